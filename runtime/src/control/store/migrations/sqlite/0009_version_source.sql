-- Version 9: where a version's bytes came from: `upload` (the deploy's
-- body), or the `oci://REGISTRY/REPO@sha256:…` reference a node pulled it
-- from, pinned to the manifest's digest at deploy.
ALTER TABLE versions ADD COLUMN source TEXT NOT NULL DEFAULT 'upload';
