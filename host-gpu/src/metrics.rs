//! Counters a batcher keeps about itself; lock-free, read as a snapshot.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (seconds) of the queue-wait histogram buckets.
pub const WAIT_BUCKETS: [f64; 12] = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0];

/// Live counters of one model's batcher.
#[derive(Debug)]
pub struct Metrics {
    /// `batch_sizes[n - 1]` counts batches of n samples.
    batch_sizes: Vec<AtomicU64>,
    wait_buckets: [AtomicU64; WAIT_BUCKETS.len()],
    wait_count: AtomicU64,
    wait_sum_us: AtomicU64,
    /// Busy time per worker (device), microseconds.
    busy_us: Vec<AtomicU64>,
    /// Device time charged to each tenant, microseconds (see [`Metrics::charge_tenants`]).
    tenant_busy_us: Mutex<BTreeMap<String, u64>>,
    /// Batch size each worker chose for the shape of its latest batch.
    batch_limit: Vec<AtomicU64>,
    /// Whether each worker is still learning that shape's size.
    learning: Vec<AtomicBool>,
    samples_ok: AtomicU64,
    samples_failed: AtomicU64,
    rejected_overloaded: AtomicU64,
    expired: AtomicU64,
    cancelled: AtomicU64,
}

/// A copy of [`Metrics`] at one instant.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSnapshot {
    /// `batch_sizes[n - 1]` = number of batches of n samples.
    pub batch_sizes: Vec<u64>,
    /// Cumulative counts for each bound of [`WAIT_BUCKETS`].
    pub wait_buckets: Vec<u64>,
    /// Calls that waited (reached a device).
    pub wait_count: u64,
    /// Total queue wait of those calls, seconds.
    pub wait_sum_seconds: f64,
    /// Busy seconds of each worker.
    pub busy_seconds: Vec<f64>,
    /// Device seconds charged to each tenant: each batch's time split
    /// between its samples by their cost (pixels).
    pub tenant_busy_seconds: BTreeMap<String, f64>,
    /// The batch size each worker last chose (learned, or `max_batch` when fixed).
    pub batch_limit: Vec<u64>,
    /// Whether each worker is still learning the size for its latest batch's
    /// shape (probing often, so batches vary more than once settled).
    pub learning: Vec<bool>,
    /// Samples answered with outputs.
    pub samples_ok: u64,
    /// Samples whose batch failed in the backend.
    pub samples_failed: u64,
    /// Calls refused because the queue was full.
    pub rejected_overloaded: u64,
    /// Calls dropped because their deadline passed in the queue.
    pub expired: u64,
    /// Calls dropped because their caller went away.
    pub cancelled: u64,
    /// Calls waiting right now.
    pub queue_depth: usize,
}

impl MetricsSnapshot {
    /// Number of batches run.
    pub fn batches(&self) -> u64 {
        self.batch_sizes.iter().sum()
    }

    /// Mean samples per batch (0 when none ran).
    pub fn mean_batch_size(&self) -> f64 {
        let batches = self.batches();
        let samples: u64 = self.batch_sizes.iter().zip(1u64..).map(|(count, n)| count * n).sum();
        if batches == 0 { 0.0 } else { samples as f64 / batches as f64 }
    }
}

impl Metrics {
    pub(crate) fn new(max_batch: usize, workers: usize) -> Self {
        Self {
            batch_sizes: (0..max_batch).map(|_| AtomicU64::new(0)).collect(),
            wait_buckets: Default::default(),
            wait_count: AtomicU64::new(0),
            wait_sum_us: AtomicU64::new(0),
            busy_us: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            tenant_busy_us: Mutex::default(),
            batch_limit: (0..workers).map(|_| AtomicU64::new(max_batch as u64)).collect(),
            learning: (0..workers).map(|_| AtomicBool::new(false)).collect(),
            samples_ok: AtomicU64::new(0),
            samples_failed: AtomicU64::new(0),
            rejected_overloaded: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
        }
    }

