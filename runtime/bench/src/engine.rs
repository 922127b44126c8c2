//! `--suite issue2` and `--suite batching`: throughput and latency of the
//! real gateway over HTTP against the raw engine, measured in one run so
//! their ratio is stable on a noisy machine, with batching on and off.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use facegate::config::EngineConfig;
use facegate_host_gpu::{InferRequest, Models, Tensor};

use crate::harness::{
    BenchConfig, BenchServe, LoopStats, Measurement, batch_counts, batch_delta, drive, measure_gateway, print_failed_clients, start_seeded,
};

/// How the bench's threads share the cores, for its header.
fn core_layout(engine: &facegate::config::EngineConfig) -> String {
    match engine.inference_cpus.as_slice() {
        [] => " (all threads share all cores)".into(),
        cores => format!(" on cores {cores:?} of their own (--inference-cores; handlers, HTTP and clients on the others)"),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_tally_adds_rounds_and_averages_batches_over_them() {
        let round = |completed, latency, batches, samples| (LoopStats::of(completed, latency), batches, samples);
        let mut tally = Tally::default();
        tally.add(round(10, 5 * MS, 4, 4), Duration::from_secs(1));
        tally.add(round(20, 15 * MS, 2, 6), Duration::from_secs(1));
        let m = tally.summarize();
        assert_eq!(m.throughput, 15.0, "30 completions in two 1-s rounds");
        assert_eq!(m.mean_batch, 10.0 / 6.0, "10 samples in 6 batches");
        assert_eq!((m.p50, m.p99), (15 * MS, 15 * MS));
        assert_eq!(Tally::default().summarize().mean_batch, 0.0, "no batch, no mean");
    }
}
