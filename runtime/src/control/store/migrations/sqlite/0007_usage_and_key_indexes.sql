-- Version 7: a tenant's usage report reads its rows by tenant and time,
-- and a key's creation counts the tenant's unrevoked keys (`max_keys`).
CREATE INDEX usage_by_tenant ON usage (tenant, bucket_ms);
CREATE INDEX api_keys_by_tenant ON api_keys (tenant, revoked_at);
