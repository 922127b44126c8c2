//! `GET /tenant/v1/logs`: a tenant's own log on this node (see
//! [`crate::metrics::logs`]), as JSON lines, once or followed as it grows.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Request, Response, StatusCode};
use tokio::sync::mpsc;

use super::app::App;
use super::auth::bearer;
use super::response::{self, Body};
use crate::control::ControlPlane;
use crate::control::keys::Scopes;
use crate::metrics::logs::{Follower, LogRecord, MAX_FOLLOWERS, TenantLogs};

/// Longest one follow stays open; the client asks again with `since=`.
const FOLLOW_FOR: Duration = Duration::from_secs(60);
/// The header that says how many records the tenant has had dropped.
const DROPPED_HEADER: &str = "x-facegate-logs-dropped";
/// The content type: one JSON record a line.
const NDJSON: &str = "application/x-ndjson";

/// What a logs request asks for.
#[derive(Debug, Default, PartialEq)]
struct LogQuery {
    handler: Option<String>,
    since: Option<u64>,
    follow: bool,
}

impl LogQuery {
    /// Parses `handler`, `since` (a record's `seq`: the records after it)
    /// and `follow` (`true`/`1`); the error says what is wrong.
    fn parse(query: &str) -> Result<Self, String> {
        let mut parsed = Self::default();
        for (name, value) in query.split('&').filter(|kv| !kv.is_empty()).map(|kv| kv.split_once('=').unwrap_or((kv, ""))) {
            match name {
                "handler" => parsed.handler = Some(value.to_owned()),
                "since" => parsed.since = Some(value.parse().map_err(|_| format!("since must be a record's seq, not {value:?}"))?),
                "follow" => parsed.follow = matches!(value, "" | "true" | "1"),
                _ => return Err(format!("unknown parameter {name:?} (handler, since, follow)")),
            }
        }
        Ok(parsed)
    }
}

/// Records as JSON lines.
fn ndjson(records: &[LogRecord]) -> String {
    records.iter().filter_map(|r| serde_json::to_string(r).ok()).map(|line| line + "\n").collect()
}

impl App {
    /// Serves `GET /tenant/v1/logs` for `tenant` (its key's `read` scope checked).
    pub(super) fn tenant_logs(&self, req: &Request<Incoming>, tenant: &str) -> Response<Body> {
        let query = match LogQuery::parse(req.uri().query().unwrap_or("")) {
            Ok(query) => query,
            Err(message) => return response::error(StatusCode::BAD_REQUEST, "invalid_parameter", message),
        };
        let logs = Arc::clone(self.sandbox.logs());
        let mut answer = if query.follow {
            let Some(follower) = logs.follow(tenant) else {
                let message = format!("this tenant's log has {MAX_FOLLOWERS} followers on this node already");
                return response::retry_later(StatusCode::TOO_MANY_REQUESTS, "too_many_followers", &message, 5);
            };
            let reader = Reader {
                control: Arc::clone(&self.control),
                tenant: tenant.to_owned(),
                key: bearer(req).unwrap_or_default().to_owned(),
                incarnation: self.control.live().tenants.get(tenant).map(|e| e.incarnation.clone()),
            };
            let (tx, rx) = mpsc::channel(16);
            tokio::spawn(follow((Arc::clone(&logs), follower), reader, query, tx));
            Response::new(Lines(rx).boxed_unsync())
        } else {
            response::text(NDJSON, ndjson(&logs.read(tenant, query.since, query.handler.as_deref()).records))
        };
        let dropped = logs.read_dropped(tenant);
        answer.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(NDJSON));
        answer.headers_mut().insert(DROPPED_HEADER, HeaderValue::from(dropped));
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
}

impl Reader {
    fn may_read(&self) -> bool {
        let live = self.control.live();
        let key_reads = live.authenticate(Some(&self.key)).is_some_and(|(t, scopes)| t == self.tenant && scopes.contains(Scopes::READ));
        key_reads && live.tenants.get(&self.tenant).map(|e| &e.incarnation) == self.incarnation.as_ref()
    }
}

/// Sends the tenant's records after `query.since` as they come, for
/// [`FOLLOW_FOR`], until the client goes, or until `reader` may read no more.
async fn follow((logs, follower): (Arc<TenantLogs>, Follower), reader: Reader, query: LogQuery, tx: mpsc::Sender<Bytes>) {
    let end = Instant::now() + FOLLOW_FOR;
    let mut since = query.since;
    loop {
        // Armed before the read: a record added in between still wakes us.
        let changed = follower.grew.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if !reader.may_read() {
            return;
        }
        let read = logs.read(&reader.tenant, since, query.handler.as_deref());
        if let Some(last) = read.records.last() {
            since = Some(last.seq);
            if tx.send(ndjson(&read.records).into()).await.is_err() {
                return;
            }
        }
        tokio::select! {
            () = &mut changed => {}
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
        assert_eq!(q, LogQuery { handler: Some("faces".into()), since: Some(41), follow: true });
        assert!(LogQuery::parse("since=yesterday").unwrap_err().contains("seq"));
        assert!(LogQuery::parse("tenant=other").unwrap_err().contains("unknown parameter"));
    }
}