    pub(crate) fn record_wait(&self, wait: Duration) {
        let secs = wait.as_secs_f64();
        for (bound, bucket) in WAIT_BUCKETS.iter().zip(&self.wait_buckets) {
            if secs <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.wait_count.fetch_add(1, Ordering::Relaxed);
        self.wait_sum_us.fetch_add(micros(wait), Ordering::Relaxed);
    }

    pub(crate) fn record_batch(&self, worker: usize, size: usize, busy: Duration, ok: bool) {
        if let Some(slot) = size.checked_sub(1).and_then(|i| self.batch_sizes.get(i)) {
            slot.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(slot) = self.busy_us.get(worker) {
            slot.fetch_add(micros(busy), Ordering::Relaxed);
        }
        let counter = if ok { &self.samples_ok } else { &self.samples_failed };
        counter.fetch_add(size as u64, Ordering::Relaxed);
    }

    /// Charges a batch's device time to the tenants of its samples, each
    /// `(tenant, cost)` its share in proportion to its cost.
    pub(crate) fn charge_tenants<'a>(&self, busy: Duration, samples: impl Iterator<Item = (&'a str, u64)> + Clone) {
        let total: u64 = samples.clone().map(|(_, cost)| cost).sum();
        if total == 0 {
            return;
        }
        let mut charged = self.tenant_busy_us.lock().unwrap_or_else(|p| p.into_inner());
        for (tenant, cost) in samples {
            let share = share_us(busy, cost, total);
            match charged.get_mut(tenant) {
                Some(us) => *us = us.saturating_add(share),
                None => {
                    charged.insert(tenant.to_owned(), share);
                }
            }
        }
    }

    /// Forgets a deleted tenant's charged device time.
    pub(crate) fn forget_tenant(&self, tenant: &str) {
        self.tenant_busy_us.lock().unwrap_or_else(|p| p.into_inner()).remove(tenant);
    }

    /// Records a worker's chosen batch size, and whether it is still learning it.
    pub(crate) fn record_sizing(&self, worker: usize, limit: usize, learning: bool) {
        if let Some(slot) = self.batch_limit.get(worker) {
            slot.store(limit as u64, Ordering::Relaxed);
        }
        if let Some(slot) = self.learning.get(worker) {
            slot.store(learning, Ordering::Relaxed);
        }
    }

    pub(crate) fn record_overloaded(&self) {
        self.rejected_overloaded.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn record_dropped(&self, expired: usize, cancelled: usize) {
        self.expired.fetch_add(expired as u64, Ordering::Relaxed);
        self.cancelled.fetch_add(cancelled as u64, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self, queue_depth: usize) -> MetricsSnapshot {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsSnapshot {
            batch_sizes: self.batch_sizes.iter().map(load).collect(),
            wait_buckets: self.wait_buckets.iter().map(load).collect(),
            wait_count: load(&self.wait_count),
            wait_sum_seconds: load(&self.wait_sum_us) as f64 / 1e6,
            busy_seconds: self.busy_us.iter().map(|a| load(a) as f64 / 1e6).collect(),
            tenant_busy_seconds: (self.tenant_busy_us.lock().unwrap_or_else(|p| p.into_inner()).iter())
                .map(|(tenant, us)| (tenant.clone(), *us as f64 / 1e6))
                .collect(),
            batch_limit: self.batch_limit.iter().map(load).collect(),
            learning: self.learning.iter().map(|a| a.load(Ordering::Relaxed)).collect(),
            samples_ok: load(&self.samples_ok),
            samples_failed: load(&self.samples_failed),
            rejected_overloaded: load(&self.rejected_overloaded),
            expired: load(&self.expired),
            cancelled: load(&self.cancelled),
            queue_depth,
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A sample's share, µs, of a batch that kept its device `busy`: its cost
/// over the batch's `total` cost (rounded down; what each tenant is
/// charged, and each metered call).
pub(crate) fn share_us(busy: Duration, cost: u64, total: u64) -> u64 {
    if total == 0 {
        return 0;
    }
    u64::try_from(u128::from(micros(busy)) * u128::from(cost) / u128::from(total)).unwrap_or(u64::MAX)
}
