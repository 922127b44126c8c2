//! Starts one real gateway per test binary, on a thread of its own, and
//! gives tests its address.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use facegate::config::{EngineConfig, ServeConfig};

/// Deadline of every request at the test gateway.
pub const REQUEST_TIMEOUT_MS: u64 = 5_000;
/// Infer calls one request may make at the test gateway.
pub const MAX_INFER_CALLS: u32 = 4;

/// Body limit of the test gateway (small, so the 413 test stays cheap).
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// Repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where deploy/setup.sh put the runtime library and the model.
pub fn facegate_home() -> PathBuf {
    std::env::var_os("FACEGATE_HOME").map(PathBuf::from).unwrap_or_else(|| root().join(".facegate"))
}

/// A test photo from runtime/tests/fixtures/images.
pub fn image(name: &str) -> Vec<u8> {
    let path = root().join("runtime/tests/fixtures/images").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A built guest component (deploy/scripts/build-guests.sh builds them).
pub fn guest(name: &str) -> PathBuf {
    let path = root().join("guests/target/wasm32-wasip2/release").join(format!("{name}.wasm"));
    assert!(path.exists(), "{} missing: run deploy/scripts/build-guests.sh", path.display());
    path
}

/// Copies a component to `<handlers>/<tenant>/<handler>.wasm`.
pub fn install(handlers: &Path, tenant: &str, handler: &str, component: &Path) {
    let dir = handlers.join(tenant);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(component, dir.join(format!("{handler}.wasm"))).unwrap();
}

/// The test gateway's settings, serving `handlers_dir`.
pub fn config(handlers_dir: PathBuf) -> ServeConfig {
    let home = facegate_home();
    ServeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tls_cert: None,
        tls_key: None,
        handlers_dir,
        request_timeout_ms: REQUEST_TIMEOUT_MS,
        max_body_bytes: MAX_BODY_BYTES,
        memory_limit_mib: 256,
        max_instances: 64,
        max_infer_calls: MAX_INFER_CALLS,
        engine: EngineConfig {
            model: home.join("models/centerface.onnx"),
            onnxruntime: std::env::var_os("ORT_DYLIB_PATH").map(PathBuf::from).unwrap_or_else(|| home.join("lib/libonnxruntime.so")),
            cpu_workers: 1,
            cpu_threads: 0,
            max_batch: 4,
            batch_delay_us: 0,
            queue_capacity: 256,
            tenant_queue_capacity: 128,
            tenant_weights: Vec::new(),
        },
    }
}

/// The shared gateway: tenant `demo` serves the example handlers
/// (`detect`, `blur`, `crop`); tenant `evil` serves the hostile test program as `attack`.
pub fn gateway() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let handlers = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("handlers-{}", std::process::id()));
        install(&handlers, "demo", "detect", &guest("detect"));
        install(&handlers, "demo", "blur", &guest("blur"));
        install(&handlers, "demo", "crop", &guest("crop"));
        install(&handlers, "evil", "attack", &guest("hostile"));
        start(config(handlers))
    })
}

/// Starts a gateway with `config` on a thread of its own; returns its address.
pub fn start(config: ServeConfig) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let models = facegate::load_models(&config.engine).expect("load model (run deploy/setup.sh)");
            let gateway = facegate::Gateway::new(&config, models).expect("start gateway");
            let (listener, addr) = facegate::bind(config.listen).await.unwrap();
            tx.send(addr).unwrap();
            gateway.serve(listener, std::future::pending()).await.unwrap();
        });
    });
    rx.recv().expect("gateway failed to start")
}

/// A blocking HTTP client with a generous timeout.
pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(std::time::Duration::from_secs(60)).build().unwrap()
}

/// `http://<gateway>/<path>`.
pub fn url(path: &str) -> String {
    format!("http://{}{path}", gateway())
}
