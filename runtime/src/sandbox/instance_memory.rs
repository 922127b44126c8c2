//! The memory limit of one handler instance: all its linear memories and
//! tables together, whatever number of them the component declares
//! (wasmtime's `StoreLimits` bounds each memory on its own, so a component
//! with two memories could use twice the tenant's limit). Everything it
//! charges, with the request's host resources, is charged to the node's
//! memory budget too ([`crate::admission::memory`]).

use wasmtime::ResourceLimiter;

use crate::admission::memory::{Charge, NodeMemoryExhausted};

/// What one table element costs against the budget (a pointer, as wasmtime
/// stores funcrefs).
const TABLE_ELEMENT_BYTES: usize = std::mem::size_of::<usize>();

/// Core instances, memories and tables one store may create (generous for
/// components from componentize-py and the like; the pooling allocator has
/// its own per-component caps).
const MAX_INSTANCES: usize = 64;
const MAX_MEMORIES: usize = 16;
const MAX_TABLES: usize = 64;

/// The error a guest traps with when its instance would exceed its memory budget.
#[derive(Debug, thiserror::Error)]
#[error("memory limit exceeded: the handler's memories and tables would use {wanted} bytes, over its limit of {limit}")]
pub struct MemoryLimitExceeded {
    /// Bytes the growth asked for, counting everything already allocated.
    pub wanted: usize,
    /// The budget.
    pub limit: usize,
}

/// Charges every memory and table growth of one store to one budget, and
/// to the node's, and traps when either would be exceeded.
#[derive(Debug)]
pub struct InstanceLimiter {
    limit: usize,
    used: usize,
    /// Host memory the store's resources may hold now, at their largest.
    host: usize,
    /// `used + host`, in the node's budget.
    node: Charge,
}

impl InstanceLimiter {
    /// A budget of `limit` bytes for all memories and tables of a store,
    /// charged to the node's budget through `node`.
    pub fn new(limit: usize, node: Charge) -> Self {
        Self { limit, used: 0, host: 0, node }
    }

    /// Charges `bytes` of host memory (the store's resources at their
    /// largest) instead of what was charged for them before; fails when
    /// the node's budget refuses the growth.
    pub fn set_host_bytes(&mut self, bytes: usize) -> Result<(), NodeMemoryExhausted> {
        if bytes == self.host {
            return Ok(());
        }
        self.node.resize(self.used.saturating_add(bytes)).map_err(NodeMemoryExhausted)?;
        self.host = bytes;
        Ok(())
    }

    /// Sets the budget for the next request of a warm instance (the tenant's
    /// limit may have changed); what is charged stays.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Bytes charged so far.
    pub fn used(&self) -> usize {
        self.used
    }

    fn charge(&mut self, bytes: usize) -> wasmtime::Result<bool> {
        let wanted = self.used.saturating_add(bytes);
        if wanted > self.limit {
            return Err(MemoryLimitExceeded { wanted, limit: self.limit }.into());
        }
        self.node.resize(wanted.saturating_add(self.host)).map_err(NodeMemoryExhausted)?;
        self.used = wanted;
        Ok(true)
    }
}

impl ResourceLimiter for InstanceLimiter {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|max| desired > max) {
            return Err(MemoryLimitExceeded { wanted: desired, limit: maximum.unwrap_or(desired) }.into());
        }
        self.charge(desired.saturating_sub(current))
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        // Allowed by the budget but refused by the allocator or the OS: a trap
        // with a clear reason, not an allocator abort inside the guest.
        Err(error.context("memory limit exceeded: the allocator refused the growth"))
    }

    fn table_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|max| desired > max) {
            return Ok(false);
        }
        self.charge(desired.saturating_sub(current).saturating_mul(TABLE_ELEMENT_BYTES))
    }

    fn instances(&self) -> usize {
        MAX_INSTANCES
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES
    }

    fn tables(&self) -> usize {
        MAX_TABLES
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::admission::memory::{MemoryBudget, Refusal};

    fn unbudgeted(limit: usize) -> InstanceLimiter {
        InstanceLimiter::new(limit, MemoryBudget::new(usize::MAX).empty(&"t".into()))
    }

    #[test]
    fn all_memories_share_one_budget() {
        let mut limiter = unbudgeted(100 << 20);
        // Two memories of 40 MiB each fit; a third does not.
        assert!(limiter.memory_growing(0, 40 << 20, None).unwrap());
        assert!(limiter.memory_growing(0, 40 << 20, None).unwrap());
        let err = limiter.memory_growing(0, 40 << 20, None).unwrap_err();
        assert!(err.downcast_ref::<MemoryLimitExceeded>().is_some(), "{err}");
        // Growing one by the rest still fits.
        assert!(limiter.memory_growing(40 << 20, 60 << 20, None).unwrap());
        assert_eq!(limiter.used(), 100 << 20);
    }

    #[test]
    fn tables_count_against_the_same_budget() {
        let mut limiter = unbudgeted(1 << 20);
        assert!(limiter.memory_growing(0, (1 << 20) - 8 * 100, None).unwrap());
        assert!(limiter.table_growing(0, 100, None).unwrap());
        assert!(limiter.table_growing(100, 101, None).is_err());
    }

    #[test]
    fn growth_and_host_memory_are_charged_to_the_node_and_given_back() {
        let budget = MemoryBudget::new(64 << 20);
        let tenant: Arc<str> = "t".into();
        let mut limiter = InstanceLimiter::new(256 << 20, budget.empty(&tenant));
        assert!(limiter.memory_growing(0, 40 << 20, None).unwrap());
        limiter.set_host_bytes(8 << 20).unwrap();
        assert_eq!(budget.held_by("t"), 48 << 20);
        // Within the request's own limit, past the node's budget: refused by the node.
        let err = limiter.memory_growing(40 << 20, 60 << 20, None).unwrap_err();
        assert!(matches!(err.downcast_ref::<NodeMemoryExhausted>(), Some(NodeMemoryExhausted(Refusal::Spent))), "{err}");
        assert_eq!(limiter.used(), 40 << 20, "a refused growth charges nothing");
        assert!(limiter.set_host_bytes(32 << 20).is_err());
        drop(limiter);
        assert_eq!(budget.used(), 0, "an instance's charge ends with it");
    }
}
