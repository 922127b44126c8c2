//! The batching queue as pure state: no threads, no clocks of its own.
//!
//! Calls wait in per-tenant FIFO sub-queues. A batch is formed by deficit
//! round-robin over the tenants (each turn adds the tenant's weight to its
//! deficit; each sample taken costs 1), restricted to one input shape per
//! batch (the shape at the head of the tenant whose turn it is). Expired and
//! cancelled calls are dropped before they can reach a device. Capacity is
//! bounded globally and per tenant: a full queue refuses at once.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::error::InferError;
use crate::tensor::Tensor;

/// What a waiting caller receives: its outputs, or why there are none.
pub type Reply = Result<Vec<Tensor>, InferError>;

/// One queued inference call.
#[derive(Debug)]
pub struct Entry {
    /// Whose call this is (the fairness key).
    pub tenant: Arc<str>,
    /// The validated input sample.
    pub input: Tensor,
    /// After this instant the call is answered `DeadlineExceeded` instead of run.
    pub deadline: Instant,
    /// When the call entered the queue.
    pub enqueued: Instant,
    /// Where the answer goes; closed if the caller went away.
    pub reply: oneshot::Sender<Reply>,
}

impl Entry {
    fn is_cancelled(&self) -> bool {
        self.reply.is_closed()
    }
}

/// Limits of one model's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConfig {
    /// Most samples in one batch.
    pub max_batch: usize,
    /// Most calls waiting, all tenants together.
    pub capacity: usize,
    /// Most calls waiting for any one tenant.
    pub tenant_capacity: usize,
    /// How long a partial batch may be held back to fill; zero sends at once.
    pub max_delay: Duration,
}

/// Whether a worker should take a batch now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Nothing is waiting.
    Empty,
    /// A partial batch is being held to fill until this instant.
    WaitUntil(Instant),
    /// Take a batch now.
    Ready,
}

/// The outcome of [`State::next_batch`].
#[derive(Debug, Default)]
pub struct Formed {
    /// Calls to run together, all of one input shape.
    pub batch: Vec<Entry>,
    /// Calls whose deadline passed; answer them `DeadlineExceeded`.
    pub expired: Vec<Entry>,
    /// Calls dropped because their caller went away.
    pub cancelled: usize,
}

#[derive(Debug)]
struct TenantQueue {
    items: VecDeque<Entry>,
    deficit: u64,
    /// Whether the tenant's current turn has already been credited.
    credited: bool,
}

/// The queue of one model.
#[derive(Debug)]
pub struct State {
    config: QueueConfig,
    tenants: HashMap<Arc<str>, TenantQueue>,
    /// Tenants with waiting calls, in round-robin order; the front has the turn.
    ring: VecDeque<Arc<str>>,
    weights: HashMap<Arc<str>, u32>,
    len: usize,
}

impl State {
    /// An empty queue.
    pub fn new(config: QueueConfig) -> Self {
        Self { config, tenants: HashMap::new(), ring: VecDeque::new(), weights: HashMap::new(), len: 0 }
    }

    /// The queue's limits.
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// Calls waiting, all tenants together.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Calls waiting for one tenant.
    pub fn tenant_len(&self, tenant: &str) -> usize {
        self.tenants.get(tenant).map_or(0, |q| q.items.len())
    }

    /// Sets a tenant's share: with weights 3 and 1, two busy tenants get
    /// three samples to one. Zero is treated as 1.
    pub fn set_weight(&mut self, tenant: Arc<str>, weight: u32) {
        self.weights.insert(tenant, weight.max(1));
    }

    fn weight(&self, tenant: &str) -> u64 {
        u64::from(self.weights.get(tenant).copied().unwrap_or(1))
    }

    /// Queues a call, or hands it back with `Overloaded` when the queue or
    /// the tenant's share of it is full.
    pub fn push(&mut self, entry: Entry) -> Result<(), Box<(InferError, Entry)>> {
        if self.is_full_for(&entry.tenant) {
            // Calls whose callers went away still hold space: reclaim it first.
            self.purge_cancelled();
            if self.is_full_for(&entry.tenant) {
                return Err(Box::new((InferError::Overloaded, entry)));
            }
        }
        let tenant = Arc::clone(&entry.tenant);
        let queue = self.tenants.entry(Arc::clone(&tenant)).or_insert_with(|| {
            TenantQueue { items: VecDeque::new(), deficit: 0, credited: false }
        });
        if queue.items.is_empty() {
            self.ring.push_back(tenant);
        }
        queue.items.push_back(entry);
        self.len += 1;
        Ok(())
    }

