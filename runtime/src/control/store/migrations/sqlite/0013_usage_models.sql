-- Version 13: each usage bucket's part per model: the device time and
-- inference calls of its requests that ran on each model (bills by
-- model). Written in the same transaction and under the same node and
-- delta number as the bucket's row, so also at most once.
CREATE TABLE usage_models (
    node TEXT NOT NULL,
    seq INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    handler TEXT NOT NULL,
    version INTEGER NOT NULL,
    bucket_ms INTEGER NOT NULL,
    model TEXT NOT NULL,
    device_us INTEGER NOT NULL,
    infer_calls INTEGER NOT NULL,
    PRIMARY KEY (node, seq, tenant, handler, version, bucket_ms, model)
);
CREATE INDEX usage_models_by_tenant ON usage_models (tenant, bucket_ms);
CREATE INDEX usage_models_by_bucket ON usage_models (bucket_ms, tenant);
