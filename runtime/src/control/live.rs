//! The snapshot the data plane reads ([`Live`]): tenants with their
//! admission gates and active handlers, and the active API keys. Built by
//! `ControlPlane::refresh` and swapped in whole; never changed in place.

use std::collections::HashMap;
use std::sync::Arc;

use super::keys;
use super::limits::{ConcurrencyGate, TenantLimits, TokenBucket};
use crate::handlers::Handler;

/// A tenant's admission state: limits, rate bucket, concurrency slots.
/// Kept across snapshots while the limits do not change.
pub struct TenantGate {
    /// Effective limits.
    pub limits: TenantLimits,
    /// Requests-per-second bucket.
    pub rate: Arc<TokenBucket>,
    /// Concurrent-request slots.
    pub concurrency: Arc<ConcurrencyGate>,
}

/// One tenant in the live snapshot.
pub struct TenantEntry {
    /// Which creation of a tenant of this name (see `store::new_incarnation`).
    pub incarnation: String,
    /// Admission state.
    pub gate: Arc<TenantGate>,
    /// Active handler versions by name.
    pub handlers: HashMap<String, Arc<Handler>>,
}

pub(super) struct ActiveKey {
    pub(super) tenant: String,
    pub(super) secret_sha256: [u8; 32],
}

/// What the data plane serves: an immutable snapshot, swapped on change.
#[derive(Default)]
pub struct Live {
    /// Tenants by name.
    pub tenants: HashMap<String, TenantEntry>,
    pub(super) keys: HashMap<String, ActiveKey>,
}

/// Compared against when a key id is unknown, so both paths hash once.
const DUMMY_SECRET: [u8; 32] = [0; 32];

impl Live {
    /// The tenant a bearer key belongs to; `None` if missing, malformed,
    /// unknown or revoked. Never looks at the tenant in the request path,
    /// so its timing says nothing about which tenants exist.
    pub fn authenticate(&self, bearer: Option<&str>) -> Option<&str> {
        let (id, secret) = bearer.and_then(keys::parse).unwrap_or(("", ""));
        match self.keys.get(id) {
            Some(key) => keys::secret_matches(secret, &key.secret_sha256).then_some(key.tenant.as_str()),
            None => {
                let _ = keys::secret_matches(secret, &DUMMY_SECRET);
                None
            }
        }
    }

    /// A tenant's active handler with the tenant's gate.
    pub fn handler(&self, tenant: &str, name: &str) -> Option<(&Arc<TenantGate>, &Arc<Handler>)> {
        let entry = self.tenants.get(tenant)?;
        Some((&entry.gate, entry.handlers.get(name)?))
    }

    /// Handlers served, all tenants.
    pub fn handler_count(&self) -> usize {
        self.tenants.values().map(|t| t.handlers.len()).sum()
    }
}

/// A gate for `limits`. An existing tenant keeps its bucket and slots,
/// resized in place: a limit change neither refills the bucket nor lets the
/// tenant run its old and new concurrency at once.
pub(super) fn new_gate(limits: TenantLimits, old: Option<&TenantGate>) -> TenantGate {
    let Some(old) = old else {
        let rate = Arc::new(TokenBucket::new(limits.rps, limits.burst));
        let concurrency = Arc::new(ConcurrencyGate::new(limits.max_concurrency));
        return TenantGate { rate, concurrency, limits };
    };
    old.rate.reconfigure(limits.rps, limits.burst);
    old.concurrency.resize(limits.max_concurrency);
    TenantGate { rate: Arc::clone(&old.rate), concurrency: Arc::clone(&old.concurrency), limits }
}
