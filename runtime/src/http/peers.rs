//! A tenant's log from the other live nodes of a cluster: each node keeps
//! the records of the requests it served, so the node a tenant asks reads
//! the others' through their own tenant API (`GET /tenant/v1/logs` with
//! `local=true`, as the tenant: its key goes along, and each node checks it
//! itself). Nodes are found in the store's heartbeats (`--advertise`).

use std::fmt::Display;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::Incoming;
use hyper::{Request, Response, Uri};
use serde::Deserialize;

use super::client;
use crate::control::store::NodeRow;

/// Longest wait for another node's answer to begin, and (a read) for each
/// part of it the reader asks for.
pub(super) const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest record line taken from another node: a record with the longest
/// output line (32 KiB, escaped: 64 KiB as JSON at worst) and its fields.
pub(super) const MAX_LINE: usize = 80 << 10;
/// What a connection to another node buffers of its answer at once
/// (hyper's read buffer, so also the largest frame it gives).
pub(super) const PEER_READ_BUFFER: usize = 16 << 10;

/// Another node, and the log query to send it.
#[derive(Debug, Clone)]
pub(super) struct Peer {
    /// Its node id.
    pub id: String,
    /// `GET` this (an absolute URL) with the tenant's key.
    url: String,
}

impl Peer {
    /// The node of `row`, asked for `query` (`local=true` and the rest).
    pub fn new(row: &NodeRow, query: &str) -> Self {
        let base = if row.address.contains("://") { row.address.clone() } else { format!("http://{}", row.address) };
        Self { id: row.id.clone(), url: format!("{}/tenant/v1/logs?{query}", base.trim_end_matches('/')) }
    }
}

/// What asking a peer gave: its answer, or why there is none.
pub(super) type Asked = Result<Response<Incoming>, String>;

/// The TLS a node asks its peers over (for their `https://` addresses).
#[derive(Debug, Clone, Default)]
pub(super) struct PeerTls {
    /// CA certificates (PEM) the peers' certificates are verified with
    /// (else the system's roots).
    pub ca: Option<PathBuf>,
    /// The name every peer's certificate is verified for, instead of the
    /// host of its address (one certificate for nodes reached by address).
    pub name: Option<String>,
}

/// Asks `peer` as the holder of `key`; an answer that is not a 200 within
/// [`PEER_TIMEOUT`] is an error saying what happened.
pub(super) async fn ask(peer: &Peer, key: &str, tls: &PeerTls) -> Asked {
    let uri: Uri = peer.url.parse().map_err(|e| format!("bad address: {e}"))?;
    let host = uri.authority().map(|a| a.as_str().to_owned()).unwrap_or_default();
    let request = Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header(hyper::header::HOST, host)
        .header(hyper::header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let options =
        client::Options { ca: tls.ca.as_deref(), server_name: tls.name.as_deref(), read_buffer: Some(PEER_READ_BUFFER), addresses: None };
    let response = match tokio::time::timeout(PEER_TIMEOUT, client::send_with(&uri, request, options)).await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => return Err(format!("{e:#}")),
        Err(_) => return Err(format!("no answer within {PEER_TIMEOUT:?}")),
    };
    match response.status().as_u16() {
        200 => Ok(response),
        status => Err(format!("answered {status}")),
    }
}

/// Asks every peer at once; the answers in `peers`' order.
pub(super) async fn ask_all(peers: &[Peer], key: &str, tls: &PeerTls) -> Vec<Asked> {
    let mut asking = tokio::task::JoinSet::new();
    for (i, peer) in peers.iter().enumerate() {
        let (peer, key, tls) = (peer.clone(), key.to_owned(), tls.clone());
        asking.spawn(async move { (i, ask(&peer, &key, &tls).await) });
    }
    let mut answers: Vec<Asked> = peers.iter().map(|_| Err("not asked".to_owned())).collect();
    while let Some(joined) = asking.join_next().await {
        if let Ok((i, asked)) = joined {
            answers[i] = asked;
        }
    }
    answers
}

/// A header of a peer's answer, if it is text.
pub(super) fn header<'a>(response: &'a Response<Incoming>, name: &str) -> Option<&'a str> {
    response.headers().get(name).and_then(|v| v.to_str().ok())
}

/// Where a record line sorts, and whose it is.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(super) struct Stamp {
    /// Unix ms.
    pub time_ms: i64,
    /// The node that logged it.
    pub node: String,
    /// Its place in that node's log.
    pub seq: u64,
}

/// One record as a JSON line (without its newline), and its stamp.
#[derive(Debug)]
pub(super) struct Line {
    /// Where it sorts.
    pub stamp: Stamp,
    /// The record.
    pub text: Vec<u8>,
}

/// A peer's answer body, its errors as text (a test gives its own).
pub(super) type PeerBody = UnsyncBoxBody<Bytes, String>;

/// A peer's answer as a body.
pub(super) fn body(response: Response<Incoming>) -> PeerBody {
    response.into_body().map_err(|e| e.to_string()).boxed_unsync()
}

/// Another node's answer, a record of that node at a time (a node asked at
/// a wrong address gives none of another's): it holds at most a partial
/// line and one frame ([`PEER_READ_BUFFER`]), [`Self::held`] bytes.
pub(super) struct PeerLines {
    node: String,
    body: PeerBody,
    pending: Vec<u8>,
    /// Where the lines not yet given start in `pending`.
    start: usize,
    /// Its records up to this `seq` only: where its read ended when asked.
    until: u64,
    /// Longest wait for each frame (a read); none (a follow): its records
    /// come when they come.
    wait: Option<Duration>,
}

