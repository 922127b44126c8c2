//! The control plane's part for tenants' registry credentials
//! ([`Registries`]): a tenant (or the operator for it) keeps a user name
//! and password per registry, so a deploy by reference from its CI needs
//! no credentials of its own. The password is sealed with the secrets key
//! before it reaches the store and opened only on the node that pulls;
//! no read returns it. Deleted with the tenant.

use std::sync::Arc;

use super::secrets::SecretsKey;
use super::shared::Shared;
use super::store::{RegistryLoginRow, StoreError, StoreResult, now};

/// Registries one tenant may keep credentials for.
pub const MAX_REGISTRY_LOGINS: usize = 16;
/// The longest user name kept.
const MAX_USERNAME_BYTES: usize = 256;
/// The longest password or token kept (registry tokens run to a few KiB).
const MAX_PASSWORD_BYTES: usize = 8 << 10;

/// Tenants' registry credentials (see the module docs).
pub struct Registries {
    shared: Arc<Shared>,
}

impl Registries {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// Keeps `tenant`'s credentials for `registry` (`HOST[:PORT]`),
    /// replacing any it had; the password sealed with the secrets key.
    pub fn login(&self, tenant: &str, registry: &str, username: &str, password: &str) -> StoreResult<RegistryLoginRow> {
        let registry = crate::config::registry_name(registry).map_err(StoreError::Invalid)?;
        if username.is_empty() || username.len() > MAX_USERNAME_BYTES || password.len() > MAX_PASSWORD_BYTES {
            return Err(StoreError::Invalid(format!(
                "a registry user name is 1 to {MAX_USERNAME_BYTES} bytes, a password at most {MAX_PASSWORD_BYTES}"
            )));
        }
        let key = self.key()?;
        let mut db = self.shared.db();
        let kept = db.registry_logins(tenant)?;
        if kept.len() >= MAX_REGISTRY_LOGINS && !kept.iter().any(|r| r.registry == registry) {
            return Err(StoreError::Quota(format!("tenant {tenant:?} keeps credentials for {MAX_REGISTRY_LOGINS} registries, its most")));
        }
        let row = RegistryLoginRow { registry, username: username.to_owned(), updated_at: now() };
        let sealed = key.seal(&context(tenant, &row), password.as_bytes())?;
        db.put_registry_login(tenant, &row, &sealed)?;
        tracing::info!(tenant, registry = %row.registry, "registry credentials kept");
        Ok(row)
    }

    /// `tenant`'s registries with credentials (never the passwords).
    pub fn list(&self, tenant: &str) -> StoreResult<Vec<RegistryLoginRow>> {
        self.shared.db().registry_logins(tenant)
    }

    /// Forgets `tenant`'s credentials for `registry`.
    pub fn logout(&self, tenant: &str, registry: &str) -> StoreResult<()> {
        let registry = crate::config::registry_name(registry).map_err(StoreError::Invalid)?;
        self.shared.db().remove_registry_login(tenant, &registry)?;
        tracing::info!(tenant, %registry, "registry credentials forgotten");
        Ok(())
    }

    /// `tenant`'s user name and password for `registry`, opened, if it
    /// keeps any; an error, never garbage, when they do not open.
    pub fn credentials(&self, tenant: &str, registry: &str) -> StoreResult<Option<(String, String)>> {
        let Some((row, sealed)) = self.shared.db().registry_login(tenant, &registry.to_ascii_lowercase())? else {
            return Ok(None);
        };
        let opened = self.key()?.open(&context(tenant, &row), &sealed).map_err(|e| {
            StoreError::Conflict(format!(
                "tenant {tenant:?}'s credentials for {}: {e}; set them again, or give this node the secrets key they were kept with",
                row.registry
            ))
        })?;
        let password = String::from_utf8(opened).map_err(|_| StoreError::Conflict("stored registry credentials are not text".into()))?;
        Ok(Some((row.username, password)))
    }

    fn key(&self) -> StoreResult<&SecretsKey> {
        self.shared.secrets_key()
    }
}

/// What a password is sealed for: its tenant, registry and user name (the
/// AEAD's associated data), so a sealed value moved to another row does not open.
fn context(tenant: &str, row: &RegistryLoginRow) -> Vec<u8> {
    [b"registry-login\0", tenant.as_bytes(), b"\0", row.registry.as_bytes(), b"\0", row.username.as_bytes()].concat()
}
