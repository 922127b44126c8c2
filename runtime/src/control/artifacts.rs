//! The control plane's part for compiled components ([`Artifacts`]): loading an active version (this node's cached
//! artifact when its MAC holds; else the artifact another node of the
//! cluster compiled, when its MAC proves a holder of the artifact key made
//! it; else compiled here, cached and offered to the others) and the engine
//! id that names cached and shared artifacts. The keys that seal them are
//! in [`super::seal`].
//!
//! Why share artifacts: compiling a component takes from a second (Rust)
//! to ten (Python) on a busy node, and every node would otherwise compile
//! each deploy again before serving it. Why a MAC: an artifact is native
//! code, so whoever can write the database (or this node's data directory)
//! must not be able to make the nodes run code of their choosing; only a
//! holder of the artifact key (`--artifact-key`, a secret of its own: not
//! the admin token, which operators and their tools hold) can make a shared
//! artifact they load, and only a holder of this node's cache key a cached one.

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use super::blobs::{ArtifactCache, Unsealed};

use super::shared::Shared;
use super::store::{ActiveHandler, SharedArtifact, Store, StoreError, StoreResult};
use super::{keys, validate};
use crate::sandbox::handler::Handler;

/// Whom the node's memory budget charges for compiling a component
/// deployed through another node (no tenant's call waits for it).
const PRECOMPILE_OWNER: &str = "(precompile)";

/// Whether loading a handler may compile its component there and then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Compile {
    /// Yes: the caller waits (startup, this node's own admin calls).
    Now,
    /// No: a component not compiled yet is left to [`Artifacts::precompile`]
    /// (the sync thread), so a compile never holds back the rest of a change.
    Later,
}

/// Where this node's compiled components came from, counted since start
/// (`/metrics`): compiled here, or loaded from an artifact another node
/// shared through the store. Cached artifacts of this node count as neither.
#[derive(Debug, Default)]
struct Sources {
    compiled: AtomicU64,
    shared: AtomicU64,
}

/// The control plane's part for compiled components (see the module docs).
pub struct Artifacts {
    shared: Arc<Shared>,
    sources: Sources,
}

