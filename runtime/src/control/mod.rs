//! The control plane: tenants, API keys, handler versions and per-tenant
//! limits, kept in SQLite ([`db`]) with component bytes content-addressed on
//! disk ([`blobs`]), and the in-memory snapshot ([`Live`]) the data plane
//! reads. Every change builds a new snapshot and swaps it in: requests in
//! flight keep the `Arc<Handler>` they started with (hot swap), new requests
//! see the new one, and the inference engines are never touched.

pub mod blobs;
pub mod db;
pub mod keys;
pub mod limits;
mod upload;
pub mod validate;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use anyhow::Context;
use serde::Serialize;
use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use self::blobs::Blobs;
use self::db::{ActiveHandler, Db, KeyRow, StoreError, StoreResult, VersionRow};
use self::keys::NewKey;
use self::limits::{ConcurrencyGate, LimitOverrides, TenantLimits, TokenBucket};
use self::upload::Upload;
use crate::compile::{CompileError, CompilePool};
use crate::handlers::{Handler, valid_name};
use crate::sandbox::Sandbox;
use facegate_host_gpu::Models;

/// File name of the database inside the data directory.
pub const DB_FILE: &str = "facegate.db";
/// `meta` key recording the seeding: `started`, then `done`.
const SEED_MARK: &str = "seed";
const SEED_DONE: &str = "done";

/// A key created by [`ControlPlane::seed`].
#[derive(Debug, Clone)]
pub struct SeededKey {
    /// Its tenant.
    pub tenant: String,
    /// The key (also in `path`).
    pub key: String,
    /// The file it was written to (mode 0600).
    pub path: PathBuf,
}

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
    /// Admission state.
    pub gate: Arc<TenantGate>,
    /// Active handler versions by name.
    pub handlers: HashMap<String, Arc<Handler>>,
}

struct ActiveKey {
    tenant: String,
    secret_sha256: [u8; 32],
}

/// What the data plane serves: an immutable snapshot, swapped on change.
#[derive(Default)]
pub struct Live {
    /// Tenants by name.
    pub tenants: HashMap<String, TenantEntry>,
    keys: HashMap<String, ActiveKey>,
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

/// A tenant as the admin API shows it.
#[derive(Debug, Serialize)]
pub struct TenantInfo {
    /// Name.
    pub name: String,
    /// Effective limits.
    pub limits: TenantLimits,
    /// What it overrides.
    pub overrides: LimitOverrides,
    /// Handlers and their active versions.
    pub handlers: Vec<HandlerInfo>,
    /// Unix seconds.
    pub created_at: i64,
}

/// A handler and its active version.
#[derive(Debug, Serialize)]
pub struct HandlerInfo {
    /// Name.
    pub name: String,
    /// Active version, if any.
    pub active_version: Option<i64>,
}

/// A handler's versions.
#[derive(Debug, Serialize)]
pub struct VersionsInfo {
    /// Tenant.
    pub tenant: String,
    /// Handler.
    pub handler: String,
    /// Active version.
    pub active_version: Option<i64>,
    /// All versions, oldest first.
    pub versions: Vec<VersionRow>,
}

/// Result of an upload.
#[derive(Debug, Serialize)]
pub struct Deployed {
    /// Tenant.
    pub tenant: String,
    /// Handler.
    pub handler: String,
    /// The new version.
    pub version: i64,
    /// SHA-256 of the component.
    pub sha256: String,
    /// Bytes.
    pub size: usize,
    /// Active version after the upload.
    pub active_version: Option<i64>,
}

/// Result of an activation or rollback.
#[derive(Debug, Serialize)]
pub struct Activated {
    /// Tenant.
    pub tenant: String,
    /// Handler.
    pub handler: String,
    /// Now active.
    pub active_version: i64,
    /// Active before.
    pub previous_version: Option<i64>,
}

/// A new API key, shown once.
#[derive(Debug, Serialize)]
pub struct CreatedKey {
    /// Tenant.
    pub tenant: String,
    /// Public id (to list and revoke).
    pub id: String,
    /// The key itself; not stored, not shown again.
    pub key: String,
    /// Unix seconds.
    pub created_at: i64,
}

/// Outcome of [`check_store`].
#[derive(Debug, Serialize)]
pub struct CheckReport {
    /// No problem found.
    pub ok: bool,
    /// Each problem found.
    pub problems: Vec<String>,
    /// Handler versions checked.
    pub versions: usize,
    /// Files of interrupted writes in `tmp/` (never served; removed at start).
    pub temp_files: usize,
}

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
}

