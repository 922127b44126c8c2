//! Warm instances: a handler instance kept, after a request it ended
//! cleanly, for the next request to the same handler version. Only for
//! tenants whose `instance_reuse` is above 1; by default every request gets
//! a fresh instance.
//!
//! Why: instantiating from the pre-instance is cheap, but every fresh
//! instance's memory is reset when it ends (every page it wrote)
//! and its growth is re-done with `mprotect` calls, each of which
//! interrupts the other cores to flush their TLBs, the inference threads'
//! included. A warm instance skips all of it.
//!
//! What keeps it safe:
//! - The idle instances live in their [`crate::sandbox::handler::Handler`], one
//!   tenant's one handler version (its component's digest, not only its
//!   number): they never serve another tenant or another version, nor a
//!   tenant created again under a deleted one's name (the control plane
//!   tells them apart by the tenant's incarnation), and they go when the
//!   version does.
//! - An instance is kept only if its request returned cleanly (no trap, no
//!   timeout, and not cancelled while the guest still ran: a client that
//!   leaves after the response head lets the guest finish, as a fresh one
//!   would), its resource table holds nothing but its standard streams (no
//!   headers, bodies, pollables; the gateway grants no files or sockets),
//!   its memory is at most [`WARM_MAX_MEMORY`] and it has served fewer than
//!   the tenant's `instance_reuse` requests.
//! - Each request gets its own deadline, infer-call budget, output capture
//!   and memory limit, as a fresh instance would. The limit applies to the
//!   instance's whole memory, what earlier requests grew included (memory
//!   never shrinks): an instance already past a lowered limit is not used.
//! - Idle instances hold wasmtime slots of their own (the engine's pool is
//!   `--max-instances` plus `--warm-instances`) and no request slot, so they
//!   never keep a request, of any tenant, from running.
//! - Bounded in number and time: at most `--warm-instances` idle on the
//!   server, at most a tenant's `max_concurrency` for one tenant (all its
//!   handlers; more could never be busy at once), the last eighth of the
//!   places only for tenants holding less than their fair share (the cap
//!   divided among the tenants holding places and one more), each dropped after
//!   `--warm-idle-secs` without a request (checked every sync-thread
//!   wake-up), and all of a tenant's dropped when its limits change or it
//!   is deleted (one put back afterwards by a request that started under
//!   the old limits is used only if it fits the new ones: memory, reuse).
//! - Charged to the node's memory budget while idle (its memories, tables
//!   and host resources, re-counted when it is put back), kept only while
//!   the budget is out of its reserve, and dropped, oldest first and
//!   whoever's, before a charge of any request is refused (the
//!   [`Reclaim`] hook of [`crate::admission::memory`]): idle memory is a
//!   cache, never a reason to turn work away.
//!
//! What a tenant accepts by turning it on: its handler's globals (and
//! anything it left in its memory) outlive a request, as in a warm AWS
//! Lambda or a Cloudflare Worker isolate; output its handler buffered
//! without flushing is logged with the request that flushes it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use wasmtime::Store;
use wasmtime_wasi_http::p2::bindings::Proxy;

use crate::admission::memory::Reclaim;
use crate::sandbox::state::RequestState;

/// Largest memory (all linear memories and tables) an instance may hold to
/// be kept warm: bounds what idle instances keep resident.
pub const WARM_MAX_MEMORY: usize = 64 << 20;

/// How many idle instances may be kept: the server's cap, and each
/// tenant's share of it.
#[derive(Debug)]
pub struct WarmBudget {
    cap: usize,
    idle_for: Duration,
    idle: AtomicUsize,
    per_tenant: Mutex<HashMap<Arc<str>, usize>>,
    /// Every handler version's idle instances that ever kept one (weak:
    /// they go with their handler), for [`Reclaim`].
    stacks: Stacks,
}

/// One handler version's idle instances, the one used last on top.
type Stack = Mutex<Vec<Warm>>;

/// The [`Stack`]s a [`WarmBudget`] drops from under memory pressure.
#[derive(Default)]
struct Stacks(Mutex<Vec<Weak<Stack>>>);

impl std::fmt::Debug for Stacks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stacks").field("len", &self.0.lock().unwrap_or_else(PoisonError::into_inner).len()).finish()
    }
}

