//! Compiled components: loading an active version (this node's cached
//! artifact when present and intact; else the artifact another node of the
//! cluster compiled, when its MAC proves a node made it; else compiled
//! here, cached and offered to the others), the artifact cache's key, and
//! the key that authenticates shared artifacts.
//!
//! Why share artifacts: compiling a component takes from a second (Rust)
//! to ten (Python) on a busy node, and every node would otherwise compile
//! each deploy again before serving it. Why a MAC: an artifact is native
//! code, so whoever can write the database must not be able to make the
//! nodes run code of their choosing; only a holder of the cluster's secret
//! (the admin token every node is given) can make an artifact they load.

use std::hash::{Hash, Hasher};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use super::blobs::Blobs;

use super::store::{ActiveHandler, SharedArtifact, Store, StoreError, StoreResult};
use super::{ControlPlane, keys, validate};
use crate::handlers::Handler;

/// Signs and checks the artifacts nodes share through the store: a key
/// derived from the cluster's secret, so the same secret on every node
/// gives the same key, and the secret itself is never what is used.
#[derive(Clone)]
pub struct ArtifactKey([u8; 32]);

impl std::fmt::Debug for ArtifactKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ArtifactKey(..)")
    }
}

impl ArtifactKey {
    /// The key for `secret` (the admin token).
    pub fn derive(secret: &str) -> Self {
        let mut mac = Self::hmac(secret.as_bytes());
        mac.update(b"facegate shared artifact key v1");
        Self(mac.finalize().into_bytes().into())
    }

    /// An artifact of `component_sha256` for `engine`, sealed with this key.
    pub fn seal(&self, engine: &str, component_sha256: &str, bytes: Vec<u8>) -> SharedArtifact {
        let mac = keys::hex(&self.tag(engine, component_sha256, &bytes).finalize().into_bytes());
        SharedArtifact { engine: engine.to_owned(), bytes, mac }
    }

    /// Whether `artifact` was sealed with this key for this component (constant time).
    pub fn verify(&self, component_sha256: &str, artifact: &SharedArtifact) -> bool {
        let Some(tag) = keys::digest_from_hex(&artifact.mac) else { return false };
        self.tag(&artifact.engine, component_sha256, &artifact.bytes).verify_slice(&tag).is_ok()
    }

    fn tag(&self, engine: &str, component_sha256: &str, bytes: &[u8]) -> Hmac<Sha256> {
        let mut mac = Self::hmac(&self.0);
        // Lengths first, so no two (engine, component) pairs read alike.
        for part in [engine.as_bytes(), component_sha256.as_bytes()] {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac.update(bytes);
        mac
    }

    fn hmac(key: &[u8]) -> Hmac<Sha256> {
        // HMAC takes a key of any length.
        <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC accepts every key length"))
    }
}

/// Whether loading a handler may compile its component there and then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Compile {
    /// Yes: the caller waits (startup, this node's own admin calls).
    Now,
    /// No: a component not compiled yet is left to [`ControlPlane::precompile`]
    /// (the sync thread), so a compile never holds back the rest of a change.
    Later,
}

impl ControlPlane {
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

    fn link(&self, component: &Component, active: &ActiveHandler, outgoing_http: bool) -> StoreResult<Handler> {
        validate::check_imports(self.sandbox.engine(), component).map_err(StoreError::Conflict)?;
        Handler::link(self.sandbox.linker(), component, &active.tenant, &active.handler, active.version, &active.sha256, outgoing_http)
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
    /// the others; the next sync serves it (see [`Self::recheck_soon`]).
    /// Runs on the sync's compile thread. [`StoreError::Invalid`]: this node
    /// cannot compile or cache it, and trying again will not help;
    /// anything else is the store's and may pass.
    pub fn precompile(&self, sha256: &str) -> StoreResult<()> {
        // The compiler's connection may sit idle for hours, and a server or
        // pooler may have closed it meanwhile: one fresh try before failing.
        let bytes = match self.compile_db().component(sha256) {
            Err(StoreError::Unavailable(_)) => self.compile_db().component(sha256)?,
            read => read?,
        };
        let (_, artifact) = self.compile_component(sha256, &bytes).map_err(|e| StoreError::Invalid(e.to_string()))?;
        // A compile the cache cannot keep would be compiled again by every sync.
        let artifact =
            artifact.ok_or_else(|| StoreError::Invalid(format!("component {sha256} compiled, but its artifact cannot be cached")))?;
        if self.artifact_key.is_some() {
            self.share(&mut **self.compile_db(), sha256, artifact);
        }
        Ok(())
    }

    /// Makes the next sync rebuild the snapshot though the store did not
    /// change: a component it waited for has been compiled (or may be now).
    pub fn recheck_soon(&self) {
        self.recheck.store(true, std::sync::atomic::Ordering::Release);
    }

    /// This node's cached artifact, else one another node shared; `None` means compiling.
    fn compiled_component(&self, db: &mut dyn Store, sha256: &str) -> Option<Component> {
        match self.blobs.artifact(sha256, &self.engine_id) {
            Ok(Some(bytes)) => match deserialize(self.sandbox.engine(), &bytes) {
                Ok(component) => return Some(component),
                Err(e) => tracing::warn!(error = %e, "precompiled artifact unusable; compiling again"),
            },
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "precompiled artifact corrupt; compiling again"),
        }
        self.shared_component(db, sha256)
    }

