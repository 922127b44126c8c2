//! The snapshot the data plane reads ([`Live`]): tenants with their
//! admission gates and active handlers, and the active API keys. Built by
//! `Serving::refresh` and swapped in whole; never changed in place. A
//! key created or revoked on this node swaps in a copy with only its key
//! map changed ([`Live::with_keys`]): the tenants are shared, not rebuilt.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::keys::{self, Scopes};
use super::secrets::SecretsKey;
use super::store::{AbortRule, Canary};
use super::store::{NodeRow, RouteRow, StoredSetting};
use crate::admission::gate::TenantGate;
use crate::sandbox::handler::Handler;
use crate::sandbox::settings::{HandlerSettings, Vars};

/// One tenant in the live snapshot.
#[derive(Clone)]
pub struct TenantEntry {
    /// Which creation of a tenant of this name (see `store::new_incarnation`).
    pub incarnation: Arc<str>,
    /// Admission state.
    pub gate: Arc<TenantGate>,
    /// Active handler versions by name.
    pub handlers: HashMap<String, Arc<Handler>>,
    /// Canaries beside them, by handler name.
    pub canaries: HashMap<String, Arc<LiveCanary>>,
}

impl TenantEntry {
    /// Every handler version served: the active ones and the canaries.
    pub fn all_handlers(&self) -> impl Iterator<Item = &Arc<Handler>> {
        self.handlers.values().chain(self.canaries.values().map(|c| &c.handler))
    }
}

/// A canary being served: its version, its share and abort rule, and this
/// node's counts of each side's answers (kept across snapshots while the
/// canary is the same version).
pub struct LiveCanary {
    /// The version on trial.
    pub handler: Arc<Handler>,
    /// Its share and abort rule.
    pub canary: Canary,
    /// Answers counted on this node.
    pub counts: Arc<CanaryCounts>,
}

/// Which version answered a request of a handler with a canary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The active version.
    Stable,
    /// The canary.
    Canary,
}

/// Each side's requests and 5xx answers on this node.
#[derive(Default)]
pub struct CanaryCounts {
    stable: [AtomicU64; 2],
    canary: [AtomicU64; 2],
    aborting: AtomicBool,
}

impl CanaryCounts {
    /// Counts an answer of `status` from `side`; true once, when `rule`
    /// first holds: the canary has served `after` answers and its share of
    /// 5xx exceeds the active version's by more than `margin`.
    fn record(&self, rule: Option<AbortRule>, side: Side, status: u16) -> bool {
        let counts = match side {
            Side::Stable => &self.stable,
            Side::Canary => &self.canary,
        };
        counts[0].fetch_add(1, Ordering::Relaxed);
        counts[1].fetch_add(u64::from(status >= 500), Ordering::Relaxed);
        let Some(rule) = rule else { return false };
        let share = |c: &[AtomicU64; 2]| {
            let n = c[0].load(Ordering::Relaxed);
            (n, if n == 0 { 0.0 } else { c[1].load(Ordering::Relaxed) as f64 / n as f64 })
        };
        let ((served, canary_errors), (_, stable_errors)) = (share(&self.canary), share(&self.stable));
        served >= rule.after && canary_errors > stable_errors + rule.margin && !self.aborting.swap(true, Ordering::AcqRel)
    }
}

impl LiveCanary {
    /// Which side a request drawn `draw` (0 to 99, uniform) goes to.
    pub fn side(&self, draw: u8) -> Side {
        if draw < self.canary.percent { Side::Canary } else { Side::Stable }
    }

    /// Counts an answer of `status` from `side`; true once, when the abort
    /// rule first holds (the caller then ends the canary).
    pub fn record(&self, side: Side, status: u16) -> bool {
        self.counts.record(self.canary.abort, side, status)
    }

    /// An abort that could not reach the store: the rule may fire again.
    pub fn abort_failed(&self) {
        self.counts.aborting.store(false, Ordering::Release);
    }

