-- Version 11: handlers' state (wasi:keyvalue, crate::kv). `kv_tenants`
-- holds what each tenant's state holds (its row is the lock every write of
-- the tenant takes) and the creation of the tenant it belongs to: deleting
-- the tenant deletes its state, and a tenant created again starts empty.
-- No generation triggers: state is data, not the snapshot's.
CREATE UNIQUE INDEX tenants_incarnation ON tenants (name, incarnation);
CREATE TABLE kv_tenants (
    tenant TEXT PRIMARY KEY,
    incarnation TEXT NOT NULL,
    keys INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    FOREIGN KEY (tenant, incarnation) REFERENCES tenants (name, incarnation) ON DELETE CASCADE
);
CREATE TABLE kv (
    tenant TEXT NOT NULL REFERENCES kv_tenants (tenant) ON DELETE CASCADE,
    bucket TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    version INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, bucket, key)
);
