//! How long a new call would wait: the work ahead of it under the queue's
//! weighted fair sharing, over the pace its devices drain work at.
//!
//! Admission uses this to refuse at once what could not finish before its
//! deadline, instead of queueing it to time out after taking a place, a
//! decode and an instance that admitted work needed.
//!
//! The work ahead of a call of tenant `t` is what a fluid fair share
//! (generalised processor sharing) would run before it ends: all of `t`'s
//! own pending work and the call itself (`P_t + c`), and of every other
//! tenant `u` no more than its weighted share of that time,
//! `min(P_u, (P_t + c) · w_u / w_t)`. A light tenant's call is therefore not
//! refused for a flooding neighbour's backlog, as the batcher would not make
//! it wait behind it either.
//!
//! A tenant's pending work is the larger of what it has queued and what its
//! admitted requests have been promised ([`Promise`]): requests still
//! decoding their image will queue their calls soon, and a flood of them is
//! seen before it reaches the queue.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The share of its time left within which a call's estimated wait must
/// fall for it to be admitted. The estimate is an average: a queue kept
/// exactly at the deadline would see a share of its calls miss it, and
/// keeping it shorter costs no throughput (the devices stay busy).
pub const HEADROOM: f64 = 0.8;

/// Whether a call estimated to wait `wait` fits in the `left` of its time
/// (within [`HEADROOM`]).
pub fn fits(wait: Duration, left: Duration) -> bool {
    wait.as_secs_f64() <= left.as_secs_f64() * HEADROOM
}

/// The work of a tenant as the estimate sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    /// Cost units ([`crate::queue::sample_cost`]) of its calls waiting.
    pub queued: u64,
    /// Its fairness weight (at least 1).
    pub weight: u32,
}

/// Cost units of the work a fluid fair share runs before a call of `cost`
/// units from `tenant` ends, given every tenant's pending work (the caller's
/// own included, if it has any).
pub fn work_ahead<'a>(tenant: &str, cost: u64, pending: impl IntoIterator<Item = (&'a str, Pending)> + Clone) -> u64 {
    let own = pending.clone().into_iter().find(|(t, _)| *t == tenant).map(|(_, p)| p);
    let own_weight = u128::from(own.map_or(1, |p| p.weight).max(1));
    let own_work = u128::from(own.map_or(0, |p| p.queued)).saturating_add(u128::from(cost));
    let others: u128 = pending
        .into_iter()
        .filter(|(t, _)| *t != tenant)
        .map(|(_, p)| u128::from(p.queued).min(own_work.saturating_mul(u128::from(p.weight.max(1))) / own_weight))
        .sum();
    u64::try_from(own_work.saturating_add(others)).unwrap_or(u64::MAX)
}

/// Wall-clock pace of a model's devices: cost units run per second, each
/// device learning its own from its batches, the pool's the sum (devices
/// run batches side by side).
#[derive(Debug)]
struct Pace {
    devices: Vec<DevicePace>,
}

/// One device's wall-clock pace, believed slow quickly and fast slowly: the
/// lower of a steady rate (over a few dozen batches) and a recent one (over
/// about two). A device that slows at once (a neighbour process takes the
/// CPU) stops admitting work it can no longer finish within a batch or
/// two; one that speeds up earns its admissions back over the steady rate.
#[derive(Debug, Default, Clone, Copy)]
struct DevicePace {
    steady: RateSums,
    recent: RateSums,
}

impl DevicePace {
    fn learn(&mut self, units: f64, seconds: f64) {
        self.steady.learn(units, seconds, PACE_KEEP);
        self.recent.learn(units, seconds, RECENT_KEEP);
    }

    fn per_second(&self) -> Option<f64> {
        let steady = self.steady.per_second()?;
        Some(self.recent.per_second().map_or(steady, |recent| recent.min(steady)))
    }
}

/// A device's rate of cost units per second, learned from its batches:
/// decaying sums of their units and seconds, whose ratio weighs batches by
/// their time (a run of quick batches does not outweigh one long one). The
/// first [`RateSums::WARM_UP`] batches (the engine warming up) teach
/// nothing. The pace here (wall clock) and the batcher's charge correction
/// (device time) each keep one per device.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RateSums {
    units: f64,
    seconds: f64,
    /// Batches seen (up to [`RateSums::WARM_UP`]).
    seen: u32,
}

impl RateSums {
    /// Batches that teach nothing.
    pub(crate) const WARM_UP: u32 = 3;

    /// Whether the warm-up batches have been seen.
    pub(crate) fn warm(&self) -> bool {
        self.seen >= Self::WARM_UP
    }

    /// A batch of `units` in `seconds`: counted towards the warm-up, or
    /// added, each sum first keeping `keep` of what it had.
    pub(crate) fn learn(&mut self, units: f64, seconds: f64, keep: f64) {
        if !self.warm() {
            self.seen += 1;
            return;
        }
        self.units = self.units * keep + units;
        self.seconds = self.seconds * keep + seconds;
    }

