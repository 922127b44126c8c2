//! `facegate bench`: throughput and latency of the real gateway over HTTP
//! against the raw engine, measured in one run so their ratio is stable on a
//! noisy machine; and the batcher alone against a fake `a + b·n` device.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use facegate_host_gpu::backend::Backend;
use facegate_host_gpu::backend::fake::FakeBackend;
use facegate_host_gpu::{Batcher, BatcherConfig, InferRequest, Models, Tensor};
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
    /// at ten times capacity beside a neighbour; not part of `all`), or `all`.
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

/// How the bench's threads share the cores, for its header.
fn core_layout(engine: &facegate::config::EngineConfig) -> String {
    match engine.inference_cpus.as_slice() {
        [] => " (all threads share all cores)".into(),
        cores => format!(" on cores {cores:?} of their own (--inference-cores; handlers, HTTP and clients on the others)"),
    }
}

/// Decodes and letterboxes natively with the same SDK code the handlers run in wasm.
pub(crate) fn preprocess(bytes: &[u8], side: u32) -> anyhow::Result<Tensor> {
    use facegate_guest_sdk::image::{ImageLimits, decode, letterbox};
    let boxed = letterbox(&decode(bytes, &ImageLimits::default())?, side)?;
    let side = boxed.side as usize;
    Ok(Tensor::new(vec![side, side, 3], facegate_host_gpu::ElementType::U8, boxed.pixels)?)
}

pub(crate) async fn gateway_vs_engine(
    config: &BenchConfig,
    images: &[Bytes],
    tensors: &[Tensor],
    duration: Duration,
) -> anyhow::Result<()> {
    let batch_sizes: Vec<usize> = if config.suite == "issue2" { vec![config.serve.engine.max_batch] } else { vec![1, config.batch_on] };
    let mut setups = Vec::new();
    for &max_batch in &batch_sizes {
        let mut engine = config.serve.engine.clone();
        engine.max_batch = max_batch;
        let models = facegate::load_models(&engine)?;
        let (addr, key, server) = start_gateway(&config.serve, &engine, models.clone(), max_batch, 1).await?;
        // issue2 also runs a gateway whose tenant reuses instances, and the
        // pipeline natively, on the same engine (see `native`).
        let (warm, native) = match config.suite.as_str() {
            "issue2" => {
                let label = WARM_LABEL + max_batch;
                let (addr, key, task) = start_gateway(&config.serve, &engine, models.clone(), label, BENCH_INSTANCE_REUSE).await?;
                (Some(((addr, key), task)), Some(crate::native::start(models.clone(), config.side).await?.0))
            }
            _ => (None, None),
        };
        setups.push(Setup { max_batch, models, gateway: (addr, key), warm, native, _server: server });
    }
    println!("\n== gateway (HTTP + wasm handler) vs raw engine (host-gpu only), same images, same run ==");
    let rounds = config.rounds.max(1);
    let engine = &config.serve.engine;
    println!(
        "devices {:?}, {} CPU workers × {} threads{}, {:?} batch sizing, {}×{} images; {rounds} interleaved rounds of {:.1} s per row",
        engine.devices,
        engine.workers(),
        engine.threads_per_worker(),
        core_layout(engine),
        engine.batch_sizing,
        config.side,
        config.side,
        duration.as_secs_f64() / f64::from(rounds)
    );
    if config.suite == "issue2" {
        println!("(gateway: a fresh instance per request, the default; warm: the tenant's instance_reuse = {BENCH_INSTANCE_REUSE})");
        println!("(native: the same SDK pipeline compiled natively behind a bare hyper server, no sandbox, on the same engine)");
    }
    println!(
        "{:<28} {:>5} {:>10} {:>9} {:>9} {:>7} {:>6} {:>8} {:>6}",
        "configuration", "conc", "req/s", "p50 ms", "p99 ms", "batch", "errors", "cpu ms", "cores"
    );
    let round = duration / rounds;
    for &c in &config.concurrency {
        let warmup = Duration::from_secs_f64(config.warmup);
        let learn_max = Duration::from_secs_f64(config.learn_max);
        for setup in &setups {
            let (addr, models, max_batch) = (&setup.gateway, &setup.models, setup.max_batch);
            measure_gateway(addr, models, images, c, warmup, config.side).await;
            let (learned, waited) = learn(addr, models, images, c, config.side, learn_max).await;
            if !waited.is_zero() {
                let outcome = if learned { "learned" } else { "still learning" };
                println!(
                    "  max_batch={max_batch} at concurrency {c}: batch sizes {outcome} after {:.0} s more warm-up",
                    waited.as_secs_f64()
                );
            }
        }
        let mut tallies: Vec<[Tally; 4]> = setups.iter().map(|_| Default::default()).collect();
        for _ in 0..rounds {
            for (setup, [raw, gw, warm, native]) in setups.iter().zip(tallies.iter_mut()) {
                raw.add(measure_engine(&setup.models, tensors, c, round).await, round);
                gw.add(measure_gateway(&setup.gateway, &setup.models, images, c, round, config.side).await, round);
                if let Some((target, _)) = &setup.warm {
                    warm.add(measure_gateway(target, &setup.models, images, c, round, config.side).await, round);
                }
                if let Some(addr) = setup.native {
                    let target = (addr, String::new());
                    native.add(measure_gateway(&target, &setup.models, images, c, round, config.side).await, round);
                }
            }
        }
        let results: Vec<_> = tallies.into_iter().map(|tallies| tallies.map(Tally::summarize)).collect();
        for (setup, [raw, gw, warm, native]) in setups.iter().zip(&results) {
            let max_batch = setup.max_batch;
            print_row(&format!("engine  max_batch={max_batch}"), c, raw);
            print_row(&format!("gateway max_batch={max_batch}"), c, gw);
            if setup.warm.is_some() {
                print_row(&format!("warm gw max_batch={max_batch}"), c, warm);
            }
            if setup.native.is_some() {
                print_row(&format!("native  max_batch={max_batch}"), c, native);
            }
            let ratio =
                |label: &str, a: &Measurement, b: &Measurement| println!("{label:<28} {c:>5} {:>10.3}", a.throughput / b.throughput);
            ratio("  ratio gateway/engine", gw, raw);
            if setup.warm.is_some() {
                ratio("  ratio warm gw/engine", warm, raw);
                ratio("  ratio warm/fresh gateway", warm, gw);
            }
            if setup.native.is_some() {
                ratio("  ratio native/engine", native, raw);
                ratio("  ratio gateway/native", gw, native);
            }
            if setup.warm.is_some() && setup.native.is_some() {
                ratio("  ratio warm gw/native", warm, native);
            }
        }
        if let [[off_raw, off_gw, ..], .., [on_raw, on_gw, ..]] = results.as_slice() {
            println!("{:<28} {:>5} {:>10.3}", "  ratio batching on/off, gw", c, on_gw.throughput / off_gw.throughput);
            println!("{:<28} {:>5} {:>10.3}", "  ratio batching on/off, eng", c, on_raw.throughput / off_raw.throughput);
        }
    }
    Ok(())
}

