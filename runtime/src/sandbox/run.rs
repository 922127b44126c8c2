//! Runs one HTTP request through one handler in a fresh store (or a warm
//! instance of the same handler version, see [`crate::sandbox::warm`]): memory
//! limit, epoch deadline with async yield, and a call budget for
//! face-detect. A trap or a timeout ends that request only.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use wasmtime::component::Linker;
use wasmtime::component::ResourceTableError;
use wasmtime::{Engine, Store, Trap, UpdateDeadline};
use wasmtime_wasi_http::p2::bindings::Proxy;
use wasmtime_wasi_http::p2::bindings::http::types::Scheme;
use wasmtime_wasi_http::p2::body::HyperOutgoingBody;
use wasmtime_wasi_http::{FieldMapError, WasiHttpView};

use crate::admission::limits::Limit;
use crate::admission::limits::TenantLimits;
use crate::admission::memory::{MemoryBudget, NodeMemoryExhausted, Refusal};
use crate::kv::{KvPool, Owner};
use crate::sandbox::answer_end;
use crate::sandbox::face_detect::{self, FaceDetectCtx};
use crate::sandbox::handler::Handler;
use crate::sandbox::instance_memory::{InstanceLimiter, MemoryLimitExceeded};
use crate::sandbox::keyvalue::{KvCtx, KvLimits};
use crate::sandbox::outgoing::Egress;
use crate::sandbox::settings::HandlerSettings;
use crate::sandbox::state::{self, GatewayHooks, RequestState};
use crate::sandbox::stdio::escape_for_log;
use crate::sandbox::warm::{WARM_MAX_MEMORY, Warm, WarmBudget};
use crate::telemetry::LimitHits;
use crate::telemetry::logs::{LogOwner, LogRecord, TenantLogs};
use crate::telemetry::trace::RequestTrace;
use facegate_host_gpu::{ModelSpec, Models};
use opentelemetry::KeyValue;

/// Per-request limits of the sandbox: the tenant's, and the node's own.
#[derive(Debug, Clone, Copy)]
pub struct SandboxLimits {
    /// The tenant's limits (`admission::limits`), whole: a new limit needs
    /// no new field here.
    pub tenant: TenantLimits,
    /// Most host resources (resource-table entries) the request may hold at once.
    pub max_host_resources: usize,
}

impl SandboxLimits {
    /// All linear memories and tables of one instance together, bytes.
    fn memory_limit(&self) -> usize {
        self.tenant.memory_mib << 20
    }

    /// Most idle instances the tenant keeps, all its handlers together (its
    /// concurrency limit: more could never be busy at once).
    fn max_idle(&self) -> usize {
        self.tenant.max_concurrency as usize
    }
}

/// Why a request produced no response from its handler.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The request ran past its deadline; the guest was stopped.
    #[error("handler did not answer within {0:?}")]
    Timeout(Duration),
    /// The guest trapped (panic, stack overflow, ...).
    #[error("handler trapped: {0}")]
    Trap(String),
    /// The instance's memories and tables went over the tenant's memory limit.
    #[error("handler trapped: memory limit exceeded ({0} bytes for all memories and tables)")]
    MemoryLimit(usize),
    /// The node's memory budget refused a growth within the request's own
    /// limit (memory is scarce, or the tenant holds its fair share).
    #[error("handler stopped: {0}")]
    NodeMemory(Refusal),
    /// The guest asked the host to hold or make more than its limits allow
    /// (host resources, random bytes).
    #[error("handler stopped: {0}")]
    ResourceLimit(String),
    /// The guest returned without setting a response.
    #[error("handler returned without sending a response")]
    NoResponse,
    /// The guest answered with a wasi:http error code instead of a response
    /// (described briefly, see `guest_text`).
    #[error("handler failed: {0}")]
    Guest(String),
    /// The handler declared a response body longer than the tenant's
    /// `max_response_bytes`; the guest was stopped.
    #[error("handler response exceeds {0} bytes")]
    ResponseTooLarge(usize),
    /// The host failed to set up the request.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Holds a handler's answer to `max` body bytes: a declared length past it
