//! The gateway's configuration (`facegate serve` and the engines), from
//! flags with environment fallbacks; the doc comments are the `--help`
//! text. The command tree itself is in [`crate::cli`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use facegate_host_gpu::Sizing;
use facegate_host_gpu::{DeviceKind, DeviceSpec};

use crate::admission::limits::TenantLimits;

/// Default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Default `--memory-keep-resident-kib`: what a detection request's decode,
/// letterbox and tensor touch for a phone photo, give or take.
pub const DEFAULT_MEMORY_KEEP_RESIDENT_KIB: usize = 8192;
/// Default most handler instances alive at once (requests in flight).
pub const DEFAULT_MAX_INSTANCES: u32 = 128;
/// Default of `--usage-flush-ms`.
pub const DEFAULT_USAGE_FLUSH_MS: u64 = 10_000;
/// Default of `--usage-retention-days`.
pub const DEFAULT_USAGE_RETENTION_DAYS: u64 = 90;
/// Default most idle instances kept for reuse, all tenants together.
pub const DEFAULT_WARM_INSTANCES: u32 = 64;
/// Default seconds a warm instance waits for a request before it is dropped.
pub const DEFAULT_WARM_IDLE_SECS: u64 = 60;
/// Default largest uploaded component (64 MiB).
pub const DEFAULT_MAX_COMPONENT_BYTES: usize = 64 << 20;
/// Default `--upload-timeout-secs`.
pub const DEFAULT_UPLOAD_TIMEOUT_SECS: u64 = 30;
/// Default threads compiling uploads.
pub const DEFAULT_COMPILE_THREADS: usize = 1;
/// Default niceness of the compile threads: a weight of about a tenth of
/// the serving threads' while both want the CPU.
pub const DEFAULT_COMPILE_NICE: i32 = 10;
/// Default compile budget of one upload, ms (an 18 MB Python component
/// takes about 25 s on one core of the reference machine).
pub const DEFAULT_COMPILE_TIMEOUT_MS: u64 = 120_000;
/// Shortest admin token accepted (the metrics token too).
pub const MIN_ADMIN_TOKEN_LEN: usize = 16;
/// Shortest artifact key accepted: 32 characters (`openssl rand -hex 32`
/// gives 64), so the key behind native code is not guessable offline.
pub const MIN_ARTIFACT_KEY_LEN: usize = 32;

/// Everything `facegate serve` needs.
#[derive(Debug, Clone, Args)]
pub struct ServeConfig {
    /// Address to listen on.
    #[arg(long, env = "FACEGATE_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,

    /// TLS certificate chain (PEM); with `--tls-key`, the listener speaks HTTPS (h2 and HTTP/1.1).
    #[arg(long, env = "FACEGATE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// TLS private key (PEM) for `--tls-cert`.
    #[arg(long, env = "FACEGATE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Certificates of tenants' own hostnames (`facegate route add`): a
    /// client asking for the server name NAME (SNI) gets `DIR/NAME.crt`
    /// (chain, PEM) with `DIR/NAME.key`, read again when the files change
    /// (no restart); other names get `--tls-cert`'s.
    #[arg(long, env = "FACEGATE_TLS_HOST_CERTS", requires = "tls_cert")]
    pub tls_host_certs: Option<PathBuf>,

    /// This node's files: precompiled artifacts (a cache), key files of
    /// seeded tenants, and, without `--store`, the SQLite store.
    #[arg(long, env = "FACEGATE_DATA", default_value = ".facegate/data")]
    pub data_dir: PathBuf,

    /// The control-plane store shared by a cluster's nodes:
    /// `postgres://user:password@host:5432/db`. Without it, SQLite in `--data-dir`.
    #[arg(long, env = "FACEGATE_STORE", hide_env_values = true)]
    pub store: Option<String>,

    /// This node's id in `facegate nodes` and in tenants' log records
    /// (default: the host name): letters, digits, `.`, `_` and `-`.
    #[arg(long, env = "FACEGATE_NODE_ID", value_parser = parse_node_id)]
    pub node_id: Option<String>,

    /// The address other nodes and operators reach this node's data plane at
    /// (default: `--listen`): `host:port` for plain HTTP, or
    /// `https://name:port` (a name its certificate holds) when `--tls-cert`
    /// is on.
    #[arg(long, env = "FACEGATE_ADVERTISE")]
    pub advertise: Option<String>,

    /// CA certificates (PEM) that other nodes' `https://` data planes are
    /// verified with, when this node reads a tenant's log from them
    /// (default: the system's roots).
    #[arg(long, env = "FACEGATE_PEER_CA_CERT")]
    pub peer_ca_cert: Option<PathBuf>,

    /// The name other nodes' certificates are verified for when this node
    /// reads a tenant's log from their `https://` addresses (default: the
    /// address's host): one certificate, for this name, on every node, with
    /// nodes advertised by address (`https://$(POD_IP):8080` on Kubernetes).
    #[arg(long, env = "FACEGATE_PEER_TLS_NAME")]
    pub peer_tls_name: Option<String>,

    /// `/readyz` fails once the snapshot has not been confirmed against the
    /// store for this long (s; 0: never). Long by default: a store outage
    /// reaches every node at once, and failing them all would turn it into
    /// an outage of the data plane.
    #[arg(long, env = "FACEGATE_STALE_AFTER_S", default_value_t = 300)]
    pub stale_after_s: u64,

    /// The pipeline component (built from `guests/pipeline`), linked at
    /// deploy time into handlers that import `facegate:face-detect/pipeline`
    /// (Python and JavaScript handlers). Without the file, such uploads are refused.
    #[arg(long, env = "FACEGATE_PIPELINE_COMPONENT", default_value = ".facegate/lib/pipeline.wasm")]
    pub pipeline_component: PathBuf,

    /// Seeds an empty store from `<tenant>/<handler>.wasm` files: each tenant
    /// is created with one API key, written to `<data-dir>/<tenant>.key`.
    #[arg(long, env = "FACEGATE_SEED")]
    pub seed_dir: Option<PathBuf>,

    /// Token of the admin API (`/admin/v1/...`, at least 16 characters).
    /// Without one the admin API is off.
    #[arg(long, env = "FACEGATE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

    /// Read-only token of `/metrics` (at least 16 characters, not the admin
    /// token): what Prometheus presents. It opens nothing else; the admin
    /// token also reads `/metrics`.
    #[arg(long, env = "FACEGATE_METRICS_TOKEN", hide_env_values = true)]
    pub metrics_token: Option<String>,

