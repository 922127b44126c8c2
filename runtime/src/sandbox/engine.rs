//! The one wasmtime [`Engine`] of the process, configured in one place.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, ProfilingStrategy};

/// How often the epoch advances. Guest code yields (or is stopped at its
/// deadline) at the next epoch check after a tick, so this bounds how long a
/// spinning guest can hold a host thread.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Core instances a component may hold. Rust guests use a handful (the
/// main module, the WASI adapter and its shims); a Python handler with the
/// pipeline linked in about 20.
const CORE_INSTANCES_PER_COMPONENT: u32 = 32;
/// Linear memories a component may hold: Rust guests have one or two; a
/// Python or JavaScript handler two, plus the pipeline's. All of them count
/// against the one per-request memory limit.
const MEMORIES_PER_COMPONENT: u32 = 4;
/// Tables a component may hold.
const TABLES_PER_COMPONENT: u32 = 16;
/// Bytes of each table kept mapped between instances and zeroed by
/// `memset`: a Rust handler's tables take a page or two; a larger one is
/// reset by `madvise` past this.
const TABLE_KEEP_RESIDENT: usize = 64 << 10;

/// Limits that shape the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLimits {
    /// Most component instances alive at once.
    pub max_instances: u32,
    /// Largest linear memory of one instance, bytes.
    pub memory_limit: usize,
    /// Bytes of each linear memory kept resident between instances (`--memory-keep-resident-kib`).
    pub keep_resident: usize,
}

impl EngineLimits {
    /// The most host memory the pool keeps resident between instances: every
    /// memory slot its kept-resident bytes and every table slot
    /// `TABLE_KEEP_RESIDENT`. Nobody's request holds it, so the node's
    /// memory budget sets it aside.
    pub fn resident_between_instances(&self) -> usize {
        self.memory_slots().saturating_mul(self.keep_resident).saturating_add(self.table_resident())
    }

    /// The largest `keep_resident` (whole pages) whose
    /// [`resident_between_instances`](Self::resident_between_instances) stays within `bound`.
    pub fn keep_resident_within(&self, bound: usize) -> usize {
        const PAGE: usize = 4096;
        let per_slot = bound.saturating_sub(self.table_resident()) / self.memory_slots().max(1);
        per_slot / PAGE * PAGE
    }

    fn memory_slots(&self) -> usize {
        self.max_instances.max(1) as usize * MEMORIES_PER_COMPONENT as usize
    }

    fn table_resident(&self) -> usize {
        self.max_instances.max(1) as usize * TABLES_PER_COMPONENT as usize * TABLE_KEEP_RESIDENT
    }
}

/// Builds the engine: component model, async host calls, epoch interruption,
/// and the pooling allocator when the address space allows it.
pub fn build(limits: EngineLimits) -> wasmtime::Result<Engine> {
    let mut config = Config::new();
    // Handlers are components (wasi:http incoming-handler + face-detect).
    config.wasm_component_model(true);
    // Deadlines: the epoch thread ticks; each store yields or traps on a tick.
    config.epoch_interruption(true);
    // Deep recursion traps cleanly instead of growing the host stack.
    config.max_wasm_stack(1 << 20);
    if profile_with_perf() {
        // Names guest functions in `perf` profiles (/tmp/perf-PID.map).
        config.profiler(ProfilingStrategy::PerfMap);
    }
    if pooling_fits(limits) {
        // Pre-reserved slots: instantiation is a few microseconds and memory
        // is bounded by construction.
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling(limits)));
    } else {
        tracing::warn!("virtual address space too small for the pooling allocator; using on-demand allocation");
    }
    Engine::new(&config)
}

/// `FACEGATE_WASM_PROFILER=perfmap` writes a perf map of compiled guest code,
/// so `perf record`/`perf top` name the guest functions where time goes.
fn profile_with_perf() -> bool {
    std::env::var("FACEGATE_WASM_PROFILER").is_ok_and(|v| v == "perfmap")
}

fn pooling(limits: EngineLimits) -> PoolingAllocationConfig {
    let n = limits.max_instances.max(1);
    let mut pool = PoolingAllocationConfig::default();
    pool.total_component_instances(n)
        .total_core_instances(n * CORE_INSTANCES_PER_COMPONENT)
        .total_memories(n * MEMORIES_PER_COMPONENT)
        .total_tables(n * TABLES_PER_COMPONENT)
        .total_stacks(n)
        .max_core_instances_per_component(CORE_INSTANCES_PER_COMPONENT)
        .max_memories_per_component(MEMORIES_PER_COMPONENT)
        .max_tables_per_component(TABLES_PER_COMPONENT)
        .max_memory_size(limits.memory_limit)
        // Each request instantiates afresh: keeping the first pages of a slot
        // mapped (reset in place) spares the next instance the page faults
        // and the madvise/TLB flush of handing them back and taking them
        // again.
        .linear_memory_keep_resident(limits.keep_resident)
        // Tables too: otherwise each of an instance's tables (a page or two
        // each) is reset with its own madvise, and every madvise of a page
        // that was mapped sends a TLB-shootdown interrupt to the other
        // cores (a VM exit each on a virtual machine). strace of one `detect`
        // request: 2 madvise calls before, none after.
        .table_keep_resident(TABLE_KEEP_RESIDENT)
        // Reset only the pages the guest wrote (the kernel's PAGEMAP_SCAN,
        // Linux 6.7+; older kernels memset the whole kept region): the
        // smallest handler writes a few pages of its 1.1 MiB, and the memset
        // of the rest was a fifth of a request's CPU. The vendored wasmtime
        // also resets written pages that are swapped out or migrating,
        // which upstream's scan skips (runtime/vendor/wasmtime/PATCHED.md).
        .pagemap_scan(wasmtime::Enabled::Auto);
    pool
}

/// Whether the pool's virtual reservation fits, probed the way `wasmtime serve` does.
fn pooling_fits(limits: EngineLimits) -> bool {
    let mut probe = Config::new();
    probe.wasm_component_model(true);
    let mut pool = pooling(limits);
    // Only reserve: creating the engine allocates the pool's address space.
    pool.total_core_instances(limits.max_instances.max(1) * CORE_INSTANCES_PER_COMPONENT);
    probe.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    Engine::new(&probe).is_ok()
}

/// Advances the engine's epoch every [`EPOCH_TICK`] until dropped.
pub struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    /// Starts the ticking thread.
    pub fn start(engine: &Engine) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (engine, flag) = (engine.weak(), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("epoch-ticker".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    match engine.upgrade() {
                        Some(engine) => engine.increment_epoch(),
                        None => break,
                    }
                }
            })
            .ok();
        Self { stop, thread }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_resident_pages_are_fitted_under_a_bound() {
        let limits = EngineLimits { max_instances: 10, memory_limit: 1 << 30, keep_resident: 8 << 20 };
        // 40 memory slots of 8 MiB and 160 table slots of 64 KiB.
        assert_eq!(limits.resident_between_instances(), 40 * (8 << 20) + 160 * (64 << 10));
        let keep = limits.keep_resident_within(100 << 20);
        assert_eq!(keep % 4096, 0);
        let fitted = EngineLimits { keep_resident: keep, ..limits };
        assert!(fitted.resident_between_instances() <= 100 << 20);
        assert!(EngineLimits { keep_resident: keep + 4096, ..limits }.resident_between_instances() > 100 << 20, "the largest that fits");
        assert_eq!(limits.keep_resident_within(1 << 20), 0, "tables alone over the bound: nothing kept");
    }
}
