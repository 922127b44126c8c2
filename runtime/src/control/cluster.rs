//! The control plane's part for the cluster's membership ([`Cluster`]):
//! this node's heartbeat in the store, the nodes alive by their
//! heartbeats, and how many there are (each node enforces its share of a
//! tenant's rate and concurrency).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::live::NodeWatch;
use super::shared::Shared;
use super::store::{NodeRow, StoreResult};

/// A node silent this long is listed as not alive: many heartbeats missed
/// (a node whose store connection stalls reports nothing meanwhile).
pub const ALIVE_WITHIN: Duration = Duration::from_secs(30);

/// The cluster's nodes as this node sees them (see the module docs).
pub struct Cluster {
    shared: Arc<Shared>,
    /// Live nodes of the cluster (this one included), from the heartbeats.
    nodes: AtomicUsize,
    /// Whose heartbeats advance (see [`NodeWatch`]).
    node_watch: Mutex<NodeWatch>,
    /// Their rows, as [`Self::count_alive`] counted them.
    alive_nodes: RwLock<Arc<[NodeRow]>>,
}

impl Cluster {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared, nodes: AtomicUsize::new(1), node_watch: Mutex::default(), alive_nodes: RwLock::new(Arc::from(Vec::new())) }
    }

    /// Records this node's heartbeat; forgets nodes silent for an hour.
    pub fn heartbeat(&self, node: &NodeRow) -> StoreResult<()> {
        let mut db = self.shared.db();
        db.heartbeat(node)?;
        db.remove_nodes("", node.heartbeat_at - 3_600_000)
    }

    /// Removes this node's row (it stops cleanly).
    pub fn deregister(&self, id: &str) -> StoreResult<()> {
        self.shared.db().remove_nodes(id, 0)
    }

    /// Every node that reported, by id.
    pub fn nodes(&self) -> StoreResult<Vec<NodeRow>> {
        self.shared.db().nodes()
    }

    /// Counts the nodes alive among `nodes` (a heartbeat that advanced
    /// within [`ALIVE_WITHIN`] by this node's clock, whatever the
    /// others' clocks say, see [`NodeWatch`]; at least this one) and keeps
    /// their rows. A node that stops cleanly deregisters at once; one that
    /// dies counts until it is seen silent that long (the others enforce
    /// less meanwhile, never more).
    pub(super) fn count_alive(&self, nodes: &[NodeRow]) -> usize {
        let mut watch = self.node_watch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let alive: Arc<[NodeRow]> = watch.alive(nodes, Instant::now(), ALIVE_WITHIN).into_iter().cloned().collect();
        drop(watch);
        let live = alive.len().max(1);
        *self.alive_nodes.write().unwrap_or_else(std::sync::PoisonError::into_inner) = alive;
        if self.nodes.swap(live, Ordering::AcqRel) != live {
            tracing::info!(nodes = live, "live nodes changed: each enforces its share of the tenants' rate and concurrency");
        }
        live
    }

    /// Live nodes of the cluster as last counted (at least 1).
    pub fn live_nodes(&self) -> usize {
        self.nodes.load(Ordering::Acquire).max(1)
    }

    /// The live nodes' rows as last read (this node's among them once it
    /// has reported itself): where each serves, for reading what only it
    /// holds (a tenant's log, see `http::peers`).
    pub fn alive_nodes(&self) -> Arc<[NodeRow]> {
        Arc::clone(&self.alive_nodes.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}
