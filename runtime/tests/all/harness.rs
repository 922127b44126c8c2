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

/// Admin token of every test gateway.
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

/// Artifact key of the `facegate serve` nodes the tests start (see `process::Server`).
pub const ARTIFACT_KEY: &str = "test-artifact-key-0123456789abcdef0123456789";

/// This test run's scratch directory `<CARGO_TARGET_TMPDIR>/<name>-<pid>`.
/// The first call removes what earlier runs left there (their process is
/// gone): a run writes about 2 GiB (stores, built components), which would
/// otherwise pile up run after run until the disk is full.
pub fn scratch_dir(name: &str) -> PathBuf {
    static SWEPT: OnceLock<()> = OnceLock::new();
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    SWEPT.get_or_init(|| sweep_earlier_runs(&root));
    root.join(format!("{name}-{}", std::process::id()))
}

/// Removes the entries of `root` named `…-<pid>` whose process has ended.
fn sweep_earlier_runs(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|name| name.rsplit('-').next()).and_then(|pid| pid.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Copies a component to `<dir>/<tenant>/<handler>.wasm` (a seed directory).
pub fn install(dir: &Path, tenant: &str, handler: &str, component: &Path) {
    let dir = dir.join(tenant);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(component, dir.join(format!("{handler}.wasm"))).unwrap();
}

/// The seed of the test gateways: tenant `demo` serves the example handlers
/// (`detect`, `blur`, `crop`); tenant `evil` serves the hostile test program as `attack`.
pub fn seed_dir() -> PathBuf {
    static SEED: OnceLock<PathBuf> = OnceLock::new();
    SEED.get_or_init(|| {
        let dir = scratch_dir("seed");
        install(&dir, "demo", "detect", &guest("detect"));
        install(&dir, "demo", "blur", &guest("blur"));
        install(&dir, "demo", "crop", &guest("crop"));
        install(&dir, "evil", "attack", &guest("hostile"));
        dir
    })
    .clone()
}

/// A fresh, empty data directory named `name`.
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = scratch_dir(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The test gateway's settings: a store in `data_dir`, seeded from `seed`.
pub fn config(data_dir: PathBuf, seed: Option<PathBuf>) -> ServeConfig {
    let home = facegate_home();
    let mut config = ServeConfig::with_data_dir(data_dir).unwrap();
    config.listen = "127.0.0.1:0".parse().unwrap();
    config.tls_cert = None;
    config.tls_key = None;
    config.seed_dir = seed;
    config.admin_token = Some(ADMIN_TOKEN.to_owned());
    config.limits.timeout_ms = REQUEST_TIMEOUT_MS;
    config.limits.max_body_bytes = MAX_BODY_BYTES;
    config.limits.memory_mib = 256;
    config.max_instances = 64;
    config.limits.max_infer_calls = MAX_INFER_CALLS;
    // Every test connects from 127.0.0.1, many at once (some with hundreds
    // of sockets): a per-address cap would set them against each other. The
    // `connections` tests give their gateways one.
    config.max_connections_per_ip = 0;
    config.engine = engine_config(&home);
    config.pipeline_component = guest("pipeline");
    // Usage reaches the store (and the report) within half a second.
    config.usage_flush_ms = 500;
    config
}

/// The real model on ONNX Runtime, as deploy/setup.sh installed it.
pub fn engine_config(home: &Path) -> EngineConfig {
    let onnxruntime = std::env::var_os("ORT_DYLIB_PATH").map(PathBuf::from).unwrap_or_else(|| home.join("lib/libonnxruntime.so"));
    EngineConfig {
        queue_capacity: 256,
        tenant_queue_capacity: 128,
        ..EngineConfig::single_cpu(home.join("models/centerface.onnx"), onnxruntime)
    }
}

/// The shared test gateway: its address and its store.
pub struct TestGateway {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its data directory.
    pub data_dir: PathBuf,
}

/// The shared gateway, seeded with `demo` and `evil`.
pub fn gateway() -> &'static TestGateway {
    static GATEWAY: OnceLock<TestGateway> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        let data_dir = fresh_dir("data");
        let addr = start(config(data_dir.clone(), Some(seed_dir())));
        TestGateway { addr, data_dir }
    })
}

