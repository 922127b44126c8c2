//! How large the node's memory budget is, and what it sets aside.
//!
//! By default the budget is three quarters of what the process may use
//! (the cgroup's `memory.max`, or `--memory-total-mib`, else physical
//! memory) less what it holds once the models are loaded and the part of
//! the model-memory bound the models loaded on demand may still take; the last quarter
//! is headroom the budget does not see (ONNX Runtime's working memory grows
//! with batches, compilation, connections). Out of the budget comes what the
//! instance pool keeps resident between instances, which nobody's request
//! holds: at most a quarter of it, the kept-resident bytes per slot
//! lowered to fit.

use std::path::Path;

use crate::sandbox::engine::EngineLimits;

/// The least budget a node runs with, whatever the arithmetic says: one
/// request of a small handler.
pub const MIN_BUDGET: usize = 64 << 20;

/// The budget's share the pool's resident pages may take, at most (1/N).
const RESIDENT_SHARE: usize = 4;

/// What the process may use in all, and where that figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Available {
    /// Bytes.
    pub bytes: usize,
    /// `--memory-total-mib`, `cgroup memory.max`, or `physical memory`.
    pub source: &'static str,
}

/// The node's memory budget and what it leaves to the instance pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySizing {
    /// Bytes requests and kept instances may be charged, all tenants.
    pub chargeable: usize,
    /// Bytes the pool may keep resident between instances (set aside).
    pub resident: usize,
    /// The engine's limits, its kept-resident bytes per slot lowered to fit.
    pub engine: EngineLimits,
}

/// Splits `budget` between requests and the pool's resident pages, lowering
/// `engine.keep_resident` when the pages would take more than a quarter, or
/// leave requests less than [`MIN_BUDGET`]. The two parts add up to at most
/// `budget`, unless the tables' resident pages (which only fewer slots
/// lower) leave requests less than [`MIN_BUDGET`]: requests then get that
/// least budget (at most `budget`) and [`MemorySizing::fits`] says no.
pub fn split(budget: usize, engine: EngineLimits) -> MemorySizing {
    let bound = (budget / RESIDENT_SHARE).min(budget.saturating_sub(MIN_BUDGET));
    let engine = if engine.resident_between_instances() > bound {
        EngineLimits { keep_resident: engine.keep_resident.min(engine.keep_resident_within(bound)), ..engine }
    } else {
        engine
    };
    let resident = engine.resident_between_instances();
    MemorySizing { chargeable: budget.saturating_sub(resident).max(MIN_BUDGET.min(budget)), resident, engine }
}

impl MemorySizing {
    /// Whether requests and resident pages together stay within `budget`.
    pub fn fits(&self, budget: usize) -> bool {
        self.chargeable.saturating_add(self.resident) <= budget
    }
}

/// The default budget: three quarters of what is left of `available` once
/// `baseline` (the process with its models loaded) is taken out.
pub fn default_budget(available: usize, baseline: usize) -> usize {
    (available.saturating_sub(baseline) / 4 * 3).max(MIN_BUDGET)
}

/// What the process may use: `total_mib` if given, else the cgroup's limit,
/// else physical memory.
pub fn available(total_mib: Option<usize>) -> Option<Available> {
    if let Some(mib) = total_mib {
        return Some(Available { bytes: mib.saturating_mul(1 << 20), source: "--memory-total-mib" });
    }
    let physical = meminfo_total(&read(Path::new("/proc/meminfo"))?);
    let own = read(Path::new("/proc/self/cgroup")).and_then(|text| own_cgroup(&text).map(|path| Path::new(CGROUP_ROOT).join(path)));
    // The process's own cgroup (v2), else the root: a container's namespace
    // shows its cgroup there; a process on a host may sit deeper.
    let cgroup = own.and_then(|dir| cgroup_limit(&dir)).or_else(|| cgroup_limit(Path::new(CGROUP_ROOT)));
    match (cgroup, physical) {
        (Some(limit), Some(physical)) if limit < physical => Some(Available { bytes: limit, source: "cgroup memory.max" }),
        (_, Some(physical)) => Some(Available { bytes: physical, source: "physical memory" }),
        (Some(limit), None) => Some(Available { bytes: limit, source: "cgroup memory.max" }),
        (None, None) => None,
    }
}

/// This process's resident memory now (`VmRSS`), bytes.
pub fn resident_set() -> Option<usize> {
    let status = read(Path::new("/proc/self/status"))?;
    kib_field(&status, "VmRSS:")
}

