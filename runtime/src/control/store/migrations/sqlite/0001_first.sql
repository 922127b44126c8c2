-- The first schema.
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    limits TEXT NOT NULL DEFAULT '{}',
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    secret_sha256 TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
);
CREATE TABLE IF NOT EXISTS handlers (
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    name TEXT NOT NULL,
    active_version INTEGER,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE IF NOT EXISTS versions (
    tenant TEXT NOT NULL,
    handler TEXT NOT NULL,
    version INTEGER NOT NULL,
    component_sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, handler, version),
    FOREIGN KEY (tenant, handler) REFERENCES handlers(tenant, name) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS artifacts (
    component_sha256 TEXT NOT NULL,
    engine TEXT NOT NULL,
    artifact_sha256 TEXT NOT NULL,
    PRIMARY KEY (component_sha256, engine)
);
