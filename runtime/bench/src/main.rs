//! `facegate-bench` (also run as `facegate bench …`): the gateway against
//! the raw engine, the batcher alone on a fake device, the pipeline's CPU,
//! the handler languages, the gateway's own cost per request, and the
//! isolation, overload and tracing suites; each prints its table
//! (see docs/benchmarks.md). A binary of its own, so that the gateway
//! library links none of what the suites need (the guest SDK, image
//! codecs).

mod engine;
mod fake;
mod guest;
mod harness;
mod isolation;
mod languages;
mod models;
mod native;
mod overhead;
mod overload;
mod pipeline;
mod state;
mod traces;

use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use clap::Parser;

use crate::harness::BenchConfig;

/// The bench's flags.
#[derive(Debug, Parser)]
#[command(
    name = "facegate-bench",
    version,
    about = "Throughput and latency of the gateway against the raw engine, and more (see docs/benchmarks.md)"
)]
struct Cli {
    #[command(flatten)]
    config: BenchConfig,
}

fn main() -> anyhow::Result<()> {
    facegate::cli::init_logging();
    let mut cli = Cli::parse();
    // Before the async runtime starts: its threads inherit the handlers' cores.
    facegate::serve::cores::reserve(&mut cli.config.serve.engine)?;
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(cli.config))
}

/// Runs the suites asked for and prints their tables.
async fn run(config: BenchConfig) -> anyhow::Result<()> {
    let images = config
        .images
        .iter()
        .map(|p| std::fs::read(p).with_context(|| format!("reading {}", p.display())).map(Bytes::from))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let tensors = images.iter().map(|b| harness::preprocess(b, config.side)).collect::<anyhow::Result<Vec<_>>>()?;
    let duration = Duration::from_secs_f64(config.seconds);
    let suite = config.suite.as_str();
    if matches!(suite, "issue2" | "batching" | "all") {
        engine::gateway_vs_engine(&config, &images, &tensors, duration).await?;
    }
    if matches!(suite, "fake" | "all") {
        fake::fake_device(&config, duration).await;
    }
    if matches!(suite, "pipeline" | "all") {
        pipeline::run(&config, config.iterations.max(1)).await?;
    }
    if matches!(suite, "languages" | "all") {
        languages::run(&config, config.iterations.max(1)).await?;
    }
    if suite == "isolation" {
        isolation::run(&config, &images, duration).await?;
    }
    if suite == "overload" {
        overload::run(&config, &images, duration).await?;
    }
    if suite == "tracing" {
        traces::run(&config, &images, duration).await?;
    }
    if suite == "overhead" {
        overhead::run(&config, duration).await?;
    }
    if suite == "state" {
        state::run(&config, &images, duration).await?;
    }
    if suite == "models" {
        models::run(&config, &images, duration).await?;
    }
    harness::remove_bench_dirs();
    Ok(())
}
