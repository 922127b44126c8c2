//! Building a snapshot's tenant entries ([`Rebuild`]): a tenant's gate
//! (kept while its limits are unchanged), its active handlers and canaries
//! (those served before reused, else loaded), and forgetting what a tenant
//! that is gone left behind. [`super::serving::Serving`] runs one per rebuild.

use std::collections::HashMap;
use std::sync::Arc;

use super::artifacts::{Artifacts, Compile};
use super::live::{Live, LiveCanary, TenantEntry};
use super::shared::Shared;
use super::store::{self, Canary, Store, StoreError, StoreResult};
use crate::admission::gate::new_gate;
use crate::sandbox::handler::Handler;

/// One rebuild's context: what it builds from.
pub(super) struct Rebuild<'a> {
    pub shared: &'a Shared,
    pub artifacts: &'a Artifacts,
    /// Live nodes: a new gate's share.
    pub live_nodes: usize,
    /// The snapshot being replaced.
    pub old: &'a Live,
    /// Handlers the change loaded already, matched by version.
    pub preloaded: &'a [Arc<Handler>],
    /// Whether a component not compiled yet may be compiled now.
    pub compile: Compile,
}

impl Rebuild<'_> {
    /// Forgets the tenants of `old` that are gone from the store, or were
    /// deleted and created again under their name (another incarnation):
    /// the new one starts afresh, and none of the old one's handlers is
    /// served to it.
    pub(super) fn forget_gone(&self, incarnations: &HashMap<&str, &str>) {
        for (name, entry) in self.old.tenants.iter() {
            if incarnations.get(name.as_str()) != Some(&&*entry.incarnation) {
                self.forget_tenant(name, entry);
            }
        }
    }

    /// The snapshot entry for a tenant row (handlers added later): the gate
    /// of the same incarnation is kept while its limits are unchanged.
    pub(super) fn tenant_entry(&self, row: store::TenantRow) -> (String, TenantEntry) {
        let limits = self.shared.defaults.with(&row.overrides);
        let previous = self.old.tenants.get(&row.name).filter(|e| *e.incarnation == *row.incarnation);
        let gate = match previous {
            Some(entry) if entry.gate.limits == limits => Arc::clone(&entry.gate),
            previous => {
                // Idle instances were made under the old limits (reuse,
                // memory, concurrency): none of those waiting now outlives the change.
                previous.into_iter().flat_map(TenantEntry::all_handlers).for_each(|h| h.warm.clear());
                Arc::new(new_gate(limits, previous.map(|e| &*e.gate), self.live_nodes))
            }
        };
        let weight = self.shared.weight(&row.name, &row.overrides);
        for model in self.shared.models.iter() {
            model.set_tenant_weight(&row.name, weight);
        }
        (row.name, TenantEntry { incarnation: row.incarnation.into(), gate, handlers: HashMap::new(), canaries: HashMap::new() })
    }

    /// The store is read in several statements: a tenant deleted (and
    /// perhaps created again) between the first and the last would mix two
    /// incarnations in one snapshot (the old one's handlers, the new one's
    /// keys). Such a tenant is left out of this snapshot and forgotten; the
    /// change bumped the generation, so the next sync brings it in whole.
    pub(super) fn drop_recreated_meanwhile(&self, db: &mut dyn Store, live: &mut Live) -> StoreResult<()> {
        let rows = db.tenants()?;
        let now = incarnations(rows.iter());
        let changed: Vec<String> = live
            .tenants
            .iter()
            .filter(|(name, entry)| now.get(name.as_str()) != Some(&&*entry.incarnation))
            .map(|(name, _)| name.clone())
            .collect();
        for name in changed {
            if let Some(entry) = live.tenants_mut().remove(&name) {
                tracing::info!(tenant = %name, "tenant deleted or created again while the snapshot was read; it follows at the next sync");
                self.forget_tenant(&name, &entry);
            }
            live.keys_mut().retain(|_, key| key.tenant != name);
        }
        Ok(())
    }

    /// Drops what the server keeps of a tenant that is gone (deleted, or
    /// deleted and created again): its batcher queues' state, its counters
    /// and its handlers' idle instances.
    pub(super) fn forget_tenant(&self, name: &str, entry: &TenantEntry) {
        for model in self.shared.models.iter() {
            model.remove_tenant(name);
        }
        for counters in &self.shared.counters {
            counters.forget_tenant(name);
        }
        for handler in entry.all_handlers() {
            handler.warm.clear();
        }
    }

    /// Puts `active` into `entry`: the handler served before or `preloaded`
    /// if the same version, else loaded. Returns its component when it must
    /// be compiled first (the version served before stays meanwhile).
    pub(super) fn serve_active(&self, db: &mut dyn Store, entry: &mut TenantEntry, active: store::ActiveHandler) -> Option<String> {
        let (old, preloaded, compile) = (self.old, self.preloaded, self.compile);
        let outgoing_http = entry.gate.limits.outgoing_http;
        let same = |h: &&Arc<Handler>| h.version == active.version && h.sha256 == active.sha256 && h.outgoing_http == outgoing_http;
        // What this tenant (this incarnation of it) served before.
        let served =
            old.tenants.get(&active.tenant).filter(|e| e.incarnation == entry.incarnation).and_then(|e| e.handlers.get(&active.handler));
        let reused = preloaded
            .iter()
            .find(|h| *h.tenant == *active.tenant && h.name == active.handler && same(h))
            .or_else(|| served.filter(same))
            .cloned();
        let loaded = match reused {
            Some(handler) => Ok(Some(handler)),
            None => self.artifacts.load_handler_if(db, &active, outgoing_http, compile).map(|h| h.map(Arc::new)),
        };
        // The version being served stays (if its grant did not change)
        // while the new one compiles, or when it cannot be loaded: a
        // change made elsewhere must not take the handler away.
        let kept = || served.filter(|h| h.outgoing_http == outgoing_http).cloned();
        let mut to_compile = None;
        let handler = match loaded {
            Ok(Some(handler)) => Some(handler),
            Ok(None) => {
                tracing::info!(tenant = %active.tenant, handler = %active.handler, version = active.version, "compiling a version deployed elsewhere; serving the previous one meanwhile");
                to_compile = Some(active.sha256.clone());
                kept()
            }
            Err(e) => {
                let kept = kept();
                tracing::error!(tenant = %active.tenant, handler = %active.handler, version = active.version, kept = ?kept.as_ref().map(|h| h.version), error = %e, "cannot load handler version");
                kept
            }
        };
        if let Some(handler) = handler {
            entry.handlers.insert(active.handler, handler);
        }
        to_compile
    }

    /// Puts a canary into `live` beside its handler's active version: the
    /// one served before if it is the same version (its counts kept while
    /// the active version is the same too), else loaded. Returns the
    /// component to compile when it is not ready yet
    /// (the canary waits; the active version serves all).
    pub(super) fn canary_into(
        &self,
        db: &mut dyn Store,
        live: &mut Live,
        (version, canary): (store::ActiveHandler, Canary),
    ) -> Option<String> {
        let (old, preloaded, compile) = (self.old, self.preloaded, self.compile);
        let entry = live.tenants_mut().get_mut(&version.tenant).filter(|e| e.handlers.contains_key(&version.handler))?;
        let outgoing_http = entry.gate.limits.outgoing_http;
        let same = |h: &Arc<Handler>| h.version == version.version && h.sha256 == version.sha256 && h.outgoing_http == outgoing_http;
        // The counts compare the canary with the version served beside it:
        // another active version starts both afresh.
        let stable = entry.handlers.get(&version.handler).map(|h| h.version);
        let before = old
            .tenants
            .get(&version.tenant)
            .filter(|e| e.incarnation == entry.incarnation && e.handlers.get(&version.handler).map(|h| h.version) == stable)
            .and_then(|e| e.canaries.get(&version.handler))
            .filter(|c| same(&c.handler));
        let (handler, counts) = match before {
            Some(c) => (Arc::clone(&c.handler), Arc::clone(&c.counts)),
            None => {
                let ready = preloaded.iter().find(|h| *h.tenant == *version.tenant && h.name == version.handler && same(h)).cloned();
                let handler = match ready {
                    Some(handler) => handler,
                    None => match self.artifacts.load_handler_if(db, &version, outgoing_http, compile) {
                        Ok(Some(handler)) => Arc::new(handler),
                        Ok(None) => return Some(version.sha256.clone()),
                        Err(e) => {
                            tracing::error!(tenant = %version.tenant, handler = %version.handler, version = version.version, error = %e, "cannot load canary version");
                            return None;
                        }
                    },
                };
                (handler, Arc::default())
            }
        };
        entry.canaries.insert(version.handler.clone(), Arc::new(LiveCanary { handler, canary, counts }));
        None
    }
}

/// `tenant`'s row, `None` if there is no such tenant.
pub(super) fn tenant_row(db: &mut dyn Store, tenant: &str) -> StoreResult<Option<store::TenantRow>> {
    match db.tenant(tenant) {
        Ok(row) => Ok(Some(row)),
        Err(StoreError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Each tenant row's incarnation, by name.
pub(super) fn incarnations<'a>(rows: impl Iterator<Item = &'a store::TenantRow>) -> HashMap<&'a str, &'a str> {
    rows.map(|r| (r.name.as_str(), r.incarnation.as_str())).collect()
}
