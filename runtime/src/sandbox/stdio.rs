//! A guest's stdout and stderr: captured up to a cap per request, the excess
//! dropped and counted. A guest that writes too much loses output, never its
//! request (a [`wasmtime_wasi::p2::pipe::MemoryOutputPipe`] traps instead).

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// Largest write a guest may hand over in one call. Small, so one call is
/// cheap for the host; the guest just writes again.
const WRITE_PERMIT: usize = 64 * 1024;

#[derive(Debug, Default)]
struct Captured {
    kept: BytesMut,
    dropped: u64,
}

/// A capped, shared capture buffer; clones write to the same buffer.
#[derive(Debug, Clone)]
pub struct CappedCapture {
    capacity: usize,
    inner: Arc<Mutex<Captured>>,
}

impl CappedCapture {
    /// A capture keeping at most `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        Self { capacity, inner: Arc::default() }
    }

    /// Keeps what fits, counts the rest; returns how much was taken (all of it).
    fn take(&self, bytes: &[u8]) -> usize {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let room = self.capacity.saturating_sub(inner.kept.len());
        let kept = room.min(bytes.len());
        inner.kept.extend_from_slice(&bytes[..kept]);
        inner.dropped += (bytes.len() - kept) as u64;
        bytes.len()
    }

    /// Empties the buffer and the dropped count, for the next request of a
    /// warm instance.
    pub fn clear(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        *inner = Captured::default();
    }

    /// What was kept, and how many bytes were dropped past the cap.
    pub fn contents(&self) -> (Bytes, u64) {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        (Bytes::copy_from_slice(&inner.kept), inner.dropped)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for CappedCapture {
    async fn ready(&mut self) {}
}

impl OutputStream for CappedCapture {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.take(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(WRITE_PERMIT)
    }
}

impl AsyncWrite for CappedCapture {
    fn poll_write(self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Ok(self.take(buf)))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl IsTerminal for CappedCapture {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for CappedCapture {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

/// Bytes of a guest's stdout and stderr kept for the logs, per request;
/// the rest is dropped and counted, the guest is not stopped.
pub const STDIO_CAPTURE_BYTES: usize = 16 * 1024;

/// Longest line [`escape_for_log`] makes: twice the capture, so text
/// whose quotes and backslashes escaping doubles is logged whole, while a
/// capture of control bytes (five or six characters each, `\u{1}`) is cut.
pub const LOG_LINE_MAX: usize = 2 * STDIO_CAPTURE_BYTES;

/// `bytes` as one log-safe line: UTF-8 lossily, control characters
/// (newlines included) escaped, so a guest cannot forge log lines; cut at
/// [`LOG_LINE_MAX`] bytes (then ending in `…`).
pub fn escape_for_log(bytes: &[u8]) -> String {
    let mut line = String::new();
    for c in String::from_utf8_lossy(bytes).trim_end().escape_debug() {
        if line.len() + c.len_utf8() > LOG_LINE_MAX {
            line.push('…');
            break;
        }
        line.push(c);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excess_is_dropped_and_counted_not_refused() {
        let mut capture = CappedCapture::new(10);
        assert_eq!(capture.check_write().unwrap(), WRITE_PERMIT);
        capture.write(Bytes::from_static(b"0123456")).unwrap();
        capture.write(Bytes::from_static(b"789abcdef")).unwrap();
        assert!(capture.check_write().is_ok(), "a full capture still takes writes");
        let (kept, dropped) = capture.contents();
        assert_eq!((&kept[..], dropped), (&b"0123456789"[..], 6));
    }

    #[test]
    fn escaping_cannot_make_a_line_longer_than_its_cap() {
        let line = escape_for_log(&[1u8; STDIO_CAPTURE_BYTES]);
        assert!(line.len() <= LOG_LINE_MAX + '…'.len_utf8() && line.ends_with('…'), "{} bytes", line.len());
        assert!(line.starts_with("\\u{1}\\u{1}"), "{}", &line[..20]);
        assert_eq!(escape_for_log(b"short\n"), "short", "short lines are whole");
        let quotes = escape_for_log(&[b'"'; STDIO_CAPTURE_BYTES]);
        assert!(!quotes.ends_with('…'), "a full capture of quotes is whole");
    }

    #[test]
    fn log_lines_cannot_be_forged() {
        let escaped = escape_for_log(b"ok\n2026-01-01 INFO admin logged in\r\x1b[2J\n");
        assert!(!escaped.contains('\n') && !escaped.contains('\r') && !escaped.contains('\x1b'), "{escaped}");
        assert!(escaped.starts_with("ok\\n2026"), "{escaped}");
    }
}
