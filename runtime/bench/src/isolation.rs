//! `facegate bench --suite isolation`: a neighbour tenant's throughput and
//! p99 latency while a hostile tenant attacks, as ratios to the same
//! neighbour without an attacker, measured in interleaved rounds of one run.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::AsyncWriteExt;

use crate::harness::{BenchConfig, LoopStats, Measurement, measure_gateway, print_failed_clients, start_seeded};

/// The attacks, each a query of the hostile handler, or a connection-level attack.
const ATTACKS: &[(&str, Attack)] = &[
    ("infinite loop", Attack::Query("attack=loop")),
    ("memory bomb", Attack::Query("attack=memory")),
    ("header fields hoard", Attack::Query("attack=fields")),
    ("response bodies hoard", Attack::Query("attack=bodies")),
    ("wasi:random loop", Attack::Query("attack=random-loop")),
    ("stderr flood", Attack::Query("attack=stderr")),
    ("sleeping handlers", Attack::Query("attack=sleep")),
    ("1280² tensors", Attack::Query("attack=big-tensor&side=1280&n=2")),
    ("memory holders, 1 tenant", Attack::Hold { tenants: 1 }),
    ("memory holders, 2 tenants", Attack::Hold { tenants: 2 }),
    ("slow bodies", Attack::SlowBody),
    ("idle connections", Attack::Idle),
    ("uploads compiling", Attack::Upload),
    ("stalled uploads, 1 tenant", Attack::StalledUploads { tenants: 1 }),
    ("stalled uploads, 4 tenants", Attack::StalledUploads { tenants: 4 }),
    ("key churn", Attack::KeyChurn),
    ("stalled log readers", Attack::StalledLogReaders),
];

/// The hostile tenants the seed adds (the first two also have keys in use).
const HOSTILE_TENANTS: [&str; 4] = ["evil", "evil2", "evil3", "evil4"];

/// What each stalled upload declares: the default largest component.
const STALLED_UPLOAD_BYTES: usize = 64 << 20;

/// Admin token of the bench's gateway (uploads go through the admin API).
const ADMIN_TOKEN: &str = "bench-admin-token-0123456789";

/// Idle connections each attacker client keeps open.
const IDLE_PER_CLIENT: usize = 256;

/// Concurrency of the neighbour tenant.
const NEIGHBOUR_CONCURRENCY: usize = 4;

/// The bench gateway's memory budget: about what a 4 GiB pod gets
/// (deploy/k8s), so the memory holders press on it.
const MEMORY_BUDGET_MIB: u64 = 2048;

/// What each memory holder holds, and for how long: inside a tenant's
/// default 256 MiB, the budget's business only in aggregate.
const HOLD_QUERY: &str = "attack=hold&mib=240&ms=2000";

