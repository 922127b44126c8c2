//! A tenant's admission gate on this node: its token bucket (rate and
//! burst) and its concurrency slots, each this node's share of the
//! tenant's cluster-wide limits, resized in place when limits or the live
//! nodes change.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::limits::TenantLimits;

/// A tenant's admission state: limits, rate bucket, concurrency slots.
/// Kept across snapshots while the limits do not change.
pub struct TenantGate {
    /// Effective limits, the whole cluster's.
    pub limits: TenantLimits,
    /// Requests-per-second bucket: this node's share of the tenant's rate.
    pub rate: Arc<TokenBucket>,
    /// Concurrent-request slots: this node's share of the tenant's concurrency.
    pub concurrency: Arc<ConcurrencyGate>,
    /// Tenant-API calls on this node (not a share: every node a log read
    /// asks counts it).
    pub api: Arc<TokenBucket>,
}

/// This node's share of a tenant's rate limit, burst and concurrency when
/// `nodes` live nodes serve it (a load balancer spreads a tenant's requests
/// over them): each a `1/nodes` part, rounded up, at least 1; a rate of 0
/// (unlimited) stays unlimited.
pub fn node_share(limits: &TenantLimits, nodes: usize) -> (f64, u32, u32) {
    let nodes = nodes.max(1);
    let part = |n: u32| n.div_ceil(u32::try_from(nodes).unwrap_or(u32::MAX)).max(1);
    (limits.rps / nodes as f64, part(limits.burst), part(limits.max_concurrency))
}

impl TenantGate {
    /// Applies this node's share among `nodes` live nodes, in place (tokens
    /// saved up and slots in use are kept).
    pub(crate) fn share_among(&self, nodes: usize) {
        let (rps, burst, concurrency) = node_share(&self.limits, nodes);
        self.rate.reconfigure(rps, burst);
        self.concurrency.resize(concurrency);
        self.api.reconfigure(self.limits.api_rps, self.limits.api_burst());
    }
}

/// A gate for `limits`, this node's share among `nodes` live nodes. An
/// existing tenant keeps its bucket and slots, resized in place: a limit
/// change neither refills the bucket nor lets the tenant run its old and
/// new concurrency at once.
pub(crate) fn new_gate(limits: TenantLimits, old: Option<&TenantGate>, nodes: usize) -> TenantGate {
    let gate = match old {
        Some(old) => {
            TenantGate { rate: Arc::clone(&old.rate), concurrency: Arc::clone(&old.concurrency), api: Arc::clone(&old.api), limits }
        }
        None => {
            let (rps, burst, concurrency) = node_share(&limits, nodes);
            TenantGate {
                rate: Arc::new(TokenBucket::new(rps, burst)),
                concurrency: Arc::new(ConcurrencyGate::new(concurrency)),
                api: Arc::new(TokenBucket::new(limits.api_rps, limits.api_burst())),
                limits,
            }
        }
    };
    gate.share_among(nodes);
    gate
}

/// A tenant's requests in flight: at most `limit`, resized in place when the
/// limit changes (requests in flight keep their slots; a lower limit only
/// refuses new ones until enough have finished).
#[derive(Debug)]
pub struct ConcurrencyGate {
    limit: AtomicU32,
    in_use: AtomicU32,
}

/// One slot of a [`ConcurrencyGate`], given back when dropped.
#[derive(Debug)]
pub struct ConcurrencySlot(Arc<ConcurrencyGate>);

impl Drop for ConcurrencySlot {
    fn drop(&mut self) {
        self.0.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ConcurrencyGate {
    /// A gate of `limit` slots.
    pub fn new(limit: u32) -> Self {
        Self { limit: AtomicU32::new(limit), in_use: AtomicU32::new(0) }
    }

    /// Takes a slot if fewer than the limit are in use.
    pub fn try_acquire(self: &Arc<Self>) -> Option<ConcurrencySlot> {
        let limit = self.limit.load(Ordering::Acquire);
        self.in_use.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1)).ok()?;
        Some(ConcurrencySlot(Arc::clone(self)))
    }

    /// Changes the limit; slots in use are kept.
    pub fn resize(&self, limit: u32) {
        self.limit.store(limit, Ordering::Release);
    }

    /// Slots in use now.
    pub fn in_use(&self) -> u32 {
        self.in_use.load(Ordering::Acquire)
    }
}

/// A token bucket: `rate` tokens per second, holding at most `burst`.
#[derive(Debug)]
pub struct TokenBucket {
    state: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    /// Adds the tokens earned at the current rate since the last refill (none
    /// while unlimited), up to the burst.
    fn refill(&mut self, now: Instant) {
        if self.rate > 0.0 {
            self.tokens = (self.tokens + now.saturating_duration_since(self.last).as_secs_f64() * self.rate).min(self.burst);
        }
        self.last = now;
    }
}

impl TokenBucket {
    /// A full bucket; `rate` 0 never refuses.
    pub fn new(rate: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self { state: Mutex::new(Bucket { rate, burst, tokens: burst, last: Instant::now() }) }
    }

    /// Changes rate and burst in place: tokens saved up stay (up to the new
    /// burst), and the time since the last take earns tokens at the old
    /// rate, never at the new one (raising the rate grants no tokens for
    /// the time before it).
    pub fn reconfigure(&self, rate: f64, burst: u32) {
        self.reconfigure_at(rate, burst, Instant::now());
    }

    fn reconfigure_at(&self, rate: f64, burst: u32, now: Instant) {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.refill(now);
        state.rate = rate;
        state.burst = f64::from(burst.max(1));
        state.tokens = state.tokens.min(state.burst);
    }

