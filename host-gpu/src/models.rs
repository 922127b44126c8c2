//! The models a host serves ([`Models`]), by name, each behind a batcher of
//! its own. Some are loaded for good (pinned: the reference model a node
//! starts with); the others are loaded on demand by a [`ModelLoader`] and
//! unloaded, least recently used first, when the loaded ones would pass the
//! model-memory bound. A call to a model that is not loaded waits for its
//! load (one load however many calls wait); a model unloaded while calls
//! are queued on it finishes them first (they hold its batcher).

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use crate::{Batcher, CallOptions, InferError, InferRequest, ModelSpec, Tensor};

/// Opens a model's engines and starts its batcher, for [`Models`] to load
/// on demand. The host implements it (files, devices, sessions, budgets).
pub trait ModelLoader: Send + Sync {
    /// Loads the model. Blocking: [`Models`] calls it on a thread of its own.
    fn load(&self) -> Result<Loaded, String>;
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
    /// Tenants' fairness weights, for models loaded later too.
    weights: Mutex<BTreeMap<String, u32>>,
    /// The clock of `last_used` stamps.
    epoch: EpochClock,
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

#[derive(Default)]
struct Registry {
    entries: BTreeMap<String, Entry>,
    /// At most this many bytes of models loaded at once (`None`: no bound).
    bound: Option<u64>,
}

struct Entry {
    spec: ModelSpec,
    bytes: u64,
    pinned: bool,
    loader: Option<Arc<dyn ModelLoader>>,
    loaded: Option<Loaded>,
    /// Microseconds on the registry's clock of the last call.
    last_used: AtomicU64,
    /// Held by the one call that loads the model; the others wait on it.
    loading: Arc<tokio::sync::Mutex<()>>,
    loads: u64,
    evictions: u64,
    last_load: Option<Duration>,
}

impl Entry {
    fn new(spec: ModelSpec, bytes: u64, loader: Option<Arc<dyn ModelLoader>>, loaded: Option<Loaded>) -> Self {
        Self {
            spec,
            bytes,
            pinned: loader.is_none(),
            loader,
            loaded,
            last_used: AtomicU64::new(0),
            loading: Arc::default(),
            loads: 0,
            evictions: 0,
            last_load: None,
        }
    }
}

impl Registry {
    /// Bytes of the models loaded now.
    fn used(&self) -> u64 {
        self.entries.values().filter(|e| e.loaded.is_some()).map(|e| e.bytes).sum()
    }

