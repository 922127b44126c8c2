-- Version 2: precompiled artifacts become a per-node cache (files only);
-- nodes report heartbeats; a generation counter that triggers bump on
-- every change other nodes (or processes) must see.
DROP TABLE IF EXISTS artifacts;
CREATE TABLE nodes (
    id TEXT PRIMARY KEY,
    info TEXT NOT NULL,
    heartbeat_at INTEGER NOT NULL
);
CREATE TABLE generation (id INTEGER PRIMARY KEY CHECK (id = 1), n INTEGER NOT NULL);
INSERT INTO generation (id, n) VALUES (1, 0);
