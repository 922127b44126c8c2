//! `--suite state`: handlers' state (`wasi:keyvalue`, see `facegate::kv`).
//!
//! 1. A key's `set` and `get` on the state's own pool of connections (what
//!    a handler's call waits for, without the guest and HTTP around it), on
//!    the single node's SQLite file and on a throw-away PostgreSQL (when one
//!    can start here: `postgresql-15`), `concurrency` loops each, one
//!    tenant: p50 and p99. A tenant's writes queue on its totals row (see
//!    `facegate::kv`), so `set` shows the cost of that order.
//! 2. One image posted again and again to `detect-cached` (answered from
//!    the tenant's state after the first time) and to `detect` (inference
//!    every time), through the gateway, rounds interleaved: the ratio of
//!    their throughputs is what the cache saves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use facegate::admission::limits::LimitOverrides;
use facegate::kv::{KvPool, Owner, Quota};

use crate::harness::{BenchConfig, LoopStats, Measurement, drive, start_seeded};

/// The caching example, where `deploy/scripts/build-guests.sh` leaves it.
const CACHED_GUEST: &str = "guests/target/wasm32-wasip2/release/detect_cached.wasm";
/// The plain example.
const DETECT_GUEST: &str = "guests/target/wasm32-wasip2/release/detect.wasm";
/// The bench gateway's throw-away store.
const LABEL: usize = 5000;
/// Bounds that no loop here reaches.
const QUOTA: Quota = Quota { keys: 1 << 30, bytes: 1 << 40, value_bytes: 1 << 20 };
/// Keys the loops cycle through, and each value's size.
const KEYS: usize = 1000;
const VALUE_BYTES: usize = 1024;
/// Connections of each pool (the gateway's default `--state-connections`).
const WORKERS: usize = 8;

/// Runs the suite and prints its tables.
pub async fn run(config: &BenchConfig, images: &[Bytes], duration: Duration) -> anyhow::Result<()> {
    println!(
        "\n== state: a key's set and get on the state's connections ({WORKERS}; one tenant, {VALUE_BYTES}-byte values, {KEYS} keys) =="
    );
    println!("{:<34} {:>5} {:>10} {:>9} {:>9}", "store, operation", "conc", "ops/s", "p50 µs", "p99 µs");
    let sqlite_dir = scratch("sqlite");
    let sqlite = facegate::control::store::open(None, &sqlite_dir)?;
    let owner = tenant(sqlite, "bench")?;
    let pool = KvPool::sqlite(sqlite_dir.join(facegate::control::store::DB_FILE), WORKERS)?;
    pool_rows("sqlite", &pool, &owner, config, duration).await;
    match facegate_throwaway_pg::ThrowawayPostgres::start() {
        Ok(pg) => {
            let store = facegate::control::store::open(Some(&pg.url()), &sqlite_dir)?;
            let owner = tenant(store, "bench")?;
            let pool = KvPool::postgres(facegate::control::store::postgres::client_config(&pg.url())?, WORKERS)?;
            pool_rows("postgres (fsync off)", &pool, &owner, config, duration).await;
        }
        Err(e) => println!("(no PostgreSQL here, its rows are left out: {e:#})"),
    }
    let _ = std::fs::remove_dir_all(&sqlite_dir);
    let image = images.first().context("no image to post")?.clone();
    cached_vs_plain(config, image, duration).await
}

/// A fresh directory for a throw-away store.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("facegate-bench-{}-state-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Creates `name` in `store`; whose state it is.
fn tenant(mut store: Box<dyn facegate::control::store::Store>, name: &str) -> anyhow::Result<Owner> {
    store.create_tenant(name, &LimitOverrides::default())?;
    let row = store.tenant(name)?;
    Ok(Owner { tenant: name.into(), incarnation: row.incarnation.into() })
}

/// The set and get rows of one store at each concurrency level.
async fn pool_rows(store: &str, pool: &Arc<KvPool>, owner: &Owner, config: &BenchConfig, duration: Duration) {
    for &c in &config.concurrency {
        let set = kv_loop(pool, owner, c, duration, true).await.summarize(duration);
        print_row(&format!("{store}, set"), c, &set);
        let get = kv_loop(pool, owner, c, duration, false).await.summarize(duration);
        print_row(&format!("{store}, get"), c, &get);
    }
}

