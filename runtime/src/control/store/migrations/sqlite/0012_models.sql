-- Version 12: the model repository. A model's bytes once per content
-- (model_blobs), its versions (each with the spec its engine read and its
-- accuracy against the reference at the time it was added) and the active
-- one. Model changes bump the generation, so every node serves the same set.
CREATE TABLE model_blobs (
    sha256 TEXT PRIMARY KEY,
    bytes BLOB NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE models (
    name TEXT PRIMARY KEY,
    active_version INTEGER
);
CREATE TABLE model_versions (
    name TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
    version INTEGER NOT NULL,
    sha256 TEXT NOT NULL REFERENCES model_blobs(sha256),
    size INTEGER NOT NULL,
    spec TEXT NOT NULL,
    accuracy TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (name, version)
);
CREATE TRIGGER models_INSERT_changed AFTER INSERT ON models BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
CREATE TRIGGER models_UPDATE_changed AFTER UPDATE ON models BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
CREATE TRIGGER models_DELETE_changed AFTER DELETE ON models BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
CREATE TRIGGER model_versions_INSERT_changed AFTER INSERT ON model_versions BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
CREATE TRIGGER model_versions_DELETE_changed AFTER DELETE ON model_versions BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
