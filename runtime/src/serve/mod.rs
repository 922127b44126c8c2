//! `facegate serve`: loading the models, assembling a node (engine,
//! sandbox, control plane, HTTP app) from its config, and serving until a
//! signal; [`cores`] sets cores apart for inference, [`sizing`] sizes the
//! node's memory budget.

pub mod cores;
pub mod gate;
mod models;
pub mod sizing;

pub use models::{OnnxOpener, batcher_config, load_models};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use facegate_host_gpu::Models;
use tokio::net::TcpListener;

use crate::admission::memory::MemoryBudget;
use crate::config::ServeConfig;
use crate::control::store::NodeLoad;
use crate::control::sync::{NodeIdentity, SyncHandle};
use crate::control::{ControlPlane, ControlSettings};
use crate::http::{App, Plane};
use crate::sandbox::compile::CompilePool;
use crate::sandbox::engine::{EngineLimits, EpochTicker};
use crate::sandbox::{Sandbox, engine, outgoing};
use crate::telemetry::trace::Tracing;
use crate::{control, http, telemetry};

/// A gateway ready to serve: the app plus the epoch thread its deadlines need.
pub struct Gateway {
    /// The request router and everything behind it.
    pub app: Arc<App>,
    /// Keys the seeding created at this start (shown once).
    pub seeded_keys: Vec<crate::control::SeededKey>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// The `--admin-listen` listener's TLS (see [`ServeConfig::admin_tls_files`]).
    admin_tls: Option<tokio_rustls::TlsAcceptor>,
    _ticker: EpochTicker,
}

impl Gateway {
    /// Builds the wasmtime engine and sandbox, opens the store (seeding it
    /// when empty and `--seed-dir` is given) and loads every active handler.
    pub fn new(config: &ServeConfig, models: Models) -> anyhow::Result<Self> {
        preflight(config)?;
        let memory_limit = config.limits.memory_mib << 20;
        let (memory, engine_limits) = node_memory(
            config,
            &models,
            EngineLimits {
                // Warm instances hold slots of their own (see warm.rs).
                max_instances: config.max_instances.saturating_add(config.warm_instances),
                memory_limit,
                keep_resident: config.memory_keep_resident_kib << 10,
            },
        );
        let engine = engine::build(engine_limits)?;
        let ticker = EpochTicker::start(&engine);
        let warm = (config.warm_instances as usize, Duration::from_secs(config.warm_idle_secs));
        let egress = outgoing::Egress::new(config.egress_rules());
        outgoing::log_rules(egress.rules());
        let state = state_pool(config)?;
        let sandbox = Arc::new(Sandbox::new(engine, models.clone(), warm, egress, memory)?.with_state(state));
        sandbox.logs().set_capacity(usize::try_from(config.tenant_log_bytes).unwrap_or(usize::MAX));
        sandbox.logs().set_total_capacity(usize::try_from(config.tenant_logs_total_mib << 20).unwrap_or(usize::MAX));
        // Per-tenant counters the control plane clears when a tenant is deleted.
        let http_metrics = Arc::new(telemetry::HttpMetrics::default());
        let counters: Vec<Arc<dyn telemetry::TenantCounters>> = vec![http_metrics.clone(), sandbox.hits().clone(), sandbox.logs().clone()];
        let settings = ControlSettings {
            defaults: config.limits,
            max_instances: config.max_instances,
            compile: CompilePool::new(config.compile_threads, config.compile_nice, Duration::from_millis(config.compile_timeout_ms))?,
            weights: config.engine.tenant_weights.iter().cloned().collect(),
            counters,
            pipeline: read_pipeline(&config.pipeline_component),
            artifact_key: shared_artifact_key(config),
            secrets_key: secrets_key(config)?,
            cache_key: config.artifact_key.as_deref().map(|secret| crate::control::ArtifactKey::derive(secret).cache_key()),
            // One node's store is local and answers at once: one connection does.
            compile_store: if control::store::is_shared(config.store.as_deref()) {
                Some(control::store::open(config.store.as_deref(), &config.data_dir)?)
            } else {
                None
            },
            // The snapshot's rebuilds never wait for a change or a tenant's read, nor they for it.
            serving_store: Some(control::store::open(config.store.as_deref(), &config.data_dir)?),
            model_opener: Some(Arc::new(OnnxOpener::new(&config.engine))),
        };
        let store = control::store::open(config.store.as_deref(), &config.data_dir)?;
        let control = ControlPlane::open(store, &config.data_dir, Arc::clone(&sandbox), models.clone(), settings)?;
        let seeded_keys = match &config.seed_dir {
            Some(seed) => control.seed(seed)?,
            None => Vec::new(),
        };
        let live = control.serving.live();
        tracing::info!(tenants = live.tenants.len(), handlers = live.handler_count(), store = control.store_name(), "store loaded");
        match (&config.admin_token, &config.metrics_token) {
            (None, None) => tracing::warn!(
                "admin API and /metrics off (set --admin-token or FACEGATE_ADMIN_TOKEN to manage tenants and handlers, --metrics-token for Prometheus)"
            ),
            (None, Some(_)) => tracing::warn!(
                "admin API off (set --admin-token or FACEGATE_ADMIN_TOKEN to manage tenants and handlers); /metrics takes the metrics token"
            ),
            _ => {}
        }
        let tls = match (&config.tls_cert, &config.tls_key) {
            (Some(cert), Some(key)) => Some(http::tls::acceptor((cert, key), config.tls_host_certs.as_deref())?),
            _ => None,
        };
        let admin_tls = match config.admin_tls_files().filter(|_| config.admin_listen.is_some()) {
            Some((cert, key)) => Some(http::tls::acceptor((cert, key), None)?),
            None => None,
        };
        let tracing = trace_requests(config, &models)?;
        let app = Arc::new(App::new((Arc::new(control), sandbox, models), config.clone(), http_metrics, tracing));
        Ok(Self { app, tls, admin_tls, seeded_keys, _ticker: ticker })
    }

