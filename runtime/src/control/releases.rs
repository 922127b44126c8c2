//! The control plane's part for handlers, their versions and canaries
//! ([`Releases`]): uploads validated, compiled (on the compile pool, under
//! the node's memory budget) and stored; versions activated, rolled back,
//! released as canaries, promoted or aborted; old versions pruned. A
//! tenant has one change in progress on a node at a time ([`Change`]).

use std::sync::Arc;

use bytes::Bytes;

use super::api::{Activated, Deployed, VersionsInfo};
use super::artifacts::Artifacts;
use super::serving::Serving;
use super::shared::{Shared, compile_refusal, no_memory};
use super::store::{self, AbortRule, ActiveHandler, Canary, NewVersion, Store, StoreError, StoreResult};
use super::upload::{Change, ChangePlace, Changes, Upload, UploadHold};
use super::validate;
use crate::sandbox::handler::{GuestPath, valid_name};

/// Handlers, versions and canaries (see the module docs).
pub struct Releases {
    shared: Arc<Shared>,
    artifacts: Arc<Artifacts>,
    serving: Arc<Serving>,
    /// Tenants with a change in progress here (one each at a time).
    changes: Changes,
}

impl Releases {
    pub(super) fn new(shared: Arc<Shared>, artifacts: Arc<Artifacts>, serving: Arc<Serving>) -> Self {
        Self { shared, artifacts, serving, changes: Changes::default() }
    }

