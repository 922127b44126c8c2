//! The app every listener serves: what a request needs (the control
//! plane, sandbox, models, limits, counters), which routes a listener
//! serves ([`Plane`]), and the headers the gateway adds.

use std::sync::Arc;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::admission::slots::InstancePool;
use crate::config::ServeConfig;
use crate::control::ControlPlane;
use crate::sandbox::Sandbox;
use crate::telemetry::trace::Tracing;
use crate::telemetry::{HttpMetrics, LimitHits};
use facegate_host_gpu::Models;

/// Which routes a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plane {
    /// Tenants' handlers, models, health (with `--admin-listen`, the public listener).
    Data,
    /// Admin API, metrics, health (the `--admin-listen` listener).
    Admin,
    /// Everything on one listener (no `--admin-listen`).
    Both,
    /// A reserve connection of a full shared listener (see
    /// [`ADMIN_RESERVE_CONNECTIONS`](super::ADMIN_RESERVE_CONNECTIONS)): the
    /// admin API, metrics and health; anything else gets 503 `overloaded`.
    Reserve,
}

/// Response header naming the handler version that answered.
pub const VERSION_HEADER: &str = "x-facegate-handler-version";

/// Response header carrying the request's id (also in the gateway's log lines about it).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Everything a request needs: the control plane (tenants, keys, handlers),
/// sandbox, models, limits, counters.
pub struct App {
    pub(crate) control: Arc<ControlPlane>,
    pub(super) sandbox: Arc<Sandbox>,
    pub(crate) models: Models,
    pub(crate) config: ServeConfig,
    pub(super) metrics: Arc<HttpMetrics>,
    pub(super) instances: Arc<InstancePool>,
    pub(super) request_ids: RequestIds,
    pub(super) draining: AtomicBool,
    pub(super) token_failures: super::auth::TokenFailures,
    /// Requests' traces (off unless configured).
    pub(crate) tracing: Tracing,
    /// This node's id (`--node-id`, else the host name).
    pub(super) node: Arc<str>,
}

/// Request ids: a random prefix per process and a counter, unique across restarts.
pub(super) struct RequestIds {
    prefix: u32,
    next: AtomicU64,
}

impl RequestIds {
    fn new() -> Self {
        let mut bytes = [0u8; 4];
        // Without entropy the ids are still unique within this process.
        let _ = getrandom::fill(&mut bytes);
        Self { prefix: u32::from_le_bytes(bytes), next: AtomicU64::new(1) }
    }

    pub(super) fn next(&self) -> Arc<str> {
        format!("{:08x}-{:x}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed)).into()
    }
}

impl App {
    /// Assembles the app from loaded parts; requests are traced by `tracing`
    /// (whose batch observer the models' batchers should have).
    pub fn new(
        (control, sandbox, models): (Arc<ControlPlane>, Arc<Sandbox>, Models),
        config: ServeConfig,
        metrics: Arc<HttpMetrics>,
        tracing: Tracing,
    ) -> Self {
        let instances = Arc::new(InstancePool::new(config.max_instances as usize));
        Self {
            node: config.node_name().into(),
            tracing,
            control,
            sandbox,
            models,
            config,
            metrics,
            instances,
            request_ids: RequestIds::new(),
            draining: AtomicBool::new(false),
            token_failures: Default::default(),
        }
    }

    /// Handler instances running now.
    pub fn in_flight(&self) -> usize {
        self.instances.in_use()
    }

    /// Marks the node as draining: `/readyz` answers 503 from now on.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub(super) fn hits(&self) -> &LimitHits {
        self.sandbox.hits()
    }
}
