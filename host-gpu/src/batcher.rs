//! A model's dynamic batcher and device pool: callers await an async,
//! cloneable handle; one OS thread per device pulls the next batch whenever
//! the device is free and it is this model's turn on it (see
//! [`crate::arbiter`]), so a slow device never holds up the queue.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::arbiter::{Arbiter, DeviceRate, QueueId, Slots};
use crate::backend::{Backend, BackendError};
use crate::backlog::{Backlog, Promise, fits};
use crate::error::InferError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::model::ModelSpec;
use crate::observe::{BatchMember, BatchObserver, BatchReport, CallTag};
use crate::queue::{Entry, QueueConfig, Readiness, Reply, sample_cost};
use crate::sizing::{BatchSizer, Sizing};
use crate::tensor::Tensor;

/// Default bound on calls waiting per model, all tenants together.
pub const DEFAULT_QUEUE_CAPACITY: usize = 1024;
/// Default bound on calls waiting per model for one tenant.
pub const DEFAULT_TENANT_CAPACITY: usize = 256;

/// How a batcher forms batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatcherConfig {
    /// Most samples per batch (capped by the backend's own maximum).
    pub max_batch: usize,
    /// Most calls waiting, all tenants together.
    pub queue_capacity: usize,
    /// Most calls waiting for one tenant.
    pub tenant_capacity: usize,
    /// How long to hold a partial batch to fill it. Zero: a batch grows only
    /// while every device is busy, which is what measurements favour.
    pub max_delay: Duration,
    /// Whether each device learns the batch size that pays for each input
    /// shape (up to `max_batch`), or always fills to `max_batch`.
    pub sizing: Sizing,
}

impl Default for BatcherConfig {
    fn default() -> Self {
        Self {
            max_batch: 8,
            queue_capacity: DEFAULT_QUEUE_CAPACITY,
            tenant_capacity: DEFAULT_TENANT_CAPACITY,
            max_delay: Duration::ZERO,
            sizing: Sizing::Adaptive,
        }
    }
}

/// What a caller adds to a call (see [`Batcher::infer_with`]).
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    /// Where the call's share of its batch's device time goes, µs (the
    /// share `/metrics` charges its tenant).
    pub device_us: Option<Arc<AtomicU64>>,
    /// Time the caller needs after the call, before its deadline: the call
    /// is refused unless its estimated wait fits in what is left less this.
    pub keep: Duration,
    /// Handed to the batcher's observer with the batch the call runs in
    /// (see [`crate::observe`]).
    pub tag: Option<CallTag>,
}

/// One inference call.
#[derive(Debug)]
pub struct InferRequest {
    /// Who is asking; batches are shared fairly between tenants.
    pub tenant: Arc<str>,
    /// One sample, without a batch dimension.
    pub input: Tensor,
    /// The call fails with `DeadlineExceeded` if it has not run by then.
    pub deadline: Instant,
}

struct Shared {
    /// Where the model's queue is kept, beside the other models' on its devices.
    arbiter: Arbiter,
    /// The model's queue in the arbiter.
    id: QueueId,
    shutdown: AtomicBool,
    metrics: Metrics,
    /// The devices' pace and the work promised and running (see [`crate::backlog`]).
    backlog: Arc<Backlog>,
    /// Told of each batch that ran a tagged call (see [`Batcher::observe`]).
    observer: OnceLock<Arc<dyn BatchObserver>>,
    /// The model's name, for the observer.
    model: String,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Slots> {
        self.arbiter.lock()
    }

    /// Stops the model's workers and takes its queue out of the arbiter,
    /// answering the calls still waiting [`InferError::ShuttingDown`]. The
    /// flag is set before `unregister` takes the lock and wakes every
    /// worker, so a worker between its check and its wait cannot miss it.
    fn stop(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        for entry in self.arbiter.unregister(self.id) {
            let _ = entry.reply.send(Err(InferError::ShuttingDown));
        }
    }
}

