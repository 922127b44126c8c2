//! Prometheus text exposition of the gateway's and the batchers' counters,
//! the tenants' usage for bills ([`usage`]), their logs ([`logs`]) and
//! requests' traces ([`trace`]); dates in UTC ([`dates`]).

pub mod dates;
pub mod logs;
pub mod trace;
pub mod usage;

use std::collections::BTreeMap;

use crate::admission::limits::Limit;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use facegate_host_gpu::Models;
use facegate_host_gpu::metrics::{MetricsSnapshot, WAIT_BUCKETS};

/// Upper bounds (seconds) of the request-latency histogram.
const LATENCY_BUCKETS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

#[derive(Default)]
struct Series {
    count: u64,
    sum: f64,
    buckets: [u64; LATENCY_BUCKETS.len()],
}

/// Counters kept per tenant, which forget a tenant when it is deleted (the
/// control plane calls this on every snapshot that drops a tenant).
pub trait TenantCounters: Send + Sync {
    /// Drops every series of `tenant`: a namesake starts at zero.
    fn forget_tenant(&self, tenant: &str);
}

/// Request counters by tenant, handler and status, and connection counters.
#[derive(Default)]
pub struct HttpMetrics {
    requests: Mutex<BTreeMap<(String, String, u16), Series>>,
    /// Open connections and connections closed by a limit, all listeners.
    pub connections: Arc<ConnectionMetrics>,
}

impl HttpMetrics {
    /// Records one finished request.
    pub fn record(&self, tenant: &str, handler: &str, status: u16, latency: Duration) {
        let mut requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        let series = requests.entry((tenant.to_owned(), handler.to_owned(), status)).or_default();
        let secs = latency.as_secs_f64();
        series.count += 1;
        series.sum += secs;
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(series.buckets.iter_mut()) {
            if secs <= *bound {
                *bucket += 1;
            }
        }
    }

    /// Requests summed per tenant (all handlers), for the console's live view.
    pub fn by_tenant(&self) -> BTreeMap<String, TenantRequests> {
        let requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: BTreeMap<String, TenantRequests> = BTreeMap::new();
        for ((tenant, _, status), series) in requests.iter() {
            let summary = out.entry(tenant.clone()).or_default();
            summary.requests += series.count;
            *summary.by_status.entry(*status).or_default() += series.count;
            for (sum, count) in summary.buckets.iter_mut().zip(series.buckets) {
                *sum += count;
            }
        }
        out
    }

    fn render(&self, out: &mut String) {
        let requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        out.push_str("# HELP facegate_requests_seconds Handler request latency, by tenant, handler and status.\n");
        out.push_str("# TYPE facegate_requests_seconds histogram\n");
        for ((tenant, handler, status), s) in requests.iter() {
            let labels = format!("tenant=\"{tenant}\",handler=\"{handler}\",status=\"{status}\"");
            for (bound, count) in LATENCY_BUCKETS.iter().zip(s.buckets) {
                let _ = writeln!(out, "facegate_requests_seconds_bucket{{{labels},le=\"{bound}\"}} {count}");
            }
            let _ = writeln!(out, "facegate_requests_seconds_bucket{{{labels},le=\"+Inf\"}} {}", s.count);
            let _ = writeln!(out, "facegate_requests_seconds_sum{{{labels}}} {}", s.sum);
            let _ = writeln!(out, "facegate_requests_seconds_count{{{labels}}} {}", s.count);
        }
        drop(requests);
        self.connections.render(out);
    }
}

/// One tenant's requests, all handlers together.
#[derive(Debug, Clone, Default)]
pub struct TenantRequests {
    /// Requests answered.
    pub requests: u64,
    /// Requests by response status.
    pub by_status: BTreeMap<u16, u64>,
    /// Cumulative latency histogram over the request-latency buckets.
    buckets: [u64; LATENCY_BUCKETS.len()],
}