/// is refused before the head is sent ([`SandboxError::ResponseTooLarge`]);
/// a body streamed past it is cut there, its head gone (the client sees
/// the body end in error), and counted as a `response_size` hit.
fn cap_response(
    response: hyper::Response<HyperOutgoingBody>,
    max: usize,
    hits: &Arc<LimitHits>,
    tenant: &Arc<str>,
) -> Result<hyper::Response<HyperOutgoingBody>, SandboxError> {
    if answer_end::declared_length(&response).is_some_and(|length| length > max as u64) {
        return Err(SandboxError::ResponseTooLarge(max));
    }
    let (hits, tenant) = (Arc::clone(hits), Arc::clone(tenant));
    Ok(response.map(|body| {
        http_body_util::Limited::new(body, max)
            .map_err(move |e| match e.downcast::<wasmtime_wasi_http::Error>() {
                Ok(inner) => *inner,
                Err(_) => {
                    hits.hit(&tenant, Limit::ResponseSize);
                    wasmtime_wasi_http::Error::HttpResponseBodySize(Some(max as u64))
                }
            })
            .boxed_unsync()
    }))
}

/// What names a request in the sandbox: its id in the logs, and where its
/// usage is metered (see [`crate::telemetry::usage`]).
pub struct RequestTag {
    /// The request id.
    pub id: Arc<str>,
    /// The meter and bucket its guest time, device time, calls and memory go to.
    pub usage: Option<(Arc<crate::telemetry::usage::Meter>, crate::telemetry::usage::UsageKey)>,
    /// Its trace: the instantiation and the guest are spans of it.
    pub trace: RequestTrace,
    /// The tenant's log its handler's output goes to (this creation of the tenant).
    pub log: LogOwner,
    /// The handler's settings and secrets, as the snapshot held them when the request started.
    pub settings: HandlerSettings,
    /// Whose state its `wasi:keyvalue` calls reach (`None`: none).
    pub owner: Option<Owner>,
}

/// What a client is told of a [`SandboxError`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The HTTP status.
    pub status: hyper::StatusCode,
    /// The stable error code of the JSON body.
    pub code: &'static str,
    /// The message of the JSON body.
    pub message: String,
    /// Seconds for `Retry-After`, when retrying may help.
    pub retry_after: Option<u32>,
}

impl SandboxError {
    /// The limit this failure is counted under, if a limit ended the request.
    pub fn limit(&self) -> Option<Limit> {
        match self {
            Self::Timeout(_) => Some(Limit::Deadline),
            Self::MemoryLimit(_) => Some(Limit::Memory),
            Self::ResourceLimit(_) => Some(Limit::HostResources),
            Self::NodeMemory(_) => Some(Limit::NodeMemory),
            Self::ResponseTooLarge(_) => Some(Limit::ResponseSize),
            _ => None,
        }
    }

    /// The client's view of this failure.
    pub fn answer(&self) -> Answer {
        use hyper::StatusCode;
        let (status, code, retry_after) = match self {
            Self::Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "handler_timeout", None),
            Self::Trap(_) | Self::MemoryLimit(_) => (StatusCode::INTERNAL_SERVER_ERROR, "handler_trapped", None),
            Self::ResourceLimit(_) => (StatusCode::INTERNAL_SERVER_ERROR, "resource_limit", None),
            // The node ran out, not the handler: the client may retry.
            Self::NodeMemory(_) => (StatusCode::SERVICE_UNAVAILABLE, "overloaded", Some(1)),
            Self::NoResponse | Self::Guest(_) => (StatusCode::INTERNAL_SERVER_ERROR, "handler_failed", None),
            Self::ResponseTooLarge(_) => (StatusCode::BAD_GATEWAY, "response_too_large", None),
            // The host's own details stay in its log.
            Self::Internal(_) => {
                return Answer {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    code: "internal",
                    message: "internal error".into(),
                    retry_after: None,
                };
            }
        };
        Answer { status, code, message: self.to_string(), retry_after }
    }
}

/// The engine, linker and inference models every request runs against.
pub struct Sandbox {
    engine: Engine,
    linker: Linker<RequestState>,
    models: Models,
    hits: Arc<LimitHits>,
    logs: Arc<TenantLogs>,
    warm: Arc<WarmBudget>,
    reused: AtomicU64,
    /// Bytes one host call may copy out of a guest (see [`hostcall_fuel`]).
    hostcall_fuel: usize,
    /// Where granted outgoing requests may go.
    egress: Egress,
    /// The node's memory budget, charged by every store.
    memory: Arc<MemoryBudget>,
    /// The handlers' state, if this node keeps it (see [`Sandbox::with_state`]).
    kv: Option<Arc<KvPool>>,
}

