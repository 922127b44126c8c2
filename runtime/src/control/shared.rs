//! What every part of the control plane shares: the store's connections and
//! this node's settings. Nothing here changes after the node starts, but
//! the store connections' contents; each part holds an `Arc` of it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use super::blobs::ArtifactCache;
use super::seal::ArtifactKey;
use super::store::{Store, StoreError, StoreResult};
use crate::admission::limits::{LimitOverrides, TenantLimits};
use crate::sandbox::Sandbox;
use crate::sandbox::compile::{CompileError, CompilePool};
use crate::telemetry::TenantCounters;
use facegate_host_gpu::Models;

/// One store connection behind a lock of its own.
pub(super) struct Connection(Mutex<Box<dyn Store>>);

impl Connection {
    pub(super) fn new(store: Box<dyn Store>) -> Self {
        Self(Mutex::new(store))
    }

    /// The connection, for one operation: hold it no longer.
    pub(super) fn lock(&self) -> MutexGuard<'_, Box<dyn Store>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The node's settings and store connections (see the module docs).
pub(super) struct Shared {
    /// This node's files (artifact cache, key files).
    pub data_dir: PathBuf,
    /// The store: the connection changes and the snapshot's reads use.
    pub db: Connection,
    /// The background compiler's own connection for its bulk reads and
    /// writes (an 18 MB component, a 38 MB artifact); `None` shares `db`.
    pub compile_db: Option<Connection>,
    /// The snapshot's own connection, for its rebuilds and the sync's
    /// generation checks: a rebuild never holds the lock that changes, a
    /// tenant's reads or a compile take; `None` shares `db`.
    pub serving_db: Option<Connection>,
    /// The store, for logs (no password).
    pub described: String,
    pub sandbox: Arc<Sandbox>,
    pub models: Models,
    /// Names this engine's artifacts (see [`super::artifacts::engine_id`]).
    pub engine_id: String,
    /// The tenants' default limits.
    pub defaults: TenantLimits,
    /// The gateway's instance slots.
    pub max_instances: u32,
    /// `--tenant-weight`.
    pub weights: HashMap<String, u32>,
    /// Per-tenant counters outside the batchers, told when a tenant goes.
    pub counters: Vec<Arc<dyn TenantCounters>>,
    /// The pipeline component linked into handlers that import it.
    pub pipeline: Option<Arc<[u8]>>,
    /// Seals the artifacts shared with the other nodes; `None` shares none.
    pub artifact_key: Option<ArtifactKey>,
    /// Seals tenants' secrets in the store; `None` keeps none.
    pub secrets_key: Option<super::secrets::SecretsKey>,
    /// This node's compiled artifacts.
    pub cache: ArtifactCache,
    /// Where compiles run, under their budget.
    pub compile: CompilePool,
    /// What this node serves of the model repository.
    pub repository: super::opener::RepositoryServing,
}

impl Shared {
    /// The key tenants' secrets are sealed with; a clear refusal on nodes
    /// that share a store and were given none (each would seal its own).
    pub fn secrets_key(&self) -> StoreResult<&super::secrets::SecretsKey> {
        self.secrets_key.as_ref().ok_or_else(|| {
            StoreError::Conflict(
                "this gateway keeps no secrets: its nodes share a store and were given no secrets key \
                 (set FACEGATE_SECRETS_KEY or --secrets-key-file, the same on every node)"
                    .into(),
            )
        })
    }

    /// The store's main connection.
    pub fn db(&self) -> MutexGuard<'_, Box<dyn Store>> {
        self.db.lock()
    }

    /// The snapshot's connection: its own where it has one.
    pub fn serving_db(&self) -> MutexGuard<'_, Box<dyn Store>> {
        self.serving_db.as_ref().unwrap_or(&self.db).lock()
    }

    /// The background compiler's connection: its own where it has one.
    pub fn compile_db(&self) -> MutexGuard<'_, Box<dyn Store>> {
        self.compile_db.as_ref().unwrap_or(&self.db).lock()
    }

    /// A tenant's weight, from one rule: its override, else `--tenant-weight`, else the default.
    pub fn weight(&self, tenant: &str, overrides: &LimitOverrides) -> u32 {
        overrides.weight.or_else(|| self.weights.get(tenant).copied()).unwrap_or(self.defaults.weight)
    }
}

/// A memory-budget refusal as the store's error: 503 `overloaded`, retry shortly.
pub(super) fn no_memory(refusal: crate::admission::memory::Refusal) -> StoreError {
    StoreError::NoMemory(format!("{refusal}: the upload does not fit now; retry shortly"))
}

/// A compile-pool refusal as the store's error: busy or too slow is 503
/// `busy` (retry shortly), a failed pool an internal error.
pub(super) fn compile_refusal(e: CompileError) -> StoreError {
    match e {
        CompileError::TooSlow(_) | CompileError::Busy => StoreError::Busy(e.to_string()),
        CompileError::Failed => StoreError::Internal(anyhow::anyhow!(e)),
    }
}
