//! The node's memory budget: one ledger of the memory every request and
//! every kept instance holds, all tenants together.
//!
//! Per-request limits multiply: 32 requests of one tenant at 256 MiB each
//! are 8 GiB, more than a pod has. So everything a request makes the host
//! hold is charged here as well as to the request's own limit: its buffered
//! body and a base (stack, host structures) when it is admitted, then every
//! growth of its linear memories and tables, and its host resources (at
//! their largest size, re-counted at every epoch tick). A warm instance
//! keeps its charge while it waits. Past the budget, new requests are
//! refused (503 `overloaded`) before their body is read, and a growth
//! inside a running request fails as its own memory limit would, answered
//! 503 `overloaded` too: the node, not the handler, ran out.
//!
//! Shared fairly, as instance slots are (`slots.rs`): the last eighth
//! of the budget goes only to a tenant whose holding, with what it asks
//! for, stays within its fair share (the budget divided among the tenants
//! holding memory, the asker if new, and one more not yet arrived). A tenant
//! that fills the node with big requests is then the one refused, and
//! others keep being served.
//!
//! The shares are equal, not weighted: a tenant's own limits (`memory_mib`
//! times `max_concurrency`) already say how much of the first seven eighths
//! it may hold, and weighting the scarce last eighth by those same limits
//! would hand most of it to the tenant with the largest limits, the one
//! most able to fill the node. (The tenants' `weight` is a share of device
//! time, not of memory.)
//!
//! Idle instances kept warm are a cache: before a charge is refused, or
//! once one takes the budget into its reserve, the [`Reclaim`] hook drops
//! them, oldest first and whoever's they are, and the charge is retried.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

/// Bytes charged for every admitted request before it grows anything: the
/// guest's async stack (wasmtime's default 2 MiB, touched as it runs) and
/// the instance's host-side structures.
pub const REQUEST_BASE_BYTES: usize = 2 << 20;

/// Why the budget refused a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The charge would take the node past its budget.
    #[error("the node's memory budget is spent")]
    Spent,
    /// Only the last eighth is left, and the charge would take this tenant past its fair share.
    #[error("memory is scarce on this node and the tenant holds its fair share of it")]
    FairShare,
}

/// The error a guest traps with when a growth is refused by the node's
/// budget rather than by its own limit.
#[derive(Debug, thiserror::Error)]
#[error("node memory budget: {0}")]
pub struct NodeMemoryExhausted(pub Refusal);

/// Memory the node keeps only as a cache (idle warm instances), given back
/// when work needs it.
pub trait Reclaim: Send + Sync + std::fmt::Debug {
    /// Drops the oldest cached item, its charge given back; `false` when
    /// there was none.
    fn reclaim_one(&self) -> bool;
}

#[derive(Debug, Default)]
struct Ledger {
    used: usize,
    by_tenant: HashMap<Arc<str>, usize>,
}

/// The node's memory budget.
#[derive(Debug)]
pub struct MemoryBudget {
    total: usize,
    reserve: usize,
    ledger: Mutex<Ledger>,
    /// What drops idle instances under pressure (weak: the cache's owner
    /// holds the budget, not the other way round).
    reclaimer: OnceLock<Weak<dyn Reclaim>>,
}

impl MemoryBudget {
    /// A budget of `total` bytes; its last eighth is the fair-share reserve.
    pub fn new(total: usize) -> Arc<Self> {
        Arc::new(Self { total, reserve: total / 8, ledger: Mutex::default(), reclaimer: OnceLock::new() })
    }

    /// Sets what drops cached memory before a charge is refused (once; a
    /// second call is ignored).
    pub fn set_reclaimer(&self, reclaimer: Weak<dyn Reclaim>) {
        let _ = self.reclaimer.set(reclaimer);
    }

    /// Bytes the budget holds.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Bytes charged now, all tenants.
    pub fn used(&self) -> usize {
        self.lock().used
    }