    /// The sums of units and seconds, once some batch was added.
    pub(crate) fn sums(&self) -> Option<(f64, f64)> {
        (self.seconds > 0.0 && self.units > 0.0).then_some((self.units, self.seconds))
    }

    fn per_second(&self) -> Option<f64> {
        self.sums().map(|(units, seconds)| units / seconds)
    }
}

/// What each batch keeps of a device's steady wall-clock sums: the pace
/// follows a change of load (batch sizes) within a few dozen batches.
const PACE_KEEP: f64 = 0.9;

/// What each batch keeps of a device's recent sums (see [`DevicePace`]).
const RECENT_KEEP: f64 = 0.5;

impl Pace {
    fn per_second(&self) -> Option<f64> {
        let rates: Vec<f64> = self.devices.iter().filter_map(DevicePace::per_second).collect();
        (!rates.is_empty()).then(|| rates.iter().sum())
    }
}

#[derive(Debug)]
struct Inner {
    pace: Pace,
    /// Cost units promised to each tenant's admitted requests.
    promised: HashMap<Arc<str>, u64>,
    /// Cost units in the batches running now, all devices together.
    running: u64,
}

/// A model's backlog book: its devices' pace, the work promised to admitted
/// requests and the work running. Shared by the batcher and its workers.
#[derive(Debug)]
pub struct Backlog {
    inner: Mutex<Inner>,
}

impl Backlog {
    /// A book for a pool of `devices` devices that has run nothing yet.
    pub fn new(devices: usize) -> Arc<Self> {
        let pace = Pace { devices: vec![DevicePace::default(); devices.max(1)] };
        Arc::new(Self { inner: Mutex::new(Inner { pace, promised: HashMap::new(), running: 0 }) })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing panics while holding it; a poisoned book is still sound.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A device starts a batch of `units`.
    pub fn started(&self, units: u64) {
        let mut inner = self.lock();
        inner.running = inner.running.saturating_add(units);
    }

    /// Device `index` ran a batch of `units` in `took` (wall clock); a
    /// failed batch says nothing of the pace.
    pub fn finished(&self, index: usize, units: u64, took: Duration, ok: bool) {
        let mut inner = self.lock();
        inner.running = inner.running.saturating_sub(units);
        if let Some(device) = inner.pace.devices.get_mut(index).filter(|_| ok) {
            device.learn(units as f64, took.as_secs_f64());
        }
    }

    /// The pool's pace in cost units a second, once a device has learned one.
    pub fn per_second(&self) -> Option<f64> {
        self.lock().pace.per_second()
    }

    /// How long a call of `cost` units from `tenant` would take to end,
    /// given `queued` (each waiting tenant's work; promises raise it);
    /// `None` while no device has learned its pace.
    pub fn estimate(&self, tenant: &str, cost: u64, queued: &[(Arc<str>, Pending)]) -> Option<Duration> {
        let inner = self.lock();
        let per_second = inner.pace.per_second()?;
        let mut pending: HashMap<&str, Pending> = queued.iter().map(|(t, p)| (&**t, *p)).collect();
        for (t, &promised) in &inner.promised {
            let entry = pending.entry(t).or_insert(Pending { queued: 0, weight: weight_of(queued, t) });
            entry.queued = entry.queued.max(promised);
        }
        let ahead = work_ahead(tenant, cost, pending.iter().map(|(t, p)| (*t, *p))).saturating_add(inner.running);
        Some(Duration::from_secs_f64((ahead as f64 / per_second).min(1e9)))
    }

    /// Promises `tenant` a call of `cost` units, until the returned guard drops.
    pub fn promise(self: &Arc<Self>, tenant: Arc<str>, cost: u64) -> Promise {
        let mut inner = self.lock();
        let total = inner.promised.entry(Arc::clone(&tenant)).or_default();
        *total = total.saturating_add(cost);
        Promise { book: Arc::clone(self), tenant, cost }
    }

    fn unpromise(&self, tenant: &str, cost: u64) {
        let mut inner = self.lock();
        if let Some(total) = inner.promised.get_mut(tenant) {
            *total = total.saturating_sub(cost);
            if *total == 0 {
                inner.promised.remove(tenant);
            }
        }
    }
}

/// A tenant's weight as the queue reports it (1 for a tenant with nothing queued).
fn weight_of(queued: &[(Arc<str>, Pending)], tenant: &str) -> u32 {
    queued.iter().find(|(t, _)| &**t == tenant).map_or(1, |(_, p)| p.weight)
}

/// Work promised to an admitted request (see [`Backlog::promise`]): counted
/// as its tenant's pending work until dropped.
#[derive(Debug)]
pub struct Promise {
    book: Arc<Backlog>,
    tenant: Arc<str>,
    cost: u64,
}

impl Drop for Promise {
    fn drop(&mut self) {
        self.book.unpromise(&self.tenant, self.cost);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(queued: u64, weight: u32) -> Pending {
        Pending { queued, weight }
    }

    #[test]
    fn a_lone_tenant_waits_for_all_its_own_work() {
        assert_eq!(work_ahead("a", 10, [("a", p(100, 1))]), 110);
        assert_eq!(work_ahead("a", 10, []), 10, "an empty queue: only the call itself");
    }

    #[test]
    fn a_light_tenant_does_not_wait_behind_a_floods_backlog() {
        // The flood has 10 000 units queued; the light tenant's call of 10
        // runs after at most 10 units of the flood's (equal weights).
        assert_eq!(work_ahead("light", 10, [("flood", p(10_000, 1))]), 20);
        // The flood itself waits behind all of its own and the light one's.
        assert_eq!(work_ahead("flood", 10, [("flood", p(10_000, 1)), ("light", p(10, 1))]), 10_020);
    }

    #[test]
    fn weights_scale_a_neighbours_share() {
        // A neighbour of weight 3 runs three units for each of ours.
        assert_eq!(work_ahead("a", 10, [("b", p(1_000, 3))]), 40);
        // Ours of weight 2 halves what a neighbour of weight 1 runs meanwhile.
        assert_eq!(work_ahead("a", 10, [("a", p(10, 2)), ("b", p(1_000, 1))]), 30);
    }

    #[test]
    fn the_estimate_waits_for_a_learned_pace() {
        let book = Backlog::new(1);
        assert_eq!(book.estimate("a", 1024, &[]), None);
        for _ in 0..RateSums::WARM_UP {
            book.finished(0, 1024, Duration::from_secs(10), true);
        }
        assert_eq!(book.estimate("a", 1024, &[]), None, "warm-up batches teach nothing");
        book.finished(0, 1024, Duration::from_millis(100), true);
        let wait = book.estimate("a", 1024, &[]).unwrap();
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-6, "one sample at 10 a second: {wait:?}");
        book.finished(0, 1024, Duration::from_secs(100), false);
        assert_eq!(book.estimate("a", 1024, &[]), Some(wait), "a failed batch teaches no pace");
    }