    /// Serve the admin API and `/metrics` on this address only (keep it on
    /// loopback or an internal network); without it they share `--listen`.
    /// HTTPS with `--admin-tls-cert`/`--admin-tls-key`, else with
    /// `--tls-cert`/`--tls-key` when given, else plain HTTP.
    #[arg(long, env = "FACEGATE_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,

    /// TLS certificate chain (PEM) of the `--admin-listen` listener; with
    /// `--admin-tls-key` it speaks HTTPS (default: `--tls-cert`'s).
    #[arg(long, env = "FACEGATE_ADMIN_TLS_CERT", requires = "admin_tls_key")]
    pub admin_tls_cert: Option<PathBuf>,

    /// TLS private key (PEM) for `--admin-tls-cert`.
    #[arg(long, env = "FACEGATE_ADMIN_TLS_KEY", requires = "admin_tls_cert")]
    pub admin_tls_key: Option<PathBuf>,

    /// Largest component an upload may carry (bytes).
    #[arg(long, env = "FACEGATE_MAX_COMPONENT_BYTES", default_value_t = DEFAULT_MAX_COMPONENT_BYTES)]
    pub max_component_bytes: usize,

    /// Bytes of each linear memory kept mapped when its instance ends (KiB):
    /// the pages the guest wrote (Linux 6.7+'s PAGEMAP_SCAN finds them; the
    /// whole region on older kernels), reset in place instead of being handed back to the kernel: the
    /// next request in that slot takes no page faults for them. Costs up to
    /// this much resident memory per instance slot in use; 0 hands it all back.
    #[arg(long, env = "FACEGATE_MEMORY_KEEP_RESIDENT_KIB", default_value_t = DEFAULT_MEMORY_KEEP_RESIDENT_KIB)]
    pub memory_keep_resident_kib: usize,

    /// The node's memory budget (MiB), shared by all tenants: every request's
    /// body, linear memories, tables and host resources, and every warm
    /// instance, are charged to it as well as to their own limits; past it,
    /// new requests get 503 `overloaded` and a growth fails. Default: three
    /// quarters of `--memory-total-mib` less the memory the process holds
    /// once its models are loaded (printed at start). The instance pool's
    /// resident pages (`--memory-keep-resident-kib`) come out of it, lowered
    /// to fit in a quarter of it.
    #[arg(long, env = "FACEGATE_MEMORY_BUDGET_MIB", value_parser = clap::value_parser!(u64).range(64..=MAX_MEMORY_MIB))]
    pub memory_budget_mib: Option<u64>,

    /// The memory this process may use in all (MiB), for the default
    /// `--memory-budget-mib` (Kubernetes: the container's limit, through the
    /// downward API). Default: the cgroup's `memory.max`, else physical memory.
    #[arg(long, env = "FACEGATE_MEMORY_TOTAL_MIB", value_parser = clap::value_parser!(u64).range(1..=MAX_MEMORY_MIB))]
    pub memory_total_mib: Option<u64>,

    /// Most handler instances alive at once, all tenants; further requests get 503.
    #[arg(long, env = "FACEGATE_MAX_INSTANCES", default_value_t = DEFAULT_MAX_INSTANCES)]
    pub max_instances: u32,

    /// Every tenant's default limits (declared in `admission::limits`):
    /// `--memory-limit-mib`, `--request-timeout-ms`, `--max-body-bytes`,
    /// `--max-response-bytes`, `--max-infer-calls`, `--tenant-max-concurrency`,
    /// `--tenant-rps`, `--tenant-burst`, `--instance-reuse`.
    #[command(flatten)]
    pub limits: TenantLimits,

    /// Most idle instances kept warm for reuse, all tenants together (see
    /// `--instance-reuse`). They hold instance slots of their own, beside
    /// `--max-instances`, so they never keep a request from running; each
    /// holds its memory (at most 64 MiB: larger ones are not kept).
    #[arg(long, env = "FACEGATE_WARM_INSTANCES", default_value_t = DEFAULT_WARM_INSTANCES)]
    pub warm_instances: u32,

    /// Seconds an idle warm instance is kept without a request before it is
    /// dropped (its slot and memory given back); 1 to 86400.
    #[arg(long, env = "FACEGATE_WARM_IDLE_SECS", default_value_t = DEFAULT_WARM_IDLE_SECS, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub warm_idle_secs: u64,

    /// Whether handlers granted outgoing HTTP (a tenant's `outgoing_http`)
    /// may also reach loopback, private, link-local and other non-public
    /// addresses, and this host's own. `false`: public addresses of other
    /// hosts only, so a granted handler reaches neither this host (its
    /// admin API) nor the cloud's metadata service nor internal networks.
    #[arg(
        long,
        env = "FACEGATE_OUTGOING_ALLOW_PRIVATE",
        default_value_t = false,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    pub outgoing_allow_private: bool,

    /// The only ports handlers granted outgoing HTTP may reach,
    /// comma-separated; a request to another port fails with
    /// `HTTP-request-denied` before any lookup or connection.
    #[arg(long, env = "FACEGATE_OUTGOING_PORTS", value_name = "PORT", value_delimiter = ',', default_values_t = crate::sandbox::outgoing::DEFAULT_PORTS, value_parser = clap::value_parser!(u16).range(1..))]
    pub outgoing_ports: Vec<u16>,

    /// Address ranges (CIDR, IPv4 or IPv6) handlers granted outgoing HTTP
    /// may never reach, even public ones and even with
    /// `--outgoing-allow-private`: the cluster's pod, node and service
    /// networks where they are public (global IPv6). Repeatable or
    /// comma-separated; IPv4 inside IPv6 is checked as IPv4.
    #[arg(long, env = "FACEGATE_OUTGOING_DENY", value_name = "CIDR", value_delimiter = ',', value_parser = crate::sandbox::outgoing::parse_cidr)]
    pub outgoing_deny: Vec<ipnet::IpNet>,

    /// Most outgoing connections of one tenant's handlers open at once (a
    /// connection counts until it closes, after its response body); past
    /// it a request fails at once with `connection-limit-reached`.
    #[arg(long, env = "FACEGATE_OUTGOING_MAX_CONNECTIONS_PER_TENANT", default_value_t = crate::sandbox::outgoing::DEFAULT_TENANT_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..))]
    pub outgoing_max_connections_per_tenant: u32,