impl TenantRequests {
    /// The upper bound (seconds) of the latency bucket holding quantile `q`;
    /// `None` with no requests, or past the largest bucket.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.requests == 0 {
            return None;
        }
        let rank = (q * self.requests as f64).ceil().max(1.0) as u64;
        LATENCY_BUCKETS.iter().zip(self.buckets).find(|(_, count)| *count >= rank).map(|(bound, _)| *bound)
    }
}

/// Why the gateway closed a connection (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    /// No complete first request head (TLS handshake included) in time.
    HeadTimeout,
    /// No request in flight, and none started, for the idle timeout.
    Idle,
    /// Every connection slot (and the admin reserve) was taken, and no
    /// connection was idle to make room.
    OverCapacity,
    /// The client address had its most connections open.
    PerIpCap,
    /// The TLS handshake failed (a handshake that runs out of time is a `HeadTimeout`).
    TlsHandshake,
    /// Open for `--max-connection-age-s`: shut down gracefully.
    MaxAge,
    /// The longest-idle connection of a full listener, closed to admit a newcomer.
    Evicted,
    /// A client that took no answer (its receive window or socket full)
    /// for the idle timeout, with a request in flight or answers unsent:
    /// dropped.
    Stalled,
    /// Shut down gracefully after refusing `REFUSALS_BEFORE_CLOSE` requests
    /// in a row (429, 503): a client ignoring `Retry-After` reconnects to
    /// try again.
    Refusing,
}

impl CloseReason {
    const ALL: [Self; 9] = [
        Self::HeadTimeout,
        Self::Idle,
        Self::OverCapacity,
        Self::PerIpCap,
        Self::TlsHandshake,
        Self::MaxAge,
        Self::Evicted,
        Self::Stalled,
        Self::Refusing,
    ];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::HeadTimeout => "head_timeout",
            Self::Idle => "idle",
            Self::OverCapacity => "over_capacity",
            Self::PerIpCap => "per_ip_cap",
            Self::TlsHandshake => "tls_handshake",
            Self::MaxAge => "max_age",
            Self::Evicted => "evicted",
            Self::Stalled => "stalled",
            Self::Refusing => "refusing",
        }
    }
}

/// Open client connections, and those closed by a limit.
#[derive(Default)]
pub struct ConnectionMetrics {
    open: AtomicI64,
    closed: [AtomicU64; CloseReason::ALL.len()],
}

impl ConnectionMetrics {
    /// A connection was admitted.
    pub fn opened(&self) {
        self.open.fetch_add(1, Ordering::Relaxed);
    }

    /// An admitted connection ended, for whatever reason.
    pub fn ended(&self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }

    /// A connection was closed by a limit.
    pub fn closed(&self, reason: CloseReason) {
        self.closed[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String) {
        out.push_str(
            "# HELP facegate_connections_open Client connections open now, all listeners.\n# TYPE facegate_connections_open gauge\n",
        );
        let _ = writeln!(out, "facegate_connections_open {}", self.open.load(Ordering::Relaxed));
        out.push_str("# HELP facegate_connections_closed_total Client connections closed by a limit, by reason.\n");
        out.push_str("# TYPE facegate_connections_closed_total counter\n");
        for reason in CloseReason::ALL {
            let count = self.closed[reason as usize].load(Ordering::Relaxed);
            let _ = writeln!(out, "facegate_connections_closed_total{{reason=\"{}\"}} {count}", reason.label());
        }
    }
}

/// How often each tenant hit each limit.
#[derive(Default)]
pub struct LimitHits {
    hits: Mutex<BTreeMap<(String, Limit), Hits>>,
}

/// One tenant's hits of one limit.
#[derive(Default)]
struct Hits {
    count: u64,
    /// When a hit was last logged, and the hits since that were not.
    logged_at: Option<std::time::Instant>,
    unlogged: u64,
}

/// At most one "limit hit" log line per tenant and limit this often: a
/// flood of refusals must not become a flood of log lines (each costs the
/// node CPU, and the operator's log the lines that matter).
const HIT_LOG_EVERY: Duration = Duration::from_secs(10);

impl LimitHits {
    /// Counts one hit of `limit` by `tenant`, and logs it (at most once per
    /// `HIT_LOG_EVERY` per tenant and limit, saying how many went unlogged).
    pub fn hit(&self, tenant: &str, limit: Limit) {
        let mut hits = self.hits.lock().unwrap_or_else(|p| p.into_inner());
        let entry = hits.entry((tenant.to_owned(), limit)).or_default();
        entry.count += 1;
        let now = std::time::Instant::now();
        if entry.logged_at.is_some_and(|at| now.duration_since(at) < HIT_LOG_EVERY) {
            entry.unlogged += 1;
            return;
        }
        let unlogged = std::mem::take(&mut entry.unlogged);
        entry.logged_at = Some(now);
        drop(hits);
        tracing::info!(tenant, limit = limit.label(), unlogged_since_last = unlogged, "limit hit");
    }

