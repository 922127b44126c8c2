//! The batching queue as pure state: no threads, no clocks of its own.
//!
//! Calls wait in per-tenant FIFO sub-queues. What is shared fairly between
//! busy tenants is device time, estimated from size: a call costs
//! [`sample_cost`] of its input shape, proportional to its pixels, where a
//! 640×640 image ([`REFERENCE_ELEMENTS`]) costs one [`QUANTUM`] and no call
//! costs less than [`MIN_SAMPLE_COST`].
//!
//! Batches are formed by virtual-time fair queueing (start-time fair
//! queueing, as in Linux's CFS): every tenant has a *service* count, the
//! cost of every call it has had run divided by its weight. The tenant
//! served least picks the next batch's shape (that of its oldest call), and
//! the batch is filled one call at a time, each time from the tenant served
//! least among those that may add a call of that shape, which is then
//! charged: the picking tenant any of its calls of that shape, the others
//! only the calls of that shape at the front of their queues. So tenants of
//! one shape interleave within a batch, and a tenant whose oldest call has
//! another shape is not charged meanwhile: it waits at most until the
//! others have caught up with it, then it is the least served and the next
//! batch is its shape. Ties go to the tenant that took a call least
//! recently, then to the one queued first.
//!
//! The charge is an estimate when the batch is formed; once the batch has
//! run, [`Ledger::correct_charge`] replaces it with the call's share of the
//! measured device time, so what busy tenants share is device time as
//! measured, not as estimated.
//!
//! Service is compared, not banked: a tenant that starts waiting is raised
//! to the least service of those already waiting (the clock), so idle time
//! earns no burst later, and it keeps what it had if that was more, so
//! draining its queue does not forgive what it was ahead. This holds
//! however the batch limit of each shape differs: a tenant whose device
//! takes one small sample per batch gets batch after batch until it has
//! caught up, not one batch per neighbour's full batch.
//!
//! Service, weights and the clock are kept in a [`Ledger`] apart from the
//! [`Queue`]s of calls: the models sharing a set of devices share one
//! ledger (see [`crate::arbiter`]), so a tenant's calls to every model
//! count towards one service, and the queue whose picking tenant is served
//! least ([`Queue::priority`]) has the device next.
//!
//! Expired and cancelled calls are dropped before they can reach a device.
//! Capacity is bounded globally and per tenant: a full queue refuses at once.
//! [`Queue::remove_tenant`] hands back a tenant's waiting calls and
//! [`Ledger::forget`] forgets its weight and service.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::error::InferError;
use crate::observe::CallTag;
use crate::tensor::Tensor;

/// Size of the reference sample, in input elements: a 640×640 RGB image
/// (`[640, 640, 3]` u8). A sample of this size costs one [`QUANTUM`].
pub const REFERENCE_ELEMENTS: u64 = 640 * 640 * 3;

/// The cost of a reference sample. The unit is fine (1/1024 of a reference
/// sample) so costs follow sizes closely.
pub const QUANTUM: u64 = 1024;

/// The least a sample costs: an eighth of a reference sample (the pixels of
/// a 226×226 image). Smaller samples are no cheaper in practice (copies,
/// pre- and post-processing and launches do not shrink with the pixels),
/// so a tenant of tiny samples gets at most eight calls to a neighbour's
/// one reference-sized call, not a thousand.
pub const MIN_SAMPLE_COST: u64 = QUANTUM / 8;

/// Costs are capped here (a sample of about 2^38 reference samples).
const MAX_SAMPLE_COST: u64 = 1 << 48;

/// Service is counted in cost units times this, divided by the weight:
/// exact for every weight up to 16 (720720 is their least common multiple).
const SERVICE_SCALE: u128 = 720_720;

/// What a sample of this shape costs, in units where a reference sample
/// ([`REFERENCE_ELEMENTS`]) costs [`QUANTUM`]: proportional to its element
/// count (for the `[H, W, 3]` images served, to its H×W pixels), rounded
/// up, and never below [`MIN_SAMPLE_COST`].
pub fn sample_cost(shape: &[usize]) -> u64 {
    let elements = shape.iter().fold(1u128, |n, &d| n.saturating_mul(d as u128));
    let cost = elements.saturating_mul(u128::from(QUANTUM)).div_ceil(u128::from(REFERENCE_ELEMENTS));
    u64::try_from(cost).unwrap_or(u64::MAX).clamp(MIN_SAMPLE_COST, MAX_SAMPLE_COST)
}

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
    /// Where the call's share of its batch's device time goes, µs (the
    /// share `/metrics` charges its tenant), if the caller meters it.
    pub device_us: Option<Arc<AtomicU64>>,
    /// The caller's tag, handed to the batcher's observer with the batch
    /// the call runs in (see [`crate::observe`]).
    pub tag: Option<CallTag>,
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

/// The outcome of [`Queue::next_batch`].
#[derive(Debug, Default)]
pub struct Formed {
    /// Calls to run together, all of one input shape.
    pub batch: Vec<Entry>,
    /// Calls whose deadline passed; answer them `DeadlineExceeded`.
    pub expired: Vec<Entry>,
    /// Calls dropped because their caller went away.
    pub cancelled: usize,
}