    /// This node's counts: requests and 5xx answers of the active version, then of the canary.
    pub fn counted(&self) -> [(u64, u64); 2] {
        let read = |c: &[AtomicU64; 2]| (c[0].load(Ordering::Relaxed), c[1].load(Ordering::Relaxed));
        [read(&self.counts.stable), read(&self.counts.canary)]
    }
}

/// An unrevoked key: whose it is, its secret's digest and its scopes.
pub(super) struct ActiveKey {
    pub(super) tenant: String,
    pub(super) secret_sha256: [u8; 32],
    pub(super) scopes: Scopes,
}

/// The active keys by id. Entries are shared, so a copy with one key more
/// or less costs a table of pointers, not a copy of every key.
pub(super) type KeyMap = HashMap<Arc<str>, Arc<ActiveKey>>;

/// Where a routed hostname goes, as the snapshot holds it (see `super::routes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRoute {
    /// The tenant the hostname belongs to.
    pub tenant: String,
    /// The tenant's handler it runs.
    pub handler: String,
}

/// The snapshot's hostnames: lowercase, without a port or a trailing dot.
pub type HostRoutes = HashMap<String, HostRoute>;

/// The snapshot's table from the store's rows.
pub(super) fn host_routes(rows: Vec<RouteRow>) -> HostRoutes {
    rows.into_iter().map(|r| (r.hostname, HostRoute { tenant: r.tenant, handler: r.handler })).collect()
}

/// Every tenant's settings as its handlers read them (see `super::settings`).
#[derive(Debug, Default, Clone)]
pub struct LiveSettings(HashMap<String, Arc<TenantSettings>>);

/// One tenant's settings: its own and each handler's, each once.
#[derive(Debug, Default)]
struct TenantSettings {
    /// Which creation of the tenant they belong to: another one of the
    /// same name (deleted and created again, not yet synced here) reads none.
    incarnation: String,
    every: Arc<Vars>,
    handlers: HashMap<String, Arc<Vars>>,
}

impl LiveSettings {
    /// What `tenant`'s `handler` reads, if `incarnation` is the tenant's whose settings these are.
    fn of(&self, (tenant, incarnation): (&str, &str), handler: &str) -> HandlerSettings {
        match self.0.get(tenant).filter(|s| s.incarnation == incarnation) {
            None => HandlerSettings::default(),
            Some(settings) => {
                let own = settings.handlers.get(handler).map_or_else(|| HandlerSettings::default().own, Arc::clone);
                HandlerSettings { own, every: Arc::clone(&settings.every) }
            }
        }
    }

    /// These, with `tenant`'s replaced by those of `rows` (its settings as
    /// the store has them now; none: it has none).
    pub(super) fn with_tenant(&self, tenant: &str, rows: Vec<StoredSetting>, key: Option<&SecretsKey>) -> LiveSettings {
        let mut settings = self.clone();
        settings.0.remove(tenant);
        settings.0.extend(live_settings(rows, key).0);
        settings
    }

    /// Forgets a deleted tenant's.
    pub(super) fn remove(&mut self, tenant: &str) {
        self.0.remove(tenant);
    }
}

/// The associated data a setting's secret is sealed with: its tenant (this
/// creation of it), handler and name, so a sealed value moved to another
/// row, or restored into a tenant created again, does not open.
pub(super) fn setting_context(tenant: (&str, &str), handler: &str, name: &str) -> Vec<u8> {
    let (tenant, incarnation) = tenant;
    [b"setting\0", tenant.as_bytes(), b"\0", incarnation.as_bytes(), b"\0", handler.as_bytes(), b"\0", name.as_bytes()].concat()
}