    /// Most outgoing connections of all handlers open at once (each is a
    /// file descriptor); past it a request fails with `connection-limit-reached`.
    #[arg(long, env = "FACEGATE_OUTGOING_MAX_CONNECTIONS", default_value_t = crate::sandbox::outgoing::DEFAULT_MAX_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..))]
    pub outgoing_max_connections: u32,

    /// Registries a node pulls handlers from when a deploy names a
    /// component by reference (`oci://HOST[:PORT]/REPO…`), each as
    /// references name it (`HOST` or `HOST:PORT`, matched exactly);
    /// repeatable or comma-separated. None by default: a deploy by
    /// reference is refused. Pulls go over HTTPS and through the same
    /// address rules as handlers' outgoing requests (`--outgoing-allow-private`,
    /// `--outgoing-deny`), redirects included.
    #[arg(long = "oci-registry", env = "FACEGATE_OCI_REGISTRIES", value_name = "HOST[:PORT]", value_delimiter = ',', value_parser = registry_name)]
    pub oci_registries: Vec<String>,

    /// Registries pulled from over plain HTTP (one without TLS on the
    /// cluster's own network); naming one here also allows it.
    #[arg(long = "oci-insecure-registry", env = "FACEGATE_OCI_INSECURE_REGISTRIES", value_name = "HOST[:PORT]", value_delimiter = ',', value_parser = registry_name)]
    pub oci_insecure_registries: Vec<String>,

    /// Longest an upload may take to arrive, or a pull from a registry to
    /// finish, seconds (1 to 3600); past it the deploy is refused and its
    /// tenant's upload place given back.
    #[arg(long, env = "FACEGATE_UPLOAD_TIMEOUT_SECS", default_value_t = DEFAULT_UPLOAD_TIMEOUT_SECS, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub upload_timeout_secs: u64,

    /// Most host resources one request may hold at once (wasi:http fields,
    /// bodies, streams, pollables); past it the request ends with 500
    /// `resource_limit`. Each holds at most 128 KiB of host memory.
    #[arg(long, env = "FACEGATE_MAX_HOST_RESOURCES", default_value_t = crate::sandbox::state::DEFAULT_MAX_HOST_RESOURCES)]
    pub max_host_resources: usize,

    /// Connections to the store's database for handlers' state
    /// (`wasi:keyvalue`), each on a thread of its own; one tenant's calls
    /// use at most a quarter of them (at least one) at once.
    #[arg(long, env = "FACEGATE_STATE_CONNECTIONS", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub state_connections: u16,

    /// Threads that compile uploaded components (serving keeps the other cores).
    #[arg(long, env = "FACEGATE_COMPILE_THREADS", default_value_t = DEFAULT_COMPILE_THREADS)]
    pub compile_threads: usize,

    /// Niceness of the compile threads (0..=19): above 0 they get CPU only
    /// in proportion, so serving keeps its cores while an upload compiles.
    #[arg(long, env = "FACEGATE_COMPILE_NICE", default_value_t = DEFAULT_COMPILE_NICE, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub compile_nice: i32,

    /// How often this node writes the usage it metered to the store, ms:
    /// what a crash may lose (see docs/operations.md, "Usage").
    #[arg(long, env = "FACEGATE_USAGE_FLUSH_MS", default_value_t = DEFAULT_USAGE_FLUSH_MS, value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    pub usage_flush_ms: u64,

    /// Bytes of each tenant's log (its requests' outcomes and its handlers'
    /// output) this node keeps; past it the oldest records are dropped,
    /// and counted.
    #[arg(long, env = "FACEGATE_TENANT_LOG_BYTES", default_value_t = crate::telemetry::logs::DEFAULT_TENANT_LOG_BYTES as u64, value_parser = clap::value_parser!(u64).range(4096..=(1 << 30)))]
    pub tenant_log_bytes: u64,

    /// MiB of all tenants' logs together this node keeps; past it the
    /// tenant whose log is largest drops its oldest records first.
    #[arg(long, env = "FACEGATE_TENANT_LOGS_TOTAL_MIB", default_value_t = (crate::telemetry::logs::DEFAULT_TENANT_LOGS_TOTAL_BYTES >> 20) as u64, value_parser = clap::value_parser!(u64).range(1..=(1 << 20)))]
    pub tenant_logs_total_mib: u64,

    /// Days of usage the store keeps (older minute buckets are pruned).
    #[arg(long, env = "FACEGATE_USAGE_RETENTION_DAYS", default_value_t = DEFAULT_USAGE_RETENTION_DAYS, value_parser = clap::value_parser!(u64).range(1..=36_500))]
    pub usage_retention_days: u64,

    /// Whether this node shares the components it compiles with the other
    /// nodes of a cluster, and loads theirs, through the store (native code,
    /// so sealed with a key derived from `--artifact-key`, which every node
    /// must then be given alike; without one nothing is shared). `false`:
    /// each node compiles each deploy itself.
    #[arg(long, env = "FACEGATE_SHARE_ARTIFACTS", default_value_t = true, action = clap::ArgAction::Set)]
    pub share_artifacts: bool,

    /// Secret that seals the compiled handlers nodes share through the store
    /// and each node's artifact cache (at least 32 characters, e.g.
    /// `openssl rand -hex 32`; not the admin or metrics token). The same on
    /// every node of a cluster; without it nothing is shared and each node
    /// seals its cache with a random key kept in `--data-dir`.
    #[arg(long, env = "FACEGATE_ARTIFACT_KEY", hide_env_values = true)]
    pub artifact_key: Option<String>,

    /// The key that seals tenants' secrets in the store (their registry
    /// credentials): 64 hex digits (`openssl rand -hex 32`), the same on
    /// every node of a cluster; not the admin token nor the artifact key.
    /// Default: a single node (SQLite store) keeps a random one in
    /// `--data-dir/secrets.key`; nodes sharing a store without one keep no secrets.
    #[arg(long, env = "FACEGATE_SECRETS_KEY", hide_env_values = true, conflicts_with = "secrets_key_file")]
    pub secrets_key: Option<String>,

    /// A file holding the secrets key (64 hex digits), instead of `--secrets-key`.
    #[arg(long, env = "FACEGATE_SECRETS_KEY_FILE")]
    pub secrets_key_file: Option<PathBuf>,

    /// Longest an upload's compilation may take (ms); past it the upload is refused.
    #[arg(long, env = "FACEGATE_COMPILE_TIMEOUT_MS", default_value_t = DEFAULT_COMPILE_TIMEOUT_MS)]
    pub compile_timeout_ms: u64,

    /// Inference engines.
    #[command(flatten)]
    pub engine: EngineConfig,

