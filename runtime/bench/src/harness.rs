//! What the suites share: the bench's flags, in-process gateways on
//! throw-away stores, closed-loop clients ([`drive`]) and their figures
//! ([`LoopStats`], [`Measurement`]), and the gateway measured from a client.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use facegate_host_gpu::{Models, Tensor};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use facegate::config::{EngineConfig, ServeConfig};

/// Settings of `facegate bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchConfig {
    /// Image to post (repeat for several; they are used round-robin).
    #[arg(long = "image", default_value = "runtime/tests/fixtures/images/grace_hopper.jpg")]
    pub images: Vec<PathBuf>,

    /// Concurrency levels to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub concurrency: Vec<usize>,

    /// Seconds measured per configuration (after a short warm-up).
    #[arg(long, default_value_t = 5.0, value_parser = parse_seconds)]
    pub seconds: f64,

    /// What to measure: `issue2` (gateway vs engine at the given levels),
    /// `batching` (gateway with batching off vs on, plus the engine), `fake`
    /// (batcher with a fake a+b·n device), `pipeline` (CPU per request
    /// outside inference, per image kind, and wasm vs native
    /// preprocessing), `languages` (detect in Rust, Python and JavaScript:
    /// deploy, first request, warm latency), `isolation` (a neighbour tenant
    /// while a hostile one attacks; not part of `all`), `overload` (a flood
    /// at ten times capacity beside a neighbour; not part of `all`),
    /// `tracing` (throughput traced against untraced; not part of `all`),
    /// `overhead` (the smallest handler through the gateway against a bare
    /// hyper server; not part of `all`), `state` (key-value set and get on
    /// SQLite and PostgreSQL, and a repeated image through `detect-cached`
    /// against `detect`; not part of `all`), `models` (`centerface`
    /// against `centerface-int8` through the gateway at sides 160 and 640,
    /// and each one's accuracy on the test photos; not part of `all`), or `all`.
    #[arg(long, default_value = "all")]
    pub suite: String,

    /// Max batch of the "batching on" configuration (off is 1).
    #[arg(long, default_value_t = 8)]
    pub batch_on: usize,

    /// Letterbox side: passed to the handler as `?size=` and used for the
    /// raw engine's tensors, so both run the same input.
    #[arg(long, default_value_t = 640)]
    pub side: u32,

    /// Seconds each configuration runs, unmeasured, before each concurrency
    /// level, so that what is measured is the steady state.
    #[arg(long, default_value_t = 3.0, value_parser = parse_seconds)]
    pub warmup: f64,

    /// With `--batch-sizing adaptive`, at most this many extra warm-up
    /// seconds per configuration and level while a device is still learning
    /// its batch size (probing often); the bench prints how long it took.
    #[arg(long, default_value_t = 60.0, value_parser = parse_seconds)]
    pub learn_max: f64,

    /// Interleaved rounds per row: configurations compared are measured
    /// A B A B …, so drift on a shared machine hits all of them alike.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,

    /// The hostile test handler, deployed as tenant `evil` for `--suite isolation`.
    #[arg(long, default_value = "guests/target/wasm32-wasip2/release/hostile.wasm")]
    pub hostile: PathBuf,

    /// Requests per image in `--suite pipeline` (medians are reported).
    #[arg(long, default_value_t = 10)]
    pub iterations: usize,

    /// Concurrent attacker clients of each attack in `--suite isolation`.
    #[arg(long, default_value_t = 4)]
    pub attackers: usize,

    /// Only the `--suite isolation` attacks whose name contains this.
    #[arg(long)]
    pub only: Option<String>,

    /// The component the `--suite isolation` upload attack uploads (default:
    /// the seed's `demo/detect.wasm`; e.g. `demo/detect-py.wasm`, 18 MB).
    #[arg(long)]
    pub upload_component: Option<PathBuf>,

    /// Gateway settings (handlers directory, limits) for the in-process gateway.
    #[command(flatten)]
    pub serve: BenchServe,
}

/// The subset of serve settings the bench exposes.
#[derive(Debug, Clone, Args)]
pub struct BenchServe {
    /// Handler components (`<tenant>/<handler>.wasm`) seeded into a
    /// throw-away store; `demo/detect` is posted to.
    #[arg(long, env = "FACEGATE_SEED", default_value = ".facegate/handlers")]
    pub seed_dir: PathBuf,

    /// Inference engines.
    #[command(flatten)]
    pub engine: EngineConfig,
}

