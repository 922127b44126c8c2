//! The data of one request's [`wasmtime::Store`]: it owns the single
//! [`ResourceTable`]; each capability borrows it through a view.

use std::time::Instant;

use wasmtime::StoreLimits;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpView};

use crate::face_detect::{FaceDetectCtx, FaceDetectView};

/// Bytes of a guest's stderr kept for the logs, per request.
pub const STDERR_CAPTURE_BYTES: usize = 16 * 1024;

/// Per-request store state.
pub struct RequestState {
    /// The only resource table; WASI, wasi:http and face-detect all borrow it.
    pub table: ResourceTable,
    /// WASI: no preopens, no environment, no sockets, stdio captured.
    pub wasi: WasiCtx,
    /// wasi:http (incoming side only; outgoing HTTP is not linked).
    pub http: WasiHttpCtx,
    /// The face-detect capability.
    pub face_detect: FaceDetectCtx,
    /// Memory and instance limits of this store.
    pub limits: StoreLimits,
    /// The guest is stopped at the first epoch check after this instant.
    pub deadline: Instant,
    /// The guest's stderr, for the logs.
    pub stderr: MemoryOutputPipe,
}

impl RequestState {
    /// State for one request: a WASI context that grants nothing.
    pub fn new(face_detect: FaceDetectCtx, limits: StoreLimits, deadline: Instant) -> Self {
        let stderr = MemoryOutputPipe::new(STDERR_CAPTURE_BYTES);
        let wasi = WasiCtx::builder()
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        Self { table: ResourceTable::new(), wasi, http: WasiHttpCtx::new(), face_detect, limits, deadline, stderr }
    }
}

impl WasiView for RequestState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl WasiHttpView for RequestState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView { ctx: &mut self.http, table: &mut self.table, hooks: Default::default() }
    }
}

/// Projects the face-detect view (for [`crate::face_detect::add_to_linker`]).
pub fn face_detect_view(state: &mut RequestState) -> FaceDetectView<'_> {
    FaceDetectView::new(&mut state.face_detect)
}
