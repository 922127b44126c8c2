//! `GET /tenant/v1/logs`: a tenant's own log (see [`crate::telemetry::logs`])
//! from every live node of the cluster, as JSON lines, once or followed as
//! it grows. Each node keeps the records of the requests it served; the
//! node asked adds the others' (see [`super::peers`]). A record names its
//! node and its `seq` there; a cursor (`since=node-a:41,node-b:12`) says
//! where a reader is on each node.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use serde::Serialize;
use tokio::sync::{Notify, mpsc};

use super::app::App;
use super::auth::bearer;
use super::peers::{self, Asked, Line, PEER_TIMEOUT, Peer, PeerLines, PeerTls, Stamp};
use super::response::{self, Body};
use crate::admission::limits::Limit;
use crate::admission::memory::{Charge, MemoryBudget, Refusal};
use crate::config::valid_node_id;
use crate::control::ControlPlane;
use crate::control::keys::Scopes;
use crate::sandbox::handler::valid_name;
use crate::telemetry::logs::{Follower, LogOwner, LogRecord, MAX_FOLLOWERS, TenantLogs};

/// Longest one follow stays open; the client asks again with `since=`.
const FOLLOW_FOR: Duration = Duration::from_secs(60);
/// How often a follow checks its reader may still read, records or not.
const RECHECK_EVERY: Duration = Duration::from_secs(1);
/// The header that says how many records the tenant has had dropped (on
/// the nodes read).
const DROPPED_HEADER: &str = "x-facegate-logs-dropped";
/// The header naming the live nodes that could not be read.
const UNREACHABLE_HEADER: &str = "x-facegate-logs-unreachable";
/// The header with the cursor after the records returned (a read), or
/// where a follow starts.
const CURSOR_HEADER: &str = "x-facegate-logs-cursor";
/// The content type: one JSON record a line.
const NDJSON: &str = "application/x-ndjson";
/// Longest a reader's client may take none of its answer while the next
/// part waits: then the read (or follow) ends, and what it held is given
/// back.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// A part of the answer is handed on once it holds this much (or nothing
/// more is at hand): at most this and one record line.
const CHUNK_BYTES: usize = 16 << 10;
/// This node's records are copied a batch of this many bytes (as the log
/// counts them) at a time.
const LOCAL_BATCH_BYTES: usize = 16 << 10;
/// What one node's records hold in a reader at most: the line it offers
/// the merge, and a batch of this node's or a partial line and a frame of
/// another's ([`PeerLines`]).
const SOURCE_BYTES: usize = 2 * peers::MAX_LINE + 2 * peers::PEER_READ_BUFFER;
/// What one part of an answer holds at most (see [`CHUNK_BYTES`]).
const PART_BYTES: usize = CHUNK_BYTES + peers::MAX_LINE;

/// What a reader of `nodes` nodes' records holds at most, charged to the
/// node's memory budget while it runs: each node's records and the part
/// each sends, and the part waiting for the client (hyper's own buffers
/// are the connection's, bounded there).
fn reader_bytes(nodes: usize) -> usize {
    nodes * (SOURCE_BYTES + PART_BYTES) + PART_BYTES
}

/// Where a reader is in a tenant's log: the last `seq` it has of each node.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Cursor {
    nodes: BTreeMap<String, u64>,
    /// A bare number: the last `seq` of the node asked.
    here: Option<u64>,
}

impl Cursor {
    /// `node:seq` pairs joined by commas, or one bare `seq` of the node asked.
    pub fn parse(value: &str) -> Result<Self, String> {
        if let Ok(seq) = value.parse() {
            return Ok(Self { here: Some(seq), ..Self::default() });
        }
        let mut nodes = BTreeMap::new();
        for pair in value.split(',').filter(|p| !p.is_empty()) {
            let parsed = pair.rsplit_once(':').and_then(|(node, seq)| Some((node, seq.parse::<u64>().ok()?)));
            match parsed {
                Some((node, seq)) if valid_node_id(node) => nodes.insert(node.to_owned(), seq),
                _ => return Err(format!("since must be a cursor (node:seq,node:seq) or a record's seq, not {pair:?}")),
            };
        }
        Ok(Self { nodes, here: None })
    }

    /// The last `seq` read of `node` (`here` when it is the node asked).
    fn of(&self, node: &str, here: bool) -> Option<u64> {
        self.nodes.get(node).copied().or(self.here.filter(|_| here))
    }

    /// The cursor with a bare `seq` written as `node`'s (the node asked),
    /// so that what it returns names that node.
    fn resolved(&self, node: &str) -> Self {
        let mut cursor = Self { nodes: self.nodes.clone(), here: None };
        if let Some(seq) = self.here {
            cursor.nodes.entry(node.to_owned()).or_insert(seq);
        }
        cursor
    }