    fn is_full_for(&self, tenant: &str) -> bool {
        self.len >= self.config.capacity || self.tenant_len(tenant) >= self.config.tenant_capacity
    }

    /// Drops calls whose callers went away; returns how many.
    fn purge_cancelled(&mut self) -> usize {
        let before = self.len;
        for queue in self.tenants.values_mut() {
            queue.items.retain(|e| !e.is_cancelled());
        }
        self.len = self.tenants.values().map(|q| q.items.len()).sum();
        self.forget_empty_tenants();
        before - self.len
    }

    /// Removes tenants left without calls from the map and the ring.
    fn forget_empty_tenants(&mut self) {
        self.tenants.retain(|_, q| !q.items.is_empty());
        let tenants = &self.tenants;
        self.ring.retain(|t| tenants.contains_key(t));
    }

    /// Whether a batch should be taken now (see [`QueueConfig::max_delay`]);
    /// `limit` gives the largest batch wanted for an input shape (it is
    /// capped at `max_batch`), so a held batch goes as soon as it is that full.
    pub fn readiness(&self, now: Instant, limit: impl Fn(&[usize]) -> usize) -> Readiness {
        let Some(oldest) = self.tenants.values().filter_map(|q| q.items.front()).map(|e| e.enqueued).min() else {
            return Readiness::Empty;
        };
        if self.config.max_delay.is_zero() || self.front_shape_count() >= self.cap(limit) {
            return Readiness::Ready;
        }
        let due = oldest + self.config.max_delay;
        if due <= now { Readiness::Ready } else { Readiness::WaitUntil(due) }
    }

    /// The batch size to fill for the front shape: `limit`'s, within 1..=max_batch.
    fn cap(&self, limit: impl Fn(&[usize]) -> usize) -> usize {
        let wanted = self.front_shape().map_or(self.config.max_batch, |shape| limit(&shape));
        wanted.clamp(1, self.config.max_batch.max(1))
    }

    fn front_shape(&self) -> Option<Vec<usize>> {
        let tenant = self.ring.front()?;
        Some(self.tenants.get(tenant)?.items.front()?.input.shape().to_vec())
    }

    /// Calls waiting with the shape of the next batch (what it could take).
    pub fn front_shape_count(&self) -> usize {
        let Some(shape) = self.front_shape() else { return 0 };
        self.tenants.values().flat_map(|q| &q.items).filter(|e| e.input.shape() == shape.as_slice()).count()
    }

    /// Takes the next batch: drops expired and cancelled calls, then fills
    /// up to `limit(shape)` (at most `max_batch`) calls of one shape by
    /// deficit round-robin.
    pub fn next_batch(&mut self, now: Instant, limit: impl Fn(&[usize]) -> usize) -> Formed {
        let mut formed = Formed::default();
        self.drop_dead(now, &mut formed);
        let Some(shape) = self.front_shape() else { return formed };
        let cap = self.cap(limit);
        let mut idle_visits = 0;
        while formed.batch.len() < cap && idle_visits < self.ring.len() {
            let took = self.serve_front(&shape, cap, &mut formed.batch);
            idle_visits = if took == 0 { idle_visits + 1 } else { 0 };
        }
        formed
    }

    /// Gives the front tenant its turn; returns how many calls it contributed.
    /// The tenant keeps the turn only if the batch filled before its deficit ran out.
    fn serve_front(&mut self, shape: &[usize], max_batch: usize, batch: &mut Vec<Entry>) -> usize {
        let Some(tenant) = self.ring.front().cloned() else { return 0 };
        let weight = self.weight(&tenant);
        let Some(queue) = self.tenants.get_mut(&tenant) else { return 0 };
        if !queue.credited {
            // Unused credit carries over, but never beyond two turns' worth.
            queue.deficit = (queue.deficit + weight).min(2 * weight);
            queue.credited = true;
        }
        let mut took = 0;
        while queue.deficit > 0 && batch.len() < max_batch {
            let Some(pos) = queue.items.iter().position(|e| e.input.shape() == shape) else { break };
            batch.extend(queue.items.remove(pos));
            queue.deficit -= 1;
            took += 1;
        }
        self.len -= took;
        let turn_over = batch.len() < max_batch || queue.deficit == 0;
        if queue.items.is_empty() {
            self.tenants.remove(&tenant);
            self.ring.pop_front();
        } else if turn_over {
            queue.credited = false;
            self.ring.rotate_left(1);
        }
        took
    }