    /// Hits of `limit` by `tenant` so far.
    pub fn count(&self, tenant: &str, limit: Limit) -> u64 {
        let hits = self.hits.lock().unwrap_or_else(|p| p.into_inner());
        hits.get(&(tenant.to_owned(), limit)).map_or(0, |h| h.count)
    }

    fn render(&self, out: &mut String) {
        let hits = self.hits.lock().unwrap_or_else(|p| p.into_inner());
        out.push_str("# HELP facegate_limit_hits_total Requests that hit a limit, by tenant and limit.\n");
        out.push_str("# TYPE facegate_limit_hits_total counter\n");
        for ((tenant, limit), hits) in hits.iter() {
            let _ = writeln!(out, "facegate_limit_hits_total{{tenant=\"{tenant}\",limit=\"{}\"}} {}", limit.label(), hits.count);
        }
    }
}

impl TenantCounters for HttpMetrics {
    fn forget_tenant(&self, tenant: &str) {
        self.requests.lock().unwrap_or_else(|p| p.into_inner()).retain(|(t, _, _), _| t != tenant);
    }
}

impl TenantCounters for LimitHits {
    fn forget_tenant(&self, tenant: &str) {
        self.hits.lock().unwrap_or_else(|p| p.into_inner()).retain(|(t, _), _| t != tenant);
    }
}

/// Handler instances now and since start, for `/metrics`.
#[derive(Debug, Clone, Copy)]
pub struct InstanceCounts {
    /// Instances running a request now.
    pub in_use: usize,
    /// Idle instances kept for reuse now.
    pub warm: usize,
    /// Requests served by a reused (warm) instance since start.
    pub reused: u64,
}

/// The node's own gauges: its memory budget and the cluster it counts.
#[derive(Debug, Clone, Copy)]
pub struct NodeGauges {
    /// The node's memory budget, bytes.
    pub memory_budget: usize,
    /// Bytes charged to it now.
    pub memory_charged: usize,
    /// Live nodes of the cluster, this one included (each enforces its
    /// share of a tenant's rate and concurrency).
    pub live_nodes: usize,
    /// Components compiled here since start.
    pub components_compiled: u64,
    /// Artifacts another node shared, loaded here instead of compiling, since start.
    pub components_shared: u64,
}

/// Appends the node's own gauges and counters.
pub fn render_node(out: &mut String, node: NodeGauges) {
    let series: [(&str, &str, &str, u64); 5] = [
        ("facegate_memory_budget_bytes", "gauge", "The node's memory budget for requests and warm instances.", node.memory_budget as u64),
        ("facegate_memory_charged_bytes", "gauge", "Memory charged to the budget now, all tenants.", node.memory_charged as u64),
        (
            "facegate_live_nodes",
            "gauge",
            "Live nodes of the cluster as this node counts them (tenants' rate and concurrency are shared among them).",
            node.live_nodes as u64,
        ),
        ("facegate_components_compiled_total", "counter", "Components this node compiled.", node.components_compiled),
        (
            "facegate_components_shared_loaded_total",
            "counter",
            "Artifacts other nodes compiled and shared, loaded instead of compiling.",
            node.components_shared,
        ),
    ];
    for (name, kind, help, value) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    }
}

