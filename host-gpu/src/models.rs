//! The models a host serves ([`Models`]), by name, each behind a batcher of
//! its own. Some are loaded for good (pinned: the reference model a node
//! starts with); the others are loaded on demand by a [`ModelLoader`] and
//! unloaded, least recently used first, when the loaded ones would pass the
//! model-memory bound (a load reserves its bytes before it starts). A call
//! to a model that is not loaded waits for its load (one load however many
//! calls wait, on a thread of its own that ends whether or not they still
//! wait); a model unloaded while calls are queued on it finishes them
//! first (they hold its batcher), and its memory is freed when they end.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::{Arbiter, BatchObserver, Batcher, CallOptions, InferError, InferRequest, ModelSpec, Tensor};

/// Opens a model's engines and starts its batcher, for [`Models`] to load
/// on demand. The host implements it (files, devices, sessions, budgets).
pub trait ModelLoader: Send + Sync {
    /// Loads the model, its batcher started in `arbiter` (the registry's:
    /// see [`Models::arbiter`]). Blocking: [`Models`] calls it on a thread
    /// of its own.
    fn load(&self, arbiter: &Arbiter) -> Result<Loaded, String>;
}

/// A loaded model: its batcher and what the loader charged for it
/// (released when the model is unloaded).
pub struct Loaded {
    /// The model's batcher over its devices.
    pub batcher: Batcher,
    /// Dropped when the model is unloaded (a memory-budget charge, say).
    pub hold: Option<Box<dyn Any + Send + Sync>>,
}

impl Loaded {
    /// A batcher that holds nothing else.
    pub fn new(batcher: Batcher) -> Self {
        Self { batcher, hold: None }
    }
}

/// What [`Models::states`] says of one model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelState {
    /// The model's name.
    pub name: String,
    /// Whether its engines are loaded now.
    pub loaded: bool,
    /// Loaded for good: never unloaded to make room.
    pub pinned: bool,
    /// What it counts against the model-memory bound while loaded.
    pub bytes: u64,
    /// Loads on demand since it was added (not counting one at start).
    pub loads: u64,
    /// Times it was unloaded to make room for another.
    pub evictions: u64,
    /// How long its last load on demand took.
    pub last_load: Option<Duration>,
}

/// The models a host serves (see the module docs). Clones share one registry.
#[derive(Clone, Default)]
pub struct Models {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    registry: RwLock<Registry>,
    /// Where every model's batcher is started: one virtual clock, the devices shared.
    arbiter: Arbiter,
    /// Traces' observer of batches, for models loaded later too.
    observer: Mutex<Option<Arc<dyn BatchObserver>>>,
    /// The clock of `last_used` stamps.
    epoch: EpochClock,
    /// Numbers entries: a model replaced under its name is another entry.
    next_id: AtomicU64,
}

struct EpochClock(Instant);

impl Default for EpochClock {
    fn default() -> Self {
        Self(Instant::now())
    }
}

