//! ONNX Runtime's intra-op threads of one CPU session, spawned by us so that
//! a batch can be charged with all the CPU time it took, not only the
//! worker thread's share.
//!
//! Why: with two intra-op threads the split of a run between the calling
//! thread and the pool thread depends on the batch size. Counting the
//! caller alone made single samples look 15 % dearer than pairs on a
//! 2-core machine, while in total CPU time (and in wall time) they are the
//! cheapest. Spinning is off, so an idle pool thread uses no CPU time.

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use ort::environment::ThreadManager;

/// Stack of a pool thread: the usual pthread default (8 MiB), which ONNX
/// Runtime's own threads would get, rather than Rust's 2 MiB.
const STACK_BYTES: usize = 8 << 20;

/// Spawns the session's pool threads, pinned to the session's cores when it
/// has some, and remembers their thread ids.
#[derive(Clone, Default)]
pub(super) struct IntraOpThreads {
    tids: Arc<Mutex<Vec<i32>>>,
    /// Cores the threads run on; empty: wherever the OS puts them.
    cores: Arc<[usize]>,
}

impl IntraOpThreads {
    /// Pool threads pinned to `cores` (none: not pinned).
    pub(super) fn new(cores: Vec<usize>) -> Self {
        Self { tids: Arc::default(), cores: cores.into() }
    }

    /// The cores the session's threads are pinned to (empty: not pinned).
    pub(super) fn cores(&self) -> &[usize] {
        &self.cores
    }

    /// CPU time the pool threads have used so far (zero where the platform
    /// does not tell, so a batch then costs the worker thread's time alone).
    pub(super) fn cpu_time(&self) -> Duration {
        let tids = self.tids.lock().unwrap_or_else(PoisonError::into_inner);
        tids.iter().filter_map(|&tid| thread_cpu_time(tid)).sum()
    }
}

impl ThreadManager for IntraOpThreads {
    type Thread = JoinHandle<()>;

    fn create(&self, work: impl FnOnce() + Send + 'static) -> ort::Result<Self::Thread> {
        let (tids, cores) = (Arc::clone(&self.tids), Arc::clone(&self.cores));
        let (started_tx, started) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("ort-intra-op".into())
            .stack_size(STACK_BYTES)
            .spawn(move || {
                // Rather than fail: ONNX Runtime does not recover from a pool
                // thread it could not create.
                pin_current_thread(&cores, "an ONNX Runtime pool thread");
                let tid = current_tid();
                if let Some(tid) = tid {
                    tids.lock().unwrap_or_else(PoisonError::into_inner).push(tid);
                }
                let _ = started_tx.send(());
                work();
                // Gone threads must not be read: their CPU time would vanish
                // from the sum between two readings.
                tids.lock().unwrap_or_else(PoisonError::into_inner).retain(|&t| Some(t) != tid);
            })
            .map_err(|e| ort::Error::new(format!("cannot start an ONNX Runtime thread: {e}")))?;
        // Registered before the session can run a batch on it, so no batch
        // is charged with a thread's whole past.
        let _ = started.recv();
        Ok(thread)
    }

    fn join(thread: Self::Thread) -> ort::Result<()> {
        thread.join().map_err(|_| ort::Error::new("an ONNX Runtime thread panicked"))
    }
}

/// Pins the calling thread (`what`, for the log) to `cores`, if any. The
/// cores come from the process's own set, so this fails only if that set
/// shrank since; the thread then runs where the OS puts it, with a warning.
pub(super) fn pin_current_thread(cores: &[usize], what: &str) {
    if !cores.is_empty()
        && let Err(e) = crate::affinity::pin_current_thread(cores)
    {
        tracing::warn!(?cores, "cannot pin {what} to its cores: {e}");
    }
}

#[cfg(target_os = "linux")]
fn current_tid() -> Option<i32> {
    Some(rustix::thread::gettid().as_raw_nonzero().get())
}

#[cfg(not(target_os = "linux"))]
fn current_tid() -> Option<i32> {
    None
}

/// A thread's time on the CPU, from the first field of its `schedstat`
/// (nanoseconds; unlike `stat`'s ticks, fine enough for one batch).
#[cfg(target_os = "linux")]
fn thread_cpu_time(tid: i32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    stat.split_whitespace().next()?.parse().ok().map(Duration::from_nanos)
}

#[cfg(not(target_os = "linux"))]
fn thread_cpu_time(_: i32) -> Option<Duration> {
    None
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn own_cpu_time() -> Duration {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        Duration::new(t.tv_sec.unsigned_abs(), u32::try_from(t.tv_nsec).expect("nanoseconds below 1e9"))
    }

    /// A pool thread that computes for 60 ms and then sleeps 60 ms (as an
    /// idle, non-spinning ORT thread does) is charged about 60 ms. On Linux
    /// (the only platform this module is built for) an unreadable
    /// `schedstat` fails the test rather than skipping it: it is the case
    /// in which pool CPU time would silently count as zero.
    #[test]
    fn pool_threads_are_charged_with_their_cpu_time_only() {
        let tid = current_tid().expect("Linux has thread ids");
        assert!(
            thread_cpu_time(tid).is_some(),
            "/proc/self/task/{tid}/schedstat is unreadable on this Linux kernel (CONFIG_SCHED_INFO off?): pool threads' CPU time would count as zero"
        );
        let pool = IntraOpThreads::default();
        let (done, measured) = (mpsc::channel::<()>(), mpsc::channel::<()>());
        let (done_tx, done_rx) = done;
        let (measured_tx, measured_rx) = measured;
        let thread = pool
            .create(move || {
                // 60 ms of this thread's own CPU time, however loaded the machine.
                let mut x = 0u64;
                while own_cpu_time() < Duration::from_millis(60) {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
                std::thread::sleep(Duration::from_millis(60));
                done_tx.send(()).unwrap();
                // Stay alive until read: an exited thread's clock is gone.
                measured_rx.recv().unwrap();
            })
            .unwrap();
        done_rx.recv().unwrap();
        let charged = pool.cpu_time();
        measured_tx.send(()).unwrap();
        IntraOpThreads::join(thread).unwrap();
        assert_eq!(pool.cpu_time(), Duration::ZERO, "a thread that ended is no longer read");
        assert!(charged >= Duration::from_millis(60), "charged {charged:?} for 60 ms of work");
        assert!(charged < Duration::from_millis(100), "charged {charged:?}: the sleep was counted");
    }
}
