//! The pipeline bench's like-for-like wasm timing: `guests/bench` (a
//! `wasi:cli` command) run in this process, under an engine built as the
//! gateway's is, timing the SDK's `decode_for_letterbox` + `letterbox`
//! inside wasm in a loop: the same calls, the same loop and the same warm
//! caches as the native timing it is compared with. A request through the
//! gateway also pays for a fresh instance's memory and caches cold after
//! inference; the bench reports that separately.

use std::path::{Path, PathBuf};

use anyhow::Context;
use wasmtime::component::{Component, Linker, ResourceTable};
use wasmtime::{Engine, Store};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use facegate::sandbox::engine::EngineLimits;

/// Where `deploy/scripts/build-guests.sh` leaves the bench guest, from the repository root.
pub const BENCH_GUEST: &str = "guests/target/wasm32-wasip2/release/bench.wasm";

/// The interface the bench guest imports for `--detect`.
const FACE_DETECT: &str = "facegate:face-detect/face-detect@0.1.0";

/// The bench guest, compiled, and a folder it reads images from.
pub struct GuestBench {
    engine: Engine,
    component: Component,
    images: PathBuf,
}

/// What the guest measured for one image: median milliseconds, and
/// hashes of the pixels it made (to compare with native code's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuestTimes {
    /// `decode_for_letterbox`.
    pub decode: f64,
    /// `letterbox`.
    pub letterbox: f64,
    /// 64-bit FNV-1a of the decoded pixels.
    pub decoded_fnv: u64,
    /// 64-bit FNV-1a of the letterbox's canvas.
    pub letterbox_fnv: u64,
}

/// What the command's WASI calls need.
struct BenchState {
    wasi: WasiCtx,
    table: ResourceTable,
}

impl WasiView for BenchState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl GuestBench {
    /// Compiles `wasm` with an engine configured as the gateway's; `images`
    /// is the folder [`GuestBench::time`] names its files in.
    pub fn new(wasm: &Path, images: &Path, limits: EngineLimits) -> anyhow::Result<Self> {
        let engine = facegate::sandbox::engine::build(limits)?;
        let component = Component::from_file(&engine, wasm).map_err(|e| anyhow::anyhow!("compiling {}: {e:#}", wasm.display()))?;
        Ok(Self { engine, component, images: images.to_owned() })
    }

    /// Runs the guest on `file` (in the images folder): medians of
    /// `iterations` decodes and letterboxes to `side`.
    pub async fn time(&self, file: &str, side: u32, iterations: usize) -> anyhow::Result<GuestTimes> {
        let mut linker = Linker::<BenchState>::new(&self.engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        // `face-detect` (for `--detect`, not used here) traps if called.
        let mut face_detect = linker.instance(FACE_DETECT)?;
        for name in ["models", "infer"] {
            face_detect.func_new(name, |_, _, _, _| Err(wasmtime::Error::msg("the pipeline bench provides no face-detect")))?;
        }
        let stdout = MemoryOutputPipe::new(1 << 16);
        let args = [
            "bench".to_owned(),
            "--iterations".into(),
            iterations.to_string(),
            "--size".into(),
            side.to_string(),
            format!("/images/{file}"),
        ];
        let mut wasi = WasiCtxBuilder::new();
        wasi.args(&args).stdout(stdout.clone()).inherit_stderr();
        wasi.preopened_dir(&self.images, "/images", FsPerms::ReadOnly)?;
        let wasi = wasi.build();
        let mut store = Store::new(&self.engine, BenchState { wasi, table: ResourceTable::new() });
        // Nothing advances this engine's epoch: one tick is never reached.
        store.set_epoch_deadline(1);
        let command = wasmtime_wasi::p2::bindings::Command::instantiate_async(&mut store, &self.component, &linker).await?;
        command.wasi_cli_run().call_run(&mut store).await?.map_err(|()| anyhow::anyhow!("the bench guest failed on {file}"))?;
        drop(store);
        parse(&stdout.contents())
    }
}

/// The guest's JSON line: `decode_ms`, `letterbox_ms` and the pixels' hashes (hex).
fn parse(output: &[u8]) -> anyhow::Result<GuestTimes> {
    let line: serde_json::Value = serde_json::from_slice(output).context("the bench guest's output is not JSON")?;
    let get =
        |key: &str| line.get(key).and_then(serde_json::Value::as_f64).with_context(|| format!("the bench guest's output has no {key}"));
    let hash = |key: &str| {
        let hex = line.get(key).and_then(serde_json::Value::as_str).with_context(|| format!("the bench guest's output has no {key}"))?;
        u64::from_str_radix(hex, 16).with_context(|| format!("{key} is not hex: {hex}"))
    };
    Ok(GuestTimes {
        decode: get("decode_ms")?,
        letterbox: get("letterbox_ms")?,
        decoded_fnv: hash("decoded_fnv")?,
        letterbox_fnv: hash("letterbox_fnv")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 64-bit FNV-1a of `bytes`, as the bench guest hashes pixels.
    fn fnv1a(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
    }

    #[tokio::test]
    async fn the_bench_guest_times_the_sdk_inside_wasm() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let wasm = root.join(BENCH_GUEST);
        assert!(wasm.exists(), "{} is missing: deploy/scripts/build-guests.sh builds it (deploy/test.sh does)", wasm.display());
        let images = root.join("runtime/tests/fixtures/images");
        let limits = EngineLimits { max_instances: 1, memory_limit: 256 << 20, keep_resident: 0 };
        let bench = GuestBench::new(&wasm, &images, limits).expect("compiles");
        let times = bench.time("grace_hopper.jpg", 160, 3).await.expect("runs");
        assert!(times.decode > 0.0 && times.letterbox > 0.0, "{times:?}");
        // A second run reuses the compiled guest; a missing image is the guest's error, not a hang.
        assert!(bench.time("no-such-image.jpg", 160, 1).await.is_err());
    }

    /// A 200×300 RGB PNG of gradients and noise, written to `dir`: letterboxed
    /// to 320 or 640 it is enlarged to a width (213, 427) that leaves the
    /// enlargement's last group of four pixels partial, both axes scaled.
    fn portrait_png(dir: &Path) -> &'static str {
        let mut state = 0x9e37_79b9_u32;
        let image = image::RgbImage::from_fn(200, 300, |x, y| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            let noise = (state >> 24) as u8;
            image::Rgb([(x + y) as u8, if (x / 9 + y / 7) % 2 == 0 { noise } else { 40 }, (x * 3) as u8 ^ (noise / 4)])
        });
        image.save(dir.join("portrait.png")).expect("writes the PNG");
        "portrait.png"
    }

