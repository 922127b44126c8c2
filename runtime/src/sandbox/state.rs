//! The data of one request's [`wasmtime::Store`]: it owns the single
//! [`ResourceTable`]; each capability borrows it through a view.

use std::sync::Arc;
use std::time::Instant;

use wasmtime::component::ResourceTable;
use wasmtime_wasi::p2::{DynInputStream, DynOutputStream};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};
use wasmtime_wasi_http::{Error as HttpError, RequestOptions, WasiBody, WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView};

use crate::sandbox::face_detect::{FaceDetectCtx, FaceDetectView};
use crate::sandbox::instance_memory::InstanceLimiter;
use crate::sandbox::keyvalue::{KvCtx, KvView};
use crate::sandbox::outgoing::{Caller, Egress, Refusals, Sent};
use crate::sandbox::settings::{HandlerSettings, SettingsView};
use crate::sandbox::stdio::{CappedCapture, STDIO_CAPTURE_BYTES};
use crate::telemetry::trace::RequestTrace;

/// Default most host resources (wasi:http fields, bodies, streams,
/// pollables, ...) one request may hold at once. Rust handlers use about 15.
pub const DEFAULT_MAX_HOST_RESOURCES: usize = 256;
/// Largest in-memory size of one wasi:http `fields` (headers) resource.
pub const FIELD_SIZE_LIMIT: usize = 64 * 1024;
/// Largest write into an outgoing body, and chunks buffered per body: with
/// [`FIELD_SIZE_LIMIT`], no resource holds more than 128 KiB of host memory.
pub const BODY_CHUNK_BYTES: usize = 64 * 1024;
const BODY_BUFFER_CHUNKS: usize = 1;
/// Standard streams a guest's libc may keep open between requests (stdin,
/// stdout, stderr: wasi-libc asks for each once and keeps it).
const STDIO_STREAMS: usize = 3;
/// Largest `wasi:random` request; larger ones trap. One call stays a short
/// stretch of host CPU, and the guest yields at the next epoch tick.
pub const RANDOM_MAX_BYTES: u64 = 1 << 20;

/// Host memory one request can make the host hold through its resources,
/// at most: every resource at its largest. (While a host call runs, its
/// arguments add at most the store's hostcall fuel, see `run.rs`.)
pub fn host_memory_bound(max_host_resources: usize) -> usize {
    max_host_resources * RESOURCE_MAX_BYTES
}

/// Host-side bookkeeping of one stream resource (its box and state; what
/// it buffers is counted elsewhere, see [`host_resource_bytes`]).
const STREAM_BYTES: usize = 1024;

/// Host memory a request holding `streams` stream resources and `others`
/// other resources may hold: each other resource at [`RESOURCE_MAX_BYTES`];
/// each stream at `STREAM_BYTES`, since what a stream buffers is counted
/// with its parent (a body's stream cannot outlive its body, charged in
/// full) or is the output capture, charged once at [`STDIO_CAPTURE_BYTES`]
/// however many standard streams write to it.
pub fn host_resource_bytes(streams: usize, others: usize) -> usize {
    others.saturating_mul(RESOURCE_MAX_BYTES).saturating_add(streams.saturating_mul(STREAM_BYTES)).saturating_add(STDIO_CAPTURE_BYTES)
}

/// Host memory one resource holds at most: a full header map, or a body's
/// buffered chunks and the one being written.
pub const RESOURCE_MAX_BYTES: usize = if FIELD_SIZE_LIMIT > BODY_CHUNK_BYTES * (BODY_BUFFER_CHUNKS + 1) {
    FIELD_SIZE_LIMIT
} else {
    BODY_CHUNK_BYTES * (BODY_BUFFER_CHUNKS + 1)
};

/// The wasi:http hooks of a request: small body buffers, and outgoing
/// requests denied unless the tenant is granted outgoing HTTP.
#[derive(Debug)]
pub struct GatewayHooks {
    /// The tenant's grant.
    pub outgoing_http: bool,
    /// The tenant, whose shares of name lookups and connections a granted request takes.
    pub tenant: Arc<str>,
    /// Where granted requests may go (server-wide).
    pub egress: Egress,
    /// The request's deadline: no outgoing request waits past it.
    pub deadline: Instant,
    /// What the request's outgoing requests were refused (see [`Self::take_refused_connections`]).
    refusals: Arc<Refusals>,
    /// The guest's span: outgoing requests carry its `traceparent`.
    pub trace: RequestTrace,
}