struct Workers {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shared.stop();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Async handle onto one model's batcher and its device workers. Clones
/// share the same queue; the workers stop when the last clone is dropped.
#[derive(Clone)]
pub struct Batcher {
    shared: Arc<Shared>,
    spec: Arc<ModelSpec>,
    _workers: Arc<Workers>,
}

impl Batcher {
    /// Starts one worker thread per backend, on devices of its own. All
    /// backends must serve the same model.
    pub fn start(backends: Vec<Box<dyn Backend>>, config: &BatcherConfig) -> Result<Self, BackendError> {
        Self::start_in(&Arbiter::new(), backends, config)
    }

    /// Starts one worker thread per backend, backend `i` on device `i` of
    /// `arbiter`, which the other models started in it share: one batch
    /// at a time per device, and one virtual clock for all tenants (see
    /// [`crate::arbiter`]). All backends must serve the same model.
    pub fn start_in(arbiter: &Arbiter, backends: Vec<Box<dyn Backend>>, config: &BatcherConfig) -> Result<Self, BackendError> {
        let first = backends.first().ok_or_else(|| BackendError("a batcher needs at least one backend".into()))?;
        let mut spec = first.spec().clone();
        if let Some(other) = backends.iter().find(|b| b.spec() != &spec) {
            return Err(BackendError(format!("backends disagree: {} vs {}", spec.name, other.spec().name)));
        }
        spec.max_batch = config.max_batch.clamp(1, spec.max_batch.max(1));
        let queue = QueueConfig {
            max_batch: spec.max_batch,
            capacity: config.queue_capacity,
            tenant_capacity: config.tenant_capacity,
            max_delay: config.max_delay,
        };
        let shared = Arc::new(Shared {
            id: arbiter.register(queue, backends.len()),
            arbiter: arbiter.clone(),
            shutdown: AtomicBool::new(false),
            metrics: Metrics::new(spec.max_batch, backends.len()),
            backlog: Backlog::new(backends.len()),
            observer: OnceLock::new(),
            model: spec.name.clone(),
        });
        // From here on, dropping `workers` stops the threads and leaves the arbiter.
        let mut workers = Workers { shared: Arc::clone(&shared), threads: Vec::new() };
        workers.threads = spawn_workers(&shared, backends, &spec.name, spec.max_batch, config.sizing)?;
        let workers = Arc::new(workers);
        Ok(Self { shared, spec: Arc::new(spec), _workers: workers })
    }

    /// The model this batcher serves (with the effective `max_batch`).
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Installs the observer told of each batch that runs a tagged call
    /// (see [`crate::observe`]); the first installed stays. Returns whether
    /// this one was installed.
    pub fn observe(&self, observer: Arc<dyn BatchObserver>) -> bool {
        self.shared.observer.set(observer).is_ok()
    }

    /// Sets a tenant's fairness weight (default 1; 0 counts as 1): busy
    /// tenants share device time, as measured, in proportion to their
    /// weights (see [`crate::queue`]).
    pub fn set_tenant_weight(&self, tenant: &str, weight: u32) {
        self.shared.arbiter.set_tenant_weight(tenant, weight);
    }

    /// A tenant's fairness weight: what [`Batcher::set_tenant_weight`] set, else 1.
    pub fn tenant_weight(&self, tenant: &str) -> u32 {
        self.shared.arbiter.tenant_weight(tenant)
    }

    /// Forgets a tenant (when it is deleted): its weight and its service
    /// count, so a later tenant of the same name starts afresh at weight 1. Its calls still waiting are answered
    /// [`InferError::ShuttingDown`] at once rather than run: a deleted
    /// tenant gets no more device time, its calls free their queue space,
    /// and no state of it lingers for a namesake to inherit. Calls already
    /// in a batch on a device finish normally. Returns how many calls were
    /// answered so.
    pub fn remove_tenant(&self, tenant: &str) -> usize {
        let removed = {
            let mut slots = self.shared.lock();
            let removed = slots.parts(self.shared.id).map(|(queue, ledger)| queue.remove_tenant(ledger, tenant)).unwrap_or_default();
            slots.ledger.forget(tenant);
            // The devices' turns may have been this tenant's.
            slots.wake_idle();
            removed
        };
        self.shared.metrics.forget_tenant(tenant);
        let count = removed.len();
        for entry in removed {
            let _ = entry.reply.send(Err(InferError::ShuttingDown));
        }
        count
    }

