//! `facegate bench --suite pipeline`: where a request's CPU goes outside
//! inference, per image kind, and how fast the SDK's preprocessing runs in
//! wasm against the same code compiled natively.
//!
//! For each image, `--iterations` requests one after another (nothing else
//! running) to `demo/detect?size=<--side>`: the guest's own step timings
//! from `Server-Timing` (decode, letterbox, inference, post-processing) and
//! the rest of the request's wall time (HTTP, body copy, instantiation,
//! JSON). Then the same SDK calls the handler makes before inference
//! (`decode_for_letterbox` + `letterbox`), run natively in this process and
//! timed as process CPU time (the native JPEG decoder may use threads).
//! Then, like for like, the same calls in a loop inside wasm (the bench
//! guest, see `guest`) against the native loop, in interleaved
//! rounds; then memory slots kept resident against handed back.
//! Medians throughout.

use std::io::Cursor;
use std::net::SocketAddr;
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use facegate_guest_sdk::image::{ImageLimits, RgbImage, decode_for_letterbox, letterbox};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use image::imageops::FilterType;

use crate::guest::{BENCH_GUEST, GuestBench};
use crate::harness::{BenchConfig, process_cpu, start_seeded};
use facegate::sandbox::engine::EngineLimits;

/// One test image: what it stands for, and its bytes.
struct Sample {
    name: String,
    bytes: Vec<u8>,
}

/// Median step times of one image through the gateway, milliseconds.
#[derive(Debug, Default, Clone, Copy)]
struct GatewaySteps {
    decode: f64,
    preprocess: f64,
    infer: f64,
    postprocess: f64,
    /// Request wall time less the guest's steps: HTTP, instantiation, copies, JSON.
    other: f64,
}

/// Runs the suite and prints its table.
pub async fn run(config: &BenchConfig, iterations: usize) -> anyhow::Result<()> {
    let samples = samples(&config.images)?;
    let models = facegate::load_models(&config.serve.engine)?;
    let (addr, keys, _server) = start_seeded(&config.serve.seed_dir, &config.serve.engine, models.clone(), 98, |_| {}).await?;
    let key = keys.get("demo").context("the seed has no demo tenant")?.clone();
    // The same gateway, but memory slots hand every page back between requests.
    let (addr_cold, keys_cold, _cold) =
        start_seeded(&config.serve.seed_dir, &config.serve.engine, models, 97, |c| c.memory_keep_resident_kib = 0).await?;
    let key_cold = keys_cold.get("demo").context("the seed has no demo tenant")?.clone();
    println!(
        "\n== pipeline: CPU ms per request outside inference, demo/detect?size={} one at a time, median of {iterations} ==",
        config.side
    );
    println!(
        "{:<28} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>8}",
        "image", "bytes", "decode", "letterb.", "post", "other", "infer", "wasm pre", "full-size", "native", "wasm/nat"
    );
    for sample in &samples {
        let steps = through_gateway(addr, &key, "detect", &sample.bytes, config.side, iterations).await?;
        // `crop` decodes full size (it returns pixels): the same image without the reduced decode.
        let full = through_gateway(addr, &key, "crop", &sample.bytes, config.side, iterations).await?;
        let native = native_preprocess_ms(&sample.bytes, config.side, iterations)?;
        let wasm = steps.decode + steps.preprocess;
        println!(
            "{:<28} {:>9} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>9.2} {:>8.3}",
            sample.name,
            sample.bytes.len(),
            steps.decode,
            steps.preprocess,
            steps.postprocess,
            steps.other,
            steps.infer,
            wasm,
            full.decode + full.preprocess,
            native,
            native / wasm
        );
    }
    println!(
        "(wasm pre: decode + letterbox in detect; full-size: the same in crop, which decodes the whole image; wasm/nat: native CPU time ÷ wasm pre, the same SDK code; 1 = as fast as native)"
    );
    like_for_like(config, &samples, iterations).await?;
    println!(
        "\n== memory slots: the first {} KiB kept resident between requests vs every page handed back (--memory-keep-resident-kib 0); ms outside inference per request, medians of {ROUNDS} interleaved rounds ==",
        facegate::config::DEFAULT_MEMORY_KEEP_RESIDENT_KIB
    );
    println!("{:<28} {:>9} {:>9} {:>9} {:>9} {:>8}", "image", "pre kept", "pre back", "all kept", "all back", "back/kept");
    for sample in &samples {
        let (mut kept, mut back) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            kept.push(through_gateway(addr, &key, "detect", &sample.bytes, config.side, iterations).await?);
            back.push(through_gateway(addr_cold, &key_cold, "detect", &sample.bytes, config.side, iterations).await?);
        }
        let pre = |runs: &[GatewaySteps]| median(runs.iter().map(|s| s.decode + s.preprocess).collect());
        let outside = |runs: &[GatewaySteps]| median(runs.iter().map(GatewaySteps::outside_inference).collect());
        let (kept_all, back_all) = (outside(&kept), outside(&back));
        println!(
            "{:<28} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>8.3}",
            sample.name,
            pre(&kept),
            pre(&back),
            kept_all,
            back_all,
            back_all / kept_all
        );
    }
    println!("(pre: decode + letterbox; all: everything but inference — decode, letterbox, post-processing, HTTP, instantiation)");
    Ok(())
}