impl GatewayHooks {
    /// The hooks of a request of `tenant` (granted outgoing HTTP or not)
    /// ending at `deadline`, its granted requests going where `egress` allows.
    pub fn new(outgoing_http: bool, tenant: Arc<str>, egress: Egress, deadline: Instant) -> Self {
        Self { outgoing_http, tenant, egress, deadline, refusals: Arc::default(), trace: RequestTrace::default() }
    }

    /// At the end of a request: how many of its outgoing connections the
    /// connection caps refused (a limit hit); the counts start afresh for
    /// the instance's next request.
    pub fn take_refused_connections(&self) -> u32 {
        self.refusals.take_refused_connections()
    }
}

/// What `send_request` returns (the hook's own signature).
type SendFuture = Box<dyn std::future::Future<Output = Result<Sent, HttpError>> + Send>;

impl WasiHttpHooks for GatewayHooks {
    /// Without the grant, every outgoing request fails with
    /// `HTTP-request-denied` (JavaScript components import the interface
    /// whether or not they use it); with it, [`crate::sandbox::outgoing`] sends it
    /// where `egress` allows (`HTTP-request-denied` to a port it does not
    /// list, `destination-IP-prohibited` to an address it refuses,
    /// `connection-limit-reached` past the connection caps).
    fn send_request(
        &mut self,
        request: hyper::Request<WasiBody>,
        options: Option<RequestOptions>,
        fut: Box<dyn std::future::Future<Output = Result<(), HttpError>> + Send>,
    ) -> SendFuture {
        drop(fut);
        if !self.outgoing_http {
            return Box::new(async { Err(HttpError::HttpRequestDenied) });
        }
        let mut request = request;
        // The host's trace context, not one the guest wrote.
        for (name, value) in self.trace.headers() {
            if let Ok(value) = hyper::header::HeaderValue::from_str(&value) {
                request.headers_mut().insert(name, value);
            }
        }
        let caller = Caller { tenant: Arc::clone(&self.tenant), refusals: Arc::clone(&self.refusals) };
        Box::new(crate::sandbox::outgoing::send(request, options, self.egress.clone(), caller, self.deadline))
    }

    fn p2_outgoing_body_buffer_chunks(&mut self) -> usize {
        BODY_BUFFER_CHUNKS
    }

    fn p2_outgoing_body_chunk_size(&mut self) -> usize {
        BODY_CHUNK_BYTES
    }
}

/// Per-request store state.
pub struct RequestState {
    /// The only resource table; WASI, wasi:http and face-detect all borrow it.
    pub table: ResourceTable,
    /// WASI: no preopens, no environment, no sockets, stdio captured.
    pub wasi: WasiCtx,
    /// wasi:http (outgoing requests denied without the tenant's grant, see [`GatewayHooks`]).
    pub http: WasiHttpCtx,
    /// The face-detect capability.
    pub face_detect: FaceDetectCtx,
    /// wasi:http hooks (body buffer sizes).
    pub hooks: GatewayHooks,
    /// The memory budget of this store's memories and tables.
    pub limiter: InstanceLimiter,
    /// The guest is stopped at the first epoch check after this instant.
    pub deadline: Instant,
    /// The guest's stdout and stderr, for the logs.
    pub stdio: CappedCapture,
    /// Its settings and secrets (`wasi:config/store`), as the request started.
    pub settings: HandlerSettings,
    /// Its tenant's state (`wasi:keyvalue`).
    pub kv: KvCtx,
}

impl RequestState {
    /// State for one request: a WASI context that grants nothing, a resource
    /// table of at most `max_host_resources` entries, outgoing HTTP as
    /// `hooks` grant it, stopped at `hooks.deadline`.
    pub fn new(face_detect: FaceDetectCtx, limiter: InstanceLimiter, max_host_resources: usize, hooks: GatewayHooks) -> Self {
        let stdio = CappedCapture::new(STDIO_CAPTURE_BYTES);
        let wasi = WasiCtx::builder()
            .stdout(stdio.clone())
            .stderr(stdio.clone())
            .max_random_size(RANDOM_MAX_BYTES)
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        let mut table = ResourceTable::new();
        table.set_max_capacity(max_host_resources);
        let mut http = WasiHttpCtx::new();
        http.set_field_size_limit(FIELD_SIZE_LIMIT);
        let settings = HandlerSettings::default();
        Self { table, wasi, http, deadline: hooks.deadline, hooks, face_detect, limiter, stdio, settings, kv: KvCtx::default() }
    }