/// Which models are loaded, what they count against the model-memory
/// bound, and their loads on demand and evictions (a model's batch series
/// below start again from zero when it is loaded again).
fn render_model_states(out: &mut String, models: &Models) {
    /// A family's name, type, help and value of a model.
    type Family = (&'static str, &'static str, &'static str, fn(&facegate_host_gpu::ModelState) -> u64);
    let states = models.states();
    let families: [Family; 4] = [
        ("facegate_model_loaded", "gauge", "1 while the model's engines are loaded.", |m| u64::from(m.loaded)),
        ("facegate_model_memory_bytes", "gauge", "What the model counts against the model-memory bound while loaded.", |m| m.bytes),
        ("facegate_model_loads_total", "counter", "Loads of the model on demand (a call found it unloaded).", |m| m.loads),
        ("facegate_model_evictions_total", "counter", "Times the model was unloaded to make room for another.", |m| m.evictions),
    ];
    for (name, kind, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for state in &states {
            let _ = writeln!(out, "{name}{{model=\"{}\"}} {}", state.name, value(state));
        }
    }
    let (loaded, bound) = models.memory();
    out.push_str(
        "# HELP facegate_models_loaded_bytes What the loaded models count against the bound.\n# TYPE facegate_models_loaded_bytes gauge\n",
    );
    let _ = writeln!(out, "facegate_models_loaded_bytes {loaded}");
    if let Some(bound) = bound {
        out.push_str("# HELP facegate_model_memory_bound_bytes --model-memory-mib.\n# TYPE facegate_model_memory_bound_bytes gauge\n");
        let _ = writeln!(out, "facegate_model_memory_bound_bytes {bound}");
    }
}

/// Renders everything in Prometheus text format.
pub fn render(http: &HttpMetrics, hits: &LimitHits, models: &Models, instances: InstanceCounts) -> String {
    let mut out = String::new();
    http.render(&mut out);
    hits.render(&mut out);
    out.push_str("# HELP facegate_instances_in_use Handler instances running a request now.\n# TYPE facegate_instances_in_use gauge\n");
    let _ = writeln!(out, "facegate_instances_in_use {}", instances.in_use);
    out.push_str("# HELP facegate_instances_warm Idle handler instances kept for reuse now.\n# TYPE facegate_instances_warm gauge\n");
    let _ = writeln!(out, "facegate_instances_warm {}", instances.warm);
    out.push_str(
        "# HELP facegate_instances_reused_total Requests served by a warm (reused) instance.\n# TYPE facegate_instances_reused_total counter\n",
    );
    let _ = writeln!(out, "facegate_instances_reused_total {}", instances.reused);
    render_model_states(&mut out, models);
    let snapshots: Vec<(String, MetricsSnapshot)> = models.iter().map(|b| (b.spec().name.clone(), b.metrics())).collect();
    // One family at a time, every model inside it: a family must not be split.
    family(&mut out, "facegate_batch_size", "histogram", "Samples per device batch.", &snapshots, batch_sizes);
    family(&mut out, "facegate_queue_wait_seconds", "histogram", "Time calls waited for a device.", &snapshots, queue_wait);
    family(&mut out, "facegate_device_busy_seconds_total", "counter", "Time each device spent running batches.", &snapshots, busy);
    family(
        &mut out,
        "facegate_tenant_device_seconds_total",
        "counter",
        "Device time charged to each tenant: each batch's time split between its samples by their pixels.",
        &snapshots,
        tenant_busy,
    );
    family(
        &mut out,
        "facegate_batch_limit",
        "gauge",
        "Batch size each device chose for the input shape of its latest batch (learned per shape).",
        &snapshots,
        limits,
    );
    family(
        &mut out,
        "facegate_batch_sizing_learning",
        "gauge",
        "1 while a device is still learning the batch size for the input shape of its latest batch (probing often).",
        &snapshots,
        learning,
    );
    family(&mut out, "facegate_queue_depth", "gauge", "Calls waiting now.", &snapshots, depth);
    family(&mut out, "facegate_inferences_total", "counter", "Inference calls by outcome.", &snapshots, outcomes);
    out
}

type Lines = fn(&mut String, &str, &MetricsSnapshot);

fn family(out: &mut String, name: &str, kind: &str, help: &str, snapshots: &[(String, MetricsSnapshot)], lines: Lines) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (model, snapshot) in snapshots {
        lines(out, &format!("model=\"{model}\""), snapshot);
    }
}

