//! An answer ends only once its handler has: the last bytes of a handler's
//! body (or the body's end, when its length is not declared) are held
//! until the guest's task is gone and with it the call's slots (the
//! tenant's concurrency slot, the instance slot, its memory charge).
//!
//! Why: a client that reads an answer in full and sends its next call at
//! once must find its earlier call's slots free. Without the hold, the
//! guest's return, its log capture and its store's teardown race the
//! client's next call, and a tenant at its concurrency limit is refused
//! (429 `concurrency_limited`) by its own finished calls on a busy node.
//! A handler that keeps running after its body is written delays its
//! answer's end (up to its deadline), which is what it costs the tenant.
//!
//! hyper ends an HTTP/1 body of declared length on its last byte without
//! asking for the body's end, so the frame that completes a declared
//! length is held, not only the end. An error in the body (the response
//! cap, a guest's abort) is held too, so a retry finds the slots free.
//! Whatever is held, the body behind it is dropped at once: a guest that
//! writes on (past its length, after an error) sees it closed instead of
//! waiting for room that no one makes. Bodies hyper never sends (HEAD,
//! 204, 304, a declared length of 0) are dropped before the head is
//! answered (see [`is_bodiless`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::sync::oneshot;
use wasmtime_wasi_http::p2::body::HyperOutgoingBody;

/// Sent (by being dropped) when the guest's task is gone.
pub type GuestGone = oneshot::Receiver<()>;

/// A frame of the handler's body, as hyper polls it.
type Polled = Option<Result<Frame<Bytes>, wasmtime_wasi_http::Error>>;

/// Holds the last frame of a handler's body until its guest is gone.
struct EndsWithGuest<B> {
    /// The handler's body, until its last frame is taken.
    body: Option<B>,
    gone: Option<GuestGone>,
    /// Bytes still to come of a declared length.
    remaining: Option<u64>,
    /// The last frame, held until `gone` resolves.
    last: Option<Polled>,
}

/// `response` whose body's last frame waits for `gone` (see the module).
pub fn after_guest(response: hyper::Response<HyperOutgoingBody>, gone: GuestGone) -> hyper::Response<HyperOutgoingBody> {
    let remaining = declared_length(&response);
    response.map(|body| EndsWithGuest { body: Some(body), gone: Some(gone), remaining, last: None }.boxed_unsync())
}

/// Whether hyper sends no body with this answer to a request of `method`:
/// it would then drop the body unpolled, so its end says nothing.
pub fn is_bodiless(method: &hyper::Method, response: &hyper::Response<HyperOutgoingBody>) -> bool {
    let status = response.status();
    method == hyper::Method::HEAD
        || status.is_informational()
        || status == hyper::StatusCode::NO_CONTENT
        || status == hyper::StatusCode::NOT_MODIFIED
        || declared_length(response) == Some(0)
}

/// A bodiless answer (see [`is_bodiless`]) to a request of `method`, its
/// body dropped (a guest still writing it sees it closed) for an empty
/// one. A `Content-Length` is kept for HEAD only: on any other bodiless
/// answer hyper would drop it anyway, with a warning in the operator's
/// log for each answer whose length is not 0.
pub fn emptied(response: hyper::Response<HyperOutgoingBody>, method: &hyper::Method) -> hyper::Response<HyperOutgoingBody> {
    let (mut parts, body) = response.into_parts();
    drop(body);
    if method != hyper::Method::HEAD {
        parts.headers.remove(hyper::header::CONTENT_LENGTH);
    }
    hyper::Response::from_parts(parts, empty())
}