/// Deadline marker error, so a timeout is told apart from other traps.
#[derive(Debug, thiserror::Error)]
#[error("request deadline exceeded")]
struct DeadlineReached;

impl Sandbox {
    /// Builds the linker: WASI (granting nothing by configuration),
    /// wasi:http (outgoing requests denied per request unless the tenant is
    /// granted outgoing HTTP, see [`state::GatewayHooks`]) and face-detect;
    /// keeps at most `warm_instances` idle instances for reuse, each for at
    /// most `warm_idle` without a request; granted outgoing requests go
    /// where `egress` allows; every store is charged to `memory`.
    pub fn new(
        engine: Engine,
        models: Models,
        (warm_instances, warm_idle): (usize, Duration),
        egress: Egress,
        memory: Arc<MemoryBudget>,
    ) -> wasmtime::Result<Self> {
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        let options = wasmtime_wasi_http::p2::bindings::LinkOptions::default();
        wasmtime_wasi_http::p2::bindings::http::types::add_to_linker::<_, wasmtime_wasi_http::WasiHttp>(
            &mut linker,
            &options.into(),
            RequestState::http,
        )?;
        face_detect::add_to_linker(&mut linker, state::face_detect_view)?;
        super::settings::add_to_linker(&mut linker, state::settings_view)?;
        super::keyvalue::add_to_linker(&mut linker, state::kv_view)?;
        wasmtime_wasi_http::p2::bindings::http::outgoing_handler::add_to_linker::<_, wasmtime_wasi_http::WasiHttp>(
            &mut linker,
            RequestState::http,
        )?;
        let hostcall_fuel = hostcall_fuel(&models);
        let warm = WarmBudget::new(warm_instances, warm_idle);
        // Idle instances are dropped before any charge is refused.
        let reclaimer: std::sync::Weak<WarmBudget> = Arc::downgrade(&warm);
        memory.set_reclaimer(reclaimer);
        Ok(Self {
            engine,
            linker,
            hostcall_fuel,
            egress,
            memory,
            models,
            hits: Arc::default(),
            logs: Arc::default(),
            warm,
            reused: AtomicU64::new(0),
            kv: None,
        })
    }

    /// Gives handlers their tenants' state on `pool` (without it, every
    /// `wasi:keyvalue` open is `no-such-store`).
    pub fn with_state(mut self, pool: Arc<KvPool>) -> Self {
        self.kv = Some(pool);
        self
    }

    /// The handlers' state, if this node keeps it.
    pub fn state(&self) -> Option<&Arc<KvPool>> {
        self.kv.as_ref()
    }

    /// The per-tenant counters of limit hits.
    pub fn hits(&self) -> &Arc<LimitHits> {
        &self.hits
    }

    /// The tenants' logs (requests' outcomes and their handlers' output).
    pub fn logs(&self) -> &Arc<TenantLogs> {
        &self.logs
    }

    /// Idle instances kept for reuse now, all handlers.
    pub fn warm_instances(&self) -> usize {
        self.warm.idle()
    }

    /// How long an idle instance is kept without a request.
    pub fn warm_idle(&self) -> Duration {
        self.warm.idle_for()
    }

    /// Requests served by a warm instance since start.
    pub fn reused_instances(&self) -> u64 {
        self.reused.load(Ordering::Relaxed)
    }

    /// The inference models requests call.
    pub fn models(&self) -> &Models {
        &self.models
    }