fn batch_sizes(out: &mut String, l: &str, m: &MetricsSnapshot) {
    let mut cumulative = 0;
    for (size, count) in (1..).zip(&m.batch_sizes) {
        cumulative += count;
        let _ = writeln!(out, "facegate_batch_size_bucket{{{l},le=\"{size}\"}} {cumulative}");
    }
    let samples: u64 = (1u64..).zip(&m.batch_sizes).map(|(n, c)| n * c).sum();
    let _ = writeln!(out, "facegate_batch_size_bucket{{{l},le=\"+Inf\"}} {cumulative}");
    let _ = writeln!(out, "facegate_batch_size_sum{{{l}}} {samples}");
    let _ = writeln!(out, "facegate_batch_size_count{{{l}}} {cumulative}");
}

fn queue_wait(out: &mut String, l: &str, m: &MetricsSnapshot) {
    for (bound, count) in WAIT_BUCKETS.iter().zip(&m.wait_buckets) {
        let _ = writeln!(out, "facegate_queue_wait_seconds_bucket{{{l},le=\"{bound}\"}} {count}");
    }
    let _ = writeln!(out, "facegate_queue_wait_seconds_bucket{{{l},le=\"+Inf\"}} {}", m.wait_count);
    let _ = writeln!(out, "facegate_queue_wait_seconds_sum{{{l}}} {}", m.wait_sum_seconds);
    let _ = writeln!(out, "facegate_queue_wait_seconds_count{{{l}}} {}", m.wait_count);
}

fn busy(out: &mut String, l: &str, m: &MetricsSnapshot) {
    for (device, seconds) in m.busy_seconds.iter().enumerate() {
        let _ = writeln!(out, "facegate_device_busy_seconds_total{{{l},device=\"{device}\"}} {seconds}");
    }
}

fn tenant_busy(out: &mut String, l: &str, m: &MetricsSnapshot) {
    for (tenant, seconds) in &m.tenant_busy_seconds {
        let _ = writeln!(out, "facegate_tenant_device_seconds_total{{{l},tenant=\"{}\"}} {seconds}", tenant.escape_default());
    }
}

fn limits(out: &mut String, l: &str, m: &MetricsSnapshot) {
    for (device, limit) in m.batch_limit.iter().enumerate() {
        let _ = writeln!(out, "facegate_batch_limit{{{l},device=\"{device}\"}} {limit}");
    }
}

fn learning(out: &mut String, l: &str, m: &MetricsSnapshot) {
    for (device, learning) in m.learning.iter().enumerate() {
        let _ = writeln!(out, "facegate_batch_sizing_learning{{{l},device=\"{device}\"}} {}", u8::from(*learning));
    }
}

fn depth(out: &mut String, l: &str, m: &MetricsSnapshot) {
    let _ = writeln!(out, "facegate_queue_depth{{{l}}} {}", m.queue_depth);
}

fn outcomes(out: &mut String, l: &str, m: &MetricsSnapshot) {
    for (outcome, value) in [
        ("ok", m.samples_ok),
        ("backend_error", m.samples_failed),
        ("overloaded", m.rejected_overloaded),
        ("expired", m.expired),
        ("cancelled", m.cancelled),
    ] {
        let _ = writeln!(out, "facegate_inferences_total{{{l},outcome=\"{outcome}\"}} {value}");
    }
}