    /// Deletes a handler's versions past the tenant's `max_versions` (see
    /// [`Store::prune_versions`]) and this node's cached artifacts of the
    /// components they freed. The upload is stored either way: a failure
    /// here is logged, and the next upload prunes again.
    fn prune(&self, db: &mut dyn Store, (tenant, handler): (&str, &str), max_versions: u32) {
        match db.prune_versions(tenant, handler, max_versions as usize) {
            Ok(pruned) if !pruned.versions.is_empty() => {
                for sha in &pruned.components {
                    self.shared.cache.discard(sha, &self.shared.engine_id);
                }
                tracing::info!(tenant, handler, versions = ?pruned.versions, components = pruned.components.len(), max_versions, "old versions deleted");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(tenant, handler, error = %e, "old versions not deleted"),
        }
    }

    /// Whether uploads are refused as busy now (see [`CompilePool::is_full`]).
    pub fn uploads_busy(&self) -> bool {
        self.shared.compile.is_full()
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
        let memory = self.shared.sandbox.memory().charge(&Arc::from(tenant), bytes.len()).map_err(no_memory)?;
        let release = if activate { Release::Activate } else { Release::Store };
        self.release(tenant, handler, bytes, Releasing::uploaded(release, GuestPath::default()), UploadHold { place, memory })
    }

    /// Stores `bytes` as a new version of `tenant`'s `handler` and releases
    /// it as `release` says: active, stored only, or a canary beside the
    /// active version (which there must be); its guest sees the path
    /// `guest_path` says; the version records its `source`. `hold` is what the upload
    /// holds already (its tenant's place, its body's memory charge): the
    /// charge grows to the compile's estimate before it starts, and both go
    /// with the compile job.
    pub fn release(
        &self,
        tenant: &str,
        handler: &str,
        bytes: Bytes,
        Releasing { release, guest_path, source }: Releasing,
        mut hold: UploadHold,
    ) -> StoreResult<Deployed> {
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
        if matches!(release, Release::Canary { .. }) && self.serving.live().handler(tenant, &handler).is_none() {
            return Err(StoreError::Invalid(format!(
                "{tenant}/{handler} has no active version for a canary to run beside; deploy it first"
            )));
        }
        let limits = {
            let live = self.serving.live();
            let entry = live.tenants.get(tenant).ok_or_else(|| StoreError::NotFound(format!("no tenant {tenant:?}")))?;
            entry.gate.limits
        };
        let outgoing_http = limits.outgoing_http;
        validate::check_header(&bytes).map_err(StoreError::Invalid)?;
        let imports_pipeline = validate::check_interface(&bytes).map_err(StoreError::Invalid)?;
        check_handler_quota(&mut **self.shared.db(), tenant, &handler, limits.max_handlers)?;
        let pipeline = imports_pipeline.then(|| self.shared.pipeline.as_ref().map_or(0, |p| p.len()));
        hold.memory.resize(crate::sandbox::compile::upload_memory_estimate(bytes.len(), pipeline)).map_err(no_memory)?;
        let upload = Upload {
            sandbox: Arc::clone(&self.shared.sandbox),
            cache: self.shared.cache.clone(),
            engine_id: self.shared.engine_id.clone(),
            tenant: tenant.to_owned(),
            handler: handler.clone(),
            outgoing_http,
            bytes,
            imports_pipeline,
            pipeline: self.shared.pipeline.clone(),
            artifact_key: self.shared.artifact_key.clone(),
        };
        // The hold goes with the job: a compile past the budget keeps the
        // tenant's place and its charge until it ends.
        let (prepared, mut hold) = self.shared.compile.run(move || (upload.prepare(), hold)).map_err(compile_refusal)?;
        let prepared = prepared?;
        self.artifacts.compiled_here();
        // From here on the upload holds what is stored, its component (a
        // charge that shrinks is never refused).
        let _ = hold.memory.resize(prepared.component.len());
        // A grant changed while this compiled: the refresh links it anew (see `refresh`).
        let mut db = self.shared.db();
        // Again under the store's lock: another upload may have added a handler meanwhile.
        check_handler_quota(&mut **db, tenant, &handler, limits.max_handlers)?;
        let (sha256, component) = (prepared.sha256, prepared.component);
        let artifact = prepared.shared.as_ref();
        let version = db.add_version(NewVersion {
            tenant,
            handler: &handler,
            sha256: &sha256,
            component: &component,
            activate,
            guest_path,
            source: &source,
            artifact,
        })?;
        let mut linked = prepared.linked;
        (linked.version, linked.guest_path) = (version, guest_path);
        if let Release::Canary { percent, abort } = release {
            db.set_canary(tenant, &handler, Some(Canary { version, percent, abort }))?;
        }
        self.prune(&mut **db, (tenant, &handler), limits.max_versions);
        // Stored: what is active follows from the upload (no second read that could fail now).
        let active_version = if activate { Some(version) } else { db.versions(tenant, &handler).map(|v| v.1).unwrap_or(None) };
        drop(db);
        // Matched by version: served only if active, or the canary.
        self.serving.refresh_after_commit(tenant, vec![Arc::new(linked)]);
        tracing::info!(tenant, handler, version, %sha256, activate, source, "handler version stored");
        Ok(Deployed { tenant: tenant.to_owned(), handler, version, sha256, size: component.len(), active_version, source })
    }

    /// A handler's versions.
    pub fn versions(&self, tenant: &str, handler: &str) -> StoreResult<VersionsInfo> {
        let mut db = self.shared.db();
        let (versions, active_version) = db.versions(tenant, handler)?;
        let canary = db.canary(tenant, handler)?;
        Ok(VersionsInfo { tenant: tenant.to_owned(), handler: handler.to_owned(), active_version, versions, canary })
    }

    /// Makes a handler's canary its active version, and ends the canary.
    /// The canary is looked at again just before the switch: one aborted
    /// (or replaced) meanwhile is not promoted.
    pub fn promote(&self, tenant: &str, handler: &str) -> StoreResult<Activated> {
        let no_canary = || StoreError::NotFound(format!("{tenant}/{handler} has no canary"));
        let canary = self.shared.db().canary(tenant, handler)?.ok_or_else(no_canary)?;
        let row = self.version_row(&mut **self.shared.db(), tenant, handler, canary.version)?;
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
        let mut db = self.shared.db();
        let canary = db.canary(tenant, handler)?.filter(|c| only.is_none_or(|v| v == c.version));
        let canary = canary.ok_or_else(|| StoreError::NotFound(format!("{tenant}/{handler} has no canary")))?;
        db.set_canary(tenant, handler, None)?;
        drop(db);
        self.serving.refresh_after_commit(tenant, Vec::new());
        tracing::info!(tenant, handler, version = canary.version, "canary ended");
        Ok(canary)
    }

    /// Makes `version` active. It is loaded before the switch: if it cannot
    /// be served, nothing changes.
    pub fn activate(&self, tenant: &str, handler: &str, version: i64) -> StoreResult<Activated> {
        let row = self.version_row(&mut **self.shared.db(), tenant, handler, version)?;
        self.activate_compiled(tenant, handler, &row)
    }

    /// Activates the newest version older than the active one.
    pub fn rollback(&self, tenant: &str, handler: &str) -> StoreResult<Activated> {
        let row = {
            let mut db = self.shared.db();
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

    /// [`Releases::activate_compiled`], switching only if `check` (run
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
        let loading = self.shared.sandbox.memory().charge(&Arc::from(tenant), estimate).map_err(no_memory)?;
        let component = self.artifacts.compile_off_lock(sha256)?;
        drop(loading);
        let mut db = self.shared.db();
        check(&mut **db)?;
        let outgoing_http = self.shared.defaults.with(&db.tenant(tenant)?.overrides).outgoing_http;
        let (tenant_name, handler_name, guest_path) = (tenant.to_owned(), handler.to_owned(), row.guest_path);
        let active = ActiveHandler { tenant: tenant_name, handler: handler_name, version, sha256: sha256.to_owned(), guest_path };
        let loaded = self.artifacts.link(&component, &active, outgoing_http)?;
        let previous_version = db.activate(tenant, handler, version)?;
        if db.canary(tenant, handler)?.is_some_and(|c| c.version == version) {
            db.set_canary(tenant, handler, None)?;
        }
        drop(db);
        self.serving.refresh_after_commit(tenant, vec![Arc::new(loaded)]);
        tracing::info!(tenant, handler, version, ?previous_version, "handler version activated");
        Ok(Activated { tenant: tenant.to_owned(), handler: handler.to_owned(), active_version: version, previous_version })
    }
}

/// How a new version is released, the path its guest sees, and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Releasing {
    /// Active, stored only, or a canary.
    pub release: Release,
    /// The path its guest sees.
    pub guest_path: GuestPath,
    /// Where its bytes came from: [`store::UPLOADED`], or the `oci://…@sha256:…`
    /// reference it was pulled from.
    pub source: String,
}

impl Releasing {
    /// An uploaded version, released as `release`, its guest seeing `guest_path`.
    pub fn uploaded(release: Release, guest_path: GuestPath) -> Self {
        Self { release, guest_path, source: store::UPLOADED.to_owned() }
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