    /// The node's memory budget.
    pub fn memory(&self) -> &Arc<MemoryBudget> {
        &self.memory
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The linker handlers are instantiated with.
    pub fn linker(&self) -> &Linker<RequestState> {
        &self.linker
    }

    /// Runs `request` through `handler` under `limits`, stopping the guest
    /// at `deadline`; `tag` names it in the logs and says where its usage is
    /// metered. `permits` (instance and tenant slots) are held until the
    /// guest is gone, and the answer ends only then (see
    /// [`crate::sandbox::answer_end`]): a failure is answered once the
    /// guest is stopped, a body's last bytes are sent once it has returned.
    pub async fn handle(
        &self,
        handler: &Arc<Handler>,
        request: hyper::Request<Full<Bytes>>,
        deadline: Instant,
        limits: SandboxLimits,
        tag: RequestTag,
        permits: impl Send + 'static,
    ) -> Result<hyper::Response<HyperOutgoingBody>, SandboxError> {
        let method = request.method().clone();
        let (mut store, warm_proxy, served) = self.store_for(handler, deadline, limits);
        let RequestTag { id: request_id, usage, trace, log, settings, owner } = tag;
        store.data_mut().settings = settings;
        store.data_mut().kv = self.kv(handler, owner, deadline, limits);
        trace.set([KeyValue::new("faas.coldstart", warm_proxy.is_none())]);
        if let Some((meter, key)) = usage {
            store.data_mut().kv.meter_as(Arc::clone(&meter), key.clone());
            store.data_mut().face_detect.meter_as(meter, key);
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (req, out) = {
            let mut http = store.data_mut().http();
            let req = http.new_incoming_request(Scheme::Http, request).map_err(internal)?;
            let out = http.new_response_outparam(tx).map_err(internal)?;
            (req, out)
        };
        let pre = handler.pre.clone();
        let (handler_ref, hits, budget) = (Arc::clone(handler), Arc::clone(&self.hits), Arc::clone(&self.warm));
        let logs = Arc::clone(&self.logs);
        let memory = Arc::clone(&self.memory);
        let (gone_tx, gone) = tokio::sync::oneshot::channel::<()>();
        // The guest runs in its own task so it can keep streaming the body
        // after the response head is sent; it is bounded by the same deadline.
        let task = tokio::spawn(async move {
            // The slots are held until the guest and its store are gone or
            // the store is kept warm (declared first, dropped last); then
            // the answer may end (`gone` is dropped after them).
            let _gone = gone_tx;
            let _permits = permits;
            let mut store = store;
            let run = async {
                let proxy = match warm_proxy {
                    Some(proxy) => proxy,
                    None => {
                        let started = Instant::now();
                        let proxy = pre.instantiate_async(&mut store).await;
                        trace.span("instantiate", (started, Instant::now()), Vec::new);
                        proxy?
                    }
                };
                let guest = trace.start("guest", Vec::new);
                store.data_mut().traced(guest.trace());
                let handled = proxy.wasi_http_incoming_handler().call_handle(&mut store, req, out).await;
                if let Err(err) = &handled {
                    guest.trace().fail(err.to_string());
                }
                // A store kept warm keeps nothing of this request's trace.
                store.data_mut().traced(&RequestTrace::default());
                handled?;
                Ok(proxy)
            };
            let result = tokio::time::timeout_at(deadline.into(), run).await;
            log_output(&handler_ref, (&request_id, &log), &store, (&hits, &logs));
            let used = store.data().limiter.used();
            store.data_mut().face_detect.settle(used);
            store.data_mut().kv.settle();
            match result {
                Ok(Ok(proxy)) => {
                    store.data().face_detect.ended();
                    keep_warm(&handler_ref, (&budget, &memory), store, proxy, served + 1, limits);
                    Ok(Ok(()))
                }
                Ok(Err(err)) => Ok(Err(err)),
                Err(elapsed) => Err(elapsed),
            }
        });
        // If the client goes away before the response head, this future is
        // dropped: the guard stops the guest, whose queued inference calls
        // are then skipped before they reach a device.
        let mut task = AbortOnDrop::new(task);
        let timeout = deadline.saturating_duration_since(Instant::now());
        let failure = match tokio::time::timeout_at(deadline.into(), rx).await {
            Ok(Ok(Ok(response))) => match cap_response(response, limits.tenant.max_response_bytes, &self.hits, &handler.tenant) {
                Ok(response) => return Ok(ended_with_guest(response, &method, task, gone).await),
                Err(refused) => refused,
            },
            Ok(Ok(Err(code))) => SandboxError::Guest(guest_text(&code)),
            Ok(Err(_)) => return Err(task_outcome(task.join().await, timeout)),
            Err(_) => SandboxError::Timeout(timeout),
        };
        task.stop().await;
        Err(failure)
    }

    /// A warm instance of `handler` made ready for this request, or a fresh
    /// store (the instance is then made in the guest's task); with how many
    /// requests the instance served before.
    fn store_for(&self, handler: &Handler, deadline: Instant, limits: SandboxLimits) -> (Store<RequestState>, Option<Proxy>, u32) {
        if limits.tenant.instance_reuse <= 1 {
            // The tenant turned reuse off: nothing of earlier requests stays.
            handler.warm.clear();
            return (self.new_store(handler, deadline, limits), None, 0);
        }
        match handler.warm.take() {
            // A lowered memory limit the instance is already past, or a
            // lowered reuse it has reached (it went back under the old
            // limits, while they changed): start afresh.
            Some(Warm { mut store, proxy, served, .. })
                if store.data().limiter.used() <= limits.memory_limit() && served < limits.tenant.instance_reuse =>
            {
                self.renew(&mut store, handler, deadline, limits);
                self.reused.fetch_add(1, Ordering::Relaxed);
                (store, Some(proxy), served)
            }
            _ => (self.new_store(handler, deadline, limits), None, 0),
        }
    }

    /// Gives a warm instance's store this request's deadline, infer-call
    /// budget, memory limit, host-resource cap and an empty output capture.
    fn renew(&self, store: &mut Store<RequestState>, handler: &Handler, deadline: Instant, limits: SandboxLimits) {
        let face = self.face_detect(handler, deadline, limits);
        let state = store.data_mut();
        state.face_detect = face;
        state.deadline = deadline;
        state.limiter.set_limit(limits.memory_limit());
        state.table.set_max_capacity(limits.max_host_resources);
        state.hooks.outgoing_http = handler.outgoing_http;
        state.hooks.deadline = deadline;
        state.stdio.clear();
        store.set_epoch_deadline(1);
    }

    /// The request's state capability: `owner`'s state, within the
    /// tenant's limits, until `deadline`.
    fn kv(&self, handler: &Handler, owner: Option<Owner>, deadline: Instant, limits: SandboxLimits) -> KvCtx {
        let at = self.kv.as_ref().zip(owner).map(|(pool, owner)| (Arc::clone(pool), owner));
        KvCtx::new(at, KvLimits::of(&limits.tenant), deadline, self.memory.empty(&handler.tenant))
    }

    /// The request's face-detect capability: its deadline and call budget,
    /// its inputs charged to the node's memory budget.
    fn face_detect(&self, handler: &Handler, deadline: Instant, limits: SandboxLimits) -> FaceDetectCtx {
        let memory = self.memory.empty(&handler.tenant);
        let who = (Arc::clone(&handler.tenant), Arc::clone(&handler.profile));
        FaceDetectCtx::new(self.models.clone(), who, (deadline, limits.tenant.max_infer_calls, limits.tenant.models), memory)
    }

    fn new_store(&self, handler: &Handler, deadline: Instant, limits: SandboxLimits) -> Store<RequestState> {
        let face = self.face_detect(handler, deadline, limits);
        // One budget for all memories and tables; a growth past it traps with
        // a clear reason instead of letting the guest's allocator abort.
        let limiter = InstanceLimiter::new(limits.memory_limit(), self.memory.empty(&handler.tenant));
        let mut store = Store::new(
            &self.engine,
            RequestState::new(
                face,
                limiter,
                limits.max_host_resources,
                GatewayHooks::new(handler.outgoing_http, Arc::clone(&handler.tenant), self.egress.clone(), deadline),
            ),
        );
        store.limiter(|state| &mut state.limiter);
        store.set_hostcall_fuel(self.hostcall_fuel);
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(|mut ctx| {
            if Instant::now() >= ctx.data().deadline {
                return Err(DeadlineReached.into());
            }
            // Host resources are charged to the node at every tick (at most
            // a request's own host-resource bound is added between two).
            ctx.data_mut().charge_host_resources()?;
            // Yield to tokio at every tick so a spinning guest never holds a host thread.
            Ok(UpdateDeadline::Yield(1))
        });
        store
    }
}

/// Keeps an instance whose request returned cleanly for the next request to
/// its handler version, if the tenant allows another request on it, it
/// holds no host resources but its standard streams, its memory is small
/// enough (see [`crate::sandbox::warm`]) and the node's memory budget is not into
/// its reserve (an idle instance keeps its charge, its host resources
/// re-counted now rather than at the last epoch tick); otherwise drops it.
fn keep_warm(
    handler: &Handler,
    (budget, memory): (&Arc<WarmBudget>, &MemoryBudget),
    mut store: Store<RequestState>,
    proxy: Proxy,
    served: u32,
    limits: SandboxLimits,
) {
    let state = store.data_mut();
    // An idle instance holds no request's settings, nor its state's connections.
    state.settings = HandlerSettings::default();
    state.kv = KvCtx::default();
    let keep = served < limits.tenant.instance_reuse
        && state.holds_only_stdio()
        && state.limiter.used() <= WARM_MAX_MEMORY
        && state.charge_host_resources().is_ok()
        && memory.has_room_beyond_reserve(0);
    if keep {
        handler.warm.put(budget, &handler.tenant, limits.max_idle(), store, proxy, served);
    }
}

/// The guest's `response`, to a request of `method`, made to end once the
/// guest's `task` is gone (see [`crate::sandbox::answer_end`]): a body
/// hyper would never send is dropped (a guest still writing it sees it
/// closed) and the guest awaited; any other is passed on with its last
/// frame held, the guest left to stream it.
async fn ended_with_guest<T>(
    response: hyper::Response<HyperOutgoingBody>,
    method: &hyper::Method,
    mut task: AbortOnDrop<T>,
    gone: answer_end::GuestGone,
) -> hyper::Response<HyperOutgoingBody> {
    if answer_end::is_bodiless(method, &response) {
        let response = answer_end::emptied(response, method);
        let _ = task.join().await;
        return response;
    }
    task.detach();
    answer_end::after_guest(response, gone)
}

/// Aborts the guest's task when dropped, unless detached or joined.
struct AbortOnDrop<T> {
    handle: tokio::task::JoinHandle<T>,
    armed: bool,
}

impl<T> AbortOnDrop<T> {
    fn new(handle: tokio::task::JoinHandle<T>) -> Self {
        Self { handle, armed: true }
    }

    fn detach(&mut self) {
        self.armed = false;
    }

    /// Stops the guest and waits until its task (and what it holds) is gone.
    async fn stop(&mut self) {
        self.handle.abort();
        let _ = self.join().await;
    }

    async fn join(&mut self) -> Result<T, tokio::task::JoinError> {
        // Still armed while waiting: if the client leaves now, the guest stops.
        let result = (&mut self.handle).await;
        self.armed = false;
        result
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        if self.armed {
            self.handle.abort();
        }
    }
}

type TaskResult = Result<Result<wasmtime::Result<()>, tokio::time::error::Elapsed>, tokio::task::JoinError>;

/// Why the guest dropped its response outparam without a response.
fn task_outcome(result: TaskResult, timeout: Duration) -> SandboxError {
    match result {
        Ok(Ok(Ok(()))) => SandboxError::NoResponse,
        Ok(Ok(Err(err))) => classify_trap(&err, timeout),
        Ok(Err(_)) => SandboxError::Timeout(timeout),
        Err(join) => SandboxError::Internal(join.to_string()),
    }
}

fn classify_trap(err: &wasmtime::Error, timeout: Duration) -> SandboxError {
    if err.downcast_ref::<DeadlineReached>().is_some() {
        return SandboxError::Timeout(timeout);
    }
    if let Some(exceeded) = err.chain().find_map(|e| e.downcast_ref::<MemoryLimitExceeded>()) {
        return SandboxError::MemoryLimit(exceeded.limit);
    }
    if let Some(NodeMemoryExhausted(refusal)) = err.chain().find_map(|e| e.downcast_ref::<NodeMemoryExhausted>()) {
        return SandboxError::NodeMemory(*refusal);
    }
    if let Some(limit) = host_limit(err) {
        return SandboxError::ResourceLimit(limit);
    }
    let reason = match err.downcast_ref::<Trap>() {
        Some(Trap::StackOverflow) => "stack overflow".to_owned(),
        Some(Trap::UnreachableCodeReached) => "unreachable executed (a panic or abort in the handler)".to_owned(),
        Some(trap) => trap.to_string(),
        None => root_cause(err),
    };
    SandboxError::Trap(reason)
}

/// Which host-side limit a trap comes from, if any.
fn host_limit(err: &wasmtime::Error) -> Option<String> {
    if err.chain().any(|e| matches!(e.downcast_ref::<ResourceTableError>(), Some(ResourceTableError::Full))) {
        return Some("too many host resources held at once (headers, bodies, streams, pollables)".to_owned());
    }
    if err.chain().any(|e| matches!(e.downcast_ref::<FieldMapError>(), Some(FieldMapError::TotalSizeTooBig | FieldMapError::TooManyFields)))
    {
        return Some("a header map over its size limit".to_owned());
    }
    let text = err.root_cause().to_string();
    // wasmtime's message when a host call's arguments exceed the store's hostcall fuel.
    if text.contains("fuel allocated for hostcalls has been exhausted") {
        return Some("a host call handed over more data than the host takes in one call".to_owned());
    }
    // wasmtime-wasi's message for a `wasi:random` request over its cap.
    (text.starts_with("requested len") && text.contains("exceeds limit")).then(|| "a wasi:random request over its size limit".to_owned())
}

/// Room above the largest model input in [`hostcall_fuel`].
const HOSTCALL_SLACK: usize = 1 << 20;
/// The least [`hostcall_fuel`]: well above what any other host call takes
/// (header maps 64 KiB, stream writes one permit).
const HOSTCALL_FLOOR: usize = 4 << 20;

/// Bytes one host call may copy out of a guest (wasmtime's hostcall fuel,
/// 128 MiB by default): the largest valid model input, with room. wasmtime
/// copies a call's arguments into host memory before the host function
/// runs, outside the tenant's memory limit; a call over this traps instead.
fn hostcall_fuel(models: &Models) -> usize {
    let largest = models.specs().iter().map(ModelSpec::max_input_bytes).max().unwrap_or(0);
    largest.saturating_add(HOSTCALL_SLACK).max(HOSTCALL_FLOOR)
}

/// Longest text of a guest's making (an error code's message) that
/// reaches a log line or an error response.
const GUEST_TEXT_MAX: usize = 1024;

/// `value` as text, cut at [`GUEST_TEXT_MAX`] bytes. Formatting stops
/// there, so a guest's 100 MB message costs the host no more than that.
fn guest_text(value: &dyn std::fmt::Debug) -> String {
    capped(GUEST_TEXT_MAX, |text| write!(text, "{value:?}"))
}

/// What `write` writes, cut at `max` bytes and then marked `… (cut)`.
fn capped(max: usize, write: impl FnOnce(&mut Capped) -> std::fmt::Result) -> String {
    let mut text = Capped { text: String::new(), max };
    if write(&mut text).is_err() {
        text.text.push_str("… (cut)");
    }
    text.text
}

/// Longest error chain of a failed guest written to the log (it can hold
/// a wasm backtrace, whose function names the guest chose).
const LOG_ERROR_MAX: usize = 8 * 1024;

/// A string that refuses (with `fmt::Error`) to grow past `max` bytes.
struct Capped {
    text: String,
    max: usize,
}

impl std::fmt::Write for Capped {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let room = self.max.saturating_sub(self.text.len());
        if s.len() <= room {
            self.text.push_str(s);
            return Ok(());
        }
        let end = (0..=room).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        self.text.push_str(&s[..end]);
        Err(std::fmt::Error)
    }
}

/// The reason shown to the client: known limits by name, anything else
/// generic (the full error goes to the log, not to the client).
fn root_cause(err: &wasmtime::Error) -> String {
    let text = err.root_cause().to_string();
    if text.contains("table") && text.contains("grow") {
        "table limit exceeded".to_owned()
    } else {
        tracing::warn!(error = %error_chain(err).escape_debug(), "guest failed");
        "the handler failed".to_owned()
    }
}

/// `err` and its causes, `: `-separated, cut at [`LOG_ERROR_MAX`] bytes.
fn error_chain(err: &wasmtime::Error) -> String {
    capped(LOG_ERROR_MAX, |causes| {
        err.chain().enumerate().try_for_each(|(i, e)| if i == 0 { write!(causes, "{e}") } else { write!(causes, ": {e}") })
    })
}

/// Logs what the guest wrote to stdout/stderr, escaped and attributed, in
/// the node's log and line by line in its tenant's; counts output dropped
/// past the cap, and `infer` calls and outgoing connections refused by a
/// limit.
fn log_output(
    handler: &Handler,
    (request_id, log): (&str, &LogOwner),
    store: &Store<RequestState>,
    (hits, logs): (&LimitHits, &TenantLogs),
) {
    let (bytes, dropped) = store.data().stdio.contents();
    if !bytes.is_empty() {
        tracing::info!(tenant = %handler.tenant, handler = %handler.name, request_id, dropped_bytes = dropped, output = %escape_for_log(&bytes), "guest output");
        let time_ms = crate::telemetry::logs::now_ms();
        for line in bytes.split(|b| *b == b'\n').filter(|l| !l.iter().all(u8::is_ascii_whitespace)) {
            logs.push(log, LogRecord::output(time_ms, (&handler.name, handler.version), request_id, escape_for_log(line)));
        }
    }
    if dropped > 0 {
        hits.hit(&handler.tenant, Limit::Output);
    }
    let face = &store.data().face_detect;
    if face.quota_refusals > 0 {
        hits.hit(&handler.tenant, Limit::InferCalls);
    }
    if face.overloaded_refusals > 0 {
        hits.hit(&handler.tenant, Limit::Queue);
    }
    if face.backlog_refusals > 0 {
        hits.hit(&handler.tenant, Limit::Backlog);
    }
    if face.memory_refusals > 0 {
        hits.hit(&handler.tenant, Limit::NodeMemory);
    }
    if store.data().hooks.take_refused_connections() > 0 {
        hits.hit(&handler.tenant, Limit::OutgoingConnections);
    }
}

fn internal(err: impl std::fmt::Display) -> SandboxError {
    SandboxError::Internal(err.to_string())
}

#[cfg(test)]
mod tests {
    use wasmtime_wasi_http::p2::bindings::http::types::ErrorCode;