impl EpochClock {
    fn now(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// How long a model whose load failed answers that failure at once
/// instead of loading again.
const LOAD_RETRY_AFTER: Duration = Duration::from_secs(5);

/// What a load's waiters are told when it ends: look again, or why not.
type LoadOutcome = Option<Result<(), InferError>>;

#[derive(Default)]
struct Registry {
    entries: BTreeMap<String, Entry>,
    /// At most this many bytes of models loaded (or loading) at once
    /// (`None`: no bound).
    bound: Option<u64>,
}

struct Entry {
    id: u64,
    spec: ModelSpec,
    bytes: u64,
    loader: Option<Arc<dyn ModelLoader>>,
    loaded: Option<Loaded>,
    /// Microseconds on the registry's clock of the last call.
    last_used: AtomicU64,
    /// The load running now (its bytes are reserved): its waiters watch this.
    loading: Option<watch::Receiver<LoadOutcome>>,
    /// The last load's failure, and when.
    failed: Option<(Instant, InferError)>,
    loads: u64,
    evictions: u64,
    last_load: Option<Duration>,
}

impl Entry {
    /// Loaded for good: no loader to load it again.
    fn pinned(&self) -> bool {
        self.loader.is_none()
    }

    fn holds(&self) -> bool {
        self.loaded.is_some() || self.loading.is_some()
    }
}

/// Where a call to a model stands.
enum Lookup {
    Loaded(Batcher),
    Loading(watch::Receiver<LoadOutcome>),
}

impl Registry {
    /// Bytes of the models loaded now or loading.
    fn used(&self) -> u64 {
        self.entries.values().filter(|e| e.holds()).map(|e| e.bytes).sum()
    }

    /// Unloads the least recently used models but `keep` until `bytes`
    /// more fit, into `victims` (dropped by the caller, outside the lock);
    /// refused, unloading nothing, when they would not fit even then.
    fn make_room(&mut self, keep: &str, bytes: u64, victims: &mut Vec<Loaded>) -> Result<(), InferError> {
        let Some(bound) = self.bound else { return Ok(()) };
        let fixed: u64 = self
            .entries
            .iter()
            .filter(|(name, e)| e.holds() && (e.pinned() || e.loading.is_some() || name.as_str() == keep))
            .map(|(_, e)| e.bytes)
            .sum();
        if fixed.saturating_add(bytes) > bound {
            return Err(InferError::ModelMemory(format!(
                "model {keep} needs {} MiB, and the models that cannot be unloaded now (pinned or loading) hold {} of the {} MiB model-memory bound",
                mib(bytes),
                mib(fixed),
                mib(bound)
            )));
        }
        while self.used().saturating_add(bytes) > bound {
            let victim = self
                .entries
                .iter_mut()
                .filter(|(name, e)| e.loaded.is_some() && !e.pinned() && name.as_str() != keep)
                .min_by_key(|(_, e)| e.last_used.load(Ordering::Relaxed));
            let Some((name, entry)) = victim else { break };
            victims.extend(entry.loaded.take());
            entry.evictions += 1;
            tracing::info!(model = %name, to_load = keep, "model unloaded to make room (least recently used)");
        }
        Ok(())
    }
}

fn mib(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

impl Models {
    /// An empty registry, no memory bound.
    pub fn new() -> Self {
        Self::default()
    }

    /// Where the models' batchers are started (by the host, and by each
    /// [`ModelLoader`]): their tenants share one virtual clock, and each
    /// device runs the batch of the least served tenant, whatever its model
    /// (see [`crate::arbiter`]).
    pub fn arbiter(&self) -> &Arbiter {
        &self.inner.arbiter
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Registry> {
        self.inner.registry.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Registry> {
        self.inner.registry.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn entry(&self, spec: ModelSpec, bytes: u64, loader: Option<Arc<dyn ModelLoader>>, loaded: Option<Loaded>) -> Entry {
        Entry {
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            spec,
            bytes,
            loader,
            loaded,
            last_used: AtomicU64::new(0),
            loading: None,
            failed: None,
            loads: 0,
            evictions: 0,
            last_load: None,
        }
    }

    /// Bounds the bytes of the models loaded (or loading) at once (`None`:
    /// unbounded). The models loaded for good ([`Models::insert`]) count
    /// nothing; the others count what [`Models::insert_on_demand`] says.
    pub fn set_memory_bound(&self, bytes: Option<u64>) {
        self.write().bound = bytes;
    }

    /// The bytes of the models loaded (or loading) now, and the bound.
    pub fn memory(&self) -> (u64, Option<u64>) {
        let registry = self.read();
        (registry.used(), registry.bound)
    }

    /// Adds (or replaces) a model loaded for good, keyed by its spec's name.
    pub fn insert(&self, batcher: Batcher) {
        let spec = batcher.spec().clone();
        let entry = self.entry(spec.clone(), 0, None, Some(Loaded::new(batcher)));
        let replaced = self.write().entries.insert(spec.name, entry);
        drop(replaced);
    }

    /// Adds (or replaces) a model that `loader` loads on demand, counting
    /// `bytes` against the bound while loaded. `loaded`: already loaded
    /// (at start, say); refused when it would pass the bound (nothing is
    /// unloaded for it).
    pub fn insert_on_demand(
        &self,
        spec: ModelSpec,
        bytes: u64,
        loader: Arc<dyn ModelLoader>,
        loaded: Option<Loaded>,
    ) -> Result<(), InferError> {
        let name = spec.name.clone();
        let entry = self.entry(spec, bytes, Some(loader), loaded);
        let mut registry = self.write();
        // What it replaces is dropped once the lock is released (its workers join).
        let replaced = registry.entries.remove(&name);
        if entry.loaded.is_some()
            && let Some(bound) = registry.bound.filter(|bound| registry.used().saturating_add(bytes) > *bound)
        {
            let used = registry.used();
            drop(registry);
            drop(replaced);
            return Err(InferError::ModelMemory(format!(
                "model {name} needs {} MiB; {} of the {} MiB model-memory bound are loaded",
                mib(bytes),
                mib(used),
                mib(bound)
            )));
        }
        registry.entries.insert(name, entry);
        drop(registry);
        drop(replaced);
        Ok(())
    }

    /// Stops serving a model: later calls are [`InferError::UnknownModel`];
    /// calls queued already are answered. Returns whether it was served.
    pub fn remove(&self, name: &str) -> bool {
        let removed = self.write().entries.remove(name);
        removed.is_some()
    }

    /// The batcher of a model, if it is loaded now.
    pub fn get(&self, name: &str) -> Option<Batcher> {
        self.read().entries.get(name).and_then(|e| e.loaded.as_ref()).map(|l| l.batcher.clone())
    }

    /// The batchers of the models loaded now, by name.
    pub fn iter(&self) -> std::vec::IntoIter<Batcher> {
        let loaded: Vec<Batcher> = self.read().entries.values().filter_map(|e| e.loaded.as_ref()).map(|l| l.batcher.clone()).collect();
        loaded.into_iter()
    }

    /// The specs of every model served, loaded or not, by name.
    pub fn specs(&self) -> Vec<ModelSpec> {
        self.read().entries.values().map(|e| e.spec.clone()).collect()
    }

    /// Whether a model of that name is served (loaded or not).
    pub fn contains(&self, name: &str) -> bool {
        self.read().entries.contains_key(name)
    }

    /// Every model's state, by name.
    pub fn states(&self) -> Vec<ModelState> {
        let registry = self.read();
        registry
            .entries
            .iter()
            .map(|(name, e)| ModelState {
                name: name.clone(),
                loaded: e.loaded.is_some(),
                pinned: e.pinned(),
                bytes: e.bytes,
                loads: e.loads,
                evictions: e.evictions,
                last_load: e.last_load,
            })
            .collect()
    }

    /// Sets a tenant's fairness weight for every model: in the arbiter's
    /// ledger, which models loaded later share, and in any batcher inserted
    /// from another arbiter (see [`Batcher::set_tenant_weight`]).
    pub fn set_tenant_weight(&self, tenant: &str, weight: u32) {
        self.inner.arbiter.set_tenant_weight(tenant, weight);
        for batcher in self.iter() {
            batcher.set_tenant_weight(tenant, weight);
        }
    }

    /// Forgets a tenant in every model's batcher, answering its waiting
    /// calls [`InferError::ShuttingDown`] (see [`Batcher::remove_tenant`]);
    /// returns how many calls were answered so.
    pub fn remove_tenant(&self, tenant: &str) -> usize {
        self.iter().map(|batcher| batcher.remove_tenant(tenant)).sum()
    }

    /// Has `observer` watch every model's batches, those loaded later too
    /// (see [`Batcher::observe`]).
    pub fn observe(&self, observer: Arc<dyn BatchObserver>) {
        *self.inner.observer.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&observer));
        for batcher in self.iter() {
            batcher.observe(Arc::clone(&observer));
        }
    }

    /// Runs one sample through the named model.
    pub async fn infer(&self, model: &str, request: InferRequest) -> Result<Vec<Tensor>, InferError> {
        self.infer_with(model, request, CallOptions::default()).await
    }

    /// [`Models::infer`] with `options` (see [`Batcher::infer_with`]); a
    /// model not loaded is loaded first.
    pub async fn infer_with(&self, model: &str, request: InferRequest, options: CallOptions) -> Result<Vec<Tensor>, InferError> {
        self.batcher(model).await?.infer_with(request, options).await
    }

    /// The batcher of a model, loading it (and unloading others to make
    /// room) when it is not loaded. The load runs on a thread of its own
    /// and ends whether or not its callers still wait.
    pub async fn batcher(&self, name: &str) -> Result<Batcher, InferError> {
        // A model unloaded or replaced (another version) between its load
        // and the look that follows is looked up again; a few times at most.
        for _ in 0..3 {
            let mut loading = match self.lookup(name)? {
                Lookup::Loaded(batcher) => return Ok(batcher),
                Lookup::Loading(loading) => loading,
            };
            let outcome = loading.wait_for(Option::is_some).await.map(|outcome| outcome.clone());
            match outcome {
                Ok(Some(Err(e))) => return Err(e),
                Ok(_) => continue,
                Err(_) => return Err(InferError::Backend(format!("loading model {name}: the load ended without an answer"))),
            }
        }
        Err(InferError::Overloaded)
    }

    /// The model's batcher when loaded, else the load to wait for (started
    /// here when none runs).
    fn lookup(&self, name: &str) -> Result<Lookup, InferError> {
        {
            let registry = self.read();
            let entry = registry.entries.get(name).ok_or_else(|| InferError::UnknownModel(name.to_owned()))?;
            entry.last_used.store(self.inner.epoch.now(), Ordering::Relaxed);
            if let Some(loaded) = &entry.loaded {
                return Ok(Lookup::Loaded(loaded.batcher.clone()));
            }
            if let Some(loading) = &entry.loading {
                return Ok(Lookup::Loading(loading.clone()));
            }
        }
        let mut victims = Vec::new();
        let started = self.start_load(&mut self.write(), name, &mut victims);
        drop(victims);
        started
    }

    /// Starts loading `name` under the registry's lock, its bytes reserved
    /// (others unloaded into `victims` to make room).
    fn start_load(&self, registry: &mut Registry, name: &str, victims: &mut Vec<Loaded>) -> Result<Lookup, InferError> {
        let entry = registry.entries.get(name).ok_or_else(|| InferError::UnknownModel(name.to_owned()))?;
        if let Some(loaded) = &entry.loaded {
            return Ok(Lookup::Loaded(loaded.batcher.clone()));
        }
        if let Some(loading) = &entry.loading {
            return Ok(Lookup::Loading(loading.clone()));
        }
        if let Some((at, failure)) = &entry.failed
            && at.elapsed() < LOAD_RETRY_AFTER
        {
            return Err(failure.clone());
        }
        let (id, bytes) = (entry.id, entry.bytes);
        let loader = entry.loader.clone().ok_or_else(|| InferError::UnknownModel(name.to_owned()))?;
        registry.make_room(name, bytes, victims)?;
        let (done, loading) = watch::channel(None);
        let (models, owned) = (self.clone(), name.to_owned());
        let arbiter = self.inner.arbiter.clone();
        std::thread::Builder::new()
            .name(format!("load-{name}"))
            .spawn(move || {
                let started = Instant::now();
                let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| loader.load(&arbiter)))
                    .unwrap_or_else(|_| Err("the loader panicked".to_owned()));
                let _ = done.send(Some(models.finish_load(&owned, id, loaded, started.elapsed())));
            })
            .map_err(|e| InferError::Backend(format!("cannot start a thread to load model {name}: {e}")))?;
        if let Some(entry) = registry.entries.get_mut(name) {
            entry.loading = Some(loading.clone());
        }
        Ok(Lookup::Loading(loading))
    }

    /// Records how a load ended, if its entry is still the one it loaded
    /// (a model replaced or removed meanwhile drops what was loaded).
    fn finish_load(&self, name: &str, id: u64, loaded: Result<Loaded, String>, took: Duration) -> Result<(), InferError> {
        if let Ok(loaded) = &loaded
            && let Some(observer) = self.inner.observer.lock().unwrap_or_else(PoisonError::into_inner).as_ref()
        {
            loaded.batcher.observe(Arc::clone(observer));
        }
        let mut registry = self.write();
        let Some(entry) = registry.entries.get_mut(name).filter(|e| e.id == id) else {
            drop(registry);
            drop(loaded);
            return Ok(());
        };
        entry.loading = None;
        match loaded {
            Ok(loaded) => {
                entry.spec = loaded.batcher.spec().clone();
                entry.loaded = Some(loaded);
                entry.loads += 1;
                entry.last_load = Some(took);
                tracing::info!(model = name, took_ms = took.as_millis(), "model loaded on demand");
                Ok(())
            }
            Err(e) => {
                let failure = InferError::Backend(format!("loading model {name}: {e}"));
                entry.failed = Some((Instant::now(), failure.clone()));
                tracing::warn!(model = name, error = %e, "model load failed");
                Err(failure)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::backend::fake::FakeBackend;
    use crate::{BatcherConfig, ElementType};

    struct FakeLoader {
        name: &'static str,
        loads: Arc<AtomicUsize>,
    }

    impl ModelLoader for FakeLoader {
        fn load(&self, arbiter: &Arbiter) -> Result<Loaded, String> {
            self.loads.fetch_add(1, Ordering::SeqCst);
            // Long enough for the other calls to arrive while it loads.
            std::thread::sleep(Duration::from_millis(50));
            Ok(Loaded::new(fake_batcher_in(arbiter, self.name)))
        }
    }

    fn fake_batcher(name: &str) -> Batcher {
        fake_batcher_in(&Arbiter::new(), name)
    }

    fn fake_batcher_in(arbiter: &Arbiter, name: &str) -> Batcher {
        let backend = FakeBackend::new(name, 8, Duration::from_millis(1), Duration::ZERO);
        Batcher::start_in(arbiter, vec![Box::new(backend)], &BatcherConfig::default()).unwrap()
    }

    fn on_demand(models: &Models, name: &'static str, bytes: u64) -> Arc<AtomicUsize> {
        let loads = Arc::new(AtomicUsize::new(0));
        let spec = fake_batcher(name).spec().clone();
        models.insert_on_demand(spec, bytes, Arc::new(FakeLoader { name, loads: Arc::clone(&loads) }), None).unwrap();
        loads
    }

    fn request() -> InferRequest {
        let input = Tensor::new(vec![4], ElementType::U8, vec![0; 4]).unwrap();
        InferRequest { tenant: "t".into(), input, deadline: Instant::now() + Duration::from_secs(5) }
    }

    fn loaded(models: &Models) -> Vec<String> {
        models.states().into_iter().filter(|s| s.loaded).map(|s| s.name).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_the_bound_the_least_recently_used_model_is_unloaded_and_loaded_again_on_its_next_call() {
        let models = Models::new();
        models.insert(fake_batcher_in(models.arbiter(), "pinned"));
        models.set_memory_bound(Some(250));
        let a = on_demand(&models, "a", 100);
        let b = on_demand(&models, "b", 100);
        let c = on_demand(&models, "c", 100);
        assert!(loaded(&models) == ["pinned"], "nothing loaded before a call");
        models.infer("a", request()).await.unwrap();
        models.infer("b", request()).await.unwrap();
        models.infer("a", request()).await.unwrap();
        assert_eq!(loaded(&models), ["a", "b", "pinned"]);
        // c does not fit beside a and b: b, the least recently used, goes.
        models.infer("c", request()).await.unwrap();
        assert_eq!(loaded(&models), ["a", "c", "pinned"]);
        models.infer("b", request()).await.unwrap();
        assert_eq!(loaded(&models), ["b", "c", "pinned"]);
        assert_eq!((a.load(Ordering::SeqCst), b.load(Ordering::SeqCst), c.load(Ordering::SeqCst)), (1, 2, 1));
        let b_state = models.states().into_iter().find(|s| s.name == "b").unwrap();
        assert_eq!((b_state.loads, b_state.evictions), (2, 1));
        assert!(b_state.last_load.is_some());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_calls_to_a_model_not_loaded_share_one_load() {
        let models = Models::new();
        let loads = on_demand(&models, "a", 1);
        let calls: Vec<_> = (0..16)
            .map(|_| {
                let models = models.clone();
                tokio::spawn(async move { models.infer("a", request()).await })
            })
            .collect();
        for call in calls {
            call.await.unwrap().unwrap();
        }
        assert_eq!(loads.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_model_replaced_while_it_loads_is_served_as_replaced() {
        let models = Models::new();
        let first = on_demand(&models, "a", 1);
        let call = {
            let models = models.clone();
            tokio::spawn(async move { models.infer("a", request()).await })
        };
        // While the first version loads (50 ms), another takes its place.
        tokio::time::sleep(Duration::from_millis(10)).await;
        let second = on_demand(&models, "a", 1);
        call.await.unwrap().unwrap();
        assert_eq!((first.load(Ordering::SeqCst), second.load(Ordering::SeqCst)), (1, 1), "the first load was not installed");
        let state = models.states().into_iter().find(|s| s.name == "a").unwrap();
        assert_eq!((state.loaded, state.loads), (true, 1), "the second version is loaded, once");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_load_goes_on_when_its_caller_goes_and_loads_in_flight_count_against_the_bound() {
        let models = Models::new();
        models.set_memory_bound(Some(150));
        let a = on_demand(&models, "a", 100);
        on_demand(&models, "b", 100);
        let call = {
            let models = models.clone();
            tokio::spawn(async move { models.infer("a", request()).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        call.abort();
        // a's load (50 ms) holds its 100 bytes: b cannot fit beside it.
        let err = models.infer("b", request()).await.unwrap_err();
        assert!(matches!(&err, InferError::ModelMemory(m) if m.contains("loading")), "{err}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(loaded(&models), ["a"], "the load ended and installed a, its caller gone");
        assert_eq!(a.load(Ordering::SeqCst), 1);
    }

    struct FailingLoader(Arc<AtomicUsize>);

    impl ModelLoader for FailingLoader {
        fn load(&self, _: &Arbiter) -> Result<Loaded, String> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Err("no such file".into())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_load_is_answered_again_without_loading_for_a_while() {
        let models = Models::new();
        let tries = Arc::new(AtomicUsize::new(0));
        let spec = fake_batcher("broken").spec().clone();
        models.insert_on_demand(spec, 1, Arc::new(FailingLoader(Arc::clone(&tries))), None).unwrap();
        for _ in 0..3 {
            let err = models.infer("broken", request()).await.unwrap_err();
            assert!(matches!(&err, InferError::Backend(m) if m.contains("no such file")), "{err}");
        }
        assert_eq!(tries.load(Ordering::SeqCst), 1);
        assert_eq!(models.memory().0, 0, "a failed load holds nothing");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_model_larger_than_the_bound_is_refused_with_why_and_a_removed_one_is_unknown() {
        let models = Models::new();
        models.set_memory_bound(Some(50));
        on_demand(&models, "big", 100);
        let err = models.infer("big", request()).await.unwrap_err();
        assert!(matches!(&err, InferError::ModelMemory(m) if m.contains("model-memory bound")), "{err}");
        assert!(models.remove("big"));
        assert_eq!(models.infer("big", request()).await.unwrap_err(), InferError::UnknownModel("big".into()));
    }
}
