//! Compiling uploaded components off the serving path: a small pool of its
//! own (one thread by default) at a lower CPU priority, a time budget, and a
//! bound on uploads waiting, so an upload does not take the cores that
//! serve requests.
//!
//! wasmtime compiles a component's functions in parallel with rayon; run
//! inside this pool, its parallel iterators use this pool's threads only.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

/// Uploads that may wait for a compile thread, per thread.
const WAITING_PER_THREAD: usize = 2;

/// A job's life on the pool: waiting for a thread, running, or abandoned
/// by its caller before it started (it then never runs).
const WAITING: u8 = 0;
const RUNNING: u8 = 1;
const ABANDONED: u8 = 2;

/// Heap a compile holds at its peak beyond what grows with the component
/// (the compiler's own tables, a thread's scratch): measured, see [`memory_estimate`].
const COMPILE_BASE_BYTES: usize = 24 << 20;
/// Heap a compile holds at its peak per byte of component: measured, see [`memory_estimate`].
const COMPILE_BYTES_PER_BYTE: usize = 32;

/// What compiling a component of `component_bytes` bytes may hold at its
/// peak (the compiler's heap and the code it emits), charged to the node's
/// memory budget before the compile starts. The figures are an upper
/// bound of what `runtime/tests/compile_memory` measures on the example
/// handlers (Rust, Python, JavaScript) with the default compile pool of
/// one thread (2026-12-05: 1.2 MB of Rust peaks at 37 MiB, 18 MB of
/// Python with the pipeline at 351 MiB, 13 MB of JavaScript with it at
/// 368 MiB: some 26 bytes per byte of code); that test fails if a compile
/// holds more than this says, or less than a quarter of it. More compile
/// threads (`--compile-threads`) compile more functions at once and may
/// hold more.
pub fn memory_estimate(component_bytes: usize) -> usize {
    component_bytes.saturating_mul(COMPILE_BYTES_PER_BYTE).saturating_add(COMPILE_BASE_BYTES)
}

/// What an upload of `upload` bytes holds at its peak: its body, and when
/// it imports the pipeline (of `pipeline` bytes) the composed component
/// and the composition's own copies of both, then the compile of what is
/// stored ([`memory_estimate`]). Checked against measured peaks by
/// `runtime/tests/compile_memory.rs`.
pub fn upload_memory_estimate(upload: usize, pipeline: Option<usize>) -> usize {
    let compiled = upload.saturating_add(pipeline.unwrap_or(0));
    // Composing parses both into a graph and encodes the result: about
    // three copies of what it links, beside the body it started from.
    let composing = if pipeline.is_some() { compiled.saturating_mul(3) } else { 0 };
    upload.saturating_add(composing).saturating_add(memory_estimate(compiled))
}

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
    /// done, refused or out of time.
    ///
    /// Past its budget, a job that has not started gives its place up at
    /// once and never runs (dropped, with whatever it owns: the upload's
    /// memory charge and its tenant's place). One already compiling cannot
    /// be stopped: it finishes in the background and is discarded, keeping
    /// its place in the pool (the thread is busy) and what it owns until
    /// then, so its tenant cannot start another meanwhile.
    pub fn run<T: Send + 'static>(&self, job: impl FnOnce() -> T + Send + 'static) -> Result<T, CompileError> {
        if self.pending.fetch_add(1, Ordering::AcqRel) >= self.max_pending {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(CompileError::Busy);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let (pending, state) = (Arc::clone(&self.pending), Arc::new(AtomicU8::new(WAITING)));
        let job_state = Arc::clone(&state);
        self.pool.spawn(move || {
            if job_state.compare_exchange(WAITING, RUNNING, Ordering::AcqRel, Ordering::Acquire).is_err() {
                // Abandoned while it waited: its place was given back then.
                return;
            }
            // A panic in a rayon job aborts the process: catch it, fail the upload only.
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).map_err(|_| CompileError::Failed);
            pending.fetch_sub(1, Ordering::AcqRel);
            // The uploader may have given up (time budget): nobody to tell.
            let _ = tx.send(result);
        });
        match rx.recv_timeout(self.timeout) {
            Ok(result) => result,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if state.compare_exchange(WAITING, ABANDONED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    self.pending.fetch_sub(1, Ordering::AcqRel);
                }
                Err(CompileError::TooSlow(self.timeout))
            }
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
    fn the_queue_is_bounded() {
        let engine = Engine::default();
        let pool = Arc::new(CompilePool::new(1, 10, Duration::from_secs(30)).unwrap());
        // Hold the only thread: every upload waits.
        let (release, wait) = std::sync::mpsc::channel::<()>();
        pool.pool.spawn(move || {
            let _ = wait.recv();
        });
        let bytes: Arc<[u8]> = wat::parse_str(EMPTY_COMPONENT).unwrap().into();
        let waiting: Vec<_> = (0..3)
            .map(|_| {
                let (pool, engine, bytes) = (Arc::clone(&pool), engine.clone(), Arc::clone(&bytes));
                std::thread::spawn(move || compile(&pool, &engine, bytes).is_ok())
            })
            .collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !pool.is_full() {
            assert!(std::time::Instant::now() < deadline, "three waiting uploads never filled the pool");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(matches!(compile(&pool, &engine, Arc::clone(&bytes)), Err(CompileError::Busy)), "a fourth is refused at once");
        release.send(()).unwrap();
        assert!(waiting.into_iter().all(|w| w.join().unwrap()), "the waiting ones compile once the thread is free");
        assert_eq!(pool.pending.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_job_past_its_budget_before_it_started_gives_its_place_up_and_never_runs() {
        let pool = CompilePool::new(1, 10, Duration::from_millis(50)).unwrap();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        pool.pool.spawn(move || {
            let _ = wait.recv();
        });
        let (ran, owned) = (Arc::new(AtomicUsize::new(0)), Arc::new(()));
        let (job_ran, job_owns) = (Arc::clone(&ran), Arc::clone(&owned));
        let outcome = pool.run(move || {
            let _owns = job_owns;
            job_ran.fetch_add(1, Ordering::AcqRel);
        });
        assert!(matches!(outcome, Err(CompileError::TooSlow(_))), "{outcome:?}");
        assert_eq!(pool.pending.load(Ordering::Acquire), 0, "its place is free as soon as its caller gave up");
        release.send(()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&owned) > 1 {
            assert!(std::time::Instant::now() < deadline, "the abandoned job still holds what it owns");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(ran.load(Ordering::Acquire), 0, "an abandoned job never runs");
    }

    #[test]
    fn a_job_running_past_its_budget_keeps_its_place_until_it_ends() {
        let pool = CompilePool::new(1, 10, Duration::from_millis(50)).unwrap();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let outcome = pool.run(move || {
            let _ = wait.recv();
        });
        assert!(matches!(outcome, Err(CompileError::TooSlow(_))), "{outcome:?}");
        assert_eq!(pool.pending.load(Ordering::Acquire), 1, "the thread is still busy with it");
        release.send(()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pool.pending.load(Ordering::Acquire) > 0 {
            assert!(std::time::Instant::now() < deadline, "the place never came back");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