/// What the ledger remembers of a tenant between its calls.
#[derive(Debug, Clone, Copy, Default)]
struct Account {
    /// Cost of the calls it has had run, over its weight (× [`SERVICE_SCALE`]).
    service: u128,
    /// When it last took a call ([`Ledger::turns`]): breaks ties in service.
    last_turn: u64,
}

/// Where a tenant stands against the others: its service, then when it
/// last took a call. The least is served first.
pub type Standing = (u128, u64);

/// The tenants' accounts, shared by the queues of every model on a set of
/// devices (see [`crate::arbiter`]): one virtual clock, so a tenant busy on
/// two models is as served as one busy on one, not twice.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Service of every tenant seen (until it is removed).
    accounts: HashMap<Arc<str>, Account>,
    weights: HashMap<Arc<str>, u32>,
    /// For each tenant with calls waiting, in how many queues.
    waiting: HashMap<Arc<str>, usize>,
    /// The least service of the waiting tenants, as last seen: never goes back.
    clock: u128,
    /// Calls taken so far, all queues together (orders [`Account::last_turn`]).
    turns: u64,
}

impl Ledger {
    /// Sets a tenant's share: with weights 3 and 1, two busy tenants get
    /// three times the device time (by [`sample_cost`]) to one. Zero is
    /// treated as 1.
    pub fn set_weight(&mut self, tenant: Arc<str>, weight: u32) {
        self.weights.insert(tenant, weight.max(1));
    }

    /// A tenant's weight: what [`Ledger::set_weight`] set, else 1.
    pub fn weight(&self, tenant: &str) -> u32 {
        self.weights.get(tenant).copied().unwrap_or(1)
    }

    /// Where `tenant` stands (see [`Standing`]).
    pub fn standing(&self, tenant: &str) -> Standing {
        self.accounts.get(tenant).map(|a| (a.service, a.last_turn)).unwrap_or_default()
    }

    /// What a call of `cost` adds to the service of a tenant of `weight`
    /// (rounded up, so no call is free).
    fn charge(cost: u64, weight: u32) -> u128 {
        (u128::from(cost) * SERVICE_SCALE).div_ceil(u128::from(weight.max(1)))
    }

    /// A queue now holds calls of `tenant`. If no other queue did, the
    /// tenant starts waiting: no less served than those already waiting.
    fn start_waiting(&mut self, tenant: &Arc<str>) {
        let queues = self.waiting.entry(Arc::clone(tenant)).or_default();
        *queues += 1;
        if *queues == 1 {
            let account = self.accounts.entry(Arc::clone(tenant)).or_default();
            account.service = account.service.max(self.clock);
        }
    }

    /// A queue no longer holds calls of `tenant`.
    fn stop_waiting(&mut self, tenant: &str) {
        if let Some(queues) = self.waiting.get_mut(tenant) {
            *queues -= 1;
            if *queues == 0 {
                self.waiting.remove(tenant);
            }
        }
    }

    /// Moves the clock up to the least service of the waiting tenants.
    fn advance_clock(&mut self) {
        let least = self.waiting.keys().filter_map(|t| self.accounts.get(t)).map(|a| a.service).min();
        if let Some(least) = least {
            self.clock = self.clock.max(least);
        }
    }

    /// Charges `tenant` a call of `cost` taken now.
    pub(crate) fn take_turn(&mut self, tenant: &Arc<str>, cost: u64) {
        self.turns += 1;
        let charge = Self::charge(cost, self.weight(tenant));
        let account = self.accounts.entry(Arc::clone(tenant)).or_default();
        account.service = account.service.saturating_add(charge);
        account.last_turn = self.turns;
    }

    /// Corrects the charge of a call that has run: its tenant was charged
    /// `estimated` cost units when the batch was formed, and the device's
    /// measurement of the batch says the call took `measured`. So busy
    /// tenants share measured device time, wherever the pixel estimate is
    /// off (a shape the device runs slowly, batches it runs small, a model
    /// faster than another). A tenant removed meanwhile is skipped.
    pub fn correct_charge(&mut self, tenant: &str, estimated: u64, measured: u64) {
        let weight = self.weight(tenant);
        let Some(account) = self.accounts.get_mut(tenant) else { return };
        let (estimated, measured) = (Self::charge(estimated, weight), Self::charge(measured, weight));
        account.service = if measured >= estimated {
            account.service.saturating_add(measured - estimated)
        } else {
            account.service.saturating_sub(estimated - measured)
        };
        self.advance_clock();
    }

    /// Forgets a tenant's weight and service (a tenant of the same name
    /// added later starts at weight 1, level with those waiting), once no
    /// queue holds calls of it: while one still does (a tenant removed
    /// from one model's queue after another), it keeps its standing there,
    /// and the last queue to remove it forgets it.
    pub fn forget(&mut self, tenant: &str) {
        if self.waiting.contains_key(tenant) {
            return;
        }
        self.weights.remove(tenant);
        self.accounts.remove(tenant);
        self.advance_clock();
    }
}

