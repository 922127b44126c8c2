-- Version 3: a tenant's incarnation, new each time a tenant of that name
-- is created; rows from before get one of their own.
ALTER TABLE tenants ADD COLUMN incarnation TEXT NOT NULL DEFAULT '';
UPDATE tenants SET incarnation = lower(hex(randomblob(8)));