/// The cgroup's memory limit: v2's `memory.max`, or v1's
/// `memory.limit_in_bytes` (no limit reads as `max`, or as a huge number).
fn cgroup_limit(root: &Path) -> Option<usize> {
    let text = read(&root.join("memory.max")).or_else(|| read(&root.join("memory/memory.limit_in_bytes")))?;
    text.trim().parse::<usize>().ok()
}

/// Where the cgroup file system is mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The process's cgroup v2 path, relative to [`CGROUP_ROOT`], from
/// `/proc/self/cgroup` (its `0::/PATH` line); `None` at the root or on v1.
fn own_cgroup(proc_self_cgroup: &str) -> Option<&str> {
    let path = proc_self_cgroup.lines().find_map(|line| line.strip_prefix("0::"))?.trim().trim_start_matches('/');
    // A path with `..` would leave the mount (a process outside the cgroup namespace's root).
    (!path.is_empty() && !path.split('/').any(|part| part == "..")).then_some(path)
}

/// `MemTotal` of `/proc/meminfo`, bytes.
fn meminfo_total(meminfo: &str) -> Option<usize> {
    kib_field(meminfo, "MemTotal:")
}

/// A `NAME:   1234 kB` line's value in bytes.
fn kib_field(text: &str, name: &str) -> Option<usize> {
    let line = text.lines().find(|line| line.starts_with(name))?;
    let kib: usize = line[name.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn the_default_leaves_a_quarter_for_the_engines_working_memory() {
        assert_eq!(default_budget(4096 * MIB, 600 * MIB), (4096 - 600) * MIB / 4 * 3);
        assert_eq!(default_budget(512 * MIB, 600 * MIB), MIN_BUDGET, "a baseline over the total still leaves the least budget");
    }

    #[test]
    fn resident_pages_take_at_most_a_quarter() {
        let engine = EngineLimits { max_instances: 192, memory_limit: 256 * MIB, keep_resident: 8 * MIB };
        let sizing = split(1024 * MIB, engine);
        assert!(sizing.resident <= 256 * MIB, "{}", sizing.resident);
        assert!(sizing.engine.keep_resident < 8 * MIB);
        assert_eq!(sizing.chargeable, 1024 * MIB - sizing.resident);
        // A roomy budget keeps the configured pages.
        let roomy = split(64 * 1024 * MIB, engine);
        assert_eq!(roomy.engine.keep_resident, 8 * MIB);
        assert_eq!(roomy.resident, engine.resident_between_instances());
    }

    #[test]
    fn the_split_never_exceeds_a_small_budget() {
        // 8 slots: 8 MiB of table pages, 256 MiB of memory pages as configured.
        let engine = EngineLimits { max_instances: 8, memory_limit: 256 * MIB, keep_resident: 8 * MIB };
        for mib in [72, 80, 100, 256] {
            let sizing = split(mib * MIB, engine);
            assert!(sizing.fits(mib * MIB), "{mib} MiB: {sizing:?}");
            assert!(sizing.chargeable >= MIN_BUDGET, "the memory pages give way to the least budget: {mib} MiB: {sizing:?}");
        }
        // 192 slots: their table pages alone (192 MiB) are past a small budget.
        let crowded = split(128 * MIB, EngineLimits { max_instances: 192, ..engine });
        assert!(!crowded.fits(128 * MIB), "{crowded:?}");
        assert_eq!((crowded.chargeable, crowded.engine.keep_resident), (MIN_BUDGET, 0), "{crowded:?}");
    }

    #[test]
    fn the_process_own_cgroup_is_found() {
        assert_eq!(own_cgroup("0::/kubepods.slice/pod1/ctr\n"), Some("kubepods.slice/pod1/ctr"));
        assert_eq!(own_cgroup("12:memory:/docker/abc\n0::/system.slice/facegate.service\n"), Some("system.slice/facegate.service"));
        assert_eq!(own_cgroup("0::/\n"), None, "the root: read there");
        assert_eq!(own_cgroup("0::/../outside\n"), None);
        assert_eq!(own_cgroup("4:memory:/docker/abc\n"), None, "cgroup v1 only");
    }

    #[test]
    fn limits_are_read_from_the_cgroup_and_meminfo() {
        let dir = std::env::temp_dir().join(format!("facegate-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "4294967296\n").unwrap();
        assert_eq!(cgroup_limit(&dir), Some(4 << 30));
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_limit(&dir), None, "no limit");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(meminfo_total("MemTotal:       24588812 kB\nMemFree: 1 kB\n"), Some(24_588_812 * 1024));
        assert_eq!(available(Some(2048)).unwrap(), Available { bytes: 2048 * MIB, source: "--memory-total-mib" });
        assert!(resident_set().is_some_and(|rss| rss > 0));
    }
}