    /// OpenTelemetry traces (off unless an OTLP endpoint is set).
    #[command(flatten)]
    pub traces: crate::telemetry::trace::TraceConfig,

    // ---- Connection limits (kept together, last) ----
    // A client that holds a connection without using it takes a slot from
    // everyone else: every connection gets deadlines and a share.
    //
    /// Longest from accepting a connection to its first complete request head,
    /// TLS handshake included (ms); past it the connection is closed.
    // The first head is the one wait hyper's header timeout does not cover.
    #[arg(long, env = "FACEGATE_REQUEST_HEAD_TIMEOUT_MS", default_value_t = DEFAULT_REQUEST_HEAD_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub request_head_timeout_ms: u64,

    /// Keep-alive connections (HTTP/1.1 and HTTP/2) with no request in flight
    /// and none started for this long (ms) are shut down gracefully (HTTP/2:
    /// GOAWAY). Only requests count: HTTP/2 PINGs and window updates do not.
    // Longer than a client's pause between requests, short enough that
    // abandoned connections give their slots back.
    #[arg(long, env = "FACEGATE_IDLE_TIMEOUT_MS", default_value_t = DEFAULT_IDLE_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_ms: u64,

    /// Longest a connection stays open (s; 0: no limit). Past it (less up
    /// to a tenth, spread per connection) it is shut down gracefully, its
    /// requests in flight finishing (HTTP/1: `Connection: close`; HTTP/2:
    /// GOAWAY), and the client reconnects.
    // No client keeps a slot forever by using it, and load balancers get to
    // spread long-lived clients again (after a scale-up, say).
    #[arg(long, env = "FACEGATE_MAX_CONNECTION_AGE_S", default_value_t = DEFAULT_MAX_CONNECTION_AGE_S, value_parser = clap::value_parser!(u64).range(0..=MAX_CONNECTION_AGE_S))]
    pub max_connection_age_s: u64,

    /// Most open client connections per listener. When they are all open,
    /// a new one takes the slot of the connection idle the longest (closed);
    /// with none idle it is closed at once. A listener that also serves the
    /// admin API keeps a few more for it. The open-file limit is raised to
    /// fit at start (or this lowered to fit it, with a warning).
    // Bounds file descriptors and per-connection memory.
    #[arg(long, env = "FACEGATE_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,

    /// Most open connections from one client address (IPv6: one /64) per
    /// listener; more are closed at once (0: no cap). Behind a proxy, a load
    /// balancer that rewrites source addresses or kube-proxy's SNAT, every
    /// client has the proxy's address: set 0 there.
    #[arg(long, env = "FACEGATE_MAX_CONNECTIONS_PER_IP", default_value_t = DEFAULT_MAX_CONNECTIONS_PER_IP)]
    pub max_connections_per_ip: u32,
}

/// Where the model and ONNX Runtime are, and how they are spread over devices.
#[derive(Debug, Clone, Args)]
pub struct EngineConfig {
    /// The prepared CenterFace model, served as `centerface` (deploy/setup.sh installs it).
    #[arg(long, env = "FACEGATE_MODEL", default_value = ".facegate/models/centerface.onnx")]
    pub model: PathBuf,

    /// More models of CenterFace's contract (the same input and outputs),
    /// `NAME=PATH`, comma-separated, each served under its name beside
    /// `centerface` with a batcher of its own. The default is the INT8
    /// CenterFace deploy/setup.sh makes; skipped with a warning when that
    /// file is absent (a model named here otherwise must load); `none`
    /// serves `centerface` alone. Two models of one name are refused.
    #[arg(long = "extra-model", env = "FACEGATE_EXTRA_MODELS", value_delimiter = ',', value_parser = parse_named_model,
        default_value = DEFAULT_EXTRA_MODEL)]
    pub extra_models: Vec<(String, PathBuf)>,

    /// Most memory (MiB) the models may hold loaded at once, as estimated
    /// per model (its weights three times over and 32 MiB per session);
    /// 0: no bound. `centerface` stays loaded; past the bound the least
    /// recently used of the others is unloaded, and loaded again at its
    /// next call, which waits for the load. Set aside from the node's
    /// memory budget.
    #[arg(long, env = "FACEGATE_MODEL_MEMORY_MIB", default_value_t = 1024)]
    pub model_memory_mib: u64,

    /// The ONNX Runtime shared library (deploy/setup.sh installs it).
    #[arg(long, env = "ORT_DYLIB_PATH", default_value = ".facegate/lib/libonnxruntime.so")]
    pub onnxruntime: PathBuf,

    /// Devices the model runs on, comma-separated: each a kind of host-gpu's
    /// `DeviceKind` table (`cpu`, `cuda:N`, …); the `--help` text,
    /// `devices_help`, lists them from that table.
    #[arg(long, env = "FACEGATE_DEVICES", value_delimiter = ',', default_value = DeviceKind::Cpu.info().name, help = devices_help())]
    pub devices: Vec<DeviceSpec>,

    /// Device workers (ONNX Runtime sessions) on the CPU, each pulling its own
    /// batches (0: one per core, or per reserved core with
    /// `--inference-cores`). One worker using every core halves a lone
    /// request's latency; one per core gives about the same throughput under load.
    #[arg(long, env = "FACEGATE_CPU_WORKERS", default_value_t = 1)]
    pub cpu_workers: usize,

    /// Intra-op threads of each CPU worker (0: the cores, or the reserved
    /// cores with `--inference-cores`, divided by the workers).
    #[arg(long, env = "FACEGATE_CPU_THREADS", default_value_t = 0)]
    pub cpu_threads: usize,

    /// Cores reserved for CPU inference (0: none, every thread may run on
    /// every core). The CPU workers and their ONNX Runtime threads run only
    /// on the last N cores the process may use, and everything else (the
    /// tenants' handlers, HTTP, compiling) only on the others, so handlers
    /// cannot take CPU from inference nor inference from handlers: the
    /// layout of a machine whose accelerator is a device of its own.
    /// `--cpu-workers` and `--cpu-threads` then default to the reserved
    /// cores. Linux only.
    #[arg(long, env = "FACEGATE_INFERENCE_CORES", default_value_t = 0)]
    pub inference_cores: usize,

    /// The cores reserved for inference, once [`crate::serve::cores::reserve`] has
    /// set them apart (empty: none).
    #[arg(skip)]
    pub inference_cpus: Vec<usize>,

    /// Most samples per device batch. With `--batch-sizing adaptive` each
    /// device learns, per image size, the batch size (up to this) that is
    /// cheapest per image: on a CPU that is 1 for 640×640 images and 4–8
    /// for small ones; on a GPU, the largest.
    #[arg(long, env = "FACEGATE_MAX_BATCH", default_value_t = 8)]
    pub max_batch: usize,

    /// `adaptive`: batches only as large as pays on each device, measured
    /// per input shape; `fixed`: always fill to `--max-batch`.
    #[arg(long, env = "FACEGATE_BATCH_SIZING", default_value = "adaptive", value_parser = parse_sizing)]
    pub batch_sizing: Sizing,

    /// How long (µs) to hold a partial batch to fill it; 0 batches only what waits while devices are busy.
    #[arg(long, env = "FACEGATE_BATCH_DELAY_US", default_value_t = 0)]
    pub batch_delay_us: u64,

    /// Most inference calls waiting per model (all tenants); more get `overloaded`.
    #[arg(long, env = "FACEGATE_QUEUE_CAPACITY", default_value_t = facegate_host_gpu::DEFAULT_QUEUE_CAPACITY)]
    pub queue_capacity: usize,

    /// Most inference calls waiting per model for one tenant.
    #[arg(long, env = "FACEGATE_TENANT_QUEUE_CAPACITY", default_value_t = facegate_host_gpu::DEFAULT_TENANT_CAPACITY)]
    pub tenant_queue_capacity: usize,

    /// A tenant's share of device time, `TENANT=WEIGHT` (default weight 1;
    /// with weights 3 and 1, two busy tenants get three times the device
    /// time to one).
    #[arg(long = "tenant-weight", env = "FACEGATE_TENANT_WEIGHTS", value_delimiter = ',', value_parser = parse_weight)]
    pub tenant_weights: Vec<(String, u32)>,
}