    fn drop_dead(&mut self, now: Instant, formed: &mut Formed) {
        for queue in self.tenants.values_mut() {
            let before = queue.items.len();
            let items = std::mem::take(&mut queue.items);
            for entry in items {
                if entry.is_cancelled() {
                    formed.cancelled += 1;
                } else if entry.deadline <= now {
                    formed.expired.push(entry);
                } else {
                    queue.items.push_back(entry);
                }
            }
            self.len -= before - queue.items.len();
        }
        self.forget_empty_tenants();
    }

    /// Empties the queue (at shutdown), handing back every waiting call.
    pub fn drain(&mut self) -> Vec<Entry> {
        self.ring.clear();
        self.len = 0;
        self.tenants.drain().flat_map(|(_, q)| q.items).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::ElementType;

    const SECOND: Duration = Duration::from_secs(1);
    /// No limit below `max_batch`.
    const FULL: fn(&[usize]) -> usize = |_| usize::MAX;

    fn config(max_batch: usize) -> QueueConfig {
        QueueConfig { max_batch, capacity: 100, tenant_capacity: 100, max_delay: Duration::ZERO }
    }

    /// A queued call of `tenant` with a 1-D input of length `len`; the receiver
    /// is returned so the call stays alive (dropping it cancels the call).
    fn call(tenant: &str, len: usize, now: Instant) -> (Entry, oneshot::Receiver<Reply>) {
        let (tx, rx) = oneshot::channel();
        let input = Tensor::new(vec![len], ElementType::U8, vec![0; len]).unwrap();
        let entry = Entry { tenant: tenant.into(), input, deadline: now + SECOND, enqueued: now, reply: tx };
        (entry, rx)
    }

    fn push_n(state: &mut State, tenant: &str, n: usize, now: Instant) -> Vec<oneshot::Receiver<Reply>> {
        (0..n)
            .map(|_| {
                let (entry, rx) = call(tenant, 4, now);
                state.push(entry).unwrap();
                rx
            })
            .collect()
    }

    fn tenants_of(formed: &Formed) -> Vec<&str> {
        formed.batch.iter().map(|e| &*e.tenant).collect()
    }

    #[test]
    fn batch_is_capped_at_max_batch() {
        let now = Instant::now();
        let mut state = State::new(config(4));
        let _rx = push_n(&mut state, "a", 10, now);
        assert_eq!(state.next_batch(now, FULL).batch.len(), 4);
        assert_eq!(state.len(), 6);
        assert_eq!(state.next_batch(now, FULL).batch.len(), 4);
        assert_eq!(state.next_batch(now, FULL).batch.len(), 2);
        assert!(state.is_empty());
        assert!(state.next_batch(now, FULL).batch.is_empty());
    }

    #[test]
    fn shapes_batch_separately_in_arrival_order() {
        let now = Instant::now();
        let mut state = State::new(config(8));
        let mut keep = Vec::new();
        for len in [4, 8, 4, 8, 4] {
            let (entry, rx) = call("a", len, now);
            state.push(entry).unwrap();
            keep.push(rx);
        }
        let first = state.next_batch(now, FULL);
        assert_eq!(first.batch.iter().map(|e| e.input.shape()[0]).collect::<Vec<_>>(), vec![4, 4, 4]);
        let second = state.next_batch(now, FULL);
        assert_eq!(second.batch.iter().map(|e| e.input.shape()[0]).collect::<Vec<_>>(), vec![8, 8]);
    }

    #[test]
    fn a_device_limit_caps_the_batch_below_max_batch() {
        let now = Instant::now();
        let mut state = State::new(config(8));
        let _rx = push_n(&mut state, "a", 5, now);
        let limit = |shape: &[usize]| if shape == [4] { 2 } else { 8 };
        assert_eq!(state.next_batch(now, limit).batch.len(), 2);
        assert_eq!(state.next_batch(now, |_| 0).batch.len(), 1, "a limit of 0 still takes one call");
        assert_eq!(state.next_batch(now, FULL).batch.len(), 2);
    }

    #[test]
    fn a_held_batch_goes_when_it_reaches_the_device_limit() {
        let now = Instant::now();
        let delay = Duration::from_millis(5);
        let mut state = State::new(QueueConfig { max_delay: delay, ..config(8) });
        let _rx = push_n(&mut state, "a", 2, now);
        assert_eq!(state.readiness(now, FULL), Readiness::WaitUntil(now + delay));
        assert_eq!(state.readiness(now, |_| 2), Readiness::Ready);
    }

    #[test]
    fn delay_cap_holds_partial_batch_until_due_or_full() {
        let now = Instant::now();
        let delay = Duration::from_millis(5);
        let mut state = State::new(QueueConfig { max_delay: delay, ..config(3) });
        assert_eq!(state.readiness(now, FULL), Readiness::Empty);
        let mut keep = push_n(&mut state, "a", 2, now);
        assert_eq!(state.readiness(now, FULL), Readiness::WaitUntil(now + delay));
        assert_eq!(state.readiness(now + delay, FULL), Readiness::Ready);
        keep.extend(push_n(&mut state, "b", 1, now));
        assert_eq!(state.readiness(now, FULL), Readiness::Ready, "a full batch goes at once");
    }

    #[test]
    fn zero_delay_is_always_ready() {
        let now = Instant::now();
        let mut state = State::new(config(8));
        let _rx = push_n(&mut state, "a", 1, now);
        assert_eq!(state.readiness(now, FULL), Readiness::Ready);
    }

    #[test]
    fn round_robin_shares_a_batch_between_tenants() {
        let now = Instant::now();
        let mut state = State::new(config(4));
        let _a = push_n(&mut state, "a", 10, now);
        let _b = push_n(&mut state, "b", 10, now);
        let formed = state.next_batch(now, FULL);
        assert_eq!(tenants_of(&formed), vec!["a", "b", "a", "b"]);
    }

    #[test]
    fn weights_set_the_share() {
        let now = Instant::now();
        let mut state = State::new(config(8));
        state.set_weight("a".into(), 3);
        let _a = push_n(&mut state, "a", 40, now);
        let _b = push_n(&mut state, "b", 40, now);
        let mut counts = HashMap::new();
        for _ in 0..4 {
            for e in state.next_batch(now, FULL).batch {
                *counts.entry(e.tenant.to_string()).or_insert(0) += 1;
            }
        }
        assert_eq!((counts["a"], counts["b"]), (24, 8));
    }

    #[test]
    fn a_flooding_tenant_cannot_starve_a_light_one() {
        let now = Instant::now();
        let mut state = State::new(config(4));
        let _a = push_n(&mut state, "a", 50, now);
        let _b = push_n(&mut state, "b", 2, now);
        let formed = state.next_batch(now, FULL);
        assert_eq!(formed.batch.iter().filter(|e| &*e.tenant == "b").count(), 2);
    }

    #[test]
    fn expired_calls_are_handed_back_not_batched() {
        let now = Instant::now();
        let mut state = State::new(config(4));
        let (mut old, _rx1) = call("a", 4, now);
        old.deadline = now + Duration::from_millis(1);
        state.push(old).unwrap();
        let _rx2 = push_n(&mut state, "a", 1, now);
        let formed = state.next_batch(now + Duration::from_millis(2), FULL);
        assert_eq!((formed.batch.len(), formed.expired.len()), (1, 1));
        assert!(state.is_empty());
    }

    #[test]
    fn cancelled_calls_are_skipped() {
        let now = Instant::now();
        let mut state = State::new(config(4));
        let rx = push_n(&mut state, "a", 3, now);
        drop(rx);
        let _live = push_n(&mut state, "b", 1, now);
        let formed = state.next_batch(now, FULL);
        assert_eq!((formed.batch.len(), formed.cancelled), (1, 3));
        assert_eq!(tenants_of(&formed), vec!["b"]);
        assert!(state.is_empty());
    }

    #[test]
    fn overload_is_refused_globally_and_per_tenant() {
        let now = Instant::now();
        let mut state = State::new(QueueConfig { capacity: 3, tenant_capacity: 2, ..config(4) });
        let _a = push_n(&mut state, "a", 2, now);
        let (extra, _rx) = call("a", 4, now);
        let refused = state.push(extra).unwrap_err();
        assert_eq!(refused.0, InferError::Overloaded);
        let _b = push_n(&mut state, "b", 1, now);
        let (extra, _rx) = call("c", 4, now);
        assert_eq!(state.push(extra).unwrap_err().0, InferError::Overloaded);
        assert_eq!(state.len(), 3);
    }

    #[test]
    fn cancelled_calls_free_their_space_for_new_ones() {
        let now = Instant::now();
        let mut state = State::new(QueueConfig { capacity: 2, tenant_capacity: 2, ..config(4) });
        drop(push_n(&mut state, "a", 2, now));
        let (entry, _rx) = call("a", 4, now);
        assert!(state.push(entry).is_ok(), "space of cancelled calls is reclaimed");
        assert_eq!(state.len(), 1);
    }

    #[test]
    fn drain_returns_everything() {
        let now = Instant::now();
        let mut state = State::new(config(4));
        let _a = push_n(&mut state, "a", 3, now);
        let _b = push_n(&mut state, "b", 2, now);
        assert_eq!(state.drain().len(), 5);
        assert!(state.is_empty());
        assert_eq!(state.readiness(now, FULL), Readiness::Empty);
    }
}
