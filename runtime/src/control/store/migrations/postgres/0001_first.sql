-- The first schema.
CREATE TABLE tenants (
    name TEXT PRIMARY KEY,
    limits TEXT NOT NULL DEFAULT '{}',
    created_at BIGINT NOT NULL
);
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    secret_sha256 TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);
CREATE TABLE handlers (
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    name TEXT NOT NULL,
    active_version BIGINT,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE components (
    sha256 TEXT PRIMARY KEY,
    bytes BYTEA NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE TABLE versions (
    tenant TEXT NOT NULL,
    handler TEXT NOT NULL,
    version BIGINT NOT NULL,
    component_sha256 TEXT NOT NULL REFERENCES components(sha256),
    size BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, handler, version),
    FOREIGN KEY (tenant, handler) REFERENCES handlers(tenant, name) ON DELETE CASCADE
);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE nodes (id TEXT PRIMARY KEY, info TEXT NOT NULL, heartbeat_at BIGINT NOT NULL);
CREATE TABLE generation (id INT PRIMARY KEY CHECK (id = 1), n BIGINT NOT NULL);
INSERT INTO generation (id, n) VALUES (1, 0);
CREATE FUNCTION facegate_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE g BIGINT;
BEGIN
    UPDATE generation SET n = n + 1 WHERE id = 1 RETURNING n INTO g;
    PERFORM pg_notify('facegate_changes', g::text);
    RETURN NULL;
END $$;
CREATE TRIGGER tenants_changed AFTER INSERT OR UPDATE OR DELETE ON tenants FOR EACH STATEMENT EXECUTE FUNCTION facegate_changed();
CREATE TRIGGER api_keys_changed AFTER INSERT OR UPDATE OR DELETE ON api_keys FOR EACH STATEMENT EXECUTE FUNCTION facegate_changed();
CREATE TRIGGER handlers_changed AFTER INSERT OR UPDATE OR DELETE ON handlers FOR EACH STATEMENT EXECUTE FUNCTION facegate_changed();
CREATE TRIGGER versions_changed AFTER INSERT OR UPDATE OR DELETE ON versions FOR EACH STATEMENT EXECUTE FUNCTION facegate_changed();