impl Stacks {
    /// The stacks still alive (forgetting the others).
    fn alive(&self) -> Vec<Arc<Stack>> {
        let mut stacks = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        stacks.retain(|stack| stack.strong_count() > 0);
        stacks.iter().filter_map(Weak::upgrade).collect()
    }

    fn register(&self, stack: &Arc<Stack>) {
        let mut stacks = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        stacks.retain(|stack| stack.strong_count() > 0);
        stacks.push(Arc::downgrade(stack));
    }
}

impl WarmBudget {
    /// A budget of `cap` idle instances (0 keeps none), each dropped after
    /// `idle_for` without a request.
    pub fn new(cap: usize, idle_for: Duration) -> Arc<Self> {
        Arc::new(Self { cap, idle_for, idle: AtomicUsize::new(0), per_tenant: Mutex::default(), stacks: Stacks::default() })
    }

    /// Idle instances now, all handlers.
    pub fn idle(&self) -> usize {
        self.idle.load(Ordering::Relaxed)
    }

    /// How long an instance may wait for its next request.
    pub fn idle_for(&self) -> Duration {
        self.idle_for
    }

    /// Room for one more idle instance of `tenant`, or `None` when the
    /// server's cap or the tenant's `tenant_cap` is reached, or when only
    /// the last eighth of the cap is left and the tenant already holds its
    /// fair share (as for instance slots, see `admission/slots.rs`): two busy
    /// tenants cannot keep all the places, and others' handlers warm none.
    fn try_take(self: &Arc<Self>, tenant: &Arc<str>, tenant_cap: usize) -> Option<WarmToken> {
        let mut per_tenant = self.per_tenant.lock().unwrap_or_else(PoisonError::into_inner);
        let held = per_tenant.get(tenant).copied().unwrap_or(0);
        if held >= tenant_cap {
            return None;
        }
        let free = self.cap.saturating_sub(self.idle.load(Ordering::Acquire));
        // The holders, the asker if new, and one more not yet arrived.
        let fair_share = (self.cap / (per_tenant.len() + usize::from(held == 0) + 1)).max(1);
        if free <= self.cap / 8 && held >= fair_share {
            return None;
        }
        self.idle.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.cap).then_some(n + 1)).ok()?;
        per_tenant.insert(Arc::clone(tenant), held + 1);
        Some(WarmToken { budget: Arc::clone(self), tenant: Arc::clone(tenant) })
    }

    fn give_back(&self, tenant: &str) {
        let mut per_tenant = self.per_tenant.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = per_tenant.get_mut(tenant) {
            *held -= 1;
            if *held == 0 {
                per_tenant.remove(tenant);
            }
        }
        self.idle.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Reclaim for WarmBudget {
    /// Drops the instance idle longest, of any handler and tenant.
    fn reclaim_one(&self) -> bool {
        if self.idle() == 0 {
            return false;
        }
        let stacks = self.stacks.alive();
        // The bottom of each stack is its oldest (instances go back on top).
        let oldest = stacks.iter().filter_map(|stack| Some((lock(stack).first()?.idle_since, stack))).min_by_key(|(since, _)| *since);
        let Some((_, stack)) = oldest else { return false };
        let dropped = {
            let mut idle = lock(stack);
            (!idle.is_empty()).then(|| idle.remove(0))
        };
        // Dropped outside the lock: freeing an instance resets its memory.
        dropped.is_some()
    }
}

/// One idle instance's place in the [`WarmBudget`], given back when dropped.
#[derive(Debug)]
struct WarmToken {
    budget: Arc<WarmBudget>,
    tenant: Arc<str>,
}

impl Drop for WarmToken {
    fn drop(&mut self) {
        self.budget.give_back(&self.tenant);
    }
}

/// An instance between requests: its store and its bindings.
pub struct Warm {
    /// The store, with the instance in it.
    pub store: Store<RequestState>,
    /// The instance's `wasi:http/incoming-handler` export.
    pub proxy: Proxy,
    /// Requests it has served.
    pub served: u32,
    idle_since: Instant,
    _token: WarmToken,
}

/// One handler version's idle instances, the one used last on top.
#[derive(Default)]
pub struct WarmInstances {
    idle: Arc<Stack>,
    /// Whether [`WarmBudget`]'s stacks know this one.
    registered: AtomicBool,
}

impl WarmInstances {
    /// The instance used last (its memory is the likeliest in cache), if any.
    pub fn take(&self) -> Option<Warm> {
        self.lock().pop()
    }

    /// Keeps an instance of `tenant` that served `served` requests for the
    /// next request, unless the tenant already keeps `tenant_cap` idle
    /// instances (all its handlers) or the server its cap; then it is
    /// dropped (and its memory reset as usual).
    pub fn put(
        &self,
        budget: &Arc<WarmBudget>,
        tenant: &Arc<str>,
        tenant_cap: usize,
        store: Store<RequestState>,
        proxy: Proxy,
        served: u32,
    ) {
        if let Some(token) = budget.try_take(tenant, tenant_cap) {
            if !self.registered.swap(true, Ordering::AcqRel) {
                budget.stacks.register(&self.idle);
            }
            self.lock().push(Warm { store, proxy, served, idle_since: Instant::now(), _token: token });
        }
    }

    /// Drops the instances that have been idle longer than `idle_for`;
    /// returns how many.
    pub fn expire(&self, idle_for: Duration) -> usize {
        let expired: Vec<Warm> = {
            let mut idle = self.lock();
            // Oldest first: the stack is in the order instances were put back.
            let stale = idle.iter().take_while(|w| w.idle_since.elapsed() > idle_for).count();
            idle.drain(..stale).collect()
        };
        // Dropped outside the lock: freeing an instance resets its memory.
        expired.len()
    }

    /// Drops every idle instance (the tenant turned reuse off, changed its
    /// limits, or is gone).
    pub fn clear(&self) {
        let dropped = std::mem::take(&mut *self.lock());
        drop(dropped);
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Warm>> {
        lock(&self.idle)
    }
}

fn lock(stack: &Stack) -> MutexGuard<'_, Vec<Warm>> {
    stack.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(60);

    #[test]
    fn the_budget_caps_idle_instances_and_tokens_give_their_place_back() {
        let budget = WarmBudget::new(2, IDLE);
        let acme: Arc<str> = "acme".into();
        let a = budget.try_take(&acme, 10).unwrap();
        let b = budget.try_take(&acme, 10).unwrap();
        assert!(budget.try_take(&acme, 10).is_none());
        assert_eq!(budget.idle(), 2);
        drop(a);
        assert_eq!(budget.idle(), 1);
        let c = budget.try_take(&acme, 10).unwrap();
        drop((b, c));
        assert_eq!(budget.idle(), 0);
        assert!(WarmBudget::new(0, IDLE).try_take(&acme, 10).is_none(), "a cap of 0 keeps nothing");
    }

    #[test]
    fn a_tenant_holds_at_most_its_share_and_leaves_the_rest_to_others() {
        let budget = WarmBudget::new(3, IDLE);
        let (acme, beta): (Arc<str>, Arc<str>) = ("acme".into(), "beta".into());
        let a1 = budget.try_take(&acme, 2).unwrap();
        let a2 = budget.try_take(&acme, 2).unwrap();
        assert!(budget.try_take(&acme, 2).is_none(), "acme's share is 2");
        let b1 = budget.try_take(&beta, 2).unwrap();
        assert!(budget.try_take(&beta, 2).is_none(), "the server's cap of 3 is reached");
        drop(a1);
        assert!(budget.try_take(&acme, 2).is_some(), "acme's place came back");
        drop((a2, b1));
        assert!(budget.per_tenant.lock().unwrap().is_empty(), "a tenant with none idle leaves no entry");
    }

    #[test]
    fn the_last_eighth_is_kept_for_tenants_below_their_fair_share() {
        let budget = WarmBudget::new(16, IDLE);
        let names: Vec<Arc<str>> = ["acme", "beta", "gamma"].map(Arc::from).into();
        let take_all = |tenant: &Arc<str>| std::iter::from_fn(|| budget.try_take(tenant, 16)).collect::<Vec<_>>();
        let acme = take_all(&names[0]);
        assert_eq!(acme.len(), 14, "alone, acme stops where the last eighth (2) begins");
        let beta = take_all(&names[1]);
        assert_eq!(beta.len(), 2, "beta, below its share, gets the rest");
        assert!(budget.try_take(&names[2], 16).is_none(), "the cap holds");
        drop(acme);
        assert_eq!(take_all(&names[2]).len(), 12, "places given back go to whoever asks, up to the last eighth");
    }
}