/// The snapshot's settings from the store's rows, secrets opened with
/// `key`: one that does not open (or no key) is an error for its name,
/// which its handler gets instead of a value.
pub(super) fn live_settings(rows: Vec<StoredSetting>, key: Option<&SecretsKey>) -> LiveSettings {
    let mut tenants: HashMap<String, (String, Vars, HashMap<String, Vars>)> = HashMap::new();
    for stored in rows {
        let value = opened(&stored, key);
        let StoredSetting { row, incarnation, .. } = stored;
        let (_, every, handlers) = tenants.entry(row.tenant).or_insert_with(|| (incarnation, Vars::default(), HashMap::new()));
        if row.handler.is_empty() {
            every.insert(row.name, value);
        } else {
            handlers.entry(row.handler).or_default().insert(row.name, value);
        }
    }
    let tenants = tenants.into_iter().map(|(tenant, (incarnation, every, handlers))| {
        let handlers = handlers.into_iter().map(|(handler, own)| (handler, Arc::new(own))).collect();
        (tenant, Arc::new(TenantSettings { incarnation, every: Arc::new(every), handlers }))
    });
    LiveSettings(tenants.collect())
}

/// A setting's value as its handler reads it.
fn opened(stored: &StoredSetting, key: Option<&SecretsKey>) -> Result<String, String> {
    let row = &stored.row;
    let not_text = || format!("the setting {:?} is not UTF-8 text", row.name);
    if !row.secret {
        return String::from_utf8(stored.value.clone()).map_err(|_| not_text());
    }
    let Some(key) = key else {
        return Err(format!("the secret {:?} cannot be opened: this node has no secrets key", row.name));
    };
    let context = setting_context((&row.tenant, &stored.incarnation), &row.handler, &row.name);
    let opened = key.open(&context, &stored.value).map_err(|e| format!("the secret {:?}: {e}", row.name))?;
    String::from_utf8(opened).map_err(|_| not_text())
}

/// What the data plane serves: an immutable snapshot, swapped on change.
/// Its parts are shared between snapshots: a change of keys only copies
/// the key map.
#[derive(Default)]
pub struct Live {
    /// Tenants by name.
    pub tenants: Arc<HashMap<String, TenantEntry>>,
    pub(super) keys: Arc<KeyMap>,
    /// The operator's hostnames (see [`super::routes`]).
    pub(super) routes: Arc<HostRoutes>,
    /// The tenants' settings (see [`super::settings`]).
    pub(super) settings: Arc<LiveSettings>,
}

/// Compared against when a key id is unknown, so both paths hash once.
const DUMMY_SECRET: [u8; 32] = [0; 32];

impl Live {
    /// The tenant a bearer key belongs to and what the key may do; `None`
    /// if missing, malformed, unknown or revoked. Never looks at the tenant
    /// in the request path, so its timing says nothing about which tenants
    /// exist.
    pub fn authenticate(&self, bearer: Option<&str>) -> Option<(&str, Scopes)> {
        let (id, secret) = bearer.and_then(keys::parse).unwrap_or(("", ""));
        match self.keys.get(id) {
            Some(key) => keys::secret_matches(secret, &key.secret_sha256).then_some((key.tenant.as_str(), key.scopes)),
            None => {
                let _ = keys::secret_matches(secret, &DUMMY_SECRET);
                None
            }
        }
    }

    /// A handler's canary, if it has one served here.
    pub fn canary(&self, tenant: &str, name: &str) -> Option<&Arc<LiveCanary>> {
        self.tenants.get(tenant)?.canaries.get(name)
    }

    /// A tenant's active handler with the tenant's gate.
    pub fn handler(&self, tenant: &str, name: &str) -> Option<(&Arc<TenantGate>, &Arc<Handler>)> {
        let entry = self.tenants.get(tenant)?;
        Some((&entry.gate, entry.handlers.get(name)?))
    }

    /// Where a routed hostname (as `host_of` gives it) goes.
    pub fn route(&self, hostname: &str) -> Option<&HostRoute> {
        self.routes.get(hostname)
    }

    /// What `tenant`'s `handler` reads of its settings (`wasi:config/store`):
    /// none unless they belong to the tenant this snapshot serves.
    pub fn settings(&self, tenant: &str, handler: &str) -> HandlerSettings {
        match self.tenants.get(tenant) {
            Some(entry) => self.settings.of((tenant, &entry.incarnation), handler),
            None => HandlerSettings::default(),
        }
    }

