-- Version 3: a tenant's incarnation, new each time a tenant of that name
-- is created. The default is random too, evaluated per row: rows from
-- before get one of their own, and so do tenants that a node still
-- running an older facegate creates during a rolling upgrade.
ALTER TABLE tenants ADD COLUMN incarnation TEXT NOT NULL DEFAULT substr(md5(random()::text || clock_timestamp()::text), 1, 16);
