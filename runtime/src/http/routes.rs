//! Routing and per-request limits, in front of the sandbox.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{CACHE_CONTROL, CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use hyper::{Method, Request, Response, StatusCode, Version};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::response::{self, Body};
use crate::admission::memory::{self, Charge, REQUEST_BASE_BYTES};
use crate::config::ServeConfig;
use crate::control::{ControlPlane, TenantGate};
use crate::handlers::Handler;
use crate::instances::{InstancePool, Refusal};
use crate::metrics::{self, HttpMetrics, Limit, LimitHits};
use crate::sandbox::{Sandbox, SandboxError, SandboxLimits};
use facegate_host_gpu::Models;

/// Longest a client may take to send a request body (also capped by the request timeout).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

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
    sandbox: Arc<Sandbox>,
    pub(crate) models: Models,
    pub(crate) config: ServeConfig,
    pub(super) metrics: Arc<HttpMetrics>,
    instances: Arc<InstancePool>,
    request_ids: RequestIds,
    draining: AtomicBool,
    pub(super) token_failures: super::admin::TokenFailures,
}

/// Request ids: a random prefix per process and a counter, unique across restarts.
struct RequestIds {
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

    fn next(&self) -> Arc<str> {
        format!("{:08x}-{:x}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed)).into()
    }
}

impl App {
    /// Assembles the app from loaded parts.
    pub fn new(control: Arc<ControlPlane>, sandbox: Arc<Sandbox>, models: Models, config: ServeConfig, metrics: Arc<HttpMetrics>) -> Self {
        let instances = Arc::new(InstancePool::new(config.max_instances as usize));
        Self {
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

    /// Dispatches one request arriving on a listener serving `plane`.
    /// Never fails: every problem becomes a response.
    pub async fn route(&self, req: Request<Incoming>, plane: Plane) -> Response<Body> {
        let may_leave_body_unread = req.version() < Version::HTTP_2 && has_body(&req);
        let private = is_private_answer(req.uri().path());
        let mut response = self.dispatch(req, plane).await;
        if private {
            // Keys, tenants and metrics must not stay in a proxy's or browser's cache.
            response.headers_mut().insert(CACHE_CONTROL, hyper::header::HeaderValue::from_static("no-store"));
        }
        // Refusals before the body is read (auth, limits, 413 on the declared
        // length) leave it unread, and hyper may then close the connection.
        // Say so, or a keep-alive client may send its next request on a
        // connection that is going away.
        if may_leave_body_unread && response.extensions().get::<response::BodyUnread>().is_some() {
            response.headers_mut().insert(CONNECTION, hyper::header::HeaderValue::from_static("close"));
        }
        response
    }

    async fn dispatch(&self, req: Request<Incoming>, plane: Plane) -> Response<Body> {
        let path = req.uri().path().to_owned();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (data, admin) = (matches!(plane, Plane::Data | Plane::Both), plane != Plane::Data);
        match (req.method(), segments.as_slice()) {
            (&Method::GET, ["healthz"]) => self.health(),
            (&Method::GET, ["readyz"]) => self.readiness(),
            (&Method::GET, [""] | ["console", _]) if plane != Plane::Reserve => {
                super::console::asset(path.trim_start_matches('/')).unwrap_or_else(not_found_path(&path))
            }
            (&Method::GET, ["v1", "me"]) if data => self.me(&req),
            // Metrics name tenants and handlers: they are for the operator.
            (&Method::GET, ["metrics"]) if admin => match self.metrics_refusal(&req) {
                Some(refusal) => self.token_failures.slowed("metrics", &req, refusal).await,
                None => self.prometheus(),
            },
            (&Method::GET, ["v1", "models"]) if data => self.list_models(),
            (_, ["v1", tenant, handler]) if data => self.call_handler(tenant, handler, req).await,
            (_, ["admin", "v1", rest @ ..]) if admin => self.admin(rest, req).await,
            (_, ["healthz" | "readyz"]) => method_not_allowed(),
            (_, ["metrics"]) if admin => method_not_allowed(),
            (_, ["v1", "models"]) if data => method_not_allowed(),
            // Reserve slots are for the operator; tenants wait for a main slot.
            _ if plane == Plane::Reserve => response::before_body(response::retry_later(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                "all connection slots are in use",
                1,
            )),
            _ => response::before_body(response::error(StatusCode::NOT_FOUND, "not_found", format!("no route for {path}"))),
        }
    }
}

fn not_found_path(path: &str) -> impl FnOnce() -> Response<Body> + '_ {
    move || response::error(StatusCode::NOT_FOUND, "not_found", format!("no route for {path}"))
}

/// Whether the answer to `path` is the operator's or a tenant's own (the
/// admin API, `/metrics`, `/v1/me`), never to be cached; a handler's
/// answers are its own business.
fn is_private_answer(path: &str) -> bool {
    path.starts_with("/admin/") || path == "/metrics" || path.trim_end_matches('/') == "/v1/me"
}

/// Whether an HTTP/1 request declares a body (a length above 0, or chunks).
fn has_body(req: &Request<Incoming>) -> bool {
    content_length(req).map_or(req.headers().contains_key(TRANSFER_ENCODING), |n| n > 0)
}

fn method_not_allowed() -> Response<Body> {
    response::before_body(response::error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "use GET"))
}

impl App {
    fn health(&self) -> Response<Body> {
        let models: Vec<_> = self.models.iter().map(|b| b.spec().name.clone()).collect();
        response::json(
            StatusCode::OK,
            &serde_json::json!({ "status": "ok", "handlers": self.control.live().handler_count(), "models": models }),
        )
    }

