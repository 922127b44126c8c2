-- Version 10: tenants' settings and secrets, read by their handlers through
-- wasi:config/store: `handler` '' is every handler of the tenant; a
-- secret's value is sealed with the secrets key. Changes bump the
-- generation: every node's snapshot holds them.
CREATE TABLE settings (
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    handler TEXT NOT NULL,
    name TEXT NOT NULL,
    secret INTEGER NOT NULL,
    value BLOB NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, handler, name)
);
CREATE TRIGGER settings_INSERT_changed AFTER INSERT ON settings BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
CREATE TRIGGER settings_UPDATE_changed AFTER UPDATE ON settings BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
CREATE TRIGGER settings_DELETE_changed AFTER DELETE ON settings BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;