    /// Notes `node`'s record `seq` as read (each node's furthest kept).
    pub fn advance(&mut self, node: &str, seq: u64) {
        let at = self.nodes.entry(node.to_owned()).or_insert(seq);
        *at = (*at).max(seq);
    }

    /// Takes in another cursor (the gateway's `x-facegate-logs-cursor`),
    /// each node's furthest kept; a bare `seq` gives way to it.
    pub fn absorb(&mut self, other: &Self) {
        other.nodes.iter().for_each(|(node, seq)| self.advance(node, *seq));
        self.here = self.here.filter(|_| other.nodes.is_empty());
    }

    /// The `since=` parameter for it, if it says anything (`:` and `,` escaped).
    pub fn query(&self) -> Option<String> {
        match self.here {
            Some(seq) if self.nodes.is_empty() => Some(format!("since={seq}")),
            _ if self.nodes.is_empty() => None,
            _ => Some(format!("since={}", self.to_string().replace(':', "%3A").replace(',', "%2C"))),
        }
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pairs: Vec<String> = self.nodes.iter().map(|(node, seq)| format!("{node}:{seq}")).collect();
        f.write_str(&pairs.join(","))
    }
}

/// What a logs request asks for.
#[derive(Debug, Default, PartialEq)]
struct LogQuery {
    handler: Option<String>,
    since: Cursor,
    follow: bool,
    /// This node's records only (what one node asks another).
    local: bool,
}

impl LogQuery {
    /// Parses `handler`, `since` (a [`Cursor`]), `follow` and `local`
    /// (`true`/`1`); the error says what is wrong.
    fn parse(query: &str) -> Result<Self, String> {
        let mut parsed = Self::default();
        let yes = |value: &str| matches!(value, "" | "true" | "1");
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            match &*name {
                "handler" if valid_name(&value).is_ok() => parsed.handler = Some(value.into_owned()),
                "handler" => return Err(format!("{value:?} is not a handler name")),
                "since" => parsed.since = Cursor::parse(&value)?,
                "follow" => parsed.follow = yes(&value),
                "local" => parsed.local = yes(&value),
                _ => return Err(format!("unknown parameter {name:?} (handler, since, follow, local)")),
            }
        }
        Ok(parsed)
    }

    /// The query asking `node` for its own records after this cursor.
    fn for_peer(&self, node: &str) -> String {
        let mut query = vec!["local=true".to_owned()];
        query.extend(self.handler.as_ref().map(|h| format!("handler={h}")));
        query.extend(self.since.of(node, false).map(|seq| format!("since={seq}")));
        if self.follow {
            query.push("follow=true".into());
        }
        query.join("&")
    }
}

/// A record as the API gives it: with its node.
#[derive(Serialize)]
struct OnNode<'a> {
    node: &'a str,
    #[serde(flatten)]
    record: &'a LogRecord,
}

/// One of this node's records as a line.
fn line_of(record: &LogRecord, node: &str) -> Line {
    let text = serde_json::to_vec(&OnNode { node, record }).unwrap_or_default();
    Line { stamp: Stamp { time_ms: record.time_ms, node: node.to_owned(), seq: record.seq }, text }
}

/// This node's records as JSON lines.
fn ndjson(records: &[LogRecord], node: &str) -> Vec<u8> {
    let mut text = Vec::new();
    for record in records {
        if serde_json::to_writer(&mut text, &OnNode { node, record }).is_ok() {
            text.push(b'\n');
        }
    }
    text
}

/// This node's records for a reader, a bounded batch copied at a time.
struct LocalRecords {
    logs: Arc<TenantLogs>,
    owner: LogOwner,
    handler: Option<String>,
    node: Arc<str>,
    /// The last `seq` given.
    after: Option<u64>,
    /// Where the read ends: the newest record when it began.
    until: u64,
    batch: VecDeque<LogRecord>,
}

impl LocalRecords {
    fn next(&mut self) -> Option<Line> {
        if self.batch.is_empty() {
            let range = (self.after, self.until);
            self.batch = self.logs.read_batch(&self.owner, range, self.handler.as_deref(), LOCAL_BATCH_BYTES).into();
        }
        let record = self.batch.pop_front()?;
        self.after = Some(record.seq);
        Some(line_of(&record, &self.node))
    }

    fn held(&self) -> usize {
        self.batch.iter().map(LogRecord::size).sum()
    }
}

