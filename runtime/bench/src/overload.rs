//! `facegate bench --suite overload`: a tenant floods the gateway at about
//! ten times what it serves, open loop (a fixed request rate) and closed
//! loop (512 clients that ignore `Retry-After`), beside a neighbour tenant.
//! Reported, each as a ratio to the same gateway unflooded in the same run:
//! the goodput (requests served a second, both tenants), the flood's
//! refusals (how many, how fast) and its admitted requests that timed out
//! (504), the neighbour's p99, and the gateway's own CPU per refusal (the
//! flood's client runs on a thread of its own, whose CPU is not counted).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::harness::{BenchConfig, Measurement, measure_gateway, print_failed_clients, process_cpu, start_seeded};

/// The neighbour's closed-loop clients.
const NEIGHBOUR_CONCURRENCY: usize = 4;
/// The flooding tenant's closed-loop clients when unflooded: enough to keep
/// the device's batches full.
const STEADY_CONCURRENCY: usize = 32;
/// The open-loop flood's rate, as a multiple of the unflooded throughput.
const FLOOD_FACTOR: f64 = 10.0;
/// The closed-loop flood's clients (each one request at a time, retrying
/// at once whatever it is told).
const CLOSED_FLOOD_CLIENTS: usize = 512;
/// Most open-loop requests the flood's client keeps in flight; past it the
/// client skips a tick (counted) rather than grow without bound.
const MAX_OPEN_IN_FLIGHT: usize = 4096;
/// Unmeasured start of every measured window (as in `harness::drive`).
const WARM_UP: Duration = Duration::from_millis(500);
/// The tenants' request deadline: the server's default.
const DEADLINE_MS: u64 = facegate::admission::limits::DEFAULT_REQUEST_TIMEOUT_MS;
/// Requests in flight a tenant may have: the flood is refused by the
/// backlog estimate, not by this (the issue's flood ran with 128).
const TENANT_CONCURRENCY: u32 = 128;
/// Label of this suite's gateway store.
const STORE_LABEL: usize = 98;
/// The suite's admin token (the refusal-cost row sets a tenant's rate).
const ADMIN_TOKEN: &str = "bench-admin-token-0123456789";
/// Clients of the refusal-cost row.
const REFUSAL_CLIENTS: usize = 64;

/// How the flood's client sends.
#[derive(Debug, Clone, Copy)]
enum Flood {
    /// A fixed rate of new requests a second, whatever comes back.
    Open(f64),
    /// This many clients, each sending its next request as soon as it has an answer.
    Closed(usize),
}

/// What the flood's client saw inside the measured window.
#[derive(Debug, Default)]
struct FloodStats {
    served: usize,
    refused: usize,
    refusal_latencies: Vec<Duration>,
    /// Admitted requests that ran out of time (504).
    timed_out: usize,
    /// Any other status.
    other: usize,
    /// Requests that got no answer (connection errors), and the first error.
    no_answer: usize,
    first_error: Option<String>,
    /// Open-loop ticks skipped with [`MAX_OPEN_IN_FLIGHT`] in flight.
    skipped: usize,
    /// CPU time of the client's own thread inside the window.
    client_cpu: Duration,
}

impl FloodStats {
    fn record(&mut self, status: Result<u16, String>, took: Duration) {
        match status {
            Ok(200) => self.served += 1,
            Ok(429 | 503) => {
                self.refused += 1;
                self.refusal_latencies.push(took);
            }
            Ok(504) => self.timed_out += 1,
            Ok(_) => self.other += 1,
            Err(e) => {
                self.no_answer += 1;
                self.first_error.get_or_insert(e);
            }
        }
    }
}

