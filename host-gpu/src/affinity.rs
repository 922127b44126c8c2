//! Which cores a thread may run on (Linux's CPU affinity), so that CPU
//! inference can have cores of its own: its threads pinned to them, and
//! every other thread of the host (the tenants' handlers) kept off them.
//!
//! On other platforms reading gives an error and so does pinning: a
//! reservation asked for cannot silently be ignored.

use std::io;

/// The cores the calling thread may run on, in ascending order. A thread
/// created later starts with its creator's set.
pub fn allowed_cores() -> io::Result<Vec<usize>> {
    imp::allowed_cores()
}

/// Restricts the calling thread to `cores` (and the threads it creates
/// afterwards, which inherit the set). Fails on an empty list, a core past
/// the kernel's limit, or one the process may not use.
pub fn pin_current_thread(cores: &[usize]) -> io::Result<()> {
    if cores.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "no core to pin the thread to"));
    }
    imp::pin_current_thread(cores)
}

#[cfg(target_os = "linux")]
mod imp {
    use std::io;

    use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

    pub(super) fn allowed_cores() -> io::Result<Vec<usize>> {
        let set = sched_getaffinity(None)?;
        Ok((0..CpuSet::MAX_CPU).filter(|&core| set.is_set(core)).collect())
    }

    pub(super) fn pin_current_thread(cores: &[usize]) -> io::Result<()> {
        let mut set = CpuSet::new();
        for &core in cores {
            if core >= CpuSet::MAX_CPU {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("core {core} is past the kernel's limit")));
            }
            set.set(core);
        }
        // `None`: the calling thread, not the whole process.
        Ok(sched_setaffinity(None, &set)?)
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use std::io;

    fn unsupported() -> io::Error {
        io::Error::new(io::ErrorKind::Unsupported, "CPU affinity is only supported on Linux")
    }

    pub(super) fn allowed_cores() -> io::Result<Vec<usize>> {
        Err(unsupported())
    }

    pub(super) fn pin_current_thread(_: &[usize]) -> io::Result<()> {
        Err(unsupported())
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// A pinned thread reports only its core, threads it creates inherit
    /// the set, and the thread that created it keeps its own.
    #[test]
    fn a_pinned_thread_and_its_children_stay_on_its_cores() {
        let all = allowed_cores().unwrap();
        assert!(!all.is_empty());
        let last = *all.last().unwrap();
        let (own, child) = std::thread::spawn(move || {
            pin_current_thread(&[last]).unwrap();
            let child = std::thread::spawn(|| allowed_cores().unwrap()).join().unwrap();
            (allowed_cores().unwrap(), child)
        })
        .join()
        .unwrap();
        assert_eq!(own, vec![last]);
        assert_eq!(child, vec![last], "a thread created by a pinned one inherits its cores");
        assert_eq!(allowed_cores().unwrap(), all, "pinning is per thread");
        assert!(pin_current_thread(&[]).is_err());
        assert!(pin_current_thread(&[usize::MAX]).is_err());
    }
}