    /// A snapshot sharing all of this one's parts, for a change that replaces one of them.
    pub(super) fn shared_parts(&self) -> Live {
        Live {
            tenants: Arc::clone(&self.tenants),
            keys: Arc::clone(&self.keys),
            routes: Arc::clone(&self.routes),
            settings: Arc::clone(&self.settings),
        }
    }

    /// Whether no hostname is routed (requests need not look at theirs).
    pub fn routes_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// Handlers served, all tenants.
    pub fn handler_count(&self) -> usize {
        self.tenants.values().map(|t| t.handlers.len()).sum()
    }

    /// This snapshot's tenants and handlers with its keys changed by
    /// `change`.
    pub(super) fn with_keys(&self, change: impl FnOnce(&mut KeyMap)) -> Self {
        let mut keys = KeyMap::clone(&self.keys);
        change(&mut keys);
        Self { keys: Arc::new(keys), ..self.shared_parts() }
    }

    /// The tenants of a snapshot being built (not shared yet: never copied).
    pub(super) fn tenants_mut(&mut self) -> &mut HashMap<String, TenantEntry> {
        Arc::make_mut(&mut self.tenants)
    }

    /// The keys of a snapshot being built (not shared yet: never copied).
    pub(super) fn keys_mut(&mut self) -> &mut KeyMap {
        Arc::make_mut(&mut self.keys)
    }

    /// Applies this node's share among `nodes` live nodes to every tenant's gate.
    pub(super) fn share_among(&self, nodes: usize) {
        self.tenants.values().for_each(|t| t.gate.share_among(nodes));
    }
}

/// Which nodes of the cluster are alive, judged by whether their heartbeats
/// advance while this node watches, timed by this node's own monotonic
/// clock. Each node stamps its heartbeat with its own wall clock, which may
/// be minutes off this one's: comparing the stamps with this clock would
/// count a live node whose clock is behind as dead (and this node would
/// take its share too, letting a tenant past its cluster-wide limits). Only
/// a stamp's change is used, never its value.
#[derive(Debug, Default)]
pub struct NodeWatch {
    /// By node id: its last heartbeat stamp, and when this node saw it change.
    seen: HashMap<String, (i64, Instant)>,
}