/// `concurrency` loops of `set` (or `get`) of the keys in turn.
async fn kv_loop(pool: &Arc<KvPool>, owner: &Owner, concurrency: usize, duration: Duration, set: bool) -> LoopStats {
    let (pool, owner) = (Arc::clone(pool), owner.clone());
    let value = Arc::new(vec![b'v'; VALUE_BYTES]);
    drive(concurrency, duration, move |i| {
        let (pool, owner, value) = (Arc::clone(&pool), owner.clone(), Arc::clone(&value));
        async move {
            let key = format!("k{}", i % KEYS);
            let deadline = Instant::now() + Duration::from_secs(30);
            let tenant = Arc::clone(&owner.tenant);
            if set {
                let items = [(key, value.to_vec())];
                pool.run(&tenant, deadline, move |conn| facegate::kv::set_many(conn, &owner, QUOTA, "bench", &items)).await.is_ok()
            } else {
                pool.run(&tenant, deadline, move |conn| conn.entries(&owner, "bench", &[key], QUOTA.value_bytes)).await.is_ok()
            }
        }
    })
    .await
}

/// The same image through `detect-cached` and `detect`, rounds interleaved.
async fn cached_vs_plain(config: &BenchConfig, image: Bytes, duration: Duration) -> anyhow::Result<()> {
    let seed = scratch("seed");
    std::fs::create_dir_all(seed.join("bench"))?;
    for (guest, handler) in [(CACHED_GUEST, "detect-cached"), (DETECT_GUEST, "detect")] {
        std::fs::copy(guest, seed.join(format!("bench/{handler}.wasm")))
            .with_context(|| format!("{guest} (build it with deploy/scripts/build-guests.sh, from the repository root)"))?;
    }
    let models = facegate::load_models(&config.serve.engine)?;
    let (addr, keys, _server) = start_seeded(&seed, &config.serve.engine, models, LABEL, |_| {}).await?;
    let _ = std::fs::remove_dir_all(&seed);
    let key = keys.get("bench").context("no bench tenant seeded")?.clone();
    let url = |handler: &str| format!("http://{addr}/v1/bench/{handler}?size={}", config.side);
    let (cached, plain) = ((url("detect-cached"), key.clone()), (url("detect"), key));
    let rounds = config.rounds.max(1);
    println!(
        "\n== state: one image again and again, detect-cached (answered from the state) vs detect (inference each time), {rounds} rounds =="
    );
    println!("{:<34} {:>5} {:>10} {:>9} {:>9} {:>8}", "handler", "conc", "req/s", "p50 µs", "p99 µs", "ratio");
    for &c in &config.concurrency {
        let warmup = Duration::from_secs_f64(config.warmup);
        post_loop(&cached, &image, c, warmup).await;
        post_loop(&plain, &image, c, warmup).await;
        let mut worst = f64::INFINITY;
        for round in 1..=rounds {
            let hit = post_loop(&cached, &image, c, duration).await.summarize(duration);
            let inferred = post_loop(&plain, &image, c, duration).await.summarize(duration);
            let ratio = hit.throughput / inferred.throughput;
            worst = worst.min(ratio);
            print_ratio_row(&format!("detect-cached, round {round}"), c, &hit, Some(ratio));
            print_ratio_row(&format!("detect, round {round}"), c, &inferred, None);
        }
        println!("  ratio detect-cached/detect (worst of {rounds})  {c:>3}   {worst:.2}");
    }
    Ok(())
}

/// `POST body` to `url` from `concurrency` closed loops for `duration`.
pub(crate) async fn post_loop((url, key): &(String, String), body: &Bytes, concurrency: usize, duration: Duration) -> LoopStats {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(256).build(connector);
    let (url, auth, body) = (url.clone(), format!("Bearer {key}"), body.clone());
    drive(concurrency, duration, move |_| {
        let (client, url, auth, body) = (client.clone(), url.clone(), auth.clone(), body.clone());
        async move {
            let Ok(request) = hyper::Request::post(url).header(hyper::header::AUTHORIZATION, auth).body(Full::new(body)) else {
                return false;
            };
            match client.request(request).await {
                Ok(response) => response.status() == 200 && response.into_body().collect().await.is_ok(),
                Err(_) => false,
            }
        }
    })
    .await
}

fn print_row(label: &str, concurrency: usize, m: &Measurement) {
    print_ratio_row(label, concurrency, m, None);
}

pub(crate) fn print_ratio_row(label: &str, concurrency: usize, m: &Measurement, ratio: Option<f64>) {
    let ratio = ratio.map_or_else(String::new, |r| format!("{r:.2}"));
    println!(
        "{label:<34} {concurrency:>5} {:>10.0} {:>9.0} {:>9.0} {ratio:>8}",
        m.throughput,
        m.p50.as_secs_f64() * 1e6,
        m.p99.as_secs_f64() * 1e6
    );
}
