//! The gateway's handler-instance slots, shared by all tenants, with a fair
//! share kept for tenants that have few.
//!
//! Slots are handed out first come, first served while more than a reserve
//! (an eighth of the pool) is free. The reserve goes only to tenants holding
//! less than their fair share: the pool divided by the tenants holding slots,
//! plus one for a tenant yet to come. So a tenant — or a few — that fill the
//! pool with slow handlers still leave room for everyone else, and a lone
//! tenant can use seven eighths of the pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// Why no slot was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Every slot is taken.
    Full,
    /// Only the reserve is left, and this tenant already holds its fair share.
    FairShare,
}

#[derive(Debug, Default)]
struct Holdings {
    in_use: usize,
    by_tenant: HashMap<Arc<str>, usize>,
}

/// The pool of instance slots.
#[derive(Debug)]
pub struct InstancePool {
    total: usize,
    reserve: usize,
    holdings: Mutex<Holdings>,
}

/// One slot, given back when dropped.
#[derive(Debug)]
pub struct InstanceSlot {
    pool: Arc<InstancePool>,
    tenant: Arc<str>,
}

impl InstancePool {
    /// A pool of `total` slots; the reserve is an eighth of it (at least one
    /// when there are two or more slots).
    pub fn new(total: usize) -> Self {
        let reserve = if total >= 2 { total.div_ceil(8) } else { 0 };
        Self { total, reserve, holdings: Mutex::default() }
    }

    /// Slots in use now.
    pub fn in_use(&self) -> usize {
        self.lock().in_use
    }

    /// Slots `tenant` holds now.
    pub fn held_by(&self, tenant: &str) -> usize {
        self.lock().by_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// Takes a slot for `tenant`, or says why not.
    pub fn try_acquire(self: &Arc<Self>, tenant: &Arc<str>) -> Result<InstanceSlot, Refusal> {
        let mut h = self.lock();
        let free = self.total - h.in_use;
        if free == 0 {
            return Err(Refusal::Full);
        }
        let held = h.by_tenant.get(tenant).copied().unwrap_or(0);
        if free <= self.reserve && held >= self.fair_share(&h, held) {
            return Err(Refusal::FairShare);
        }
        h.in_use += 1;
        *h.by_tenant.entry(Arc::clone(tenant)).or_default() += 1;
        Ok(InstanceSlot { pool: Arc::clone(self), tenant: Arc::clone(tenant) })
    }

    /// The pool divided among the tenants holding slots (counting the asker)
    /// and one more, not yet arrived.
    fn fair_share(&self, h: &Holdings, held: usize) -> usize {
        let tenants = h.by_tenant.len() + usize::from(held == 0) + 1;
        (self.total / tenants).max(1)
    }

    fn release(&self, tenant: &str) {
        let mut h = self.lock();
        h.in_use -= 1;
        if let Some(held) = h.by_tenant.get_mut(tenant) {
            *held -= 1;
            if *held == 0 {
                // Nothing of a tenant stays behind once its last request is gone.
                h.by_tenant.remove(tenant);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Holdings> {
        self.holdings.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for InstanceSlot {
    fn drop(&mut self) {
        self.pool.release(&self.tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(pool: &Arc<InstancePool>, tenant: &str, n: usize) -> Vec<InstanceSlot> {
        let tenant: Arc<str> = tenant.into();
        (0..n).map_while(|_| pool.try_acquire(&tenant).ok()).collect()
    }

    #[test]
    fn a_lone_tenant_leaves_the_reserve_for_others() {
        let pool = Arc::new(InstancePool::new(16));
        let hog = take(&pool, "hog", 100);
        assert_eq!(hog.len(), 14, "16 slots less a reserve of 2");
        assert_eq!(pool.try_acquire(&"hog".into()).unwrap_err(), Refusal::FairShare);
        let other = take(&pool, "other", 100);
        assert_eq!(other.len(), 2, "a newcomer gets the reserve");
        assert_eq!(pool.try_acquire(&"third".into()).unwrap_err(), Refusal::Full);
        drop(other);
        assert_eq!(pool.in_use(), 14);
    }

    #[test]
    fn a_few_hogs_cannot_lock_out_a_newcomer() {
        let pool = Arc::new(InstancePool::new(64));
        // Three tenants take what they can, in turns.
        let mut held = Vec::new();
        for _ in 0..64 {
            for t in ["a", "b", "c"] {
                held.extend(take(&pool, t, 1));
            }
        }
        assert!(pool.in_use() < 64, "the reserve is kept: {}", pool.in_use());
        assert_eq!(take(&pool, "d", 1).len(), 1, "a fourth tenant is still served");
    }

    #[test]
    fn slots_are_given_back_and_tenants_forgotten() {
        let pool = Arc::new(InstancePool::new(4));
        let slots = take(&pool, "t", 4);
        assert_eq!(pool.held_by("t"), slots.len());
        drop(slots);
        assert_eq!((pool.in_use(), pool.held_by("t")), (0, 0));
        assert!(pool.lock().by_tenant.is_empty());
    }

    #[test]
    fn a_pool_of_one_is_first_come_first_served() {
        let pool = Arc::new(InstancePool::new(1));
        let slot = take(&pool, "a", 1);
        assert_eq!(slot.len(), 1);
        assert_eq!(pool.try_acquire(&"b".into()).unwrap_err(), Refusal::Full);
    }
}