#[derive(Clone, Copy)]
enum Attack {
    /// GET `/v1/evil/attack?<query>` in closed loops.
    Query(&'static str),
    /// [`HOLD_QUERY`] in closed loops, the clients split among `tenants`
    /// hostile tenants (`evil`, `evil2`).
    Hold { tenants: usize },
    /// Uploads that declare a body and send a byte now and then.
    SlowBody,
    /// Connections that never send a byte, reopened when closed.
    Idle,
    /// New versions of a handler uploaded through the admin API, back to back.
    Upload,
    /// Uploads of [`STALLED_UPLOAD_BYTES`] through the admin API, the
    /// clients split among `tenants` hostile tenants, each sending all but
    /// its last byte and then waiting; refused ones try again at once.
    StalledUploads { tenants: usize },
    /// Keys of `evil` created and revoked through the admin API, back to back.
    KeyChurn,
    /// [`STALLED_READERS`] clients follow `evil`'s log and never read (a
    /// new follow every [`STALLED_READER_EVERY`]); the others fill it with
    /// `attack=stderr`.
    StalledLogReaders,
}

/// Followers of the hostile tenant's log that never read: a tenant's
/// followers on a node at most.
const STALLED_READERS: usize = 8;

/// How long each stalled follower holds its connection before opening
/// another: past the gateway's write timeout for log readers (10 s).
const STALLED_READER_EVERY: Duration = Duration::from_secs(15);

/// Runs the suite and prints its table.
pub async fn run(config: &BenchConfig, images: &[Bytes], duration: Duration) -> anyhow::Result<()> {
    let seed = seed_with_attacker(&config.serve.seed_dir, &config.hostile)?;
    let upload = config.upload_component.clone().unwrap_or_else(|| seed.join("demo/detect.wasm"));
    let component = Bytes::from(std::fs::read(&upload).with_context(|| format!("reading {}", upload.display()))?);
    let models = facegate::load_models(&config.serve.engine)?;
    // The defaults a production gateway runs with, not the bench's wide-open ones.
    let (addr, keys, _server) = start_seeded(&seed, &config.serve.engine, models.clone(), STORE_LABEL, |c| {
        c.limits.timeout_ms = 5_000;
        c.max_instances = facegate::config::DEFAULT_MAX_INSTANCES;
        c.limits.max_concurrency = facegate::admission::limits::DEFAULT_TENANT_MAX_CONCURRENCY;
        c.memory_budget_mib = Some(MEMORY_BUDGET_MIB);
        c.admin_token = Some(ADMIN_TOKEN.to_owned());
    })
    .await?;
    let _ = std::fs::remove_dir_all(&seed);
    let demo = (addr, keys.get("demo").context("no demo tenant")?.clone());
    let evil =
        ["evil", "evil2"].map(|t| keys.get(t).cloned().context("no hostile tenant")).into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let rounds = config.rounds.max(1);
    let round = duration / rounds;
    println!(
        "\n== isolation: neighbour demo/detect at concurrency {NEIGHBOUR_CONCURRENCY} alone vs beside {} attacker clients; {rounds} interleaved rounds of {:.1} s; memory budget {MEMORY_BUDGET_MIB} MiB ==",
        config.attackers,
        round.as_secs_f64()
    );
    println!(
        "{:<26} {:>10} {:>10} {:>9} {:>9} {:>9} {:>8} {:>9}",
        "attack", "alone r/s", "beside r/s", "tput", "p99 alone", "p99 bes.", "p99", "RSS +MiB"
    );
    measure_gateway(&demo, &models, images, NEIGHBOUR_CONCURRENCY, Duration::from_secs_f64(config.warmup), config.side).await;
    for (name, attack) in ATTACKS.iter().filter(|(name, _)| config.only.as_deref().is_none_or(|only| name.contains(only))) {
        let (mut alone, mut beside, mut growth) = (LoopStats::default(), LoopStats::default(), 0);
        for _ in 0..rounds {
            alone.merge(measure_gateway(&demo, &models, images, NEIGHBOUR_CONCURRENCY, round, config.side).await.0);
            let stop = Arc::new(AtomicBool::new(false));
            let rss = RssPeak::start(&stop);
            let attackers = start_attack(*attack, addr, &evil, &component, config.attackers, &stop);
            beside.merge(measure_gateway(&demo, &models, images, NEIGHBOUR_CONCURRENCY, round, config.side).await.0);
            stop.store(true, Ordering::SeqCst);
            for task in attackers {
                task.abort();
            }
            growth = growth.max(rss.growth_mib());
        }
        print_comparison(name, (&alone.summarize(round * rounds), &beside.summarize(round * rounds)), Some(growth));
    }
    if config.only.as_deref().is_none_or(|only| HOARDING.contains(only)) {
        connection_hoarding(&demo, &models, images, config, round).await?;
    }
    let _ = std::fs::remove_dir_all(crate::harness::bench_data_dir(STORE_LABEL));
    Ok(())
}

/// One row of the table: the neighbour `alone` and `beside` an attack, the
/// ratios beside ÷ alone, then any failed neighbour requests or clients.
/// `rss_growth_mib`: the bench process's (the gateway's) peak RSS beside the attack over before it, if measured.
fn print_comparison(name: &str, (alone, beside): (&Measurement, &Measurement), rss_growth_mib: Option<u64>) {
    let rss = rss_growth_mib.map_or_else(|| "-".to_owned(), |g| g.to_string());
    println!(
        "{name:<26} {:>10.2} {:>10.2} {:>9.3} {:>9.1} {:>9.1} {:>8.3} {rss:>9}",
        alone.throughput,
        beside.throughput,
        beside.throughput / alone.throughput,
        alone.p99.as_secs_f64() * 1e3,
        beside.p99.as_secs_f64() * 1e3,
        beside.p99.as_secs_f64() / alone.p99.as_secs_f64()
    );
    if beside.errors > 0 {
        println!("  {} neighbour requests failed beside this attack", beside.errors);
    }
    print_failed_clients(alone.failed_clients + beside.failed_clients);
}

/// Label of this suite's gateway store (kept while it runs: uploads write to it).
const STORE_LABEL: usize = 99;

/// A seed directory: `seed_dir`'s tenants plus tenants `evil` and `evil2` serving `hostile` as `attack`.
fn seed_with_attacker(seed_dir: &Path, hostile: &Path) -> anyhow::Result<std::path::PathBuf> {
    let seed = std::env::temp_dir().join(format!("facegate-bench-seed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&seed);
    for tenant in std::fs::read_dir(seed_dir).with_context(|| format!("reading {}", seed_dir.display()))? {
        let tenant = tenant?;
        if !tenant.file_type()?.is_dir() {
            continue;
        }
        let to = seed.join(tenant.file_name());
        std::fs::create_dir_all(&to)?;
        for handler in std::fs::read_dir(tenant.path())? {
            let handler = handler?;
            std::fs::copy(handler.path(), to.join(handler.file_name()))?;
        }
    }
    for tenant in HOSTILE_TENANTS {
        std::fs::create_dir_all(seed.join(tenant))?;
        std::fs::copy(hostile, seed.join(tenant).join("attack.wasm"))
            .with_context(|| format!("{} (run deploy/scripts/build-guests.sh)", hostile.display()))?;
    }
    Ok(seed)
}

/// Starts `clients` attacker tasks; `keys` are the hostile tenants' (`evil`, `evil2`).
fn start_attack(
    attack: Attack,
    addr: SocketAddr,
    keys: &[String],
    component: &Bytes,
    clients: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|i| {
            let tenant = match attack {
                Attack::Hold { tenants } => i % tenants.clamp(1, keys.len()),
                Attack::StalledUploads { tenants } => i % tenants.clamp(1, HOSTILE_TENANTS.len()),
                _ => 0,
            };
            let (stop, key, component) = (Arc::clone(stop), keys[tenant.min(keys.len() - 1)].clone(), component.clone());
            let name = HOSTILE_TENANTS[tenant];
            tokio::spawn(async move {
                match attack {
                    Attack::Query(query) => query_loop(addr, (name, &key), query, &stop).await,
                    Attack::Hold { .. } => query_loop(addr, (name, &key), HOLD_QUERY, &stop).await,
                    Attack::SlowBody => slow_body_loop(addr, &key, &stop).await,
                    Attack::Idle => idle_loop(addr, &stop).await,
                    Attack::Upload => upload_loop(addr, component, &stop).await,
                    Attack::StalledUploads { .. } => stalled_upload_loop(addr, name, &stop).await,
                    Attack::KeyChurn => key_churn_loop(addr, &stop).await,
                    Attack::StalledLogReaders if i < STALLED_READERS => stalled_reader_loop(addr, &stop).await,
                    Attack::StalledLogReaders => query_loop(addr, (name, &key), "attack=stderr", &stop).await,
                }
            })
        })
        .collect()
}

async fn query_loop(addr: SocketAddr, (tenant, key): (&str, &str), query: &str, stop: &AtomicBool) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let url = format!("http://{addr}/v1/{tenant}/attack?{query}");
    while !stop.load(Ordering::SeqCst) {
        let Ok(req) = hyper::Request::get(&url).header(hyper::header::AUTHORIZATION, format!("Bearer {key}")).body(Full::default()) else {
            return;
        };
        match client.request(req).await {
            Ok(resp) => {
                let _ = resp.into_body().collect().await;
            }
            // Refused connections and the like: back off a little.
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Opens uploads of a declared 1 MB and sends a byte every 100 ms until the
/// gateway gives up on them, then opens the next.
async fn slow_body_loop(addr: SocketAddr, key: &str, stop: &AtomicBool) {
    let head = format!(
        "POST /v1/evil/attack?attack=snoop HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {key}\r\nContent-Length: 1000000\r\n\r\n"
    );
    while !stop.load(Ordering::SeqCst) {
        let Some(mut stream) = open_with_head(addr, &head).await else { continue };
        while !stop.load(Ordering::SeqCst) && stream.write_all(b"x").await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A connection to `addr` that has sent `head`; `None` (after a short
/// pause when the connection was refused) when either failed.
async fn open_with_head(addr: SocketAddr, head: &str) -> Option<tokio::net::TcpStream> {
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        tokio::time::sleep(Duration::from_millis(10)).await;
        return None;
    };
    stream.write_all(head.as_bytes()).await.ok()?;
    Some(stream)
}

/// Keeps [`IDLE_PER_CLIENT`] silent connections open, replacing those the gateway closes.
async fn idle_loop(addr: SocketAddr, stop: &AtomicBool) {
    let mut open: Vec<tokio::net::TcpStream> = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        // A closed connection reads as ready (EOF); keep the rest.
        open.retain(|s| s.try_read(&mut [0u8; 1]).is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock));
        while open.len() < IDLE_PER_CLIENT {
            // Spread over addresses of their own: the neighbour's (127.0.0.1)
            // per-address cap is not the attacker's to fill.
            let source = std::net::Ipv4Addr::new(127, 0, 2, 1 + (open.len() % 250) as u8);
            match connect_from(source.into(), addr).await {
                Ok(stream) => open.push(stream),
                Err(_) => break,
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Uploads `component` as new versions of `evil/uploaded` (not activated), back to back.
async fn upload_loop(addr: SocketAddr, component: Bytes, stop: &AtomicBool) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let url = format!("http://{addr}/admin/v1/tenants/evil/handlers/uploaded?activate=false");
    while !stop.load(Ordering::SeqCst) {
        let request = hyper::Request::put(&url).header(hyper::header::AUTHORIZATION, format!("Bearer {ADMIN_TOKEN}"));
        let Ok(req) = request.body(Full::new(component.clone())) else { return };
        match client.request(req).await {
            Ok(resp) => {
                let _ = resp.into_body().collect().await;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Opens an upload of [`STALLED_UPLOAD_BYTES`] to `tenant` through the admin
/// API; refused before its body, opens the next at once; admitted, sends
/// all but its last byte and waits until the gateway gives up on it.
async fn stalled_upload_loop(addr: SocketAddr, tenant: &str, stop: &AtomicBool) {
    let head = format!(
        "PUT /admin/v1/tenants/{tenant}/handlers/stalled HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: {STALLED_UPLOAD_BYTES}\r\n\r\n"
    );
    let chunk = vec![0u8; 1 << 20];
    while !stop.load(Ordering::SeqCst) {
        let Some(mut stream) = open_with_head(addr, &head).await else { continue };
        // An answer before the body is a refusal; none within 100 ms, admitted.
        let mut answer = [0u8; 512];
        if let Ok(read) = tokio::time::timeout(Duration::from_millis(100), tokio::io::AsyncReadExt::read(&mut stream, &mut answer)).await {
            if read.is_ok_and(|n| n > 0) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            continue;
        }
        let mut left = STALLED_UPLOAD_BYTES - 1;
        while left > 0 && !stop.load(Ordering::SeqCst) {
            let n = left.min(chunk.len());
            if stream.write_all(&chunk[..n]).await.is_err() {
                break;
            }
            left -= n;
        }
        while !stop.load(Ordering::SeqCst) && stream.try_read(&mut answer).is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Creates a key of `evil` and revokes it, back to back, through the admin API.
async fn key_churn_loop(addr: SocketAddr, stop: &AtomicBool) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let keys = format!("http://{addr}/admin/v1/tenants/evil/keys");
    while !stop.load(Ordering::SeqCst) {
        let request = hyper::Request::post(&keys).header(hyper::header::AUTHORIZATION, format!("Bearer {ADMIN_TOKEN}"));
        let Ok(req) = request.body(Full::default()) else { return };
        let Ok(resp) = client.request(req).await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let id = serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|v| v["id"].as_str().map(str::to_owned));
        let Some(id) = id else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let request = hyper::Request::delete(format!("{keys}/{id}")).header(hyper::header::AUTHORIZATION, format!("Bearer {ADMIN_TOKEN}"));
        if let Ok(req) = request.body(Full::default()) {
            let _ = client.request(req).await.map(|resp| resp.into_body().collect());
        }
    }
}

/// Follows `evil`'s log with a read key of its own and never reads the
/// answer; opens another follow every [`STALLED_READER_EVERY`].
async fn stalled_reader_loop(addr: SocketAddr, stop: &AtomicBool) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let request = hyper::Request::post(format!("http://{addr}/admin/v1/tenants/evil/keys"))
        .header(hyper::header::AUTHORIZATION, format!("Bearer {ADMIN_TOKEN}"))
        .body(Full::from(r#"{"scopes":["read"]}"#));
    let Ok(request) = request else { return };
    let Ok(resp) = client.request(request).await else { return };
    let body = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let Some(key) = serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|v| v["key"].as_str().map(str::to_owned)) else {
        return;
    };
    let head = format!("GET /tenant/v1/logs?follow=true HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {key}\r\n\r\n");
    while !stop.load(Ordering::SeqCst) {
        // Held open, never read, until the next.
        let Some(_stream) = open_with_head(addr, &head).await else { continue };
        let opened = std::time::Instant::now();
        while !stop.load(Ordering::SeqCst) && opened.elapsed() < STALLED_READER_EVERY {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The peak resident memory of this process (the gateway runs in it) over
/// what it was when sampling started, sampled every 10 ms until `stop`.
struct RssPeak {
    before: u64,
    peak: Arc<std::sync::atomic::AtomicU64>,
}

impl RssPeak {
    fn start(stop: &Arc<AtomicBool>) -> Self {
        let (before, peak) = (rss_mib(), Arc::new(std::sync::atomic::AtomicU64::new(0)));
        let (stop, sampled) = (Arc::clone(stop), Arc::clone(&peak));
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                sampled.fetch_max(rss_mib(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        Self { before, peak }
    }

    fn growth_mib(&self) -> u64 {
        self.peak.load(Ordering::SeqCst).saturating_sub(self.before)
    }
}

/// This process's resident memory, MiB (0 where /proc is not there).
fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
    kib.unwrap_or(0) / 1024
}

/// The connection-hoarding row (`--only` matches its name).
const HOARDING: &str = "connection hoarding";

/// Connections one address keeps busy (`GET /healthz` every
/// [`HOARD_REQUEST_EVERY`]): as many as the issue's attacker opened, more
/// than a listener's default slots, so far more than the address's cap.
const HOARD_BUSY: usize = 4200;

/// How often each busy hoarded connection sends a request.
const HOARD_REQUEST_EVERY: Duration = Duration::from_secs(5);

/// Idle keep-alive connections (one request each, then silence), from
/// addresses of their own, each taking its cap's worth: more than a
/// listener's default slots.
const HOARD_IDLE: usize = 4400;

/// How long a hoarding client waits before reopening a closed connection.
const HOARD_REOPEN_AFTER: Duration = Duration::from_millis(500);

/// Newcomers from another address timed while the listener is full.
const NEWCOMER_PROBES: usize = 20;

/// The neighbour (from 127.0.0.1) alone vs beside one address keeping
/// [`HOARD_BUSY`] connections busy and others filling the listener with
/// [`HOARD_IDLE`] idle keep-alives; then whether newcomers from 127.0.0.2
/// are served, and how fast. Each round reopens the hoard.
async fn connection_hoarding(
    demo: &(SocketAddr, String),
    models: &facegate_host_gpu::Models,
    images: &[Bytes],
    config: &BenchConfig,
    round: Duration,
) -> anyhow::Result<()> {
    let addr = demo.0;
    // Both ends of every connection are in this process.
    let gateway = facegate::http::open_files::descriptors_needed(
        facegate::config::DEFAULT_MAX_CONNECTIONS,
        facegate::sandbox::outgoing::DEFAULT_MAX_CONNECTIONS,
        facegate::http::open_files::Listeners::Shared,
    );
    let needed = gateway + (HOARD_BUSY + HOARD_IDLE) as u64;
    let soft = facegate::http::open_files::raise_soft_limit(needed)?;
    if soft.is_some_and(|soft| soft < needed) {
        println!("{HOARDING:<24} skipped: the open-file limit is {soft:?}, {needed} needed (raise ulimit -Hn)");
        return Ok(());
    }
    let (mut alone, mut beside, mut newcomers, mut filled) = (LoopStats::default(), LoopStats::default(), Vec::new(), usize::MAX);
    for _ in 0..config.rounds.max(1) {
        alone.merge(measure_gateway(demo, models, images, NEIGHBOUR_CONCURRENCY, round, config.side).await.0);
        let idle = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let hoard = start_hoard(addr, &idle);
        filled = filled.min(wait_until_filled(&idle).await);
        beside.merge(measure_gateway(demo, models, images, NEIGHBOUR_CONCURRENCY, round, config.side).await.0);
        for _ in 0..NEWCOMER_PROBES {
            newcomers.push(newcomer(addr).await);
        }
        for task in hoard {
            task.abort();
        }
    }
    let window = round * config.rounds.max(1);
    print_comparison(HOARDING, (&alone.summarize(window), &beside.summarize(window)), None);
    let mut served: Vec<Duration> = newcomers.iter().filter_map(|n| n.as_ref().ok().copied()).collect();
    served.sort();
    let refused: Vec<&String> = newcomers.iter().filter_map(|n| n.as_ref().err()).collect();
    let ms = |d: Option<&Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
    println!(
        "  newcomers from 127.0.0.2: {}/{} served, p50 {:.1} ms, max {:.1} ms (the listener held at least {filled} idle keep-alives each round; {HOARD_BUSY} busy ones tried from one address)",
        served.len(),
        newcomers.len(),
        ms(served.get(served.len() / 2)),
        ms(served.last())
    );
    if !refused.is_empty() {
        println!("  newcomers not served: {refused:?}");
    }
    Ok(())
}

/// Starts the hoard: one task per connection. `idle` counts the idle ones open.
fn start_hoard(addr: SocketAddr, idle: &Arc<std::sync::atomic::AtomicUsize>) -> Vec<tokio::task::JoinHandle<()>> {
    let busy = (0..HOARD_BUSY).map(|_| tokio::spawn(hoard_busy(addr)));
    // Each address its cap's worth (the bench gateway runs the defaults).
    let per_address = match facegate::config::DEFAULT_MAX_CONNECTIONS_PER_IP as usize {
        0 => HOARD_IDLE,
        cap => cap,
    };
    let idle = (0..HOARD_IDLE).map(|i| {
        let source = std::net::Ipv4Addr::new(127, 0, 1 + (i / per_address / 250) as u8, 1 + (i / per_address % 250) as u8);
        tokio::spawn(hoard_idle(source.into(), addr, Arc::clone(idle)))
    });
    busy.chain(idle).collect()
}

/// Waits (at most 30 s) until the idle hoard holds every slot the busy
/// address's cap leaves; how many it held at most.
async fn wait_until_filled(idle: &std::sync::atomic::AtomicUsize) -> usize {
    let full = (facegate::config::DEFAULT_MAX_CONNECTIONS - facegate::config::DEFAULT_MAX_CONNECTIONS_PER_IP) as usize;
    let mut most = 0;
    for _ in 0..120 {
        most = most.max(idle.load(Ordering::SeqCst));
        if most >= full {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    most
}

/// One connection from 127.0.0.3 sending `GET /healthz` every
/// [`HOARD_REQUEST_EVERY`], reopened whenever the gateway closes it.
async fn hoard_busy(addr: SocketAddr) {
    let source = std::net::Ipv4Addr::new(127, 0, 0, 3).into();
    loop {
        if let Ok(mut stream) = connect_from(source, addr).await {
            while healthz(&mut stream).await {
                tokio::time::sleep(HOARD_REQUEST_EVERY).await;
            }
        }
        tokio::time::sleep(HOARD_REOPEN_AFTER).await;
    }
}

/// One keep-alive connection from `source`: a request, then silence until
/// the gateway closes it; reopened then.
async fn hoard_idle(source: std::net::IpAddr, addr: SocketAddr, idle: Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::AsyncReadExt;
    loop {
        if let Ok(mut stream) = connect_from(source, addr).await
            && healthz(&mut stream).await
        {
            idle.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 256];
            while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
            idle.fetch_sub(1, Ordering::SeqCst);
        }
        tokio::time::sleep(HOARD_REOPEN_AFTER).await;
    }
}

/// A tenant request (`GET /v1/models`) on a new connection from 127.0.0.2:
/// how long it took to be served, or what came instead (a status line,
/// `closed`, `timeout`).
async fn newcomer(addr: SocketAddr) -> Result<Duration, String> {
    use tokio::io::AsyncReadExt;
    let started = std::time::Instant::now();
    let mut stream = connect_from(std::net::Ipv4Addr::new(127, 0, 0, 2).into(), addr).await.map_err(|e| e.to_string())?;
    let request = b"GET /v1/models HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n";
    let mut response = Vec::new();
    let exchange = async {
        stream.write_all(request).await?;
        stream.read_to_end(&mut response).await
    };
    match tokio::time::timeout(Duration::from_secs(10), exchange).await {
        Err(_) => return Err("timeout".to_owned()),
        Ok(Err(_)) if response.is_empty() => return Err("closed".to_owned()),
        Ok(_) => {}
    }
    match response.starts_with(b"HTTP/1.1 200") {
        true => Ok(started.elapsed()),
        false => Err(String::from_utf8_lossy(response.split(|&b| b == b'\r').next().unwrap_or_default()).into_owned()),
    }
}

/// `GET /healthz` on `stream`; whether it was answered 200.
async fn healthz(stream: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    if stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n").await.is_err() {
        return false;
    }
    let mut buf = [0u8; 1024];
    matches!(stream.read(&mut buf).await, Ok(n) if n > 0 && buf.starts_with(b"HTTP/1.1 200"))
}

/// A TCP connection to `addr` from the loopback address `source`.
async fn connect_from(source: std::net::IpAddr, addr: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(source, 0))?;
    socket.connect(addr).await
}
