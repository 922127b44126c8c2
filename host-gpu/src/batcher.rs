//! A model's dynamic batcher and device pool: callers await an async,
//! cloneable handle; one OS thread per device pulls the next batch whenever
//! it is free, so a slow device never holds up the queue.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::backend::{Backend, BackendError};
use crate::backlog::{Backlog, Promise, RateSums, fits};
use crate::error::InferError;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::model::ModelSpec;
use crate::observe::{BatchMember, BatchObserver, BatchReport, CallTag};
use crate::queue::{Entry, QueueConfig, Readiness, Reply, State, sample_cost};
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
    state: Mutex<State>,
    wake: Condvar,
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
    fn lock(&self) -> MutexGuard<'_, State> {
        // A worker never panics while holding the lock (backends run outside
        // it, under catch_unwind), so a poisoned lock still holds a sound queue.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

struct Workers {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        {
            // Set the flag under the lock: a worker between its shutdown
            // check and its wait would otherwise miss the wake-up.
            let _state = self.shared.lock();
            self.shared.shutdown.store(true, Ordering::SeqCst);
        }
        self.shared.wake.notify_all();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        for entry in self.shared.lock().drain() {
            let _ = entry.reply.send(Err(InferError::ShuttingDown));
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
    /// Starts one worker thread per backend. All backends must serve the same model.
    pub fn start(backends: Vec<Box<dyn Backend>>, config: &BatcherConfig) -> Result<Self, BackendError> {
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
            state: Mutex::new(State::new(queue)),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            metrics: Metrics::new(spec.max_batch, backends.len()),
            backlog: Backlog::new(backends.len()),
            observer: OnceLock::new(),
            model: spec.name.clone(),
        });
        let threads = spawn_workers(&shared, backends, &spec.name, spec.max_batch, config.sizing)?;
        let workers = Arc::new(Workers { shared: Arc::clone(&shared), threads });
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
        self.shared.lock().set_weight(tenant.into(), weight);
    }

    /// A tenant's fairness weight: what [`Batcher::set_tenant_weight`] set, else 1.
    pub fn tenant_weight(&self, tenant: &str) -> u32 {
        self.shared.lock().weight(tenant)
    }

    /// Forgets a tenant (when it is deleted): its weight and its service
    /// count, so a later tenant of the same name starts afresh at weight 1. Its calls still waiting are answered
    /// [`InferError::ShuttingDown`] at once rather than run: a deleted
    /// tenant gets no more device time, its calls free their queue space,
    /// and no state of it lingers for a namesake to inherit. Calls already
    /// in a batch on a device finish normally. Returns how many calls were
    /// answered so.
    pub fn remove_tenant(&self, tenant: &str) -> usize {
        let removed = self.shared.lock().remove_tenant(tenant);
        self.shared.metrics.forget_tenant(tenant);
        let count = removed.len();
        for entry in removed {
            let _ = entry.reply.send(Err(InferError::ShuttingDown));
        }
        count
    }

    /// Calls waiting right now, all tenants together.
    pub fn queue_depth(&self) -> usize {
        self.shared.lock().len()
    }

    /// Calls of one tenant waiting right now.
    pub fn tenant_queue_depth(&self, tenant: &str) -> usize {
        self.shared.lock().tenant_len(tenant)
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
        if let Err(refused) = self.shared.lock().push(entry) {
            self.shared.metrics.record_overloaded();
            return Err(refused.0);
        }
        self.shared.wake.notify_one();
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
                .spawn(move || worker_loop(&shared, index, backend, sizer))
                .map_err(|e| BackendError(format!("cannot start worker thread: {e}")))
        })
        .collect()
}

fn worker_loop(shared: &Shared, index: usize, mut backend: Box<dyn Backend>, mut sizer: BatchSizer) {
    backend.on_worker_thread();
    shared.metrics.record_sizing(index, sizer.chosen(&[]), sizer.learning(&[]));
    let mut rate = DeviceRate::default();
    while let Some((batch, waiting)) = wait_for_batch(shared, &sizer) {
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
        if !cost.is_zero() {
            charge_measured(shared, &mut rate, &charged, cost, ok);
        }
        if ok && !cost.is_zero() {
            sizer.record(&shape, size, cost);
        }
        shared.metrics.record_sizing(index, sizer.chosen(&shape), sizer.learning(&shape));
    }
}

/// A device's usual speed, in cost units ([`sample_cost`]) per second of
/// device time, learned from its batches: it turns a batch's measured time
/// into what each of its calls cost.
#[derive(Debug, Default)]
struct DeviceRate {
    sums: RateSums,
}

impl DeviceRate {
    /// First batches of a device (engine warm-up) teach and charge nothing.
    #[cfg(test)]
    const WARM_UP: u32 = RateSums::WARM_UP;
    /// What each batch keeps of the sums before it.
    const KEEP: f64 = 0.95;
    /// Most a batch may be charged over its estimate: bounds what one
    /// stalled batch (the host busy elsewhere) costs its tenants, yet
    /// leaves calls of a shape the device runs far slower per pixel
    /// charged for most of their time.
    const MAX_FACTOR: f64 = 16.0;
    /// Least a batch may be charged, as a fraction of its estimate.
    const MIN_FACTOR: f64 = 0.25;