/// The control plane (see the module docs).
pub struct ControlPlane {
    data_dir: PathBuf,
    db: Mutex<Db>,
    blobs: Blobs,
    sandbox: Arc<Sandbox>,
    models: Models,
    engine_id: String,
    defaults: TenantLimits,
    max_instances: u32,
    compile: CompilePool,
    weights: HashMap<String, u32>,
    live: RwLock<Arc<Live>>,
}

impl ControlPlane {
    /// Opens the store under `data_dir` and loads every active handler.
    pub fn open(data_dir: &Path, sandbox: Arc<Sandbox>, models: Models, settings: ControlSettings) -> anyhow::Result<Self> {
        let ControlSettings { defaults, max_instances, compile, weights } = settings;
        create_private_dir(data_dir)?;
        if let Err(e) = validate_defaults(&defaults, max_instances) {
            anyhow::bail!(
                "the tenants' default limits (--tenant-*, --memory-limit-mib, --max-body-bytes, --request-timeout-ms flags) are invalid: {e}"
            );
        }
        let blobs = Blobs::open(data_dir)?;
        let leftovers = blobs.clear_tmp()?;
        if leftovers > 0 {
            tracing::warn!(files = leftovers, "removed files of interrupted uploads");
        }
        let db = Db::open(&data_dir.join(DB_FILE))?;
        let engine_id = engine_id(sandbox.engine());
        let control = Self {
            data_dir: data_dir.to_owned(),
            db: Mutex::new(db),
            blobs,
            sandbox,
            models,
            engine_id,
            defaults,
            max_instances,
            compile,
            weights,
            live: RwLock::new(Arc::new(Live::default())),
        };
        control.refresh(&control.db(), Vec::new())?;
        Ok(control)
    }

