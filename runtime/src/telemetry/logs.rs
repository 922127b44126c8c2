//! Each tenant's own log: one record per request (time, handler, version,
//! status, duration, request id, the limit it hit) and the lines its
//! handler wrote to stdout and stderr, escaped as the node's log escapes
//! them, in a buffer of bounded size per tenant (the oldest records
//! dropped first, and counted), and in a bound for all tenants together
//! (past it the tenant holding the most drops its oldest). A tenant reads
//! its own through the tenant API (`GET /tenant/v1/logs`), and can follow
//! it as it grows. Per node: each node keeps the records of the requests it
//! served (the API reads every live node's).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::Serialize;

/// Unix ms now.
pub fn now_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}

/// Default bytes of records kept per tenant.
pub const DEFAULT_TENANT_LOG_BYTES: usize = 1 << 20;
/// Default bytes of records kept for all tenants together: within the
/// quarter of the process's memory the node's budget leaves as headroom.
pub const DEFAULT_TENANT_LOGS_TOTAL_BYTES: usize = 64 << 20;
/// Past the bound for all tenants, the largest logs are cut to this share
/// of it (7/8) at once, so the search for the largest is not made again
/// at every record.
const TOTAL_TRIM: (usize, usize) = (7, 8);
/// Bytes a record counts beside its text (its fixed fields).
const RECORD_OVERHEAD: usize = 96;

/// What a record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A request's outcome.
    Request,
    /// A line the handler wrote.
    Output,
}

/// Most bytes of a request's path its record keeps.
pub const MAX_LOGGED_PATH: usize = 1024;

/// One record of a tenant's log.
#[derive(Debug, Clone, Serialize)]
pub struct LogRecord {
    /// Its place in the tenant's log on this node: `since=` takes it.
    pub seq: u64,
    /// Unix ms.
    pub time_ms: i64,
    /// A request's outcome or a line of output.
    pub kind: Kind,
    /// The handler.
    pub handler: String,
    /// Its version.
    pub version: i64,
    /// The request (`x-request-id`).
    pub request_id: String,
    /// The answer's status (requests).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// From arrival to the answer's head, ms (requests).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<f64>,
    /// The limit the request hit, as `facegate_limit_hits_total` names it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<&'static str>,
    /// The path below the handler's mount, without the query (requests;
    /// its first [`MAX_LOGGED_PATH`] bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The line, escaped (output).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<String>,
}

impl LogRecord {
    /// A line `handler` (name, version) wrote during `request_id`.
    pub fn output(time_ms: i64, (handler, version): (&str, i64), request_id: &str, line: String) -> Self {
        Self {
            seq: 0,
            time_ms,
            kind: Kind::Output,
            handler: handler.to_owned(),
            version,
            request_id: request_id.to_owned(),
            status: None,
            duration_ms: None,
            limit: None,
            path: None,
            line: Some(line),
        }
    }

    /// The outcome of `request_id` to `handler` (name, version): its
    /// `status` after `duration`, and the limit it hit.
    pub fn request(
        (handler, version): (&str, i64),
        request_id: &str,
        (status, duration): (u16, std::time::Duration),
        limit: Option<&'static str>,
    ) -> Self {
        Self {
            seq: 0,
            time_ms: now_ms(),
            kind: Kind::Request,
            handler: handler.to_owned(),
            version,
            request_id: request_id.to_owned(),
            status: Some(status),
            duration_ms: Some(duration.as_secs_f64() * 1e3),
            limit,
            path: None,
            line: None,
        }
    }

    /// The record with the path its request asked for, cut to
    /// [`MAX_LOGGED_PATH`] bytes (at a character's boundary).
    pub fn at_path(mut self, path: &str) -> Self {
        let mut end = path.len().min(MAX_LOGGED_PATH);
        while !path.is_char_boundary(end) {
            end -= 1;
        }
        self.path = Some(path[..end].to_owned());
        self
    }

    /// The bytes it counts against its log's bound.
    pub fn size(&self) -> usize {
        let texts = [&self.line, &self.path].into_iter().flatten().map(String::len).sum::<usize>();
        RECORD_OVERHEAD + self.handler.len() + self.request_id.len() + texts
    }
}

