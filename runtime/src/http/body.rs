//! Reading a request body: under its size limit and a read timeout, and
//! charged to the node's memory budget as it is buffered.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use hyper::{Request, Response, StatusCode};

use super::response::{self, Body};
use crate::admission::limits::Limit;
use crate::admission::memory::{self, Charge, REQUEST_BASE_BYTES};

/// Longest a client may take to send a request body (also capped by the request timeout).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a body could not be buffered.
pub(crate) enum BodyError {
    TooLarge,
    Unreadable,
    /// The node's memory budget refused the buffer's growth.
    NoMemory(memory::Refusal),
}

/// Reads the whole body under a size limit and a read timeout (the shorter
/// of [`BODY_READ_TIMEOUT`] and `timeout`: a slow upload holds a slot), the
/// buffer charged to `memory` as it grows (its allocation, over the
/// charge's base of [`REQUEST_BASE_BYTES`]), if given: past the node's
/// budget, 503 `overloaded`. A refusal names the limit it comes from, if
/// any, for the counters.
pub(super) async fn read_body(
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
pub(crate) async fn collect_charged<B>(
    mut body: B,
    limit: usize,
    declared: usize,
    mut memory: Option<&mut Charge>,
) -> Result<Bytes, BodyError>
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

pub(super) fn content_length(req: &Request<Incoming>) -> Option<u64> {
    declared_length(req.headers())
}

/// The `Content-Length` `headers` declare, if any.
pub(crate) fn declared_length(headers: &hyper::HeaderMap) -> Option<u64> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// Whether an HTTP/1 request declares a body (a length above 0, or chunks).
pub(super) fn has_body(req: &Request<Incoming>) -> bool {
    content_length(req).map_or(req.headers().contains_key(TRANSFER_ENCODING), |n| n > 0)
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
