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

use crate::bench::{BenchConfig, LoopStats, measure_gateway, print_failed_clients, start_seeded};

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
    ("slow bodies", Attack::SlowBody),
    ("idle connections", Attack::Idle),
    ("uploads compiling", Attack::Upload),
];

/// Admin token of the bench's gateway (uploads go through the admin API).
const ADMIN_TOKEN: &str = "bench-admin-token-0123456789";

/// Idle connections each attacker client keeps open.
const IDLE_PER_CLIENT: usize = 256;

/// Concurrency of the neighbour tenant.
const NEIGHBOUR_CONCURRENCY: usize = 4;

#[derive(Clone, Copy)]
enum Attack {
    /// GET `/v1/evil/attack?<query>` in closed loops.
    Query(&'static str),
    /// Uploads that declare a body and send a byte now and then.
    SlowBody,
    /// Connections that never send a byte, reopened when closed.
    Idle,
    /// New versions of a handler uploaded through the admin API, back to back.
    Upload,
}

/// Runs the suite and prints its table.
pub async fn run(config: &BenchConfig, images: &[Bytes], duration: Duration) -> anyhow::Result<()> {
    let seed = seed_with_attacker(&config.serve.seed_dir, &config.hostile)?;
    let upload = config.upload_component.clone().unwrap_or_else(|| seed.join("demo/detect.wasm"));
    let component = Bytes::from(std::fs::read(&upload).with_context(|| format!("reading {}", upload.display()))?);
    let models = crate::load_models(&config.serve.engine)?;
    // The defaults a production gateway runs with, not the bench's wide-open ones.
    let (addr, keys, _server) = start_seeded(&seed, &config.serve.engine, models.clone(), STORE_LABEL, |c| {
        let defaults = crate::config::ServeConfig::with_data_dir(c.data_dir.clone()).expect("defaults parse");
        c.request_timeout_ms = 5_000;
        c.max_instances = defaults.max_instances;
        c.tenant_max_concurrency = defaults.tenant_max_concurrency;
        c.admin_token = Some(ADMIN_TOKEN.to_owned());
    })
    .await?;
    let _ = std::fs::remove_dir_all(&seed);
    let demo = (addr, keys.get("demo").context("no demo tenant")?.clone());
    let evil = keys.get("evil").context("no evil tenant")?.clone();
    let rounds = config.rounds.max(1);
    let round = duration / rounds;
    println!(
        "\n== isolation: neighbour demo/detect at concurrency {NEIGHBOUR_CONCURRENCY} alone vs beside {} attacker clients; {rounds} interleaved rounds of {:.1} s ==",
        config.attackers,
        round.as_secs_f64()
    );
    println!("{:<24} {:>10} {:>10} {:>9} {:>9} {:>9} {:>8}", "attack", "alone r/s", "beside r/s", "tput", "p99 alone", "p99 bes.", "p99");
    measure_gateway(&demo, &models, images, NEIGHBOUR_CONCURRENCY, Duration::from_secs_f64(config.warmup), config.side).await;
    for (name, attack) in ATTACKS.iter().filter(|(name, _)| config.only.as_deref().is_none_or(|only| name.contains(only))) {
        let (mut alone, mut beside) = (LoopStats::default(), LoopStats::default());
        for _ in 0..rounds {
            alone.merge(measure_gateway(&demo, &models, images, NEIGHBOUR_CONCURRENCY, round, config.side).await.0);
            let stop = Arc::new(AtomicBool::new(false));
            let attackers = start_attack(*attack, addr, &evil, &component, config.attackers, &stop);
            beside.merge(measure_gateway(&demo, &models, images, NEIGHBOUR_CONCURRENCY, round, config.side).await.0);
            stop.store(true, Ordering::SeqCst);
            for task in attackers {
                task.abort();
            }
        }
        let (a, b) = (alone.summarize(round * rounds), beside.summarize(round * rounds));
        println!(
            "{name:<24} {:>10.2} {:>10.2} {:>9.3} {:>9.1} {:>9.1} {:>8.3}",
            a.throughput,
            b.throughput,
            b.throughput / a.throughput,
            a.p99.as_secs_f64() * 1e3,
            b.p99.as_secs_f64() * 1e3,
            b.p99.as_secs_f64() / a.p99.as_secs_f64()
        );
        if b.errors > 0 {
            println!("  {} neighbour requests failed beside this attack", b.errors);
        }
        print_failed_clients(a.failed_clients + b.failed_clients);
    }
    let _ = std::fs::remove_dir_all(crate::bench::bench_data_dir(STORE_LABEL));
    Ok(())
}

/// Label of this suite's gateway store (kept while it runs: uploads write to it).
const STORE_LABEL: usize = 99;

/// A seed directory: `seed_dir`'s tenants plus tenant `evil` serving `hostile` as `attack`.
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
    std::fs::create_dir_all(seed.join("evil"))?;
    std::fs::copy(hostile, seed.join("evil/attack.wasm"))
        .with_context(|| format!("{} (run deploy/scripts/build-guests.sh)", hostile.display()))?;
    Ok(seed)
}

fn start_attack(
    attack: Attack,
    addr: SocketAddr,
    key: &str,
    component: &Bytes,
    clients: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|_| {
            let (stop, key, component) = (Arc::clone(stop), key.to_owned(), component.clone());
            tokio::spawn(async move {
                match attack {
                    Attack::Query(query) => query_loop(addr, &key, query, &stop).await,
                    Attack::SlowBody => slow_body_loop(addr, &key, &stop).await,
                    Attack::Idle => idle_loop(addr, &stop).await,
                    Attack::Upload => upload_loop(addr, component, &stop).await,
                }
            })
        })
        .collect()
}

async fn query_loop(addr: SocketAddr, key: &str, query: &str, stop: &AtomicBool) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let url = format!("http://{addr}/v1/evil/attack?{query}");
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
        let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if stream.write_all(head.as_bytes()).await.is_err() {
            continue;
        }
        while !stop.load(Ordering::SeqCst) && stream.write_all(b"x").await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Keeps [`IDLE_PER_CLIENT`] silent connections open, replacing those the gateway closes.
async fn idle_loop(addr: SocketAddr, stop: &AtomicBool) {
    let mut open: Vec<tokio::net::TcpStream> = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        // A closed connection reads as ready (EOF); keep the rest.
        open.retain(|s| s.try_read(&mut [0u8; 1]).is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock));
        while open.len() < IDLE_PER_CLIENT {
            match tokio::net::TcpStream::connect(addr).await {
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
