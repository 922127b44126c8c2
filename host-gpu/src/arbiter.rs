//! How the models on one set of devices share them: one virtual clock for
//! every tenant, and each device run by one batch at a time, that of the
//! model whose next batch's tenant is served least.
//!
//! Each model has its own [`Queue`], batch sizer and device workers (one per
//! device; worker `i` of every model runs on device `i`). Were each model
//! fair on its own, a tenant busy on two models would get a share of each:
//! measured, a tenant on `centerface` and `centerface-int8` got 3× the
//! device time of a tenant on `centerface` alone. Here the tenants'
//! service is one [`Ledger`] for all models, and a device that is free goes
//! to the model whose queue has the least served picking tenant
//! ([`Queue::priority`]); the other models' workers for that device wait.
//! So the rule inside a queue (least served first, see [`crate::queue`])
//! holds across queues.
//!
//! What a batch is charged is its measured device time turned into cost
//! units at one rate per device, whatever the model ([`DeviceRate`]): a
//! second of one model's batch costs as much as a second of another's, so
//! a tenant of a faster model gets more calls through, not more of the
//! device.
//!
//! Everything here is under one lock, taken briefly by callers queueing
//! calls and by workers picking and finishing batches; no engine runs
//! under it.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::backlog::{Pending, RateSums};
use crate::queue::{Entry, Ledger, Queue, QueueConfig, Readiness};

/// A model's queue in its arbiter.
pub(crate) type QueueId = u64;

/// The devices shared by some models, and the tenants' one ledger (see the
/// module docs). Clones share the same state. A batcher started alone
/// ([`crate::Batcher::start`]) has one of its own.
#[derive(Clone, Default)]
pub struct Arbiter {
    inner: Arc<Mutex<Slots>>,
}

impl std::fmt::Debug for Arbiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arbiter").finish_non_exhaustive()
    }
}

impl Arbiter {
    /// Devices shared by no model yet, and an empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// The shared state, locked. Workers never panic holding it (engines
    /// run outside it, under catch_unwind), so a poisoned lock still holds
    /// sound state.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Slots> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets a tenant's fairness weight, for every model (see [`Ledger::set_weight`]).
    pub fn set_tenant_weight(&self, tenant: &str, weight: u32) {
        self.lock().ledger.set_weight(tenant.into(), weight);
    }

    /// A tenant's fairness weight (1 unless set).
    pub fn tenant_weight(&self, tenant: &str) -> u32 {
        self.lock().ledger.weight(tenant)
    }

    /// Adds a model's queue, served by workers on devices `0..devices`.
    pub(crate) fn register(&self, config: QueueConfig, devices: usize) -> QueueId {
        let mut slots = self.lock();
        while slots.devices.len() < devices {
            slots.devices.push(Device::default());
        }
        let id = slots.next_id;
        slots.next_id += 1;
        slots.queues.insert(id, Member { queue: Queue::new(config), devices });
        id
    }

    /// Removes a model's queue (its batcher stops), handing back the calls
    /// still waiting in it; the devices go to the other models.
    pub(crate) fn unregister(&self, id: QueueId) -> Vec<Entry> {
        let mut slots = self.lock();
        let drained = match slots.queues.remove(&id) {
            Some(mut member) => member.queue.drain(&mut slots.ledger),
            None => Vec::new(),
        };
        slots.wake_all();
        drained
    }
}

/// A model's queue and how many devices its workers run on.
#[derive(Debug)]
struct Member {
    queue: Queue,
    devices: usize,
}

/// One device: whether a batch runs on it, the condition its idle workers
/// wait on (every model's), and its rate of cost units per second.
#[derive(Debug, Default)]
struct Device {
    busy: bool,
    wake: Arc<Condvar>,
    rate: DeviceRate,
}

/// What the arbiter's lock guards: the ledger, the models' queues, the devices.
#[derive(Debug, Default)]
pub(crate) struct Slots {
    /// Every tenant's service, weight and the clock, for all queues.
    pub(crate) ledger: Ledger,
    queues: HashMap<QueueId, Member>,
    devices: Vec<Device>,
    next_id: QueueId,
}

impl Slots {
    /// A model's queue, if it is still registered.
    pub(crate) fn queue(&self, id: QueueId) -> Option<&Queue> {
        self.queues.get(&id).map(|m| &m.queue)
    }

    /// A model's queue with the ledger, to change both.
    pub(crate) fn parts(&mut self, id: QueueId) -> Option<(&mut Queue, &mut Ledger)> {
        let member = self.queues.get_mut(&id)?;
        Some((&mut member.queue, &mut self.ledger))
    }

    /// The model whose worker should run the next batch on `device` at
    /// `now`: of the queues with a worker there whose batch is due, the one
    /// whose picking tenant is served least (ties: its older call, then the
    /// first model); if none is due (each holds a partial batch to fill,
    /// `max_delay`), the least served of those, which waits until it is.
    pub(crate) fn turn(&self, device: usize, now: Instant) -> Option<QueueId> {
        let mut due = None;
        let mut held = None;
        for (id, member) in self.queues.iter().filter(|(_, m)| m.devices > device) {
            let Some(priority) = member.queue.priority(&self.ledger) else { continue };
            let candidate = Some((priority, *id));
            let best = if member.queue.readiness(&self.ledger, now, |_| usize::MAX) == Readiness::Ready { &mut due } else { &mut held };
            if best.is_none() || candidate < *best {
                *best = candidate;
            }
        }
        due.or(held).map(|(_, id)| id)
    }

