//! The control plane's part that serving reads ([`Serving`]): building the live snapshot ([`Live`]) from the store and keeping it in
//! step: [`Serving::sync`] (a change made through another node),
//! rebuilds after this node's own changes, this node's share of tenants'
//! limits among the live nodes, and what a rebuild forgets (tenants gone
//! or recreated, idle instances past their time).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicBool, AtomicI64};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use super::artifacts::{Artifacts, Compile};
use super::cluster::Cluster;
use super::keys;
use super::live::{ActiveKey, KeyMap, Live, LiveCanary, TenantEntry};
use super::shared::Shared;
use super::store::{self, Canary, Store, StoreError, StoreResult, now_ms};
use crate::admission::gate::new_gate;
use crate::sandbox::handler::Handler;

/// The control plane's part that serving reads: the snapshot (see the module docs).
pub struct Serving {
    shared: Arc<Shared>,
    artifacts: Arc<Artifacts>,
    cluster: Arc<Cluster>,
    /// Store generation the snapshot was built at.
    generation: AtomicI64,
    /// Unix ms when the snapshot was last known current (built, or the generation checked).
    synced_at_ms: AtomicI64,
    /// A component the snapshot waited for has been compiled: the next sync rebuilds it.
    recheck: AtomicBool,
    live: RwLock<Arc<Live>>,
    /// Held by every swap of `live` and a rebuild's read of the keys (see `change_keys`).
    swap: Mutex<()>,
}

impl Serving {
    pub(super) fn new(shared: Arc<Shared>, artifacts: Arc<Artifacts>, cluster: Arc<Cluster>) -> Self {
        Self {
            shared,
            artifacts,
            cluster,
            generation: AtomicI64::new(-1),
            synced_at_ms: AtomicI64::new(0),
            recheck: AtomicBool::new(false),
            live: RwLock::new(Arc::new(Live::default())),
            swap: Mutex::new(()),
        }
    }

    /// Makes the next sync rebuild the snapshot though the store did not
    /// change: a component it waited for has been compiled (or may be now).
    pub fn recheck_soon(&self) {
        self.recheck.store(true, Ordering::Release);
    }

    /// Rebuilds the snapshot if the store changed since it was built (a
    /// change made through another node) or a component it waited for was
    /// compiled since. A component this node has neither cached nor found
    /// compiled by another node is not compiled here: its handler keeps the
    /// version it served (a new handler waits), and the component is listed
    /// in [`Synced::to_compile`] for [`Artifacts::precompile`]. So a compile
    /// never holds back the rest of a change, a revoked key least of all.
    pub fn sync(&self) -> StoreResult<Synced> {
        let generation = self.shared.serving_db().generation()?;
        let recheck = self.recheck.swap(false, Ordering::AcqRel);
        if generation == self.generation.load(Ordering::Acquire) && !recheck {
            self.synced_at_ms.store(now_ms(), Ordering::Release);
            return Ok(Synced::default());
        }
        let to_compile = self.refresh(Vec::new(), Compile::Later).inspect_err(|_| {
            if recheck {
                // Not rebuilt: the compiled version is still to be swapped in.
                self.recheck_soon();
            }
        })?;
        Ok(Synced { changed: true, to_compile })
    }

    /// How long since the snapshot was last known to match the store.
    pub fn snapshot_age(&self) -> Duration {
        Duration::from_millis(u64::try_from(now_ms() - self.synced_at_ms.load(Ordering::Acquire)).unwrap_or(0))
    }

