//! How large the node's memory budget is, and what it sets aside.
//!
//! By default the budget is three quarters of what the process may use
//! (the cgroup's `memory.max`, or `--memory-total-mib`, else physical
//! memory) less what it holds once the models are loaded; the last quarter
//! is headroom the budget does not see (ONNX Runtime's working memory grows
//! with batches, compilation, connections). Out of the budget comes what the
//! instance pool keeps resident between instances, which nobody's request
//! holds: at most a quarter of it, the kept-resident bytes per slot
//! lowered to fit.

use std::path::Path;

use crate::engine::EngineLimits;

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
/// `engine.keep_resident` when the pages would take more than a quarter.
pub fn split(budget: usize, engine: EngineLimits) -> MemorySizing {
    let bound = budget / RESIDENT_SHARE;
    let engine = if engine.resident_between_instances() > bound {
        EngineLimits { keep_resident: engine.keep_resident.min(engine.keep_resident_within(bound)), ..engine }
    } else {
        engine
    };
    let resident = engine.resident_between_instances();
    MemorySizing { chargeable: budget.saturating_sub(resident).max(MIN_BUDGET), resident, engine }
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
    let cgroup = cgroup_limit(Path::new("/sys/fs/cgroup"));
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