/// Where a read takes records from: this node's log, or another's answer.
enum Source {
    Local(LocalRecords),
    Peer(PeerLines),
}

impl Source {
    async fn next(&mut self) -> Result<Option<Line>, String> {
        match self {
            Self::Local(local) => Ok(local.next()),
            Self::Peer(peer) => peer.next().await,
        }
    }

    fn held(&self) -> usize {
        match self {
            Self::Local(local) => local.held(),
            Self::Peer(peer) => peer.held(),
        }
    }
}

/// Several nodes' records merged by time as they are read, one line of
/// each held ahead: each node's in its own order (its `seq`s), so the
/// cursor after any record is exact.
struct Merge {
    sources: Vec<Source>,
    heads: Vec<Option<Line>>,
}

impl Merge {
    /// Reads each node's first record; a peer that fails here is left out,
    /// named with why.
    async fn start(sources: Vec<Source>) -> (Self, Vec<(String, String)>) {
        let mut merge = Self { sources: Vec::new(), heads: Vec::new() };
        let mut failed = Vec::new();
        for mut source in sources {
            match source.next().await {
                Ok(head) => {
                    merge.sources.push(source);
                    merge.heads.push(head);
                }
                Err(why) => failed.push((peer_of(&source), why)),
            }
        }
        (merge, failed)
    }

    /// The nodes it reads (this one's id for this node's records).
    fn nodes(&self) -> impl Iterator<Item = &str> {
        self.sources.iter().filter_map(|s| if let Source::Peer(p) = s { Some(p.node()) } else { None })
    }

    /// The earliest record held, the next of its node read in its place;
    /// an error when a node's answer broke off.
    async fn next(&mut self) -> Result<Option<Line>, String> {
        let earliest = self
            .heads
            .iter()
            .enumerate()
            .filter_map(|(i, h)| Some((i, h.as_ref()?)))
            .min_by(|(_, a), (_, b)| (a.stamp.time_ms, &a.stamp.node, a.stamp.seq).cmp(&(b.stamp.time_ms, &b.stamp.node, b.stamp.seq)));
        let Some((i, _)) = earliest else { return Ok(None) };
        let next = self.sources[i].next().await.map_err(|why| format!("node {}: {why}", peer_of(&self.sources[i])))?;
        Ok(std::mem::replace(&mut self.heads[i], next))
    }

    /// Bytes it holds now.
    fn held(&self) -> usize {
        self.sources.iter().map(Source::held).sum::<usize>() + self.heads.iter().flatten().map(|l| l.text.len()).sum::<usize>()
    }
}

/// A source's node, for messages.
fn peer_of(source: &Source) -> String {
    match source {
        Source::Local(local) => local.node.to_string(),
        Source::Peer(peer) => peer.node().to_owned(),
    }
}

/// How a reader's answer ends, shared by the tasks that write it and its
/// body: once stopped they all end; broken off, the body ends in an error
/// (so its client knows the answer is incomplete and its cursor not to be
/// trusted).
#[derive(Default)]
struct Ending {
    stopped: AtomicBool,
    broken: AtomicBool,
    stop: Notify,
}

/// Where a reader's records go: its answer's body, through a channel of
/// one part. Held by every task writing it, with the reader's charge.
#[derive(Clone)]
struct Out {
    tx: mpsc::Sender<Bytes>,
    ending: Arc<Ending>,
    write_timeout: Duration,
    _charge: Arc<Charge>,
}

impl Out {
    /// A reader's output, holding `charge` until its last writer ends, and
    /// the body that gives it.
    fn new(charge: Charge, write_timeout: Duration) -> (Self, Lines) {
        let (tx, rx) = mpsc::channel(1);
        let ending = Arc::new(Ending::default());
        let lines = Lines { rx, ending: Arc::clone(&ending) };
        (Self { tx, ending, write_timeout, _charge: Arc::new(charge) }, lines)
    }

    /// Hands `part` to the body; `false` once the reader is done: its
    /// client gone, or it took nothing for the write timeout (then the
    /// answer is broken off and every writer ends), or stopped.
    async fn send(&self, part: Vec<u8>) -> bool {
        tokio::select! {
            sent = self.tx.send_timeout(part.into(), self.write_timeout) => match sent {
                Ok(()) => true,
                Err(mpsc::error::SendTimeoutError::Timeout(_)) => {
                    self.stop(Some(&format!("its client took nothing for {:?}", self.write_timeout)));
                    false
                }
                Err(mpsc::error::SendTimeoutError::Closed(_)) => false,
            },
            () = self.stopped() => false,
        }
    }

