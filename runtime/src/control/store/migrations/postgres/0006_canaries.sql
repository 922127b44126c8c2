-- Version 6: a handler's canary (see [`Canary`]).
ALTER TABLE handlers ADD COLUMN canary_version BIGINT;
ALTER TABLE handlers ADD COLUMN canary_percent BIGINT NOT NULL DEFAULT 0;
ALTER TABLE handlers ADD COLUMN canary_abort_margin DOUBLE PRECISION;
ALTER TABLE handlers ADD COLUMN canary_abort_after BIGINT;
