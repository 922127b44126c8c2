-- Version 6: a handler's canary (see [`Canary`]).
ALTER TABLE handlers ADD COLUMN canary_version INTEGER;
ALTER TABLE handlers ADD COLUMN canary_percent INTEGER NOT NULL DEFAULT 0;
ALTER TABLE handlers ADD COLUMN canary_abort_margin REAL;
ALTER TABLE handlers ADD COLUMN canary_abort_after INTEGER;
