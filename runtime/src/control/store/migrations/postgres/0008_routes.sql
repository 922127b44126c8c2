-- Version 8: the path a version's guest sees (`relative` to its mount, or
-- `full`), and the operator's hostnames, each routed to a tenant's handler
-- (deleted with the tenant). Route changes bump the generation.
ALTER TABLE versions ADD COLUMN guest_path TEXT NOT NULL DEFAULT 'relative';
CREATE TABLE routes (
    hostname TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    handler TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX routes_by_tenant ON routes (tenant);
CREATE TRIGGER routes_changed AFTER INSERT OR UPDATE OR DELETE ON routes FOR EACH STATEMENT EXECUTE FUNCTION facegate_changed();
