//! Compiled components: loading an active version (its cached artifact
//! when present and intact, else compiled again and cached), and the
//! artifact cache's key.

use std::hash::{Hash, Hasher};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use super::blobs::Blobs;

use super::store::{ActiveHandler, Store, StoreError, StoreResult};
use super::{ControlPlane, keys, validate};
use crate::handlers::Handler;

impl ControlPlane {
    pub(super) fn load_handler(&self, db: &mut dyn Store, active: &ActiveHandler, outgoing_http: bool) -> StoreResult<Handler> {
        let component = self.load_component(db, &active.sha256)?;
        validate::check_imports(self.sandbox.engine(), &component).map_err(StoreError::Conflict)?;
        Handler::link(self.sandbox.linker(), &component, &active.tenant, &active.handler, active.version, outgoing_http)
            .map_err(|e| StoreError::Internal(anyhow::anyhow!(e)))
    }

    /// The compiled component: this node's cached artifact when present and
    /// intact, else compiled from the store's verified bytes (and cached).
    pub(super) fn load_component(&self, db: &mut dyn Store, sha256: &str) -> StoreResult<Component> {
        let engine = self.sandbox.engine();
        match self.blobs.artifact(sha256, &self.engine_id) {
            Ok(Some(bytes)) => match deserialize(engine, &bytes) {
                Ok(component) => return Ok(component),
                Err(e) => tracing::warn!(error = %e, "precompiled artifact unusable; compiling again"),
            },
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "precompiled artifact corrupt; compiling again"),
        }
        let bytes = db.component(sha256)?;
        let component = Component::new(engine, &bytes).map_err(|e| anyhow::anyhow!("component {sha256}: {e:#}"))?;
        // The cache only saves the next compile: a full disk must not stop serving.
        if let Err(e) = write_artifact(&self.blobs, &self.engine_id, sha256, &component) {
            tracing::warn!(error = %format!("{e:#}"), "precompiled artifact not cached");
        }
        Ok(component)
    }
}

/// Serialises `component` into this node's artifact cache.
pub(super) fn write_artifact(blobs: &Blobs, engine_id: &str, sha256: &str, component: &Component) -> anyhow::Result<()> {
    let artifact = component.serialize().map_err(|e| anyhow::anyhow!("serialize: {e}"))?;
    blobs.put_artifact(sha256, engine_id, &artifact)
}

/// Loads a precompiled artifact.
#[allow(unsafe_code, reason = "wasmtime requires it to load precompiled code")]
fn deserialize(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: the bytes come from `Component::serialize` of an engine with
    // the same compatibility hash (it names the file), were written
    // atomically by this node into its own data directory (never received
    // from the store or another node), and their SHA-256 matches the one
    // recorded beside them; wasmtime re-checks version and settings in the header.
    unsafe { Component::deserialize(engine, bytes) }
}

/// A short, stable identity of the engine's code-generation settings and
/// version: precompiled artifacts are keyed by it, so changing either
/// recompiles instead of loading stale code.
pub fn engine_id(engine: &Engine) -> String {
    struct Sha(Sha256);
    impl Hasher for Sha {
        fn write(&mut self, bytes: &[u8]) {
            self.0.update(bytes);
        }
        fn finish(&self) -> u64 {
            0
        }
    }
    let mut hasher = Sha(Sha256::new());
    engine.precompile_compatibility_hash().hash(&mut hasher);
    keys::hex(&hasher.0.finalize()[..8])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineLimits, build};

    #[test]
    fn artifacts_are_keyed_by_the_engine_configuration() {
        let limits = EngineLimits { max_instances: 2, memory_limit: 16 << 20 };
        let a = engine_id(&build(limits).unwrap());
        assert_eq!(a, engine_id(&build(limits).unwrap()), "stable for the same configuration");
        assert_eq!(a.len(), 16);
        let mut other = wasmtime::Config::new();
        other.wasm_component_model(true);
        assert_ne!(a, engine_id(&Engine::new(&other).unwrap()), "another configuration, another key");
    }
}