    /// Ends every writer: cleanly, or broken off saying why.
    fn stop(&self, broken: Option<&str>) {
        if let Some(why) = broken {
            tracing::debug!(reason = why, "a tenant's log read broken off");
            self.ending.broken.store(true, Ordering::SeqCst);
        }
        self.ending.stopped.store(true, Ordering::SeqCst);
        self.ending.stop.notify_waiters();
    }

    /// Resolves once the reader is done (its client gone, or stopped).
    async fn stopped(&self) {
        let stop = self.ending.stop.notified();
        tokio::pin!(stop);
        stop.as_mut().enable();
        if self.ending.stopped.load(Ordering::SeqCst) {
            return;
        }
        tokio::select! {
            () = stop => {}
            () = self.tx.closed() => {}
        }
    }
}

/// A response body of the parts a reader's writers send; it ends when they
/// all have, in an error if the answer was broken off.
struct Lines {
    rx: mpsc::Receiver<Bytes>,
    ending: Arc<Ending>,
}

impl hyper::body::Body for Lines {
    type Data = Bytes;
    type Error = wasmtime_wasi_http::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, wasmtime_wasi_http::Error>>> {
        self.rx.poll_recv(cx).map(|part| match part {
            Some(bytes) => Some(Ok(Frame::data(bytes))),
            // Once: the body ends after its error.
            None if self.ending.broken.swap(false, Ordering::SeqCst) => Some(Err(wasmtime_wasi_http::Error::HttpResponseIncomplete)),
            None => None,
        })
    }
}

/// Sends a read's records, merged, a part at a time; breaks the answer off
/// if a node's answer breaks off.
async fn stream_read(mut merge: Merge, out: Out) {
    let mut part = Vec::new();
    loop {
        debug_assert!(merge.held() <= merge.sources.len() * SOURCE_BYTES, "a reader holds what it is charged");
        match merge.next().await {
            Ok(Some(line)) => {
                part.extend_from_slice(&line.text);
                part.push(b'\n');
                if part.len() >= CHUNK_BYTES && !out.send(std::mem::take(&mut part)).await {
                    return;
                }
            }
            Ok(None) => break,
            Err(why) => return out.stop(Some(&why)),
        }
    }
    if !part.is_empty() {
        out.send(part).await;
    }
}

/// What the other nodes gave: their answers, dropped counts summed, and
/// the ids of those that gave none.
struct FromPeers {
    answers: Vec<(Peer, Response<Incoming>)>,
    dropped: u64,
    unreachable: Vec<String>,
}

impl FromPeers {
    fn gather(peers: Vec<Peer>, asked: Vec<Asked>) -> Self {
        let mut gathered = Self { answers: Vec::new(), dropped: 0, unreachable: Vec::new() };
        for (peer, asked) in peers.into_iter().zip(asked) {
            match asked {
                Ok(answer) => {
                    gathered.dropped += peers::header(&answer, DROPPED_HEADER).and_then(|v| v.parse().ok()).unwrap_or(0);
                    gathered.answers.push((peer, answer));
                }
                Err(why) => gathered.unreachable(peer.id, &why),
            }
        }
        gathered
    }

    fn unreachable(&mut self, node: String, why: &str) {
        peers::unread(&node, &why);
        self.unreachable.push(node);
    }

    /// The answers as a read's sources: each peer's records up to where its
    /// read ended (its cursor), or named unreachable when it gave none.
    fn read_sources(&mut self) -> Vec<Source> {
        let mut sources = Vec::new();
        for (peer, answer) in std::mem::take(&mut self.answers) {
            let end = peers::header(&answer, CURSOR_HEADER).and_then(|c| Cursor::parse(c).ok()).map(|c| c.of(&peer.id, false));
            match end {
                // No entry: nothing there past the cursor asked with.
                Some(until) => {
                    sources.push(Source::Peer(PeerLines::new(&peer.id, peers::body(answer), until.unwrap_or(0), Some(PEER_TIMEOUT))))
                }
                None => self.unreachable(peer.id, "answered without a cursor"),
            }
        }
        sources
    }
}

/// Sets a header when its value is valid (ours always are).
fn set_header(answer: &mut Response<Body>, name: &'static str, value: String) {
    if let Ok(value) = HeaderValue::try_from(value) {
        answer.headers_mut().insert(HeaderName::from_static(name), value);
    }
}

/// A reader's place in the node's memory budget, charged to its tenant
/// for `nodes` nodes' records.
fn charge_reader(budget: &Arc<MemoryBudget>, tenant: &str, nodes: usize) -> Result<Charge, Refusal> {
    budget.charge(&Arc::from(tenant), reader_bytes(nodes))
}