    /// Bytes `tenant` holds now.
    pub fn held_by(&self, tenant: &str) -> usize {
        self.lock().by_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// Charges `bytes` to `tenant`, or says why not; given back when the
    /// [`Charge`] drops.
    pub fn charge(self: &Arc<Self>, tenant: &Arc<str>, bytes: usize) -> Result<Charge, Refusal> {
        self.add(tenant, bytes)?;
        Ok(Charge { budget: Arc::clone(self), tenant: Arc::clone(tenant), bytes })
    }

    /// A charge of nothing yet, for `tenant` (grown with [`Charge::resize`]).
    pub fn empty(self: &Arc<Self>, tenant: &Arc<str>) -> Charge {
        Charge { budget: Arc::clone(self), tenant: Arc::clone(tenant), bytes: 0 }
    }

    /// Whether `bytes` more could be charged to a tenant below its fair
    /// share while leaving the reserve untouched (warm instances are kept
    /// only then: idle memory never squeezes work).
    pub fn has_room_beyond_reserve(&self, bytes: usize) -> bool {
        let used = self.lock().used;
        used.saturating_add(bytes).saturating_add(self.reserve) <= self.total
    }

    /// Charges `bytes` to `tenant`: idle instances are dropped, oldest first,
    /// until the charge fits or none is left, and once it fits, while the
    /// budget is in its reserve (idle memory never squeezes work).
    fn add(&self, tenant: &Arc<str>, bytes: usize) -> Result<(), Refusal> {
        if bytes == 0 {
            return Ok(());
        }
        loop {
            match self.try_add(tenant, bytes) {
                Ok(()) => break,
                Err(refusal) if !self.reclaim_one() => return Err(refusal),
                Err(_) => {}
            }
        }
        while self.in_reserve() && self.reclaim_one() {}
        Ok(())
    }

    /// Whether less than the reserve is left.
    fn in_reserve(&self) -> bool {
        self.total - self.lock().used < self.reserve
    }

    /// Drops one idle instance through the reclaimer, if any (never with the
    /// ledger locked: its charge comes back through it).
    fn reclaim_one(&self) -> bool {
        self.reclaimer.get().and_then(Weak::upgrade).is_some_and(|reclaimer| reclaimer.reclaim_one())
    }

    fn try_add(&self, tenant: &Arc<str>, bytes: usize) -> Result<(), Refusal> {
        let mut ledger = self.lock();
        let used = ledger.used.checked_add(bytes).filter(|&used| used <= self.total).ok_or(Refusal::Spent)?;
        let held = ledger.by_tenant.get(tenant).copied().unwrap_or(0);
        if self.total - used < self.reserve && held.saturating_add(bytes) > self.fair_share(&ledger, held) {
            return Err(Refusal::FairShare);
        }
        ledger.used = used;
        *ledger.by_tenant.entry(Arc::clone(tenant)).or_default() += bytes;
        Ok(())
    }

    /// The budget divided among the tenants holding memory (counting the
    /// asker) and one more, not yet arrived.
    fn fair_share(&self, ledger: &Ledger, held: usize) -> usize {
        let tenants = ledger.by_tenant.len() + usize::from(held == 0) + 1;
        self.total / tenants
    }

    fn remove(&self, tenant: &str, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let mut ledger = self.lock();
        ledger.used -= bytes;
        if let Some(held) = ledger.by_tenant.get_mut(tenant) {
            *held -= bytes;
            if *held == 0 {
                // Nothing of a tenant stays behind once its memory is given back.
                ledger.by_tenant.remove(tenant);
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Bytes charged to one tenant, given back when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<MemoryBudget>,
    tenant: Arc<str>,
    bytes: usize,
}

impl Charge {
    /// Bytes charged now.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// A charge of `bytes` of its own for the same tenant (held apart from this one).
    pub fn another(&self, bytes: usize) -> Result<Charge, Refusal> {
        self.budget.charge(&self.tenant, bytes)
    }

    /// Charges `bytes` in all instead of what is charged now: growing is
    /// checked against the budget, shrinking always succeeds.
    pub fn resize(&mut self, bytes: usize) -> Result<(), Refusal> {
        if bytes > self.bytes {
            self.budget.add(&self.tenant, bytes - self.bytes)?;
        } else {
            self.budget.remove(&self.tenant, self.bytes - bytes);
        }
        self.bytes = bytes;
        Ok(())
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.remove(&self.tenant, self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn tenant(name: &str) -> Arc<str> {
        name.into()
    }

    #[test]
    fn charges_add_up_to_the_budget_and_come_back() {
        let budget = MemoryBudget::new(100 * MIB);
        let a = budget.charge(&tenant("a"), 40 * MIB).unwrap();
        let b = budget.charge(&tenant("b"), 40 * MIB).unwrap();
        assert_eq!(budget.charge(&tenant("c"), 40 * MIB).unwrap_err(), Refusal::Spent);
        assert_eq!(budget.used(), 80 * MIB);
        drop(a);
        drop(b);
        assert_eq!((budget.used(), budget.held_by("a")), (0, 0));
        assert!(budget.lock().by_tenant.is_empty(), "nothing of a tenant stays behind");
    }

    #[test]
    fn a_hog_is_refused_the_reserve_and_a_neighbour_gets_it() {
        let budget = MemoryBudget::new(1024 * MIB);
        let hog = tenant("hog");
        // The hog grows in 16 MiB steps until refused: it keeps out of the last eighth.
        let mut held = budget.empty(&hog);
        while held.resize(held.bytes() + 16 * MIB).is_ok() {}
        assert_eq!(held.bytes(), 896 * MIB, "a lone tenant takes all but the reserve");
        assert_eq!(budget.charge(&hog, MIB).unwrap_err(), Refusal::FairShare);
        // A neighbour below its share is served from the reserve.
        let neighbour = budget.charge(&tenant("neighbour"), 100 * MIB).unwrap();
        assert_eq!(neighbour.bytes(), 100 * MIB);
        // Nobody goes past the total.
        assert_eq!(budget.charge(&tenant("third"), 64 * MIB).unwrap_err(), Refusal::Spent);
    }

    #[test]
    fn shrinking_gives_back_and_always_succeeds() {
        let budget = MemoryBudget::new(64 * MIB);
        let mut charge = budget.charge(&tenant("t"), 50 * MIB).unwrap();
        charge.resize(10 * MIB).unwrap();
        assert_eq!((budget.used(), budget.held_by("t")), (10 * MIB, 10 * MIB));
        assert_eq!(charge.resize(100 * MIB).unwrap_err(), Refusal::Spent, "a refused growth keeps the old charge");
        assert_eq!(charge.bytes(), 10 * MIB);
        charge.resize(0).unwrap();
        assert_eq!(budget.used(), 0);
    }

    /// Cached charges, dropped oldest first.
    #[derive(Debug, Default)]
    struct Cache(Mutex<Vec<Charge>>);

    impl Reclaim for Cache {
        fn reclaim_one(&self) -> bool {
            let mut cached = self.0.lock().unwrap();
            (!cached.is_empty()).then(|| cached.remove(0)).is_some()
        }
    }

    #[test]
    fn cached_memory_is_dropped_oldest_first_before_work_is_refused() {
        let budget = MemoryBudget::new(100 * MIB);
        let cache = Arc::new(Cache::default());
        let weak: Weak<Cache> = Arc::downgrade(&cache);
        budget.set_reclaimer(weak);
        let fill = || {
            for _ in 0..4 {
                let charge = budget.charge(&tenant("idle"), 20 * MIB).unwrap();
                cache.0.lock().unwrap().push(charge);
            }
        };
        fill();
        // 80 MiB cached: 50 more fit once three are dropped (after two, the
        // charge would be in the reserve, past a newcomer's fair share).
        let work = budget.charge(&tenant("work"), 50 * MIB).unwrap();
        assert_eq!(cache.0.lock().unwrap().len(), 1, "the oldest were dropped, one is left");
        assert_eq!(budget.used(), 70 * MIB);
        // Nothing left to drop: past the budget is still refused.
        assert_eq!(budget.charge(&tenant("more"), 60 * MIB).unwrap_err(), Refusal::Spent);
        assert!(cache.0.lock().unwrap().is_empty());
        drop(work);
        assert_eq!(budget.used(), 0);
        // A charge that fits but enters the reserve drops cached memory until it is out.
        fill();
        let _small = budget.charge(&tenant("work"), 10 * MIB).unwrap();
        assert_eq!((cache.0.lock().unwrap().len(), budget.used()), (3, 70 * MIB));
    }

    #[test]
    fn warm_room_leaves_the_reserve() {
        let budget = MemoryBudget::new(80 * MIB);
        let _work = budget.charge(&tenant("t"), 60 * MIB).unwrap();
        assert!(budget.has_room_beyond_reserve(10 * MIB));
        assert!(!budget.has_room_beyond_reserve(11 * MIB), "10 MiB is the reserve");
    }
}