/// The queue of one model: its tenants' waiting calls. Where each tenant
/// stands is the [`Ledger`]'s, passed to each method that needs it.
#[derive(Debug)]
pub struct Queue {
    config: QueueConfig,
    /// Waiting calls of each tenant that has some.
    tenants: HashMap<Arc<str>, VecDeque<Entry>>,
    /// Tenants with waiting calls, in the order they started waiting.
    order: VecDeque<Arc<str>>,
    len: usize,
}

impl Queue {
    /// An empty queue.
    pub fn new(config: QueueConfig) -> Self {
        Self { config, tenants: HashMap::new(), order: VecDeque::new(), len: 0 }
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
        self.tenants.get(tenant).map_or(0, VecDeque::len)
    }

    /// The cost units waiting for each tenant that has calls waiting, with
    /// its weight: what [`crate::backlog`] estimates a new call's wait from.
    pub fn waiting(&self, ledger: &Ledger) -> Vec<(Arc<str>, crate::backlog::Pending)> {
        let cost = |queue: &VecDeque<Entry>| queue.iter().map(|e| sample_cost(e.input.shape())).fold(0u64, u64::saturating_add);
        self.tenants
            .iter()
            .map(|(tenant, queue)| (Arc::clone(tenant), crate::backlog::Pending { queued: cost(queue), weight: ledger.weight(tenant) }))
            .collect()
    }

    /// Hands back a tenant's waiting calls, unanswered, for the caller to
    /// answer (forgetting its account is [`Ledger::forget`]).
    pub fn remove_tenant(&mut self, ledger: &mut Ledger, tenant: &str) -> Vec<Entry> {
        let removed: Vec<Entry> = self.tenants.remove(tenant).map(Vec::from).unwrap_or_default();
        if self.order.iter().any(|t| &**t == tenant) {
            ledger.stop_waiting(tenant);
        }
        self.len -= removed.len();
        self.order.retain(|t| &**t != tenant);
        ledger.advance_clock();
        removed
    }

    /// Queues a call, or hands it back with `Overloaded` when the queue or
    /// the tenant's share of it is full.
    pub fn push(&mut self, ledger: &mut Ledger, entry: Entry) -> Result<(), Box<(InferError, Entry)>> {
        if self.is_full_for(&entry.tenant) {
            // Calls whose callers went away still hold space: reclaim it first.
            self.purge_cancelled(ledger);
            if self.is_full_for(&entry.tenant) {
                return Err(Box::new((InferError::Overloaded, entry)));
            }
        }
        let tenant = Arc::clone(&entry.tenant);
        let queue = self.tenants.entry(Arc::clone(&tenant)).or_default();
        if queue.is_empty() {
            ledger.start_waiting(&tenant);
            self.order.push_back(tenant);
        }
        queue.push_back(entry);
        self.len += 1;
        Ok(())
    }

    fn is_full_for(&self, tenant: &str) -> bool {
        self.len >= self.config.capacity || self.tenant_len(tenant) >= self.config.tenant_capacity
    }

    /// Drops calls whose callers went away; returns how many.
    fn purge_cancelled(&mut self, ledger: &mut Ledger) -> usize {
        let before = self.len;
        for queue in self.tenants.values_mut() {
            queue.retain(|e| !e.is_cancelled());
        }
        self.len = self.tenants.values().map(VecDeque::len).sum();
        self.forget_empty_tenants(ledger);
        before - self.len
    }

    /// Removes tenants left without calls from the waiting set (their
    /// service is kept), and moves the clock on.
    fn forget_empty_tenants(&mut self, ledger: &mut Ledger) {
        self.tenants.retain(|tenant, queue| {
            if queue.is_empty() {
                ledger.stop_waiting(tenant);
            }
            !queue.is_empty()
        });
        let tenants = &self.tenants;
        self.order.retain(|t| tenants.contains_key(t));
        ledger.advance_clock();
    }

    /// Whether a batch should be taken now (see [`QueueConfig::max_delay`]);
    /// `limit` gives the largest batch wanted for an input shape (it is
    /// capped at `max_batch`), so a held batch goes as soon as it is that full.
    pub fn readiness(&self, ledger: &Ledger, now: Instant, limit: impl Fn(&[usize]) -> usize) -> Readiness {
        let Some(oldest) = self.tenants.values().filter_map(|q| q.front()).map(|e| e.enqueued).min() else {
            return Readiness::Empty;
        };
        if self.config.max_delay.is_zero() || self.front_shape_count(ledger) >= self.cap(ledger, limit) {
            return Readiness::Ready;
        }
        // A delay past what the clock can represent holds nothing.
        match oldest.checked_add(self.config.max_delay) {
            Some(due) if due > now => Readiness::WaitUntil(due),
            _ => Readiness::Ready,
        }
    }

