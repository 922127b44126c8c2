-- Version 9: where a version's bytes came from: `upload` (the deploy's
-- body), or the `oci://REGISTRY/REPO@sha256:…` reference a node pulled it
-- from, pinned to the manifest's digest at deploy.
ALTER TABLE versions ADD COLUMN source TEXT NOT NULL DEFAULT 'upload';
-- Tenants' registry credentials for deploys by reference: the password
-- sealed with the secrets key (control/secrets.rs), deleted with the tenant.
-- Not in the serving snapshot: no generation bump.
CREATE TABLE registry_logins (
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    registry TEXT NOT NULL,
    username TEXT NOT NULL,
    sealed BYTEA NOT NULL,
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, registry)
);