/// The answer to a reader the budget refused: 503 `overloaded` + `Retry-After`.
fn reader_refused(refusal: Refusal, nodes: usize) -> Response<Body> {
    let message = format!("{refusal}: a log read holds {} KiB while it runs", reader_bytes(nodes) >> 10);
    response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "overloaded", &message, 1)
}

impl App {
    /// Serves `GET /tenant/v1/logs` for `tenant` (its key's `read` scope checked).
    pub(super) async fn tenant_logs(&self, req: &Request<Incoming>, tenant: &str) -> Response<Body> {
        let query = match LogQuery::parse(req.uri().query().unwrap_or("")) {
            Ok(query) => query,
            Err(message) => return response::error(StatusCode::BAD_REQUEST, "invalid_parameter", message),
        };
        let key = bearer(req).unwrap_or_default().to_owned();
        let peers = if query.local { Vec::new() } else { self.peers(&query) };
        let logs = Arc::clone(self.sandbox.logs());
        // This creation of the tenant: nothing of a deleted namesake's.
        let incarnation = self.control.serving.live().tenants.get(tenant).map(|e| e.incarnation.clone());
        let owner = LogOwner::new(tenant, incarnation.as_deref().unwrap_or_default());
        let follower = match query.follow.then(|| logs.follow(&owner)) {
            Some(None) => {
                let message = format!("this tenant's log has {MAX_FOLLOWERS} followers on this node already");
                return response::retry_later(StatusCode::TOO_MANY_REQUESTS, "too_many_followers", &message, 5);
            }
            Some(Some(follower)) => Some(follower),
            None => None,
        };
        let charge = match charge_reader(self.sandbox.memory(), tenant, 1 + peers.len()) {
            Ok(charge) => charge,
            Err(refusal) => {
                self.hits().hit(tenant, Limit::NodeMemory);
                return reader_refused(refusal, 1 + peers.len());
            }
        };
        let (out, body) = Out::new(charge, WRITE_TIMEOUT);
        let asked = peers::ask_all(&peers, &key, &self.peer_tls()).await;
        let from_peers = FromPeers::gather(peers, asked);
        let mut answer = match follower {
            Some(follower) => {
                let reader = Reader { control: Arc::clone(&self.control), tenant: tenant.to_owned(), key, incarnation, owner };
                self.followed((logs, follower), reader, (query, from_peers), out)
            }
            None => self.read_logs((logs, owner), &query, from_peers, out).await,
        };
        *answer.body_mut() = body.boxed_unsync();
        answer.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(NDJSON));
        answer
    }

    /// How this node asks its peers over TLS.
    fn peer_tls(&self) -> PeerTls {
        PeerTls { ca: self.config.peer_ca_cert.clone(), name: self.config.peer_tls_name.clone() }
    }

    /// The other live nodes, each with its query.
    fn peers(&self, query: &LogQuery) -> Vec<Peer> {
        let nodes = self.control.cluster.alive_nodes();
        nodes.iter().filter(|n| *n.id != *self.node).map(|n| Peer::new(n, &query.for_peer(&n.id))).collect()
    }

    /// The tenant's records after the cursor on this node and the peers
    /// that answered, merged by time and streamed to `out`; the answer's
    /// head (its cursor known from the start: where each node's read ends).
    async fn read_logs(
        &self,
        (logs, owner): (Arc<TenantLogs>, LogOwner),
        query: &LogQuery,
        mut from_peers: FromPeers,
        out: Out,
    ) -> Response<Body> {
        let mut cursor = query.since.resolved(&self.node);
        let dropped = logs.read_dropped(&owner) + from_peers.dropped;
        let until = logs.last_seq(&owner, query.handler.as_deref());
        let after = query.since.of(&self.node, true);
        let local = LocalRecords {
            logs,
            owner,
            handler: query.handler.clone(),
            node: Arc::clone(&self.node),
            after,
            until: until.unwrap_or(0),
            batch: VecDeque::new(),
        };
        if let Some(until) = until.filter(|u| after.is_none_or(|a| u > &a)) {
            cursor.advance(&self.node, until);
        }
        let mut sources = vec![Source::Local(local)];
        sources.extend(from_peers.read_sources());
        let peer_ends: Vec<(String, u64)> =
            sources.iter().filter_map(|s| if let Source::Peer(p) = s { Some((p.node().to_owned(), p.until())) } else { None }).collect();
        let (merge, failed) = Merge::start(sources).await;
        failed.into_iter().for_each(|(node, why)| from_peers.unreachable(node, &why));
        let read: Vec<&str> = merge.nodes().collect();
        for (node, until) in peer_ends.iter().filter(|(n, u)| read.contains(&n.as_str()) && *u > 0) {
            cursor.advance(node, *until);
        }
        tokio::spawn(stream_read(merge, out));
        let mut answer = Response::new(response::full(Bytes::new()));
        set_header(&mut answer, DROPPED_HEADER, dropped.to_string());
        set_header(&mut answer, CURSOR_HEADER, cursor.to_string());
        if !from_peers.unreachable.is_empty() {
            set_header(&mut answer, UNREACHABLE_HEADER, from_peers.unreachable.join(","));
        }
        answer
    }

    /// The tenant's log followed: this node's records and the peers'
    /// streams, as they come, until [`FOLLOW_FOR`] has passed.
    fn followed(
        &self,
        local: (Arc<TenantLogs>, Follower),
        reader: Reader,
        (query, from_peers): (LogQuery, FromPeers),
        out: Out,
    ) -> Response<Body> {
        let dropped = local.0.read_dropped(&reader.owner) + from_peers.dropped;
        // Where the follow starts, the asked node named: a client resumes from it.
        let cursor = query.since.resolved(&self.node);
        let end = Instant::now() + FOLLOW_FOR;
        for (peer, answer) in from_peers.answers {
            let lines = PeerLines::new(&peer.id, peers::body(answer), u64::MAX, None);
            tokio::spawn(follow_peer(lines, out.clone(), end));
        }
        let since = query.since.of(&self.node, true);
        let may_read = move || reader.may_read();
        tokio::spawn(follow(local, (may_read, Arc::clone(&self.node)), (since, query.handler, end), out));
        let mut answer = Response::new(response::full(Bytes::new()));
        set_header(&mut answer, DROPPED_HEADER, dropped.to_string());
        set_header(&mut answer, CURSOR_HEADER, cursor.to_string());
        if !from_peers.unreachable.is_empty() {
            set_header(&mut answer, UNREACHABLE_HEADER, from_peers.unreachable.join(","));
        }
        answer
    }
}