    /// The batch size to fill for the next batch's shape: `limit`'s, within 1..=max_batch.
    fn cap(&self, ledger: &Ledger, limit: impl Fn(&[usize]) -> usize) -> usize {
        let wanted = self.picker(ledger).map_or(self.config.max_batch, |(_, shape)| limit(&shape));
        wanted.clamp(1, self.config.max_batch.max(1))
    }

    /// The waiting tenant served least whose queue `fits` accepts: least
    /// service, then least recent turn, then first to start waiting.
    fn least_served(&self, ledger: &Ledger, fits: impl Fn(&Arc<str>, &VecDeque<Entry>) -> bool) -> Option<Arc<str>> {
        self.order.iter().filter(|t| self.tenants.get(*t).is_some_and(|q| fits(t, q))).min_by_key(|t| ledger.standing(t)).cloned()
    }

    /// The tenant whose oldest call picks the next batch's shape (the one
    /// served least), and that shape.
    fn picker(&self, ledger: &Ledger) -> Option<(Arc<str>, Vec<usize>)> {
        let tenant = self.least_served(ledger, |_, _| true)?;
        let shape = self.tenants.get(&tenant)?.front()?.input.shape().to_vec();
        Some((tenant, shape))
    }

    /// Where this queue's next batch stands against other queues' on a
    /// shared device: its picking tenant's [`Standing`], then when that
    /// tenant's oldest call here was queued (a tenant waiting on two
    /// models has its older call run first). `None` when nothing waits.
    pub fn priority(&self, ledger: &Ledger) -> Option<(Standing, Instant)> {
        let tenant = self.least_served(ledger, |_, _| true)?;
        let oldest = self.tenants.get(&tenant)?.front()?.enqueued;
        Some((ledger.standing(&tenant), oldest))
    }

    /// How many of a tenant's calls a batch of `shape` may take: for the
    /// tenant that picked the shape, all of that shape; for the others, the
    /// run of that shape at the front of their queues, so that a tenant
    /// whose oldest call has another shape is not charged in this batch,
    /// falls behind, and picks a batch of its own shape soon.
    fn takeable(queue: &VecDeque<Entry>, picked: bool, shape: &[usize]) -> usize {
        if picked {
            queue.iter().filter(|e| e.input.shape() == shape).count()
        } else {
            queue.iter().take_while(|e| e.input.shape() == shape).count()
        }
    }

    /// Calls waiting that the next batch could take.
    pub fn front_shape_count(&self, ledger: &Ledger) -> usize {
        let Some((picker, shape)) = self.picker(ledger) else { return 0 };
        self.tenants.iter().map(|(tenant, queue)| Self::takeable(queue, *tenant == picker, &shape)).sum()
    }

    /// Takes the next batch: drops expired and cancelled calls, then fills
    /// up to `limit(shape)` (at most `max_batch`) calls of one shape, each
    /// from the tenant served least that has one it may take (see
    /// `Queue::takeable`).
    pub fn next_batch(&mut self, ledger: &mut Ledger, now: Instant, limit: impl Fn(&[usize]) -> usize) -> Formed {
        let mut formed = Formed::default();
        self.drop_dead(ledger, now, &mut formed);
        let Some((picker, shape)) = self.picker(ledger) else { return formed };
        let cap = self.cap(ledger, limit);
        let cost = sample_cost(&shape);
        while formed.batch.len() < cap {
            let next = self.least_served(ledger, |tenant, queue| Self::takeable(queue, *tenant == picker, &shape) > 0);
            let Some(entry) = next.and_then(|t| self.take(ledger, &t, &shape, cost)) else { break };
            formed.batch.push(entry);
        }
        self.forget_empty_tenants(ledger);
        formed
    }

    /// Takes `tenant`'s oldest call of `shape` and charges it `cost`.
    fn take(&mut self, ledger: &mut Ledger, tenant: &Arc<str>, shape: &[usize], cost: u64) -> Option<Entry> {
        let queue = self.tenants.get_mut(tenant)?;
        let entry = queue.remove(queue.iter().position(|e| e.input.shape() == shape)?)?;
        self.len -= 1;
        ledger.take_turn(tenant, cost);
        Some(entry)
    }

    fn drop_dead(&mut self, ledger: &mut Ledger, now: Instant, formed: &mut Formed) {
        for queue in self.tenants.values_mut() {
            let before = queue.len();
            let items = std::mem::take(queue);
            for entry in items {
                if entry.is_cancelled() {
                    formed.cancelled += 1;
                } else if entry.deadline <= now {
                    formed.expired.push(entry);
                } else {
                    queue.push_back(entry);
                }
            }
            self.len -= before - queue.len();
        }
        self.forget_empty_tenants(ledger);
    }

