//! The control plane: tenants, API keys, handler versions and per-tenant
//! limits, kept in a [`store`] (SQLite in the data directory, or PostgreSQL
//! shared by a cluster of nodes), and the in-memory snapshot ([`Live`]) the
//! data plane reads. Every change builds a new snapshot and swaps it in:
//! requests in flight keep the `Arc<Handler>` they started with (hot swap),
//! new requests see the new one, and the inference engines are never
//! touched. Changes made through other nodes arrive through [`sync`]: the
//! store's generation moved, so the snapshot is rebuilt. The data plane
//! never waits for the store: without it, a node serves its last snapshot.

mod api;
pub mod blobs;
mod components;
pub mod compose;
pub mod keys;
mod live;
mod seal;
mod seed;
mod snapshot;
pub mod store;
pub mod sync;
mod upload;
pub mod usage;
pub mod validate;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use self::blobs::{ArtifactCache, Blobs};
use self::components::Compile;
use bytes::Bytes;

use self::keys::{NewKey, Scopes};
use self::store::{AbortRule, ActiveHandler, Canary, KeyRow, NewVersion, NodeRow, Store, StoreError, StoreResult};
use self::upload::Upload;
pub use self::upload::{Change, ChangePlace, UploadHold};
use crate::admission::limits::{LimitOverrides, TenantLimits};
use crate::telemetry::TenantCounters;
use crate::sandbox::Sandbox;
use crate::sandbox::compile::{CompileError, CompilePool};
use crate::sandbox::handler::valid_name;
use facegate_host_gpu::Models;

pub use self::api::{Activated, CheckReport, CreatedKey, Deployed, HandlerInfo, SeededKey, TenantInfo, VersionsInfo};
pub use self::components::engine_id;
pub use self::live::{CanaryCounts, Live, LiveCanary, Side, TenantEntry};
pub use self::seal::{ArtifactKey, CACHE_KEY_FILE, CacheKey};
pub use self::seed::write_secret;
pub use self::snapshot::Synced;

/// How the control plane is set up.
pub struct ControlSettings {
    /// The tenants' default limits.
    pub defaults: TenantLimits,
    /// The gateway's instance slots: no tenant may have more concurrent requests.
    pub max_instances: u32,
    /// Where uploads compile.
    pub compile: CompilePool,
    /// `--tenant-weight`: weights of tenants that have no weight override.
    pub weights: HashMap<String, u32>,
    /// Per-tenant counters outside the batchers, told when a tenant is deleted.
    pub counters: Vec<Arc<dyn TenantCounters>>,
    /// The pipeline component (`--pipeline-component`), linked into handlers that import it.
    pub pipeline: Option<Arc<[u8]>>,
    /// Signs the artifacts this node shares with the other nodes of a
    /// cluster and checks theirs (from `--artifact-key`); `None` shares none.
    pub artifact_key: Option<ArtifactKey>,
    /// Seals this node's artifact cache (derived from `--artifact-key`);
    /// `None`: a random key kept in the data directory ([`CACHE_KEY_FILE`]).
    pub cache_key: Option<CacheKey>,
    /// A second connection to the same store for the background compiler's
    /// bulk reads and writes (an 18 MB component, a 38 MB artifact), so the
    /// sync never waits behind them for the store; `None` shares the main one.
    pub compile_store: Option<Box<dyn Store>>,
}

