//! The control plane's part for tenants and their API keys ([`Tenants`]):
//! creating, changing and deleting tenants, and the keys that authenticate
//! their calls. A key change touches only the snapshot's key map.

use std::sync::Arc;

use super::api::{CreatedKey, HandlerInfo, TenantInfo};
use super::keys::{self, NewKey, Scopes};
use super::live;
use super::serving::Serving;
use super::shared::Shared;
use super::store::{self, KeyRow, Store, StoreError, StoreResult};
use crate::admission::limits::LimitOverrides;
use crate::sandbox::handler::valid_name;

/// Tenants and keys (see the module docs).
pub struct Tenants {
    shared: Arc<Shared>,
    serving: Arc<Serving>,
}

impl Tenants {
    pub(super) fn new(shared: Arc<Shared>, serving: Arc<Serving>) -> Self {
        Self { shared, serving }
    }

    /// All tenants.
    pub fn list(&self) -> StoreResult<Vec<TenantInfo>> {
        let mut db = self.shared.db();
        db.tenants()?.into_iter().map(|row| self.info(&mut **db, row)).collect()
    }

    /// One tenant.
    pub fn get(&self, name: &str) -> StoreResult<TenantInfo> {
        let mut db = self.shared.db();
        let row = db.tenant(name)?;
        self.info(&mut **db, row)
    }

    fn info(&self, db: &mut dyn Store, row: store::TenantRow) -> StoreResult<TenantInfo> {
        let handlers = db.handlers(&row.name)?.into_iter().map(|(name, active_version)| HandlerInfo { name, active_version }).collect();
        let mut limits = self.shared.defaults.with(&row.overrides);
        limits.weight = self.shared.weight(&row.name, &row.overrides);
        Ok(TenantInfo { limits, name: row.name, overrides: row.overrides, handlers, created_at: row.created_at })
    }

    /// Creates a tenant.
    pub fn create(&self, name: &str, overrides: &LimitOverrides) -> StoreResult<TenantInfo> {
        let name = valid_name(name).map_err(|e| StoreError::Invalid(e.to_string()))?;
        self.validate_limits(overrides)?;
        self.shared.db().create_tenant(&name, overrides)?;
        // The store's lock is released first: a rebuild runs on the snapshot's own connection.
        self.serving.refresh_after_commit(&name, Vec::new());
        self.get(&name)
    }

    /// Changes some of a tenant's limits (fields absent in `patch` stay).
    pub fn update_limits(&self, name: &str, patch: &LimitOverrides) -> StoreResult<TenantInfo> {
        let mut db = self.shared.db();
        let mut overrides = db.tenant(name)?.overrides;
        overrides.merge(patch);
        self.validate_limits(&overrides)?;
        db.set_limits(name, &overrides)?;
        drop(db);
        self.serving.refresh_after_commit(name, Vec::new());
        self.get(name)
    }

    fn validate_limits(&self, overrides: &LimitOverrides) -> StoreResult<()> {
        self.shared.defaults.validate(overrides).map_err(StoreError::Invalid)?;
        let concurrency = self.shared.defaults.with(overrides).max_concurrency;
        if concurrency > self.shared.max_instances {
            return Err(StoreError::Invalid(format!(
                "max_concurrency must be at most {} (the gateway's instance slots)",
                self.shared.max_instances
            )));
        }
        Ok(())
    }

    /// Deletes a tenant, its keys and handlers; its requests in flight finish.
    pub fn delete(&self, name: &str) -> StoreResult<()> {
        self.shared.db().delete_tenant(name)?;
        self.serving.refresh_after_commit(name, Vec::new());
        Ok(())
    }

    /// Creates an API key of `scopes` for `tenant`, unless it has
    /// `max_keys` unrevoked keys already (403 `quota_exceeded`, counted in
    /// the store's transaction). The snapshot gains the key, and nothing
    /// else is rebuilt, after the store's lock is released.
    pub fn create_key(&self, tenant: &str, scopes: Scopes) -> StoreResult<CreatedKey> {
        let NewKey { id, key, secret_sha256 } = keys::generate()?;
        let digest = keys::digest_from_hex(&secret_sha256)
            .ok_or_else(|| StoreError::Internal(anyhow::anyhow!("a new key's digest is not 64 hex digits")))?;
        let mut db = self.shared.db();
        let max_keys = self.shared.defaults.with(&db.tenant(tenant)?.overrides).max_keys;
        let commit = db.insert_key(tenant, &id, &secret_sha256, scopes, max_keys)?;
        let active = Arc::new(live::ActiveKey { tenant: tenant.to_owned(), secret_sha256: digest, scopes });
        self.serving.change_keys(db, commit.generation, |keys| {
            keys.insert(Arc::from(id.as_str()), active);
        });
        Ok(CreatedKey { tenant: tenant.to_owned(), id, key, created_at: commit.at, scopes })
    }

    /// A tenant's keys (ids and dates only).
    pub fn keys(&self, tenant: &str) -> StoreResult<Vec<KeyRow>> {
        self.shared.db().keys(tenant)
    }

    /// Revokes a key; requests with it are refused from now on (on this
    /// node before this returns; on the others at their next sync). Only
    /// the snapshot's key map changes, after the store's lock is released.
    pub fn revoke_key(&self, tenant: &str, id: &str) -> StoreResult<()> {
        let mut db = self.shared.db();
        let commit = db.revoke_key(tenant, id)?;
        self.serving.change_keys(db, commit.generation, |keys| {
            keys.remove(id);
        });
        Ok(())
    }
}