impl Artifacts {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared, sources: Sources::default() }
    }

    /// Components this node compiled, and artifacts of other nodes it
    /// loaded instead of compiling, since it started.
    pub fn sources(&self) -> (u64, u64) {
        (self.sources.compiled.load(Ordering::Relaxed), self.sources.shared.load(Ordering::Relaxed))
    }

    /// Counts a component compiled here (an upload's compile among them).
    pub(super) fn compiled_here(&self) {
        self.sources.compiled.fetch_add(1, Ordering::Relaxed);
    }

    /// The active version `active`, loaded and linked (compiled here if no artifact is at hand).
    pub(super) fn load_handler(&self, db: &mut dyn Store, active: &ActiveHandler, outgoing_http: bool) -> StoreResult<Handler> {
        let component = self.load_component(db, &active.sha256)?;
        self.link(&component, active, outgoing_http)
    }

    /// [`Self::load_handler`] under `compile`: `None` when the component must be compiled first and that is for later.
    pub(super) fn load_handler_if(
        &self,
        db: &mut dyn Store,
        active: &ActiveHandler,
        outgoing_http: bool,
        compile: Compile,
    ) -> StoreResult<Option<Handler>> {
        if compile == Compile::Now {
            return self.load_handler(db, active, outgoing_http).map(Some);
        }
        match self.compiled_component(db, &active.sha256) {
            Some(component) => self.link(&component, active, outgoing_http).map(Some),
            None => Ok(None),
        }
    }

    pub(super) fn link(&self, component: &Component, active: &ActiveHandler, outgoing_http: bool) -> StoreResult<Handler> {
        validate::check_imports(self.shared.sandbox.engine(), component).map_err(StoreError::Conflict)?;
        Handler::link(
            self.shared.sandbox.linker(),
            component,
            &active.tenant,
            &active.handler,
            active.version,
            &active.sha256,
            outgoing_http,
        )
        .map(|handler| Handler { guest_path: active.guest_path, ..handler })
        .map_err(|e| StoreError::Internal(anyhow::anyhow!(e)))
    }

    /// The compiled component (see the module docs for where it comes from).
    pub(super) fn load_component(&self, db: &mut dyn Store, sha256: &str) -> StoreResult<Component> {
        if let Some(component) = self.compiled_component(db, sha256) {
            return Ok(component);
        }
        let (component, artifact) = self.compile_component(sha256, &db.component(sha256)?)?;
        if let Some(artifact) = artifact {
            self.share(db, sha256, artifact);
        }
        Ok(component)
    }

    /// Compiles a component another node deployed into this node's cache,
    /// without holding the store's lock while it compiles, and offers it to
    /// the others; the next sync serves it (see [`super::serving::Serving::recheck_soon`]).
    /// Runs on the sync's compile thread. [`StoreError::Invalid`]: this node
    /// cannot compile or cache it, and trying again will not help;
    /// anything else is the store's and may pass.
    pub fn precompile(&self, sha256: &str) -> StoreResult<()> {
        // The compiler's connection may sit idle for hours, and a server or
        // pooler may have closed it meanwhile: one fresh try before failing.
        let bytes = match self.shared.compile_db().component(sha256) {
            Err(StoreError::Unavailable(_)) => self.shared.compile_db().component(sha256)?,
            read => read?,
        };
        // Charged to the node as a compile of its size; refused (the node is
        // short of memory now), it is asked for again by a later sync.
        let node: Arc<str> = Arc::from(PRECOMPILE_OWNER);
        let _compiling = self
            .shared
            .sandbox
            .memory()
            .charge(&node, crate::sandbox::compile::memory_estimate(bytes.len()))
            .map_err(|e| StoreError::NoMemory(format!("{e}: compiling {sha256} later")))?;
        let (_, artifact) = self.compile_component(sha256, &bytes).map_err(|e| StoreError::Invalid(e.to_string()))?;
        // A compile the cache cannot keep would be compiled again by every sync.
        let artifact =
            artifact.ok_or_else(|| StoreError::Invalid(format!("component {sha256} compiled, but its artifact cannot be cached")))?;
        if self.shared.artifact_key.is_some() {
            self.share(&mut **self.shared.compile_db(), sha256, artifact);
        }
        Ok(())
    }

    /// The compiled component of `sha256`: this node's artifact or one
    /// another node shared, else compiled on the compile pool (its budget
    /// and its bound on pending work), then cached and shared as any
    /// compile. The store's lock is held only for the store's reads and
    /// writes: checking a MAC and loading native code (a large component's
    /// artifact is tens of MB) run outside it, as compiling does, so other
    /// admin calls and the sync go on meanwhile.
    pub(super) fn compile_off_lock(&self, sha256: &str) -> StoreResult<Component> {
        if let Some(component) = self.cached_component(sha256) {
            return Ok(component);
        }
        let shared = self.fetch_shared(&mut **self.shared.db(), sha256);
        if let Some(component) = shared.and_then(|artifact| self.load_shared(sha256, &artifact)) {
            return Ok(component);
        }
        let bytes = self.shared.db().component(sha256)?;
        let engine = self.shared.sandbox.engine().clone();
        let compiled = self.shared.compile.run(move || Component::new(&engine, &bytes)).map_err(super::shared::compile_refusal)?;
        let component = compiled.map_err(|e| anyhow::anyhow!("component {sha256}: {e:#}"))?;
        self.compiled_here();
        match write_artifact(&self.shared.cache, &self.shared.engine_id, sha256, &component) {
            Ok(artifact) => self.share(&mut **self.shared.db(), sha256, artifact),
            // The cache only saves the next compile: a full disk must not stop serving.
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "precompiled artifact not cached"),
        }
        Ok(component)
    }

    /// This node's cached artifact, else one another node shared; `None` means compiling.
    fn compiled_component(&self, db: &mut dyn Store, sha256: &str) -> Option<Component> {
        self.cached_component(sha256).or_else(|| self.shared_component(db, sha256))
    }

    /// This node's cached artifact, if its MAC holds and it loads (no store involved).
    fn cached_component(&self, sha256: &str) -> Option<Component> {
        match self.shared.cache.get(sha256, &self.shared.engine_id) {
            Ok(Some(bytes)) => match deserialize(self.shared.sandbox.engine(), &bytes) {
                Ok(component) => return Some(component),
                Err(e) => tracing::warn!(error = %e, "precompiled artifact unusable; compiling again"),
            },
            Ok(None) => {}
            Err(e) if e.downcast_ref::<Unsealed>().is_some() => {
                tracing::warn!(component = sha256, error = %e, "cached artifact refused: its MAC does not hold; discarded, compiling again");
                self.shared.cache.discard(sha256, &self.shared.engine_id);
            }
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "cached artifact unreadable; compiling again"),
        }
        None
    }

    /// Compiles verified component bytes and caches the artifact; returns
    /// the artifact too, unless the cache could not keep it.
    fn compile_component(&self, sha256: &str, bytes: &[u8]) -> StoreResult<(Component, Option<Vec<u8>>)> {
        let component = Component::new(self.shared.sandbox.engine(), bytes).map_err(|e| anyhow::anyhow!("component {sha256}: {e:#}"))?;
        self.compiled_here();
        // The cache only saves the next compile: a full disk must not stop serving.
        let artifact = write_artifact(&self.shared.cache, &self.shared.engine_id, sha256, &component)
            .map_err(|e| tracing::warn!(error = %format!("{e:#}"), "precompiled artifact not cached"))
            .ok();
        Ok((component, artifact))
    }

    /// Offers what this node compiled to the others, sealed (best effort;
    /// nothing without a key). It replaces what the store had for this
    /// engine: that was unusable here, or this node would not have compiled.
    fn share(&self, db: &mut dyn Store, sha256: &str, artifact: Vec<u8>) {
        let Some(key) = &self.shared.artifact_key else { return };
        if let Err(e) = db.share_artifact(sha256, &key.seal(&self.shared.engine_id, sha256, artifact)) {
            tracing::debug!(error = %e, "precompiled artifact not shared");
        }
    }

    /// The artifact another node compiled for this engine, if the store has
    /// one and its MAC holds; cached here. Anything else means compiling.
    fn shared_component(&self, db: &mut dyn Store, sha256: &str) -> Option<Component> {
        let artifact = self.fetch_shared(db, sha256)?;
        self.load_shared(sha256, &artifact)
    }

    /// The store's artifact of `sha256` for this engine, unchecked; none
    /// without an artifact key (nothing shared could be verified).
    fn fetch_shared(&self, db: &mut dyn Store, sha256: &str) -> Option<SharedArtifact> {
        // Without the key nothing shared could be verified: not even fetched.
        self.shared.artifact_key.as_ref()?;
        match db.shared_artifact(sha256, &self.shared.engine_id) {
            Ok(found) => found,
            Err(e) => {
                tracing::debug!(error = %e, "shared artifacts unavailable; compiling");
                None
            }
        }
    }

    /// Loads a fetched shared artifact if its MAC holds, and caches it here.
    fn load_shared(&self, sha256: &str, artifact: &SharedArtifact) -> Option<Component> {
        let key = self.shared.artifact_key.as_ref()?;
        if !key.verify(sha256, artifact) {
            tracing::warn!(
                component = sha256,
                "a shared artifact's MAC does not hold (another artifact key, sealed before --artifact-key, or written by someone else); compiling"
            );
            return None;
        }
        let component = deserialize(self.shared.sandbox.engine(), &artifact.bytes)
            .map_err(|e| tracing::warn!(error = %e, "shared artifact unusable; compiling"))
            .ok()?;
        self.sources.shared.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.shared.cache.put(sha256, &self.shared.engine_id, &artifact.bytes) {
            tracing::warn!(error = %format!("{e:#}"), "precompiled artifact not cached");
        }
        Some(component)
    }
}

