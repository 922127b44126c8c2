-- Version 4: usage, one row per node, delta, tenant, handler, version and
-- minute (see [`crate::telemetry::usage`]); kept when a tenant is deleted
-- (bills outlive tenants). Not watched: usage changes nothing served.
CREATE TABLE usage (
    node TEXT NOT NULL,
    seq BIGINT NOT NULL,
    tenant TEXT NOT NULL,
    handler TEXT NOT NULL,
    version BIGINT NOT NULL,
    bucket_ms BIGINT NOT NULL,
    requests_2xx BIGINT NOT NULL,
    requests_3xx BIGINT NOT NULL,
    requests_4xx BIGINT NOT NULL,
    requests_5xx BIGINT NOT NULL,
    guest_us BIGINT NOT NULL,
    device_us BIGINT NOT NULL,
    infer_calls BIGINT NOT NULL,
    bytes_in BIGINT NOT NULL,
    bytes_out BIGINT NOT NULL,
    peak_memory_bytes BIGINT NOT NULL,
    PRIMARY KEY (node, seq, tenant, handler, version, bucket_ms)
);
CREATE INDEX usage_by_bucket ON usage (bucket_ms, tenant);
