//! The control plane's part for tenants' settings and secrets
//! ([`Settings`]): named values a tenant (or the operator for it) sets for
//! all its handlers or one of them, which handlers read through
//! `wasi:config/store` without a redeploy. They live in the store (every
//! node's snapshot holds them, a change bumps the generation) and a
//! secret's value is sealed with the secrets key before it gets there,
//! opened only into a node's snapshot; no read returns it.

use std::sync::Arc;

use serde::Serialize;

use super::live::setting_context;
use super::serving::Serving;
use super::shared::Shared;
use super::store::{SettingQuota, SettingRow, StoreError, StoreResult, now};
use crate::sandbox::handler::valid_name;

/// The longest name.
const MAX_NAME_BYTES: usize = 128;

/// A setting as listed: a plain value shows, a secret only its fingerprint.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SettingInfo {
    /// The handler it is for; `None`: all the tenant's handlers.
    pub handler: Option<String>,
    /// Its name.
    pub name: String,
    /// Whether it is a secret.
    pub secret: bool,
    /// A plain value; never a secret's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// A secret's fingerprint: a short hash of its sealed bytes, new at each set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// Unix seconds of its last change.
    pub updated_at: i64,
}

/// Tenants' settings (see the module docs).
pub struct Settings {
    shared: Arc<Shared>,
    serving: Arc<Serving>,
}

impl Settings {
    pub(super) fn new(shared: Arc<Shared>, serving: Arc<Serving>) -> Self {
        Self { shared, serving }
    }

    /// Sets `tenant`'s setting `name` for `handler` (`None`: all its
    /// handlers) to `value`, sealed if `secret`; refused past the tenant's
    /// bounds or, for a secret, without a secrets key.
    pub fn set(&self, tenant: &str, handler: Option<&str>, name: &str, value: &str, secret: bool) -> StoreResult<SettingInfo> {
        let (handler, name) = (handler_of(handler)?, valid_setting_name(name)?);
        let row = SettingRow { tenant: tenant.to_owned(), handler, name, secret, updated_at: now() };
        let mut db = self.shared.db();
        let tenant_row = db.tenant(tenant)?;
        let limits = self.shared.defaults.with(&tenant_row.overrides);
        if value.len() as u64 > limits.setting_bytes {
            let message = format!("a setting's value is at most {} bytes (setting_bytes), not {}", limits.setting_bytes, value.len());
            return Err(StoreError::Quota(message));
        }
        let stored = if secret { self.seal(&row, &tenant_row.incarnation, value)? } else { value.as_bytes().to_vec() };
        let quota = SettingQuota {
            count: usize::try_from(limits.settings).unwrap_or(usize::MAX),
            bytes: usize::try_from(limits.settings_bytes).unwrap_or(usize::MAX),
        };
        db.put_setting(&row, &stored, quota)?;
        drop(db);
        self.refresh(tenant);
        tracing::info!(tenant, handler = %row.handler, name = %row.name, secret, "setting changed");
        Ok(info(row, stored))
    }

    /// Removes `tenant`'s setting `name` of `handler` (`None`: its own).
    pub fn unset(&self, tenant: &str, handler: Option<&str>, name: &str) -> StoreResult<()> {
        let (handler, name) = (handler_of(handler)?, valid_setting_name(name)?);
        self.shared.db().remove_setting(tenant, &handler, &name)?;
        self.refresh(tenant);
        tracing::info!(tenant, %handler, %name, "setting removed");
        Ok(())
    }

    /// `tenant`'s settings: plain values, secrets' names and fingerprints.
    pub fn list(&self, tenant: &str) -> StoreResult<Vec<SettingInfo>> {
        let mut db = self.shared.db();
        db.tenant(tenant)?;
        Ok(db.settings(Some(tenant))?.into_iter().map(|s| info(s.row, s.value)).collect())
    }

    /// This node's snapshot after a committed change: a failure to read it
    /// is logged (the change stands; the sync's next check brings it in).
    fn refresh(&self, tenant: &str) {
        if let Err(e) = self.serving.refresh_settings(tenant) {
            tracing::warn!(tenant, error = %e, "settings changed, this node's snapshot not refreshed yet");
        }
    }

    fn seal(&self, row: &SettingRow, incarnation: &str, value: &str) -> StoreResult<Vec<u8>> {
        let key = self.shared.secrets_key()?;
        Ok(key.seal(&setting_context((&row.tenant, incarnation), &row.handler, &row.name), value.as_bytes())?)
    }
}

/// How a setting is listed (a secret's value never).
fn info(row: SettingRow, stored: Vec<u8>) -> SettingInfo {
    let (value, fingerprint) = if row.secret {
        (None, Some(super::keys::sha256_hex(&stored)[..8].to_owned()))
    } else {
        (Some(String::from_utf8_lossy(&stored).into_owned()), None)
    };
    let handler = (!row.handler.is_empty()).then_some(row.handler);
    SettingInfo { handler, name: row.name, secret: row.secret, value, fingerprint, updated_at: row.updated_at }
}

/// The store's handler column: a valid handler name, or empty for the tenant's own.
fn handler_of(handler: Option<&str>) -> StoreResult<String> {
    match handler {
        Some(h) => valid_name(h).map_err(|e| StoreError::Invalid(e.to_string())),
        None => Ok(String::new()),
    }
}

/// A setting's name: 1 to 128 of `A-Z a-z 0-9 _ . -`.
pub fn valid_setting_name(name: &str) -> StoreResult<String> {
    let ok =
        (1..=MAX_NAME_BYTES).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(name.to_owned())
    } else {
        Err(StoreError::Invalid(format!("{name:?} is not a setting name: 1 to {MAX_NAME_BYTES} of A-Z, a-z, 0-9, '_', '.', '-'")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_listed_without_its_value_and_names_are_checked() {
        let row = |secret| SettingRow { tenant: "t".into(), handler: "detect".into(), name: "token".into(), secret, updated_at: 1 };
        let listed = info(row(true), b"sealed bytes".to_vec());
        assert_eq!((listed.value, listed.handler.as_deref()), (None, Some("detect")));
        assert_eq!(listed.fingerprint.map(|f| f.len()), Some(8));
        let plain = info(SettingRow { handler: String::new(), ..row(false) }, b"0.8".to_vec());
        assert_eq!((plain.value.as_deref(), plain.handler, plain.fingerprint), (Some("0.8"), None, None));
        assert!(valid_setting_name("min_score").is_ok() && valid_setting_name("a.b-c_D9").is_ok());
        for bad in ["", "with space", "a/b", &"x".repeat(129)] {
            assert!(valid_setting_name(bad).is_err(), "{bad:?}");
        }
    }
}