/// One tenant's records.
#[derive(Default)]
struct Ring {
    records: VecDeque<LogRecord>,
    bytes: usize,
    /// Records dropped to stay within the bound, since start.
    dropped: u64,
    /// Woken at each of this tenant's records (its followers wait on it).
    grew: Arc<tokio::sync::Notify>,
    /// Followers now.
    followers: usize,
}

/// Most followers of one tenant's log on a node at once.
pub const MAX_FOLLOWERS: usize = 8;

/// Whose log: a tenant as one creation of it (its incarnation). A tenant
/// deleted and created again under its name has a log of its own: what the
/// old one's requests still in flight write after the deletion goes where
/// no reader of the new one looks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LogOwner(Arc<str>);

impl LogOwner {
    /// `tenant` as created with `incarnation`.
    pub fn new(tenant: &str, incarnation: &str) -> Self {
        Self(format!("{tenant}\0{incarnation}").into())
    }

    fn tenant(&self) -> &str {
        self.0.split('\0').next().unwrap_or_default()
    }
}

/// Every tenant's log on this node.
pub struct TenantLogs {
    /// The next record's `seq` (see [`seq_base`]).
    next_seq: std::sync::atomic::AtomicU64,
    capacity: AtomicUsize,
    total_capacity: AtomicUsize,
    tenants: Mutex<Rings>,
}

/// Where this process's `seq`s start: the time in ms × 1024. One counter
/// for every log, so a log made again (its tenant forgotten and back)
/// continues past every `seq` of the one before; and a restarted node
/// starts past every `seq` it gave before (the old process would have
/// needed 1024 records a ms all its life to reach it): a reader's cursor
/// from before skips nothing. Below 2^53, so exact in JavaScript too.
fn seq_base() -> u64 {
    u64::try_from(now_ms()).unwrap_or(0).saturating_mul(1024)
}

/// Every tenant's ring, and the bytes of them all.
#[derive(Default)]
struct Rings {
    by_owner: HashMap<LogOwner, Ring>,
    bytes: usize,
}

impl Rings {
    fn get(&self, owner: &LogOwner) -> Option<&Ring> {
        self.by_owner.get(owner)
    }

    /// Drops the oldest records of the largest logs until all of them take
    /// at most `bytes`: every log above a common level is cut to it (the
    /// level found once, not the largest log again at every record), and
    /// logs left empty with no follower are forgotten.
    fn trim_to(&mut self, bytes: usize) {
        let level = water_level(self.by_owner.values().map(|r| r.bytes).collect(), bytes);
        for ring in self.by_owner.values_mut() {
            while ring.bytes > level {
                let Some(old) = ring.records.pop_front() else { break };
                ring.bytes -= old.size();
                ring.dropped += 1;
                self.bytes -= old.size();
            }
        }
        self.by_owner.retain(|_, ring| !ring.records.is_empty() || ring.followers > 0);
    }
}

/// The largest level such that `sizes`, each cut to it, sum to at most
/// `total`.
fn water_level(mut sizes: Vec<usize>, total: usize) -> usize {
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let mut rest: usize = sizes.iter().sum();
    for (k, &size) in sizes.iter().enumerate() {
        rest -= size;
        // The k + 1 largest cut to one level, the rest as they are.
        let level = total.saturating_sub(rest) / (k + 1);
        if sizes.get(k + 1).is_none_or(|&next| level >= next) {
            return level;
        }
    }
    0
}

impl Default for TenantLogs {
    fn default() -> Self {
        Self {
            next_seq: std::sync::atomic::AtomicU64::new(seq_base()),
            capacity: AtomicUsize::new(DEFAULT_TENANT_LOG_BYTES),
            total_capacity: AtomicUsize::new(DEFAULT_TENANT_LOGS_TOTAL_BYTES),
            tenants: Mutex::default(),
        }
    }
}

/// A follower of one tenant's log (see [`TenantLogs::follow`]); its place
/// is given back when it drops.
pub struct Follower {
    logs: Arc<TenantLogs>,
    owner: LogOwner,
    /// Notified at each of the tenant's new records.
    pub grew: Arc<tokio::sync::Notify>,
}

impl Follower {
    /// Whose log it follows.
    pub fn owner(&self) -> &LogOwner {
        &self.owner
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        if let Some(ring) = self.logs.lock().by_owner.get_mut(&self.owner) {
            ring.followers = ring.followers.saturating_sub(1);
        }
    }
}

