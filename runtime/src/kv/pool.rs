//! The connections state calls run on: a few worker threads, each with a
//! connection of its own (opened at its first call, opened again after a
//! failure), off the async runtime (the database clients block). A call
//! first takes one of its tenant's places (a quarter of the workers, at least
//! one), then a worker's, both within the request's deadline: one tenant's
//! handlers can keep at most a quarter of the workers busy (its writes run
//! one at a time anyway, see `ops.rs`).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use postgres::Config;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::postgres::PgConn;
use super::sqlite::SqliteConn;
use super::{Conn, KvError, KvResult};

/// Tenants' places kept before those not in use are forgotten.
const PRUNE_AT: usize = 1024;

/// Opens a worker's connection.
type Opener = dyn Fn() -> anyhow::Result<Box<dyn Conn>> + Send + Sync;

/// A call for a worker: it runs with the worker's connection (`None`
/// until opened) and the way to open one.
type Job = Box<dyn FnOnce(&mut Option<Box<dyn Conn>>, &Opener) + Send>;

/// The state's connections (see the module docs).
pub struct KvPool {
    jobs: Mutex<Sender<Job>>,
    workers: Arc<Semaphore>,
    per_tenant: usize,
    tenants: Mutex<HashMap<Arc<str>, Arc<Semaphore>>>,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool").field("per_tenant", &self.per_tenant).finish_non_exhaustive()
    }
}

impl KvPool {
    /// A pool of `workers` connections to the store's SQLite file at `path`.
    pub fn sqlite(path: PathBuf, workers: usize) -> anyhow::Result<Arc<Self>> {
        // One writer at a time, as SQLite has (see `sqlite.rs`).
        let writer = Arc::new(Mutex::new(()));
        Self::with_opener(Box::new(move || Ok(Box::new(SqliteConn::open(&path, Arc::clone(&writer))?) as Box<dyn Conn>)), workers)
    }

    /// A pool of `workers` connections to the cluster's PostgreSQL, with
    /// the store's connection settings (`client`).
    pub fn postgres(client: (Config, MakeRustlsConnect), workers: usize) -> anyhow::Result<Arc<Self>> {
        Self::with_opener(Box::new(move || Ok(Box::new(PgConn::connect(&client)?) as Box<dyn Conn>)), workers)
    }

    /// A pool of `workers` threads whose connections `open` makes.
    fn with_opener(open: Box<Opener>, workers: usize) -> anyhow::Result<Arc<Self>> {
        let workers = workers.max(1);
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let (queue, open) = (Arc::new(Mutex::new(queue)), Arc::<Opener>::from(open));
        for i in 0..workers {
            let (queue, open) = (Arc::clone(&queue), Arc::clone(&open));
            std::thread::Builder::new().name(format!("facegate-kv-{i}")).spawn(move || work(&queue, &*open))?;
        }
        Ok(Arc::new(Self {
            jobs: Mutex::new(jobs),
            workers: Arc::new(Semaphore::new(workers)),
            per_tenant: (workers / 4).max(1),
            tenants: Mutex::default(),
        }))
    }

    /// Runs `op` for `tenant` on a worker's connection; waits for places
    /// and for the answer until `deadline` at most ([`KvError::Busy`]).
    /// An `op` still running at the deadline finishes (a write may land),
    /// its places held until then.
    pub async fn run<T: Send + 'static>(
        &self,
        tenant: &Arc<str>,
        deadline: Instant,
        op: impl FnOnce(&mut dyn Conn) -> KvResult<T> + Send + 'static,
    ) -> KvResult<T> {
        let late = || KvError::Busy("the state store did not answer before the request's deadline".into());
        let places = tokio::time::timeout_at(deadline.into(), self.places(tenant)).await.map_err(|_| late())?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |conn, open| {
            let _places = places;
            let _ = tx.send(on_connection(conn, open, op));
        });
        self.jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(job)
            .map_err(|_| KvError::Store("the state workers are gone".into()))?;
        match tokio::time::timeout_at(deadline.into(), rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(KvError::Store("a state worker failed".into())),
            Err(_) => Err(late()),
        }
    }

    /// One of `tenant`'s places, then a worker's.
    async fn places(&self, tenant: &Arc<str>) -> (OwnedSemaphorePermit, OwnedSemaphorePermit) {
        let own = {
            let mut tenants = self.tenants.lock().unwrap_or_else(PoisonError::into_inner);
            if tenants.len() >= PRUNE_AT {
                // Tenants with no call in flight (deleted ones among them) go.
                tenants.retain(|_, places| Arc::strong_count(places) > 1 || places.available_permits() < self.per_tenant);
            }
            Arc::clone(tenants.entry(Arc::clone(tenant)).or_insert_with(|| Arc::new(Semaphore::new(self.per_tenant))))
        };
        // Neither semaphore is ever closed.
        let own = own.acquire_owned().await.unwrap_or_else(|_| unreachable!("never closed"));
        let worker = Arc::clone(&self.workers).acquire_owned().await.unwrap_or_else(|_| unreachable!("never closed"));
        (own, worker)
    }

    /// Calls of one tenant that may run at once.
    pub fn per_tenant(&self) -> usize {
        self.per_tenant
    }
}

/// Runs `op` on the worker's connection, opening it first if need be; a
/// connection that failed is dropped (the next call opens a new one; a
/// statement the database refused leaves it), and a panic is an error,
/// never a dead worker.
fn on_connection<T>(conn: &mut Option<Box<dyn Conn>>, open: &Opener, op: impl FnOnce(&mut dyn Conn) -> KvResult<T>) -> KvResult<T> {
    if conn.is_none() {
        *conn = Some(open().map_err(|e| KvError::Store(format!("cannot connect: {e:#}")))?);
    }
    let Some(connected) = conn.as_mut() else { return Err(KvError::Store("not connected".into())) };
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| op(connected.as_mut())))
        .unwrap_or_else(|_| Err(KvError::Store("a state operation panicked".into())));
    if matches!(result, Err(KvError::Store(_))) {
        *conn = None;
    }
    result
}

/// A worker: runs jobs until the pool is gone.
fn work(queue: &Mutex<Receiver<Job>>, open: &Opener) {
    let mut conn = None;
    loop {
        let job = queue.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(job) = job else { return };
        job(&mut conn, open);
    }
}