    /// Ready: not draining, and the snapshot confirmed against the store
    /// within `--stale-after-s` (the model is loaded before the gateway listens).
    fn readiness(&self) -> Response<Body> {
        let age = self.control.snapshot_age();
        let stale = self.config.stale_after_s > 0 && age > Duration::from_secs(self.config.stale_after_s);
        let draining = self.draining.load(Ordering::Acquire);
        let ready = !stale && !draining;
        let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        response::json(
            status,
            &serde_json::json!({
                "ready": ready,
                "draining": draining,
                "stale": stale,
                "snapshot_age_ms": age.as_millis() as u64,
                "generation": self.control.generation(),
            }),
        )
    }

    fn prometheus(&self) -> Response<Body> {
        let instances = metrics::InstanceCounts {
            in_use: self.instances.in_use(),
            warm: self.sandbox.warm_instances(),
            reused: self.sandbox.reused_instances(),
        };
        let mut text = metrics::render(&self.metrics, self.hits(), &self.models, instances);
        let memory = self.sandbox.memory();
        let node =
            metrics::NodeGauges { memory_budget: memory.total(), memory_charged: memory.used(), live_nodes: self.control.live_nodes() };
        metrics::render_node(&mut text, node);
        response::text("text/plain; version=0.0.4", text)
    }

    fn hits(&self) -> &LimitHits {
        self.sandbox.hits()
    }

    fn list_models(&self) -> Response<Body> {
        let models: Vec<_> = self
            .models
            .iter()
            .map(|b| {
                let s = b.spec();
                serde_json::json!({
                    "name": s.name, "input": {"shape": s.input.shape, "element": s.input.element},
                    "dim_multiple": s.dim_multiple, "max_side": s.max_side, "max_batch": s.max_batch,
                })
            })
            .collect();
        response::json(StatusCode::OK, &serde_json::json!({ "models": models }))
    }

    /// Authenticates, admits (tenant rate and concurrency, instance slots)
    /// and runs a tenant's handler. Authentication comes first and never
    /// looks at the path's tenant: an unknown tenant and another tenant's
    /// handler give the same 404 after the same work.
    async fn call_handler(&self, tenant: &str, name: &str, mut req: Request<Incoming>) -> Response<Body> {
        let started = Instant::now();
        let live = self.control.live();
        let Some(key_tenant) = live.authenticate(bearer(&req)) else {
            let mut refusal = response::error(StatusCode::UNAUTHORIZED, "unauthorized", "missing, invalid or revoked API key");
            refusal.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
            return response::before_body(refusal);
        };
        let found = (key_tenant == tenant).then(|| live.handler(tenant, name)).flatten();
        let Some((gate, handler)) = found.map(|(g, h)| (Arc::clone(g), Arc::clone(h))) else {
            return response::before_body(response::error(
                StatusCode::NOT_FOUND,
                "unknown_handler",
                format!("no handler {name:?} for tenant {tenant:?}"),
            ));
        };
        drop(live);
        // The handler never sees the tenant's key.
        req.headers_mut().remove(hyper::header::AUTHORIZATION);
        let id = self.request_ids.next();
        let mut response = self.run_handler(&gate, &handler, req, &id).await;
        self.metrics.record(tenant, name, response.status().as_u16(), started.elapsed());
        if let Ok(value) = hyper::header::HeaderValue::from_str(&id) {
            response.headers_mut().insert(REQUEST_ID_HEADER, value);
        }
        response
    }