    /// Serves every route on `listener` until `shutdown` resolves.
    pub async fn serve(self, listener: TcpListener, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
        let _sync = self.start_sync(&listener)?;
        let shutdown = self.draining_after(shutdown);
        let served = http::serve(Arc::clone(&self.app), Plane::Both, listener, self.tls.clone(), shutdown).await;
        self.flush_traces().await;
        served
    }

    /// Exports the spans still queued (the exporter blocks: off the runtime's threads).
    async fn flush_traces(&self) {
        let tracing = self.app.tracing.clone();
        let _ = tokio::task::spawn_blocking(move || tracing.shutdown()).await;
    }

    /// Keeps the snapshot in step with the store and reports this node
    /// (see [`control::sync`]) while it serves; stops (and deregisters) on drop.
    fn start_sync(&self, listener: &TcpListener) -> anyhow::Result<SyncHandle> {
        let config = &self.app.config;
        let address = match &config.advertise {
            Some(address) => address.clone(),
            None => {
                let local = listener.local_addr()?;
                if local.ip().is_unspecified() && config.store.is_some() {
                    tracing::warn!(address = %local, "no --advertise: other nodes cannot reach this one at an unspecified address (a tenant's log read through them misses this node's records); set --advertise");
                }
                local.to_string()
            }
        };
        let node =
            NodeIdentity { id: config.node_name(), address, devices: config.engine.devices.iter().map(ToString::to_string).collect() };
        let app = Arc::clone(&self.app);
        let load = Box::new(move || NodeLoad {
            queue_depth: app.models.iter().map(|m| m.queue_depth() as u64).sum(),
            in_flight: app.in_flight() as u64,
            handlers: app.control.serving.live().handler_count() as u64,
            generation: 0,
        });
        let usage = control::usage::UsagePolicy {
            flush_every: Duration::from_millis(config.usage_flush_ms),
            retention: Duration::from_secs(config.usage_retention_days.saturating_mul(86_400)),
        };
        SyncHandle::start(Arc::clone(&self.app.control), node, load, (config.compile_nice, usage))
    }

    /// `shutdown`, after which `/readyz` answers 503 while connections drain.
    fn draining_after(&self, shutdown: impl std::future::Future<Output = ()>) -> impl std::future::Future<Output = ()> {
        let app = Arc::clone(&self.app);
        async move {
            shutdown.await;
            app.begin_drain();
        }
    }

    /// Serves tenants on `public` and the admin API and metrics on `admin`
    /// (HTTPS when the admin listener has TLS files, see
    /// [`ServeConfig::admin_tls_files`]) until `shutdown` resolves.
    pub async fn serve_split(
        self,
        public: TcpListener,
        admin: TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<()> {
        let _sync = self.start_sync(&public)?;
        let shutdown = self.draining_after(shutdown);
        // Whichever ends first (the signal, or a listener failing) stops both,
        // and each drains its own connections.
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|stop| *stop).await;
        };
        let stop = &stop;
        let admin = async {
            let result = http::serve(Arc::clone(&self.app), Plane::Admin, admin, self.admin_tls.clone(), wait(stopped.clone())).await;
            let _ = stop.send(true);
            result
        };
        let public = async {
            let result = http::serve(Arc::clone(&self.app), Plane::Data, public, self.tls.clone(), wait(stopped.clone())).await;
            let _ = stop.send(true);
            result
        };
        let signal = async {
            tokio::select! {
                () = shutdown => {}
                () = wait(stopped.clone()) => {}
            }
            let _ = stop.send(true);
        };
        let ((), admin, public) = tokio::join!(signal, admin, public);
        self.flush_traces().await;
        admin.and(public)
    }
}

