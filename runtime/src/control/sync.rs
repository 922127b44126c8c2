//! Keeps a node's snapshot in step with the store and reports the node.
//!
//! One thread per gateway: it waits for a change announcement (PostgreSQL
//! `LISTEN`) or the poll interval, whichever comes first, then compares the
//! store's generation with its snapshot's and rebuilds on a difference
//! (loading what other nodes deployed: this node's cached artifact, or the
//! one the deploying node shared). Every heartbeat interval it records the
//! node's id, address, version, devices and load; every wake-up it drops
//! the warm instances idle too long (see [`crate::sandbox::warm`]); every
//! usage flush interval it writes what the node metered (see
//! [`super::usage`]), and once more as it stops. When the store is
//! unreachable it keeps trying; the snapshot it has goes on being served.
//!
//! A component with no usable artifact (another engine, a node without the
//! cluster's secret) is compiled by a second thread, so the sync thread
//! never waits for a compile: the rest of a change (a revoked key, a limit)
//! applies at once, and the new version is served once it has compiled.
//! The compile thread runs at the compile threads' lower priority: it must
//! not slow the requests this node serves; the sync thread, which compiles
//! nothing, runs at the server's, so changes are not held back by load.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::ControlPlane;
use super::store::{Listener, NodeLoad, NodeRow, StoreError, now_ms};
use super::usage::UsagePolicy;

/// How often the generation is polled when no announcement wakes the thread.
pub const POLL_INTERVAL: Duration = Duration::from_millis(250);
/// How often a node reports itself.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// How long to wait before listening again after the listener failed.
const RELISTEN_AFTER: Duration = Duration::from_secs(2);

/// What a node says about itself, apart from its load.
#[derive(Debug, Clone)]
pub struct NodeIdentity {
    /// `--node-id`.
    pub id: String,
    /// `--advertise`, else the listening address.
    pub address: String,
    /// Inference devices.
    pub devices: Vec<String>,
}

/// Measures a node's load for its heartbeat.
pub type LoadProbe = Box<dyn Fn() -> NodeLoad + Send>;

/// The running sync thread; stopping it (drop) removes the node's row.
pub struct SyncHandle {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    control: Arc<ControlPlane>,
    id: String,
}

impl SyncHandle {
    /// Starts the thread (see the module docs); `nice` as `--compile-nice`.
    pub fn start(
        control: Arc<ControlPlane>,
        node: NodeIdentity,
        load: LoadProbe,
        (nice, usage): (i32, UsagePolicy),
    ) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let id = node.id.clone();
        let compiler = Compiler::start(Arc::clone(&control), nice)?;
        let worker = Worker { control: Arc::clone(&control), node, load, stop: Arc::clone(&stop), started_at: now_ms(), compiler, usage };
        // At the server's priority: the sync no longer compiles, and what it
        // does (store reads, loading artifacts) should not wait behind serving.
        let thread = std::thread::Builder::new().name("facegate-sync".into()).spawn(move || worker.run())?;
        Ok(Self { stop, thread: Some(thread), control, id })
    }
}

impl Drop for SyncHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // What was metered since the last flush: a clean stop loses none of it.
        if let Err(e) = self.control.usage.flush() {
            tracing::warn!(error = %e, "could not write this node's last usage");
        }
        if let Err(e) = self.control.cluster.deregister(&self.id) {
            tracing::debug!(error = %e, "could not remove this node's row");
        }
    }
}

struct Worker {
    control: Arc<ControlPlane>,
    node: NodeIdentity,
    load: LoadProbe,
    stop: Arc<AtomicBool>,
    started_at: i64,
    compiler: Compiler,
    usage: UsagePolicy,
}

/// Components that may wait for the sync's compile thread; more are left
/// for a later sync to ask for again (the queue is bounded, as every queue).
const PRECOMPILE_QUEUE: usize = 64;

/// The thread that compiles what the sync left for later, one component at
/// a time; it ends when its [`Worker`] does (after the compile it is in).
struct Compiler {
    queue: mpsc::SyncSender<String>,
    /// Queued or compiling now: asked for again by every sync until served.
    queued: Arc<Mutex<HashSet<String>>>,
    /// Failed here: not tried again until the node restarts (logged once).
    failed: Arc<Mutex<HashSet<String>>>,
}