    async fn run_handler(&self, gate: &TenantGate, handler: &Arc<Handler>, req: Request<Incoming>, id: &Arc<str>) -> Response<Body> {
        let (limits, tenant) = (&gate.limits, &handler.tenant);
        if let Err(wait) = gate.rate.try_take() {
            self.hits().hit(tenant, Limit::Rate);
            // `as` saturates: a huge wait becomes u32::MAX seconds, never a panic.
            let seconds = wait.as_secs_f64().ceil().max(1.0) as u32;
            return response::before_body(response::retry_later(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                "the tenant's request rate is exceeded",
                seconds,
            ));
        }
        // The tenant's slot is taken before the body is read (a slow upload
        // holds one of the tenant's own slots); the slots live as long as
        // the guest (they move into the guest's task).
        let Some(tenant_slot) = gate.concurrency.try_acquire() else {
            self.hits().hit(tenant, Limit::Concurrency);
            return response::before_body(response::retry_later(
                StatusCode::TOO_MANY_REQUESTS,
                "concurrency_limited",
                "the tenant has too many requests in flight",
                1,
            ));
        };
        // Memory before the body: a refusal reads nothing and makes nothing.
        let mut memory = match self.admit_memory(tenant, &req, limits.max_body_bytes) {
            Ok(charge) => charge,
            Err(refusal) => {
                self.hits().hit(tenant, Limit::NodeMemory);
                return response::before_body(response::retry_later(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    &refusal.to_string(),
                    1,
                ));
            }
        };
        let req = match read_body(req, limits.max_body_bytes, limits.timeout(), Some(&mut memory)).await {
            Ok(req) => {
                // The body read, its reservation shrinks to its size.
                let body = hyper::body::Body::size_hint(req.body()).exact().unwrap_or(0) as usize;
                let _ = memory.resize(body.saturating_add(REQUEST_BASE_BYTES));
                req
            }
            Err((limit, refusal)) => {
                if let Some(limit) = limit {
                    self.hits().hit(tenant, limit);
                }
                return refusal;
            }
        };
        // The shared instance slot only once the body is in: a slow upload
        // does not pin one.
        let instance = match self.instances.try_acquire(tenant) {
            Ok(slot) => slot,
            Err(refusal) => {
                self.hits().hit(tenant, Limit::Instances);
                let message = match refusal {
                    Refusal::Full => "all handler instances are busy",
                    Refusal::FairShare => "handler instances are scarce and this tenant holds its fair share of them",
                };
                return response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message, 1);
            }
        };
        // The deadline covers the guest, queueing and inference, not the upload.
        let deadline = Instant::now() + limits.timeout();
        let sandbox_limits = SandboxLimits {
            memory_limit: limits.memory_mib << 20,
            max_infer_calls: limits.max_infer_calls,
            max_host_resources: self.config.max_host_resources,
            instance_reuse: limits.instance_reuse,
            max_idle: limits.max_concurrency as usize,
        };
        match self.sandbox.handle(handler, req, deadline, sandbox_limits, Arc::clone(id), (instance, tenant_slot, memory)).await {
            Ok(mut response) => {
                response.headers_mut().insert(VERSION_HEADER, hyper::header::HeaderValue::from(handler.version));
                response
            }
            Err(e) => self.sandbox_error(handler, id, &e),
        }
    }

