//! The snapshot the data plane reads ([`Live`]): tenants with their
//! admission gates and active handlers, and the active API keys. Built by
//! `ControlPlane::refresh` and swapped in whole; never changed in place.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::keys;
use super::limits::{ConcurrencyGate, TenantLimits, TokenBucket};
use super::store::NodeRow;
use crate::handlers::Handler;

/// A tenant's admission state: limits, rate bucket, concurrency slots.
/// Kept across snapshots while the limits do not change.
pub struct TenantGate {
    /// Effective limits, the whole cluster's.
    pub limits: TenantLimits,
    /// Requests-per-second bucket: this node's share of the tenant's rate.
    pub rate: Arc<TokenBucket>,
    /// Concurrent-request slots: this node's share of the tenant's concurrency.
    pub concurrency: Arc<ConcurrencyGate>,
}

/// This node's share of a tenant's rate limit, burst and concurrency when
/// `nodes` live nodes serve it (a load balancer spreads a tenant's requests
/// over them): each a `1/nodes` part, rounded up, at least 1; a rate of 0
/// (unlimited) stays unlimited.
pub fn node_share(limits: &TenantLimits, nodes: usize) -> (f64, u32, u32) {
    let nodes = nodes.max(1);
    let part = |n: u32| n.div_ceil(u32::try_from(nodes).unwrap_or(u32::MAX)).max(1);
    (limits.rps / nodes as f64, part(limits.burst), part(limits.max_concurrency))
}

impl TenantGate {
    /// Applies this node's share among `nodes` live nodes, in place (tokens
    /// saved up and slots in use are kept).
    pub(super) fn share_among(&self, nodes: usize) {
        let (rps, burst, concurrency) = node_share(&self.limits, nodes);
        self.rate.reconfigure(rps, burst);
        self.concurrency.resize(concurrency);
    }
}

/// One tenant in the live snapshot.
pub struct TenantEntry {
    /// Which creation of a tenant of this name (see `store::new_incarnation`).
    pub incarnation: String,
    /// Admission state.
    pub gate: Arc<TenantGate>,
    /// Active handler versions by name.
    pub handlers: HashMap<String, Arc<Handler>>,
}

pub(super) struct ActiveKey {
    pub(super) tenant: String,
    pub(super) secret_sha256: [u8; 32],
}

/// What the data plane serves: an immutable snapshot, swapped on change.
#[derive(Default)]
pub struct Live {
    /// Tenants by name.
    pub tenants: HashMap<String, TenantEntry>,
    pub(super) keys: HashMap<String, ActiveKey>,
}

/// Compared against when a key id is unknown, so both paths hash once.
const DUMMY_SECRET: [u8; 32] = [0; 32];

impl Live {
    /// The tenant a bearer key belongs to; `None` if missing, malformed,
    /// unknown or revoked. Never looks at the tenant in the request path,
    /// so its timing says nothing about which tenants exist.
    pub fn authenticate(&self, bearer: Option<&str>) -> Option<&str> {
        let (id, secret) = bearer.and_then(keys::parse).unwrap_or(("", ""));
        match self.keys.get(id) {
            Some(key) => keys::secret_matches(secret, &key.secret_sha256).then_some(key.tenant.as_str()),
            None => {
                let _ = keys::secret_matches(secret, &DUMMY_SECRET);
                None
            }
        }
    }

    /// A tenant's active handler with the tenant's gate.
    pub fn handler(&self, tenant: &str, name: &str) -> Option<(&Arc<TenantGate>, &Arc<Handler>)> {
        let entry = self.tenants.get(tenant)?;
        Some((&entry.gate, entry.handlers.get(name)?))
    }

    /// Handlers served, all tenants.
    pub fn handler_count(&self) -> usize {
        self.tenants.values().map(|t| t.handlers.len()).sum()
    }

    /// Applies this node's share among `nodes` live nodes to every tenant's gate.
    pub(super) fn share_among(&self, nodes: usize) {
        self.tenants.values().for_each(|t| t.gate.share_among(nodes));
    }
}

