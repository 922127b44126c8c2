//! `bench [--detect] [--iterations N] [--size S] IMAGE...`: times the SDK's
//! image decode (at the scale a letterbox of `--size` needs, as `detect`
//! handlers decode) and letterbox inside wasm (median of N runs per image)
//! and, with `--detect`, runs the whole `detect` pipeline once per image through
//! the host's `face-detect.infer`. Prints one JSON object per image, with
//! FNV-1a hashes of the decoded and letterboxed pixels.
//!
//! Run it with `deploy/scripts/guest-bench.py`, which provides the host
//! side (a preopened image folder and, for `--detect`, onnxruntime).

use std::time::Instant;

use facegate_guest_sdk::image::{ImageLimits, decode_for_letterbox, letterbox};
use facegate_guest_sdk::serde_json::json;
use facegate_guest_sdk::{DetectOptions, detect};

/// Command-line options.
struct Args {
    detect: bool,
    iterations: usize,
    size: u32,
    images: Vec<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args { detect: false, iterations: 10, size: 640, images: Vec::new() };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--detect" => args.detect = true,
            "--iterations" => args.iterations = value("--iterations")?.parse().map_err(|e| format!("{e}"))?,
            "--size" => args.size = value("--size")?.parse().map_err(|e| format!("{e}"))?,
            _ => args.images.push(arg),
        }
    }
    if args.images.is_empty() || args.iterations == 0 {
        return Err("usage: bench [--detect] [--iterations N] [--size S] IMAGE...".into());
    }
    Ok(args)
}

/// Median milliseconds of `f` over `n` runs.
fn median_ms(n: usize, mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..n)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[n / 2]
}

/// 64-bit FNV-1a of `bytes`.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

fn bench_one(path: &str, args: &Args) -> Result<(), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    let limits = ImageLimits::default();
    // What `detect` handlers run: a large JPEG decoded at the smallest scale that covers the letterbox.
    let image = decode_for_letterbox(&bytes, &limits, args.size).map_err(|e| e.to_string())?.image;
    let decode_ms = median_ms(args.iterations, || {
        decode_for_letterbox(&bytes, &limits, args.size).map(drop).unwrap_or_else(|e| panic!("{e}"));
    });
    let letterbox_ms = median_ms(args.iterations, || {
        letterbox(&image, args.size).map(drop).unwrap_or_else(|e| panic!("{e}"));
    });
    let boxed = letterbox(&image, args.size).map_err(|e| e.to_string())?;
    let mut out = json!({
        "image": path, "width": image.width(), "height": image.height(), "size": args.size,
        "iterations": args.iterations, "decode_ms": decode_ms, "letterbox_ms": letterbox_ms,
        // For comparing wasm's pixels with native code's.
        "decoded_fnv": format!("{:016x}", fnv1a(image.as_raw())), "letterbox_fnv": format!("{:016x}", fnv1a(&boxed.pixels)),
    });
    if args.detect {
        let options = DetectOptions { size: args.size, ..DetectOptions::default() };
        let detection = detect(&bytes, &options).map_err(|e| e.to_string())?;
        out["detection"] = detection.to_json();
    }
    println!("{out}");
    Ok(())
}

/// The command (`wasi:cli/run`).
struct Bench;

impl facegate_guest_sdk::wasi::exports::cli::run::Guest for Bench {
    fn run() -> Result<(), ()> {
        let result = parse_args().and_then(|args| args.images.iter().try_for_each(|path| bench_one(path, &args)));
        result.map_err(|e| eprintln!("bench: {e}"))
    }
}

facegate_guest_sdk::wasi::cli::command::export!(Bench);