    /// Calls waiting right now, all tenants together.
    pub fn queue_depth(&self) -> usize {
        self.shared.lock().queue(self.shared.id).map_or(0, |q| q.len())
    }

    /// Calls of one tenant waiting right now.
    pub fn tenant_queue_depth(&self, tenant: &str) -> usize {
        self.shared.lock().queue(self.shared.id).map_or(0, |q| q.tenant_len(tenant))
    }

    /// The batcher's counters.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.shared.metrics.snapshot(self.queue_depth())
    }

    /// How long a call of `cost` units ([`sample_cost`]) from `tenant`
    /// would take to end if queued now: the work ahead of it under fair
    /// sharing (queued, promised to admitted requests, running) over the
    /// devices' measured pace. `None` until a device has learned its pace.
    pub fn estimate_wait(&self, tenant: &str, cost: u64) -> Option<Duration> {
        // The work queued for every model on these devices: it runs on
        // them before or between this model's batches.
        let waiting = self.shared.lock().waiting();
        self.shared.backlog.estimate(tenant, cost, &waiting)
    }

    /// Admits a request of `tenant` expected to make a call of `cost` units
    /// within `budget`: a [`Promise`] that counts the call as the tenant's
    /// pending work until dropped, or the estimated wait when it exceeds the
    /// budget's [`crate::backlog::HEADROOM`] (the request could not finish;
    /// refuse it before any work).
    pub fn admit(&self, tenant: &Arc<str>, cost: u64, budget: Duration) -> Result<Promise, Duration> {
        match self.estimate_wait(tenant, cost) {
            Some(wait) if !fits(wait, budget) => Err(wait),
            _ => Ok(self.shared.backlog.promise(Arc::clone(tenant), cost)),
        }
    }

    /// Runs one sample as part of whatever batch forms. Dropping the future
    /// cancels the call: it is skipped before it reaches a device. A call
    /// whose estimated wait ([`Batcher::estimate_wait`]) does not fit in
    /// what is left of its deadline ([`crate::backlog::fits`]) is refused
    /// at once ([`InferError::Backlog`]).
    pub async fn infer(&self, request: InferRequest) -> Reply {
        self.infer_with(request, CallOptions::default()).await
    }

    /// [`Batcher::infer`] with `options`: the call's device time metered,
    /// time kept for the caller after it.
    pub async fn infer_with(&self, request: InferRequest, options: CallOptions) -> Reply {
        self.spec.validate_input(&request.input)?;
        let left = request.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(InferError::DeadlineExceeded);
        }
        let budget = left.saturating_sub(options.keep);
        if let Some(wait) = self.estimate_wait(&request.tenant, sample_cost(request.input.shape())).filter(|wait| !fits(*wait, budget)) {
            self.shared.metrics.record_overloaded();
            return Err(InferError::Backlog { wait });
        }
        let deadline = request.deadline;
        let rx = self.enqueue(request, options.device_us, options.tag)?;
        match tokio::time::timeout_at(deadline.into(), rx).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(_)) => Err(InferError::ShuttingDown),
            // Dropping `rx` here marks the entry cancelled for the workers.
            Err(_) => Err(InferError::DeadlineExceeded),
        }
    }

    fn enqueue(
        &self,
        request: InferRequest,
        device_us: Option<Arc<AtomicU64>>,
        tag: Option<CallTag>,
    ) -> Result<oneshot::Receiver<Reply>, InferError> {
        if self.shared.shutdown.load(Ordering::SeqCst) {
            return Err(InferError::ShuttingDown);
        }
        let (tx, rx) = oneshot::channel();
        let entry = Entry {
            tenant: request.tenant,
            input: request.input,
            deadline: request.deadline,
            enqueued: Instant::now(),
            reply: tx,
            device_us,
            tag,
        };
        let mut slots = self.shared.lock();
        let Some((queue, ledger)) = slots.parts(self.shared.id) else { return Err(InferError::ShuttingDown) };
        if let Err(refused) = queue.push(ledger, entry) {
            // Refusing may have purged cancelled calls: the turns may have changed.
            slots.wake_idle();
            drop(slots);
            self.shared.metrics.record_overloaded();
            return Err(refused.0);
        }
        slots.wake_one_idle();
        Ok(rx)
    }
}

