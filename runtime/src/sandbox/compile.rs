//! Compiling uploaded components off the serving path: a small pool of its
//! own (one thread by default) at a lower CPU priority, a time budget, and a
//! bound on uploads waiting, so an upload does not take the cores that
//! serve requests.
//!
//! wasmtime compiles a component's functions in parallel with rayon; run
//! inside this pool, its parallel iterators use this pool's threads only.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Uploads that may wait for a compile thread, per thread.
const WAITING_PER_THREAD: usize = 2;

/// Why an upload's job did not run to its end (its own errors are its result).
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// Compilation ran past the budget (it finishes in the background and is discarded).
    #[error("compiling the component took longer than {0:?}; make it smaller or ask the operator for a larger --compile-timeout-ms")]
    TooSlow(Duration),
    /// Too many uploads are compiling or waiting.
    #[error("too many uploads are compiling now; retry shortly")]
    Busy,
    /// The pool failed (its thread is gone).
    #[error("the compile pool failed")]
    Failed,
}

/// The compile pool.
pub struct CompilePool {
    pool: rayon::ThreadPool,
    timeout: Duration,
    pending: Arc<AtomicUsize>,
    max_pending: usize,
}

impl CompilePool {
    /// A pool of `threads` compile threads (at least one) at niceness
    /// `nice` (0: the server's own priority) with a budget of `timeout` per upload.
    pub fn new(threads: usize, nice: i32, timeout: Duration) -> anyhow::Result<Self> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("compile-{i}"))
            .start_handler(move |_| lower_priority(nice))
            .build()?;
        Ok(Self { pool, timeout, pending: Arc::default(), max_pending: threads * (1 + WAITING_PER_THREAD) })
    }

    /// Whether a new upload would be refused [`CompileError::Busy`] now:
    /// lets the admin API refuse before it reads the upload's body.
    pub fn is_full(&self) -> bool {
        self.pending.load(Ordering::Acquire) >= self.max_pending
    }

    /// Runs `job` (an upload's CPU-heavy work: compiling, hashing,
    /// serialising) on the pool, under the time budget and the bound on
    /// jobs waiting; the caller (a blocking admin thread) waits until it is
    /// done, refused or out of time. A job past its budget finishes in the
    /// background and is discarded.
    pub fn run<T: Send + 'static>(&self, job: impl FnOnce() -> T + Send + 'static) -> Result<T, CompileError> {
        if self.pending.fetch_add(1, Ordering::AcqRel) >= self.max_pending {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(CompileError::Busy);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let pending = Arc::clone(&self.pending);
        self.pool.spawn(move || {
            // A panic in a rayon job aborts the process: catch it, fail the upload only.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).map_err(|_| CompileError::Failed);
            pending.fetch_sub(1, Ordering::AcqRel);
            // The uploader may have given up (time budget): nobody to tell.
            let _ = tx.send(result);
        });
        match rx.recv_timeout(self.timeout) {
            Ok(result) => result,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(CompileError::TooSlow(self.timeout)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(CompileError::Failed),
        }
    }
}

/// Lowers the calling thread's priority (Linux: threads have their own niceness).
pub(crate) fn lower_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    if nice > 0 {
        let thread = rustix::thread::gettid();
        if let Err(e) = rustix::process::setpriority_process(Some(thread), nice) {
            tracing::warn!(error = %e, "cannot lower the compile thread's priority");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

#[cfg(test)]
mod tests {
    use wasmtime::Engine;
    use wasmtime::component::Component;

    use super::*;

    const EMPTY_COMPONENT: &str = "(component)";

    /// Compiles on the pool, as an upload does.
    fn compile(pool: &CompilePool, engine: &Engine, bytes: Arc<[u8]>) -> Result<wasmtime::Result<Component>, CompileError> {
        let engine = engine.clone();
        pool.run(move || Component::new(&engine, &bytes))
    }

    #[test]
    fn compiles_on_the_pool_and_refuses_garbage() {
        let engine = Engine::default();
        let pool = CompilePool::new(1, 10, Duration::from_secs(30)).unwrap();
        let bytes: Arc<[u8]> = wat::parse_str(EMPTY_COMPONENT).unwrap().into();
        assert!(matches!(compile(&pool, &engine, bytes), Ok(Ok(_))));
        let garbage: Arc<[u8]> = Arc::from(&b"\0asm\x0d\0\x01\0garbage"[..]);
        assert!(matches!(compile(&pool, &engine, garbage), Ok(Err(_))), "garbage does not compile");
        assert_eq!(pool.pending.load(Ordering::Acquire), 0);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn compile_threads_run_at_a_lower_priority() {
        let pool = CompilePool::new(1, 10, Duration::from_secs(5)).unwrap();
        let nice = pool.pool.install(|| rustix::process::getpriority_process(Some(rustix::thread::gettid())).unwrap());
        let own = rustix::process::getpriority_process(None).unwrap();
        assert_eq!(nice, own + 10);
    }

    #[test]
    fn a_compile_past_the_budget_is_refused_and_the_queue_is_bounded() {
        let engine = Engine::default();
        let pool = CompilePool::new(1, 10, Duration::from_millis(50)).unwrap();
        // Hold the only thread so every upload waits past its budget.
        let (release, wait) = std::sync::mpsc::channel::<()>();
        pool.pool.spawn(move || {
            let _ = wait.recv();
        });
        let bytes: Arc<[u8]> = wat::parse_str(EMPTY_COMPONENT).unwrap().into();
        let outcomes: Vec<_> = (0..4).map(|_| compile(&pool, &engine, Arc::clone(&bytes))).collect();
        assert!(matches!(outcomes[0], Err(CompileError::TooSlow(_))), "{:?}", outcomes[0].as_ref().err());
        assert!(matches!(outcomes[3], Err(CompileError::Busy)), "{:?}", outcomes[3].as_ref().err());
        assert!(pool.is_full(), "the three still waiting fill it");
        release.send(()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while pool.is_full() {
            assert!(std::time::Instant::now() < deadline, "the queue never drained");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
