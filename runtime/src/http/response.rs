//! Host-generated responses: JSON bodies and the `{"error": {...}}` shape
//! that handlers built with the guest SDK also use.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Response, StatusCode};
use wasmtime_wasi_http::p2::body::HyperOutgoingBody;

use crate::control::store::StoreError;
use crate::telemetry::trace::ServerSpan;
use crate::telemetry::usage::BytesOut;

/// The body type of every response: a guest's streaming body or a host buffer.
pub type Body = HyperOutgoingBody;

/// A buffered body.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed_unsync()
}

/// A JSON response.
pub fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut response = Response::new(full(value.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// A JSON error: `{"error": {"code": ..., "message": ...}}`.
pub fn error(status: StatusCode, code: &str, message: impl std::fmt::Display) -> Response<Body> {
    json(status, &serde_json::json!({ "error": { "code": code, "message": message.to_string() } }))
}

/// A 503/429-style refusal with `Retry-After` (seconds).
pub fn retry_later(status: StatusCode, code: &str, message: &str, seconds: u32) -> Response<Body> {
    let mut response = error(status, code, message);
    response.headers_mut().insert(RETRY_AFTER, HeaderValue::from(seconds));
    response
}

/// [`retry_later`] after a token bucket's `wait`: whole seconds, rounded
/// up, at least one.
pub fn retry_after_wait(status: StatusCode, code: &str, message: &str, wait: std::time::Duration) -> Response<Body> {
    // `as` saturates: a huge wait becomes u32::MAX seconds, never a panic.
    retry_later(status, code, message, wait.as_secs_f64().ceil().max(1.0) as u32)
}

/// Marks a response given before the request's body was read: on HTTP/1
/// the connection is then closed and the response says so (`App::route`).
#[derive(Debug, Clone, Copy)]
pub struct BodyUnread;

/// `response`, marked as given before the request's body was read.
pub fn before_body(mut response: Response<Body>) -> Response<Body> {
    response.extensions_mut().insert(BodyUnread);
    response
}

/// A plain-text response (Prometheus exposition format and the like).
pub fn text(content_type: &'static str, body: String) -> Response<Body> {
    let mut response = Response::new(full(body));
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// `response` with its body's bytes counted into `counter` as they are
/// sent (added to the usage meter when the body ends or is dropped), and
/// the request's server span ended then.
pub fn counted(response: Response<Body>, (counter, span): (BytesOut, ServerSpan)) -> Response<Body> {
    response.map(|body| Counted { body, counter, _span: span }.boxed_unsync())
}

/// A body counting the bytes it gives (see [`counted`]).
struct Counted {
    body: Body,
    counter: BytesOut,
    /// Ends when the body is done with.
    _span: ServerSpan,
}

impl hyper::body::Body for Counted {
    type Data = Bytes;
    type Error = <Body as hyper::body::Body>::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.body).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.counter.sent(data.len());
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// The API's answer to a store error: its status, code and message; an
/// internal one is logged here and answered `internal`.
pub fn store_error(e: &StoreError) -> Response<Body> {
    match e {
        StoreError::NotFound(m) => error(StatusCode::NOT_FOUND, "not_found", m),
        StoreError::Conflict(m) => error(StatusCode::CONFLICT, "conflict", m),
        StoreError::Invalid(m) => error(StatusCode::BAD_REQUEST, "invalid", m),
        StoreError::Forbidden(m) => error(StatusCode::FORBIDDEN, "forbidden", m),
        StoreError::Quota(m) => error(StatusCode::FORBIDDEN, "quota_exceeded", m),
        StoreError::TooMany { code, message } => retry_later(StatusCode::TOO_MANY_REQUESTS, code, message, 2),
        StoreError::NoMemory(m) => retry_later(StatusCode::SERVICE_UNAVAILABLE, "overloaded", m, 1),
        StoreError::Busy(m) => retry_later(StatusCode::SERVICE_UNAVAILABLE, "busy", m, 5),
        StoreError::Unavailable(_) => retry_later(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", &e.to_string(), 5),
        StoreError::Internal(err) => {
            tracing::error!(error = %format!("{err:#}"), "admin operation failed");
            error(StatusCode::INTERNAL_SERVER_ERROR, "internal", e)
        }
    }
}