fn spawn_workers(
    shared: &Arc<Shared>,
    backends: Vec<Box<dyn Backend>>,
    model: &str,
    max_batch: usize,
    sizing: Sizing,
) -> Result<Vec<JoinHandle<()>>, BackendError> {
    backends
        .into_iter()
        .enumerate()
        .map(|(index, backend)| {
            // Each device learns its own sizes: a CPU and a GPU in one pool differ.
            let shared = Arc::clone(shared);
            let sizer = BatchSizer::new(max_batch, sizing, !backend.runs_on_cpu());
            std::thread::Builder::new()
                .name(format!("{model}-dev{index}"))
                .spawn(move || {
                    // A worker that dies (a bug: engines run under catch_unwind)
                    // takes its model out of the arbiter, so the model cannot
                    // keep a device's turn with nobody to take it.
                    if std::panic::catch_unwind(AssertUnwindSafe(|| worker_loop(&shared, index, backend, sizer))).is_err() {
                        tracing::error!(model = %shared.model, device = index, "a device worker panicked; the model stops");
                        shared.stop();
                    }
                })
                .map_err(|e| BackendError(format!("cannot start worker thread: {e}")))
        })
        .collect()
}

fn worker_loop(shared: &Shared, index: usize, mut backend: Box<dyn Backend>, mut sizer: BatchSizer) {
    backend.on_worker_thread();
    shared.metrics.record_sizing(index, sizer.chosen(&[]), sizer.learning(&[]));
    // The engine's first runs (warming up) are charged their estimate, and
    // teach the device's rate nothing: a model loaded beside a warm one
    // would otherwise pay for its own warm-up.
    let mut warming = DeviceRate::WARM_UP;
    while let Some((batch, waiting)) = wait_for_batch(shared, index, &sizer) {
        let claim = Claim { shared, device: index, released: false };
        let shape = batch[0].input.shape().to_vec();
        sizer.note_waiting(&shape, waiting);
        let charged: Vec<(Arc<str>, u64)> = batch.iter().map(|e| (Arc::clone(&e.tenant), sample_cost(e.input.shape()))).collect();
        let units = charged.iter().map(|(_, cost)| cost).fold(0u64, |a, b| a.saturating_add(*b));
        shared.backlog.started(units);
        let cpu_before = cpu_time_before(backend.as_ref());
        let (size, elapsed, ok) = run_batch(shared, index, backend.as_mut(), batch);
        shared.backlog.finished(index, units, elapsed, ok);
        // On a CPU, the CPU time of the batch's threads: the wall clock also
        // counts what other work on the host (a tenant's handlers) took.
        let cost = match (backend.runs_on_cpu(), cpu_before, cpu_time_after(backend.as_ref())) {
            (true, Some(before), Some(after)) => after.saturating_sub(before),
            _ => elapsed,
        };
        // A zero cost is a clock that failed (say, a pool thread gone).
        let measured = (warming == 0 && !cost.is_zero()).then_some(cost);
        warming = warming.saturating_sub(1);
        claim.release(&charged, measured, ok);
        if ok && !cost.is_zero() {
            sizer.record(&shape, size, cost);
        }
        shared.metrics.record_sizing(index, sizer.chosen(&shape), sizer.learning(&shape));
    }
}

