//! `--suite fake`: the batcher alone against a fake `a + b·n` device, at
//! each concurrency level, without and with a hold-back delay.

use std::time::{Duration, Instant};

use facegate_host_gpu::backend::Backend;
use facegate_host_gpu::backend::fake::FakeBackend;
use facegate_host_gpu::{Batcher, BatcherConfig, InferRequest, Models, Tensor};

use crate::harness::{BenchConfig, Measurement, batch_counts, batch_delta, drive, print_failed_clients};

/// Hold-back delay of the fake suite's second row when `--batch-delay-us` is 0.
const FAKE_DEFAULT_DELAY: Duration = Duration::from_millis(2);

/// The fake suite's rows: each `--concurrency` level, without a hold-back
/// delay and with `--batch-delay-us` (2 ms when that is 0).
fn fake_plan(config: &BenchConfig) -> (Vec<usize>, [Duration; 2]) {
    let delay = match config.serve.engine.batch_delay_us {
        0 => FAKE_DEFAULT_DELAY,
        us => Duration::from_micros(us),
    };
    (config.concurrency.clone(), [Duration::ZERO, delay])
}

/// The batcher alone, on a fake device costing `a + b·n` per batch of n,
/// without and with a hold-back delay (`--batch-delay-us` in `serve`), and
/// the ratio of the two at each level.
pub(crate) async fn fake_device(config: &BenchConfig, duration: Duration) {
    const MAX_BATCH: usize = 16;
    let (a, b) = (Duration::from_millis(8), Duration::from_micros(500));
    let ideal = MAX_BATCH as f64 / (a + b * MAX_BATCH as u32).as_secs_f64();
    let (levels, delays) = fake_plan(config);
    let warmup = Duration::from_secs_f64(config.warmup);
    println!("\n== batcher alone, fake device: {a:?} + {b:?}·n per batch, max batch {MAX_BATCH}; ideal {ideal:.1}/s ==");
    println!("{:<10} {:>8} {:>10} {:>9} {:>9} {:>7} {:>12}", "conc", "delay", "calls/s", "p50 ms", "p99 ms", "batch", "of ideal");
    for concurrency in levels {
        let mut rows = Vec::new();
        for delay in delays {
            let batcher = BatcherConfig { max_batch: MAX_BATCH, max_delay: delay, ..BatcherConfig::default() };
            let Some(m) = measure_fake(&batcher, (a, b), concurrency, warmup, duration).await else { return };
            println!(
                "{concurrency:<10} {:>6}µs {:>10.1} {:>9.2} {:>9.2} {:>7.2} {:>11.3}x",
                delay.as_micros(),
                m.throughput,
                m.p50.as_secs_f64() * 1e3,
                m.p99.as_secs_f64() * 1e3,
                m.mean_batch,
                m.throughput / ideal
            );
            print_failed_clients(m.failed_clients);
            rows.push(m);
        }
        if let [none, delayed] = rows.as_slice() {
            println!(
                "  ratio delay/none at {concurrency}: throughput {:.3}, p50 {:.3}",
                delayed.throughput / none.throughput,
                delayed.p50.as_secs_f64() / none.p50.as_secs_f64()
            );
        }
    }
}

/// One fake-device configuration: an unmeasured warm-up, then `duration`
/// measured; the mean batch counts only the batches run while measured.
async fn measure_fake(
    config: &BatcherConfig,
    (a, b): (Duration, Duration),
    concurrency: usize,
    warmup: Duration,
    duration: Duration,
) -> Option<Measurement> {
    let backend: Box<dyn Backend> = Box::new(FakeBackend::new("fake", config.max_batch, a, b));
    let batcher = Batcher::start(vec![backend], config).ok()?;
    let models = Models::new();
    models.insert(batcher);
    let input = Tensor::new(vec![4], facegate_host_gpu::ElementType::U8, vec![1; 4]).ok()?;
    let driver = models.clone();
    let call = move |_| {
        let (models, input) = (driver.clone(), input.clone());
        async move {
            let request = InferRequest { tenant: "bench".into(), input, deadline: Instant::now() + Duration::from_secs(60) };
            models.infer("fake", request).await.is_ok()
        }
    };
    drive(concurrency, warmup, call.clone()).await;
    let before = batch_counts(&models);
    let measured = drive(concurrency, duration, call).await;
    let (batches, samples) = batch_delta(&models, &before);
    let mean_batch = if batches == 0 { 0.0 } else { samples as f64 / batches as f64 };
    Some(Measurement { mean_batch, ..measured.summarize(duration) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn bench_config(args: &[&str]) -> BenchConfig {
        crate::Cli::try_parse_from(["facegate-bench"].iter().chain(args)).unwrap().config
    }

    #[test]
    fn the_fake_suite_follows_the_concurrency_and_delay_flags() {
        let (levels, delays) = fake_plan(&bench_config(&["--suite", "fake", "--concurrency", "2,8", "--batch-delay-us", "500"]));
        assert_eq!((levels, delays), (vec![2, 8], [Duration::ZERO, Duration::from_micros(500)]));
        let (levels, delays) = fake_plan(&bench_config(&[]));
        assert_eq!((levels, delays), (vec![1, 4, 16, 64], [Duration::ZERO, FAKE_DEFAULT_DELAY]));
    }
}