/// `instance_reuse` of the demo tenant on the bench's warm gateway.
const BENCH_INSTANCE_REUSE: u32 = 1000;
/// Added to the max batch to label the warm gateway's throw-away store.
const WARM_LABEL: usize = 1000;

/// One engine configuration of [`gateway_vs_engine`]: its models, its
/// gateway, perhaps a warm gateway (with its task) and the native server's
/// address, and the gateway's task.
struct Setup {
    max_batch: usize,
    models: Models,
    gateway: (SocketAddr, String),
    warm: Option<((SocketAddr, String), tokio::task::JoinHandle<()>)>,
    native: Option<SocketAddr>,
    _server: tokio::task::JoinHandle<()>,
}

/// Several rounds of one configuration, added up.
#[derive(Default)]
struct Tally {
    stats: LoopStats,
    window: Duration,
    batches: u64,
    samples: u64,
}

impl Tally {
    fn add(&mut self, (stats, batches, samples): (LoopStats, u64, u64), window: Duration) {
        self.stats.merge(stats);
        self.window += window;
        self.batches += batches;
        self.samples += samples;
    }

    fn summarize(self) -> Measurement {
        let mean_batch = if self.batches == 0 { 0.0 } else { self.samples as f64 / self.batches as f64 };
        Measurement { mean_batch, ..self.stats.summarize(self.window) }
    }
}

fn print_row(label: &str, concurrency: usize, m: &Measurement) {
    println!(
        "{label:<28} {concurrency:>5} {:>10.2} {:>9.1} {:>9.1} {:>7.2} {:>6} {:>8.2} {:>6.2}",
        m.throughput,
        m.p50.as_secs_f64() * 1e3,
        m.p99.as_secs_f64() * 1e3,
        m.mean_batch,
        m.errors,
        m.cpu_per_call.as_secs_f64() * 1e3,
        m.cores
    );
    print_failed_clients(m.failed_clients);
}

