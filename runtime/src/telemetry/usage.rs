//! Usage metering: what each tenant's handler versions used, per minute,
//! for bills. Requests add to the [`Meter`] as they end; the control
//! plane's sync thread hands what accumulated to the store every flush
//! interval as a numbered *delta* ([`Meter::seal`]), written once under the
//! node's incarnation and that number, so a retried write never counts
//! twice and a cluster's nodes simply sum. A crash loses what was not yet
//! written: at most one flush interval (more while the store is away).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

/// Length of a usage bucket, ms: requests are counted in the minute they started.
pub const BUCKET_MS: i64 = 60_000;

/// Which bucket a figure belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct UsageKey {
    /// The tenant.
    pub tenant: String,
    /// The handler.
    pub handler: String,
    /// The handler version that answered.
    pub version: i64,
    /// Start of the bucket, Unix ms (a multiple of [`BUCKET_MS`]).
    pub bucket_ms: i64,
}

impl UsageKey {
    /// The key of a request of `tenant`'s `handler` `version` that started at `at_ms`.
    pub fn new(tenant: &str, handler: &str, version: i64, at_ms: i64) -> Self {
        Self { tenant: tenant.to_owned(), handler: handler.to_owned(), version, bucket_ms: at_ms.div_euclid(BUCKET_MS) * BUCKET_MS }
    }
}

/// How a figure folds when buckets, deltas or nodes are summed up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fold {
    /// Added (saturating).
    Sum,
    /// The larger kept.
    Max,
}

impl Fold {
    /// Folds `b` into `a`.
    pub fn apply(self, a: u64, b: u64) -> u64 {
        match self {
            Self::Sum => a.saturating_add(b),
            Self::Max => a.max(b),
        }
    }

    /// The SQL aggregate that folds a column the same way.
    pub fn sql(self) -> &'static str {
        match self {
            Self::Sum => "SUM",
            Self::Max => "MAX",
        }
    }
}