/// The control plane (see the module docs).
pub struct ControlPlane {
    data_dir: PathBuf,
    db: Mutex<Box<dyn Store>>,
    /// The compiler's own connection ([`ControlSettings::compile_store`]).
    compile_db: Option<Mutex<Box<dyn Store>>>,
    described: String,
    /// Store generation the snapshot was built at.
    generation: AtomicI64,
    /// Unix ms when the snapshot was last known current (built, or the generation checked).
    synced_at_ms: AtomicI64,
    /// A component the snapshot waited for has been compiled: the next sync rebuilds it.
    recheck: AtomicBool,
    cache: ArtifactCache,
    sandbox: Arc<Sandbox>,
    models: Models,
    engine_id: String,
    defaults: TenantLimits,
    max_instances: u32,
    compile: CompilePool,
    weights: HashMap<String, u32>,
    counters: Vec<Arc<dyn TenantCounters>>,
    pipeline: Option<Arc<[u8]>>,
    artifact_key: Option<ArtifactKey>,
    live: RwLock<Arc<Live>>,
    /// Held by every swap of `live`, taken under `db` (see `change_keys`).
    swap: Mutex<()>,
    /// Live nodes of the cluster (this one included), from the heartbeats:
    /// each enforces its share of a tenant's rate and concurrency.
    nodes: AtomicUsize,
    /// Whose heartbeats advance (see [`live::NodeWatch`]).
    node_watch: Mutex<live::NodeWatch>,
    /// Their rows, as [`Self::live_nodes`] counted them.
    alive_nodes: RwLock<Arc<[NodeRow]>>,
    /// What this node's requests used, until written (see [`usage`]).
    meter: Arc<crate::telemetry::usage::Meter>,
    /// Tenants with a change in progress here (one each at a time).
    changes: upload::Changes,
}

impl ControlPlane {
    /// Takes the opened `store` (see [`store::open`]), with `data_dir` for
    /// this node's files (artifact cache, key files), and loads every active handler.
    pub fn open(
        store: Box<dyn Store>,
        data_dir: &Path,
        sandbox: Arc<Sandbox>,
        models: Models,
        settings: ControlSettings,
    ) -> anyhow::Result<Self> {
        let ControlSettings { defaults, max_instances, compile, weights, counters, pipeline, artifact_key, cache_key, compile_store } =
            settings;
        blobs::prepare_data_dir(data_dir)?;
        if let Err(e) = validate_defaults(&defaults, max_instances) {
            anyhow::bail!(
                "the tenants' default limits (--memory-limit-mib, --request-timeout-ms, --tenant-max-concurrency, \
                 --tenant-rps, --tenant-burst, --max-body-bytes, --max-response-bytes, --max-infer-calls, \
                 --instance-reuse flags) are invalid: {e}"
            );
        }
        let cache_key = match cache_key {
            Some(key) => key,
            None => CacheKey::in_data_dir(data_dir)?,
        };
        let cache = ArtifactCache::new(Blobs::open(data_dir)?, cache_key);
        let leftovers = cache.blobs().clear_tmp()?;
        if leftovers > 0 {
            tracing::warn!(files = leftovers, "removed files of interrupted uploads");
        }
        let engine_id = engine_id(sandbox.engine());
        let control = Self {
            data_dir: data_dir.to_owned(),
            described: store.describe(),
            db: Mutex::new(store),
            compile_db: compile_store.map(Mutex::new),
            generation: AtomicI64::new(-1),
            synced_at_ms: AtomicI64::new(0),
            recheck: AtomicBool::new(false),
            cache,
            sandbox,
            models,
            engine_id,
            defaults,
            max_instances,
            compile,
            weights,
            counters,
            pipeline,
            artifact_key,
            live: RwLock::new(Arc::new(Live::default())),
            swap: Mutex::new(()),
            nodes: AtomicUsize::new(1),
            node_watch: Mutex::default(),
            alive_nodes: RwLock::new(Arc::from(Vec::new())),
            // A restarted node writes under a new name: its numbers start again.
            meter: crate::telemetry::usage::Meter::new(store::new_incarnation()?),
            changes: upload::Changes::default(),
        };
        control.refresh(&mut **control.db(), Vec::new(), Compile::Now)?;
        Ok(control)
    }

    /// The store, for logs (no password).
    pub fn store_name(&self) -> &str {
        &self.described
    }

    /// A listener for change announcements, if the store has them; it
    /// connects after the store's lock is released.
    pub fn store_listener(&self) -> Option<anyhow::Result<Box<dyn store::Listener>>> {
        let source = self.db().listener()?;
        Some(source())
    }

    /// Records this node's heartbeat; forgets nodes silent for an hour.
    pub fn heartbeat(&self, node: &NodeRow) -> StoreResult<()> {
        let mut db = self.db();
        db.heartbeat(node)?;
        db.remove_nodes("", node.heartbeat_at - 3_600_000)
    }