/// Runs the suite and prints its table.
pub async fn run(config: &BenchConfig, images: &[Bytes], duration: Duration) -> anyhow::Result<()> {
    let seed = seed_with_flooder(&config.serve.seed_dir)?;
    let models = facegate::load_models(&config.serve.engine)?;
    let (addr, keys, _server) = start_seeded(&seed, &config.serve.engine, models.clone(), STORE_LABEL, |c| {
        c.limits.timeout_ms = DEADLINE_MS;
        c.limits.max_concurrency = TENANT_CONCURRENCY;
        c.max_instances = facegate::config::DEFAULT_MAX_INSTANCES;
        c.admin_token = Some(ADMIN_TOKEN.to_owned());
    })
    .await?;
    let _ = std::fs::remove_dir_all(&seed);
    let neighbour = (addr, keys.get("demo").context("no demo tenant")?.clone());
    let flooder = (addr, keys.get("flood").context("no flood tenant")?.clone());
    let body = images.first().cloned().context("no image")?;
    measure_gateway(&flooder, &models, images, STEADY_CONCURRENCY, Duration::from_secs_f64(config.warmup), config.side).await;

    let alone = measure_gateway(&neighbour, &models, images, NEIGHBOUR_CONCURRENCY, duration, config.side).await.0.summarize(duration);
    let steady = steady_state(&neighbour, &flooder, &models, images, duration, config.side).await;
    println!(
        "\n== overload: tenant flood posts to flood/detect beside neighbour demo/detect (concurrency {NEIGHBOUR_CONCURRENCY}); \
         deadline {DEADLINE_MS} ms; {:.0} s windows ==",
        duration.as_secs_f64()
    );
    println!(
        "unflooded: {:.1} served/s (flood at concurrency {STEADY_CONCURRENCY} + neighbour), neighbour alone p99 {:.0} ms, {:.1} ms CPU per request",
        steady.served_per_second,
        alone.p99.as_secs_f64() * 1e3,
        steady.cpu_per_served.as_secs_f64() * 1e3
    );
    println!(
        "{:<22} {:>9} {:>9} {:>7} {:>10} {:>9} {:>6} {:>6} {:>10} {:>7} {:>10}",
        "flood", "offered/s", "served/s", "goodput", "refused/s", "refuse ms", "504", "other", "nbr p99 ms", "nbr p99", "gw cores"
    );
    let rate = steady.served_per_second * FLOOD_FACTOR;
    for flood in [Flood::Open(rate), Flood::Closed(CLOSED_FLOOD_CLIENTS)] {
        let row = flooded(flood, (&neighbour, &flooder, &body), &models, images, duration, config.side).await;
        print_row(flood, &row, &steady, &alone, duration);
    }
    refusal_cost(&flooder, &body, duration).await?;
    let _ = std::fs::remove_dir_all(crate::harness::bench_data_dir(STORE_LABEL));
    Ok(())
}

/// The gateway unflooded: requests served a second by both tenants, and
/// the process's CPU per request served.
struct Steady {
    served_per_second: f64,
    cpu_per_served: Duration,
}

async fn steady_state(
    neighbour: &(SocketAddr, String),
    flooder: &(SocketAddr, String),
    models: &facegate_host_gpu::Models,
    images: &[Bytes],
    duration: Duration,
    side: u32,
) -> Steady {
    let (nbr, flood) = tokio::join!(
        measure_gateway(neighbour, models, images, NEIGHBOUR_CONCURRENCY, duration, side),
        measure_gateway(flooder, models, images, STEADY_CONCURRENCY, duration, side),
    );
    // Both windows are the same process's CPU: count it once.
    let (nbr, flood) = (nbr.0.summarize(duration), flood.0.summarize(duration));
    let served = (nbr.throughput + flood.throughput) * duration.as_secs_f64();
    let cpu = flood.cores * duration.as_secs_f64();
    Steady { served_per_second: nbr.throughput + flood.throughput, cpu_per_served: Duration::from_secs_f64(cpu / served.max(1.0)) }
}

/// One flood row's figures.
struct Row {
    flood: FloodStats,
    neighbour: Measurement,
    /// The process's CPU inside the window, less the flood client's.
    gateway_cpu: Duration,
}

/// The neighbour measured while `flood` runs against the flooder's handler.
async fn flooded(
    flood: Flood,
    (neighbour, flooder, body): (&(SocketAddr, String), &(SocketAddr, String), &Bytes),
    models: &facegate_host_gpu::Models,
    images: &[Bytes],
    duration: Duration,
    side: u32,
) -> Row {
    // The same window as the neighbour's (see `harness::drive`).
    let started = Instant::now();
    let window = (started + WARM_UP, started + WARM_UP + duration);
    let request =
        FloodRequest { url: format!("http://{}/v1/flood/detect?size={side}", flooder.0), key: flooder.1.clone(), body: body.clone() };
    let client = std::thread::spawn(move || run_flood(flood, request, window));
    let cpu = tokio::spawn(async move {
        tokio::time::sleep_until(window.0.into()).await;
        let before = process_cpu();
        tokio::time::sleep_until(window.1.into()).await;
        process_cpu().saturating_sub(before)
    });
    let (measured, _, _) = measure_gateway(neighbour, models, images, NEIGHBOUR_CONCURRENCY, duration, side).await;
    let cpu = cpu.await.unwrap_or_default();
    let flood = tokio::task::spawn_blocking(move || client.join().unwrap_or_default()).await.unwrap_or_default();
    let gateway_cpu = cpu.saturating_sub(flood.client_cpu);
    Row { flood, neighbour: measured.summarize(duration), gateway_cpu }
}