impl Compiler {
    fn start(control: Arc<ControlPlane>, nice: i32) -> anyhow::Result<Self> {
        let (queue, jobs) = mpsc::sync_channel::<String>(PRECOMPILE_QUEUE);
        let (queued, failed) = (Arc::<Mutex<HashSet<String>>>::default(), Arc::<Mutex<HashSet<String>>>::default());
        let (done, broken) = (Arc::clone(&queued), Arc::clone(&failed));
        std::thread::Builder::new().name("facegate-precompile".into()).spawn(move || {
            crate::sandbox::compile::lower_priority(nice);
            for sha in jobs {
                let outcome = control.artifacts.precompile(&sha);
                if let Err(e) = &outcome {
                    tracing::error!(component = %sha, error = %e, "cannot compile a component deployed elsewhere; its handler keeps the version it served");
                }
                // Failed for good, or done (or failed in the store: the next sync lists it again).
                if let Err(StoreError::Invalid(_)) = outcome {
                    lock(&broken).insert(sha.clone());
                }
                lock(&done).remove(&sha);
                // After it left the queue, so that sync may ask for it again.
                control.serving.recheck_soon();
            }
        })?;
        Ok(Self { queue, queued, failed })
    }

    /// Queues what is neither queued nor failed already.
    fn want(&self, components: Vec<String>) {
        for sha in components {
            if lock(&self.failed).contains(&sha) || !lock(&self.queued).insert(sha.clone()) {
                continue;
            }
            match self.queue.try_send(sha) {
                Ok(()) => {}
                // Full: what is left out is asked for again by a later sync.
                Err(mpsc::TrySendError::Full(sha)) => {
                    lock(&self.queued).remove(&sha);
                }
                Err(mpsc::TrySendError::Disconnected(_)) => tracing::error!("the compile thread of the sync is gone"),
            }
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Worker {
    fn run(self) {
        let mut listener: Option<Box<dyn Listener>> = None;
        let mut listen_again = Instant::now();
        let mut next_heartbeat = Instant::now();
        let (mut next_flush, mut next_prune) = (Instant::now() + self.usage.flush_every, Instant::now());
        let mut reachable = true;
        while !self.stop.load(Ordering::Acquire) {
            if listener.is_none() && Instant::now() >= listen_again {
                listener = self.listen();
                listen_again = Instant::now() + RELISTEN_AFTER;
            }
            match listener.as_mut().map(|l| l.wait(POLL_INTERVAL)) {
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "change listener lost; polling");
                    listener = None;
                }
                None => std::thread::sleep(POLL_INTERVAL),
            }
            reachable = self.sync(reachable);
            // Here, off the request path: dropping an instance resets its memory.
            self.control.serving.expire_idle_instances();
            if reachable && Instant::now() >= next_heartbeat {
                self.heartbeat();
                next_heartbeat = Instant::now() + HEARTBEAT_INTERVAL;
            }
            if reachable && Instant::now() >= next_flush {
                self.flush_usage(&mut next_prune);
                next_flush = Instant::now() + self.usage.flush_every;
            }
        }
    }

    /// Writes the node's usage (a failed write is retried at the next
    /// flush, as the same delta); prunes old buckets when due.
    fn flush_usage(&self, next_prune: &mut Instant) {
        if let Err(e) = self.control.usage.flush() {
            tracing::warn!(error = %e, "could not write usage; retrying at the next flush");
            return;
        }
        if Instant::now() >= *next_prune {
            if let Err(e) = self.control.usage.prune(self.usage.retention) {
                tracing::debug!(error = %e, "could not prune old usage");
            }
            *next_prune = Instant::now() + self.usage.prune_every();
        }
    }

    fn listen(&self) -> Option<Box<dyn Listener>> {
        match self.control.store_listener()? {
            Ok(listener) => Some(listener),
            Err(e) => {
                tracing::debug!(error = %e, "cannot listen for changes; polling");
                None
            }
        }
    }

    /// One sync; logs when the store is lost and when it is back. Returns reachability.
    fn sync(&self, was_reachable: bool) -> bool {
        match self.control.serving.sync() {
            Ok(synced) => {
                if !was_reachable {
                    tracing::info!(store = self.control.store_name(), "control-plane store reachable again; snapshot caught up");
                }
                if synced.changed {
                    tracing::debug!(generation = self.control.serving.generation(), "snapshot rebuilt after a change made elsewhere");
                }
                self.compiler.want(synced.to_compile);
                true
            }
            Err(e) => {
                if was_reachable {
                    tracing::warn!(store = self.control.store_name(), error = %e, "control-plane store unreachable; serving the last snapshot");
                }
                false
            }
        }
    }

    fn heartbeat(&self) {
        let mut load = (self.load)();
        load.generation = self.control.serving.generation();
        let row = NodeRow {
            id: self.node.id.clone(),
            address: self.node.address.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            devices: self.node.devices.clone(),
            load,
            started_at: self.started_at,
            heartbeat_at: now_ms(),
        };
        if let Err(e) = self.control.cluster.heartbeat(&row) {
            tracing::debug!(error = %e, "heartbeat not recorded");
            return;
        }
        match self.control.cluster.nodes() {
            Ok(nodes) => self.control.share_tenant_limits(&nodes),
            Err(e) => tracing::debug!(error = %e, "nodes not read; tenants' shares unchanged"),
        }
    }
}