/// One measured configuration.
#[derive(Debug, Clone)]
pub struct Measurement {
    /// Completed calls per second.
    pub throughput: f64,
    /// Median latency.
    pub p50: Duration,
    /// 99th-percentile latency.
    pub p99: Duration,
    /// Mean device batch size over the run.
    pub mean_batch: f64,
    /// Calls that failed.
    pub errors: usize,
    /// Client loops that panicked; their calls are missing from the figures.
    pub failed_clients: usize,
    /// CPU time of the whole process inside the window per completed call
    /// (client, gateway and engine together: they share the cores).
    pub cpu_per_call: Duration,
    /// Cores the process kept busy on average inside the window.
    pub cores: f64,
}

/// A duration in seconds: finite and not negative.
fn parse_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => Ok(s),
        _ => Err(format!("{text:?} is not a number of seconds (0 or more)")),
    }
}

/// Decodes and letterboxes natively with the same SDK code the handlers run in wasm.
pub(crate) fn preprocess(bytes: &[u8], side: u32) -> anyhow::Result<Tensor> {
    use facegate_guest_sdk::image::{ImageLimits, decode, letterbox};
    let boxed = letterbox(&decode(bytes, &ImageLimits::default())?, side)?;
    let side = boxed.side as usize;
    Ok(Tensor::new(vec![side, side, 3], facegate_host_gpu::ElementType::U8, boxed.pixels)?)
}

/// A line under a row whose client loops panicked (their calls are missing).
pub(crate) fn print_failed_clients(failed: usize) {
    if failed > 0 {
        println!("  {failed} client loop(s) panicked: their calls are missing from the row above");
    }
}

/// An in-process gateway on a throw-away store seeded from `seed_dir`, with
/// the bench's settings then `adjust`'s; returns its address and every
/// seeded tenant's key.
pub(crate) async fn start_seeded(
    seed_dir: &std::path::Path,
    engine: &EngineConfig,
    models: Models,
    label: usize,
    adjust: impl FnOnce(&mut ServeConfig),
) -> anyhow::Result<(SocketAddr, std::collections::HashMap<String, String>, tokio::task::JoinHandle<()>)> {
    let data_dir = bench_data_dir(label);
    let _ = std::fs::remove_dir_all(&data_dir);
    let mut config = ServeConfig::with_data_dir(data_dir.clone())?;
    config.listen = "127.0.0.1:0".parse()?;
    let seed_copy = rust_handlers_only(seed_dir, &data_dir)?;
    config.seed_dir = Some(seed_copy.clone());
    config.limits.timeout_ms = 60_000;
    config.max_instances = 256;
    config.limits.max_concurrency = 256;
    config.limits.rps = 0.0;
    config.engine = engine.clone();
    adjust(&mut config);
    let gateway = facegate::Gateway::new(&config, models)?;
    let _ = std::fs::remove_dir_all(&seed_copy);
    let keys = gateway.seeded_keys.iter().map(|k| (k.tenant.clone(), k.key.clone())).collect();
    let (listener, addr) = facegate::bind(config.listen).await?;
    let task = tokio::spawn(async move {
        let _ = gateway.serve(listener, std::future::pending()).await;
    });
    Ok((addr, keys, task))
}

/// A copy of `seed_dir` without the Python and JavaScript examples
/// (`*-py.wasm`, `*-js.wasm`): each bench gateway would compile them again
/// at start, and only `--suite languages` calls them (it deploys them itself).
fn rust_handlers_only(seed_dir: &std::path::Path, data_dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    let copy = data_dir.with_extension("seed");
    let _ = std::fs::remove_dir_all(&copy);
    for tenant in std::fs::read_dir(seed_dir).with_context(|| format!("reading {}", seed_dir.display()))?.flatten() {
        if !tenant.path().is_dir() {
            continue;
        }
        let into = copy.join(tenant.file_name());
        std::fs::create_dir_all(&into)?;
        for file in std::fs::read_dir(tenant.path())?.flatten() {
            let name = file.file_name().to_string_lossy().into_owned();
            if name.ends_with(".wasm") && !name.ends_with("-py.wasm") && !name.ends_with("-js.wasm") {
                std::fs::copy(file.path(), into.join(&name))?;
            }
        }
    }
    Ok(copy)
}

/// Removes this process's throw-away stores (each gateway's stays while it
/// serves: handlers' state lives in it).
pub(crate) fn remove_bench_dirs() {
    let prefix = format!("facegate-bench-{}-", std::process::id());
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&prefix)) {
        let _ = std::fs::remove_dir_all(entry.path());
    }
}

/// The throw-away store of the bench gateway numbered `label`.
pub(crate) fn bench_data_dir(label: usize) -> PathBuf {
    std::env::temp_dir().join(format!("facegate-bench-{}-{label}", std::process::id()))
}