/// A device a worker runs a batch on: freed by [`Claim::release`], or, if
/// the worker unwinds before it does, when dropped, so a device is never
/// left busy for every model.
struct Claim<'a> {
    shared: &'a Shared,
    device: usize,
    released: bool,
}

impl Claim<'_> {
    /// Frees the device, charges the batch's calls their share of the
    /// `measured` device time (see [`Slots::charge_measured`]), and wakes
    /// the idle devices' workers: the charge may give any of them to
    /// another model.
    fn release(mut self, charged: &[(Arc<str>, u64)], measured: Option<Duration>, ok: bool) {
        self.released = true;
        let mut slots = self.shared.lock();
        slots.set_busy(self.device, false);
        if let Some(took) = measured {
            slots.charge_measured(self.device, charged, took, ok);
        }
        slots.wake_idle();
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.released {
            let mut slots = self.shared.lock();
            slots.set_busy(self.device, false);
            slots.wake_idle();
        }
    }
}

/// CPU time used by the calling worker thread and its backend's pool
/// threads, where the platform tells. The pool is read before the worker's
/// clock here and after it in [`cpu_time_after`], so the reading itself
/// (procfs) is not charged to the batch.
fn cpu_time_before(backend: &dyn Backend) -> Option<Duration> {
    let pool = backend.pool_cpu_time();
    Some(thread_cpu_time()? + pool)
}

/// As [`cpu_time_before`], at the end of a batch.
fn cpu_time_after(backend: &dyn Backend) -> Option<Duration> {
    let own = thread_cpu_time()?;
    Some(own + backend.pool_cpu_time())
}

/// CPU time the calling thread has used, where the platform tells.
#[cfg(unix)]
fn thread_cpu_time() -> Option<Duration> {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Some(Duration::new(u64::try_from(t.tv_sec).ok()?, u32::try_from(t.tv_nsec).ok()?))
}

#[cfg(not(unix))]
fn thread_cpu_time() -> Option<Duration> {
    None
}

/// Blocks until this model has a batch to run on `device` (or shutdown:
/// `None`): the device is free, the model has its turn on it (see
/// [`Slots::turn`]) and the batch is due. Answers expired calls on the way
/// and marks the device busy. Batches are limited to what `sizer` says
/// pays on this device. Also returns how many calls of the batch's shape
/// were waiting.
fn wait_for_batch(shared: &Shared, device: usize, sizer: &BatchSizer) -> Option<(Vec<Entry>, usize)> {
    let limit = |shape: &[usize]| sizer.limit(shape);
    let mut slots = shared.lock();
    loop {
        if shared.shutdown.load(Ordering::SeqCst) {
            return None;
        }
        let now = Instant::now();
        let mut due = None;
        if !slots.is_busy(device) && slots.turn(device, now) == Some(shared.id) {
            let (queue, ledger) = slots.parts(shared.id)?;
            match queue.readiness(ledger, now, limit) {
                Readiness::Ready => {
                    let waiting = queue.front_shape_count(ledger);
                    let formed = queue.next_batch(ledger, now, limit);
                    let taken = !formed.batch.is_empty();
                    slots.set_busy(device, taken);
                    if !taken {
                        // Only dead calls: the device's turn may be another model's now.
                        slots.wake_device(device);
                    } else if slots.any_waiting() {
                        // Another idle device can start on what is left.
                        slots.wake_one_idle();
                    }
                    drop(slots);
                    shared.metrics.record_dropped(formed.expired.len(), formed.cancelled);
                    for entry in formed.expired {
                        let _ = entry.reply.send(Err(InferError::DeadlineExceeded));
                    }
                    if taken {
                        return Some((formed.batch, waiting));
                    }
                    slots = shared.lock();
                    continue;
                }
                Readiness::WaitUntil(at) => due = Some(at - now),
                Readiness::Empty => {}
            }
        }
        let wake = slots.wake(device);
        slots = match due {
            Some(timeout) => wake.wait_timeout(slots, timeout).unwrap_or_else(|p| p.into_inner()).0,
            None => wake.wait(slots).unwrap_or_else(|p| p.into_inner()),
        };
    }
}