/// The API key the seed wrote for `tenant`.
pub fn key(tenant: &str) -> String {
    let path = gateway().data_dir.join(format!("{tenant}.key"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).trim().to_owned()
}

/// Starts a gateway with `config` on a thread of its own; returns its address.
/// With `FACEGATE_LOG` set, the gateways log to the test output.
pub fn start(config: ServeConfig) -> SocketAddr {
    start_until(config, std::future::pending()).0
}

/// Starts a gateway that drains when `shutdown` resolves; the returned
/// receiver hears once `serve` has returned.
pub fn start_until(
    config: ServeConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> (SocketAddr, std::sync::mpsc::Receiver<()>) {
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("FACEGATE_LOG") {
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
    }
    let (started, addr) = std::sync::mpsc::channel();
    let (ended, returned) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let models = facegate::load_models(&config.engine).expect("load model (run deploy/setup.sh)");
            let gateway = facegate::Gateway::new(&config, models).expect("start gateway");
            let (listener, addr) = facegate::bind(config.listen).await.unwrap();
            started.send(addr).unwrap();
            gateway.serve(listener, shutdown).await.unwrap();
            let _ = ended.send(());
        });
    });
    (addr.recv().expect("gateway failed to start"), returned)
}

/// Starts a gateway with `config` serving tenants on `config.listen` and
/// the admin API and `/metrics` on `config.admin_listen` (as `--admin-listen`
/// does), on a thread of its own; returns both addresses.
pub fn start_split(config: ServeConfig) -> (SocketAddr, SocketAddr) {
    let admin_listen = config.admin_listen.expect("start_split needs config.admin_listen");
    let (started, addrs) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let models = facegate::load_models(&config.engine).expect("load model (run deploy/setup.sh)");
            let gateway = facegate::Gateway::new(&config, models).expect("start gateway");
            let (public, public_addr) = facegate::bind(config.listen).await.unwrap();
            let (admin, admin_addr) = facegate::bind(admin_listen).await.unwrap();
            started.send((public_addr, admin_addr)).unwrap();
            gateway.serve_split(public, admin, std::future::pending()).await.unwrap();
        });
    });
    addrs.recv().expect("gateway failed to start")
}

/// The test gateway's settings over HTTPS, with a fresh self-signed
/// certificate for `localhost` written under `dir`; returns the certificate too.
pub fn tls_config(dir: &Path) -> (ServeConfig, tokio_rustls::rustls::pki_types::CertificateDer<'static>) {
    std::fs::create_dir_all(dir).unwrap();
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, certified.cert.pem()).unwrap();
    std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
    let mut config = config(dir.join("data"), Some(seed_dir()));
    config.tls_cert = Some(cert);
    config.tls_key = Some(key);
    (config, certified.cert.der().clone())
}

/// A TLS client's connection asking for the server name `sni` and
/// trusting the certificate `root` only.
pub fn tls_client(root: &tokio_rustls::rustls::pki_types::CertificateDer<'static>, sni: &str) -> tokio_rustls::rustls::ClientConnection {
    use tokio_rustls::rustls::{ClientConfig, RootCertStore};
    let mut roots = RootCertStore::empty();
    roots.add(root.clone()).unwrap();
    let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from(sni.to_owned()).unwrap();
    tokio_rustls::rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap()
}

/// A blocking HTTP client with a generous timeout, sending no key.
pub fn anonymous() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(std::time::Duration::from_secs(60)).build().unwrap()
}

/// A client sending `key` with every request.
pub fn client_with_key(key: &str) -> reqwest::blocking::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {key}").parse().unwrap());
    reqwest::blocking::Client::builder().timeout(std::time::Duration::from_secs(60)).default_headers(headers).build().unwrap()
}

/// A client with `tenant`'s seeded key.
pub fn client_as(tenant: &str) -> reqwest::blocking::Client {
    client_with_key(&key(tenant))
}

/// A client with tenant `demo`'s key.
pub fn client() -> reqwest::blocking::Client {
    client_as("demo")
}

/// `http://<gateway>/<path>`.
pub fn url(path: &str) -> String {
    format!("http://{}{path}", gateway().addr)
}

/// An admin API request (`/admin/v1/<path>`) with the admin token.
pub fn admin(method: reqwest::Method, path: &str) -> reqwest::blocking::RequestBuilder {
    anonymous().request(method, url(&format!("/admin/v1/{path}"))).bearer_auth(ADMIN_TOKEN)
}

/// An admin API request to the gateway at `addr`.
pub fn admin_at(addr: SocketAddr, method: reqwest::Method, path: &str) -> reqwest::blocking::RequestBuilder {
    anonymous().request(method, format!("http://{addr}/admin/v1/{path}")).bearer_auth(ADMIN_TOKEN)
}

/// Sends an admin request; returns the status and the JSON answer.
pub fn admin_json(request: reqwest::blocking::RequestBuilder) -> (u16, serde_json::Value) {
    let response = request.send().unwrap();
    let status = response.status().as_u16();
    (status, response.json().unwrap_or(serde_json::Value::Null))
}

/// The value of the `/metrics` sample `series` (its name and labels, exactly), if present.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