/// A gate for `limits`, this node's share among `nodes` live nodes. An
/// existing tenant keeps its bucket and slots, resized in place: a limit
/// change neither refills the bucket nor lets the tenant run its old and
/// new concurrency at once.
pub(super) fn new_gate(limits: TenantLimits, old: Option<&TenantGate>, nodes: usize) -> TenantGate {
    let gate = match old {
        Some(old) => TenantGate { rate: Arc::clone(&old.rate), concurrency: Arc::clone(&old.concurrency), limits },
        None => {
            let (rps, burst, concurrency) = node_share(&limits, nodes);
            TenantGate { rate: Arc::new(TokenBucket::new(rps, burst)), concurrency: Arc::new(ConcurrencyGate::new(concurrency)), limits }
        }
    };
    gate.share_among(nodes);
    gate
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
    /// Counts the nodes in `nodes` (the store's rows) whose heartbeat
    /// changed within `window` before `now`, at least 1 (this one). A node
    /// seen for the first time counts until `window` passes without a
    /// change: a dead one is then counted a while, so each node enforces
    /// less meanwhile, never more.
    pub fn count_alive(&mut self, nodes: &[NodeRow], now: Instant, window: Duration) -> usize {
        self.seen.retain(|id, _| nodes.iter().any(|n| &n.id == id));
        let mut alive = 0;
        for node in nodes {
            let (stamp, changed) = self.seen.entry(node.id.clone()).or_insert((node.heartbeat_at, now));
            if *stamp != node.heartbeat_at {
                *stamp = node.heartbeat_at;
                *changed = now;
            }
            alive += usize::from(now.saturating_duration_since(*changed) <= window);
        }
        alive.max(1)
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
        assert_eq!(watch.count_alive(&[row("me", 0), row("behind", behind), row("ahead", ahead)], t0, WINDOW), 3);
        let later = t0 + Duration::from_secs(20);
        let rows = [row("me", 20_000), row("behind", behind + 20_000), row("ahead", ahead)];
        assert_eq!(watch.count_alive(&rows, later, WINDOW), 3, "'ahead' stopped, but only 20 s ago");
        let rows = [row("me", 40_000), row("behind", behind + 40_000), row("ahead", ahead)];
        assert_eq!(watch.count_alive(&rows, t0 + Duration::from_secs(40), WINDOW), 2, "'ahead' silent for 40 s: dead, its clock no matter");
        assert_eq!(watch.count_alive(&[row("me", 50_000)], t0 + Duration::from_secs(50), WINDOW), 1, "rows removed are forgotten");
        assert_eq!(watch.seen.len(), 1);
        assert_eq!(NodeWatch::default().count_alive(&[], t0, WINDOW), 1, "at least this node");
    }

    fn limits(rps: f64, burst: u32, max_concurrency: u32) -> TenantLimits {
        TenantLimits {
            memory_mib: 256,
            timeout_ms: 10_000,
            max_concurrency,
            rps,
            burst,
            max_body_bytes: 1 << 20,
            max_infer_calls: 16,
            weight: 1,
            outgoing_http: false,
            instance_reuse: 1,
        }
    }

    #[test]
    fn each_node_enforces_its_share_rounded_up() {
        assert_eq!(node_share(&limits(100.0, 200, 32), 1), (100.0, 200, 32), "one node: the whole limit");
        assert_eq!(node_share(&limits(100.0, 200, 32), 3), (100.0 / 3.0, 67, 11));
        assert_eq!(node_share(&limits(0.0, 1, 1), 4), (0.0, 1, 1), "unlimited stays unlimited; at least one slot");
        assert_eq!(node_share(&limits(10.0, 20, 8), 0), (10.0, 20, 8), "no node known yet: this one");
    }

    #[test]
    fn a_gate_is_reshared_in_place_when_nodes_come_and_go() {
        let gate = new_gate(limits(10.0, 4, 4), None, 2);
        let held: Vec<_> = std::iter::from_fn(|| gate.concurrency.try_acquire()).collect();
        assert_eq!(held.len(), 2, "half of 4 on each of two nodes");
        gate.share_among(1);
        assert!(gate.concurrency.try_acquire().is_some(), "a node gone: this one takes the whole limit");
        let kept = new_gate(limits(10.0, 4, 4), Some(&gate), 4);
        assert!(Arc::ptr_eq(&kept.concurrency, &gate.concurrency) && kept.concurrency.try_acquire().is_none());
    }
}