    /// Measured over estimated cost of a batch of `estimated` cost units
    /// that took `took`, within `MIN_FACTOR..=MAX_FACTOR`; `None` while
    /// warming up. Learns from the batch if `learn`.
    fn factor(&mut self, estimated: u64, took: Duration, learn: bool) -> Option<f64> {
        let seconds = took.as_secs_f64();
        if estimated == 0 || seconds <= 0.0 {
            return None;
        }
        let units = estimated as f64;
        if !self.sums.warm() {
            if learn {
                self.sums.learn(units, seconds, Self::KEEP);
            }
            return None;
        }
        // The first batch after the warm-up is its own rate.
        let (rate_units, rate_seconds) = match self.sums.sums() {
            Some(sums) => sums,
            None if learn => (units, seconds),
            None => return None,
        };
        if learn {
            self.sums.learn(units, seconds, Self::KEEP);
        }
        let measured = seconds * rate_units / rate_seconds;
        Some((measured / units).clamp(Self::MIN_FACTOR, Self::MAX_FACTOR))
    }
}

/// Replaces the estimated charges of a batch that ran with its calls'
/// shares of the measured device time `took` (see
/// [`State::correct_charge`]). A failed batch teaches nothing and is
/// charged at least its estimate: failing is no way to get device time
/// cheap.
fn charge_measured(shared: &Shared, rate: &mut DeviceRate, charged: &[(Arc<str>, u64)], took: Duration, ok: bool) {
    let estimated: u64 = charged.iter().map(|(_, cost)| cost).sum();
    let Some(factor) = rate.factor(estimated, took, ok) else { return };
    let factor = if ok { factor } else { factor.max(1.0) };
    let mut state = shared.lock();
    for (tenant, cost) in charged {
        state.correct_charge(tenant, *cost, (*cost as f64 * factor).round() as u64);
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

/// Blocks until a batch is due (or shutdown: `None`). Answers expired calls
/// on the way. Batches are limited to what `sizer` says pays on this device.
/// Also returns how many calls of the batch's shape were waiting.
fn wait_for_batch(shared: &Shared, sizer: &BatchSizer) -> Option<(Vec<Entry>, usize)> {
    let limit = |shape: &[usize]| sizer.limit(shape);
    let mut state = shared.lock();
    loop {
        if shared.shutdown.load(Ordering::SeqCst) {
            return None;
        }
        let now = Instant::now();
        state = match state.readiness(now, limit) {
            Readiness::Empty => shared.wake.wait(state).unwrap_or_else(|p| p.into_inner()),
            Readiness::WaitUntil(due) => shared.wake.wait_timeout(state, due - now).unwrap_or_else(|p| p.into_inner()).0,
            Readiness::Ready => {
                let waiting = state.front_shape_count();
                let formed = state.next_batch(now, limit);

                let more = !state.is_empty();
                drop(state);
                if more {
                    // Another idle device can start on what is left.
                    shared.wake.notify_one();
                }
                shared.metrics.record_dropped(formed.expired.len(), formed.cancelled);
                for entry in formed.expired {
                    let _ = entry.reply.send(Err(InferError::DeadlineExceeded));
                }
                if !formed.batch.is_empty() {
                    return Some((formed.batch, waiting));
                }
                shared.lock()
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn device_rate_charges_nothing_while_warming_up() {
        let mut rate = DeviceRate::default();
        for _ in 0..DeviceRate::WARM_UP {
            assert_eq!(rate.factor(1000, 900 * MS, true), None, "a slow first run teaches nothing");
        }
        assert_eq!(rate.factor(1000, 10 * MS, false), None, "a failed batch teaches no rate");
        assert_eq!(rate.factor(1000, 10 * MS, true), Some(1.0), "the first measured batch is the rate");
        assert_eq!(rate.factor(0, 10 * MS, true), None);
        assert_eq!(rate.factor(1000, Duration::ZERO, true), None);
    }

    #[test]
    fn device_rate_charges_slow_batches_more_within_bounds() {
        let mut rate = DeviceRate::default();
        for _ in 0..DeviceRate::WARM_UP + 1 {
            rate.factor(1000, 10 * MS, true);
        }
        let slow = rate.factor(1000, 20 * MS, false).unwrap();
        assert!((slow - 2.0).abs() < 1e-9, "twice the time, twice the cost: {slow}");
        let fast = rate.factor(1000, 5 * MS, false).unwrap();
        assert!((fast - 0.5).abs() < 1e-9, "half the time, half the cost: {fast}");
        assert_eq!(rate.factor(1000, 10_000 * MS, false), Some(DeviceRate::MAX_FACTOR), "a stalled batch is charged at most 16×");
        assert_eq!(rate.factor(1000, Duration::from_micros(1), false), Some(DeviceRate::MIN_FACTOR));
    }

    #[test]
    fn device_rate_weighs_batches_by_their_time() {
        let mut rate = DeviceRate::default();
        for _ in 0..DeviceRate::WARM_UP {
            rate.factor(1000, 10 * MS, true);
        }
        // One long batch at 10 000 units in 400 ms, ten quick ones at 1000 in 10 ms.
        rate.factor(10_000, 400 * MS, true);
        for _ in 0..10 {
            rate.factor(1000, 10 * MS, true);
        }
        // About 14 000 units in 0.32 s once decayed: some 43 800 units a
        // second, so a quick batch is charged about 0.44 of its estimate (an
        // average of the eleven batches' own rates, 93 000 units a second,
        // would say 0.93: the quick batches would outweigh the long one).
        let factor = rate.factor(1000, 10 * MS, false).unwrap();
        assert!((0.42..0.46).contains(&factor), "factor {factor}");
    }
}