    /// Takes a token, or says how long until one is available.
    pub fn try_take(&self) -> Result<(), Duration> {
        self.try_take_at(Instant::now())
    }

    fn try_take_at(&self, now: Instant) -> Result<(), Duration> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let b = &mut *state;
        if b.rate <= 0.0 {
            return Ok(());
        }
        b.refill(now);
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::try_from_secs_f64((1.0 - b.tokens) / b.rate).unwrap_or(Duration::MAX))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_allows_a_burst_then_the_rate() {
        let bucket = TokenBucket::new(2.0, 3);
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(bucket.try_take_at(t0).is_ok());
        }
        let wait = bucket.try_take_at(t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-6, "{wait:?}");
        assert!(bucket.try_take_at(t0 + Duration::from_millis(500)).is_ok());
        assert!(bucket.try_take_at(t0 + Duration::from_millis(500)).is_err());
        assert!(TokenBucket::new(0.0, 1).try_take_at(t0).is_ok(), "rate 0 is unlimited");
    }

    #[test]
    fn a_raised_rate_grants_no_tokens_for_the_time_before_it() {
        let bucket = TokenBucket::new(1.0, 1);
        let t0 = Instant::now();
        assert!(bucket.try_take_at(t0).is_ok());
        // Ten idle seconds at 1/s refill the burst of 1, not 10 000 at the new rate.
        let t1 = t0 + Duration::from_secs(10);
        bucket.reconfigure_at(1000.0, 1000, t1);
        let granted = std::iter::from_fn(|| bucket.try_take_at(t1).ok()).take(2000).count();
        assert_eq!(granted, 1);
        assert!(bucket.try_take_at(t1 + Duration::from_millis(10)).is_ok(), "the new rate applies from the change on");
        // Lowered, the saved-up tokens stay within the new burst.
        let full = TokenBucket::new(1.0, 50);
        full.reconfigure_at(1.0, 2, t0);
        assert_eq!(std::iter::from_fn(|| full.try_take_at(t0).ok()).take(100).count(), 2);
    }

    #[test]
    fn bucket_reconfigured_in_place_keeps_no_more_than_the_new_burst() {
        let bucket = TokenBucket::new(1.0, 10);
        let t0 = Instant::now();
        bucket.reconfigure(1.0, 2);
        assert!(bucket.try_take_at(t0).is_ok());
        assert!(bucket.try_take_at(t0).is_ok());
        assert!(bucket.try_take_at(t0).is_err(), "the burst shrank to 2");
    }

    #[test]
    fn concurrency_gate_resized_in_place_never_runs_over_the_new_limit() {
        let gate = Arc::new(ConcurrencyGate::new(4));
        let mut held: Vec<_> = (0..4).map(|_| gate.try_acquire().unwrap()).collect();
        assert!(gate.try_acquire().is_none());
        gate.resize(2);
        held.pop();
        // 3 still in flight, over the new limit of 2: nothing new until 1 is left.
        assert_eq!(gate.in_use(), 3);
        assert!(gate.try_acquire().is_none());
        gate.resize(8);
        let more: Vec<_> = (0..5).map(|_| gate.try_acquire().unwrap()).collect();
        assert_eq!((gate.in_use(), more.len(), held.len()), (8, 5, 3));
        assert!(gate.try_acquire().is_none());
    }

    #[test]
    fn the_tenant_api_bucket_is_each_nodes_whole_and_kept_across_changes() {
        let gate = new_gate(TenantLimits { api_rps: 2.0, ..TenantLimits::default() }, None, 4);
        let taken = std::iter::from_fn(|| gate.api.try_take().ok()).take(100).count();
        assert_eq!(taken, 10, "five seconds of 2/s, on each of four nodes alike");
        let changed = new_gate(TenantLimits { api_rps: 3.0, ..TenantLimits::default() }, Some(&gate), 4);
        assert!(changed.api.try_take().is_err(), "a limit change refills nothing");
    }

    fn limits(rps: f64, burst: u32, max_concurrency: u32) -> TenantLimits {
        TenantLimits { rps, burst, max_concurrency, ..TenantLimits::default() }
    }

    #[test]
    fn each_node_enforces_its_share_rounded_up() {
        assert_eq!(node_share(&limits(100.0, 200, 32), 1), (100.0, 200, 32), "one node: the whole limit");
        assert_eq!(node_share(&limits(100.0, 200, 32), 3), (100.0 / 3.0, 67, 11));
        assert_eq!(node_share(&limits(0.0, 1, 1), 4), (0.0, 1, 1), "unlimited stays unlimited; at least one slot");
        assert_eq!(node_share(&limits(10.0, 20, 8), 0), (10.0, 20, 8), "no node known yet: this one");
    }

    #[test]
    fn a_gate_is_reshared_in_place_when_nodes_come_and_go() {
        let gate = new_gate(limits(10.0, 4, 4), None, 2);
        let held: Vec<_> = std::iter::from_fn(|| gate.concurrency.try_acquire()).collect();
        assert_eq!(held.len(), 2, "half of 4 on each of two nodes");
        gate.share_among(1);
        assert!(gate.concurrency.try_acquire().is_some(), "a node gone: this one takes the whole limit");
        let kept = new_gate(limits(10.0, 4, 4), Some(&gate), 4);
        assert!(Arc::ptr_eq(&kept.concurrency, &gate.concurrency) && kept.concurrency.try_acquire().is_none());
    }
}
