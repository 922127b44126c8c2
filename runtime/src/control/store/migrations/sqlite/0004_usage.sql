-- Version 4: usage, one row per node, delta, tenant, handler, version and
-- minute (see [`crate::telemetry::usage`]); kept when a tenant is deleted
-- (bills outlive tenants).
CREATE TABLE usage (
    node TEXT NOT NULL,
    seq INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    handler TEXT NOT NULL,
    version INTEGER NOT NULL,
    bucket_ms INTEGER NOT NULL,
    requests_2xx INTEGER NOT NULL,
    requests_3xx INTEGER NOT NULL,
    requests_4xx INTEGER NOT NULL,
    requests_5xx INTEGER NOT NULL,
    guest_us INTEGER NOT NULL,
    device_us INTEGER NOT NULL,
    infer_calls INTEGER NOT NULL,
    bytes_in INTEGER NOT NULL,
    bytes_out INTEGER NOT NULL,
    peak_memory_bytes INTEGER NOT NULL,
    PRIMARY KEY (node, seq, tenant, handler, version, bucket_ms)
);
CREATE INDEX usage_by_bucket ON usage (bucket_ms, tenant);
