-- Version 10: tenants' settings and secrets, read by their handlers through
-- wasi:config/store: `handler` '' is every handler of the tenant; a
-- secret's value is sealed with the secrets key. Changes bump the
-- generation: every node's snapshot holds them.
CREATE TABLE settings (
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    handler TEXT NOT NULL,
    name TEXT NOT NULL,
    secret BOOLEAN NOT NULL,
    value BYTEA NOT NULL,
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, handler, name)
);
CREATE TRIGGER settings_changed AFTER INSERT OR UPDATE OR DELETE ON settings FOR EACH STATEMENT EXECUTE FUNCTION facegate_changed();