    /// Charges the request's base and its declared body to the node's
    /// memory budget; a body of undeclared length (chunks) is charged as it
    /// arrives (see [`read_body`]), so a slow upload costs only what it sent.
    fn admit_memory(&self, tenant: &Arc<str>, req: &Request<Incoming>, max_body: usize) -> Result<Charge, memory::Refusal> {
        let body = content_length(req).map_or(0, |n| n.min(max_body as u64) as usize);
        self.sandbox.memory().charge(tenant, body.saturating_add(REQUEST_BASE_BYTES))
    }

    fn sandbox_error(&self, handler: &Handler, id: &str, err: &SandboxError) -> Response<Body> {
        tracing::warn!(tenant = %handler.tenant, handler = %handler.name, request_id = id, error = %err, "handler failed");
        let limit = match err {
            SandboxError::Timeout(_) => Some(Limit::Deadline),
            SandboxError::MemoryLimit(_) => Some(Limit::Memory),
            SandboxError::ResourceLimit(_) => Some(Limit::HostResources),
            SandboxError::NodeMemory(_) => Some(Limit::NodeMemory),
            _ => None,
        };
        if let Some(limit) = limit {
            self.hits().hit(&handler.tenant, limit);
        }
        sandbox_error(err)
    }
}

/// The bearer token of a request, if any.
pub(super) fn bearer(req: &Request<Incoming>) -> Option<&str> {
    let value = req.headers().get(hyper::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token.trim())
}

/// Reads the whole body under a size limit and a read timeout (the shorter
/// of [`BODY_READ_TIMEOUT`] and `timeout`: a slow upload holds a slot).
/// A refusal names the limit it comes from, if any, for the counters.
pub(super) async fn buffer_body(
    req: Request<Incoming>,
    limit: usize,
    timeout: Duration,
) -> Result<Request<Full<Bytes>>, (Option<Limit>, Response<Body>)> {
    read_body(req, limit, timeout, None).await
}

/// Why a body could not be buffered.
enum BodyError {
    TooLarge,
    Unreadable,
    /// The node's memory budget refused the buffer's growth.
    NoMemory(memory::Refusal),
}

/// [`buffer_body`], the buffer charged to `memory` as it grows (its
/// allocation, over the charge's base of [`REQUEST_BASE_BYTES`]), if given:
/// past the node's budget, 503 `overloaded`.
async fn read_body(
    req: Request<Incoming>,
    limit: usize,
    timeout: Duration,
    memory: Option<&mut Charge>,
) -> Result<Request<Full<Bytes>>, (Option<Limit>, Response<Body>)> {
    let too_large = || {
        let refusal = response::error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", format!("request body exceeds {limit} bytes"));
        (Some(Limit::BodySize), response::before_body(refusal))
    };
    let declared = content_length(&req);
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let (mut parts, body) = req.into_parts();
    let read_timeout = BODY_READ_TIMEOUT.min(timeout);
    let declared = declared.map_or(0, |n| n as usize);
    let collected = tokio::time::timeout(read_timeout, collect_charged(body, limit, declared, memory)).await;
    let bytes = match collected {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(BodyError::TooLarge)) => return Err(too_large()),
        Ok(Err(BodyError::Unreadable)) => {
            let refusal = response::error(StatusCode::BAD_REQUEST, "bad_body", "the request body could not be read");
            return Err((None, response::before_body(refusal)));
        }
        Ok(Err(BodyError::NoMemory(refusal))) => {
            let refusal = response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "overloaded", &refusal.to_string(), 1);
            return Err((Some(Limit::NodeMemory), response::before_body(refusal)));
        }
        Err(_) => {
            let refusal = response::error(StatusCode::REQUEST_TIMEOUT, "body_timeout", "request body was not received in time");
            return Err((Some(Limit::BodyTimeout), response::before_body(refusal)));
        }
    };
    if parts.headers.get(HOST).is_some_and(|h| h.to_str().is_err()) {
        return Err((None, response::error(StatusCode::BAD_REQUEST, "bad_host", "the Host header is not valid text")));
    }
    if parts.uri.authority().is_none() && !parts.headers.contains_key(HOST) {
        parts.headers.insert(HOST, hyper::header::HeaderValue::from_static("localhost"));
    }
    Ok(Request::from_parts(parts, Full::new(bytes)))
}

