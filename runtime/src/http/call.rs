//! A tenant's call of its handler: authentication, admission (the
//! tenant's rate and concurrency, the inference backlog, the node's memory,
//! instance slots), the body, the sandbox, and the answer its outcome gives.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use facegate_host_gpu::Promise;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use opentelemetry::KeyValue;

use super::app::{App, REQUEST_ID_HEADER, VERSION_HEADER};
use super::auth::bearer;
use super::body::{content_length, read_body};
use super::conn::Tls;
use super::mount::Mount;
use super::response::{self, Body};
use crate::admission::gate::TenantGate;
use crate::admission::limits::Limit;
use crate::admission::memory::{self, Charge, REQUEST_BASE_BYTES};
use crate::admission::slots::Refusal;
use crate::control::keys::Scopes;
use crate::control::store::StoreError;
use crate::control::{LiveCanary, Side};
use crate::sandbox::handler::Handler;
use crate::sandbox::{RequestTag, SandboxError, SandboxLimits};
use crate::telemetry::logs::{LogOwner, LogRecord};
use crate::telemetry::trace::RequestTrace;
use crate::telemetry::usage::{BytesOut, Usage, UsageKey};

/// A number from 0 to 99, uniformly (99, the active version's side, when
/// the system has no randomness to give).
fn draw_percent() -> u8 {
    getrandom::u32().map_or(99, |r| (r % 100) as u8)
}

/// The Content-Security-Policy of every handler answer. Handlers answer
/// on the console's origin: sandboxed, a `text/html` answer runs no script
/// and is an opaque origin, with no reach into the console's storage or
/// its same-origin API calls.
pub const HANDLER_CONTENT_SECURITY_POLICY: &str = "sandbox";

/// Adds [`HANDLER_CONTENT_SECURITY_POLICY`] to a handler's answer. Added
/// beside any policy the handler set, never in its place: a browser
/// enforces every policy an answer carries, so a handler may tighten its
/// answer's policy but cannot lift the sandbox.
fn sandbox_answer(response: &mut Response<Body>) {
    let policy = hyper::header::HeaderValue::from_static(HANDLER_CONTENT_SECURITY_POLICY);
    response.headers_mut().append(hyper::header::CONTENT_SECURITY_POLICY, policy);
}

/// One call of a handler, as its admission and run see it.
struct Call<'a> {
    id: &'a Arc<str>,
    /// Its usage bucket.
    key: &'a UsageKey,
    trace: &'a RequestTrace,
    /// The limit that refused or stopped it, for its tenant's log.
    hit: OnceLock<Limit>,
    /// Whether it reached its handler (was not refused before).
    ran: std::sync::atomic::AtomicBool,
    /// The tenant's log its records go to (the tenant as it was at the call's start).
    log: LogOwner,
    /// The handler's settings as the call started (`wasi:config/store`).
    settings: crate::sandbox::settings::HandlerSettings,
    /// Whose state its `wasi:keyvalue` calls reach: the tenant as it was at the call's start.
    owner: Option<crate::kv::Owner>,
}