    /// Unloads the least recently used models but `keep` until `bytes` more fit.
    fn make_room(&mut self, keep: &str, bytes: u64) -> Result<(), InferError> {
        let Some(bound) = self.bound else { return Ok(()) };
        while self.used().saturating_add(bytes) > bound {
            let victim = self
                .entries
                .iter()
                .filter(|(name, e)| e.loaded.is_some() && !e.pinned && name.as_str() != keep)
                .min_by_key(|(_, e)| e.last_used.load(Ordering::Relaxed))
                .map(|(name, _)| name.clone());
            let Some(victim) = victim else {
                return Err(InferError::ModelMemory(format!(
                    "model {keep} needs {} MiB, and the models that cannot be unloaded hold {} of the {} MiB model-memory bound",
                    mib(bytes),
                    mib(self.used()),
                    mib(bound)
                )));
            };
            if let Some(entry) = self.entries.get_mut(&victim) {
                entry.loaded = None;
                entry.evictions += 1;
                tracing::info!(model = %victim, to_load = keep, "model unloaded to make room (least recently used)");
            }
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

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Registry> {
        self.inner.registry.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Registry> {
        self.inner.registry.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bounds the bytes of the models loaded at once (`None`: unbounded).
    /// Pinned models count too, but are never unloaded.
    pub fn set_memory_bound(&self, bytes: Option<u64>) {
        self.write().bound = bytes;
    }

    /// The bytes of the models loaded now, and the bound.
    pub fn memory(&self) -> (u64, Option<u64>) {
        let registry = self.read();
        (registry.used(), registry.bound)
    }

    /// Adds (or replaces) a model loaded for good, keyed by its spec's name.
    pub fn insert(&self, batcher: Batcher) {
        let spec = batcher.spec().clone();
        self.write().entries.insert(spec.name.clone(), Entry::new(spec, 0, None, Some(Loaded::new(batcher))));
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
        let mut registry = self.write();
        registry.entries.remove(&name);
        if loaded.is_some()
            && let Some(bound) = registry.bound.filter(|bound| registry.used().saturating_add(bytes) > *bound)
        {
            return Err(InferError::ModelMemory(format!(
                "model {name} needs {} MiB; {} of the {} MiB model-memory bound are loaded",
                mib(bytes),
                mib(registry.used()),
                mib(bound)
            )));
        }
        registry.entries.insert(name, Entry::new(spec, bytes, Some(loader), loaded));
        Ok(())
    }

    /// Stops serving a model: later calls are [`InferError::UnknownModel`];
    /// calls queued already are answered. Returns whether it was served.
    pub fn remove(&self, name: &str) -> bool {
        self.write().entries.remove(name).is_some()
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
                pinned: e.pinned,
                bytes: e.bytes,
                loads: e.loads,
                evictions: e.evictions,
                last_load: e.last_load,
            })
            .collect()
    }

    /// Sets a tenant's fairness weight in every model's batcher, and in
    /// those loaded later (see [`Batcher::set_tenant_weight`]).
    pub fn set_tenant_weight(&self, tenant: &str, weight: u32) {
        self.inner.weights.lock().unwrap_or_else(PoisonError::into_inner).insert(tenant.to_owned(), weight);
        for batcher in self.iter() {
            batcher.set_tenant_weight(tenant, weight);
        }
    }

    /// Forgets a tenant in every model's batcher, answering its waiting
    /// calls [`InferError::ShuttingDown`] (see [`Batcher::remove_tenant`]);
    /// returns how many calls were answered so.
    pub fn remove_tenant(&self, tenant: &str) -> usize {
        self.inner.weights.lock().unwrap_or_else(PoisonError::into_inner).remove(tenant);
        self.iter().map(|batcher| batcher.remove_tenant(tenant)).sum()
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
    /// room) when it is not loaded.
    pub async fn batcher(&self, name: &str) -> Result<Batcher, InferError> {
        let gate = match self.loaded_or_gate(name)? {
            Ok(batcher) => return Ok(batcher),
            Err(gate) => gate,
        };
        let _loading = gate.lock().await;
        let loader = match self.loaded_or_gate(name)? {
            Ok(batcher) => return Ok(batcher),
            Err(_) => self.read().entries.get(name).and_then(|e| e.loader.clone()),
        };
        let loader = loader.ok_or_else(|| InferError::UnknownModel(name.to_owned()))?;
        let started = Instant::now();
        let loaded = load_on_thread(name, loader).await?;
        self.install(name, loaded, started.elapsed())
    }

    /// The model's batcher when loaded, else the gate its loads pass.
    fn loaded_or_gate(&self, name: &str) -> Result<Result<Batcher, Arc<tokio::sync::Mutex<()>>>, InferError> {
        let registry = self.read();
        let entry = registry.entries.get(name).ok_or_else(|| InferError::UnknownModel(name.to_owned()))?;
        entry.last_used.store(self.inner.epoch.now(), Ordering::Relaxed);
        Ok(match &entry.loaded {
            Some(loaded) => Ok(loaded.batcher.clone()),
            None => Err(Arc::clone(&entry.loading)),
        })
    }

    /// Records a model loaded on demand, making room for it.
    fn install(&self, name: &str, loaded: Loaded, took: Duration) -> Result<Batcher, InferError> {
        for (tenant, weight) in self.inner.weights.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            loaded.batcher.set_tenant_weight(tenant, *weight);
        }
        let mut registry = self.write();
        let bytes = registry.entries.get(name).ok_or_else(|| InferError::UnknownModel(name.to_owned()))?.bytes;
        registry.make_room(name, bytes)?;
        let entry = registry.entries.get_mut(name).ok_or_else(|| InferError::UnknownModel(name.to_owned()))?;
        let batcher = loaded.batcher.clone();
        entry.spec = batcher.spec().clone();
        entry.loaded = Some(loaded);
        entry.loads += 1;
        entry.last_load = Some(took);
        tracing::info!(model = name, took_ms = took.as_millis(), "model loaded on demand");
        Ok(batcher)
    }
}

/// Runs `loader` on a thread of its own (it blocks: files, sessions).
async fn load_on_thread(name: &str, loader: Arc<dyn ModelLoader>) -> Result<Loaded, InferError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("load-{name}"))
        .spawn(move || {
            let _ = tx.send(loader.load());
        })
        .map_err(|e| InferError::ModelMemory(format!("cannot start a thread to load model {name}: {e}")))?;
    match rx.await {
        Ok(Ok(loaded)) => Ok(loaded),
        Ok(Err(e)) => Err(InferError::Backend(format!("loading model {name}: {e}"))),
        Err(_) => Err(InferError::Backend(format!("loading model {name}: the loader panicked"))),
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
        fn load(&self) -> Result<Loaded, String> {
            self.loads.fetch_add(1, Ordering::SeqCst);
            // Long enough for the other calls to arrive while it loads.
            std::thread::sleep(Duration::from_millis(50));
            Ok(Loaded::new(fake_batcher(self.name)))
        }
    }

    fn fake_batcher(name: &str) -> Batcher {
        let backend = FakeBackend::new(name, 8, Duration::from_millis(1), Duration::ZERO);
        Batcher::start(vec![Box::new(backend)], &BatcherConfig::default()).unwrap()
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
        models.insert(fake_batcher("pinned"));
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