/// Who follows a log: checked again at each wake-up, so a key revoked (or
/// its read scope gone) or the tenant deleted and created again ends it.
struct Reader {
    control: Arc<ControlPlane>,
    tenant: String,
    key: String,
    incarnation: Option<Arc<str>>,
    /// Its log on this node.
    owner: LogOwner,
}

impl Reader {
    fn may_read(&self) -> bool {
        let live = self.control.serving.live();
        let key_reads = live.authenticate(Some(&self.key)).is_some_and(|(t, scopes)| t == self.tenant && scopes.contains(Scopes::READ));
        key_reads && live.tenants.get(&self.tenant).map(|e| &e.incarnation) == self.incarnation.as_ref()
    }
}

/// Sends the tenant's records on this node (`node`) after `since` as they
/// come, a bounded batch at a time, until `end`, until the reader is done,
/// or until it may read no more (then the whole follow ends).
async fn follow(
    (logs, follower): (Arc<TenantLogs>, Follower),
    (may_read, node): (impl Fn() -> bool, Arc<str>),
    (mut since, handler, end): (Option<u64>, Option<String>, Instant),
    out: Out,
) {
    let owner = follower.owner().clone();
    loop {
        // Armed before the read: a record added in between still wakes us.
        let changed = follower.grew.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if !may_read() {
            return out.stop(None);
        }
        let batch = logs.read_batch(&owner, (since, u64::MAX), handler.as_deref(), LOCAL_BATCH_BYTES);
        if let Some(last) = batch.last() {
            since = Some(last.seq);
            if !out.send(ndjson(&batch, &node)).await {
                return;
            }
            continue;
        }
        tokio::select! {
            () = &mut changed => {}
            // Checked again now and then: a tenant deleted writes nothing to wake us.
            () = tokio::time::sleep(RECHECK_EVERY) => {}
            () = tokio::time::sleep_until(end.into()) => return,
            () = out.stopped() => return,
        }
    }
}