    /// The cost units waiting for each tenant in every queue, with its
    /// weight: the work ahead of a new call on these devices, whatever
    /// its model (see [`crate::backlog`]).
    pub(crate) fn waiting(&self) -> Vec<(Arc<str>, Pending)> {
        let mut all: HashMap<Arc<str>, Pending> = HashMap::new();
        for (tenant, pending) in self.queues.values().flat_map(|m| m.queue.waiting(&self.ledger)) {
            let sum = all.entry(tenant).or_insert(Pending { queued: 0, weight: pending.weight });
            sum.queued = sum.queued.saturating_add(pending.queued);
        }
        all.into_iter().collect()
    }

    /// Whether a batch runs on `device`.
    pub(crate) fn is_busy(&self, device: usize) -> bool {
        self.devices.get(device).is_some_and(|d| d.busy)
    }

    /// Marks `device` as running a batch, or free.
    pub(crate) fn set_busy(&mut self, device: usize, busy: bool) {
        if let Some(d) = self.devices.get_mut(device) {
            d.busy = busy;
        }
    }

    /// What the idle workers of `device` wait on.
    pub(crate) fn wake(&self, device: usize) -> Arc<Condvar> {
        self.devices.get(device).map(|d| Arc::clone(&d.wake)).unwrap_or_default()
    }

    /// Whether any queue has calls waiting.
    pub(crate) fn any_waiting(&self) -> bool {
        self.queues.values().any(|m| !m.queue.is_empty())
    }

    /// Wakes the workers of one idle device (each model's, as the device's
    /// next batch may be any model's): new work has come.
    pub(crate) fn wake_one_idle(&self) {
        if let Some(device) = self.devices.iter().find(|d| !d.busy) {
            device.wake.notify_all();
        }
    }

    /// Wakes the workers of `device`: it is free, or whose turn it is changed.
    pub(crate) fn wake_device(&self, device: usize) {
        if let Some(d) = self.devices.get(device) {
            d.wake.notify_all();
        }
    }

    /// Wakes the workers of every idle device: whose turn it is may have
    /// changed (a batch charged, a tenant removed, calls purged).
    pub(crate) fn wake_idle(&self) {
        for device in self.devices.iter().filter(|d| !d.busy) {
            device.wake.notify_all();
        }
    }

    /// Wakes every worker (a model stopping, or leaving).
    pub(crate) fn wake_all(&self) {
        for device in &self.devices {
            device.wake.notify_all();
        }
    }

    /// Replaces the estimated charges of a batch that ran on `device` with
    /// its calls' shares of the measured device time `took`, at the
    /// device's rate (see [`Ledger::correct_charge`]). A failed batch
    /// teaches nothing and is charged at least its estimate: failing is no
    /// way to get device time cheap.
    pub(crate) fn charge_measured(&mut self, device: usize, charged: &[(Arc<str>, u64)], took: Duration, ok: bool) {
        let estimated: u64 = charged.iter().map(|(_, cost)| cost).sum();
        let Some(rate) = self.devices.get_mut(device).map(|d| &mut d.rate) else { return };
        let Some(factor) = rate.factor(estimated, took, ok) else { return };
        let factor = if ok { factor } else { factor.max(1.0) };
        for (tenant, cost) in charged {
            self.ledger.correct_charge(tenant, *cost, (*cost as f64 * factor).round() as u64);
        }
    }
}

/// A device's usual speed, in cost units ([`crate::queue::sample_cost`])
/// per second of device time, learned from the batches of every model on
/// it: it turns a batch's measured time into what each of its calls cost,
/// at one rate for all models, so that a second of device time costs the
/// same whichever model took it.
#[derive(Debug, Default)]
pub(crate) struct DeviceRate {
    sums: RateSums,
}

impl DeviceRate {
    /// First batches of a device teach and charge nothing.
    pub(crate) const WARM_UP: u32 = RateSums::WARM_UP;
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

    fn push(slots: &mut Slots, id: QueueId, tenant: &str, at: Instant) -> tokio::sync::oneshot::Receiver<crate::queue::Reply> {
        use crate::tensor::{ElementType, Tensor};
        let (tx, rx) = tokio::sync::oneshot::channel();
        let input = Tensor::new(vec![4], ElementType::U8, vec![0; 4]).unwrap();
        let entry = Entry {
            tenant: tenant.into(),
            input,
            deadline: at + Duration::from_secs(60),
            enqueued: at,
            reply: tx,
            device_us: None,
            tag: None,
        };
        let (queue, ledger) = slots.parts(id).unwrap();
        queue.push(ledger, entry).unwrap();
        rx
    }

