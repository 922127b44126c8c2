//! `GET /tenant/v1/logs`: a tenant's own log (see [`crate::metrics::logs`])
//! from every live node of the cluster, as JSON lines, once or followed as
//! it grows. Each node keeps the records of the requests it served; the
//! node asked adds the others' (see [`super::peers`]). A record names its
//! node and its `seq` there; a cursor (`since=node-a:41,node-b:12`) says
//! where a reader is on each node.

use std::collections::BTreeMap;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::app::App;
use super::auth::bearer;
use super::peers::{self, Asked, PEER_TIMEOUT, Peer};
use super::response::{self, Body};
use crate::config::valid_node_id;
use crate::control::ControlPlane;
use crate::control::keys::Scopes;
use crate::metrics::logs::{Follower, LogOwner, LogRecord, MAX_FOLLOWERS, TenantLogs};
use crate::sandbox::handler::valid_name;

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

/// What a merge needs of a record line: where it sorts.
#[derive(Deserialize)]
struct Stamp {
    time_ms: i64,
    node: String,
    seq: u64,
}

/// This node's records as JSON lines.
fn ndjson(records: &[LogRecord], node: &str) -> String {
    records.iter().filter_map(|record| serde_json::to_string(&OnNode { node, record }).ok()).map(|line| line + "\n").collect()
}

/// Records of several nodes, as lines.
#[derive(Default)]
struct Merged {
    lines: Vec<(Stamp, Vec<u8>)>,
}

impl Merged {
    /// Adds every line of `text` that is a record of `node` (a node asked at
    /// a wrong address, this one's own say, gives none of another's).
    fn add(&mut self, text: &[u8], node: &str) {
        for line in text.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            if let Ok(stamp) = serde_json::from_slice::<Stamp>(line)
                && stamp.node == node
            {
                self.lines.push((stamp, line.to_vec()));
            }
        }
    }

    /// The records by time (then node and seq), and the cursor after them.
    fn into_answer(mut self, mut cursor: Cursor) -> (Vec<u8>, Cursor) {
        self.lines.sort_by(|(a, _), (b, _)| (a.time_ms, &a.node, a.seq).cmp(&(b.time_ms, &b.node, b.seq)));
        let mut body = Vec::new();
        for (stamp, line) in self.lines {
            cursor.advance(&stamp.node, stamp.seq);
            body.extend_from_slice(&line);
            body.push(b'\n');
        }
        (body, cursor)
    }
}

/// What the other nodes gave: their answers, dropped counts summed, and
/// the ids of those that gave none.
struct FromPeers {
    answers: Vec<(Peer, hyper::Response<Incoming>)>,
    dropped: u64,
    unreachable: Vec<String>,
}

impl FromPeers {
    fn gather(peers: Vec<Peer>, asked: Vec<Asked>) -> Self {
        let mut gathered = Self { answers: Vec::new(), dropped: 0, unreachable: Vec::new() };
        for (peer, asked) in peers.into_iter().zip(asked) {
            match asked {
                Ok(answer) => {
                    gathered.dropped += peers::dropped(&answer, DROPPED_HEADER);
                    gathered.answers.push((peer, answer));
                }
                Err(why) => gathered.unreachable(peer.id, &why),
            }
        }
        gathered
    }

    fn unreachable(&mut self, node: String, why: &str) {
        tracing::warn!(node = %node, reason = why, "a tenant's log not read from a live node");
        self.unreachable.push(node);
    }
}