    /// Store generation of the current snapshot.
    pub fn generation(&self) -> i64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The current snapshot.
    pub fn live(&self) -> Arc<Live> {
        Arc::clone(&self.live.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Forgets the tenants of `old` that are gone from the store, or were
    /// deleted and created again under their name (another incarnation):
    /// the new one starts afresh, and none of the old one's handlers is
    /// served to it.
    fn forget_gone(&self, old: &Live, incarnations: &HashMap<&str, &str>) {
        for (name, entry) in old.tenants.iter() {
            if incarnations.get(name.as_str()) != Some(&entry.incarnation.as_str()) {
                self.forget_tenant(name, entry);
            }
        }
    }

    /// The snapshot entry for a tenant row (handlers added later): the gate
    /// of the same incarnation is kept while its limits are unchanged.
    fn tenant_entry(&self, old: &Live, row: store::TenantRow) -> (String, TenantEntry) {
        let limits = self.shared.defaults.with(&row.overrides);
        let previous = old.tenants.get(&row.name).filter(|e| e.incarnation == row.incarnation);
        let gate = match previous {
            Some(entry) if entry.gate.limits == limits => Arc::clone(&entry.gate),
            previous => {
                // Idle instances were made under the old limits (reuse,
                // memory, concurrency): none of those waiting now outlives the change.
                previous.into_iter().flat_map(TenantEntry::all_handlers).for_each(|h| h.warm.clear());
                Arc::new(new_gate(limits, previous.map(|e| &*e.gate), self.cluster.live_nodes()))
            }
        };
        let weight = self.shared.weight(&row.name, &row.overrides);
        for model in self.shared.models.iter() {
            model.set_tenant_weight(&row.name, weight);
        }
        (row.name, TenantEntry { incarnation: row.incarnation, gate, handlers: HashMap::new(), canaries: HashMap::new() })
    }

    /// The store is read in several statements: a tenant deleted (and
    /// perhaps created again) between the first and the last would mix two
    /// incarnations in one snapshot (the old one's handlers, the new one's
    /// keys). Such a tenant is left out of this snapshot and forgotten; the
    /// change bumped the generation, so the next sync brings it in whole.
    fn drop_recreated_meanwhile(&self, db: &mut dyn Store, live: &mut Live) -> StoreResult<()> {
        let rows = db.tenants()?;
        let now = incarnations(rows.iter());
        let changed: Vec<String> = live
            .tenants
            .iter()
            .filter(|(name, entry)| now.get(name.as_str()) != Some(&entry.incarnation.as_str()))
            .map(|(name, _)| name.clone())
            .collect();
        for name in changed {
            if let Some(entry) = live.tenants_mut().remove(&name) {
                tracing::info!(tenant = %name, "tenant deleted or created again while the snapshot was read; it follows at the next sync");
                self.forget_tenant(&name, &entry);
            }
            live.keys_mut().retain(|_, key| key.tenant != name);
        }
        Ok(())
    }

    /// Drops what the server keeps of a tenant that is gone (deleted, or
    /// deleted and created again): its batcher queues' state, its counters
    /// and its handlers' idle instances.
    fn forget_tenant(&self, name: &str, entry: &TenantEntry) {
        for model in self.shared.models.iter() {
            model.remove_tenant(name);
        }
        for counters in &self.shared.counters {
            counters.forget_tenant(name);
        }
        for handler in entry.all_handlers() {
            handler.warm.clear();
        }
    }

    /// Drops the idle instances of the handlers served now that waited
    /// longer than `--warm-idle-secs` (the sync thread calls this).
    pub fn expire_idle_instances(&self) {
        let idle_for = self.shared.sandbox.warm_idle();
        for entry in self.live().tenants.values() {
            for handler in entry.all_handlers() {
                handler.warm.expire(idle_for);
            }
        }
    }

    /// After a change of `tenant` is committed (only its entry is rebuilt,
    /// see [`Self::refresh_tenant`]): the change stands whatever happens next,
    /// so a snapshot that cannot be rebuilt now (the store went away) is
    /// logged, not reported as the change failing; the sync thread retries
    /// (the generation it holds is still the old one). It never compiles:
    /// the caller holds the store's lock, and what this node has not
    /// compiled (a version deployed through another node) is left to the
    /// sync's compile thread, asked for at the next sync.
    pub(super) fn refresh_after_commit(&self, tenant: &str, preloaded: Vec<Arc<Handler>>) {
        match self.refresh_tenant(tenant, &preloaded, Compile::Later) {
            Ok(to_compile) if !to_compile.is_empty() => self.recheck_soon(),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "change stored; the snapshot follows when the store answers again"),
        }
    }

    /// Applies a key change this node committed at `generation` to the
    /// snapshot, after the store's lock `db` is released: only the key map
    /// is copied (see [`Live::with_keys`]); tenants, gates and handlers are
    /// shared. The swap lock is taken before `db` is released, so key
    /// changes apply in the order they committed, and a rebuild (which
    /// reads the keys and swaps under the same lock) never swaps in an
    /// older view of the keys after a newer change. If the snapshot was the
    /// store just before this change, it is the store at `generation` now:
    /// the sync finds nothing to rebuild.
    pub(super) fn change_keys(&self, db: MutexGuard<'_, Box<dyn Store>>, generation: i64, change: impl FnOnce(&mut KeyMap)) {
        let swapping = self.swapping();
        drop(db);
        let next = Arc::new(self.live().with_keys(change));
        *self.live.write().unwrap_or_else(std::sync::PoisonError::into_inner) = next;
        let _ = self.generation.compare_exchange(generation - 1, generation, Ordering::AcqRel, Ordering::Acquire);
        drop(swapping);
    }

    /// The lock every swap of the snapshot holds; taken while a store
    /// connection's lock is held (the main one by a key change, the
    /// snapshot's by a rebuild), never the other way round.
    fn swapping(&self) -> MutexGuard<'_, ()> {
        self.swap.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Builds a new snapshot from the database and swaps it in. Handlers
    /// already loaded at the same version are reused, as are tenant gates
    /// whose limits did not change. Returns the components left to compile
    /// (under [`Compile::Later`]).
    pub(super) fn refresh(&self, preloaded: Vec<Arc<Handler>>, compile: Compile) -> StoreResult<Vec<String>> {
        let mut db = self.shared.serving_db();
        self.rebuild_all(&mut **db, &preloaded, compile)
    }

    /// [`Self::refresh`] on the snapshot's connection `db`, held throughout.
    fn rebuild_all(&self, db: &mut dyn Store, preloaded: &[Arc<Handler>], compile: Compile) -> StoreResult<Vec<String>> {
        // Read first: a change committed while this runs bumps it again, and the next sync catches it.
        let generation = db.generation()?;
        let old = self.live();
        let mut live = Live::default();
        let rows = db.tenants()?;
        self.forget_gone(&old, &incarnations(rows.iter()));
        for row in rows {
            let (name, entry) = self.tenant_entry(&old, row);
            live.tenants_mut().insert(name, entry);
        }
        let mut to_compile = Vec::new();
        for active in db.active_handlers()? {
            let Some(entry) = live.tenants_mut().get_mut(&active.tenant) else { continue };
            to_compile.extend(self.serve_active(db, &old, (preloaded, compile), entry, active));
        }
        for (version, canary) in db.canaries()? {
            to_compile.extend(self.canary_into(db, &old, (preloaded, compile), &mut live, (version, canary)));
        }
        // The keys are read under the swap lock: a key change committed
        // before this read is in it, one committed after it waits to apply
        // on top (see `change_keys`), so no revoked key comes back.
        let _swapping = self.swapping();
        for (id, tenant, sha, scopes) in db.active_keys()? {
            if let Some(secret_sha256) = keys::digest_from_hex(&sha) {
                live.keys_mut().insert(Arc::from(id), Arc::new(ActiveKey { tenant, secret_sha256, scopes }));
            }
        }
        self.drop_recreated_meanwhile(db, &mut live)?;
        *self.live.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(live);
        self.generation.store(generation, Ordering::Release);
        self.synced_at_ms.store(now_ms(), Ordering::Release);
        Ok(to_compile)
    }

    /// Rebuilds only `tenant`'s entry after a change that touched only it
    /// (its limits, a version, a canary; its creation or deletion): the
    /// other tenants' entries and the keys are shared with the current
    /// snapshot, not read again. A tenant deleted and created again
    /// meanwhile is rebuilt with everything else. The snapshot's generation
    /// is left as it was: the sync's next check rebuilds it whole, off the
    /// change's path.
    pub(super) fn refresh_tenant(&self, tenant: &str, preloaded: &[Arc<Handler>], compile: Compile) -> StoreResult<Vec<String>> {
        let mut guard = self.shared.serving_db();
        let db = &mut **guard;
        let old = self.live();
        let row = tenant_row(db, tenant)?;
        let incarnation = row.as_ref().map(|r| r.incarnation.clone());
        if old.tenants.get(tenant).is_some_and(|was| incarnation.as_ref().is_some_and(|now| *now != was.incarnation)) {
            return self.rebuild_all(db, preloaded, compile);
        }
        let mut live = Live { tenants: Arc::clone(&old.tenants), keys: Arc::default() };
        if let Some(was) = live.tenants_mut().remove(tenant)
            && row.is_none()
        {
            self.forget_tenant(tenant, &was);
        }
        let mut to_compile = Vec::new();
        if let Some(row) = row {
            let (name, mut entry) = self.tenant_entry(&old, row);
            for active in db.active_handlers()?.into_iter().filter(|a| a.tenant == tenant) {
                to_compile.extend(self.serve_active(db, &old, (preloaded, compile), &mut entry, active));
            }
            live.tenants_mut().insert(name, entry);
            for (version, canary) in db.canaries()?.into_iter().filter(|(v, _)| v.tenant == tenant) {
                to_compile.extend(self.canary_into(db, &old, (preloaded, compile), &mut live, (version, canary)));
            }
        }
        // Deleted or created again while this read: rebuilt whole instead.
        if tenant_row(db, tenant)?.map(|r| r.incarnation) != incarnation {
            return self.rebuild_all(db, preloaded, compile);
        }
        let _swapping = self.swapping();
        let current = self.live();
        live.keys = Arc::clone(&current.keys);
        if incarnation.is_none() {
            live.keys_mut().retain(|_, key| key.tenant != tenant);
        }
        *self.live.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(live);
        Ok(to_compile)
    }

    /// Puts `active` into `entry`: the handler served before or `preloaded`
    /// if the same version, else loaded. Returns its component when it must
    /// be compiled first (the version served before stays meanwhile).
    fn serve_active(
        &self,
        db: &mut dyn Store,
        old: &Live,
        (preloaded, compile): (&[Arc<Handler>], Compile),
        entry: &mut TenantEntry,
        active: store::ActiveHandler,
    ) -> Option<String> {
        let outgoing_http = entry.gate.limits.outgoing_http;
        let same = |h: &&Arc<Handler>| h.version == active.version && h.sha256 == active.sha256 && h.outgoing_http == outgoing_http;
        // What this tenant (this incarnation of it) served before.
        let served =
            old.tenants.get(&active.tenant).filter(|e| e.incarnation == entry.incarnation).and_then(|e| e.handlers.get(&active.handler));
        let reused = preloaded
            .iter()
            .find(|h| *h.tenant == *active.tenant && h.name == active.handler && same(h))
            .or_else(|| served.filter(same))
            .cloned();
        let loaded = match reused {
            Some(handler) => Ok(Some(handler)),
            None => self.artifacts.load_handler_if(db, &active, outgoing_http, compile).map(|h| h.map(Arc::new)),
        };
        // The version being served stays (if its grant did not change)
        // while the new one compiles, or when it cannot be loaded: a
        // change made elsewhere must not take the handler away.
        let kept = || served.filter(|h| h.outgoing_http == outgoing_http).cloned();
        let mut to_compile = None;
        let handler = match loaded {
            Ok(Some(handler)) => Some(handler),
            Ok(None) => {
                tracing::info!(tenant = %active.tenant, handler = %active.handler, version = active.version, "compiling a version deployed elsewhere; serving the previous one meanwhile");
                to_compile = Some(active.sha256.clone());
                kept()
            }
            Err(e) => {
                let kept = kept();
                tracing::error!(tenant = %active.tenant, handler = %active.handler, version = active.version, kept = ?kept.as_ref().map(|h| h.version), error = %e, "cannot load handler version");
                kept
            }
        };
        if let Some(handler) = handler {
            entry.handlers.insert(active.handler, handler);
        }
        to_compile
    }
}

/// `tenant`'s row, `None` if there is no such tenant.
fn tenant_row(db: &mut dyn Store, tenant: &str) -> StoreResult<Option<store::TenantRow>> {
    match db.tenant(tenant) {
        Ok(row) => Ok(Some(row)),
        Err(StoreError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

impl Serving {
    /// Puts a canary into `live` beside its handler's active version: the
    /// one served before if it is the same version (its counts kept while
    /// the active version is the same too), else loaded. Returns the
    /// component to compile when it is not ready yet
    /// (the canary waits; the active version serves all).
    fn canary_into(
        &self,
        db: &mut dyn Store,
        old: &Live,
        (preloaded, compile): (&[Arc<Handler>], Compile),
        live: &mut Live,
        (version, canary): (store::ActiveHandler, Canary),
    ) -> Option<String> {
        let entry = live.tenants_mut().get_mut(&version.tenant).filter(|e| e.handlers.contains_key(&version.handler))?;
        let outgoing_http = entry.gate.limits.outgoing_http;
        let same = |h: &Arc<Handler>| h.version == version.version && h.sha256 == version.sha256 && h.outgoing_http == outgoing_http;
        // The counts compare the canary with the version served beside it:
        // another active version starts both afresh.
        let stable = entry.handlers.get(&version.handler).map(|h| h.version);
        let before = old
            .tenants
            .get(&version.tenant)
            .filter(|e| e.incarnation == entry.incarnation && e.handlers.get(&version.handler).map(|h| h.version) == stable)
            .and_then(|e| e.canaries.get(&version.handler))
            .filter(|c| same(&c.handler));
        let (handler, counts) = match before {
            Some(c) => (Arc::clone(&c.handler), Arc::clone(&c.counts)),
            None => {
                let ready = preloaded.iter().find(|h| *h.tenant == *version.tenant && h.name == version.handler && same(h)).cloned();
                let handler = match ready {
                    Some(handler) => handler,
                    None => match self.artifacts.load_handler_if(db, &version, outgoing_http, compile) {
                        Ok(Some(handler)) => Arc::new(handler),
                        Ok(None) => return Some(version.sha256.clone()),
                        Err(e) => {
                            tracing::error!(tenant = %version.tenant, handler = %version.handler, version = version.version, error = %e, "cannot load canary version");
                            return None;
                        }
                    },
                };
                (handler, Arc::default())
            }
        };
        entry.canaries.insert(version.handler.clone(), Arc::new(LiveCanary { handler, canary, counts }));
        None
    }
}

/// Each tenant row's incarnation, by name.
fn incarnations<'a>(rows: impl Iterator<Item = &'a store::TenantRow>) -> HashMap<&'a str, &'a str> {
    rows.map(|r| (r.name.as_str(), r.incarnation.as_str())).collect()
}

/// What one [`Serving::sync`] did.
#[derive(Debug, Default)]
pub struct Synced {
    /// Whether the snapshot was rebuilt.
    pub changed: bool,
    /// Components of active versions this node must compile before it serves them.
    pub to_compile: Vec<String>,
}
