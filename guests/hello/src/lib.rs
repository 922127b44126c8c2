//! `hello`: the smallest `wasi:http` handler, as `wasmtime serve`'s hello
//! world is: it answers every request `200 hello` without reading the
//! request, through `wasi:http` alone (no SDK helpers, no `face-detect`).
//! `facegate bench --suite overhead` measures what the gateway costs per
//! request with it.

use facegate_guest_sdk::wasi::exports::http::incoming_handler::Guest;
use facegate_guest_sdk::wasi::http::types::{Fields, IncomingRequest, OutgoingBody, OutgoingResponse, ResponseOutparam};

/// The body every request gets.
const HELLO: &[u8] = b"hello\n";

/// The handler.
struct Hello;

impl Guest for Hello {
    fn handle(_request: IncomingRequest, out: ResponseOutparam) {
        let headers = Fields::new();
        // A fixed length: the host sends it as Content-Length, no chunking.
        let _ = headers.set("content-length", &[HELLO.len().to_string().into_bytes()]);
        let response = OutgoingResponse::new(headers);
        let Ok(body) = response.body() else { return };
        ResponseOutparam::set(out, Ok(response));
        if let Ok(stream) = body.write() {
            let _ = stream.blocking_write_and_flush(HELLO);
        }
        let _ = OutgoingBody::finish(body, None);
    }
}

facegate_guest_sdk::wasi::http::proxy::export!(Hello);