/// Sets a header when its value is valid (ours always are).
fn set_header(answer: &mut Response<Body>, name: &'static str, value: String) {
    if let Ok(value) = HeaderValue::try_from(value) {
        answer.headers_mut().insert(HeaderName::from_static(name), value);
    }
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
        let incarnation = self.control.live().tenants.get(tenant).map(|e| e.incarnation.clone());
        let owner = LogOwner::new(tenant, incarnation.as_deref().unwrap_or_default());
        let mut answer = if query.follow {
            let Some(follower) = logs.follow(&owner) else {
                let message = format!("this tenant's log has {MAX_FOLLOWERS} followers on this node already");
                return response::retry_later(StatusCode::TOO_MANY_REQUESTS, "too_many_followers", &message, 5);
            };
            let asked = peers::ask_all(&peers, &key, self.config.peer_ca_cert.as_ref()).await;
            let from_peers = FromPeers::gather(peers, asked);
            let reader = Reader {
                control: Arc::clone(&self.control),
                tenant: tenant.to_owned(),
                key,
                incarnation,
                owner,
                node: Arc::clone(&self.node),
            };
            self.followed((logs, follower), reader, query, from_peers)
        } else {
            self.read_logs(&owner, &query, (peers, &key)).await
        };
        answer.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(NDJSON));
        answer
    }

    /// The other live nodes, each with its query.
    fn peers(&self, query: &LogQuery) -> Vec<Peer> {
        let nodes = self.control.alive_nodes();
        nodes.iter().filter(|n| *n.id != *self.node).map(|n| Peer::new(n, &query.for_peer(&n.id))).collect()
    }

    /// The tenant's records after the cursor on this node and `peers`, by time.
    async fn read_logs(&self, owner: &LogOwner, query: &LogQuery, (peers, key): (Vec<Peer>, &str)) -> Response<Body> {
        let asked = peers::ask_all(&peers, key, self.config.peer_ca_cert.as_ref()).await;
        let mut from_peers = FromPeers::gather(peers, asked);
        let read = self.sandbox.logs().read(owner, query.since.of(&self.node, true), query.handler.as_deref());
        let mut merged = Merged::default();
        merged.add(ndjson(&read.records, &self.node).as_bytes(), &self.node);
        let until = Instant::now() + PEER_TIMEOUT;
        for (peer, answer) in std::mem::take(&mut from_peers.answers) {
            match peers::read_all(answer, until).await {
                Ok(text) => merged.add(&text, &peer.id),
                Err(why) => from_peers.unreachable(peer.id, &why),
            }
        }
        let (body, cursor) = merged.into_answer(query.since.resolved(&self.node));
        let mut answer = response::text(NDJSON, String::from_utf8_lossy(&body).into_owned());
        set_header(&mut answer, DROPPED_HEADER, (read.dropped + from_peers.dropped).to_string());
        set_header(&mut answer, CURSOR_HEADER, cursor.to_string());
        if !from_peers.unreachable.is_empty() {
            set_header(&mut answer, UNREACHABLE_HEADER, from_peers.unreachable.join(","));
        }
        answer
    }

    /// The tenant's log followed: this node's records and the peers'
    /// streams, as they come.
    fn followed(&self, local: (Arc<TenantLogs>, Follower), reader: Reader, query: LogQuery, from_peers: FromPeers) -> Response<Body> {
        let dropped = local.0.read_dropped(&reader.owner) + from_peers.dropped;
        // Where the follow starts, the asked node named: a client resumes from it.
        let cursor = query.since.resolved(&self.node);
        let (tx, rx) = mpsc::channel(16);
        let end = Instant::now() + FOLLOW_FOR;
        for (peer, answer) in from_peers.answers {
            tokio::spawn(peers::pump(answer, (peer.id, tx.clone()), end));
        }
        tokio::spawn(follow(local, reader, (query, end), tx));
        let mut answer = Response::new(Lines(rx).boxed_unsync());
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
    incarnation: Option<String>,
    /// Its log on this node.
    owner: LogOwner,
    /// This node's id, in each record.
    node: Arc<str>,
}

impl Reader {
    fn may_read(&self) -> bool {
        let live = self.control.live();
        let key_reads = live.authenticate(Some(&self.key)).is_some_and(|(t, scopes)| t == self.tenant && scopes.contains(Scopes::READ));
        key_reads && live.tenants.get(&self.tenant).map(|e| &e.incarnation) == self.incarnation.as_ref()
    }
}

/// Sends the tenant's records on this node after `query.since` as they
/// come, until `end`, until the client goes, or until `reader` may read no
/// more.
async fn follow((logs, follower): (Arc<TenantLogs>, Follower), reader: Reader, (query, end): (LogQuery, Instant), tx: mpsc::Sender<Bytes>) {
    let mut since = query.since.of(&reader.node, true);
    loop {
        // Armed before the read: a record added in between still wakes us.
        let changed = follower.grew.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if !reader.may_read() {
            return;
        }
        let read = logs.read(&reader.owner, since, query.handler.as_deref());
        if let Some(last) = read.records.last() {
            since = Some(last.seq);
            if tx.send(ndjson(&read.records, &reader.node).into()).await.is_err() {
                return;
            }
        }
        tokio::select! {
            () = &mut changed => {}
            // Checked again now and then: a tenant deleted writes nothing to wake us.
            () = tokio::time::sleep(RECHECK_EVERY) => {}
            () = tokio::time::sleep_until(end.into()) => return,
            () = tx.closed() => return,
        }
    }
}

/// A response body of the chunks a channel receives; it ends when the
/// sender does.
struct Lines(mpsc::Receiver<Bytes>);

impl hyper::body::Body for Lines {
    type Data = Bytes;
    type Error = wasmtime_wasi_http::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, wasmtime_wasi_http::Error>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|bytes| Ok(Frame::data(bytes))))
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

    #[test]
    fn nodes_records_merge_by_time_and_advance_the_cursor() {
        let mut merged = Merged::default();
        merged.add(b"{\"node\":\"b\",\"seq\":3,\"time_ms\":20}\n{\"node\":\"b\",\"seq\":4,\"time_ms\":40}\n", "b");
        merged.add(b"{\"node\":\"a\",\"seq\":9,\"time_ms\":30}\nnot a record\n{\"node\":\"b\",\"seq\":5,\"time_ms\":1}\n", "a");
        let (body, cursor) = merged.into_answer(Cursor::parse("a:8,c:1").unwrap());
        let order: Vec<u64> = String::from_utf8(body)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"].as_u64().unwrap())
            .collect();
        assert_eq!(order, [3, 9, 4]);
        assert_eq!(cursor.to_string(), "a:9,b:4,c:1");
    }
}
