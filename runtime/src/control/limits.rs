//! Per-tenant limits: the server's flags give the defaults (and, for memory
//! and body size, the ceilings); a tenant stores only what it overrides.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Slowest sustained rate a tenant may be given (one request in 1000 s).
pub const MIN_RPS: f64 = 0.001;
/// Most requests one instance may serve: past it a fresh one starts, so a
/// handler's slow leaks (memory, state) are bounded in time too.
pub const MAX_INSTANCE_REUSE: u32 = 100_000;

/// A tenant's effective limits.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantLimits {
    /// Linear memory of one handler instance, MiB.
    pub memory_mib: usize,
    /// Deadline of one request (guest CPU, queueing and inference), ms.
    pub timeout_ms: u64,
    /// Requests of this tenant in flight at once; more get 429.
    pub max_concurrency: u32,
    /// Sustained requests per second (token bucket); 0 means unlimited.
    pub rps: f64,
    /// Requests that may arrive at once above the sustained rate.
    pub burst: u32,
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// `face-detect.infer` calls one request may make.
    pub max_infer_calls: u32,
    /// Share of device time when tenants compete (fair-queueing weight).
    pub weight: u32,
    /// Whether handlers may import `wasi:http/outgoing-handler` and send requests.
    pub outgoing_http: bool,
    /// Requests one handler instance may serve, one after another; 1 means a
    /// fresh instance for every request. Above 1 an instance that ended its
    /// request cleanly is kept warm for the same handler version, so its
    /// globals outlive a request (see `crate::warm`).
    pub instance_reuse: u32,
}

/// What a tenant overrides; absent fields follow the server's defaults.
/// The same struct is the admin API's `limits` JSON and the CLI's flags.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(deny_unknown_fields)]
pub struct LimitOverrides {
    /// Linear memory of one instance (MiB).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<usize>,
    /// Request deadline (ms).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Requests in flight at once.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
    /// Sustained requests per second (0: unlimited).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rps: Option<f64>,
    /// Token-bucket size.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Largest request body (bytes).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_body_bytes: Option<usize>,
    /// face-detect calls per request.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_infer_calls: Option<u32>,
    /// Share of device batches.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    /// Grant outgoing HTTP (wasi:http/outgoing-handler): true or false.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outgoing_http: Option<bool>,
    /// Requests one handler instance may serve (1: a fresh instance each).
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_reuse: Option<u32>,
}

impl LimitOverrides {
    /// Fields set in `other` replace those here.
    pub fn merge(&mut self, other: &LimitOverrides) {
        macro_rules! take {
            ($($f:ident),*) => { $( if other.$f.is_some() { self.$f = other.$f; } )* };
        }
        take!(memory_mib, timeout_ms, max_concurrency, rps, burst, max_body_bytes, max_infer_calls, weight, outgoing_http, instance_reuse);
    }
}

impl TenantLimits {
    /// These defaults with `overrides` applied.
    pub fn with(&self, o: &LimitOverrides) -> TenantLimits {
        TenantLimits {
            memory_mib: o.memory_mib.unwrap_or(self.memory_mib),
            timeout_ms: o.timeout_ms.unwrap_or(self.timeout_ms),
            max_concurrency: o.max_concurrency.unwrap_or(self.max_concurrency),
            rps: o.rps.unwrap_or(self.rps),
            burst: o.burst.unwrap_or(self.burst),
            max_body_bytes: o.max_body_bytes.unwrap_or(self.max_body_bytes),
            max_infer_calls: o.max_infer_calls.unwrap_or(self.max_infer_calls),
            weight: o.weight.unwrap_or(self.weight),
            outgoing_http: o.outgoing_http.unwrap_or(self.outgoing_http),
            instance_reuse: o.instance_reuse.unwrap_or(self.instance_reuse),
        }
    }

    /// Checks `o` against these defaults, which are also the ceilings for
    /// memory and body size (the engine's instance slots are sized by them).
    pub fn validate(&self, o: &LimitOverrides) -> Result<(), String> {
        let l = self.with(o);
        let checks = [
            (l.memory_mib >= 1 && l.memory_mib <= self.memory_mib, format!("memory_mib must be 1..={}", self.memory_mib)),
            (l.timeout_ms >= 1 && l.timeout_ms <= 600_000, "timeout_ms must be 1..=600000".to_owned()),
            (l.max_concurrency >= 1, "max_concurrency must be at least 1".to_owned()),
            (l.rps == 0.0 || (l.rps.is_finite() && l.rps >= MIN_RPS), format!("rps must be 0 (unlimited) or at least {MIN_RPS}")),
            (l.burst >= 1, "burst must be at least 1".to_owned()),
            (
                l.max_body_bytes >= 1 && l.max_body_bytes <= self.max_body_bytes,
                format!("max_body_bytes must be 1..={}", self.max_body_bytes),
            ),
            (l.max_infer_calls <= 1024, "max_infer_calls must be at most 1024".to_owned()),
            (l.weight >= 1 && l.weight <= 1000, "weight must be 1..=1000".to_owned()),
            (l.instance_reuse >= 1 && l.instance_reuse <= MAX_INSTANCE_REUSE, format!("instance_reuse must be 1..={MAX_INSTANCE_REUSE}")),
        ];
        checks.into_iter().find(|(ok, _)| !ok).map_or(Ok(()), |(_, message)| Err(message))
    }

    /// The request deadline as a duration.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
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

    fn defaults() -> TenantLimits {
        TenantLimits {
            memory_mib: 256,
            timeout_ms: 10_000,
            max_concurrency: 32,
            rps: 100.0,
            burst: 100,
            max_body_bytes: 16 << 20,
            max_infer_calls: 16,
            weight: 1,
            outgoing_http: false,
            instance_reuse: 1,
        }
    }

    #[test]
    fn overrides_apply_and_ceilings_hold() {
        let o = LimitOverrides { memory_mib: Some(64), rps: Some(2.0), ..Default::default() };
        let l = defaults().with(&o);
        assert_eq!((l.memory_mib, l.rps, l.timeout_ms), (64, 2.0, 10_000));
        assert!(defaults().validate(&o).is_ok());
        let too_big = LimitOverrides { memory_mib: Some(512), ..Default::default() };
        assert!(defaults().validate(&too_big).unwrap_err().contains("memory_mib"));
        let zero = LimitOverrides { weight: Some(0), ..Default::default() };
        assert!(defaults().validate(&zero).unwrap_err().contains("weight"));
        for reuse in [0, MAX_INSTANCE_REUSE + 1] {
            let o = LimitOverrides { instance_reuse: Some(reuse), ..Default::default() };
            assert!(defaults().validate(&o).unwrap_err().contains("instance_reuse"), "{reuse}");
        }
        let warm = LimitOverrides { instance_reuse: Some(1000), ..Default::default() };
        assert_eq!(defaults().with(&warm).instance_reuse, 1000);
        for rps in [1e-30, -1.0, f64::NAN, f64::INFINITY] {
            let o = LimitOverrides { rps: Some(rps), ..Default::default() };
            assert!(defaults().validate(&o).unwrap_err().contains("rps"), "{rps}");
        }
    }

    #[test]
    fn unknown_limit_names_are_refused() {
        assert!(serde_json::from_str::<LimitOverrides>(r#"{"memroy_mib": 1}"#).is_err());
        let o: LimitOverrides = serde_json::from_str(r#"{"rps": 5}"#).unwrap();
        assert_eq!(o.rps, Some(5.0));
    }

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
}