/// The INT8 CenterFace deploy/setup.sh makes (deploy/scripts/quantize_model.py).
pub const DEFAULT_EXTRA_MODEL: &str = "centerface-int8=.facegate/models/centerface-int8.onnx";

fn parse_named_model(s: &str) -> Result<(String, PathBuf), String> {
    if s.trim() == "none" {
        // No extra model: an entry `load_models` skips.
        return Ok((String::new(), PathBuf::new()));
    }
    let (name, path) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected NAME=PATH"))?;
    let name = name.trim();
    if !crate::admission::models::valid_model_name(name) || name == "centerface" {
        return Err(format!("{name:?}: a model name is a-z, 0-9, '.', '_', '-' (at most 64 bytes), and not centerface"));
    }
    Ok((name.to_owned(), PathBuf::from(path.trim())))
}

fn parse_sizing(s: &str) -> Result<Sizing, String> {
    match s {
        "adaptive" => Ok(Sizing::Adaptive),
        "fixed" => Ok(Sizing::Fixed),
        other => Err(format!("unknown batch sizing {other:?} (expected adaptive or fixed)")),
    }
}

fn parse_weight(s: &str) -> Result<(String, u32), String> {
    let (tenant, weight) = s.split_once('=').ok_or_else(|| format!("expected TENANT=WEIGHT, got {s:?}"))?;
    let weight: u32 = weight.parse().map_err(|_| format!("weight of {tenant:?} must be a positive integer"))?;
    if weight == 0 || tenant.is_empty() {
        return Err(format!("expected TENANT=WEIGHT with WEIGHT >= 1, got {s:?}"));
    }
    Ok((tenant.to_owned(), weight))
}

/// Default deadline from accept to a complete first request head, ms.
pub const DEFAULT_REQUEST_HEAD_TIMEOUT_MS: u64 = 10_000;
/// Default idle timeout of keep-alive connections, ms.
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 30_000;
/// Default most open connections per listener.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 4096;
/// Default most connections per client address: a sixteenth of
/// [`DEFAULT_MAX_CONNECTIONS`], so one address cannot fill a listener, yet
/// room for the clients of an office or a carrier-grade NAT sharing one
/// (a browser opens at most 6 HTTP/1.1 connections to a host, 1 of HTTP/2).
pub const DEFAULT_MAX_CONNECTIONS_PER_IP: u32 = 256;
/// Default longest life of a connection, s: thousands of requests' worth
/// for a busy client (its handshakes are paid for), short enough that a
/// hoarded slot or a load balancer's uneven spread lasts minutes, not days.
pub const DEFAULT_MAX_CONNECTION_AGE_S: u64 = 600;
/// Largest `--max-connection-age-s` (a year): instants a connection's age
/// is added to stay far from overflowing.
pub const MAX_CONNECTION_AGE_S: u64 = 365 * 24 * 3600;
/// Largest `--memory-budget-mib` and `--memory-total-mib` (16 TiB): their
/// bytes fit a `usize` with room.
pub const MAX_MEMORY_MIB: u64 = 1 << 24;

impl ServeConfig {
    /// The deadline from accept to a complete first request head.
    pub fn request_head_timeout(&self) -> Duration {
        Duration::from_millis(self.request_head_timeout_ms)
    }

    /// How long a keep-alive connection may sit unused.
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }

    /// How long a connection may stay open, if bounded.
    pub fn max_connection_age(&self) -> Option<Duration> {
        (self.max_connection_age_s > 0).then(|| Duration::from_secs(self.max_connection_age_s))
    }
}