/// Declares the usage figures once: the [`Usage`] struct (and so its JSON),
/// [`Usage::FIELDS`] (the store's columns in both SQL dialects, which each
/// store adds when missing, and the CSV's), how each folds ([`Usage::FOLDS`])
/// and the CLI table's column ([`Usage::COLUMNS`]). Adding a figure is one
/// line here, plus where it is measured.
macro_rules! usage_fields {
    ($( $(#[doc = $doc:literal])+ $name:ident: $fold:ident, column $column:literal / $scale:literal; )+) => {
        /// What was used in one bucket: each figure a sum, or a maximum (see [`Usage::FOLDS`]).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct Usage {
            $( $(#[doc = $doc])+ pub $name: u64, )+
        }

        impl Usage {
            /// How many figures there are.
            pub const COUNT: usize = [$(stringify!($name)),+].len();
            /// The figures' names, in the order of [`Usage::figures`] (the
            /// store's columns, the CSV's and the JSON's fields).
            pub const FIELDS: [&'static str; Self::COUNT] = [$(stringify!($name)),+];
            /// How each figure folds, in the same order.
            pub const FOLDS: [Fold; Self::COUNT] = [$(Fold::$fold),+];
            /// The CLI table's column of each figure: its heading, and what its value is divided by.
            pub const COLUMNS: [(&'static str, f64); Self::COUNT] = [$(($column, $scale as f64)),+];

            /// The figures, in the order of [`Usage::FIELDS`].
            pub fn figures(&self) -> [u64; Self::COUNT] {
                [$(self.$name),+]
            }

            /// Figures in the order of [`Usage::FIELDS`].
            pub fn from_figures(figures: [u64; Self::COUNT]) -> Self {
                let [$($name),+] = figures;
                Self { $($name),+ }
            }
        }
    };
}

usage_fields! {
    /// Answers with a 2xx status (and 1xx, none in practice).
    requests_2xx: Sum, column "2xx" / 1;
    /// Answers with a 3xx status.
    requests_3xx: Sum, column "3xx" / 1;
    /// Answers with a 4xx status (refusals for the tenant's own limits included).
    requests_4xx: Sum, column "4xx" / 1;
    /// Answers with a 5xx status (the node's refusals and the handler's failures).
    requests_5xx: Sum, column "5xx" / 1;
    /// Time the guest ran, µs: its instance's time less its waits for inference.
    guest_us: Sum, column "guest s" / 1_000_000;
    /// Device time, µs: each call's share of its batch, as `/metrics` splits it.
    device_us: Sum, column "device s" / 1_000_000;
    /// `face-detect.infer` calls made.
    infer_calls: Sum, column "calls" / 1;
    /// Request body bytes read.
    bytes_in: Sum, column "bytes in" / 1;
    /// Response body bytes sent.
    bytes_out: Sum, column "bytes out" / 1;
    /// The largest instance memory (linear memories and tables) a request
    /// ended with, bytes.
    peak_memory_bytes: Max, column "peak MiB" / 1_048_576;
    /// Keys read from the tenant's state (`wasi:keyvalue`): each key a
    /// get, an exists or a batch looked up, and each listing.
    kv_reads: Sum, column "kv reads" / 1;
    /// Keys written to the tenant's state: each key set, deleted,
    /// incremented or swapped.
    kv_writes: Sum, column "kv writes" / 1;
    /// The most bytes the tenant's state held after a write of these requests.
    kv_bytes: Max, column "kv MiB" / 1_048_576;
    /// Time from each request's arrival to its answer's head, µs, summed
    /// (over the answers: the mean latency).
    latency_us: Sum, column "latency s" / 1_000_000;
    /// The slowest of these answers, µs.
    latency_max_us: Max, column "max latency ms" / 1_000;
}

impl Usage {
    /// One answer of `status`, its head sent `latency` after the request arrived.
    pub fn answer(status: u16, latency: std::time::Duration) -> Self {
        let latency_us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let mut usage = Self { latency_us, latency_max_us: latency_us, ..Self::default() };
        match status {
            300..=399 => usage.requests_3xx = 1,
            400..=499 => usage.requests_4xx = 1,
            500.. => usage.requests_5xx = 1,
            _ => usage.requests_2xx = 1,
        }
        usage
    }

    /// All answers.
    pub fn requests(&self) -> u64 {
        self.requests_2xx + self.requests_3xx + self.requests_4xx + self.requests_5xx
    }

    /// Adds `other` in, each figure as it folds (see [`Usage::FOLDS`]).
    pub fn add(&mut self, other: &Self) {
        let (mine, theirs) = (self.figures(), other.figures());
        *self = Self::from_figures(std::array::from_fn(|i| Self::FOLDS[i].apply(mine[i], theirs[i])));
    }
}

/// What one model did for a bucket's requests: the part of the bucket's
/// `device_us` and `infer_calls` that ran on it (for bills by model).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelUsage {
    /// Device time on this model, µs.
    pub device_us: u64,
    /// `face-detect.infer` calls this model answered.
    pub infer_calls: u64,
}

impl ModelUsage {
    /// Adds `other` in.
    pub fn add(&mut self, other: &Self) {
        self.device_us = self.device_us.saturating_add(other.device_us);
        self.infer_calls = self.infer_calls.saturating_add(other.infer_calls);
    }
}

/// Each model's part of a bucket, by model name.
pub type ByModel = BTreeMap<String, ModelUsage>;

/// A sealed delta: what accumulated between two flushes, numbered.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Delta {
    /// The meter's incarnation (random per process).
    pub node: String,
    /// The delta's number, from 1, in this incarnation.
    pub seq: u64,
    /// The figures, by bucket.
    pub rows: Vec<(UsageKey, Usage)>,
    /// Each bucket's part per model (only buckets whose requests called one).
    pub models: Vec<(UsageKey, ByModel)>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Added since the last seal.
    open: HashMap<UsageKey, Usage>,
    /// Each bucket's part per model, added since the last seal.
    open_models: HashMap<UsageKey, ByModel>,
    /// Sealed and not yet written.
    sealed: Option<Delta>,
    last_seq: u64,
}

/// The node's usage, accumulating until written (see the module docs).
#[derive(Debug)]
pub struct Meter {
    node: String,
    inner: Mutex<Inner>,
}

impl Meter {
    /// A meter whose deltas are written as `node`'s (unique to this process:
    /// a restarted node must not reuse its numbers).
    pub fn new(node: String) -> Arc<Self> {
        Arc::new(Self { node, inner: Mutex::new(Inner::default()) })
    }

    /// This meter's incarnation.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Adds `usage` to `key`'s bucket.
    pub fn add(&self, key: &UsageKey, usage: &Usage) {
        let mut inner = self.lock();
        match inner.open.get_mut(key) {
            Some(bucket) => bucket.add(usage),
            None => {
                inner.open.insert(key.clone(), *usage);
            }
        }
    }

    /// Adds each model's part of a request of `key` (its `device_us` and
    /// `infer_calls` are also added whole with [`Meter::add`]).
    pub fn add_models(&self, key: &UsageKey, models: &ByModel) {
        if models.is_empty() {
            return;
        }
        let mut inner = self.lock();
        let bucket = inner.open_models.entry(key.clone()).or_default();
        for (model, usage) in models {
            bucket.entry(model.clone()).or_default().add(usage);
        }
    }

    /// The delta to write now: the one sealed before if it was not written
    /// (the same number: written at most once), else what accumulated
    /// since, sealed under the next number; `None` if there is nothing.
    pub fn seal(&self) -> Option<Delta> {
        let mut inner = self.lock();
        if let Some(sealed) = &inner.sealed {
            return Some(sealed.clone());
        }
        if inner.open.is_empty() && inner.open_models.is_empty() {
            return None;
        }
        inner.last_seq += 1;
        let mut rows: Vec<(UsageKey, Usage)> = inner.open.drain().collect();
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        let mut models: Vec<(UsageKey, ByModel)> = inner.open_models.drain().collect();
        models.sort_by(|a, b| a.0.cmp(&b.0));
        let delta = Delta { node: self.node.clone(), seq: inner.last_seq, rows, models };
        inner.sealed = Some(delta.clone());
        Some(delta)
    }

    /// The delta numbered `seq` is in the store.
    pub fn written(&self, seq: u64) {
        let mut inner = self.lock();
        if inner.sealed.as_ref().is_some_and(|d| d.seq == seq) {
            inner.sealed = None;
        }
    }

    /// Each model's part not yet written, summed by bucket (for tests).
    pub fn unwritten_models(&self) -> HashMap<UsageKey, ByModel> {
        let inner = self.lock();
        let mut all = inner.open_models.clone();
        for (key, models) in inner.sealed.iter().flat_map(|d| &d.models) {
            let bucket = all.entry(key.clone()).or_default();
            for (model, usage) in models {
                bucket.entry(model.clone()).or_default().add(usage);
            }
        }
        all
    }

    /// What is not yet written, summed by bucket (for tests and the console).
    pub fn unwritten(&self) -> HashMap<UsageKey, Usage> {
        let inner = self.lock();
        let mut all = inner.open.clone();
        for (key, usage) in inner.sealed.iter().flat_map(|d| &d.rows) {
            all.entry(key.clone()).or_default().add(usage);
        }
        all
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Counts a response body's bytes as it is sent, and adds them to its
/// bucket when the body ends or is dropped.
pub struct BytesOut {
    meter: Arc<Meter>,
    key: UsageKey,
    sent: AtomicU64,
}

impl BytesOut {
    /// A counter for a response of `key`.
    pub fn new(meter: Arc<Meter>, key: UsageKey) -> Self {
        Self { meter, key, sent: AtomicU64::new(0) }
    }

    /// `n` more bytes went out.
    pub fn sent(&self, n: usize) {
        self.sent.fetch_add(n as u64, Ordering::Relaxed);
    }
}

impl Drop for BytesOut {
    fn drop(&mut self) {
        let bytes_out = self.sent.load(Ordering::Relaxed);
        if bytes_out > 0 {
            self.meter.add(&self.key, &Usage { bytes_out, ..Usage::default() });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(minute: i64) -> UsageKey {
        UsageKey::new("acme", "detect", 1, minute * BUCKET_MS + 59_999)
    }

    #[test]
    fn requests_count_in_the_minute_they_started_by_status_class() {
        assert_eq!(key(3).bucket_ms, 3 * BUCKET_MS);
        let meter = Meter::new("n".into());
        for (status, ms) in [(200, 5), (204, 1), (301, 1), (404, 1), (429, 1), (500, 40), (503, 1)] {
            meter.add(&key(3), &Usage::answer(status, std::time::Duration::from_millis(ms)));
        }
        meter.add(&key(3), &Usage { peak_memory_bytes: 10, ..Usage::default() });
        meter.add(&key(3), &Usage { peak_memory_bytes: 4, guest_us: 7, ..Usage::default() });
        let usage = meter.unwritten()[&key(3)];
        assert_eq!((usage.requests_2xx, usage.requests_3xx, usage.requests_4xx, usage.requests_5xx), (2, 1, 2, 2));
        assert_eq!((usage.peak_memory_bytes, usage.guest_us, usage.requests()), (10, 7, 7));
        assert_eq!((usage.latency_us, usage.latency_max_us), (50_000, 40_000), "latencies summed, the slowest kept");
    }

    /// Each model's part of a bucket goes in the same delta as the bucket's
    /// figures, summed per model, and is sealed again with it while unwritten.
    #[test]
    fn models_parts_are_summed_and_sealed_with_their_delta() {
        let meter = Meter::new("n".into());
        let part = |device_us, infer_calls| ModelUsage { device_us, infer_calls };
        meter.add_models(&key(1), &ByModel::new());
        assert_eq!(meter.seal(), None, "no model called: nothing to write");
        meter.add_models(&key(1), &ByModel::from([("fp32".to_owned(), part(30, 1)), ("int8".to_owned(), part(10, 2))]));
        meter.add_models(&key(1), &ByModel::from([("fp32".to_owned(), part(5, 1))]));
        let first = meter.seal().unwrap();
        assert_eq!(first.models, vec![(key(1), ByModel::from([("fp32".to_owned(), part(35, 2)), ("int8".to_owned(), part(10, 2))]))]);
        meter.add_models(&key(1), &ByModel::from([("int8".to_owned(), part(1, 1))]));
        assert_eq!(meter.seal().unwrap(), first, "unwritten, the same delta again");
        assert_eq!(meter.unwritten_models()[&key(1)]["int8"], part(11, 3));
        meter.written(1);
        assert_eq!(meter.seal().unwrap().models, vec![(key(1), ByModel::from([("int8".to_owned(), part(1, 1))]))]);
    }

    #[test]
    fn a_delta_not_written_is_sealed_again_under_its_number() {
        let meter = Meter::new("n".into());
        assert_eq!(meter.seal(), None, "nothing to write");
        meter.add(&key(1), &Usage::answer(200, std::time::Duration::ZERO));
        let first = meter.seal().unwrap();
        assert_eq!(first.seq, 1);
        // The write failed; meanwhile more came.
        meter.add(&key(1), &Usage::answer(200, std::time::Duration::ZERO));
        assert_eq!(meter.seal().unwrap(), first, "the same delta, the same number: written once");
        assert_eq!(meter.unwritten()[&key(1)].requests_2xx, 2);
        meter.written(1);
        let second = meter.seal().unwrap();
        assert_eq!((second.seq, second.rows[0].1.requests_2xx), (2, 1), "the later request, in the next delta");
        meter.written(2);
        assert_eq!(meter.seal(), None);
        assert!(meter.unwritten().is_empty());
    }

    #[test]
    fn figures_go_out_and_come_back_in_the_order_of_their_names() {
        let usage = Usage { requests_4xx: 4, device_us: 6, peak_memory_bytes: 10, ..Usage::default() };
        let figures = usage.figures();
        let at = |name: &str| Usage::FIELDS.iter().position(|f| *f == name).unwrap();
        assert_eq!((figures[at("requests_4xx")], figures[at("device_us")], figures[at("peak_memory_bytes")]), (4, 6, 10));
        assert_eq!(Usage::from_figures(figures), usage);
        let numbered: [u64; Usage::COUNT] = std::array::from_fn(|i| i as u64 + 1);
        assert_eq!(Usage::from_figures(numbered).figures(), numbered, "every figure out and back in its place");
        let json = serde_json::to_value(usage).unwrap();
        assert!(Usage::FIELDS.iter().zip(figures).all(|(name, n)| json[name] == n), "{json}");
    }

    #[test]
    fn bytes_out_are_added_when_the_body_is_done() {
        let meter = Meter::new("n".into());
        let counter = BytesOut::new(Arc::clone(&meter), key(0));
        counter.sent(100);
        counter.sent(28);
        assert!(meter.unwritten().is_empty());
        drop(counter);
        assert_eq!(meter.unwritten()[&key(0)].bytes_out, 128);
    }
}