impl PeerLines {
    /// `node`'s records in `body`, up to `until`, each frame within `wait`.
    pub fn new(node: &str, body: PeerBody, until: u64, wait: Option<Duration>) -> Self {
        Self { node: node.to_owned(), body, pending: Vec::new(), start: 0, until, wait }
    }

    /// Its node's id.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The last `seq` it gives.
    pub fn until(&self) -> u64 {
        self.until
    }

    /// Bytes it holds now.
    pub fn held(&self) -> usize {
        self.pending.capacity()
    }

    /// The next record already received, if any (no waiting).
    pub fn buffered(&mut self) -> Option<Line> {
        while let Some(end) = self.pending[self.start..].iter().position(|b| *b == b'\n') {
            let text = &self.pending[self.start..self.start + end];
            self.start += end + 1;
            if let Ok(stamp) = serde_json::from_slice::<Stamp>(text)
                && stamp.node == self.node
                && stamp.seq <= self.until
            {
                return Some(Line { stamp, text: text.to_vec() });
            }
        }
        None
    }

    /// The next record; `None` once the answer ended.
    pub async fn next(&mut self) -> Result<Option<Line>, String> {
        loop {
            if let Some(line) = self.buffered() {
                return Ok(Some(line));
            }
            self.pending.drain(..self.start);
            self.start = 0;
            if self.pending.len() > MAX_LINE {
                return Err(format!("a line longer than {MAX_LINE} bytes"));
            }
            if self.pending.is_empty() {
                // A long line once read keeps no buffer its size.
                self.pending.shrink_to(PEER_READ_BUFFER);
            }
            let frame = match self.wait {
                Some(wait) => tokio::time::timeout(wait, self.body.frame()).await.map_err(|_| format!("no records within {wait:?}"))?,
                None => self.body.frame().await,
            };
            match frame {
                None => return Ok(None),
                Some(Err(e)) => return Err(format!("answer not read: {e}")),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        // Exactly: what it holds stays a line and a frame.
                        self.pending.reserve_exact(data.len());
                        self.pending.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

/// Why a peer's records were not read, for the node's log.
pub(super) fn unread(node: &str, why: &impl Display) {
    tracing::warn!(node = %node, reason = %why, "a tenant's log not read from a live node");
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn row(address: &str) -> NodeRow {
        NodeRow {
            id: "b".into(),
            address: address.into(),
            version: String::new(),
            devices: Vec::new(),
            load: Default::default(),
            started_at: 0,
            heartbeat_at: 0,
        }
    }

    /// A body of the given frames, then its end (or an error).
    pub(in crate::http) struct Frames(pub std::collections::VecDeque<Result<Bytes, String>>);

    impl hyper::body::Body for Frames {
        type Data = Bytes;
        type Error = String;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, String>>> {
            std::task::Poll::Ready(self.0.pop_front().map(|f| f.map(hyper::body::Frame::data)))
        }
    }

    /// `node`'s answer of `frames`, then its end.
    pub(in crate::http) fn answer(node: &str, frames: Vec<Bytes>, until: u64) -> PeerLines {
        let body = Frames(frames.into_iter().map(Ok).collect()).boxed_unsync();
        PeerLines::new(node, body, until, Some(Duration::from_secs(1)))
    }

    fn record(node: &str, seq: u64, filler: usize) -> String {
        format!("{{\"node\":\"{node}\",\"seq\":{seq},\"time_ms\":{seq},\"line\":\"{}\"}}\n", "x".repeat(filler))
    }

    #[tokio::test]
    async fn only_the_asked_nodes_records_to_where_its_read_ended_pass() {
        let text = format!("{}{}not json\n{}{}", record("b", 1, 0), record("a", 2, 0), record("b", 3, 0), record("b", 4, 0));
        // Cut mid-line: lines come whole across frames.
        let frames = vec![Bytes::from(text[..30].to_owned()), Bytes::from(text[30..].to_owned())];
        let mut lines = answer("b", frames, 3);
        let mut seqs = Vec::new();
        while let Some(line) = lines.next().await.unwrap() {
            seqs.push(line.stamp.seq);
        }
        assert_eq!(seqs, [1, 3], "b's own, none past its end");
    }

    #[tokio::test]
    async fn a_long_answer_is_read_holding_a_line_and_a_frame() {
        // 4 MiB of records in frames as a peer connection gives them.
        let text: String = (0..4000).map(|i| record("b", i, 1000)).collect();
        let frames: Vec<Bytes> = text.as_bytes().chunks(PEER_READ_BUFFER).map(Bytes::copy_from_slice).collect();
        let mut lines = answer("b", frames, u64::MAX);
        let (mut count, mut most) = (0, 0);
        while lines.next().await.unwrap().is_some() {
            (count, most) = (count + 1, most.max(lines.held()));
        }
        assert_eq!(count, 4000);
        assert!(most <= 2 * PEER_READ_BUFFER, "{most} bytes held at most");
        let long = record("b", 1, 2 * MAX_LINE);
        let frames: Vec<Bytes> = long.as_bytes().chunks(PEER_READ_BUFFER).map(Bytes::copy_from_slice).collect();
        let error = answer("b", frames, u64::MAX).next().await.map(|_| ()).unwrap_err();
        assert!(error.contains("longer than"), "a line past the bound ends it: {error}");
    }

    #[test]
    fn a_peer_is_asked_at_its_advertised_address() {
        assert_eq!(Peer::new(&row("10.0.0.7:8080"), "local=true").url, "http://10.0.0.7:8080/tenant/v1/logs?local=true");
        assert_eq!(Peer::new(&row("https://gw-b.example:8443/"), "local=true").url, "https://gw-b.example:8443/tenant/v1/logs?local=true");
    }
}