    /// The guest's span of this request: its `infer` calls are its
    /// children, its outgoing requests carry its `traceparent`.
    pub fn traced(&mut self, guest: &RequestTrace) {
        self.face_detect.trace = guest.clone();
        self.hooks.trace = guest.clone();
    }
}

impl RequestState {
    /// Charges what the request's resources may hold now (see
    /// [`host_resource_bytes`]) to the node's memory budget (through the
    /// store's limiter); fails when the budget refuses the growth.
    pub fn charge_host_resources(&mut self) -> Result<(), crate::admission::memory::NodeMemoryExhausted> {
        let (mut streams, mut others) = (0, 0);
        for entry in self.table.iter_mut() {
            if entry.is::<DynInputStream>() || entry.is::<DynOutputStream>() {
                streams += 1;
            } else {
                others += 1;
            }
        }
        self.limiter.set_host_bytes(host_resource_bytes(streams, others))
    }

    /// Whether the resource table holds nothing but standard streams (at most
    /// `STDIO_STREAMS`), so the instance may serve another request: any
    /// other entry (headers, a body, a pollable, ...) is a resource of the
    /// request just served. A body's stream cannot outlive its body, which
    /// is not a stream.
    pub fn holds_only_stdio(&mut self) -> bool {
        let mut streams = 0;
        for entry in self.table.iter_mut() {
            if !(entry.is::<DynInputStream>() || entry.is::<DynOutputStream>()) {
                return false;
            }
            streams += 1;
        }
        streams <= STDIO_STREAMS
    }
}

impl WasiView for RequestState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl WasiHttpView for RequestState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView { ctx: &mut self.http, table: &mut self.table, hooks: &mut self.hooks }
    }
}

/// Projects the settings' view (for [`crate::sandbox::settings::add_to_linker`]).
pub fn settings_view(state: &mut RequestState) -> SettingsView<'_> {
    SettingsView(&state.settings)
}

/// Projects the state's view (for [`crate::sandbox::keyvalue::add_to_linker`]).
pub fn kv_view(state: &mut RequestState) -> KvView<'_> {
    KvView { ctx: &mut state.kv, table: &mut state.table }
}

/// Projects the face-detect view (for [`crate::sandbox::face_detect::add_to_linker`]).
pub fn face_detect_view(state: &mut RequestState) -> FaceDetectView<'_> {
    FaceDetectView::new(&mut state.face_detect)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::outgoing::EgressRules;

    #[test]
    fn standard_streams_are_charged_the_capture_they_share_not_a_body_each() {
        const KIB: usize = 1024;
        // A warm instance's stdin, stdout and stderr: the 16 KiB capture and
        // their bookkeeping, not three full bodies (384 KiB).
        assert_eq!(host_resource_bytes(3, 0), STDIO_CAPTURE_BYTES + 3 * STREAM_BYTES);
        assert!(host_resource_bytes(3, 0) < 20 * KIB);
        // A body and its stream: the body in full.
        assert_eq!(host_resource_bytes(1, 1) - host_resource_bytes(0, 0), RESOURCE_MAX_BYTES + STREAM_BYTES);
        assert_eq!(host_resource_bytes(usize::MAX, 1), usize::MAX, "saturates");
    }

    #[tokio::test]
    async fn outgoing_requests_are_denied_without_the_grant() {
        let request = hyper::Request::get("https://example.com/").body(WasiBody::default()).unwrap();
        let open = Egress::new(EgressRules { allow_private: true, ..EgressRules::default() });
        let mut hooks = GatewayHooks::new(false, "t".into(), open, Instant::now());
        let sent = hooks.send_request(request, None, Box::new(async { Ok(()) }));
        assert!(matches!(Box::into_pin(sent).await, Err(HttpError::HttpRequestDenied)));
    }

    #[tokio::test]
    async fn granted_requests_go_only_where_egress_allows() {
        let request = hyper::Request::get("http://169.254.169.254/latest/").body(WasiBody::default()).unwrap();
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        let mut hooks = GatewayHooks::new(true, "t".into(), Egress::default(), deadline);
        let sent = hooks.send_request(request, None, Box::new(async { Ok(()) }));
        assert!(matches!(Box::into_pin(sent).await, Err(HttpError::DestinationIpProhibited)));
    }
}