    /// Compiles verified component bytes and caches the artifact; returns
    /// the artifact too, unless the cache could not keep it.
    fn compile_component(&self, sha256: &str, bytes: &[u8]) -> StoreResult<(Component, Option<Vec<u8>>)> {
        let component = Component::new(self.sandbox.engine(), bytes).map_err(|e| anyhow::anyhow!("component {sha256}: {e:#}"))?;
        // The cache only saves the next compile: a full disk must not stop serving.
        let artifact = write_artifact(&self.blobs, &self.engine_id, sha256, &component)
            .map_err(|e| tracing::warn!(error = %format!("{e:#}"), "precompiled artifact not cached"))
            .ok();
        Ok((component, artifact))
    }

    /// Offers what this node compiled to the others, sealed (best effort;
    /// nothing without a key). It replaces what the store had for this
    /// engine: that was unusable here, or this node would not have compiled.
    fn share(&self, db: &mut dyn Store, sha256: &str, artifact: Vec<u8>) {
        let Some(key) = &self.artifact_key else { return };
        if let Err(e) = db.share_artifact(sha256, &key.seal(&self.engine_id, sha256, artifact)) {
            tracing::debug!(error = %e, "precompiled artifact not shared");
        }
    }

    /// The artifact another node compiled for this engine, if the store has
    /// one and its MAC holds; cached here. Anything else means compiling.
    fn shared_component(&self, db: &mut dyn Store, sha256: &str) -> Option<Component> {
        let key = self.artifact_key.as_ref()?;
        let artifact = match db.shared_artifact(sha256, &self.engine_id) {
            Ok(found) => found?,
            Err(e) => {
                tracing::debug!(error = %e, "shared artifacts unavailable; compiling");
                return None;
            }
        };
        if !key.verify(sha256, &artifact) {
            tracing::warn!(
                component = sha256,
                "a shared artifact's MAC does not hold (another secret, or written by someone else); compiling"
            );
            return None;
        }
        let component = deserialize(self.sandbox.engine(), &artifact.bytes)
            .map_err(|e| tracing::warn!(error = %e, "shared artifact unusable; compiling"))
            .ok()?;
        if let Err(e) = self.blobs.put_artifact(sha256, &self.engine_id, &artifact.bytes) {
            tracing::warn!(error = %format!("{e:#}"), "precompiled artifact not cached");
        }
        Some(component)
    }
}

/// Serialises `component` into this node's artifact cache; returns the artifact.
pub(super) fn write_artifact(blobs: &Blobs, engine_id: &str, sha256: &str, component: &Component) -> anyhow::Result<Vec<u8>> {
    let artifact = component.serialize().map_err(|e| anyhow::anyhow!("serialize: {e}"))?;
    blobs.put_artifact(sha256, engine_id, &artifact)?;
    Ok(artifact)
}

/// Loads a precompiled artifact.
#[allow(unsafe_code, reason = "wasmtime requires it to load precompiled code")]
fn deserialize(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: the bytes come from `Component::serialize` of an engine with
    // the same compatibility hash (it names the file or the store's row):
    // either this node wrote them atomically into its own data directory
    // and their SHA-256 matches the one recorded beside them, or another
    // node of the cluster made them and their HMAC, under a key derived
    // from the secret only nodes hold, was verified; wasmtime re-checks
    // version and settings in the header.
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
    fn a_shared_artifact_is_trusted_only_as_sealed_by_the_same_secret() {
        let key = ArtifactKey::derive("the cluster's admin token");
        let sealed = key.seal("engine-a", "c0ffee", b"native code".to_vec());
        assert!(key.verify("c0ffee", &sealed));
        assert!(ArtifactKey::derive("the cluster's admin token").verify("c0ffee", &sealed), "every node derives the same key");
        assert!(!ArtifactKey::derive("another token").verify("c0ffee", &sealed), "another secret");
        assert!(!key.verify("c0ffef", &sealed), "the artifact of another component");
        let tampered = |change: &dyn Fn(&mut SharedArtifact)| {
            let mut copy = sealed.clone();
            change(&mut copy);
            key.verify("c0ffee", &copy)
        };
        assert!(!tampered(&|a| a.bytes[0] ^= 1), "changed code");
        assert!(!tampered(&|a| a.bytes.push(0)), "code appended");
        assert!(!tampered(&|a| a.engine = "engine-b".into()), "relabelled for another engine");
        assert!(!tampered(&|a| a.mac = "00".repeat(32)), "a made-up MAC");
        assert!(!tampered(&|a| a.mac = "not hex".into()), "not a MAC at all");
    }

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