/// Runs a non-empty batch and answers its calls; returns its size, how long
/// the device took and whether it succeeded.
fn run_batch(shared: &Shared, index: usize, backend: &mut dyn Backend, batch: Vec<Entry>) -> (usize, Duration, bool) {
    let started = Instant::now();
    for entry in &batch {
        shared.metrics.record_wait(started.saturating_duration_since(entry.enqueued));
    }
    let inputs: Vec<&Tensor> = batch.iter().map(|e| &e.input).collect();
    // A panicking engine must fail its batch, not kill the device's worker.
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| backend.run(&inputs)))
        .unwrap_or_else(|_| Err(BackendError("backend panicked".into())));
    let result = result.and_then(|outputs| check_len(outputs, batch.len()));
    let (size, elapsed, ok) = (batch.len(), started.elapsed(), result.is_ok());
    shared.metrics.record_batch(index, size, elapsed, ok);
    shared.metrics.charge_tenants(elapsed, batch.iter().map(|e| (&*e.tenant, sample_cost(e.input.shape()))));
    meter_calls(&batch, elapsed);
    let tagged = tagged_members(shared, &batch);
    match result {
        Ok(outputs) => {
            for (entry, output) in batch.into_iter().zip(outputs) {
                let _ = entry.reply.send(Ok(output));
            }
        }
        Err(err) => {
            tracing::warn!(model = %backend.spec().name, size = batch.len(), error = %err, "batch failed");
            for entry in batch {
                let _ = entry.reply.send(Err(InferError::Backend(err.0.clone())));
            }
        }
    }
    if let Some((observer, members)) = tagged {
        let members = members.iter().map(|(tag, enqueued)| BatchMember { tag, enqueued: *enqueued }).collect();
        let report =
            BatchReport { model: &shared.model, device: index, device_name: backend.device(), size, started, took: elapsed, ok, members };
        // A panicking observer must not take the device's worker with it.
        if std::panic::catch_unwind(AssertUnwindSafe(|| observer.ran(&report))).is_err() {
            tracing::warn!(model = %shared.model, "the batch observer panicked");
        }
    }
    (size, elapsed, ok)
}

/// A batch's tagged calls: each one's tag and when it was queued.
type Tagged = Vec<(CallTag, Instant)>;

/// The observer and the batch's tagged calls, if there are both; taken
/// before the calls are answered, reported after.
fn tagged_members(shared: &Shared, batch: &[Entry]) -> Option<(Arc<dyn BatchObserver>, Tagged)> {
    let observer = shared.observer.get()?;
    let members: Tagged = batch.iter().filter_map(|e| Some((e.tag.clone()?, e.enqueued))).collect();
    (!members.is_empty()).then(|| (Arc::clone(observer), members))
}

/// Adds each metered call's share of the batch's `busy` time to its meter:
/// the same split [`Metrics::charge_tenants`] charges the tenants.
fn meter_calls(batch: &[Entry], busy: Duration) {
    if batch.iter().all(|e| e.device_us.is_none()) {
        return;
    }
    let total: u64 = batch.iter().map(|e| sample_cost(e.input.shape())).sum();
    for entry in batch {
        if let Some(meter) = &entry.device_us {
            meter.fetch_add(crate::metrics::share_us(busy, sample_cost(entry.input.shape()), total), Ordering::Relaxed);
        }
    }
}

fn check_len(outputs: Vec<Vec<Tensor>>, expected: usize) -> Result<Vec<Vec<Tensor>>, BackendError> {
    if outputs.len() == expected {
        Ok(outputs)
    } else {
        Err(BackendError(format!("backend returned {} results for {expected} inputs", outputs.len())))
    }
}
