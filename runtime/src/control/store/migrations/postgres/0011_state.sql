-- Version 11: handlers' state (wasi:keyvalue, crate::kv). `kv_tenants`
-- holds what each tenant's state holds (its row is the lock every write of
-- the tenant takes) and the creation of the tenant it belongs to: deleting
-- the tenant deletes its state, and a tenant created again starts empty.
-- No generation triggers: state is data, not the snapshot's.
ALTER TABLE tenants ADD CONSTRAINT tenants_incarnation UNIQUE (name, incarnation);
CREATE TABLE kv_tenants (
    tenant TEXT PRIMARY KEY,
    incarnation TEXT NOT NULL,
    keys BIGINT NOT NULL,
    bytes BIGINT NOT NULL,
    FOREIGN KEY (tenant, incarnation) REFERENCES tenants (name, incarnation) ON DELETE CASCADE
);
CREATE TABLE kv (
    tenant TEXT NOT NULL REFERENCES kv_tenants (tenant) ON DELETE CASCADE,
    -- Byte order, as SQLite's: the primary key serves listings by cursor.
    bucket TEXT COLLATE "C" NOT NULL,
    key TEXT COLLATE "C" NOT NULL,
    value BYTEA NOT NULL,
    version BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, bucket, key)
);