/// A node id: what `--node-id` takes, and what a tenant's log cursor names.
pub fn valid_node_id(id: &str) -> bool {
    (1..=MAX_NODE_ID_LEN).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Longest node id (a DNS name's length).
const MAX_NODE_ID_LEN: usize = 253;

fn parse_node_id(id: &str) -> Result<String, String> {
    if valid_node_id(id) {
        Ok(id.to_owned())
    } else {
        Err(format!("{id:?}: a node id is 1 to {MAX_NODE_ID_LEN} letters, digits, '.', '_' or '-'"))
    }
}

/// This machine's name (a pod's name on Kubernetes), made a valid node id.
fn host_name() -> String {
    let name = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|name| name.trim().replace(|c: char| !(c.is_ascii_alphanumeric() || "._-".contains(c)), "-"))
        .unwrap_or_default();
    if valid_node_id(&name) { name } else { "facegate".to_owned() }
}

impl ServeConfig {
    /// This node's id: `--node-id`, else the host name.
    pub fn node_name(&self) -> String {
        self.node_id.clone().unwrap_or_else(host_name)
    }

    /// Checks the secrets (each long enough, one per purpose: no two the
    /// same) and the admin listener's TLS settings.
    pub fn check_secrets(&self) -> anyhow::Result<()> {
        let admin = self.admin_token.as_deref();
        let metrics = self.metrics_token.as_deref();
        let artifact = self.artifact_key.as_deref();
        for (name, secret, min) in [
            ("admin token", admin, MIN_ADMIN_TOKEN_LEN),
            ("metrics token", metrics, MIN_ADMIN_TOKEN_LEN),
            ("artifact key", artifact, MIN_ARTIFACT_KEY_LEN),
        ] {
            anyhow::ensure!(secret.is_none_or(|s| s.len() >= min), "the {name} must be at least {min} characters");
        }
        let same = |a: Option<&str>, b: Option<&str>| a.is_some() && a == b;
        anyhow::ensure!(!same(metrics, admin), "the metrics token must not be the admin token (Prometheus would hold the admin API's key)");
        anyhow::ensure!(
            !same(artifact, admin) && !same(artifact, metrics),
            "the artifact key must be a secret of its own, not the admin or metrics token (it decides what native code nodes load)"
        );
        let secrets = self.secrets_key.as_deref().map(str::trim);
        anyhow::ensure!(
            !same(secrets, admin) && !same(secrets, metrics) && !same(secrets, artifact),
            "the secrets key must be a secret of its own, not the admin or metrics token nor the artifact key (it opens tenants' secrets)"
        );
        anyhow::ensure!(
            self.admin_tls_cert.is_none() || self.admin_listen.is_some(),
            "--admin-tls-cert needs --admin-listen (without it the admin API shares --listen and its --tls-cert)"
        );
        Ok(())
    }

    /// The certificate and key the admin listener serves HTTPS with:
    /// `--admin-tls-*`, else `--tls-*`.
    pub fn admin_tls_files(&self) -> Option<(&std::path::Path, &std::path::Path)> {
        match (&self.admin_tls_cert, &self.admin_tls_key, &self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key), _, _) | (None, None, Some(cert), Some(key)) => Some((cert, key)),
            _ => None,
        }
    }

    /// The default per-request deadline.
    pub fn request_timeout(&self) -> Duration {
        self.limits.timeout()
    }

    /// Longest an upload may take to arrive, or a pull to finish.
    pub fn upload_timeout(&self) -> Duration {
        Duration::from_secs(self.upload_timeout_secs)
    }

    /// Refuses a registry named both for HTTPS and for plain HTTP.
    pub fn check_registries(&self) -> anyhow::Result<()> {
        match self.oci_registries.iter().find(|r| self.oci_insecure_registries.contains(r)) {
            Some(both) => anyhow::bail!("the registry {both} is named by both --oci-registry and --oci-insecure-registry; name it once"),
            None => Ok(()),
        }
    }

    /// Where handlers granted outgoing HTTP may go, and their connection caps.
    pub fn egress_rules(&self) -> crate::sandbox::outgoing::EgressRules {
        crate::sandbox::outgoing::EgressRules {
            allow_private: self.outgoing_allow_private,
            ports: self.outgoing_ports.clone(),
            deny: self.outgoing_deny.clone(),
            max_connections: self.outgoing_max_connections as usize,
            tenant_connections: self.outgoing_max_connections_per_tenant as usize,
        }
    }

    /// The settings `facegate serve` would get with no flags (flags' defaults
    /// and `FACEGATE_*` environment), serving `data_dir`.
    pub fn with_data_dir(data_dir: PathBuf) -> anyhow::Result<Self> {
        #[derive(clap::Parser)]
        struct Serve {
            #[command(flatten)]
            config: ServeConfig,
        }
        let mut config = <Serve as clap::Parser>::try_parse_from(["serve"])?.config;
        config.data_dir = data_dir;
        Ok(config)
    }
}