/// What every flood request is.
struct FloodRequest {
    url: String,
    key: String,
    body: Bytes,
}

/// An answer the flood's client had: when its request started and ended, and its status.
type Answered = (Instant, Instant, Result<u16, String>);

/// The flood's client: one connection pool, answers reported on a channel.
#[derive(Clone)]
struct FloodClient {
    client: Client<HttpConnector, Full<Bytes>>,
    request: Arc<FloodRequest>,
    answers: tokio::sync::mpsc::UnboundedSender<Answered>,
    in_flight: Arc<AtomicUsize>,
}

impl FloodClient {
    /// One request, reported when answered.
    fn send(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let this = self.clone();
        this.in_flight.fetch_add(1, Ordering::Relaxed);
        async move {
            let started = Instant::now();
            let status = post(&this.client, &this.request).await;
            this.in_flight.fetch_sub(1, Ordering::Relaxed);
            let _ = this.answers.send((started, Instant::now(), status));
        }
    }
}

/// Runs the flood on this thread (a runtime of its own), counting what ends
/// inside `window`, and the thread's CPU there.
fn run_flood(flood: Flood, request: FloodRequest, window: (Instant, Instant)) -> FloodStats {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return FloodStats::default() };
    runtime.block_on(async {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let pool = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(CLOSED_FLOOD_CLIENTS).build(connector);
        let (sender, mut answers) = tokio::sync::mpsc::unbounded_channel();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let client = FloodClient { client: pool, request: Arc::new(request), answers: sender, in_flight: Arc::clone(&in_flight) };
        let mut skipped = 0;
        let mut cpu_start = None;
        match flood {
            Flood::Open(rate) => {
                let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1.0)));
                while Instant::now() < window.1 {
                    ticks.tick().await;
                    if cpu_start.is_none() && Instant::now() >= window.0 {
                        cpu_start = Some(thread_cpu());
                    }
                    if in_flight.load(Ordering::Relaxed) >= MAX_OPEN_IN_FLIGHT {
                        skipped += 1;
                    } else {
                        tokio::spawn(client.send());
                    }
                }
            }
            Flood::Closed(clients) => {
                for _ in 0..clients {
                    let client = client.clone();
                    tokio::spawn(async move {
                        while Instant::now() < window.1 {
                            client.send().await;
                        }
                    });
                }
                tokio::time::sleep_until(window.0.into()).await;
                cpu_start = Some(thread_cpu());
                tokio::time::sleep_until(window.1.into()).await;
            }
        }
        let client_cpu = thread_cpu().saturating_sub(cpu_start.unwrap_or_default());
        drop(client);
        let mut stats = FloodStats { skipped, client_cpu, ..FloodStats::default() };
        // What is still in flight at the window's end is not waited for.
        let drain = tokio::time::sleep(Duration::from_millis(200));
        tokio::pin!(drain);
        loop {
            tokio::select! {
                answer = answers.recv() => match answer {
                    Some((started, done, status)) if done >= window.0 && done < window.1 => stats.record(status, done - started),
                    Some(_) => {}
                    None => break,
                },
                () = &mut drain => break,
            }
        }
        stats
    })
}

/// Posts the flood's photo; the status, or why no answer came.
async fn post(client: &Client<HttpConnector, Full<Bytes>>, request: &FloodRequest) -> Result<u16, String> {
    let req = hyper::Request::post(&request.url)
        .header(hyper::header::AUTHORIZATION, format!("Bearer {}", request.key))
        .body(Full::new(request.body.clone()))
        .map_err(|e| e.to_string())?;
    let response = client.request(req).await.map_err(|e| format!("{e:?}"))?;
    let status = response.status().as_u16();
    response.into_body().collect().await.map_err(|e| e.to_string())?;
    Ok(status)
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
}