/// What a read returns: the records after `since`, and how many the tenant
/// has had dropped.
#[derive(Debug, Default)]
pub struct Read {
    /// The records, oldest first.
    pub records: Vec<LogRecord>,
    /// Records dropped to keep the bound, since the node started.
    pub dropped: u64,
}

impl TenantLogs {
    /// Bytes of records kept per tenant from now on.
    pub fn set_capacity(&self, bytes: usize) {
        self.capacity.store(bytes.max(RECORD_OVERHEAD), Ordering::Relaxed);
    }

    /// Bytes of records kept for all tenants together from now on.
    pub fn set_total_capacity(&self, bytes: usize) {
        self.total_capacity.store(bytes.max(RECORD_OVERHEAD), Ordering::Relaxed);
    }

    /// Appends `record` (its `seq` is set here) to `owner`'s log, dropping
    /// the oldest past the tenant's bound, and the largest logs' oldest past
    /// the bound for all.
    pub fn push(&self, owner: &LogOwner, mut record: LogRecord) {
        let capacity = self.capacity.load(Ordering::Relaxed);
        let total_capacity = self.total_capacity.load(Ordering::Relaxed);
        let grew = {
            let mut rings = self.lock();
            let ring = rings.by_owner.entry(owner.clone()).or_default();
            // Taken under the lock: a ring's records stay in `seq` order.
            record.seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            let before = ring.bytes;
            ring.bytes += record.size();
            ring.records.push_back(record);
            while ring.bytes > capacity {
                let Some(old) = ring.records.pop_front() else { break };
                ring.bytes -= old.size();
                ring.dropped += 1;
            }
            let grew = (ring.followers > 0).then(|| Arc::clone(&ring.grew));
            let after = ring.bytes;
            rings.bytes = rings.bytes + after - before;
            if rings.bytes > total_capacity {
                rings.trim_to(total_capacity / TOTAL_TRIM.1 * TOTAL_TRIM.0);
            }
            grew
        };
        if let Some(grew) = grew {
            grew.notify_waiters();
        }
    }

    /// A place among `owner`'s followers, or `None` when it has
    /// [`MAX_FOLLOWERS`] already.
    pub fn follow(self: &Arc<Self>, owner: &LogOwner) -> Option<Follower> {
        let mut rings = self.lock();
        let ring = rings.by_owner.entry(owner.clone()).or_default();
        if ring.followers >= MAX_FOLLOWERS {
            return None;
        }
        ring.followers += 1;
        let grew = Arc::clone(&ring.grew);
        drop(rings);
        Some(Follower { logs: Arc::clone(self), owner: owner.clone(), grew })
    }

    /// `owner`'s records after `since` (all with `None`), of `handler` only if given.
    pub fn read(&self, owner: &LogOwner, since: Option<u64>, handler: Option<&str>) -> Read {
        let rings = self.lock();
        let Some(ring) = rings.get(owner) else { return Read::default() };
        // In `seq` order: the first record after `since` is found by bisection.
        let skip = since.map_or(0, |s| ring.records.partition_point(|r| r.seq <= s));
        let records = ring.records.iter().skip(skip).filter(|r| handler.is_none_or(|h| r.handler == h)).cloned().collect();
        Read { records, dropped: ring.dropped }
    }

    /// `owner`'s records after `after` up to `until` (both `seq`s), of
    /// `handler` only if given, oldest first: as many as fit in `max_bytes`
    /// (their sizes as the log counts them), and always one if any is left,
    /// so a reader copies its log a bounded batch at a time.
    pub fn read_batch(
        &self,
        owner: &LogOwner,
        (after, until): (Option<u64>, u64),
        handler: Option<&str>,
        max_bytes: usize,
    ) -> Vec<LogRecord> {
        let rings = self.lock();
        let Some(ring) = rings.get(owner) else { return Vec::new() };
        let skip = after.map_or(0, |s| ring.records.partition_point(|r| r.seq <= s));
        let mut bytes = 0;
        let mut batch = Vec::new();
        for record in ring.records.iter().skip(skip).take_while(|r| r.seq <= until).filter(|r| handler.is_none_or(|h| r.handler == h)) {
            if !batch.is_empty() && bytes + record.size() > max_bytes {
                break;
            }
            bytes += record.size();
            batch.push(record.clone());
        }
        batch
    }