    /// Empties the queue (at shutdown), handing back every waiting call.
    pub fn drain(&mut self, ledger: &mut Ledger) -> Vec<Entry> {
        for tenant in self.order.drain(..) {
            ledger.stop_waiting(&tenant);
        }
        ledger.advance_clock();
        self.len = 0;
        self.tenants.drain().flat_map(|(_, q)| q).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::ElementType;

    /// One model's queue with a ledger of its own: a batcher alone on its devices.
    struct State {
        ledger: Ledger,
        queue: Queue,
    }

    impl State {
        fn new(config: QueueConfig) -> Self {
            Self { ledger: Ledger::default(), queue: Queue::new(config) }
        }
        fn push(&mut self, entry: Entry) -> Result<(), Box<(InferError, Entry)>> {
            self.queue.push(&mut self.ledger, entry)
        }
        fn next_batch(&mut self, now: Instant, limit: impl Fn(&[usize]) -> usize) -> Formed {
            self.queue.next_batch(&mut self.ledger, now, limit)
        }
        fn readiness(&self, now: Instant, limit: impl Fn(&[usize]) -> usize) -> Readiness {
            self.queue.readiness(&self.ledger, now, limit)
        }
        fn len(&self) -> usize {
            self.queue.len()
        }
        fn is_empty(&self) -> bool {
            self.queue.is_empty()
        }
        fn tenant_len(&self, tenant: &str) -> usize {
            self.queue.tenant_len(tenant)
        }
        fn drain(&mut self) -> Vec<Entry> {
            self.queue.drain(&mut self.ledger)
        }
        fn remove_tenant(&mut self, tenant: &str) -> Vec<Entry> {
            let removed = self.queue.remove_tenant(&mut self.ledger, tenant);
            self.ledger.forget(tenant);
            removed
        }
        fn correct_charge(&mut self, tenant: &str, estimated: u64, measured: u64) {
            self.ledger.correct_charge(tenant, estimated, measured);
        }
        fn set_weight(&mut self, tenant: Arc<str>, weight: u32) {
            self.ledger.set_weight(tenant, weight);
        }
        fn weight(&self, tenant: &str) -> u32 {
            self.ledger.weight(tenant)
        }
    }

    const SECOND: Duration = Duration::from_secs(1);
    /// No limit below `max_batch`.
    const FULL: fn(&[usize]) -> usize = |_| usize::MAX;

    fn config(max_batch: usize) -> QueueConfig {
        QueueConfig { max_batch, capacity: 100, tenant_capacity: 100, max_delay: Duration::ZERO }
    }

    /// A reference-sized image: one quantum.
    const REF: [usize; 3] = [640, 640, 3];
    /// A 2048×2048 image: 10.24 quanta.
    const BIG: [usize; 3] = [2048, 2048, 3];

    /// A queued call of `tenant` with an input of `shape`; the receiver is
    /// returned so the call stays alive (dropping it cancels the call). The
    /// zeroed buffer is never written, so large images cost little memory.
    fn call(tenant: &str, shape: &[usize], now: Instant) -> (Entry, oneshot::Receiver<Reply>) {
        let (tx, rx) = oneshot::channel();
        let len = shape.iter().product();
        let input = Tensor::new(shape.to_vec(), ElementType::U8, vec![0; len]).unwrap();
        let entry = Entry { tenant: tenant.into(), input, deadline: now + SECOND, enqueued: now, reply: tx, device_us: None, tag: None };
        (entry, rx)
    }

    /// Queues `n` reference-sized calls of `tenant`.
    fn push_n(state: &mut State, tenant: &str, n: usize, now: Instant) -> Vec<oneshot::Receiver<Reply>> {
        push_shaped(state, tenant, &REF, n, now)
    }

    fn push_shaped(state: &mut State, tenant: &str, shape: &[usize], n: usize, now: Instant) -> Vec<oneshot::Receiver<Reply>> {
        (0..n)
            .map(|_| {
                let (entry, rx) = call(tenant, shape, now);
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
            let (entry, rx) = call("a", &[len], now);
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
        let limit = |shape: &[usize]| if shape == REF { 2 } else { 8 };
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
        let (mut old, _rx1) = call("a", &[4], now);
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
        let (extra, _rx) = call("a", &[4], now);
        let refused = state.push(extra).unwrap_err();
        assert_eq!(refused.0, InferError::Overloaded);
        let _b = push_n(&mut state, "b", 1, now);
        let (extra, _rx) = call("c", &[4], now);
        assert_eq!(state.push(extra).unwrap_err().0, InferError::Overloaded);
        assert_eq!(state.len(), 3);
    }

    #[test]
    fn cancelled_calls_free_their_space_for_new_ones() {
        let now = Instant::now();
        let mut state = State::new(QueueConfig { capacity: 2, tenant_capacity: 2, ..config(4) });
        drop(push_n(&mut state, "a", 2, now));
        let (entry, _rx) = call("a", &[4], now);
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

    #[test]
    fn cost_follows_pixels_with_a_floor() {
        assert_eq!(sample_cost(&REF), QUANTUM);
        assert_eq!(sample_cost(&[320, 320, 3]), QUANTUM / 4);
        // 2048² / 640² = 10.24 quanta, rounded up to the unit.
        assert_eq!(sample_cost(&BIG), 10_486);
        assert_eq!(sample_cost(&[1]), MIN_SAMPLE_COST, "tiny samples ride at the floor, not free");
        assert_eq!(sample_cost(&[]), MIN_SAMPLE_COST);
        assert_eq!(sample_cost(&[usize::MAX, usize::MAX]), MAX_SAMPLE_COST);
    }

    /// Two busy tenants of equal weight, one sending 2048×2048 images and one
    /// 640×640: each gets the same pixels (device time), so the small one
    /// runs about ten times the samples.
    #[test]
    fn device_time_is_shared_not_sample_counts() {
        let now = Instant::now();
        let mut state = State::new(QueueConfig { capacity: 1000, tenant_capacity: 1000, ..config(8) });
        let mut keep = Vec::new();
        let (mut samples, mut pixels) = (HashMap::new(), HashMap::new());
        for _ in 0..300 {
            // Both always backlogged: top up before each batch.
            let big = 4 - state.tenant_len("big");
            keep.extend(push_shaped(&mut state, "big", &BIG, big, now));
            let small = 24 - state.tenant_len("small");
            keep.extend(push_shaped(&mut state, "small", &REF, small, now));
            let formed = state.next_batch(now, FULL);
            assert!(!formed.batch.is_empty());
            for e in formed.batch {
                *samples.entry(e.tenant.to_string()).or_insert(0u64) += 1;
                *pixels.entry(e.tenant.to_string()).or_insert(0u64) += (e.input.shape()[0] * e.input.shape()[1]) as u64;
            }
        }
        let pixel_ratio = pixels["big"] as f64 / pixels["small"] as f64;
        let sample_ratio = samples["small"] as f64 / samples["big"] as f64;
        assert!((0.9..1.1).contains(&pixel_ratio), "pixels big/small {pixel_ratio:.3} ({pixels:?})");
        assert!((9.0..11.5).contains(&sample_ratio), "samples small/big {sample_ratio:.2} ({samples:?})");
    }

    /// Device time stays shared when the device takes fewer small samples
    /// per batch than one round's credit would buy (the batch sizer's limit
    /// depends on the shape): the small tenant gets further batches, it is
    /// not made to wait its turn behind every large batch.
    #[test]
    fn device_time_is_shared_whatever_the_batch_limit_of_each_shape() {
        const SMALL: [usize; 3] = [320, 320, 3];
        for (large_limit, small_limit) in [(4, 2), (1, 4), (4, 1), (2, 8)] {
            let now = Instant::now();
            let mut state = State::new(QueueConfig { capacity: 1000, tenant_capacity: 1000, ..config(8) });
            let limit = |shape: &[usize]| if shape == REF { large_limit } else { small_limit };
            let mut keep = Vec::new();
            let mut cost = HashMap::new();
            for _ in 0..400 {
                let n = 16 - state.tenant_len("large");
                keep.extend(push_shaped(&mut state, "large", &REF, n, now));
                let n = 16 - state.tenant_len("small");
                keep.extend(push_shaped(&mut state, "small", &SMALL, n, now));
                for e in state.next_batch(now, limit).batch {
                    *cost.entry(e.tenant.to_string()).or_insert(0u64) += sample_cost(e.input.shape());
                }
            }
            let ratio = cost["large"] as f64 / cost["small"] as f64;
            assert!((0.9..1.1).contains(&ratio), "limits {large_limit}/{small_limit}: cost large/small {ratio:.2} ({cost:?})");
        }
    }

    /// A sample dearer than two rounds' credit is saved up for, not starved,
    /// whether its tenant is alone or next to a busy neighbour.
    #[test]
    fn a_sample_dearer_than_two_rounds_is_not_starved() {
        let now = Instant::now();
        let mut state = State::new(config(8));
        let _alone = push_shaped(&mut state, "big", &BIG, 1, now);
        assert_eq!(state.next_batch(now, FULL).batch.len(), 1, "alone, it runs at once");

        let mut keep = push_shaped(&mut state, "big", &BIG, 1, now);
        let mut batches = 0;
        loop {
            let small = 16 - state.tenant_len("small");
            keep.extend(push_shaped(&mut state, "small", &REF, small, now));
            batches += 1;
            let formed = state.next_batch(now, FULL);
            if formed.batch.iter().any(|e| &*e.tenant == "big") {
                break;
            }
            // 10.24 quanta need 11 rounds; a batch of 8 small calls spans 8.
            assert!(batches < 4, "the big call was starved for {batches} batches");
        }
        assert_eq!(state.tenant_len("big"), 0);
    }

    /// With equal weights, a tenant of tiny samples gets eight samples to a
    /// reference sample ([`MIN_SAMPLE_COST`]), not a thousand.
    #[test]
    fn tiny_samples_do_not_ride_free() {
        let now = Instant::now();
        let mut state = State::new(QueueConfig { capacity: 1000, tenant_capacity: 1000, ..config(8) });
        let mut keep = Vec::new();
        let mut counts = HashMap::new();
        for _ in 0..90 {
            let n = 40 - state.tenant_len("tiny");
            keep.extend(push_shaped(&mut state, "tiny", &[4], n, now));
            let n = 40 - state.tenant_len("ref");
            keep.extend(push_n(&mut state, "ref", n, now));
            for e in state.next_batch(now, FULL).batch {
                *counts.entry(e.tenant.to_string()).or_insert(0u32) += 1;
            }
        }
        let ratio = f64::from(counts["tiny"]) / f64::from(counts["ref"]);
        assert!((7.0..9.0).contains(&ratio), "tiny/ref samples {ratio:.2} ({counts:?})");
    }

    #[test]
    fn removing_a_tenant_forgets_weight_service_and_calls() {
        let now = Instant::now();
        let mut state = State::new(config(4));
        state.set_weight("a".into(), 5);
        let _a = push_n(&mut state, "a", 6, now);
        let _b = push_n(&mut state, "b", 6, now);
        let formed = state.next_batch(now, FULL);
        assert_eq!(tenants_of(&formed), vec!["a", "b", "a", "a"], "weight 5 to 1");

        let removed = state.remove_tenant("a");
        assert_eq!(removed.len(), 3);
        assert!(removed.iter().all(|e| &*e.tenant == "a"));
        assert_eq!((state.len(), state.tenant_len("a"), state.weight("a")), (5, 0, 1));
        assert!(!state.queue.tenants.contains_key("a") && !state.ledger.accounts.contains_key("a"));
        assert!(!state.queue.order.iter().any(|t| &**t == "a"));
        assert_eq!(state.remove_tenant("nobody").len(), 0);

        // A new tenant of the same name starts afresh, at weight 1 and level
        // with the waiting tenant: no service owed, none held against it.
        let _a2 = push_n(&mut state, "a", 6, now);
        assert_eq!(state.ledger.accounts["a"].service, state.ledger.accounts["b"].service);
        let mut counts = HashMap::new();
        for _ in 0..2 {
            for e in state.next_batch(now, FULL).batch {
                *counts.entry(e.tenant.to_string()).or_insert(0) += 1;
            }
        }
        assert_eq!((counts["a"], counts["b"]), (4, 4), "weight 1 each");
        assert_eq!(state.tenant_len("b"), 1);
    }

    /// Measured charges replace estimated ones: a tenant whose calls the
    /// device measures at three times their estimate gets a third of its
    /// neighbour's calls of a shape both send, and a removed tenant's
    /// correction is ignored.
    #[test]
    fn measured_charges_replace_the_estimate() {
        let now = Instant::now();
        let mut state = State::new(QueueConfig { capacity: 1000, tenant_capacity: 1000, ..config(4) });
        let mut keep = Vec::new();
        let mut counts = HashMap::new();
        for _ in 0..200 {
            for name in ["slow", "fast"] {
                let n = 8 - state.tenant_len(name);
                keep.extend(push_n(&mut state, name, n, now));
            }
            for e in state.next_batch(now, FULL).batch {
                if &*e.tenant == "slow" {
                    state.correct_charge("slow", QUANTUM, 3 * QUANTUM);
                }
                *counts.entry(e.tenant.to_string()).or_insert(0u32) += 1;
            }
        }
        let ratio = f64::from(counts["fast"]) / f64::from(counts["slow"]);
        assert!((2.8..3.2).contains(&ratio), "fast/slow calls {ratio:.2} ({counts:?})");
        state.remove_tenant("slow");
        state.correct_charge("slow", QUANTUM, 3 * QUANTUM);
        assert!(!state.ledger.accounts.contains_key("slow"), "no account comes back for a removed tenant");
    }

    /// A tenant whose oldest call has a shape nobody else sends, and whose
    /// later calls share a busy neighbour's shape, gets its odd call run
    /// within two batches, whatever the batch size (were it charged for its
    /// later calls in the neighbour's batches, it would stay level with the
    /// neighbour and lose every tie).
    #[test]
    fn an_odd_oldest_call_is_not_starved_by_later_calls_of_a_common_shape() {
        const ODD: [usize; 3] = [480, 640, 3];
        for max_batch in [4, 6, 7, 8] {
            let now = Instant::now();
            let mut state = State::new(QueueConfig { capacity: 1000, tenant_capacity: 1000, ..config(max_batch) });
            let mut keep = Vec::new();
            keep.extend(push_n(&mut state, "busy", 40, now));
            keep.extend(push_shaped(&mut state, "mixed", &ODD, 1, now));
            keep.extend(push_n(&mut state, "mixed", 40, now));
            let ran_within = (1..=2).find(|_| state.next_batch(now, FULL).batch.iter().any(|e| e.input.shape() == ODD));
            assert!(ran_within.is_some(), "batch size {max_batch}: the odd call waited over two batches");
        }
    }

    /// A tenant busy alone banks nothing for a neighbour to make up: one
    /// that starts waiting after a hundred batches gets one batch, then
    /// shares the next ones.
    #[test]
    fn time_alone_earns_no_burst() {
        let now = Instant::now();
        let mut state = State::new(QueueConfig { capacity: 1000, tenant_capacity: 1000, ..config(4) });
        let mut keep = Vec::new();
        for _ in 0..100 {
            keep.extend(push_n(&mut state, "early", 4, now));
            assert_eq!(state.next_batch(now, FULL).batch.len(), 4);
        }
        keep.extend(push_n(&mut state, "early", 40, now));
        keep.extend(push_n(&mut state, "late", 40, now));
        // The early tenant is one batch ahead (its last batch ran while the
        // queue's clock stood at its start): the late one catches up on that.
        assert_eq!(tenants_of(&state.next_batch(now, FULL)), vec!["late"; 4]);
        for _ in 0..5 {
            let formed = state.next_batch(now, FULL);
            assert_eq!(tenants_of(&formed).iter().filter(|t| **t == "late").count(), 2, "{:?}", tenants_of(&formed));
        }
    }

    /// The device-time share holds when one tenant's calls come in bursts
    /// (its few clients wait for their answers, so its queue drains after
    /// each of its batches) and the device takes more of its samples per
    /// batch than of its neighbour's smaller ones: draining its queue does
    /// not forgive it the batch it was ahead.
    #[test]
    fn a_tenant_that_drains_its_queue_is_not_forgiven_its_lead() {
        const SMALL: [usize; 3] = [320, 320, 3];
        let now = Instant::now();
        let mut state = State::new(QueueConfig { capacity: 1000, tenant_capacity: 1000, ..config(4) });
        let limit = |shape: &[usize]| if shape == REF { 4 } else { 1 };
        let mut keep = Vec::new();
        let mut cost = HashMap::new();
        // Batches since the large tenant's last batch: its clients answer
        // and come back two batches later.
        let mut since_large = 2;
        for _ in 0..2000 {
            if state.tenant_len("large") == 0 && since_large >= 2 {
                keep.extend(push_shaped(&mut state, "large", &REF, 4, now));
            }
            let n = 16 - state.tenant_len("small");
            keep.extend(push_shaped(&mut state, "small", &SMALL, n, now));
            let formed = state.next_batch(now, limit);
            since_large = if formed.batch.iter().any(|e| &*e.tenant == "large") { 0 } else { since_large + 1 };
            for e in formed.batch {
                *cost.entry(e.tenant.to_string()).or_insert(0u64) += sample_cost(e.input.shape());
            }
        }
        let ratio = cost["large"] as f64 / cost["small"] as f64;
        assert!((0.85..1.05).contains(&ratio), "cost large/small {ratio:.2} ({cost:?})");
    }

    /// Two busy tenants of one shape cannot starve a third of another shape
    /// (before, batches of 8 always ended just before the third one's turn,
    /// and it was never served).
    #[test]
    fn a_shape_in_the_minority_is_not_starved() {
        let now = Instant::now();
        let mut state = State::new(QueueConfig { capacity: 1000, tenant_capacity: 1000, ..config(8) });
        let mut keep = Vec::new();
        let mut counts = HashMap::new();
        let shape = |name: &str| if name == "b" { [640, 480, 3] } else { [480, 640, 3] };
        for _ in 0..60 {
            for name in ["s1", "b", "s2"] {
                let n = 20 - state.tenant_len(name);
                keep.extend(push_shaped(&mut state, name, &shape(name), n, now));
            }
            for e in state.next_batch(now, FULL).batch {
                *counts.entry(e.tenant.to_string()).or_insert(0) += 1;
            }
        }
        for name in ["s1", "b", "s2"] {
            assert!((150..=170).contains(&counts[name]), "{counts:?}: a third each");
        }
    }

    /// Two models' queues sharing one ledger, served in turn by the queue
    /// whose picking tenant is least served (as [`crate::arbiter`] does
    /// for a device): a tenant busy on both models gets as much as a
    /// tenant busy on one, not a share of each.
    #[test]
    fn a_tenant_on_two_models_is_served_as_one() {
        let now = Instant::now();
        let big = QueueConfig { capacity: 1000, tenant_capacity: 1000, ..config(4) };
        let mut ledger = Ledger::default();
        let mut queues = [Queue::new(big.clone()), Queue::new(big)];
        let mut keep = Vec::new();
        let mut cost = HashMap::new();
        for _ in 0..400 {
            for (queue, tenants) in queues.iter_mut().zip([&["both", "one"][..], &["both"][..]]) {
                for tenant in tenants {
                    for _ in queue.tenant_len(tenant)..8 {
                        let (entry, rx) = call(tenant, &REF, now);
                        queue.push(&mut ledger, entry).unwrap();
                        keep.push(rx);
                    }
                }
            }
            let turn = (0..2).filter_map(|i| Some((queues[i].priority(&ledger)?, i))).min().unwrap().1;
            for e in queues[turn].next_batch(&mut ledger, now, FULL).batch {
                *cost.entry(e.tenant.to_string()).or_insert(0u64) += sample_cost(e.input.shape());
            }
        }
        let ratio = cost["both"] as f64 / cost["one"] as f64;
        assert!((0.9..1.1).contains(&ratio), "cost both/one {ratio:.2} ({cost:?})");
    }
}