/// Reads `body` whole, at most `limit` bytes, into one buffer of
/// `declared` bytes to start with (the declared length, charged already);
/// each growth (doubling, to at most `limit`) is charged to `memory` before
/// it is made.
async fn collect_charged<B>(mut body: B, limit: usize, declared: usize, mut memory: Option<&mut Charge>) -> Result<Bytes, BodyError>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    let mut buffer: Vec<u8> = Vec::with_capacity(declared.min(limit));
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(|_| BodyError::Unreadable)?.into_data() else {
            // Trailers: nothing to keep.
            continue;
        };
        let wanted = buffer.len().checked_add(data.len()).filter(|&n| n <= limit).ok_or(BodyError::TooLarge)?;
        if wanted > buffer.capacity() {
            let capacity = wanted.max(buffer.capacity().saturating_mul(2)).min(limit);
            if let Some(memory) = memory.as_deref_mut() {
                memory.resize(capacity.saturating_add(REQUEST_BASE_BYTES)).map_err(BodyError::NoMemory)?;
            }
            buffer.reserve_exact(capacity - buffer.len());
        }
        buffer.extend_from_slice(&data);
    }
    // Held from now on: the body, not the doubled buffer (the charge shrinks to it).
    buffer.shrink_to_fit();
    Ok(Bytes::from(buffer))
}

fn content_length(req: &Request<Incoming>) -> Option<u64> {
    req.headers().get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// The client's view of a sandbox failure.
fn sandbox_error(err: &SandboxError) -> Response<Body> {
    match err {
        SandboxError::Timeout(_) => response::error(StatusCode::GATEWAY_TIMEOUT, "handler_timeout", err),
        SandboxError::Trap(_) | SandboxError::MemoryLimit(_) => response::error(StatusCode::INTERNAL_SERVER_ERROR, "handler_trapped", err),
        SandboxError::ResourceLimit(_) => response::error(StatusCode::INTERNAL_SERVER_ERROR, "resource_limit", err),
        // The node ran out, not the handler: the client may retry.
        SandboxError::NodeMemory(_) => response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "overloaded", &err.to_string(), 1),
        SandboxError::NoResponse | SandboxError::Guest(_) => response::error(StatusCode::INTERNAL_SERVER_ERROR, "handler_failed", err),
        SandboxError::Internal(_) => response::error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error"),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::convert::Infallible;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use hyper::body::Frame;

    use super::*;
    use crate::admission::memory::MemoryBudget;

    const MIB: usize = 1 << 20;

    /// A body of undeclared length, sent in chunks.
    struct Chunks(VecDeque<Bytes>);

    impl hyper::body::Body for Chunks {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.pop_front().map(|chunk| Ok(Frame::data(chunk))))
        }
    }

    /// `count` chunks of 1 MiB.
    fn chunks(count: usize) -> Chunks {
        Chunks((0..count).map(|_| Bytes::from(vec![7u8; MIB])).collect())
    }

    #[tokio::test]
    async fn an_undeclared_body_is_charged_as_it_grows_and_refused_past_the_budget() {
        let budget = MemoryBudget::new(8 * MIB);
        let mut charge = budget.charge(&"t".into(), REQUEST_BASE_BYTES).unwrap();
        let body = collect_charged(chunks(3), 16 * MIB, 0, Some(&mut charge)).await.ok().unwrap();
        assert_eq!(body.len(), 3 * MIB);
        assert_eq!(charge.bytes(), REQUEST_BASE_BYTES + 4 * MIB, "the buffer grew to 4 MiB, charged before it grew");
        drop(charge);
        // Past the budget: refused while reading, never over it.
        let mut charge = budget.charge(&"t".into(), REQUEST_BASE_BYTES).unwrap();
        let refused = collect_charged(chunks(6), 16 * MIB, 0, Some(&mut charge)).await;
        assert!(matches!(refused, Err(BodyError::NoMemory(_))));
        assert_eq!((charge.bytes(), budget.used()), (REQUEST_BASE_BYTES + 4 * MIB, 6 * MIB), "the refused growth was not made");
        // The size limit answers first for an oversized body.
        assert!(matches!(collect_charged(chunks(3), 2 * MIB, 0, None).await, Err(BodyError::TooLarge)));
    }
}