/// The same SDK calls timed in a loop inside wasm ([`GuestBench`]) and
/// natively, image by image: what wasm costs for the same code, without a
/// request's fresh instance and caches cold after inference.
async fn like_for_like(config: &BenchConfig, samples: &[Sample], iterations: usize) -> anyhow::Result<()> {
    println!(
        "\n== wasm vs native, like for like: decode_for_letterbox + letterbox to {} in a loop of {iterations}, medians of {ROUNDS} interleaved rounds; {BENCH_GUEST} in this process vs native ==",
        config.side
    );
    let wasm = std::path::Path::new(BENCH_GUEST);
    if !wasm.exists() {
        println!("(skipped: {BENCH_GUEST} is missing; deploy/scripts/build-guests.sh builds it)");
        return Ok(());
    }
    let images = crate::harness::bench_data_dir(96).join("images");
    let _ = std::fs::remove_dir_all(&images);
    std::fs::create_dir_all(&images)?;
    for (i, sample) in samples.iter().enumerate() {
        std::fs::write(images.join(format!("sample-{i}")), &sample.bytes)?;
    }
    // As the gateway's engine with its default limits.
    let limits = EngineLimits {
        max_instances: 1,
        memory_limit: facegate::admission::limits::DEFAULT_MEMORY_LIMIT_MIB << 20,
        keep_resident: facegate::config::DEFAULT_MEMORY_KEEP_RESIDENT_KIB << 10,
    };
    let guest = GuestBench::new(wasm, &images, limits)?;
    println!("{:<28} {:>9} {:>9} {:>9} {:>9} {:>8}", "image", "decode", "letterb.", "wasm", "native", "wasm/nat");
    for (i, sample) in samples.iter().enumerate() {
        // Interleaved rounds: the machine's speed drifts between seconds.
        let (mut guest_runs, mut native_runs) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            guest_runs.push(guest.time(&format!("sample-{i}"), config.side, iterations).await?);
            native_runs.push(native_preprocess_ms(&sample.bytes, config.side, iterations)?);
        }
        let (decode, letterbox) =
            (median(guest_runs.iter().map(|t| t.decode).collect()), median(guest_runs.iter().map(|t| t.letterbox).collect()));
        let (wasm, native) = (median(guest_runs.iter().map(|t| t.decode + t.letterbox).collect()), median(native_runs));
        println!("{:<28} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>8.3}", sample.name, decode, letterbox, wasm, native, native / wasm);
    }
    let _ = std::fs::remove_dir_all(&images);
    println!("(wasm: the guest's own medians of each call; native: process CPU time of both; 1 = as fast as native)");
    Ok(())
}

/// Interleaved rounds of the keep-resident comparison.
const ROUNDS: usize = 3;

impl GatewaySteps {
    /// The request's time outside inference.
    fn outside_inference(&self) -> f64 {
        self.decode + self.preprocess + self.postprocess + self.other
    }
}