impl NodeWatch {
    /// The rows of `nodes` (the store's) whose heartbeat changed within
    /// `window` before `now`. A node seen for the first time counts until
    /// `window` passes without a change: a dead one is then counted a
    /// while, so each node enforces less meanwhile, never more.
    pub fn alive<'a>(&mut self, nodes: &'a [NodeRow], now: Instant, window: Duration) -> Vec<&'a NodeRow> {
        self.seen.retain(|id, _| nodes.iter().any(|n| &n.id == id));
        let mut alive = Vec::with_capacity(nodes.len());
        for node in nodes {
            let (stamp, changed) = self.seen.entry(node.id.clone()).or_insert((node.heartbeat_at, now));
            if *stamp != node.heartbeat_at {
                *stamp = node.heartbeat_at;
                *changed = now;
            }
            if now.saturating_duration_since(*changed) <= window {
                alive.push(node);
            }
        }
        alive
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, heartbeat_at: i64) -> NodeRow {
        NodeRow {
            id: id.to_owned(),
            address: String::new(),
            version: String::new(),
            devices: Vec::new(),
            load: Default::default(),
            started_at: 0,
            heartbeat_at,
        }
    }

    #[test]
    fn nodes_are_alive_while_their_heartbeats_advance_whatever_their_clocks_say() {
        const WINDOW: Duration = Duration::from_secs(30);
        let mut watch = NodeWatch::default();
        let t0 = Instant::now();
        // "behind" stamps an hour in the past, "ahead" an hour in the future.
        let (behind, ahead) = (-3_600_000, 3_600_000);
        assert_eq!(watch.alive(&[row("me", 0), row("behind", behind), row("ahead", ahead)], t0, WINDOW).len(), 3);
        let later = t0 + Duration::from_secs(20);
        let rows = [row("me", 20_000), row("behind", behind + 20_000), row("ahead", ahead)];
        assert_eq!(watch.alive(&rows, later, WINDOW).len(), 3, "'ahead' stopped, but only 20 s ago");
        let rows = [row("me", 40_000), row("behind", behind + 40_000), row("ahead", ahead)];
        let alive: Vec<&str> = watch.alive(&rows, t0 + Duration::from_secs(40), WINDOW).iter().map(|n| n.id.as_str()).collect();
        assert_eq!(alive, ["me", "behind"], "'ahead' silent for 40 s: dead, its clock no matter");
        assert_eq!(watch.alive(&[row("me", 50_000)], t0 + Duration::from_secs(50), WINDOW).len(), 1, "rows removed are forgotten");
        assert_eq!(watch.seen.len(), 1);
        assert!(NodeWatch::default().alive(&[], t0, WINDOW).is_empty(), "none without rows");
    }

    /// Records `answers` (side, status) in order; what each `record` returned.
    fn answers(counts: &CanaryCounts, rule: AbortRule, answers: &[(Side, u16)]) -> Vec<bool> {
        answers.iter().map(|&(side, status)| counts.record(Some(rule), side, status)).collect()
    }

    #[test]
    fn a_failing_canary_is_aborted_at_its_after_th_answer_not_before_and_once() {
        let rule = AbortRule { margin: 0.1, after: 5 };
        let counts = CanaryCounts::default();
        let fired = answers(&counts, rule, &[(Side::Canary, 500); 7]);
        assert_eq!(fired, [false, false, false, false, true, false, false], "at the 5th answer (after = 5), and once");
        counts.aborting.store(false, Ordering::Release); // as `LiveCanary::abort_failed`
        assert!(counts.record(Some(rule), Side::Canary, 500), "an abort that failed fires again at the next failing answer");

        let late = CanaryCounts::default();
        assert_eq!(answers(&late, AbortRule { after: 6, ..rule }, &[(Side::Canary, 500); 6]), [false, false, false, false, false, true]);
    }

    #[test]
    fn the_margin_is_over_the_active_versions_share_and_strict() {
        // The active version: 1 of 4 answers a 5xx (0.25); margin 0.25, so
        // the canary must fail more than half its answers.
        let rule = AbortRule { margin: 0.25, after: 4 };
        let counts = CanaryCounts::default();
        let stable = [(Side::Stable, 200), (Side::Stable, 503), (Side::Stable, 200), (Side::Stable, 404)];
        assert_eq!(answers(&counts, rule, &stable), [false; 4], "the active version's answers alone abort nothing");
        let canary = [(Side::Canary, 500), (Side::Canary, 502), (Side::Canary, 200), (Side::Canary, 200)];
        assert_eq!(answers(&counts, rule, &canary), [false; 4], "2 of 4 (0.5) is at 0.25 + 0.25, not over");
        assert!(counts.record(Some(rule), Side::Canary, 500), "3 of 5 (0.6) is over");
        assert_eq!(counts.stable.each_ref().map(|n| n.load(Ordering::Relaxed)), [4, 1]);
        assert_eq!(counts.canary.each_ref().map(|n| n.load(Ordering::Relaxed)), [5, 3]);

        // The same canary beside an active version that never fails: over at once.
        let clean = CanaryCounts::default();
        let stable = [(Side::Stable, 200); 4];
        assert_eq!(answers(&clean, rule, &[&stable[..], &canary[..]].concat()), [false, false, false, false, false, false, false, true]);
    }

    #[test]
    fn only_5xx_answers_count_and_no_rule_never_aborts() {
        let rule = AbortRule { margin: 0.0, after: 1 };
        let counts = CanaryCounts::default();
        assert_eq!(answers(&counts, rule, &[(Side::Canary, 404), (Side::Canary, 429), (Side::Canary, 499)]), [false; 3]);
        assert!(counts.record(Some(rule), Side::Canary, 500), "the first 5xx is over a margin of 0");
        let unruled = CanaryCounts::default();
        assert!((0..100).all(|_| !unruled.record(None, Side::Canary, 500)), "without a rule: never");
    }
}