    /// The SDK's letterbox gives the same pixels in wasm (its `simd128`
    /// enlargement there) as natively (fast_image_resize), shrinking and
    /// enlarging PNGs, which both decode exactly.
    #[tokio::test]
    async fn wasm_and_native_letterbox_the_same_pixels() {
        use facegate_guest_sdk::image::{ImageLimits, decode_for_letterbox, letterbox};
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let wasm = root.join(BENCH_GUEST);
        assert!(wasm.exists(), "{} is missing: deploy/scripts/build-guests.sh builds it (deploy/test.sh does)", wasm.display());
        let images = std::env::temp_dir().join(format!("facegate-letterbox-test-{}", std::process::id()));
        std::fs::create_dir_all(&images).unwrap();
        std::fs::copy(root.join("runtime/tests/fixtures/images/astronaut.png"), images.join("astronaut.png")).unwrap();
        let portrait = portrait_png(&images);
        let limits = EngineLimits { max_instances: 1, memory_limit: 256 << 20, keep_resident: 0 };
        let bench = GuestBench::new(&wasm, &images, limits).expect("compiles");
        for (file, side) in [("astronaut.png", 320), ("astronaut.png", 640), ("astronaut.png", 1024), (portrait, 320), (portrait, 640)] {
            let bytes = std::fs::read(images.join(file)).unwrap();
            let decoded = decode_for_letterbox(&bytes, &ImageLimits::default(), side).unwrap().image;
            let boxed = letterbox(&decoded, side).unwrap();
            let guest = bench.time(file, side, 1).await.expect("runs");
            let what = format!("{file} at {side} ({}×{} → {}×{})", decoded.width(), decoded.height(), boxed.width, boxed.height);
            assert_eq!(guest.decoded_fnv, fnv1a(decoded.as_raw()), "decoded pixels, {what}");
            assert_eq!(guest.letterbox_fnv, fnv1a(&boxed.pixels), "letterbox, {what}");
        }
        std::fs::remove_dir_all(&images).unwrap();
    }

    #[test]
    fn the_guests_line_is_read() {
        let line = br#"{"decode_ms":1.25,"decoded_fnv":"00000000000000ff","height":300,"image":"/images/a.jpg","iterations":5,"letterbox_fnv":"cbf29ce484222325","letterbox_ms":0.5,"size":160,"width":256}
"#;
        let times = GuestTimes { decode: 1.25, letterbox: 0.5, decoded_fnv: 0xff, letterbox_fnv: 0xcbf2_9ce4_8422_2325 };
        assert_eq!(parse(line).unwrap(), times);
        assert!(parse(b"bench: /images/a.jpg: not found").is_err());
        assert!(parse(br#"{"decode_ms":1.0}"#).is_err(), "letterbox_ms missing");
    }
}