/// The gateway's own CPU per refusal: the flooder's rate set to almost
/// nothing, [`REFUSAL_CLIENTS`] clients post its photo as fast as they are
/// refused (429 before the body is read, as a backlog refusal is), nothing
/// else running; the process's CPU less the client thread's, per refusal.
async fn refusal_cost((addr, key): &(SocketAddr, String), body: &Bytes, duration: Duration) -> anyhow::Result<()> {
    set_rate(*addr, "flood", 0.01).await?;
    let started = Instant::now();
    let window = (started + WARM_UP, started + WARM_UP + duration);
    let request = FloodRequest { url: format!("http://{addr}/v1/flood/detect"), key: key.clone(), body: body.clone() };
    let client = std::thread::spawn(move || run_flood(Flood::Closed(REFUSAL_CLIENTS), request, window));
    tokio::time::sleep_until(window.0.into()).await;
    let before = process_cpu();
    tokio::time::sleep_until(window.1.into()).await;
    let cpu = process_cpu().saturating_sub(before);
    let stats = tokio::task::spawn_blocking(move || client.join().unwrap_or_default()).await.unwrap_or_default();
    let gateway = cpu.saturating_sub(stats.client_cpu);
    println!(
        "refusals alone ({REFUSAL_CLIENTS} clients, 429 before the body): {:.0}/s; gateway CPU {:.0} µs per refusal, client {:.0} µs; {} without answer{}",
        stats.refused as f64 / duration.as_secs_f64(),
        gateway.as_secs_f64() * 1e6 / stats.refused.max(1) as f64,
        stats.client_cpu.as_secs_f64() * 1e6 / stats.refused.max(1) as f64,
        stats.no_answer,
        stats.first_error.map(|e| format!(" (first: {e})")).unwrap_or_default()
    );
    Ok(())
}

/// Sets a tenant's request rate (burst 1) through the admin API.
async fn set_rate(addr: SocketAddr, tenant: &str, rps: f64) -> anyhow::Result<()> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let body = Bytes::from(format!(r#"{{"rps": {rps}, "burst": 1}}"#));
    let req = hyper::Request::patch(format!("http://{addr}/admin/v1/tenants/{tenant}"))
        .header(hyper::header::AUTHORIZATION, format!("Bearer {ADMIN_TOKEN}"))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))?;
    let response = client.request(req).await?;
    anyhow::ensure!(response.status().is_success(), "setting the rate: {}", response.status());
    Ok(())
}

/// One row: the flood's figures, the goodput as a ratio to unflooded, the
/// neighbour's p99 beside the flood (ms, and as a ratio to alone), and the
/// cores the gateway kept busy (the process less the flood's client).
fn print_row(flood: Flood, row: &Row, steady: &Steady, alone: &Measurement, window: Duration) {
    let seconds = window.as_secs_f64();
    let f = &row.flood;
    let served = f.served as f64 / seconds + row.neighbour.throughput;
    let mut refusals = f.refusal_latencies.clone();
    refusals.sort();
    let refusal_p50 = refusals.get(refusals.len() / 2).copied().unwrap_or_default();
    let (label, offered) = match flood {
        Flood::Open(rate) => (format!("open loop {FLOOD_FACTOR:.0}x"), format!("{rate:.0}")),
        Flood::Closed(clients) => {
            let sent = f.served + f.refused + f.timed_out + f.other + f.no_answer;
            (format!("closed loop {clients}"), format!("{:.0}", sent as f64 / seconds))
        }
    };
    println!(
        "{label:<22} {offered:>9} {served:>9.1} {:>7.2} {:>10.0} {:>9.1} {:>6} {:>6} {:>10.0} {:>7.2} {:>10.2}",
        served / steady.served_per_second,
        f.refused as f64 / seconds,
        refusal_p50.as_secs_f64() * 1e3,
        f.timed_out,
        f.other,
        row.neighbour.p99.as_secs_f64() * 1e3,
        row.neighbour.p99.as_secs_f64() / alone.p99.as_secs_f64().max(1e-9),
        row.gateway_cpu.as_secs_f64() / seconds
    );
    if f.no_answer > 0 {
        println!("  {} flood requests got no answer (first: {})", f.no_answer, f.first_error.as_deref().unwrap_or("?"));
    }
    if f.skipped > 0 {
        println!("  the flood's client skipped {} ticks with {MAX_OPEN_IN_FLIGHT} requests in flight", f.skipped);
    }
    if row.neighbour.errors > 0 {
        println!("  {} neighbour requests failed beside the flood", row.neighbour.errors);
    }
    print_failed_clients(row.neighbour.failed_clients);
}

/// A seed directory: `seed_dir`'s tenants plus tenant `flood` serving the
/// seed's `demo/detect.wasm` as `detect`.
fn seed_with_flooder(seed_dir: &Path) -> anyhow::Result<PathBuf> {
    let seed = std::env::temp_dir().join(format!("facegate-bench-overload-seed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&seed);
    let demo = seed_dir.join("demo");
    for (tenant, from) in [("demo", &demo), ("flood", &demo)] {
        std::fs::create_dir_all(seed.join(tenant))?;
        std::fs::copy(from.join("detect.wasm"), seed.join(tenant).join("detect.wasm"))
            .with_context(|| format!("{} (run deploy/scripts/build-guests.sh)", from.join("detect.wasm").display()))?;
    }
    Ok(seed)
}