/// Serialises `component` into this node's artifact cache; returns the artifact.
pub(super) fn write_artifact(cache: &ArtifactCache, engine_id: &str, sha256: &str, component: &Component) -> anyhow::Result<Vec<u8>> {
    let artifact = component.serialize().map_err(|e| anyhow::anyhow!("serialize: {e}"))?;
    cache.put(sha256, engine_id, &artifact)?;
    Ok(artifact)
}

/// Loads a precompiled artifact.
#[allow(unsafe_code, reason = "wasmtime requires it to load precompiled code")]
fn deserialize(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: the bytes come from `Component::serialize` of an engine with
    // the same compatibility hash (it names the file or the store's row):
    // either this node wrote them atomically into its own data directory
    // (owned by this user, mode 0700) and their HMAC under its cache key
    // was verified, or another node of the cluster made them and their
    // HMAC, under a key derived from the artifact key only nodes hold, was
    // verified; wasmtime re-checks version and settings in the header.
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
    use crate::sandbox::engine::{EngineLimits, build};

    #[test]
    fn artifacts_are_keyed_by_the_engine_configuration() {
        let limits = EngineLimits { max_instances: 2, memory_limit: 16 << 20, keep_resident: 0 };
        let a = engine_id(&build(limits).unwrap());
        assert_eq!(a, engine_id(&build(limits).unwrap()), "stable for the same configuration");
        assert_eq!(a.len(), 16);
        let mut other = wasmtime::Config::new();
        other.wasm_component_model(true);
        assert_ne!(a, engine_id(&Engine::new(&other).unwrap()), "another configuration, another key");
    }
}
