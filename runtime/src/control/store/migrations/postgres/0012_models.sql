-- Version 12: the model repository. A model's bytes once per content
-- (model_blobs), its versions (each with the spec its engine read and its
-- accuracy against the reference at the time it was added) and the active
-- one. Model changes bump the generation, so every node serves the same set.
CREATE TABLE model_blobs (
    sha256 TEXT PRIMARY KEY,
    bytes BYTEA NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE TABLE models (
    name TEXT PRIMARY KEY,
    active_version BIGINT
);
CREATE TABLE model_versions (
    name TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
    version BIGINT NOT NULL,
    sha256 TEXT NOT NULL REFERENCES model_blobs(sha256),
    size BIGINT NOT NULL,
    spec TEXT NOT NULL,
    accuracy TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (name, version)
);
CREATE TRIGGER models_changed AFTER INSERT OR UPDATE OR DELETE ON models FOR EACH STATEMENT EXECUTE FUNCTION facegate_changed();
CREATE TRIGGER model_versions_changed AFTER INSERT OR UPDATE OR DELETE ON model_versions FOR EACH STATEMENT EXECUTE FUNCTION facegate_changed();