impl App {
    /// Authenticates, admits (tenant rate and concurrency, instance slots)
    /// and runs a tenant's handler, which gets the path below `mount` (see
    /// [`Mount::apply`]). Authentication comes first and never looks at
    /// the path's tenant: an unknown tenant and another tenant's handler
    /// give the same 404 after the same work.
    pub(super) async fn call_handler(&self, (tenant, name, mount): (&str, &str, Mount), mut req: Request<Incoming>) -> Response<Body> {
        let started = Instant::now();
        let server = self.tracing.server_span(started, req.headers(), (req.method(), mount.route, req.uri().path()));
        let live = self.control.serving.live();
        let Some((key_tenant, scopes)) = live.authenticate(bearer(&req)) else {
            server.status(401);
            let mut refusal = response::error(StatusCode::UNAUTHORIZED, "unauthorized", "missing, invalid or revoked API key");
            refusal.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
            return response::before_body(refusal);
        };
        let found = (key_tenant == tenant).then(|| live.handler(tenant, name)).flatten();
        let canary = found.and_then(|_| live.canary(tenant, name)).cloned();
        let entry = live.tenants.get(tenant);
        let log = entry.map(|e| LogOwner::new(tenant, &e.incarnation));
        let incarnation = entry.map(|e| Arc::clone(&e.incarnation));
        let settings = live.settings(tenant, name);
        let Some((gate, stable)) = found.map(|(g, h)| (Arc::clone(g), Arc::clone(h))) else {
            server.status(404);
            return response::before_body(response::error(
                StatusCode::NOT_FOUND,
                "unknown_handler",
                format!("no handler {name:?} for tenant {tenant:?}"),
            ));
        };
        drop(live);
        // A canary takes its share of the requests, drawn one by one: every
        // node of a cluster draws alike, so the split holds on all.
        let side = canary.as_ref().map(|c| c.side(draw_percent()));
        let handler = match (&canary, side) {
            (Some(c), Some(Side::Canary)) => Arc::clone(&c.handler),
            _ => stable,
        };
        if !scopes.contains(Scopes::INVOKE) {
            server.status(403);
            return response::before_body(response::error(StatusCode::FORBIDDEN, "forbidden", "this key lacks the invoke scope"));
        }
        // The handler never sees the tenant's key.
        req.headers_mut().remove(hyper::header::AUTHORIZATION);
        let scheme = if req.extensions().get::<Tls>().is_some() { "https" } else { "http" };
        mount.apply(&mut req, handler.guest_path, scheme);
        let id = self.request_ids.next();
        server.handler((tenant, name, handler.version), &id);
        server.trace().span("authenticate", (started, Instant::now()), Vec::new);
        // Metered in the minute it started (see crate::telemetry::usage).
        let key = UsageKey::new(tenant, name, handler.version, crate::control::store::now_ms());
        let log = log.unwrap_or_else(|| LogOwner::new(tenant, ""));
        let call = Call {
            id: &id,
            key: &key,
            trace: server.trace(),
            hit: OnceLock::new(),
            ran: Default::default(),
            log,
            settings,
            owner: incarnation.map(|incarnation| crate::kv::Owner { tenant: Arc::clone(&handler.tenant), incarnation }),
        };
        let response = self.run_handler(&gate, &handler, req, &call).await;
        let status = response.status().as_u16();
        server.status(status);
        let outcome = (status, started.elapsed());
        let record = LogRecord::request((name, handler.version), &id, outcome, call.hit.get().map(|l| l.label())).at_path(&mount.rest);
        self.sandbox.logs().push(&call.log, record);
        // Only what a version answered counts, not a refusal before it ran.
        if let (Some(canary), Some(side)) = (canary, side)
            && call.ran.load(std::sync::atomic::Ordering::Relaxed)
        {
            self.count_canary(canary, side, status);
        }
        self.metrics.record(tenant, name, status, outcome.1);
        let meter = self.control.usage.meter();
        meter.add(&key, &Usage::answer(status, outcome.1));
        // The server span ends when the answer's body is sent.
        let mut response = response::counted(response, (BytesOut::new(Arc::clone(meter), key), server));
        if let Ok(value) = hyper::header::HeaderValue::from_str(&id) {
            response.headers_mut().insert(REQUEST_ID_HEADER, value);
        }
        sandbox_answer(&mut response);
        response
    }