    /// The current snapshot.
    pub fn live(&self) -> Arc<Live> {
        Arc::clone(&self.live.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    fn db(&self) -> MutexGuard<'_, Db> {
        self.db.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// All tenants.
    pub fn tenants(&self) -> StoreResult<Vec<TenantInfo>> {
        let db = self.db();
        db.tenants()?.into_iter().map(|row| self.tenant_info(&db, row)).collect()
    }

    /// One tenant.
    pub fn tenant(&self, name: &str) -> StoreResult<TenantInfo> {
        let db = self.db();
        let row = db.tenant(name)?;
        self.tenant_info(&db, row)
    }

    fn tenant_info(&self, db: &Db, row: db::TenantRow) -> StoreResult<TenantInfo> {
        let handlers = db.handlers(&row.name)?.into_iter().map(|(name, active_version)| HandlerInfo { name, active_version }).collect();
        Ok(TenantInfo {
            limits: self.defaults.with(&row.overrides),
            name: row.name,
            overrides: row.overrides,
            handlers,
            created_at: row.created_at,
        })
    }

    /// Creates a tenant.
    pub fn create_tenant(&self, name: &str, overrides: &LimitOverrides) -> StoreResult<TenantInfo> {
        let name = valid_name(name).map_err(|e| StoreError::Invalid(e.to_string()))?;
        self.validate_limits(overrides)?;
        let db = self.db();
        db.create_tenant(&name, overrides)?;
        self.refresh(&db, Vec::new())?;
        let row = db.tenant(&name)?;
        self.tenant_info(&db, row)
    }

    /// Changes some of a tenant's limits (fields absent in `patch` stay).
    pub fn update_limits(&self, name: &str, patch: &LimitOverrides) -> StoreResult<TenantInfo> {
        let db = self.db();
        let mut overrides = db.tenant(name)?.overrides;
        overrides.merge(patch);
        self.validate_limits(&overrides)?;
        if !self.defaults.with(&overrides).outgoing_http {
            self.refuse_if_outgoing_http_needed(name)?;
        }
        db.set_limits(name, &overrides)?;
        self.refresh(&db, Vec::new())?;
        let row = db.tenant(name)?;
        self.tenant_info(&db, row)
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

    /// Refuses to withdraw outgoing HTTP while an active version imports it.
    fn refuse_if_outgoing_http_needed(&self, tenant: &str) -> StoreResult<()> {
        let live = self.live();
        let mut needing: Vec<&str> = live
            .tenants
            .get(tenant)
            .into_iter()
            .flat_map(|t| t.handlers.values())
            .filter(|h| h.imports_outgoing_http)
            .map(|h| h.name.as_str())
            .collect();
        if needing.is_empty() {
            return Ok(());
        }
        needing.sort_unstable();
        Err(StoreError::Conflict(format!(
            "active handlers of {tenant:?} import wasi:http/outgoing-handler ({}); activate versions without it first",
            needing.join(", ")
        )))
    }

    /// Deletes a tenant, its keys and handlers; its requests in flight finish.
    pub fn delete_tenant(&self, name: &str) -> StoreResult<()> {
        let db = self.db();
        db.delete_tenant(name)?;
        self.refresh(&db, Vec::new())
    }

    /// Creates an API key for `tenant`.
    pub fn create_key(&self, tenant: &str) -> StoreResult<CreatedKey> {
        let NewKey { id, key, secret_sha256 } = keys::generate()?;
        let db = self.db();
        let created_at = db.insert_key(tenant, &id, &secret_sha256)?;
        self.refresh(&db, Vec::new())?;
        Ok(CreatedKey { tenant: tenant.to_owned(), id, key, created_at })
    }

    /// A tenant's keys (ids and dates only).
    pub fn keys(&self, tenant: &str) -> StoreResult<Vec<KeyRow>> {
        self.db().keys(tenant)
    }

    /// Revokes a key; requests with it are refused from now on.
    pub fn revoke_key(&self, tenant: &str, id: &str) -> StoreResult<()> {
        let db = self.db();
        db.revoke_key(tenant, id)?;
        self.refresh(&db, Vec::new())
    }

    /// Whether uploads are refused as busy now (see [`CompilePool::is_full`]).
    pub fn uploads_busy(&self) -> bool {
        self.compile.is_full()
    }

    /// Validates, compiles and stores a new version of a handler; activates it if asked.
    /// The heavy part runs on the compile pool (see [`upload`]), under its budget.
    pub fn deploy(&self, tenant: &str, handler: &str, bytes: &[u8], activate: bool) -> StoreResult<Deployed> {
        let handler = valid_name(handler).map_err(|e| StoreError::Invalid(e.to_string()))?;
        let outgoing_http = {
            let live = self.live();
            let entry = live.tenants.get(tenant).ok_or_else(|| StoreError::NotFound(format!("no tenant {tenant:?}")))?;
            entry.gate.limits.outgoing_http
        };
        validate::check_header(bytes).map_err(StoreError::Invalid)?;
        let upload = Upload {
            sandbox: Arc::clone(&self.sandbox),
            blobs: self.blobs.clone(),
            engine_id: self.engine_id.clone(),
            tenant: tenant.to_owned(),
            handler: handler.clone(),
            outgoing_http,
            bytes: Arc::from(bytes),
        };
        let prepared = self.compile.run(move || upload.prepare()).map_err(|e| match e {
            CompileError::Invalid(_) => StoreError::Invalid(e.to_string()),
            CompileError::TooSlow(_) | CompileError::Busy => StoreError::Busy(e.to_string()),
            CompileError::Failed => StoreError::Internal(anyhow::anyhow!(e)),
        })??;
        let mut db = self.db();
        // The grant may have changed while this compiled (outside the lock).
        if self.defaults.with(&db.tenant(tenant)?.overrides).outgoing_http != outgoing_http {
            return Err(StoreError::Conflict(format!("tenant {tenant:?}'s outgoing HTTP grant changed during the upload; upload again")));
        }
        let sha256 = prepared.sha256;
        db.put_artifact(&sha256, &self.engine_id, &prepared.artifact_sha256)?;
        let version = db.add_version(tenant, &handler, &sha256, bytes.len(), activate)?;
        let mut linked = prepared.linked;
        linked.version = version;
        let preloaded = if activate { vec![Arc::new(linked)] } else { Vec::new() };
        self.refresh(&db, preloaded)?;
        let active_version = db.versions(tenant, &handler)?.1;
        tracing::info!(tenant, handler, version, %sha256, activate, "handler version stored");
        Ok(Deployed { tenant: tenant.to_owned(), handler, version, sha256, size: bytes.len(), active_version })
    }

    /// A handler's versions.
    pub fn versions(&self, tenant: &str, handler: &str) -> StoreResult<VersionsInfo> {
        let (versions, active_version) = self.db().versions(tenant, handler)?;
        Ok(VersionsInfo { tenant: tenant.to_owned(), handler: handler.to_owned(), active_version, versions })
    }

    /// Makes `version` active. It is loaded before the switch: if it cannot
    /// be served, nothing changes.
    pub fn activate(&self, tenant: &str, handler: &str, version: i64) -> StoreResult<Activated> {
        self.activate_locked(&self.db(), tenant, handler, version)
    }

    /// Activates the newest version older than the active one.
    pub fn rollback(&self, tenant: &str, handler: &str) -> StoreResult<Activated> {
        let db = self.db();
        let target = db.rollback_target(tenant, handler)?;
        self.activate_locked(&db, tenant, handler, target)
    }

    fn activate_locked(&self, db: &Db, tenant: &str, handler: &str, version: i64) -> StoreResult<Activated> {
        let (versions, _) = db.versions(tenant, handler)?;
        let row = versions
            .iter()
            .find(|v| v.version == version)
            .ok_or_else(|| StoreError::NotFound(format!("{tenant}/{handler} has no version {version}")))?;
        let outgoing_http = self.defaults.with(&db.tenant(tenant)?.overrides).outgoing_http;
        let active = ActiveHandler { tenant: tenant.to_owned(), handler: handler.to_owned(), version, sha256: row.sha256.clone() };
        let loaded = self.load_handler(db, &active, outgoing_http)?;
        let previous_version = db.activate(tenant, handler, version)?;
        self.refresh(db, vec![Arc::new(loaded)])?;
        tracing::info!(tenant, handler, version, ?previous_version, "handler version activated");
        Ok(Activated { tenant: tenant.to_owned(), handler: handler.to_owned(), active_version: version, previous_version })
    }

    /// Seeds an empty store from `<dir>/<tenant>/<handler>.wasm`: each tenant
    /// gets default limits, version 1 of each handler, and one API key
    /// written to `<data-dir>/<tenant>.key` (mode 0600). Seeding resumes
    /// where it stopped if it was interrupted; a store that was seeded, or
    /// that had tenants before, is left alone. Returns the keys created.
    pub fn seed(&self, dir: &Path) -> anyhow::Result<Vec<SeededKey>> {
        {
            let db = self.db();
            match db.meta(SEED_MARK)?.as_deref() {
                Some(SEED_DONE) => return Ok(Vec::new()),
                Some(_) => {}
                None if !db.is_empty()? => return Ok(Vec::new()),
                None => db.set_meta(SEED_MARK, "started")?,
            }
        }
        let mut tenants: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("cannot read seed directory {}", dir.display()))?
            .filter_map(Result::ok)
            .filter(|e| e.path().is_dir())
            .map(|e| e.path())
            .collect();
        tenants.sort();
        let mut created = Vec::new();
        for tenant_dir in tenants {
            let name = tenant_dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let Ok(tenant) = valid_name(name) else {
                tracing::warn!(dir = %tenant_dir.display(), "not a tenant name; not seeded");
                continue;
            };
            created.extend(self.seed_tenant(&tenant, &tenant_dir)?);
        }
        self.db().set_meta(SEED_MARK, SEED_DONE)?;
        Ok(created)
    }

    fn seed_tenant(&self, tenant: &str, dir: &Path) -> anyhow::Result<Option<SeededKey>> {
        if !self.live().tenants.contains_key(tenant) {
            self.create_tenant(tenant, &LimitOverrides::default())?;
        }
        let mut files: Vec<_> = std::fs::read_dir(dir)?.filter_map(Result::ok).map(|e| e.path()).collect();
        files.sort();
        for file in files.iter().filter(|p| p.extension().is_some_and(|e| e == "wasm")) {
            let handler = file.file_stem().and_then(|n| n.to_str()).unwrap_or_default();
            if valid_name(handler).is_err() {
                tracing::warn!(file = %file.display(), "not a handler name; not seeded");
                continue;
            }
            if self.live().handler(tenant, handler).is_some() {
                continue;
            }
            let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
            self.deploy(tenant, handler, &bytes, true).with_context(|| format!("seeding {}", file.display()))?;
        }
        let path = self.data_dir.join(format!("{tenant}.key"));
        let saved = std::fs::read_to_string(&path).unwrap_or_default();
        if self.live().authenticate(Some(saved.trim())) == Some(tenant) {
            return Ok(None);
        }
        // A key whose file was never written (a crash in between) is useless: revoke it.
        for stale in self.keys(tenant)?.into_iter().filter(|k| k.revoked_at.is_none()) {
            self.revoke_key(tenant, &stale.id)?;
        }
        let key = self.create_key(tenant)?;
        write_secret(&path, &key.key)?;
        tracing::info!(tenant, key_id = %key.id, path = %path.display(), "seeded tenant; API key written");
        Ok(Some(SeededKey { tenant: tenant.to_owned(), key: key.key, path }))
    }

    /// Builds a new snapshot from the database and swaps it in. Handlers
    /// already loaded at the same version are reused, as are tenant gates
    /// whose limits did not change.
    fn refresh(&self, db: &Db, preloaded: Vec<Arc<Handler>>) -> StoreResult<()> {
        let old = self.live();
        let mut live = Live::default();
        for row in db.tenants()? {
            let limits = self.defaults.with(&row.overrides);
            let gate = match old.tenants.get(&row.name) {
                Some(entry) if entry.gate.limits == limits => Arc::clone(&entry.gate),
                old_entry => Arc::new(new_gate(limits, old_entry.map(|e| &*e.gate))),
            };
            // One source of truth: the override, else --tenant-weight, else the default.
            let weight = row.overrides.weight.or_else(|| self.weights.get(&row.name).copied()).unwrap_or(gate.limits.weight);
            for model in self.models.iter() {
                model.set_tenant_weight(&row.name, weight);
            }
            live.tenants.insert(row.name, TenantEntry { gate, handlers: HashMap::new() });
        }
        // A deleted tenant leaves nothing in the batchers: a new tenant of the
        // same name starts afresh.
        for gone in old.tenants.keys().filter(|name| !live.tenants.contains_key(*name)) {
            for model in self.models.iter() {
                model.remove_tenant(gone);
            }
        }
        for active in db.active_handlers()? {
            let Some(entry) = live.tenants.get_mut(&active.tenant) else { continue };
            let outgoing_http = entry.gate.limits.outgoing_http;
            let same = |h: &&Arc<Handler>| h.version == active.version && h.outgoing_http == outgoing_http;
            let reused = preloaded
                .iter()
                .find(|h| *h.tenant == *active.tenant && h.name == active.handler && same(h))
                .or_else(|| old.handler(&active.tenant, &active.handler).map(|(_, h)| h).filter(same))
                .cloned();
            let handler = match reused {
                Some(handler) => handler,
                None => match self.load_handler(db, &active, outgoing_http) {
                    Ok(handler) => Arc::new(handler),
                    Err(e) => {
                        tracing::error!(tenant = %active.tenant, handler = %active.handler, version = active.version, error = %e, "cannot load handler; it is not served");
                        continue;
                    }
                },
            };
            entry.handlers.insert(active.handler, handler);
        }
        for (id, tenant, sha) in db.active_keys()? {
            if let Some(secret_sha256) = keys::digest_from_hex(&sha) {
                live.keys.insert(id, ActiveKey { tenant, secret_sha256 });
            }
        }
        *self.live.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(live);
        Ok(())
    }

    fn load_handler(&self, db: &Db, active: &ActiveHandler, outgoing_http: bool) -> StoreResult<Handler> {
        let component = self.load_component(db, &active.sha256)?;
        validate::check_imports(self.sandbox.engine(), &component, &active.tenant, outgoing_http).map_err(StoreError::Conflict)?;
        Handler::link(self.sandbox.linker(outgoing_http), &component, &active.tenant, &active.handler, active.version, outgoing_http)
            .map_err(|e| StoreError::Internal(anyhow::anyhow!(e)))
    }

    /// The compiled component: its cached artifact when present and intact,
    /// else compiled again from the verified component bytes (and cached).
    fn load_component(&self, db: &Db, sha256: &str) -> StoreResult<Component> {
        let engine = self.sandbox.engine();
        if let Some(artifact_sha) = db.artifact(sha256, &self.engine_id)? {
            let path = self.blobs.artifact_path(sha256, &self.engine_id);
            match self.blobs.read_verified(&path, &artifact_sha) {
                Ok(bytes) => match deserialize(engine, &bytes) {
                    Ok(component) => return Ok(component),
                    Err(e) => tracing::warn!(error = %e, "precompiled artifact unusable; compiling again"),
                },
                Err(e) => tracing::warn!(error = %e, "precompiled artifact missing or corrupt; compiling again"),
            }
        }
        let bytes = self.blobs.read_verified(&self.blobs.component_path(sha256), sha256)?;
        let component = Component::new(engine, &bytes).map_err(|e| anyhow::anyhow!("component {sha256}: {e:#}"))?;
        self.cache_artifact(db, sha256, &component)?;
        Ok(component)
    }

    fn cache_artifact(&self, db: &Db, sha256: &str, component: &Component) -> StoreResult<()> {
        let artifact_sha = upload::write_artifact(&self.blobs, &self.engine_id, sha256, component)?;
        db.put_artifact(sha256, &self.engine_id, &artifact_sha)
    }
}

/// The server's defaults must themselves be a valid tenant's limits.
fn validate_defaults(defaults: &TenantLimits, max_instances: u32) -> Result<(), String> {
    defaults.validate(&LimitOverrides::default())?;
    if defaults.max_concurrency > max_instances {
        return Err(format!("--tenant-max-concurrency ({}) exceeds --max-instances ({max_instances})", defaults.max_concurrency));
    }
    Ok(())
}

/// A gate for `limits`. An existing tenant keeps its bucket and slots,
/// resized in place: a limit change neither refills the bucket nor lets the
/// tenant run its old and new concurrency at once.
fn new_gate(limits: TenantLimits, old: Option<&TenantGate>) -> TenantGate {
    let Some(old) = old else {
        let rate = Arc::new(TokenBucket::new(limits.rps, limits.burst));
        let concurrency = Arc::new(ConcurrencyGate::new(limits.max_concurrency));
        return TenantGate { rate, concurrency, limits };
    };
    old.rate.reconfigure(limits.rps, limits.burst);
    old.concurrency.resize(limits.max_concurrency);
    TenantGate { rate: Arc::clone(&old.rate), concurrency: Arc::clone(&old.concurrency), limits }
}

/// Loads a precompiled artifact.
#[allow(unsafe_code, reason = "wasmtime requires it to load precompiled code")]
fn deserialize(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: the bytes come from `Component::serialize` of an engine with
    // the same compatibility hash (it names the file), were written
    // atomically by this process, and their SHA-256 matches the one recorded
    // in the database; wasmtime re-checks version and settings in the header.
    unsafe { Component::deserialize(engine, bytes) }
}

/// A short, stable identity of the engine's code-generation settings and
/// version: precompiled artifacts are keyed by it, so changing either
/// recompiles instead of loading stale code.
pub fn engine_id(engine: &Engine) -> String {
    struct Sha(Sha256);
    impl Hasher for Sha {
        fn write(&mut self, bytes: &[u8]) {
            self.0.update(bytes);
        }
        fn finish(&self) -> u64 {
            0
        }
    }
    let mut hasher = Sha(Sha256::new());
    engine.precompile_compatibility_hash().hash(&mut hasher);
    keys::hex(&hasher.0.finalize()[..8])
}

/// Checks a store without running it: SQLite integrity, references, and
/// that every stored version's component is on disk and hashes to its name.
pub fn check_store(data_dir: &Path) -> anyhow::Result<CheckReport> {
    let db_path = data_dir.join(DB_FILE);
    anyhow::ensure!(db_path.exists(), "no store at {}", data_dir.display());
    let db = Db::open(&db_path)?;
    let blobs = Blobs::open(data_dir)?;
    let mut problems = db.check().map_err(|e| anyhow::anyhow!("{e}"))?;
    let versions = db.all_versions().map_err(|e| anyhow::anyhow!("{e}"))?;
    for (label, sha) in &versions {
        if let Err(e) = blobs.read_verified(&blobs.component_path(sha), sha) {
            problems.push(format!("{label}: {e:#}"));
        }
    }
    let temp_files = blobs.tmp_files()?.len();
    Ok(CheckReport { ok: problems.is_empty(), problems, versions: versions.len(), temp_files })
}

fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    use std::os::unix::fs::DirBuilderExt;
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    builder.mode(0o700);
    builder.create(dir).with_context(|| format!("cannot create data directory {}", dir.display()))
}

/// Writes a secret to a new file readable by its owner only.
pub fn write_secret(path: &Path, secret: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let _ = std::fs::remove_file(path);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path).with_context(|| format!("cannot write {}", path.display()))?;
    writeln!(file, "{secret}")?;
    file.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineLimits, build};

    #[test]
    fn server_defaults_that_no_tenant_could_have_are_refused() {
        let config = crate::config::ServeConfig::with_data_dir("unused".into()).unwrap();
        assert!(validate_defaults(&config.default_limits(), config.max_instances).is_ok());
        let error = validate_defaults(&config.default_limits(), 16).unwrap_err();
        assert!(error.contains("--tenant-max-concurrency"), "{error}");
        let slow = TenantLimits { rps: 0.0001, ..config.default_limits() };
        assert!(validate_defaults(&slow, config.max_instances).unwrap_err().contains("rps"));
    }

    #[test]
    fn artifacts_are_keyed_by_the_engine_configuration() {
        let limits = EngineLimits { max_instances: 2, memory_limit: 16 << 20 };
        let a = engine_id(&build(limits).unwrap());
        assert_eq!(a, engine_id(&build(limits).unwrap()), "stable for the same configuration");
        assert_eq!(a.len(), 16);
        let mut other = wasmtime::Config::new();
        other.wasm_component_model(true);
        assert_ne!(a, engine_id(&Engine::new(&other).unwrap()), "another configuration, another key");
    }
}