    use super::*;

    /// A handler's answer of `body`, declaring its length or streaming it.
    fn answer(body: &'static [u8], declared: bool) -> hyper::Response<HyperOutgoingBody> {
        let length = body.len();
        let mut response = hyper::Response::new(Full::new(Bytes::from_static(body)).map_err(|never| match never {}).boxed_unsync());
        if declared {
            response.headers_mut().insert(hyper::header::CONTENT_LENGTH, length.into());
        }
        response
    }

    #[tokio::test]
    async fn a_response_past_its_limit_is_refused_or_cut_and_counted() {
        let (hits, tenant): (Arc<LimitHits>, Arc<str>) = (Arc::default(), "t".into());
        let refused = cap_response(answer(&[7; 100], true), 64, &hits, &tenant).unwrap_err();
        assert!(matches!(refused, SandboxError::ResponseTooLarge(64)), "{refused}");
        assert_eq!(refused.answer().status, hyper::StatusCode::BAD_GATEWAY);
        // Streamed without a length: cut at the limit, once counted.
        let streamed = cap_response(answer(&[7; 100], false), 64, &hits, &tenant).unwrap();
        let err = streamed.into_body().collect().await.unwrap_err();
        assert!(matches!(err, wasmtime_wasi_http::Error::HttpResponseBodySize(Some(64))), "{err}");
        assert_eq!(hits.count("t", Limit::ResponseSize), 1);
        // Within the limit: whole.
        let whole = cap_response(answer(&[7; 64], true), 64, &hits, &tenant).unwrap();
        assert_eq!(whole.into_body().collect().await.unwrap().to_bytes().len(), 64);
    }

    #[test]
    fn a_guests_long_error_message_is_cut() {
        let code = ErrorCode::InternalError(Some("\u{1}".repeat(8 << 20)));
        let text = guest_text(&code);
        assert!(text.len() <= GUEST_TEXT_MAX + "… (cut)".len(), "{} bytes", text.len());
        assert!(text.starts_with("ErrorCode::InternalError(Some(\"\\u{1}") && text.ends_with("… (cut)"), "{text}");
        assert_eq!(guest_text(&ErrorCode::ConnectionRefused), "ErrorCode::ConnectionRefused", "short ones are whole");
        let chain = wasmtime::Error::msg("x".repeat(1 << 20)).context("a host call failed");
        let logged = error_chain(&chain);
        assert!(logged.starts_with("a host call failed: xxx") && logged.len() <= LOG_ERROR_MAX + "… (cut)".len(), "{}", logged.len());
        let multibyte = guest_text(&"é".repeat(GUEST_TEXT_MAX));
        assert!(multibyte.ends_with("… (cut)"), "cut on a character boundary: {multibyte}");
    }
}
