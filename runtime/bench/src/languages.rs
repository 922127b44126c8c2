//! `facegate bench --suite languages`: what a handler written in Python or
//! JavaScript costs against the same handler in Rust. For each of
//! `detect` (Rust), `detect-py` and `detect-js` from the seed directory:
//! a deploy through the admin API (link, compile, store), the first request
//! after it, and the median of `--iterations` requests one after another,
//! all on one gateway in one run; ratios to Rust.

use std::net::SocketAddr;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::harness::{BenchConfig, bench_data_dir, start_seeded};

const ADMIN_TOKEN: &str = "bench-admin-token-languages";
/// The bench gateway's label (its throw-away store).
const LABEL: usize = 97;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One language's figures, milliseconds.
struct Figures {
    deploy: f64,
    first: f64,
    warm_p50: f64,
    /// p50 with the tenant's `instance_reuse` at [`REUSE`] (warm instances).
    reused_p50: f64,
}

/// `instance_reuse` of the demo tenant for the reused p50.
const REUSE: u32 = 1000;

/// Runs the suite and prints its table.
pub async fn run(config: &BenchConfig, iterations: usize) -> anyhow::Result<()> {
    let image = Bytes::from(std::fs::read(config.images.first().context("no --image")?)?);
    let models = facegate::load_models(&config.serve.engine)?;
    let (addr, keys, _server) = start_seeded(&config.serve.seed_dir, &config.serve.engine, models, LABEL, |c| {
        c.admin_token = Some(ADMIN_TOKEN.to_owned());
    })
    .await?;
    let key = keys.get("demo").context("the seed has no demo tenant")?.clone();
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    println!("\n== languages: detect in Rust, Python and JavaScript, {iterations} requests one at a time after each deploy ==");
    println!(
        "{:<12} {:>10} {:>10} {:>12} {:>10} {:>12} {:>10} {:>12} {:>10}",
        "handler", "KiB", "deploy ms", "1st req ms", "p50 ms", "p50 / Rust", "+ms/req", "reused p50", "reused/p50"
    );
    let mut rust_p50 = None;
    for handler in ["detect", "detect-py", "detect-js"] {
        let path = config.serve.seed_dir.join("demo").join(format!("{handler}.wasm"));
        let Ok(component) = std::fs::read(&path) else {
            println!("{handler:<12} (no {}: deploy/setup.sh builds it)", path.display());
            continue;
        };
        let kib = component.len() >> 10;
        let figures = measure(&client, addr, &key, handler, component.into(), &image, iterations).await?;
        let base = *rust_p50.get_or_insert(figures.warm_p50);
        println!(
            "{handler:<12} {kib:>10} {:>10.0} {:>12.1} {:>10.1} {:>12.2} {:>10.1} {:>12.1} {:>10.2}",
            figures.deploy,
            figures.first,
            figures.warm_p50,
            figures.warm_p50 / base,
            figures.warm_p50 - base,
            figures.reused_p50,
            figures.reused_p50 / figures.warm_p50
        );
    }
    println!("(reused p50: the same requests with demo's instance_reuse = {REUSE}, warm instances)");
    let _ = std::fs::remove_dir_all(bench_data_dir(LABEL));
    Ok(())
}

async fn measure(
    client: &HttpClient,
    addr: SocketAddr,
    key: &str,
    handler: &str,
    component: Bytes,
    image: &Bytes,
    iterations: usize,
) -> anyhow::Result<Figures> {
    let deploy = Instant::now();
    let upload = hyper::Request::put(format!("http://{addr}/admin/v1/tenants/demo/handlers/{handler}"))
        .header(hyper::header::AUTHORIZATION, format!("Bearer {ADMIN_TOKEN}"))
        .body(Full::new(component))?;
    let response = client.request(upload).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    anyhow::ensure!(status.is_success(), "deploying {handler}: {status} {}", String::from_utf8_lossy(&body));
    let deploy = deploy.elapsed().as_secs_f64() * 1e3;
    let first = call(client, addr, key, handler, image).await?;
    let warm_p50 = p50(client, addr, key, handler, image, iterations).await?;
    set_instance_reuse(client, addr, REUSE).await?;
    let reused_p50 = p50(client, addr, key, handler, image, iterations).await;
    set_instance_reuse(client, addr, 1).await?;
    Ok(Figures { deploy, first, warm_p50, reused_p50: reused_p50? })
}

/// The median wall time of `iterations` requests one at a time, ms.
async fn p50(client: &HttpClient, addr: SocketAddr, key: &str, handler: &str, image: &Bytes, iterations: usize) -> anyhow::Result<f64> {
    let mut times = Vec::with_capacity(iterations);
    for _ in 0..iterations.max(1) {
        times.push(call(client, addr, key, handler, image).await?);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Sets the demo tenant's `instance_reuse` through the admin API.
async fn set_instance_reuse(client: &HttpClient, addr: SocketAddr, reuse: u32) -> anyhow::Result<()> {
    let request = hyper::Request::patch(format!("http://{addr}/admin/v1/tenants/demo"))
        .header(hyper::header::AUTHORIZATION, format!("Bearer {ADMIN_TOKEN}"))
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(format!("{{\"instance_reuse\": {reuse}}}"))))?;
    let response = client.request(request).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    anyhow::ensure!(status.is_success(), "setting instance_reuse: {status} {}", String::from_utf8_lossy(&body));
    Ok(())
}

/// One request's wall time, milliseconds.
async fn call(client: &HttpClient, addr: SocketAddr, key: &str, handler: &str, image: &Bytes) -> anyhow::Result<f64> {
    let request = hyper::Request::post(format!("http://{addr}/v1/demo/{handler}"))
        .header(hyper::header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Full::new(image.clone()))?;
    let started = Instant::now();
    let response = client.request(request).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    anyhow::ensure!(status.is_success(), "demo/{handler} answered {status}: {}", String::from_utf8_lossy(&body));
    Ok(started.elapsed().as_secs_f64() * 1e3)
}