/// Drives `call` from `concurrency` closed loops: a warm-up, then `duration`
/// measured. Throughput counts the calls that completed inside the window
/// (steady state, no ramp-up or drain); latencies are those of the calls
/// that started inside it.
pub(crate) async fn drive<F, Fut>(concurrency: usize, duration: Duration, call: F) -> LoopStats
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let warmup = Instant::now() + Duration::from_millis(500);
    let end = warmup + duration;
    // The process's CPU time over the same window the completions count in.
    let cpu = tokio::spawn(async move {
        tokio::time::sleep_until(warmup.into()).await;
        let start = process_cpu();
        tokio::time::sleep_until(end.into()).await;
        process_cpu().saturating_sub(start)
    });
    let tasks: Vec<_> = (0..concurrency)
        .map(|client| {
            let call = call.clone();
            tokio::spawn(async move {
                let mut stats = LoopStats::default();
                let mut i = client;
                while Instant::now() < end {
                    let start = Instant::now();
                    let ok = call(i).await;
                    stats.record(start, Instant::now(), ok, warmup, end);
                    i += concurrency;
                }
                stats
            })
        })
        .collect();
    let mut all = LoopStats::default();
    for task in tasks {
        match task.await {
            Ok(stats) => all.merge(stats),
            Err(e) => {
                eprintln!("a bench client loop failed: {e}");
                all.failed_clients += 1;
            }
        }
    }
    all.cpu = cpu.await.unwrap_or_default();
    all
}

/// CPU time of the whole process (Linux); elsewhere wall time since first use.
#[cfg(target_os = "linux")]
pub(crate) fn process_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn process_cpu() -> Duration {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed()
}

/// What one client loop saw (or several, merged).
#[derive(Debug, Default)]
pub(crate) struct LoopStats {
    latencies: Vec<Duration>,
    completed_in_window: usize,
    errors: usize,
    /// Client loops that panicked (counted by [`drive`]).
    failed_clients: usize,
    /// The process's CPU time inside the window (set by [`drive`]).
    cpu: Duration,
}

impl LoopStats {
    /// One call that ran from `start` to `done`: its latency and outcome
    /// count if it started inside `[warmup, end)`, its completion if it
    /// succeeded inside that window.
    fn record(&mut self, start: Instant, done: Instant, ok: bool, warmup: Instant, end: Instant) {
        if start >= warmup && start < end {
            self.latencies.push(done - start);
            self.errors += usize::from(!ok);
        }
        if ok && done >= warmup && done < end {
            self.completed_in_window += 1;
        }
    }

    /// Stats of `completed` calls in the window, one of them timed (for tests).
    #[cfg(test)]
    pub(crate) fn of(completed: usize, latency: Duration) -> Self {
        Self { latencies: vec![latency], completed_in_window: completed, ..Self::default() }
    }

    pub(crate) fn merge(&mut self, other: Self) {
        self.latencies.extend(other.latencies);
        self.completed_in_window += other.completed_in_window;
        self.errors += other.errors;
        self.failed_clients += other.failed_clients;
        self.cpu += other.cpu;
    }

    /// Completions per second of `window`, latency percentiles, errors
    /// and failed clients; no batch figure (callers add it).
    pub(crate) fn summarize(mut self, window: Duration) -> Measurement {
        self.latencies.sort();
        let completed = u32::try_from(self.completed_in_window.max(1)).unwrap_or(u32::MAX);
        Measurement {
            throughput: self.completed_in_window as f64 / window.as_secs_f64(),
            p50: percentile(&self.latencies, 0.5),
            p99: percentile(&self.latencies, 0.99),
            mean_batch: 0.0,
            errors: self.errors,
            failed_clients: self.failed_clients,
            cpu_per_call: self.cpu / completed,
            cores: self.cpu.as_secs_f64() / window.as_secs_f64(),
        }
    }
}

/// The `q`-quantile of `sorted`: the value at rank `round(q·(n−1))`; zero
/// when there is none.
fn percentile(sorted: &[Duration], q: f64) -> Duration {
    let last = sorted.len().saturating_sub(1) as f64;
    sorted.get((last * q).round() as usize).copied().unwrap_or_default()
}

/// Batches and samples run between a snapshot and now.
pub(crate) fn batch_delta(models: &Models, before: &[u64]) -> (u64, u64) {
    histogram_delta(&batch_counts(models), before)
}

/// Batches and samples between two batch-size histograms (entry `n - 1`
/// counts the batches of `n`).
fn histogram_delta(after: &[u64], before: &[u64]) -> (u64, u64) {
    let (mut batches, mut samples) = (0u64, 0u64);
    for (n, (a, b)) in (1u64..).zip(after.iter().zip(before)) {
        batches += a - b;
        samples += n * (a - b);
    }
    (batches, samples)
}