    async fn run_handler(&self, gate: &TenantGate, handler: &Arc<Handler>, req: Request<Incoming>, call: &Call<'_>) -> Response<Body> {
        let (id, key, trace) = (call.id, call.key, call.trace);
        let admitting = Instant::now();
        let (limits, tenant) = (&gate.limits, &handler.tenant);
        if let Err(wait) = gate.rate.try_take() {
            self.refused(call, ("admit", admitting), tenant, Limit::Rate);
            let message = "the tenant's request rate is exceeded";
            return response::before_body(response::retry_after_wait(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message, wait));
        }
        // The tenant's slot is taken before the body is read (a slow upload
        // holds one of the tenant's own slots); the slots live as long as
        // the guest (they move into the guest's task).
        let Some(tenant_slot) = gate.concurrency.try_acquire() else {
            self.refused(call, ("admit", admitting), tenant, Limit::Concurrency);
            return response::before_body(response::retry_later(
                StatusCode::TOO_MANY_REQUESTS,
                "concurrency_limited",
                "the tenant has too many requests in flight",
                1,
            ));
        };
        // The backlog before the body: a request that could not finish is
        // refused before it reads, decodes or instantiates anything.
        let promise = match self.admit_backlog(handler, limits.timeout()) {
            Ok(promise) => promise,
            Err(wait) => {
                self.refused(call, ("admit", admitting), tenant, Limit::Backlog);
                let message = format!(
                    "the inference work queued ahead would take {:.1} s, past this request's {:.1} s deadline",
                    wait.as_secs_f64(),
                    limits.timeout().as_secs_f64()
                );
                // By then the work now ahead is done. `as` saturates.
                let seconds = wait.as_secs_f64().ceil().clamp(1.0, 300.0) as u32;
                return response::before_body(response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "overloaded", &message, seconds));
            }
        };
        // Memory before the body: a refusal reads nothing and makes nothing.
        let mut memory = match self.admit_memory(tenant, &req, limits.max_body_bytes) {
            Ok(charge) => charge,
            Err(refusal) => {
                self.refused(call, ("admit", admitting), tenant, Limit::NodeMemory);
                return response::before_body(response::retry_later(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    &refusal.to_string(),
                    1,
                ));
            }
        };
        let reading = Instant::now();
        trace.span("admit", (admitting, reading), Vec::new);
        let req = match read_body(req, limits.max_body_bytes, limits.timeout(), Some(&mut memory)).await {
            Ok(req) => {
                // The body read, its reservation shrinks to its size.
                let body = hyper::body::Body::size_hint(req.body()).exact().unwrap_or(0) as usize;
                trace.span("read body", (reading, Instant::now()), || vec![KeyValue::new("http.request.body.size", body as i64)]);
                let _ = memory.resize(body.saturating_add(REQUEST_BASE_BYTES));
                self.control.usage.meter().add(key, &Usage { bytes_in: body as u64, ..Usage::default() });
                req
            }
            Err((limit, refusal)) => {
                match limit {
                    Some(limit) => self.refused(call, ("read body", reading), tenant, limit),
                    None => trace.failed("read body", (reading, Instant::now()), "the body could not be read"),
                }
                return refusal;
            }
        };
        // The shared instance slot only once the body is in: a slow upload
        // does not pin one.
        let instance = match self.instances.try_acquire(tenant) {
            Ok(slot) => slot,
            Err(refusal) => {
                self.refused(call, ("admit", Instant::now()), tenant, Limit::Instances);
                let message = match refusal {
                    Refusal::Full => "all handler instances are busy",
                    Refusal::FairShare => "handler instances are scarce and this tenant holds its fair share of them",
                };
                return response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message, 1);
            }
        };
        // The deadline covers the guest, queueing and inference, not the upload.
        let deadline = Instant::now() + limits.timeout();
        let sandbox_limits = SandboxLimits { tenant: *limits, max_host_resources: self.config.max_host_resources };
        call.ran.store(true, std::sync::atomic::Ordering::Relaxed);
        let usage = Some((Arc::clone(self.control.usage.meter()), key.clone()));
        let settings = call.settings.clone();
        let owner = call.owner.clone();
        let tag = RequestTag { id: Arc::clone(id), usage, trace: trace.clone(), log: call.log.clone(), settings, owner };
        match self.sandbox.handle(handler, req, deadline, sandbox_limits, tag, (instance, tenant_slot, memory, promise)).await {
            Ok(mut response) => {
                response.headers_mut().insert(VERSION_HEADER, hyper::header::HeaderValue::from(handler.version));
                response
            }
            Err(e) => {
                if let Some(limit) = e.limit() {
                    let _ = call.hit.set(limit);
                }
                let mut failure = self.sandbox_error(handler, id, &e);
                // Which version failed, as on its answers.
                failure.headers_mut().insert(VERSION_HEADER, hyper::header::HeaderValue::from(handler.version));
                failure
            }
        }
    }

    /// Counts an answer of a handler with a canary; when the canary's abort
    /// rule holds, ends the canary (through the store, so every node does).
    fn count_canary(&self, canary: Arc<LiveCanary>, side: Side, status: u16) {
        if !canary.record(side, status) {
            return;
        }
        let (control, handler) = (Arc::clone(&self.control), Arc::clone(&canary.handler));
        let [(stable, stable_5xx), (served, served_5xx)] = canary.counted();
        tracing::warn!(tenant = %handler.tenant, handler = %handler.name, version = handler.version, served, served_5xx, stable, stable_5xx, "canary failing past its abort rule: aborting it");
        tokio::task::spawn_blocking(move || match control.releases.abort_canary(&handler.tenant, &handler.name, Some(handler.version)) {
            Ok(_) | Err(StoreError::NotFound(_)) => {}
            Err(e) => {
                tracing::warn!(tenant = %handler.tenant, handler = %handler.name, error = %e, "canary abort failed; the next failing answer tries again");
                canary.abort_failed();
            }
        });
    }

    /// A request of `tenant` refused by `limit`: counted as its hit (and
    /// the call's), and the span `name` (from its `start` to now) failed,
    /// naming the limit.
    fn refused(&self, call: &Call<'_>, (name, start): (&'static str, Instant), tenant: &str, limit: Limit) {
        self.hits().hit(tenant, limit);
        let _ = call.hit.set(limit);
        call.trace.failed(name, (start, Instant::now()), limit.label());
    }

    /// Promises the handler's usual inference call (its last call's model
    /// and cost) to that model's batcher, or the estimated wait when the
    /// work ahead would outlast `deadline` less the guest's usual time of
    /// its own. A handler that has made no call yet is admitted without a
    /// promise; its calls are still checked as they queue.
    fn admit_backlog(&self, handler: &Handler, deadline: Duration) -> Result<Option<Promise>, Duration> {
        let habits = handler.profile.get();
        let Some((model, cost)) = habits.call.as_ref() else { return Ok(None) };
        let Some(batcher) = self.sandbox.models().get(model) else { return Ok(None) };
        batcher.admit(&handler.tenant, *cost, deadline.saturating_sub(habits.guest_time())).map(Some)
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
        if let Some(limit) = err.limit() {
            self.hits().hit(&handler.tenant, limit);
        }
        let answer = err.answer();
        match answer.retry_after {
            Some(seconds) => response::retry_later(answer.status, answer.code, &answer.message, seconds),
            None => response::error(answer.status, answer.code, answer.message),
        }
    }
}