/// The node's memory budget (see [`sizing`]), with the engine's
/// limits fitted to it; logged and printed, since everything the node
/// admits depends on it.
fn node_memory(config: &ServeConfig, models: &Models, engine: EngineLimits) -> (Arc<MemoryBudget>, EngineLimits) {
    let available = sizing::available(config.memory_total_mib.map(|mib| mib as usize));
    // The models loaded later take their room from what is not loaded now
    // (the ones loaded are in the resident set already).
    let (models_loaded, models_bound) = models.memory();
    let models_later = models_bound.map_or(0, |bound| bound.saturating_sub(models_loaded));
    let baseline = sizing::resident_set().unwrap_or(0).saturating_add(usize::try_from(models_later).unwrap_or(usize::MAX));
    let budget = match (config.memory_budget_mib, available) {
        (Some(mib), _) => (mib as usize) << 20,
        (None, Some(available)) => sizing::default_budget(available.bytes, baseline),
        (None, None) => {
            tracing::warn!("cannot tell how much memory this process may use: the node's memory budget is off (set --memory-budget-mib)");
            usize::MAX
        }
    };
    if let Some(available) = available.filter(|a| budget > a.bytes.saturating_sub(baseline)) {
        tracing::warn!(
            budget_mib = budget >> 20,
            available_mib = available.bytes >> 20,
            source = available.source,
            baseline_mib = baseline >> 20,
            "the memory budget is larger than what is left of the available memory: the kernel may kill the process before the budget refuses anything"
        );
    }
    let split = sizing::split(budget, engine);
    if split.engine.keep_resident < engine.keep_resident {
        tracing::warn!(
            kib = split.engine.keep_resident >> 10,
            configured_kib = engine.keep_resident >> 10,
            "--memory-keep-resident-kib lowered to fit a quarter of the memory budget (lower --max-instances/--warm-instances, or raise the budget)"
        );
    }
    if !split.fits(budget) {
        tracing::warn!(
            budget_mib = budget >> 20,
            pool_resident_mib = split.resident >> 20,
            requests_mib = split.chargeable >> 20,
            "the instance pool's resident table pages leave requests less than 64 MiB of the memory budget, and requests get 64 MiB beyond it: raise --memory-budget-mib or lower --max-instances/--warm-instances"
        );
    }
    let of = available.map_or_else(|| "unknown".to_owned(), |a| format!("{} MiB ({})", a.bytes >> 20, a.source));
    tracing::info!(budget_mib = split.chargeable >> 20, available = %of, held_at_start_mib = baseline >> 20, models_later_mib = models_later >> 20, pool_resident_mib = split.resident >> 20, "node memory budget (requests and warm instances)");
    (MemoryBudget::new(split.chargeable), split.engine)
}

/// Binds `addr` (port 0 picks a free one) and returns the listener and its address.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// `facegate serve`: load everything, listen, serve until SIGINT/SIGTERM.
pub async fn run(mut config: ServeConfig) -> anyhow::Result<()> {
    // Before the model loads (minutes on a GPU): a refusal comes at once.
    preflight(&config)?;
    // Before anything opens files: the connection caps get their descriptors.
    http::open_files::fit_connections(&mut config)?;
    let models = load_models(&config.engine)?;
    let gateway = Gateway::new(&config, models)?;
    let shutdown = shutdown_signal()?;
    let (listener, addr) = bind(config.listen).await?;
    let scheme = if config.tls_cert.is_some() { "https" } else { "http" };
    tracing::info!(%addr, scheme, "facegate listening");
    print_demo_key(&config, &gateway.seeded_keys, scheme, addr);
    println!("facegate listening on {scheme}://{addr}");
    match config.admin_listen {
        Some(admin_addr) => {
            let (admin, admin_addr) = bind(admin_addr).await?;
            let admin_scheme = if config.admin_tls_files().is_some() { "https" } else { "http" };
            tracing::info!(%admin_addr, scheme = admin_scheme, "admin API and metrics listening");
            println!(
                "admin API and metrics on {admin_scheme}://{admin_addr} (for the CLI: export FACEGATE_URL={admin_scheme}://{admin_addr})"
            );
            gateway.serve_split(listener, admin, shutdown).await
        }
        None => gateway.serve(listener, shutdown).await,
    }
}