    /// Removes this node's row (it stops cleanly).
    pub fn deregister(&self, id: &str) -> StoreResult<()> {
        self.db().remove_nodes(id, 0)
    }

    /// Every node that reported, by id.
    pub fn nodes(&self) -> StoreResult<Vec<NodeRow>> {
        self.db().nodes()
    }

    fn db(&self) -> MutexGuard<'_, Box<dyn Store>> {
        self.db.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The background compiler's connection: its own where it has one.
    fn compile_db(&self) -> MutexGuard<'_, Box<dyn Store>> {
        match &self.compile_db {
            Some(db) => db.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
            None => self.db(),
        }
    }

    /// All tenants.
    pub fn tenants(&self) -> StoreResult<Vec<TenantInfo>> {
        let mut db = self.db();
        db.tenants()?.into_iter().map(|row| self.tenant_info(&mut **db, row)).collect()
    }

    /// One tenant.
    pub fn tenant(&self, name: &str) -> StoreResult<TenantInfo> {
        let mut db = self.db();
        let row = db.tenant(name)?;
        self.tenant_info(&mut **db, row)
    }

    fn tenant_info(&self, db: &mut dyn Store, row: store::TenantRow) -> StoreResult<TenantInfo> {
        let handlers = db.handlers(&row.name)?.into_iter().map(|(name, active_version)| HandlerInfo { name, active_version }).collect();
        let mut limits = self.defaults.with(&row.overrides);
        limits.weight = self.weight(&row.name, &row.overrides);
        Ok(TenantInfo { limits, name: row.name, overrides: row.overrides, handlers, created_at: row.created_at })
    }

    /// Creates a tenant.
    pub fn create_tenant(&self, name: &str, overrides: &LimitOverrides) -> StoreResult<TenantInfo> {
        let name = valid_name(name).map_err(|e| StoreError::Invalid(e.to_string()))?;
        self.validate_limits(overrides)?;
        let mut db = self.db();
        db.create_tenant(&name, overrides)?;
        self.refresh_after_commit(&mut **db, Vec::new());
        let row = db.tenant(&name)?;
        self.tenant_info(&mut **db, row)
    }

    /// Changes some of a tenant's limits (fields absent in `patch` stay).
    pub fn update_limits(&self, name: &str, patch: &LimitOverrides) -> StoreResult<TenantInfo> {
        let mut db = self.db();
        let mut overrides = db.tenant(name)?.overrides;
        overrides.merge(patch);
        self.validate_limits(&overrides)?;
        db.set_limits(name, &overrides)?;
        self.refresh_after_commit(&mut **db, Vec::new());
        let row = db.tenant(name)?;
        self.tenant_info(&mut **db, row)
    }

    fn validate_limits(&self, overrides: &LimitOverrides) -> StoreResult<()> {
        self.defaults.validate(overrides).map_err(StoreError::Invalid)?;
        let concurrency = self.defaults.with(overrides).max_concurrency;
        if concurrency > self.max_instances {
            return Err(StoreError::Invalid(format!(
                "max_concurrency must be at most {} (the gateway's instance slots)",
                self.max_instances
            )));
        }
        Ok(())
    }

    /// Deletes a tenant, its keys and handlers; its requests in flight finish.
    pub fn delete_tenant(&self, name: &str) -> StoreResult<()> {
        let mut db = self.db();
        db.delete_tenant(name)?;
        self.refresh_after_commit(&mut **db, Vec::new());
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
        let mut db = self.db();
        let max_keys = self.defaults.with(&db.tenant(tenant)?.overrides).max_keys;
        let commit = db.insert_key(tenant, &id, &secret_sha256, scopes, max_keys)?;
        let active = Arc::new(live::ActiveKey { tenant: tenant.to_owned(), secret_sha256: digest, scopes });
        self.change_keys(db, commit.generation, |keys| {
            keys.insert(Arc::from(id.as_str()), active);
        });
        Ok(CreatedKey { tenant: tenant.to_owned(), id, key, created_at: commit.at, scopes })
    }

    /// A tenant's keys (ids and dates only).
    pub fn keys(&self, tenant: &str) -> StoreResult<Vec<KeyRow>> {
        self.db().keys(tenant)
    }

    /// Revokes a key; requests with it are refused from now on (on this
    /// node before this returns; on the others at their next sync). Only
    /// the snapshot's key map changes, after the store's lock is released.
    pub fn revoke_key(&self, tenant: &str, id: &str) -> StoreResult<()> {
        let mut db = self.db();
        let commit = db.revoke_key(tenant, id)?;
        self.change_keys(db, commit.generation, |keys| {
            keys.remove(id);
        });
        Ok(())
    }

    /// Deletes a handler's versions past the tenant's `max_versions` (see
    /// [`Store::prune_versions`]) and this node's cached artifacts of the
    /// components they freed. The upload is stored either way: a failure
    /// here is logged, and the next upload prunes again.
    fn prune(&self, db: &mut dyn Store, (tenant, handler): (&str, &str), max_versions: u32) {
        match db.prune_versions(tenant, handler, max_versions as usize) {
            Ok(pruned) if !pruned.versions.is_empty() => {
                for sha in &pruned.components {
                    self.cache.discard(sha, &self.engine_id);
                }
                tracing::info!(tenant, handler, versions = ?pruned.versions, components = pruned.components.len(), max_versions, "old versions deleted");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(tenant, handler, error = %e, "old versions not deleted"),
        }
    }

    /// Whether uploads are refused as busy now (see [`CompilePool::is_full`]).
    pub fn uploads_busy(&self) -> bool {
        self.compile.is_full()
    }

    /// `tenant`'s one change place on this node (see [`Change`]), taken by
    /// the APIs before they read a change's body; refused 429 while the
    /// tenant has another change in progress here.
    pub fn begin_change(&self, tenant: &str, change: Change) -> StoreResult<ChangePlace> {
        self.changes.begin(tenant, change)
    }

    /// Validates, compiles and stores a new version of a handler; activates it if asked.
    /// The heavy part runs on the compile pool (see `upload`), under its budget.
    /// Takes the upload's buffer as it arrived: it moves to the compile thread without a copy.
    /// For callers that hold nothing yet (seeding): the tenant's place and
    /// the body's charge are taken here.
    pub fn deploy(&self, tenant: &str, handler: &str, bytes: Bytes, activate: bool) -> StoreResult<Deployed> {
        let place = self.begin_change(tenant, Change::Upload)?;
        let memory = self.sandbox.memory().charge(&Arc::from(tenant), bytes.len()).map_err(no_memory)?;
        self.release(tenant, handler, bytes, (if activate { Release::Activate } else { Release::Store }, UploadHold { place, memory }))
    }

    /// Stores `bytes` as a new version of `tenant`'s `handler` and releases
    /// it as `release` says: active, stored only, or a canary beside the
    /// active version (which there must be). `hold` is what the upload
    /// holds already (its tenant's place, its body's memory charge): the
    /// charge grows to the compile's estimate before it starts, and both go
    /// with the compile job.
    pub fn release(&self, tenant: &str, handler: &str, bytes: Bytes, (release, mut hold): (Release, UploadHold)) -> StoreResult<Deployed> {
        if hold.place.tenant() != tenant {
            return Err(StoreError::Internal(anyhow::anyhow!("an upload of {tenant:?} came with {:?}'s place", hold.place.tenant())));
        }
        let activate = release == Release::Activate;
        if let Release::Canary { percent, .. } = release
            && !(1..=99).contains(&percent)
        {
            return Err(StoreError::Invalid(format!("a canary takes 1 to 99 percent of the requests, not {percent}")));
        }
        let handler = valid_name(handler).map_err(|e| StoreError::Invalid(e.to_string()))?;
        if matches!(release, Release::Canary { .. }) && self.live().handler(tenant, &handler).is_none() {
            return Err(StoreError::Invalid(format!(
                "{tenant}/{handler} has no active version for a canary to run beside; deploy it first"
            )));
        }
        let limits = {
            let live = self.live();
            let entry = live.tenants.get(tenant).ok_or_else(|| StoreError::NotFound(format!("no tenant {tenant:?}")))?;
            entry.gate.limits
        };
        let outgoing_http = limits.outgoing_http;
        validate::check_header(&bytes).map_err(StoreError::Invalid)?;
        let imports_pipeline = validate::check_interface(&bytes).map_err(StoreError::Invalid)?;
        check_handler_quota(&mut **self.db(), tenant, &handler, limits.max_handlers)?;
        let pipeline = imports_pipeline.then(|| self.pipeline.as_ref().map_or(0, |p| p.len()));
        hold.memory.resize(crate::sandbox::compile::upload_memory_estimate(bytes.len(), pipeline)).map_err(no_memory)?;
        let upload = Upload {
            sandbox: Arc::clone(&self.sandbox),
            cache: self.cache.clone(),
            engine_id: self.engine_id.clone(),
            tenant: tenant.to_owned(),
            handler: handler.clone(),
            outgoing_http,
            bytes,
            imports_pipeline,
            pipeline: self.pipeline.clone(),
            artifact_key: self.artifact_key.clone(),
        };
        // The hold goes with the job: a compile past the budget keeps the
        // tenant's place and its charge until it ends.
        let (prepared, mut hold) = self.compile.run(move || (upload.prepare(), hold)).map_err(compile_refusal)?;
        let prepared = prepared?;
        // From here on the upload holds what is stored, its component (a
        // charge that shrinks is never refused).
        let _ = hold.memory.resize(prepared.component.len());
        // A grant changed while this compiled: the refresh links it anew (see `refresh`).
        let mut db = self.db();
        // Again under the store's lock: another upload may have added a handler meanwhile.
        check_handler_quota(&mut **db, tenant, &handler, limits.max_handlers)?;
        let (sha256, component) = (prepared.sha256, prepared.component);
        let artifact = prepared.shared.as_ref();
        let version =
            db.add_version(NewVersion { tenant, handler: &handler, sha256: &sha256, component: &component, activate, artifact })?;
        let mut linked = prepared.linked;
        linked.version = version;
        if let Release::Canary { percent, abort } = release {
            db.set_canary(tenant, &handler, Some(Canary { version, percent, abort }))?;
        }
        self.prune(&mut **db, (tenant, &handler), limits.max_versions);
        // Matched by version: served only if active, or the canary.
        let preloaded = vec![Arc::new(linked)];
        self.refresh_after_commit(&mut **db, preloaded);
        // Stored: what is active follows from the upload (no second read that could fail now).
        let active_version = if activate { Some(version) } else { db.versions(tenant, &handler).map(|v| v.1).unwrap_or(None) };
        tracing::info!(tenant, handler, version, %sha256, activate, "handler version stored");
        Ok(Deployed { tenant: tenant.to_owned(), handler, version, sha256, size: component.len(), active_version })
    }

    /// A handler's versions.
    pub fn versions(&self, tenant: &str, handler: &str) -> StoreResult<VersionsInfo> {
        let mut db = self.db();
        let (versions, active_version) = db.versions(tenant, handler)?;
        let canary = db.canary(tenant, handler)?;
        Ok(VersionsInfo { tenant: tenant.to_owned(), handler: handler.to_owned(), active_version, versions, canary })
    }

    /// Makes a handler's canary its active version, and ends the canary.
    /// The canary is looked at again just before the switch: one aborted
    /// (or replaced) meanwhile is not promoted.
    pub fn promote(&self, tenant: &str, handler: &str) -> StoreResult<Activated> {
        let no_canary = || StoreError::NotFound(format!("{tenant}/{handler} has no canary"));
        let canary = self.db().canary(tenant, handler)?.ok_or_else(no_canary)?;
        let row = self.version_row(&mut **self.db(), tenant, handler, canary.version)?;
        let still = |db: &mut dyn Store| match db.canary(tenant, handler)? {
            Some(now) if now.version == canary.version => Ok(()),
            _ => Err(StoreError::Conflict(format!("{tenant}/{handler}'s canary (version {}) ended meanwhile", canary.version))),
        };
        let activated = self.activate_compiled_if(tenant, handler, &row, still)?;
        tracing::info!(tenant, handler, version = canary.version, "canary promoted");
        Ok(activated)
    }

    /// Ends a handler's canary: all its requests go to the active version
    /// again. With `only`, only if the canary is still that version (a
    /// node's automatic abort must not end a newer canary). Returns the
    /// canary ended.
    pub fn abort_canary(&self, tenant: &str, handler: &str, only: Option<i64>) -> StoreResult<Canary> {
        let mut db = self.db();
        let canary = db.canary(tenant, handler)?.filter(|c| only.is_none_or(|v| v == c.version));
        let canary = canary.ok_or_else(|| StoreError::NotFound(format!("{tenant}/{handler} has no canary")))?;
        db.set_canary(tenant, handler, None)?;
        self.refresh_after_commit(&mut **db, Vec::new());
        tracing::info!(tenant, handler, version = canary.version, "canary ended");
        Ok(canary)
    }

    /// Makes `version` active. It is loaded before the switch: if it cannot
    /// be served, nothing changes.
    pub fn activate(&self, tenant: &str, handler: &str, version: i64) -> StoreResult<Activated> {
        let row = self.version_row(&mut **self.db(), tenant, handler, version)?;
        self.activate_compiled(tenant, handler, &row)
    }

    /// Activates the newest version older than the active one.
    pub fn rollback(&self, tenant: &str, handler: &str) -> StoreResult<Activated> {
        let row = {
            let mut db = self.db();
            let target = store::rollback_target(&mut **db, tenant, handler)?;
            self.version_row(&mut **db, tenant, handler, target)?
        };
        self.activate_compiled(tenant, handler, &row)
    }

    /// A stored version's row: its component's digest and size (a
    /// version's component never changes).
    fn version_row(&self, db: &mut dyn Store, tenant: &str, handler: &str, version: i64) -> StoreResult<store::VersionRow> {
        let (versions, _) = db.versions(tenant, handler)?;
        versions
            .into_iter()
            .find(|v| v.version == version)
            .ok_or_else(|| StoreError::NotFound(format!("{tenant}/{handler} has no version {version}")))
    }

    /// Compiles the version's component if this node has no artifact for
    /// it, on the compile pool with its budget and outside the store's lock
    /// (other admin calls and the sync go on meanwhile), then links it and
    /// switches under the lock.
    fn activate_compiled(&self, tenant: &str, handler: &str, row: &store::VersionRow) -> StoreResult<Activated> {
        self.activate_compiled_if(tenant, handler, row, |_| Ok(()))
    }

    /// [`ControlPlane::activate_compiled`], switching only if `check` (run
    /// under the store's lock, just before) holds. A canary of the version
    /// made active ends: it is the active version now. Loading (or
    /// compiling) the component is charged to the tenant on the node's
    /// memory budget while it runs, as a compile of its size.
    fn activate_compiled_if(
        &self,
        tenant: &str,
        handler: &str,
        row: &store::VersionRow,
        check: impl FnOnce(&mut dyn Store) -> StoreResult<()>,
    ) -> StoreResult<Activated> {
        let (version, sha256) = (row.version, row.sha256.as_str());
        let estimate = crate::sandbox::compile::memory_estimate(usize::try_from(row.size).unwrap_or(usize::MAX));
        let loading = self.sandbox.memory().charge(&Arc::from(tenant), estimate).map_err(no_memory)?;
        let component = self.compile_off_lock(sha256)?;
        drop(loading);
        let mut db = self.db();
        check(&mut **db)?;
        let outgoing_http = self.defaults.with(&db.tenant(tenant)?.overrides).outgoing_http;
        let active = ActiveHandler { tenant: tenant.to_owned(), handler: handler.to_owned(), version, sha256: sha256.to_owned() };
        let loaded = self.link(&component, &active, outgoing_http)?;
        let previous_version = db.activate(tenant, handler, version)?;
        if db.canary(tenant, handler)?.is_some_and(|c| c.version == version) {
            db.set_canary(tenant, handler, None)?;
        }
        self.refresh_after_commit(&mut **db, vec![Arc::new(loaded)]);
        tracing::info!(tenant, handler, version, ?previous_version, "handler version activated");
        Ok(Activated { tenant: tenant.to_owned(), handler: handler.to_owned(), active_version: version, previous_version })
    }
}