    /// A model holding a partial batch to fill (`max_delay`) does not keep
    /// the device from another model whose batch is due, though its tenant
    /// is served less; once its own batch is due, it has the device.
    #[test]
    fn a_held_batch_leaves_the_device_to_a_due_one() {
        let arbiter = Arbiter::new();
        let config = |max_delay| QueueConfig { max_batch: 4, capacity: 8, tenant_capacity: 8, max_delay };
        let holding = arbiter.register(config(Duration::from_secs(1)), 1);
        let eager = arbiter.register(config(Duration::ZERO), 1);
        let now = Instant::now();
        let mut slots = arbiter.lock();
        let _keep = [push(&mut slots, holding, "quiet", now), push(&mut slots, eager, "busy", now)];
        slots.ledger.take_turn(&"busy".into(), 1024);
        assert_eq!(slots.turn(0, now), Some(eager), "the held batch is not due");
        assert_eq!(slots.turn(0, now + Duration::from_secs(2)), Some(holding), "due, the less served tenant's model goes first");
    }

    /// A tenant removed from one model's queue while it still waits in
    /// another's keeps its standing there (were it forgotten, it would be
    /// the least served of all and jump the queue); the last removal
    /// forgets it.
    #[test]
    fn a_tenant_is_forgotten_by_its_last_queue() {
        let arbiter = Arbiter::new();
        let config = QueueConfig { max_batch: 4, capacity: 8, tenant_capacity: 8, max_delay: Duration::ZERO };
        let (a, b) = (arbiter.register(config.clone(), 1), arbiter.register(config, 1));
        let now = Instant::now();
        let mut slots = arbiter.lock();
        let _keep = [push(&mut slots, a, "gone", now), push(&mut slots, b, "gone", now), push(&mut slots, b, "other", now)];
        slots.ledger.take_turn(&"gone".into(), 4096);
        slots.ledger.take_turn(&"other".into(), 1024);
        let (queue, ledger) = slots.parts(a).unwrap();
        assert_eq!(queue.remove_tenant(ledger, "gone").len(), 1);
        ledger.forget("gone");
        assert!(slots.ledger.standing("gone") > slots.ledger.standing("other"), "still more served than the other tenant");
        let (queue, ledger) = slots.parts(b).unwrap();
        assert_eq!(queue.remove_tenant(ledger, "gone").len(), 1);
        ledger.forget("gone");
        assert_eq!(slots.ledger.standing("gone"), (0, 0), "forgotten once no queue holds it");
    }

    /// Two models on one device, each with a batch of the same size, one
    /// twice as slow: one rate for the device charges the slow one's calls
    /// twice the fast one's, as their device time says.
    #[test]
    fn one_rate_per_device_charges_models_by_their_time() {
        let arbiter = Arbiter::new();
        let config = QueueConfig { max_batch: 4, capacity: 8, tenant_capacity: 8, max_delay: Duration::ZERO };
        arbiter.register(config, 1);
        let mut slots = arbiter.lock();
        for _ in 0..=DeviceRate::WARM_UP {
            slots.charge_measured(0, &[("warm".into(), 1000)], 15 * MS, true);
        }
        for _ in 0..50 {
            slots.charge_measured(0, &[("fast".into(), 1000)], 10 * MS, true);
            slots.charge_measured(0, &[("slow".into(), 1000)], 20 * MS, true);
        }
        let slow = slots.devices[0].rate.factor(1000, 20 * MS, false).unwrap();
        let fast = slots.devices[0].rate.factor(1000, 10 * MS, false).unwrap();
        assert!((slow / fast - 2.0).abs() < 1e-9, "slow/fast charge {:.3}", slow / fast);
    }

    /// A device is run by the model whose waiting tenant is served least:
    /// after a tenant's calls to one model are charged, another model's
    /// tenant has the device, and a model with no worker there never has.
    #[test]
    fn a_free_device_goes_to_the_least_served_tenants_model() {
        use crate::queue::sample_cost;
        let arbiter = Arbiter::new();
        let config = QueueConfig { max_batch: 4, capacity: 8, tenant_capacity: 8, max_delay: Duration::ZERO };
        let (a, b) = (arbiter.register(config.clone(), 1), arbiter.register(config.clone(), 1));
        let elsewhere = arbiter.register(config, 2);
        let now = Instant::now();
        let mut slots = arbiter.lock();
        assert_eq!(slots.turn(0, now), None);
        let _keep = [push(&mut slots, a, "busy", now), push(&mut slots, b, "quiet", now), push(&mut slots, elsewhere, "other", now)];
        assert_eq!(slots.turn(1, now), Some(elsewhere), "only that model has a worker on device 1");
        slots.ledger.take_turn(&"busy".into(), 4 * sample_cost(&[4]));
        slots.ledger.take_turn(&"other".into(), 4 * sample_cost(&[4]));
        assert_eq!(slots.turn(0, now), Some(b), "the quiet tenant's model has the device");
        let drained = {
            drop(slots);
            arbiter.unregister(b)
        };
        assert_eq!(drained.len(), 1);
        assert_eq!(arbiter.lock().turn(0, now), Some(a), "level in service, the busy tenant took its turn longer ago");
    }
}
