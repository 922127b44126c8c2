-- Version 8: the path a version's guest sees (`relative` to its mount, or
-- `full`), and the operator's hostnames, each routed to a tenant's handler
-- (deleted with the tenant). Route changes bump the generation.
ALTER TABLE versions ADD COLUMN guest_path TEXT NOT NULL DEFAULT 'relative';
CREATE TABLE routes (
    hostname TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    handler TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX routes_by_tenant ON routes (tenant);
CREATE TRIGGER routes_INSERT_changed AFTER INSERT ON routes BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
CREATE TRIGGER routes_UPDATE_changed AFTER UPDATE ON routes BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
CREATE TRIGGER routes_DELETE_changed AFTER DELETE ON routes BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