    /// The `seq` of `owner`'s newest record (of `handler` only, if given):
    /// where a read that starts now ends.
    pub fn last_seq(&self, owner: &LogOwner, handler: Option<&str>) -> Option<u64> {
        let rings = self.lock();
        rings.get(owner)?.records.iter().rev().find(|r| handler.is_none_or(|h| r.handler == h)).map(|r| r.seq)
    }

    /// Records `owner` has had dropped to keep the bounds.
    pub fn read_dropped(&self, owner: &LogOwner) -> u64 {
        self.lock().get(owner).map_or(0, |r| r.dropped)
    }

    /// The bytes `owner`'s records take.
    pub fn bytes(&self, owner: &LogOwner) -> usize {
        self.lock().get(owner).map_or(0, |r| r.bytes)
    }

    /// The bytes all tenants' records take.
    pub fn total_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Forgets a deleted tenant's log (every creation of its name).
    pub fn forget(&self, tenant: &str) {
        let mut rings = self.lock();
        let mut freed = 0;
        rings.by_owner.retain(|owner, ring| {
            let keep = owner.tenant() != tenant;
            freed += if keep { 0 } else { ring.bytes };
            keep
        });
        rings.bytes -= freed;
    }

    fn lock(&self) -> MutexGuard<'_, Rings> {
        self.tenants.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl super::TenantCounters for TenantLogs {
    fn forget_tenant(&self, tenant: &str) {
        self.forget(tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(handler: &str, text: &str) -> LogRecord {
        LogRecord::output(0, (handler, 1), "r", text.into())
    }

    fn owner(tenant: &str) -> LogOwner {
        LogOwner::new(tenant, "first")
    }

    #[test]
    fn a_tenant_reads_its_own_records_after_a_cursor() {
        let logs = TenantLogs::default();
        let (a, b) = (owner("a"), owner("b"));
        logs.push(&a, line("h", "one"));
        logs.push(&a, line("g", "two"));
        logs.push(&b, line("h", "theirs"));
        let all = logs.read(&a, None, None).records;
        assert_eq!(all.iter().map(|r| r.line.as_deref().unwrap()).collect::<Vec<_>>(), ["one", "two"]);
        assert_eq!(logs.read(&a, Some(all[0].seq), None).records.len(), 1, "after the cursor");
        assert_eq!(logs.read(&a, None, Some("g")).records.len(), 1, "one handler's");
        assert!(logs.read(&owner("c"), None, None).records.is_empty());
    }

    #[test]
    fn a_tenant_created_again_reads_nothing_the_old_one_wrote_after_its_deletion() {
        let logs = TenantLogs::default();
        let (old, new) = (LogOwner::new("t", "first"), LogOwner::new("t", "second"));
        logs.push(&old, line("h", "before"));
        logs.forget("t");
        logs.push(&old, line("h", "in flight at the deletion"));
        logs.push(&new, line("h", "mine"));
        let read: Vec<String> = logs.read(&new, None, None).records.into_iter().filter_map(|r| r.line).collect();
        assert_eq!(read, ["mine"]);
        logs.forget("t");
        assert_eq!(logs.total_bytes(), 0, "every creation of the name forgotten");
    }

    #[test]
    fn a_log_made_again_continues_past_every_seq_of_the_one_before() {
        let logs = TenantLogs::default();
        let t = owner("t");
        (0..100).for_each(|i| logs.push(&t, line("h", &format!("{i}"))));
        let cursor = logs.read(&t, None, None).records.last().unwrap().seq;
        logs.forget("t"); // as a restarted node starts empty
        logs.push(&t, line("h", "after"));
        let after = logs.read(&t, Some(cursor), None).records;
        assert_eq!(after.len(), 1, "an old cursor skips nothing of the new log");
    }

    #[test]
    fn a_reader_copies_a_bounded_batch_at_a_time_up_to_where_it_started() {
        let logs = TenantLogs::default();
        let t = owner("t");
        (0..100).for_each(|i| logs.push(&t, line(if i % 2 == 0 { "h" } else { "g" }, &"x".repeat(100))));
        let end = logs.last_seq(&t, None).unwrap();
        logs.push(&t, line("h", "after the read began"));
        let (mut after, mut seen, mut batches) = (None, 0, 0);
        loop {
            let batch = logs.read_batch(&t, (after, end), None, 1024);
            let Some(last) = batch.last() else { break };
            assert!(batch.iter().map(LogRecord::size).sum::<usize>() <= 1024, "one batch is bounded");
            (after, seen, batches) = (Some(last.seq), seen + batch.len(), batches + 1);
        }
        assert_eq!((seen, batches), (100, 20), "all records to where the read began, in batches of five");
        assert_eq!(logs.read_batch(&t, (None, end), Some("g"), 1 << 20).len(), 50, "one handler's");
        assert_eq!(logs.read_batch(&t, (None, u64::MAX), None, 1).len(), 1, "one record even past the bytes");
        assert_eq!(logs.last_seq(&t, Some("g")), Some(end), "the newest of one handler's");
        assert!(logs.last_seq(&t, None).unwrap() > end && logs.last_seq(&owner("u"), None).is_none());
    }

    #[test]
    fn the_water_level_cuts_the_largest_first() {
        assert_eq!(water_level(vec![100, 10, 10], 60), 40);
        assert!(water_level(vec![30, 30], 100) >= 30, "already within: nothing cut");
        assert_eq!(water_level(vec![50, 50, 1], 41), 20);
    }

    #[test]
    fn followers_are_counted_and_capped() {
        let logs = Arc::new(TenantLogs::default());
        let held: Vec<Follower> = (0..MAX_FOLLOWERS).map(|_| logs.follow(&owner("t")).unwrap()).collect();
        assert!(logs.follow(&owner("t")).is_none(), "capped");
        assert!(logs.follow(&owner("u")).is_some(), "per tenant");
        drop(held);
        assert!(logs.follow(&owner("t")).is_some(), "places come back");
    }

    #[test]
    fn all_tenants_together_stay_within_the_node_bound_the_largest_paying() {
        let logs = TenantLogs::default();
        logs.set_capacity(64 << 10);
        logs.set_total_capacity(100 << 10);
        let (quiet, loud) = (owner("quiet"), owner("loud"));
        for i in 0..20 {
            logs.push(&quiet, line("h", &format!("quiet {i}")));
        }
        let quiet_bytes = logs.bytes(&quiet);
        for (i, tenant) in (0..3000).map(|i| (i, format!("t{}", i % 30))) {
            logs.push(&owner(&tenant), line("h", &format!("{i} {}", "x".repeat(200))));
            logs.push(&loud, line("h", &"y".repeat(300)));
        }
        assert!(logs.total_bytes() <= 100 << 10, "{}", logs.total_bytes());
        assert_eq!(logs.bytes(&quiet), quiet_bytes, "a tenant below its share keeps its records");
        assert!(logs.read(&loud, None, None).dropped > 0, "the largest pays");
        logs.forget("loud");
        assert_eq!(
            logs.total_bytes(),
            (0..30).map(|i| logs.bytes(&owner(&format!("t{i}")))).sum::<usize>() + quiet_bytes,
            "counted exactly"
        );
    }

    #[test]
    fn a_flood_keeps_the_bound_and_counts_what_it_dropped() {
        let logs = TenantLogs::default();
        logs.set_capacity(4096);
        let t = owner("t");
        for i in 0..1000 {
            logs.push(&t, line("h", &format!("line {i} {}", "x".repeat(100))));
        }
        assert!(logs.bytes(&t) <= 4096);
        let read = logs.read(&t, None, None);
        assert!(read.dropped > 900 && read.records.len() + read.dropped as usize == 1000, "{}", read.dropped);
        let (first, last) = (read.records[0].seq, read.records.last().unwrap().seq);
        assert_eq!(last - first + 1, read.records.len() as u64, "consecutive: the newest stay");
        let number = |r: &LogRecord| -> u64 { r.line.as_deref().unwrap().split(' ').nth(1).unwrap().parse().unwrap() };
        assert_eq!(number(read.records.last().unwrap()), 999, "the newest record kept");
        assert_eq!(number(&read.records[0]), read.dropped, "exactly the oldest dropped: lines 0 to {} gone", read.dropped - 1);
        assert!(logs.read(&t, Some(u64::MAX), None).records.is_empty(), "a cursor past the end reads nothing, never overflows");
    }
}