/// A line under a row whose client loops panicked (their calls are missing).
pub(crate) fn print_failed_clients(failed: usize) {
    if failed > 0 {
        println!("  {failed} client loop(s) panicked: their calls are missing from the row above");
    }
}

/// An in-process gateway on a throw-away store seeded from `--seed-dir`,
/// with tenant limits out of the way and tenants' `instance_reuse` as
/// given; returns its address and demo's key.
async fn start_gateway(
    serve: &BenchServe,
    engine: &EngineConfig,
    models: Models,
    label: usize,
    instance_reuse: u32,
) -> anyhow::Result<(SocketAddr, String, tokio::task::JoinHandle<()>)> {
    let (addr, mut keys, task) = start_seeded(&serve.seed_dir, engine, models, label, |c| c.limits.instance_reuse = instance_reuse).await?;
    let key = keys.remove("demo").context("the seed has no tenant demo")?;
    Ok((addr, key, task))
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
    // Everything is loaded: without an admin API nothing changes the store,
    // which can go now (with one, the caller removes `bench_data_dir(label)`).
    if config.admin_token.is_none() {
        let _ = std::fs::remove_dir_all(&data_dir);
    }
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
fn batch_delta(models: &Models, before: &[u64]) -> (u64, u64) {
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

/// Runs the gateway, unmeasured, while any device is still learning its
/// batch size, for at most `max`; returns whether learning ended, and the
/// time it took.
async fn learn(
    gateway: &(SocketAddr, String),
    models: &Models,
    images: &[Bytes],
    concurrency: usize,
    side: u32,
    max: Duration,
) -> (bool, Duration) {
    let learning = || models.iter().any(|b| b.metrics().learning.contains(&true));
    if !learning() || max.is_zero() {
        return (!learning(), Duration::ZERO);
    }
    let start = Instant::now();
    while learning() {
        if start.elapsed() >= max {
            return (false, start.elapsed());
        }
        measure_gateway(gateway, models, images, concurrency, Duration::from_secs(2), side).await;
    }
    (true, start.elapsed())
}

fn batch_counts(models: &Models) -> Vec<u64> {
    models.iter().next().map(|b| b.metrics().batch_sizes).unwrap_or_default()
}

async fn measure_engine(models: &Models, tensors: &[Tensor], concurrency: usize, duration: Duration) -> (LoopStats, u64, u64) {
    let before = batch_counts(models);
    let (models_c, tensors) = (models.clone(), Arc::new(tensors.to_vec()));
    let measured = drive(concurrency, duration, move |i| {
        let (models, tensors) = (models_c.clone(), Arc::clone(&tensors));
        async move {
            let input = tensors[i % tensors.len()].clone();
            let request = InferRequest { tenant: "bench".into(), input, deadline: Instant::now() + Duration::from_secs(60) };
            models.infer("centerface", request).await.is_ok()
        }
    })
    .await;
    let (batches, samples) = batch_delta(models, &before);
    (measured, batches, samples)
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

/// Hold-back delay of the fake suite's second row when `--batch-delay-us` is 0.
const FAKE_DEFAULT_DELAY: Duration = Duration::from_millis(2);

/// The fake suite's rows: each `--concurrency` level, without a hold-back
/// delay and with `--batch-delay-us` (2 ms when that is 0).
fn fake_plan(config: &BenchConfig) -> (Vec<usize>, [Duration; 2]) {
    let delay = match config.serve.engine.batch_delay_us {
        0 => FAKE_DEFAULT_DELAY,
        us => Duration::from_micros(us),
    };
    (config.concurrency.clone(), [Duration::ZERO, delay])
}

/// The batcher alone, on a fake device costing `a + b·n` per batch of n,
/// without and with a hold-back delay (`--batch-delay-us` in `serve`), and
/// the ratio of the two at each level.
pub(crate) async fn fake_device(config: &BenchConfig, duration: Duration) {
    const MAX_BATCH: usize = 16;
    let (a, b) = (Duration::from_millis(8), Duration::from_micros(500));
    let ideal = MAX_BATCH as f64 / (a + b * MAX_BATCH as u32).as_secs_f64();
    let (levels, delays) = fake_plan(config);
    let warmup = Duration::from_secs_f64(config.warmup);
    println!("\n== batcher alone, fake device: {a:?} + {b:?}·n per batch, max batch {MAX_BATCH}; ideal {ideal:.1}/s ==");
    println!("{:<10} {:>8} {:>10} {:>9} {:>9} {:>7} {:>12}", "conc", "delay", "calls/s", "p50 ms", "p99 ms", "batch", "of ideal");
    for concurrency in levels {
        let mut rows = Vec::new();
        for delay in delays {
            let batcher = BatcherConfig { max_batch: MAX_BATCH, max_delay: delay, ..BatcherConfig::default() };
            let Some(m) = measure_fake(&batcher, (a, b), concurrency, warmup, duration).await else { return };
            println!(
                "{concurrency:<10} {:>6}µs {:>10.1} {:>9.2} {:>9.2} {:>7.2} {:>11.3}x",
                delay.as_micros(),
                m.throughput,
                m.p50.as_secs_f64() * 1e3,
                m.p99.as_secs_f64() * 1e3,
                m.mean_batch,
                m.throughput / ideal
            );
            print_failed_clients(m.failed_clients);
            rows.push(m);
        }
        if let [none, delayed] = rows.as_slice() {
            println!(
                "  ratio delay/none at {concurrency}: throughput {:.3}, p50 {:.3}",
                delayed.throughput / none.throughput,
                delayed.p50.as_secs_f64() / none.p50.as_secs_f64()
            );
        }
    }
}

/// One fake-device configuration: an unmeasured warm-up, then `duration`
/// measured; the mean batch counts only the batches run while measured.
async fn measure_fake(
    config: &BatcherConfig,
    (a, b): (Duration, Duration),
    concurrency: usize,
    warmup: Duration,
    duration: Duration,
) -> Option<Measurement> {
    let backend: Box<dyn Backend> = Box::new(FakeBackend::new("fake", config.max_batch, a, b));
    let batcher = Batcher::start(vec![backend], config).ok()?;
    let mut models = Models::new();
    models.insert(batcher);
    let input = Tensor::new(vec![4], facegate_host_gpu::ElementType::U8, vec![1; 4]).ok()?;
    let driver = models.clone();
    let call = move |_| {
        let (models, input) = (driver.clone(), input.clone());
        async move {
            let request = InferRequest { tenant: "bench".into(), input, deadline: Instant::now() + Duration::from_secs(60) };
            models.infer("fake", request).await.is_ok()
        }
    };
    drive(concurrency, warmup, call.clone()).await;
    let before = batch_counts(&models);
    let measured = drive(concurrency, duration, call).await;
    let (batches, samples) = batch_delta(&models, &before);
    let mean_batch = if batches == 0 { 0.0 } else { samples as f64 / batches as f64 };
    Some(Measurement { mean_batch, ..measured.summarize(duration) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    const MS: Duration = Duration::from_millis(1);

    fn bench_config(args: &[&str]) -> BenchConfig {
        crate::Cli::try_parse_from(["facegate-bench"].iter().chain(args)).unwrap().config
    }

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
    fn a_tally_adds_rounds_and_averages_batches_over_them() {
        let round = |completed, latency, batches, samples| {
            (LoopStats { latencies: vec![latency], completed_in_window: completed, ..LoopStats::default() }, batches, samples)
        };
        let mut tally = Tally::default();
        tally.add(round(10, 5 * MS, 4, 4), Duration::from_secs(1));
        tally.add(round(20, 15 * MS, 2, 6), Duration::from_secs(1));
        let m = tally.summarize();
        assert_eq!(m.throughput, 15.0, "30 completions in two 1-s rounds");
        assert_eq!(m.mean_batch, 10.0 / 6.0, "10 samples in 6 batches");
        assert_eq!((m.p50, m.p99), (15 * MS, 15 * MS));
        assert_eq!(Tally::default().summarize().mean_batch, 0.0, "no batch, no mean");
    }

    #[test]
    fn batch_deltas_count_only_the_batches_between_snapshots() {
        // Batches of 1, 2 and 3: 5, 1, 0 before; 7, 1, 3 after.
        assert_eq!(histogram_delta(&[7, 1, 3], &[5, 1, 0]), (5, 2 + 9));
        assert_eq!(histogram_delta(&[5, 1, 0], &[5, 1, 0]), (0, 0));
    }

    #[test]
    fn the_fake_suite_follows_the_concurrency_and_delay_flags() {
        let (levels, delays) = fake_plan(&bench_config(&["--suite", "fake", "--concurrency", "2,8", "--batch-delay-us", "500"]));
        assert_eq!((levels, delays), (vec![2, 8], [Duration::ZERO, Duration::from_micros(500)]));
        let (levels, delays) = fake_plan(&bench_config(&[]));
        assert_eq!((levels, delays), (vec![1, 4, 16, 64], [Duration::ZERO, FAKE_DEFAULT_DELAY]));
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
