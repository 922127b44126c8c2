//! Warm instances: a handler instance kept, after a request it ended
//! cleanly, for the next request to the same handler version. Only for
//! tenants whose `instance_reuse` is above 1; by default every request gets
//! a fresh instance.
//!
//! Why: instantiating from the pre-instance is cheap, but every fresh
//! instance's memory is reset when it ends (a `memset` of all it touched)
//! and its growth is re-done with `mprotect` calls, each of which
//! interrupts the other cores to flush their TLBs, the inference threads'
//! included. A warm instance skips all of it.
//!
//! What keeps it safe:
//! - The idle instances live in their [`crate::handlers::Handler`], one
//!   tenant's one handler version: they never serve another tenant or
//!   another version, and they go when the version does.
//! - An instance is kept only if its request returned cleanly (no trap, no
//!   timeout, not cancelled), it holds no host resources (headers, bodies,
//!   streams, pollables: the resource table is empty), its memory is at most
//!   [`WARM_MAX_MEMORY`] and it has served fewer than the tenant's
//!   `instance_reuse` requests.
//! - Each request gets its own deadline, infer-call budget, output capture
//!   and memory limit, as a fresh instance would.
//! - Idle instances hold wasmtime slots of their own (the engine's pool is
//!   `--max-instances` plus `--warm-instances`) and no request slot, so they
//!   never keep a request, of any tenant, from running.
//!
//! What a tenant accepts by turning it on: its handler's globals (and
//! anything it left in its memory) outlive a request, as in a warm AWS
//! Lambda or a Cloudflare Worker isolate.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use wasmtime::Store;
use wasmtime_wasi_http::p2::bindings::Proxy;

use crate::state::RequestState;

/// Largest memory (all linear memories and tables) an instance may hold to
/// be kept warm: bounds what idle instances keep resident.
pub const WARM_MAX_MEMORY: usize = 64 << 20;

/// The server-wide cap on idle instances.
#[derive(Debug)]
pub struct WarmBudget {
    cap: usize,
    idle: AtomicUsize,
}

impl WarmBudget {
    /// A budget of `cap` idle instances (0 keeps none).
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self { cap, idle: AtomicUsize::new(0) })
    }

    /// Idle instances now, all handlers.
    pub fn idle(&self) -> usize {
        self.idle.load(Ordering::Relaxed)
    }

    /// Room for one more idle instance, or `None` when the cap is reached.
    fn try_take(self: &Arc<Self>) -> Option<WarmToken> {
        self.idle.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.cap).then_some(n + 1)).ok()?;
        Some(WarmToken(Arc::clone(self)))
    }
}

/// One idle instance's place in the [`WarmBudget`], given back when dropped.
#[derive(Debug)]
struct WarmToken(Arc<WarmBudget>);

impl Drop for WarmToken {
    fn drop(&mut self) {
        self.0.idle.fetch_sub(1, Ordering::AcqRel);
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
    _token: WarmToken,
}

/// One handler version's idle instances.
#[derive(Default)]
pub struct WarmInstances {
    idle: Mutex<Vec<Warm>>,
}

impl WarmInstances {
    /// The instance used last (its memory is the likeliest in cache), if any.
    pub fn take(&self) -> Option<Warm> {
        self.lock().pop()
    }

    /// Keeps an instance that served `served` requests for the next
    /// request, unless this handler already keeps `max_idle` or the server
    /// its cap; then it is dropped (and its memory reset as usual).
    pub fn put(&self, budget: &Arc<WarmBudget>, store: Store<RequestState>, proxy: Proxy, served: u32, max_idle: usize) {
        let mut idle = self.lock();
        if idle.len() >= max_idle {
            return;
        }
        if let Some(token) = budget.try_take() {
            idle.push(Warm { store, proxy, served, _token: token });
        }
    }

    /// Drops every idle instance (the tenant turned reuse off).
    pub fn clear(&self) {
        let dropped = std::mem::take(&mut *self.lock());
        drop(dropped);
    }

    /// Idle instances of this handler version.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is idle.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Warm>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_caps_idle_instances_and_tokens_give_their_place_back() {
        let budget = WarmBudget::new(2);
        let a = budget.try_take().unwrap();
        let b = budget.try_take().unwrap();
        assert!(budget.try_take().is_none());
        assert_eq!(budget.idle(), 2);
        drop(a);
        assert_eq!(budget.idle(), 1);
        let c = budget.try_take().unwrap();
        drop((b, c));
        assert_eq!(budget.idle(), 0);
        assert!(WarmBudget::new(0).try_take().is_none(), "a cap of 0 keeps nothing");
    }
}