    #[test]
    fn a_device_that_slows_is_believed_at_once_one_that_speeds_up_slowly() {
        let book = Backlog::new(1);
        let second = Duration::from_secs(1);
        for _ in 0..RateSums::WARM_UP + 30 {
            book.finished(0, 1000, second, true);
        }
        assert_eq!(book.per_second(), Some(1000.0));
        // A neighbour takes the CPU: batches take twice as long.
        book.finished(0, 1000, 2 * second, true);
        let slowed = book.per_second().unwrap();
        assert!(slowed < 700.0, "one slow batch already lowers the pace: {slowed}");
        for _ in 0..3 {
            book.finished(0, 1000, 2 * second, true);
        }
        assert!(book.per_second().unwrap() < 550.0, "a few more and it is the new pace");
        // The neighbour leaves: the pace climbs back over the steady rate.
        book.finished(0, 1000, second, true);
        let recovering = book.per_second().unwrap();
        assert!(recovering < 800.0, "one fast batch does not restore the pace: {recovering}");
        for _ in 0..60 {
            book.finished(0, 1000, second, true);
        }
        assert!(book.per_second().unwrap() > 990.0, "many do");
    }

    #[test]
    fn devices_side_by_side_add_their_paces() {
        let book = Backlog::new(2);
        for index in 0..2 {
            for _ in 0..=RateSums::WARM_UP {
                book.finished(index, 1000, Duration::from_secs(1), true);
            }
        }
        assert_eq!(book.per_second(), Some(2000.0));
    }

    #[test]
    fn promises_and_running_batches_count_as_work_ahead() {
        let book = Backlog::new(1);
        for _ in 0..=RateSums::WARM_UP {
            book.finished(0, 1000, Duration::from_secs(1), true);
        }
        let queued = [(Arc::<str>::from("flood"), p(2_000, 1))];
        let before = book.estimate("flood", 1000, &queued).unwrap();
        assert_eq!(before, Duration::from_secs(3));
        let promises: Vec<Promise> = (0..5).map(|_| book.promise("flood".into(), 1000)).collect();
        assert_eq!(book.estimate("flood", 1000, &queued).unwrap(), Duration::from_secs(6), "five promised outweigh two queued");
        assert_eq!(book.estimate("light", 1000, &queued).unwrap(), Duration::from_secs(2), "the light tenant shares");
        book.started(1000);
        assert_eq!(book.estimate("light", 1000, &queued).unwrap(), Duration::from_secs(3));
        book.finished(0, 1000, Duration::from_secs(1), true);
        drop(promises);
        assert_eq!(book.estimate("flood", 1000, &queued).unwrap(), before, "promises end with their requests");
    }
}