/// How a deployed version is released.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Release {
    /// Made active at once.
    Activate,
    /// Stored, not served.
    Store,
    /// Served to `percent` of the requests beside the active version,
    /// aborted by a node under `abort`.
    Canary {
        /// Its share, 1 to 99.
        percent: u8,
        /// When a node ends it by itself.
        abort: Option<AbortRule>,
    },
}

/// Refuses the first version of a new handler when `tenant` has
/// `max_handlers` already.
fn check_handler_quota(db: &mut dyn Store, tenant: &str, handler: &str, max_handlers: u32) -> StoreResult<()> {
    let handlers = db.handlers(tenant)?;
    if handlers.len() >= max_handlers as usize && !handlers.iter().any(|(name, _)| name == handler) {
        return Err(StoreError::Quota(format!("tenant {tenant:?} has {} handlers, its most (max_handlers)", handlers.len())));
    }
    Ok(())
}

/// The server's defaults must themselves be a valid tenant's limits.
fn validate_defaults(defaults: &TenantLimits, max_instances: u32) -> Result<(), String> {
    defaults.validate(&LimitOverrides::default())?;
    if defaults.max_concurrency > max_instances {
        return Err(format!("--tenant-max-concurrency ({}) exceeds --max-instances ({max_instances})", defaults.max_concurrency));
    }
    Ok(())
}

