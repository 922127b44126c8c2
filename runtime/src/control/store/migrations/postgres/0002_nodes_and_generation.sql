-- Version 2: components precompiled by one node, for the nodes whose
-- engine matches (see [`SharedArtifact`]). Not watched: an artifact
-- changes nothing that is served.
CREATE TABLE artifacts (
    component_sha256 TEXT NOT NULL REFERENCES components(sha256) ON DELETE CASCADE,
    engine TEXT NOT NULL,
    bytes BYTEA NOT NULL,
    mac TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (component_sha256, engine)
);
