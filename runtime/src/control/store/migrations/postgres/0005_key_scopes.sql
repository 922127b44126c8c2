-- Version 5: a key's scopes (see [`Scopes`]); keys from before invoke.
ALTER TABLE api_keys ADD COLUMN scopes TEXT NOT NULL DEFAULT 'invoke';