/// A registry's name, canonical: `HOST` or `HOST:PORT` as `oci://`
/// references name it, the host lowercased (an IPv6 literal bracketed, as
/// `Ipv6Addr` prints it), the port 1 to 65535 in plain digits. Flags,
/// references, the allowlist and kept credentials all compare this form.
pub fn registry_name(text: &str) -> Result<String, String> {
    let bad = || format!("{text:?} is not HOST or HOST:PORT (no scheme, no path)");
    let (host, port) = match text.strip_prefix('[') {
        Some(rest) => {
            let (addr, after) = rest.split_once(']').ok_or_else(bad)?;
            let addr: std::net::Ipv6Addr = addr.parse().map_err(|_| bad())?;
            let port = if after.is_empty() { None } else { Some(after.strip_prefix(':').ok_or_else(bad)?) };
            (format!("[{addr}]"), port)
        }
        None => {
            let (host, port) = text.split_once(':').map_or((text, None), |(h, p)| (h, Some(p)));
            let label = |l: &str| (1..=63).contains(&l.len()) && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
            if host.len() > 253 || !host.split('.').all(label) {
                return Err(bad());
            }
            (host.to_ascii_lowercase(), port)
        }
    };
    match port {
        None => Ok(host),
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => match p.parse::<u16>() {
            Ok(n) if n > 0 => Ok(format!("{host}:{n}")),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

/// `--devices`' help, from host-gpu's device table: the spellings, what a
/// worker is and the cargo features the GPU kinds need.
fn devices_help() -> String {
    let kinds = || DeviceKind::ALL.iter().map(|kind| kind.info());
    let quoted = |names: Vec<String>| names.iter().map(|name| format!("`{name}`")).collect::<Vec<_>>();
    let spellings = quoted(kinds().map(|kind| kind.usage()).collect()).join(", ");
    let example = kinds().find(|kind| kind.ordinal).map(|kind| format!(" (e.g. `{0}:0,{0}:1`)", kind.name)).unwrap_or_default();
    let cpu = quoted(kinds().filter(|kind| kind.host_cpu).map(|kind| kind.name.to_owned()).collect()).join(" or ");
    let features: Vec<String> = kinds().filter_map(|kind| kind.feature()).map(str::to_owned).collect();
    let build = match features.split_first() {
        Some((first, [])) => format!("`--features {first}`"),
        Some((first, rest)) => format!("`--features {first}` (or {})", quoted(rest.to_vec()).join(", ")),
        None => "GPU features".to_owned(),
    };
    format!(
        "Devices the model runs on, comma-separated: {spellings}{example}. Each GPU is one device worker; {cpu} adds `--cpu-workers` \
         of them. GPUs need a build with {build} and the onnxruntime-gpu library as `--onnxruntime`"
    )
}

impl EngineConfig {
    /// One CPU session on the model at `model` (and on the INT8 model
    /// beside it, `centerface-int8.onnx`, when there is one), with ONNX
    /// Runtime from `onnxruntime`: batches of up to 4, sized adaptively,
    /// never held to fill; what the tests and benches start from.
    pub fn single_cpu(model: PathBuf, onnxruntime: PathBuf) -> Self {
        let int8 = model.with_file_name("centerface-int8.onnx");
        let extra_models = if int8.is_file() { vec![("centerface-int8".to_owned(), int8)] } else { Vec::new() };
        Self {
            model,
            extra_models,
            model_memory_mib: 1024,
            onnxruntime,
            devices: vec![DeviceKind::Cpu.into()],
            cpu_workers: 1,
            cpu_threads: 0,
            inference_cores: 0,
            inference_cpus: Vec::new(),
            max_batch: 4,
            batch_sizing: Sizing::Adaptive,
            batch_delay_us: 0,
            queue_capacity: facegate_host_gpu::DEFAULT_QUEUE_CAPACITY,
            tenant_queue_capacity: facegate_host_gpu::DEFAULT_TENANT_CAPACITY,
            tenant_weights: Vec::new(),
        }
    }

    /// CPU workers, resolving 0 to one per inference core.
    pub fn workers(&self) -> usize {
        if self.cpu_workers > 0 { self.cpu_workers } else { self.inference_core_count() }
    }

    /// Intra-op threads per CPU worker, resolving 0 to an even share of the inference cores.
    pub fn threads_per_worker(&self) -> usize {
        if self.cpu_threads > 0 { self.cpu_threads } else { (self.inference_core_count() / self.workers()).max(1) }
    }

    /// The cores CPU inference runs on: those reserved for it, or all.
    fn inference_core_count(&self) -> usize {
        match self.inference_cpus.len() {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    #[test]
    fn flags_fall_back_to_defaults_and_parse_weights() {
        let cli = Cli::try_parse_from(["facegate", "serve", "--tenant-weight", "a=3,b=1"]).unwrap();
        let Command::Serve(config) = cli.command else { panic!("not serve") };
        assert_eq!(config.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(config.engine.tenant_weights, vec![("a".to_owned(), 3), ("b".to_owned(), 1)]);
        assert!(Cli::try_parse_from(["facegate", "serve", "--tenant-weight", "a=0"]).is_err());
        assert!(Cli::try_parse_from(["facegate", "serve", "--tenant-weight", "a"]).is_err());
        assert_eq!(config.engine.devices, vec![DeviceSpec::from(DeviceKind::Cpu)]);
        let cli = Cli::try_parse_from(["facegate", "serve", "--devices", "cuda:0,tensorrt:1,cpu"]).unwrap();
        let Command::Serve(config) = cli.command else { panic!("not serve") };
        let devices: Vec<String> = config.engine.devices.iter().map(ToString::to_string).collect();
        assert_eq!(devices, ["cuda:0", "tensorrt:1", "cpu"]);
        for bad in ["gpu", "cuda", "cuda:-1", "cuda:x"] {
            assert!(Cli::try_parse_from(["facegate", "serve", "--devices", bad]).is_err(), "{bad}");
        }
        // Generated from host-gpu's device table: every kind's spelling and feature.
        let help = devices_help();
        assert!(help.starts_with("Devices the model runs on, comma-separated: `cpu`, `cuda:N`, "), "{help}");
        for kind in DeviceKind::ALL.iter().map(|kind| kind.info()) {
            assert!(help.contains(&format!("`{}`", kind.usage())), "{help}");
            assert!(kind.feature().is_none_or(|feature| help.contains(&format!("{feature}`"))), "{help}");
        }
    }

    #[test]
    #[allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]
    fn private_outgoing_addresses_are_off_unless_the_flag_is_given() {
        let allow = |args: &[&str]| {
            let cli = Cli::try_parse_from(["facegate", "serve"].iter().chain(args)).unwrap();
            let Command::Serve(config) = cli.command else { panic!("not serve") };
            config.outgoing_allow_private
        };
        assert!(!allow(&[]));
        assert!(allow(&["--outgoing-allow-private"]), "a bare flag turns it on");
        assert!(!allow(&["--outgoing-allow-private", "false"]));
    }

    #[test]
    #[allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]
    fn outgoing_ports_ranges_and_caps_parse_and_bad_ones_stop_the_start() {
        let parse = |args: &[&str]| Cli::try_parse_from(["facegate", "serve"].iter().chain(args)).map_err(|e| e.to_string());
        let Command::Serve(defaults) = parse(&[]).unwrap().command else { panic!("not serve") };
        assert_eq!(defaults.egress_rules(), crate::sandbox::outgoing::EgressRules::default());
        assert_eq!(defaults.egress_rules().ports, [80, 443]);
        let args =
            ["--outgoing-ports", "443,8443", "--outgoing-deny", "2001:db8::/32", "--outgoing-deny", "10.1.0.0/16,::ffff:192.0.2.0/120"];
        let Command::Serve(config) = parse(&[&args[..], &["--outgoing-max-connections-per-tenant", "2"]].concat()).unwrap().command else {
            panic!("not serve")
        };
        let rules = config.egress_rules();
        assert_eq!(rules.ports, [443, 8443]);
        let deny: Vec<String> = rules.deny.iter().map(ToString::to_string).collect();
        assert_eq!(deny, ["2001:db8::/32", "10.1.0.0/16", "192.0.2.0/24"], "repeatable and comma-separated; mapped as IPv4");
        assert_eq!((rules.tenant_connections, rules.max_connections), (2, crate::sandbox::outgoing::DEFAULT_MAX_CONNECTIONS as usize));
        let bad = parse(&["--outgoing-deny", "10.0.0.0/8,pods"]).unwrap_err();
        assert!(bad.contains("--outgoing-deny") && bad.contains("\"pods\" is not a CIDR range"), "{bad}");
        for bad in [
            &["--outgoing-ports", "0"][..],
            &["--outgoing-ports", "http"],
            &["--outgoing-max-connections-per-tenant", "0"],
            &["--outgoing-max-connections", "0"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    #[allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]
    fn sizes_and_ages_that_would_overflow_are_refused() {
        for (flag, value) in [("--max-connection-age-s", u64::MAX), ("--memory-budget-mib", 1 << 44), ("--memory-total-mib", 1 << 44)] {
            assert!(Cli::try_parse_from(["facegate", "serve", flag, &value.to_string()]).is_err(), "{flag} {value}");
        }
        let largest = MAX_MEMORY_MIB.to_string();
        assert!(Cli::try_parse_from(["facegate", "serve", "--memory-budget-mib", &largest]).is_ok());
    }

    #[test]
    #[allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]
    fn connection_limits_default_and_refuse_zero() {
        let cli = Cli::try_parse_from(["facegate", "serve", "--idle-timeout-ms", "1500", "--max-connections-per-ip", "8"]).unwrap();
        let Command::Serve(config) = cli.command else { panic!("not serve") };
        assert_eq!(config.request_head_timeout(), Duration::from_millis(DEFAULT_REQUEST_HEAD_TIMEOUT_MS));
        assert_eq!(config.idle_timeout(), Duration::from_millis(1500));
        assert_eq!((config.max_connections, config.max_connections_per_ip), (DEFAULT_MAX_CONNECTIONS, 8));
        for flag in ["--request-head-timeout-ms", "--idle-timeout-ms", "--max-connections"] {
            assert!(Cli::try_parse_from(["facegate", "serve", flag, "0"]).is_err(), "{flag}");
        }
        let defaults = ServeConfig::with_data_dir("d".into()).unwrap();
        assert_eq!(defaults.max_connections_per_ip, DEFAULT_MAX_CONNECTIONS_PER_IP);
        assert!(defaults.max_connections_per_ip > 0, "one address cannot fill a listener by default");
        assert_eq!(defaults.max_connection_age(), Some(Duration::from_secs(DEFAULT_MAX_CONNECTION_AGE_S)));
        let cli = Cli::try_parse_from(["facegate", "serve", "--max-connection-age-s", "0"]).unwrap();
        let Command::Serve(config) = cli.command else { panic!("not serve") };
        assert_eq!(config.max_connection_age(), None, "0: no age limit");
    }

    /// The shipped Kubernetes manifest keeps a per-address cap on (pods
    /// behind a proxy see few addresses: a higher one, never none).
    #[test]
    fn the_k8s_manifest_caps_connections_per_address() {
        let manifest = include_str!("../../deploy/k8s/base/deployment.yaml");
        let mut lines = manifest.lines().skip_while(|l| l.trim() != "- name: FACEGATE_MAX_CONNECTIONS_PER_IP").skip(1);
        let value = lines.next().and_then(|l| l.trim().strip_prefix("value:")).map(|v| v.trim().trim_matches('"'));
        let cap: Option<u32> = value.and_then(|v| v.parse().ok());
        assert!(cap.is_some_and(|cap| cap > 0 && cap < DEFAULT_MAX_CONNECTIONS), "FACEGATE_MAX_CONNECTIONS_PER_IP is {value:?}");
    }

    #[test]
    fn registry_names_are_made_canonical_or_refused() {
        assert_eq!(registry_name("GHCR.io").as_deref(), Ok("ghcr.io"));
        assert_eq!(registry_name("registry.internal:05000").as_deref(), Ok("registry.internal:5000"));
        assert_eq!(registry_name("[0:0::1]:5000").as_deref(), Ok("[::1]:5000"));
        for bad in
            ["", "ghcr.io:", "::1", "a..b", "h:1:2", "h:+5000", "h:0", "h:70000", "[::1]junk", "https://ghcr.io", "u@ghcr.io", "ghcr.io/x"]
        {
            assert!(registry_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    #[allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]
    fn secrets_are_long_enough_and_one_per_purpose() {
        let check = |args: &[&str]| {
            let cli = Cli::try_parse_from(["facegate", "serve"].iter().chain(args)).unwrap();
            let Command::Serve(config) = cli.command else { panic!("not serve") };
            config.check_secrets().map_err(|e| e.to_string())
        };
        let (admin, metrics, artifact) = ("a".repeat(16), "m".repeat(16), "k".repeat(32));
        assert!(check(&[]).is_ok(), "no secrets at all");
        assert!(check(&["--admin-token", &admin, "--metrics-token", &metrics, "--artifact-key", &artifact]).is_ok());
        assert!(check(&["--metrics-token", &"m".repeat(15)]).unwrap_err().contains("metrics token must be at least 16"));
        assert!(check(&["--artifact-key", &"k".repeat(31)]).unwrap_err().contains("artifact key must be at least 32"));
        assert!(check(&["--admin-token", &admin, "--metrics-token", &admin]).unwrap_err().contains("must not be the admin token"));
        let both = "s".repeat(32);
        assert!(check(&["--admin-token", &both, "--artifact-key", &both]).unwrap_err().contains("secret of its own"));
        assert!(check(&["--metrics-token", &both, "--artifact-key", &both]).unwrap_err().contains("secret of its own"));
        let hex = "0f".repeat(32);
        assert!(check(&["--secrets-key", &hex, "--artifact-key", &hex]).unwrap_err().contains("secrets key must be a secret of its own"));
        assert!(check(&["--secrets-key", &hex, "--artifact-key", &artifact]).is_ok());
        assert!(Cli::try_parse_from(["facegate", "serve", "--secrets-key", &hex, "--secrets-key-file", "k"]).is_err(), "one or the other");
        let tls = ["--admin-tls-cert", "c.pem", "--admin-tls-key", "k.pem"];
        assert!(check(&tls).unwrap_err().contains("needs --admin-listen"));
        assert!(Cli::try_parse_from(["facegate", "serve", "--admin-tls-cert", "c.pem"]).is_err(), "a certificate needs its key");
    }

    #[test]
    #[allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]
    fn the_admin_listener_takes_its_own_certificate_else_the_public_one() {
        let files = |args: &[&str]| {
            let cli = Cli::try_parse_from(["facegate", "serve", "--admin-listen", "127.0.0.1:9090"].iter().chain(args)).unwrap();
            let Command::Serve(config) = cli.command else { panic!("not serve") };
            config.admin_tls_files().map(|(c, k)| (c.to_owned(), k.to_owned()))
        };
        let pair = |c: &str, k: &str| Some((PathBuf::from(c), PathBuf::from(k)));
        assert_eq!(files(&[]), None, "plain HTTP");
        assert_eq!(files(&["--tls-cert", "p.pem", "--tls-key", "pk.pem"]), pair("p.pem", "pk.pem"));
        let both = ["--tls-cert", "p.pem", "--tls-key", "pk.pem", "--admin-tls-cert", "a.pem", "--admin-tls-key", "ak.pem"];
        assert_eq!(files(&both), pair("a.pem", "ak.pem"));
    }
}