pub(crate) fn batch_counts(models: &Models) -> Vec<u64> {
    models.iter().next().map(|b| b.metrics().batch_sizes).unwrap_or_default()
}

pub(crate) async fn measure_gateway(
    (addr, key): &(SocketAddr, String),
    models: &Models,
    images: &[Bytes],
    concurrency: usize,
    duration: Duration,
    side: u32,
) -> (LoopStats, u64, u64) {
    let before = batch_counts(models);
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(256).build(connector);
    let (images, url) = (Arc::new(images.to_vec()), format!("http://{addr}/v1/demo/detect?size={side}"));
    let auth = format!("Bearer {key}");
    let measured = drive(concurrency, duration, move |i| {
        let (client, images, url, auth) = (client.clone(), Arc::clone(&images), url.clone(), auth.clone());
        async move {
            let body = images[i % images.len()].clone();
            let Ok(req) = hyper::Request::post(url).header(hyper::header::AUTHORIZATION, auth).body(Full::new(body)) else {
                return false;
            };
            match client.request(req).await {
                Ok(resp) => resp.status().is_success() && resp.into_body().collect().await.is_ok(),
                Err(_) => false,
            }
        }
    })
    .await;
    let (batches, samples) = batch_delta(models, &before);
    (measured, batches, samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_call_counts_by_when_it_started_and_ended() {
        let t0 = Instant::now();
        let (warmup, end) = (t0 + 100 * MS, t0 + 200 * MS);
        let mut stats = LoopStats::default();
        stats.record(t0, t0 + 150 * MS, true, warmup, end); // started in the warm-up: completion only
        stats.record(t0 + 110 * MS, t0 + 120 * MS, true, warmup, end); // inside: both
        stats.record(t0 + 120 * MS, t0 + 130 * MS, false, warmup, end); // failed inside: latency and error
        stats.record(t0 + 190 * MS, t0 + 260 * MS, true, warmup, end); // ends after the window: latency only
        stats.record(t0 + 200 * MS, t0 + 210 * MS, false, warmup, end); // started at the end: nothing
        assert_eq!(stats.latencies, [10 * MS, 10 * MS, 70 * MS]);
        assert_eq!((stats.completed_in_window, stats.errors), (2, 1));
    }

    #[test]
    fn percentiles_pick_the_value_at_the_rounded_rank() {
        let sorted: Vec<Duration> = (1..=100).map(|i| i * MS).collect();
        assert_eq!(percentile(&sorted, 0.5), 51 * MS, "rank round(49.5) = 50");
        assert_eq!(percentile(&sorted, 0.99), 99 * MS, "rank round(98.01) = 98");
        assert_eq!(percentile(&sorted, 0.0), MS);
        assert_eq!(percentile(&sorted, 1.0), 100 * MS);
        assert_eq!(percentile(&[7 * MS], 0.99), 7 * MS);
        assert_eq!(percentile(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn summarize_sorts_merges_and_divides_by_the_window() {
        let mut a =
            LoopStats { latencies: vec![30 * MS, 10 * MS], completed_in_window: 3, errors: 1, cpu: 400 * MS, ..LoopStats::default() };
        a.merge(LoopStats { latencies: vec![20 * MS], completed_in_window: 1, errors: 0, failed_clients: 1, cpu: 200 * MS });
        let m = a.summarize(Duration::from_secs(2));
        assert_eq!(m.throughput, 2.0, "4 completions in 2 s");
        assert_eq!((m.p50, m.p99), (20 * MS, 30 * MS));
        assert_eq!((m.errors, m.failed_clients, m.mean_batch), (1, 1, 0.0));
        assert_eq!(m.cpu_per_call, 150 * MS, "600 ms of CPU over 4 completions");
        assert!((m.cores - 0.3).abs() < 1e-9, "600 ms of CPU in 2 s: {}", m.cores);
    }

    #[test]
    fn batch_deltas_count_only_the_batches_between_snapshots() {
        // Batches of 1, 2 and 3: 5, 1, 0 before; 7, 1, 3 after.
        assert_eq!(histogram_delta(&[7, 1, 3], &[5, 1, 0]), (5, 2 + 9));
        assert_eq!(histogram_delta(&[5, 1, 0], &[5, 1, 0]), (0, 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_client_loop_is_reported() {
        let stats = drive(3, 100 * MS, |i| async move {
            assert_ne!(i % 3, 1, "client 1 panics on purpose");
            tokio::time::sleep(5 * MS).await;
            true
        })
        .await;
        assert_eq!(stats.failed_clients, 1);
        assert!(stats.completed_in_window > 0, "the other two loops still count");
        assert_eq!(stats.summarize(100 * MS).failed_clients, 1);
    }
}