/// The images measured: each `--image` given, then the kinds the issue names,
/// made from the fixtures: a 12 MP phone photo and a 640×480 webcam frame
/// with the chroma subsampling cameras and browsers write (4:2:0), the same
/// photo at 4:4:4 (what the `image` crate's encoder writes: twice the blocks
/// to entropy-decode), and a 1080p PNG screenshot-size image.
fn samples(images: &[std::path::PathBuf]) -> anyhow::Result<Vec<Sample>> {
    let fixture = |name: &str| -> anyhow::Result<RgbImage> {
        let path = std::path::Path::new("runtime/tests/fixtures/images").join(name);
        Ok(image::open(&path).with_context(|| format!("reading {}", path.display()))?.into_rgb8())
    };
    let mut out = Vec::new();
    for path in images {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let name = path.file_name().map_or_else(|| "image".to_owned(), |n| n.to_string_lossy().into_owned());
        out.push(Sample { name, bytes });
    }
    let city = fixture("city.jpg")?;
    let photo = with_grain(&resized(&city, 4032));
    out.push(Sample { name: "12 MP JPEG 4:2:0 (4032 wide)".into(), bytes: camera_jpeg(&photo, 90)? });
    out.push(Sample { name: "12 MP JPEG 4:4:4 (4032 wide)".into(), bytes: jpeg(&photo, 90)? });
    let astronaut = fixture("astronaut.png")?;
    out.push(Sample {
        name: "1080p PNG (1920×1080)".into(),
        bytes: png(&image::imageops::resize(&astronaut, 1920, 1080, FilterType::Triangle))?,
    });
    let grace = fixture("grace_hopper.jpg")?;
    out.push(Sample {
        name: "webcam JPEG 4:2:0 (640×480)".into(),
        bytes: camera_jpeg(&image::imageops::resize(&grace, 640, 480, FilterType::Triangle), 85)?,
    });
    Ok(out)
}

/// `image` scaled to `width`, aspect kept.
fn resized(image: &RgbImage, width: u32) -> RgbImage {
    let height = (u64::from(image.height()) * u64::from(width) / u64::from(image.width())) as u32;
    image::imageops::resize(image, width, height, FilterType::Triangle)
}

/// Adds a camera sensor's fine grain (±3 levels, deterministic), so an
/// enlarged fixture compresses like a photo rather than like a blur.
fn with_grain(image: &RgbImage) -> RgbImage {
    let mut state = 0x2545_f491_u32;
    let mut out = image.clone();
    for value in out.iter_mut() {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        *value = value.saturating_add_signed((state % 7) as i8 - 3);
    }
    out
}

fn jpeg(image: &RgbImage, quality: u8) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality).encode_image(image)?;
    Ok(out)
}

/// A baseline JPEG with 2×2 chroma subsampling, as phone cameras write.
fn camera_jpeg(image: &RgbImage, quality: u8) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut encoder = jpeg_encoder::Encoder::new(&mut out, quality);
    encoder.set_sampling_factor(jpeg_encoder::SamplingFactor::R_4_2_0);
    let (width, height) = (u16::try_from(image.width())?, u16::try_from(image.height())?);
    encoder.encode(image.as_raw(), width, height, jpeg_encoder::ColorType::Rgb)?;
    Ok(out)
}

fn png(image: &RgbImage) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    image.write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png)?;
    Ok(out)
}

