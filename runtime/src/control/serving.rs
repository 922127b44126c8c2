//! The control plane's part that serving reads ([`Serving`]): building the live snapshot ([`Live`]) from the store and keeping it in
//! step: [`Serving::sync`] (a change made through another node),
//! rebuilds after this node's own changes, this node's share of tenants'
//! limits among the live nodes, and what a rebuild forgets (tenants gone
//! or recreated, idle instances past their time).

use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicBool, AtomicI64};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use super::artifacts::{Artifacts, Compile};
use super::cluster::Cluster;
use super::keys;
use super::live::{ActiveKey, KeyMap, Live, host_routes, live_settings};
use super::rebuild::{Rebuild, incarnations, tenant_row};
use super::shared::Shared;
use super::store::{Store, StoreResult, now_ms};
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

    /// A rebuild's context over `old`, the snapshot it replaces.
    fn rebuild<'a>(&'a self, old: &'a Live, preloaded: &'a [Arc<Handler>], compile: Compile) -> Rebuild<'a> {
        Rebuild { shared: &self.shared, artifacts: &self.artifacts, live_nodes: self.cluster.live_nodes(), old, preloaded, compile }
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
        let build = self.rebuild(&old, preloaded, compile);
        let mut live = Live::default();
        let rows = db.tenants()?;
        build.forget_gone(&incarnations(rows.iter()));
        for row in rows {
            let (name, entry) = build.tenant_entry(row);
            live.tenants_mut().insert(name, entry);
        }
        let mut to_compile = Vec::new();
        for active in db.active_handlers()? {
            let Some(entry) = live.tenants_mut().get_mut(&active.tenant) else { continue };
            to_compile.extend(build.serve_active(db, entry, active));
        }
        for (version, canary) in db.canaries()? {
            to_compile.extend(build.canary_into(db, &mut live, (version, canary)));
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
        live.routes = Arc::new(host_routes(db.routes()?));
        live.settings = Arc::new(live_settings(db.settings(None)?, self.shared.secrets_key.as_ref()));
        super::models::reconcile(&self.shared, db)?;
        build.drop_recreated_meanwhile(db, &mut live)?;
        *self.live.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(live);
        self.generation.store(generation, Ordering::Release);
        self.synced_at_ms.store(now_ms(), Ordering::Release);
        Ok(to_compile)
    }

    /// Reads the routed hostnames again after a change of them here; the
    /// tenants and keys are the current snapshot's.
    pub(super) fn refresh_routes(&self) -> StoreResult<()> {
        // The store held until the swap (see `refresh_settings`).
        let mut db = self.shared.serving_db();
        let routes = Arc::new(host_routes(db.routes()?));
        let _swapping = self.swapping();
        let current = self.live();
        let live = Live { routes, ..current.shared_parts() };
        *self.live.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(live);
        Ok(())
    }

    /// Reads `tenant`'s settings again after a change of them here (its
    /// secrets opened here); the rest is the current snapshot's. The store
    /// is held until the swap: a rebuild waits and reads after it, so an
    /// older read never lands on top of a newer one.
    pub(super) fn refresh_settings(&self, tenant: &str) -> StoreResult<()> {
        let mut db = self.shared.serving_db();
        let rows = db.settings(Some(tenant))?;
        let _swapping = self.swapping();
        let current = self.live();
        let settings = Arc::new(current.settings.with_tenant(tenant, rows, self.shared.secrets_key.as_ref()));
        let live = Live { settings, ..current.shared_parts() };
        *self.live.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(live);
        drop(db);
        Ok(())
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
        if old.tenants.get(tenant).is_some_and(|was| incarnation.as_ref().is_some_and(|now| **now != *was.incarnation)) {
            return self.rebuild_all(db, preloaded, compile);
        }
        let build = self.rebuild(&old, preloaded, compile);
        let mut live = Live { tenants: Arc::clone(&old.tenants), ..Live::default() };
        if let Some(was) = live.tenants_mut().remove(tenant)
            && row.is_none()
        {
            build.forget_tenant(tenant, &was);
        }
        let mut to_compile = Vec::new();
        if let Some(row) = row {
            let (name, mut entry) = build.tenant_entry(row);
            for active in db.active_handlers()?.into_iter().filter(|a| a.tenant == tenant) {
                to_compile.extend(build.serve_active(db, &mut entry, active));
            }
            live.tenants_mut().insert(name, entry);
            for (version, canary) in db.canaries()?.into_iter().filter(|(v, _)| v.tenant == tenant) {
                to_compile.extend(build.canary_into(db, &mut live, (version, canary)));
            }
        }
        // Deleted or created again while this read: rebuilt whole instead.
        if tenant_row(db, tenant)?.map(|r| r.incarnation) != incarnation {
            return self.rebuild_all(db, preloaded, compile);
        }
        let _swapping = self.swapping();
        let current = self.live();
        (live.keys, live.routes, live.settings) = (Arc::clone(&current.keys), Arc::clone(&current.routes), Arc::clone(&current.settings));
        if incarnation.is_none() {
            live.keys_mut().retain(|_, key| key.tenant != tenant);
            // Deleted with the tenant in the store.
            Arc::make_mut(&mut live.routes).retain(|_, route| route.tenant != tenant);
            Arc::make_mut(&mut live.settings).remove(tenant);
        }
        *self.live.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(live);
        Ok(to_compile)
    }
}

/// What one [`Serving::sync`] did.
#[derive(Debug, Default)]
pub struct Synced {
    /// Whether the snapshot was rebuilt.
    pub changed: bool,
    /// Components of active versions this node must compile before it serves them.
    pub to_compile: Vec<String>,
}