/// Passes a peer's followed records on to `out`, a part at a time, until
/// its answer ends, `end`, or the reader is done.
async fn follow_peer(mut lines: PeerLines, out: Out, end: Instant) {
    loop {
        let next = tokio::select! {
            next = lines.next() => next,
            () = tokio::time::sleep_until(end.into()) => return,
            () = out.stopped() => return,
        };
        let Ok(Some(first)) = next else { return };
        let mut part = first.text;
        part.push(b'\n');
        while part.len() < CHUNK_BYTES
            && let Some(line) = lines.buffered()
        {
            part.extend_from_slice(&line.text);
            part.push(b'\n');
        }
        if !out.send(part).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_names_a_handler_a_cursor_and_whether_to_follow() {
        assert_eq!(LogQuery::parse("").unwrap(), LogQuery::default());
        let q = LogQuery::parse("handler=faces&since=41&follow=true").unwrap();
        assert_eq!((q.handler.as_deref(), q.since.of("me", true), q.follow, q.local), (Some("faces"), Some(41), true, false));
        assert!(LogQuery::parse("since=yesterday").unwrap_err().contains("cursor"));
        assert!(LogQuery::parse("handler=../x").unwrap_err().contains("handler name"));
        assert!(LogQuery::parse("tenant=other").unwrap_err().contains("unknown parameter"));
        assert!(LogQuery::parse("local=true").unwrap().local);
    }

    #[test]
    fn a_cursor_says_where_a_reader_is_on_each_node() {
        let cursor = Cursor::parse("node-a:41,node-b:7").unwrap();
        assert_eq!((cursor.of("node-a", true), cursor.of("node-b", false), cursor.of("node-c", false)), (Some(41), Some(7), None));
        assert_eq!(cursor.to_string(), "node-a:41,node-b:7", "written as read");
        assert_eq!(LogQuery::parse("since=node-a%3A41%2Cnode-b%3A7").unwrap().since, cursor, "percent-encoded");
        let bare = Cursor::parse("41").unwrap();
        assert_eq!((bare.of("me", true), bare.of("other", false)), (Some(41), None), "a bare seq is the asked node's");
        assert_eq!(bare.resolved("me").to_string(), "me:41", "and the cursor returned names it");
        assert!(Cursor::parse("bad node:1").is_err() && Cursor::parse("a:b").is_err());
        let q = LogQuery { handler: Some("h".into()), since: cursor, follow: true, local: false };
        assert_eq!(q.for_peer("node-b"), "local=true&handler=h&since=7&follow=true");
        assert_eq!(q.for_peer("node-c"), "local=true&handler=h&follow=true", "all of a node the cursor does not name");
    }

    /// A log on this node (`a`) of `n` records of `filler` bytes of output.
    fn local_log(n: usize, filler: usize) -> (Arc<TenantLogs>, LogOwner) {
        let logs = Arc::new(TenantLogs::default());
        logs.set_capacity(64 << 20);
        let owner = LogOwner::new("t", "first");
        for i in 0..n {
            let time_ms = i64::try_from(i).unwrap() * 2;
            logs.push(&owner, LogRecord::output(time_ms, ("h", 1), "r", "x".repeat(filler)));
        }
        (logs, owner)
    }

    fn local(logs: &Arc<TenantLogs>, owner: &LogOwner) -> Source {
        let until = logs.last_seq(owner, None).unwrap_or(0);
        let (logs, owner) = (Arc::clone(logs), owner.clone());
        Source::Local(LocalRecords { logs, owner, handler: None, node: "a".into(), after: None, until, batch: VecDeque::new() })
    }

    /// Node `b`'s answer: `n` records at odd times, in frames as a peer connection gives them.
    fn peer(n: u64, filler: usize) -> Source {
        let text: String = (0..n)
            .map(|i| format!("{{\"node\":\"b\",\"seq\":{i},\"time_ms\":{},\"line\":\"{}\"}}\n", 2 * i + 1, "y".repeat(filler)))
            .collect();
        let frames = text.as_bytes().chunks(peers::PEER_READ_BUFFER).map(Bytes::copy_from_slice).collect();
        Source::Peer(peers::tests::answer("b", frames, n - 1))
    }

    #[tokio::test]
    async fn nodes_records_merge_by_time_holding_a_bounded_part_of_each() {
        // 4 MiB on each node: the merge holds a batch and a line of each.
        let (logs, owner) = local_log(4000, 1000);
        let (mut merge, failed) = Merge::start(vec![local(&logs, &owner), peer(4000, 1000)]).await;
        assert!(failed.is_empty());
        let (mut stamps, mut most) = (Vec::new(), 0);
        while let Some(line) = merge.next().await.unwrap() {
            most = most.max(merge.held());
            stamps.push((line.stamp.time_ms, line.stamp.node));
        }
        assert_eq!(stamps.len(), 8000);
        assert!(stamps.is_sorted(), "by time, the nodes interleaved");
        assert!(most <= 2 * SOURCE_BYTES, "{most} bytes held at most");
    }

    #[tokio::test]
    async fn a_read_is_sent_in_bounded_parts_and_ends_cleanly() {
        let (logs, owner) = local_log(2000, 1000);
        let budget = MemoryBudget::new(64 << 20);
        let (out, mut body) = Out::new(charge_reader(&budget, "t", 2).unwrap(), WRITE_TIMEOUT);
        let (merge, _) = Merge::start(vec![local(&logs, &owner), peer(2000, 1000)]).await;
        tokio::spawn(stream_read(merge, out));
        let (mut lines, mut largest) = (0, 0);
        while let Some(frame) = body.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            largest = largest.max(data.len());
            lines += data.iter().filter(|b| **b == b'\n').count();
        }
        assert_eq!(lines, 4000, "every record, and a clean end");
        assert!(largest <= PART_BYTES, "{largest}");
        assert_eq!(budget.used(), 0, "its charge given back");
    }

    #[tokio::test]
    async fn a_follower_whose_client_takes_nothing_is_ended_and_gives_back_its_place_and_charge() {
        let (logs, owner) = local_log(1000, 1000);
        let budget = MemoryBudget::new(64 << 20);
        let charge = charge_reader(&budget, "t", 1).unwrap();
        let write_timeout = Duration::from_millis(300);
        let (out, mut body) = Out::new(charge, write_timeout);
        let follower = logs.follow(&owner).unwrap();
        let end = Instant::now() + FOLLOW_FOR;
        let task = tokio::spawn(follow((Arc::clone(&logs), follower), (|| true, "a".into()), (None, None, end), out));
        // The log keeps filling; the body is never read.
        for _ in 0..20 {
            logs.push(&owner, LogRecord::output(0, ("h", 1), "r", "z".repeat(1000)));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::timeout(write_timeout * 4, task).await.expect("the follow ended").unwrap();
        assert_eq!(budget.used(), 0, "its charge given back");
        let places: Vec<_> = (0..MAX_FOLLOWERS).map(|_| logs.follow(&owner)).collect();
        assert!(places.iter().all(Option::is_some), "its follower place given back");
        let mut last = None;
        while let Some(frame) = body.frame().await {
            last = Some(frame.is_ok());
        }
        assert_eq!(last, Some(false), "the answer ends in an error: incomplete");
    }

    #[test]
    fn a_reader_that_does_not_fit_the_budget_is_refused_with_retry_after() {
        let budget = MemoryBudget::new(reader_bytes(2) - 1);
        let refusal = charge_reader(&budget, "t", 2).unwrap_err();
        let answer = reader_refused(refusal, 2);
        assert_eq!((refusal, answer.status()), (Refusal::Spent, StatusCode::SERVICE_UNAVAILABLE));
        assert_eq!(answer.headers()["retry-after"], "1");
        let held = charge_reader(&budget, "t", 1).unwrap();
        assert_eq!(budget.held_by("t"), reader_bytes(1));
        drop(held);
        assert_eq!(budget.used(), 0);
        assert!(reader_bytes(2) < 1 << 20, "a reader of two nodes holds a few hundred KiB: {}", reader_bytes(2));
    }

    /// A follow ends cleanly at its end, even while records keep coming;
    /// the gateway gives each follow a minute, as docs/api.md says.
    #[tokio::test]
    async fn a_follow_ends_cleanly_at_its_end_while_records_keep_coming() {
        assert_eq!(FOLLOW_FOR, Duration::from_secs(60), "docs/api.md: a follow lasts up to a minute");
        let (logs, owner) = local_log(0, 0);
        let budget = MemoryBudget::new(64 << 20);
        let (out, mut body) = Out::new(charge_reader(&budget, "t", 1).unwrap(), WRITE_TIMEOUT);
        let follower = logs.follow(&owner).unwrap();
        let (started, lasts) = (Instant::now(), Duration::from_millis(500));
        tokio::spawn(follow((Arc::clone(&logs), follower), (|| true, "a".into()), (None, None, started + lasts), out));
        // Records for 5 s, well past the follow's end.
        let (writing, writer) = (Arc::clone(&logs), owner.clone());
        let writer = tokio::spawn(async move {
            for _ in 0..500 {
                writing.push(&writer, LogRecord::output(0, ("h", 1), "r", "z".repeat(100)));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        let read = async {
            let mut lines = 0;
            while let Some(frame) = body.frame().await {
                lines += frame.expect("a clean end, not an error").into_data().unwrap().iter().filter(|b| **b == b'\n').count();
            }
            lines
        };
        let lines = tokio::time::timeout(Duration::from_secs(10), read).await.expect("the follow ended");
        let took = started.elapsed();
        writer.abort();
        assert!(lines > 0, "it followed");
        assert!(took >= lasts && took < lasts + Duration::from_secs(3), "ended {took:?} after it began, its end {lasts:?}");
        assert_eq!(budget.used(), 0, "its charge given back");
    }
}