/// Checks a store without running it: the database's integrity and
/// references, and that every stored version's component is there and
/// hashes to its name. `url` as `--store`; SQLite in `data_dir` without one.
pub fn check_store(url: Option<&str>, data_dir: &Path) -> anyhow::Result<CheckReport> {
    if url.is_none() {
        let db_path = data_dir.join(store::DB_FILE);
        anyhow::ensure!(db_path.exists(), "no store at {}", data_dir.display());
    }
    let mut db = store::open(url, data_dir)?;
    let mut problems = db.check().map_err(|e| anyhow::anyhow!("{e}"))?;
    let versions = db.all_versions().map_err(|e| anyhow::anyhow!("{e}"))?;
    for (label, sha) in &versions {
        if let Err(e) = db.component(sha) {
            problems.push(format!("{label}: {e:#}"));
        }
    }
    let temp_files = if url.is_none() { Blobs::open(data_dir)?.tmp_files()?.len() } else { 0 };
    Ok(CheckReport { ok: problems.is_empty(), problems, versions: versions.len(), temp_files })
}

/// A memory-budget refusal as the store's error: 503 `overloaded`, retry shortly.
fn no_memory(refusal: crate::admission::memory::Refusal) -> StoreError {
    StoreError::NoMemory(format!("{refusal}: the upload does not fit now; retry shortly"))
}

/// A compile-pool refusal as the store's error: busy or too slow is 503
/// `busy` (retry shortly), a failed pool an internal error.
fn compile_refusal(e: CompileError) -> StoreError {
    match e {
        CompileError::TooSlow(_) | CompileError::Busy => StoreError::Busy(e.to_string()),
        CompileError::Failed => StoreError::Internal(anyhow::anyhow!(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_defaults_that_no_tenant_could_have_are_refused() {
        let config = crate::config::ServeConfig::with_data_dir("unused".into()).unwrap();
        assert!(validate_defaults(&config.limits, config.max_instances).is_ok());
        let error = validate_defaults(&config.limits, 16).unwrap_err();
        assert!(error.contains("--tenant-max-concurrency"), "{error}");
        let slow = TenantLimits { rps: 0.0001, ..config.limits };
        assert!(validate_defaults(&slow, config.max_instances).unwrap_err().contains("rps"));
    }
}
