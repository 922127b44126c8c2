//! A tenant's log from the other live nodes of a cluster: each node keeps
//! the records of the requests it served, so the node a tenant asks reads
//! the others' through their own tenant API (`GET /tenant/v1/logs` with
//! `local=true`, as the tenant: its key goes along, and each node checks it
//! itself). Nodes are found in the store's heartbeats (`--advertise`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, Uri};
use tokio::sync::mpsc;

use super::client;
use crate::control::store::NodeRow;

/// Longest wait for another node's answer to begin (and, for a read, to end).
pub(super) const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest answer read from another node: a tenant's whole log there
/// (`--tenant-log-bytes`, 1 MiB by default) as JSON lines, with room to spare.
const MAX_PEER_ANSWER: usize = 16 << 20;
/// Longest line passed on from another node's followed log.
const MAX_PEER_LINE: usize = 1 << 20;

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

/// Asks `peer` as the holder of `key`; an answer that is not a 200 within
/// [`PEER_TIMEOUT`] is an error saying what happened.
pub(super) async fn ask(peer: &Peer, key: &str, ca: Option<&Path>) -> Asked {
    let uri: Uri = peer.url.parse().map_err(|e| format!("bad address: {e}"))?;
    let host = uri.authority().map(|a| a.as_str().to_owned()).unwrap_or_default();
    let request = Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header(hyper::header::HOST, host)
        .header(hyper::header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let response = match tokio::time::timeout(PEER_TIMEOUT, client::send(&uri, request, ca)).await {
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
pub(super) async fn ask_all(peers: &[Peer], key: &str, ca: Option<&PathBuf>) -> Vec<Asked> {
    let mut asking = tokio::task::JoinSet::new();
    for (i, peer) in peers.iter().enumerate() {
        let (peer, key, ca) = (peer.clone(), key.to_owned(), ca.cloned());
        asking.spawn(async move { (i, ask(&peer, &key, ca.as_deref()).await) });
    }
    let mut answers: Vec<Asked> = peers.iter().map(|_| Err("not asked".to_owned())).collect();
    while let Some(joined) = asking.join_next().await {
        if let Ok((i, asked)) = joined {
            answers[i] = asked;
        }
    }
    answers
}

/// The records a peer counted as dropped (its `dropped` header).
pub(super) fn dropped(response: &Response<Incoming>, header: &str) -> u64 {
    response.headers().get(header).and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(0)
}

/// A peer's whole answer, at most [`MAX_PEER_ANSWER`] bytes, by `until`.
pub(super) async fn read_all(response: Response<Incoming>, until: Instant) -> Result<Vec<u8>, String> {
    let limited = http_body_util::Limited::new(response.into_body(), MAX_PEER_ANSWER);
    match tokio::time::timeout_at(until.into(), limited.collect()).await {
        Ok(Ok(body)) => Ok(body.to_bytes().to_vec()),
        Ok(Err(e)) => Err(format!("answer not read: {e}")),
        Err(_) => Err("answer not read in time".to_owned()),
    }
}

/// Passes a peer's followed log on to `tx`, whole lines of `node`'s
/// records only (a node asked at a wrong address gives none of another's),
/// until it ends, `until`, or the reader goes.
pub(super) async fn pump(response: Response<Incoming>, (node, tx): (String, mpsc::Sender<Bytes>), until: Instant) {
    let mut body = response.into_body();
    let mut pending = Vec::new();
    loop {
        let frame = tokio::select! {
            frame = body.frame() => frame,
            () = tokio::time::sleep_until(until.into()) => return,
            () = tx.closed() => return,
        };
        let Some(Ok(frame)) = frame else { return };
        let Ok(data) = frame.into_data() else { continue };
        pending.extend_from_slice(&data);
        let Some(end) = pending.iter().rposition(|b| *b == b'\n') else {
            if pending.len() > MAX_PEER_LINE {
                return;
            }
            continue;
        };
        let lines: Vec<u8> = pending.drain(..=end).collect();
        let kept = of_node(&lines, &node);
        if !kept.is_empty() && tx.send(kept.into()).await.is_err() {
            return;
        }
    }
}

/// The lines of `text` that are records of `node`, each with its newline.
fn of_node(text: &[u8], node: &str) -> Vec<u8> {
    #[derive(serde::Deserialize)]
    struct Named<'a> {
        #[serde(borrow)]
        node: std::borrow::Cow<'a, str>,
    }
    let mut kept = Vec::with_capacity(text.len());
    for line in text.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        if serde_json::from_slice::<Named<'_>>(line).is_ok_and(|r| r.node == node) {
            kept.extend_from_slice(line);
            kept.push(b'\n');
        }
    }
    kept
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn only_the_asked_nodes_records_pass() {
        let text = b"{\"node\":\"b\",\"seq\":1}\n{\"node\":\"a\",\"seq\":2}\nnot json\n{\"node\":\"b\",\"seq\":3}\n";
        assert_eq!(of_node(text, "b"), b"{\"node\":\"b\",\"seq\":1}\n{\"node\":\"b\",\"seq\":3}\n");
    }

    #[test]
    fn a_peer_is_asked_at_its_advertised_address() {
        assert_eq!(Peer::new(&row("10.0.0.7:8080"), "local=true").url, "http://10.0.0.7:8080/tenant/v1/logs?local=true");
        assert_eq!(Peer::new(&row("https://gw-b.example:8443/"), "local=true").url, "https://gw-b.example:8443/tenant/v1/logs?local=true");
    }
}
