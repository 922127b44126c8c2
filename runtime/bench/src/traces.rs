//! `--suite tracing`: what OpenTelemetry traces cost. Two gateways on one
//! engine, one untraced and one tracing every request (the SDK's default
//! sampler, `parentbased_always_on`) to an OTLP/HTTP sink in this process
//! that reads and discards what it is sent; rounds alternate between them
//! and the throughput with traces is reported as a ratio of the throughput
//! without (the target is at least 0.95).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;

use crate::harness::{BenchConfig, LoopStats, Measurement, measure_gateway, start_seeded};

/// Rounds per gateway, alternating, so both see the same machine.
const ROUNDS: u32 = 4;
/// Labels of the two gateways' throw-away stores.
const UNTRACED: usize = 3000;
const TRACED: usize = 3001;

/// What the sink received: export requests and their bytes.
#[derive(Default)]
struct Received {
    requests: AtomicU64,
    bytes: AtomicU64,
}

/// Runs the suite and prints its table.
pub async fn run(config: &BenchConfig, images: &[Bytes], duration: Duration) -> anyhow::Result<()> {
    let received = Arc::new(Received::default());
    let sink = start_sink(Arc::clone(&received))?;
    let models = facegate::load_models(&config.serve.engine)?;
    let seed = &config.serve.seed_dir;
    let (off_addr, off_keys, _off) = start_seeded(seed, &config.serve.engine, models.clone(), UNTRACED, |_| {}).await?;
    let (on_addr, on_keys, _on) = start_seeded(seed, &config.serve.engine, models.clone(), TRACED, |c| {
        c.traces.endpoint = Some(format!("http://{sink}"));
        c.traces.export_delay_ms = 1_000;
    })
    .await?;
    let off = (off_addr, off_keys.get("demo").context("no demo tenant")?.clone());
    let on = (on_addr, on_keys.get("demo").context("no demo tenant")?.clone());
    println!(
        "\n== tracing: demo/detect untraced and traced (every request, OTLP/HTTP to a sink in this process); {ROUNDS} alternating rounds each =="
    );
    println!("{:<22} {:>5} {:>10} {:>9} {:>9} {:>10}", "configuration", "conc", "req/s", "p50 ms", "p99 ms", "ratio");
    for &c in &config.concurrency {
        let warmup = Duration::from_secs_f64(config.warmup);
        for target in [&off, &on] {
            measure_gateway(target, &models, images, c, warmup, config.side).await;
        }
        let round = duration / ROUNDS;
        let (mut untraced, mut traced) = (LoopStats::default(), LoopStats::default());
        for _ in 0..ROUNDS {
            untraced.merge(measure_gateway(&off, &models, images, c, round, config.side).await.0);
            traced.merge(measure_gateway(&on, &models, images, c, round, config.side).await.0);
        }
        let window = round * ROUNDS;
        let (untraced, traced) = (untraced.summarize(window), traced.summarize(window));
        print_row("untraced", c, &untraced, None);
        print_row("traced (all sampled)", c, &traced, Some(traced.throughput / untraced.throughput));
    }
    // The last spans go out within the export delay.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    println!(
        "exported: {} OTLP requests, {:.1} MiB",
        received.requests.load(Ordering::Relaxed),
        received.bytes.load(Ordering::Relaxed) as f64 / f64::from(1 << 20)
    );
    Ok(())
}

fn print_row(label: &str, concurrency: usize, m: &Measurement, ratio: Option<f64>) {
    let ratio = ratio.map_or_else(String::new, |r| format!("{r:.3}"));
    println!(
        "{label:<22} {concurrency:>5} {:>10.1} {:>9.1} {:>9.1} {ratio:>10}",
        m.throughput,
        m.p50.as_secs_f64() * 1e3,
        m.p99.as_secs_f64() * 1e3
    );
}

/// An OTLP/HTTP sink: answers every export 200 and counts it.
fn start_sink(received: Arc<Received>) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    std::thread::Builder::new().name("otlp-sink".into()).spawn(move || {
        for stream in listener.incoming().flatten() {
            let received = Arc::clone(&received);
            std::thread::spawn(move || drain(stream, &received));
        }
    })?;
    Ok(addr)
}

/// Reads the exports of one keep-alive connection, answering each.
fn drain(stream: TcpStream, received: &Received) {
    let Ok(mut writer) = stream.try_clone() else { return };
    let mut reader = BufReader::new(stream);
    loop {
        let mut length = 0;
        let mut line = String::new();
        // The request line, then the head.
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let Some((name, value)) = line.trim_end().split_once(':') else { break };
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        received.requests.fetch_add(1, Ordering::Relaxed);
        received.bytes.fetch_add(length as u64, Ordering::Relaxed);
        if writer.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_err() {
            return;
        }
    }
}
