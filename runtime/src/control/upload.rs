//! The CPU-heavy part of a deploy, run on the compile pool (its own thread,
//! at a lower priority, under a time budget): compiling, validating and
//! linking the component, hashing its bytes and caching its precompiled
//! artifact. What is left for the caller: storing the bytes with the row
//! that makes the version visible, under the store's lock.

use std::sync::Arc;

use bytes::Bytes;
use wasmtime::component::Component;

use super::blobs::ArtifactCache;
use super::components::write_artifact;
use super::compose;
use super::keys::sha256_hex;
use super::seal::ArtifactKey;
use super::store::{SharedArtifact, StoreError, StoreResult};
use super::validate;
use crate::sandbox::Sandbox;
use crate::sandbox::handler::Handler;

/// One upload, owned, so it can move to a compile thread.
pub(super) struct Upload {
    pub sandbox: Arc<Sandbox>,
    /// This node's artifact cache, where the compiled upload goes.
    pub cache: ArtifactCache,
    pub engine_id: String,
    pub tenant: String,
    pub handler: String,
    pub outgoing_http: bool,
    pub bytes: Bytes,
    /// The pipeline component, linked into handlers that import it.
    pub pipeline: Option<Arc<[u8]>>,
    /// Seals the artifact for the other nodes, if they share them.
    pub artifact_key: Option<ArtifactKey>,
}

/// A validated, linked, stored upload, not yet visible.
pub(super) struct Prepared {
    /// Linked at version 0; the caller sets the version the row gets.
    pub linked: Handler,
    /// What is stored and runs: the upload, or the upload with the pipeline linked in.
    pub component: Bytes,
    /// Its SHA-256 (hex), its name in the store.
    pub sha256: String,
    /// Its artifact, sealed for the other nodes (stored with the version).
    pub shared: Option<SharedArtifact>,
}

impl Upload {
    /// Links the pipeline in if the upload imports it; compiles, validates
    /// and links the result; caches its artifact.
    pub fn prepare(self) -> StoreResult<Prepared> {
        let engine = self.sandbox.engine();
        let bytes = self.with_pipeline()?;
        let component =
            Component::new(engine, &bytes).map_err(|e| StoreError::Invalid(format!("the component does not compile: {e:#}")))?;
        validate::check_imports(engine, &component).map_err(StoreError::Invalid)?;
        validate::check_exports(engine, &component).map_err(StoreError::Invalid)?;
        // Link before storing anything: a component that cannot run is refused.
        let linker = self.sandbox.linker();
        let sha256 = sha256_hex(&bytes);
        let linked =
            Handler::link(linker, &component, &self.tenant, &self.handler, 0, &sha256, self.outgoing_http).map_err(StoreError::Invalid)?;
        // The cache is this node's own; nothing refers to it until a version does.
        let artifact = write_artifact(&self.cache, &self.engine_id, &sha256, &component)?;
        // Sealed here, on the compile thread: an HMAC over megabytes is CPU work too.
        let shared = self.artifact_key.as_ref().map(|key| key.seal(&self.engine_id, &sha256, artifact));
        Ok(Prepared { linked, component: bytes, sha256, shared })
    }

    fn with_pipeline(&self) -> StoreResult<Bytes> {
        if !compose::imports_pipeline(&self.bytes) {
            return Ok(self.bytes.clone());
        }
        let pipeline = self.pipeline.as_ref().ok_or_else(|| {
            StoreError::Invalid(format!(
                "the component imports `{}…`, but this gateway has no pipeline component (--pipeline-component)",
                compose::PIPELINE_INTERFACE
            ))
        })?;
        compose::plug_pipeline(&self.bytes, pipeline).map(Bytes::from).map_err(StoreError::Invalid)
    }
}