/// A body of nothing, as a handler's body.
fn empty() -> HyperOutgoingBody {
    http_body_util::Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// The body length the handler declared in `Content-Length`, if it did.
pub(super) fn declared_length<B>(response: &hyper::Response<B>) -> Option<u64> {
    response.headers().get(hyper::header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

impl<B> EndsWithGuest<B> {
    /// Whether `frame` ends the body: its end, an error, trailers, or the
    /// data that completes a declared length.
    fn is_last(&mut self, frame: &Polled) -> bool {
        match frame {
            None | Some(Err(_)) => true,
            Some(Ok(frame)) => match (frame.data_ref(), self.remaining.as_mut()) {
                (Some(data), Some(remaining)) => {
                    *remaining = remaining.saturating_sub(data.len() as u64);
                    *remaining == 0
                }
                (Some(_), None) => false,
                (None, _) => frame.is_trailers(),
            },
        }
    }
}

impl<B> Body for EndsWithGuest<B>
where
    B: Body<Data = Bytes, Error = wasmtime_wasi_http::Error> + Unpin,
{
    type Data = Bytes;
    type Error = wasmtime_wasi_http::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Polled> {
        let this = self.get_mut();
        if this.last.is_none() {
            let Some(body) = this.body.as_mut() else { return Poll::Ready(None) };
            let frame = ready!(Pin::new(body).poll_frame(cx));
            if !this.is_last(&frame) {
                return Poll::Ready(frame);
            }
            this.body = None;
            this.last = Some(frame);
        }
        if let Some(gone) = this.gone.as_mut() {
            // Dropped or sent: either way the guest's task has ended.
            let _ = ready!(Pin::new(gone).poll(cx));
            this.gone = None;
        }
        Poll::Ready(this.last.take().flatten())
    }

    fn size_hint(&self) -> SizeHint {
        self.body.as_ref().map_or_else(SizeHint::default, Body::size_hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// What the test's guest writes: a chunk, or a failure of its body.
    type Written = Result<&'static str, ()>;

    /// A body of what the test writes, ending when the writer goes.
    struct Fed(tokio::sync::mpsc::Receiver<Written>);

    impl Body for Fed {
        type Data = Bytes;
        type Error = wasmtime_wasi_http::Error;

        fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Polled> {
            let written = ready!(self.get_mut().0.poll_recv(cx));
            let failed = wasmtime_wasi_http::Error::HttpResponseBodySize(None);
            Poll::Ready(written.map(|w| w.map(|chunk| Frame::data(Bytes::from_static(chunk.as_bytes()))).map_err(|()| failed)))
        }
    }

    /// An answer (declaring `declared` bytes, if given) whose body the test
    /// writes, and the guest's end it waits for.
    fn answer(declared: Option<usize>) -> (tokio::sync::mpsc::Sender<Written>, oneshot::Sender<()>, HyperOutgoingBody) {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut response = hyper::Response::new(Fed(rx).boxed_unsync());
        if let Some(length) = declared {
            response.headers_mut().insert(hyper::header::CONTENT_LENGTH, length.into());
        }
        let (gone_tx, gone_rx) = oneshot::channel();
        (tx, gone_tx, after_guest(response, gone_rx).into_body())
    }

    /// The next frame as text (`Err` for an error, `None` at the end), or
    /// `None` when none comes within 100 ms.
    async fn next(body: &mut HyperOutgoingBody) -> Option<Option<Result<String, ()>>> {
        let frame = tokio::time::timeout(Duration::from_millis(100), body.frame()).await.ok()?;
        let text = |frame: Frame<Bytes>| String::from_utf8(frame.into_data().unwrap().to_vec()).unwrap();
        Some(frame.map(|f| f.map(text).map_err(|_| ())))
    }

    fn data(text: &str) -> Option<Option<Result<String, ()>>> {
        Some(Some(Ok(text.to_owned())))
    }

    #[tokio::test]
    async fn the_bytes_completing_a_declared_length_wait_for_the_guest() {
        let (tx, gone, mut body) = answer(Some(6));
        tx.send(Ok("abc")).await.unwrap();
        assert_eq!(next(&mut body).await, data("abc"), "earlier frames pass at once");
        tx.send(Ok("def")).await.unwrap();
        assert_eq!(next(&mut body).await, None, "the last frame is held while the guest runs");
        assert!(tx.is_closed(), "the body behind it is closed: a guest writing past its length is not kept waiting");
        drop(gone);
        assert_eq!(next(&mut body).await, data("def"), "and sent once the guest is gone");
        assert_eq!(next(&mut body).await, Some(None));
    }

    #[tokio::test]
    async fn a_body_of_unknown_length_ends_once_the_guest_is_gone() {
        let (tx, gone, mut body) = answer(None);
        tx.send(Ok("abc")).await.unwrap();
        assert_eq!(next(&mut body).await, data("abc"));
        drop(tx);
        assert_eq!(next(&mut body).await, None, "the end is held while the guest runs");
        gone.send(()).unwrap();
        assert_eq!(next(&mut body).await, Some(None));
    }

    #[tokio::test]
    async fn an_error_in_the_body_waits_for_the_guest_and_closes_the_body() {
        let (tx, gone, mut body) = answer(Some(6));
        tx.send(Ok("abc")).await.unwrap();
        tx.send(Err(())).await.unwrap();
        assert_eq!(next(&mut body).await, data("abc"));
        assert_eq!(next(&mut body).await, None, "the error is held while the guest runs");
        assert!(tx.is_closed(), "and the guest sees its body closed");
        drop(gone);
        assert_eq!(next(&mut body).await, Some(Some(Err(()))));
    }

    #[test]
    fn bodies_hyper_never_sends_are_told() {
        let mut response = hyper::Response::new(empty());
        response.headers_mut().insert(hyper::header::CONTENT_LENGTH, 0.into());
        assert!(is_bodiless(&hyper::Method::GET, &response));
        response.headers_mut().insert(hyper::header::CONTENT_LENGTH, 5.into());
        assert!(!is_bodiless(&hyper::Method::GET, &response));
        assert!(is_bodiless(&hyper::Method::HEAD, &response));
        let head = emptied(response, &hyper::Method::HEAD);
        assert!(head.headers().contains_key(hyper::header::CONTENT_LENGTH), "HEAD keeps the length it announces");
        let mut response = head;
        *response.status_mut() = hyper::StatusCode::NO_CONTENT;
        assert!(is_bodiless(&hyper::Method::GET, &response));
        let response = emptied(response, &hyper::Method::GET);
        assert!(!response.headers().contains_key(hyper::header::CONTENT_LENGTH), "no length on a 204");
    }
}