/// Posts `bytes` to `demo/<handler>` `iterations` times (after one
/// warm-up) and takes the median of each step.
async fn through_gateway(
    addr: SocketAddr,
    key: &str,
    handler: &str,
    bytes: &[u8],
    side: u32,
    iterations: usize,
) -> anyhow::Result<GatewaySteps> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let url = format!("http://{addr}/v1/demo/{handler}?size={side}");
    let body = Bytes::copy_from_slice(bytes);
    let mut runs = Vec::new();
    for i in 0..=iterations {
        let req = hyper::Request::post(&url).header(hyper::header::AUTHORIZATION, format!("Bearer {key}")).body(Full::new(body.clone()))?;
        let started = Instant::now();
        let resp = client.request(req).await?;
        let status = resp.status();
        let timing = resp.headers().get("server-timing").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        let text = resp.into_body().collect().await?.to_bytes();
        let wall = started.elapsed().as_secs_f64() * 1e3;
        anyhow::ensure!(status.is_success(), "demo/{handler} answered {status}: {}", String::from_utf8_lossy(&text));
        if i > 0 {
            runs.push(steps(&timing, wall));
        }
    }
    let median = |f: fn(&GatewaySteps) -> f64| median(runs.iter().map(f).collect());
    Ok(GatewaySteps {
        decode: median(|s| s.decode),
        preprocess: median(|s| s.preprocess),
        infer: median(|s| s.infer),
        postprocess: median(|s| s.postprocess),
        other: median(|s| s.other),
    })
}

/// Reads `decode;dur=…, preprocess;dur=…, …` and the wall time.
fn steps(server_timing: &str, wall: f64) -> GatewaySteps {
    let get = |name: &str| {
        server_timing
            .split(',')
            .filter_map(|part| part.trim().strip_prefix(name)?.strip_prefix(";dur=")?.parse::<f64>().ok())
            .next()
            .unwrap_or(0.0)
    };
    let (decode, preprocess, infer, postprocess) = (get("decode"), get("preprocess"), get("infer"), get("postprocess"));
    GatewaySteps { decode, preprocess, infer, postprocess, other: (wall - decode - preprocess - infer - postprocess).max(0.0) }
}

/// Median process CPU milliseconds of the SDK's decode + letterbox, natively.
fn native_preprocess_ms(bytes: &[u8], side: u32, iterations: usize) -> anyhow::Result<f64> {
    let limits = ImageLimits::default();
    let mut times = Vec::new();
    for i in 0..=iterations {
        let started = process_cpu();
        let scaled = decode_for_letterbox(bytes, &limits, side)?;
        std::hint::black_box(letterbox(&scaled.image, side)?);
        if i > 0 {
            times.push((process_cpu() - started).as_secs_f64() * 1e3);
        }
    }
    Ok(median(times))
}

fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_timing_is_read_and_the_rest_is_other() {
        let s = steps("decode;dur=12.50, preprocess;dur=2.00, infer;dur=80.00, postprocess;dur=0.50", 100.0);
        assert_eq!((s.decode, s.preprocess, s.infer, s.postprocess), (12.5, 2.0, 80.0, 0.5));
        assert!((s.other - 5.0).abs() < 1e-9);
        assert_eq!(steps("", 3.0).other, 3.0, "no header: all of it is other");
    }

    #[test]
    fn camera_jpegs_subsample_chroma_and_image_crate_ones_do_not() {
        // The luma component's sampling byte in the baseline frame header:
        // 0x22 is 2×2 (4:2:0), 0x11 is 1×1 (4:4:4, chroma at full size).
        let luma_sampling = |jpeg: &[u8]| {
            let sof = jpeg.windows(2).position(|w| w == [0xFF, 0xC0]).expect("a baseline frame header");
            jpeg[sof + 11]
        };
        let image = RgbImage::from_fn(64, 48, |x, y| image::Rgb([(x * 4) as u8, (y * 5) as u8, 90]));
        assert_eq!(luma_sampling(&camera_jpeg(&image, 90).unwrap()), 0x22);
        assert_eq!(luma_sampling(&jpeg(&image, 90).unwrap()), 0x11);
        let decoded = image::load_from_memory(&camera_jpeg(&image, 90).unwrap()).unwrap();
        assert_eq!((decoded.width(), decoded.height()), (64, 48));
    }

    #[test]
    fn grain_changes_pixels_by_at_most_three_levels() {
        let flat = RgbImage::from_pixel(64, 64, image::Rgb([100, 100, 100]));
        let grainy = with_grain(&flat);
        assert!(grainy.iter().all(|&v| (97..=103).contains(&v)));
        assert!(grainy.iter().any(|&v| v != 100), "some grain");
    }
}