/// What must hold before anything is loaded: the secrets (see
/// [`ServeConfig::check_secrets`]) and a data directory of this user's own,
/// closed to others ([`control::blobs::prepare_data_dir`]).
fn preflight(config: &ServeConfig) -> anyhow::Result<()> {
    config.check_secrets()?;
    config.check_registries()?;
    control::blobs::prepare_data_dir(&config.data_dir)
}

/// The key that seals the artifacts this node shares through a cluster's
/// store (see `control::components`): from `--artifact-key` only, never the
/// admin token. Without one, sharing is off (each node compiles each deploy
/// itself), said once here; a single node's store shares nothing anyway.
fn shared_artifact_key(config: &ServeConfig) -> Option<crate::control::ArtifactKey> {
    if !config.share_artifacts || !control::store::is_shared(config.store.as_deref()) {
        return None;
    }
    let key = config.artifact_key.as_deref().map(crate::control::ArtifactKey::derive);
    if key.is_none() {
        tracing::warn!(
            "no --artifact-key (FACEGATE_ARTIFACT_KEY): compiled handlers are not shared with the other nodes; each node compiles every deploy itself"
        );
    }
    key
}

/// The secrets key: `--secrets-key`, else `--secrets-key-file`, else (one
/// node's own store) the data directory's; nodes sharing a store without
/// one keep no secrets (each would seal with a key the others lack).
fn secrets_key(config: &ServeConfig) -> anyhow::Result<Option<crate::control::secrets::SecretsKey>> {
    use crate::control::secrets::SecretsKey;
    let key = match (&config.secrets_key, &config.secrets_key_file) {
        (Some(hex), _) => Some(SecretsKey::from_hex(hex, "--secrets-key (FACEGATE_SECRETS_KEY)")?),
        (None, Some(path)) => Some(SecretsKey::from_file(path)?),
        // The data directory is prepared already (`preflight`).
        (None, None) if !control::store::is_shared(config.store.as_deref()) => Some(SecretsKey::in_data_dir(&config.data_dir)?),
        (None, None) => {
            tracing::warn!("no --secrets-key (FACEGATE_SECRETS_KEY): tenants' registry credentials cannot be kept");
            None
        }
    };
    if let Some(key) = &key {
        tracing::info!(fingerprint = %key.fingerprint(), "secrets key");
    }
    Ok(key)
}

/// A first-time user's way in: where the seeded tenants' keys are saved
/// (never the keys themselves: stdout ends up in container logs) and a
/// request to try.
fn print_demo_key(config: &ServeConfig, seeded: &[crate::control::SeededKey], scheme: &str, addr: SocketAddr) {
    for key in seeded {
        println!("tenant {}: new API key saved in {}", key.tenant, key.path.display());
    }
    let path = config.data_dir.join("demo.key");
    if path.exists() {
        println!(
            "try: curl -s -H \"Authorization: Bearer $(cat {})\" --data-binary @runtime/tests/fixtures/images/grace_hopper.jpg {scheme}://{addr}/v1/demo/detect",
            path.display()
        );
    }
}

/// The pipeline component's bytes, if the file is there (a warning otherwise:
/// only handlers that import the pipeline need it).
fn read_pipeline(path: &std::path::Path) -> Option<Arc<[u8]>> {
    match std::fs::read(path) {
        Ok(bytes) => Some(bytes.into()),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "no pipeline component: uploads that import facegate:face-detect/pipeline are refused");
            None
        }
    }
}

/// Traces as `config.traces` says, each model's batches among them.
fn trace_requests(config: &ServeConfig, models: &Models) -> anyhow::Result<Tracing> {
    let node = config.node_name();
    let tracing = Tracing::new(&config.traces, &node)?;
    if let Some(observer) = tracing.batch_observer() {
        models.observe(observer);
    }
    Ok(tracing)
}

/// Resolves at the first SIGTERM or SIGINT (Ctrl-C). The handlers are
/// installed here, when called, not when the future is first polled: a
/// signal that comes as soon as the listener opens drains the gateway
/// instead of killing it.
fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
        let mut interrupt = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
        Ok(async move {
            tokio::select! { _ = term.recv() => {}, _ = interrupt.recv() => {} }
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}

/// The connections of handlers' state to the store's database (opened at
/// their first call, after the store has migrated).
fn state_pool(config: &ServeConfig) -> anyhow::Result<Arc<crate::kv::KvPool>> {
    let workers = usize::from(config.state_connections);
    match config.store.as_deref() {
        Some(url) if control::store::is_shared(Some(url)) => {
            crate::kv::KvPool::postgres(control::store::postgres::client_config(url)?, workers)
        }
        _ => crate::kv::KvPool::sqlite(config.data_dir.join(control::store::DB_FILE), workers),
    }
}
