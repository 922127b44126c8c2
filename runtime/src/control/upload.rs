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

/// The tenants with an upload in progress on this node: one at a time
/// each, so that no tenant holds more than one of the compile pool's
/// places, however many it sends at once.
#[derive(Default)]
pub(super) struct Uploading(std::sync::Mutex<std::collections::HashSet<String>>);

impl Uploading {
    /// `tenant`'s place until the guard drops, or a refusal while it has one.
    pub fn begin(&self, tenant: &str) -> StoreResult<UploadGuard<'_>> {
        if !self.lock().insert(tenant.to_owned()) {
            return Err(StoreError::TooMany(format!("an upload of tenant {tenant:?} is in progress on this node; one at a time")));
        }
        Ok(UploadGuard { uploading: self, tenant: tenant.to_owned() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A tenant's upload in progress (see [`Uploading`]).
pub(super) struct UploadGuard<'a> {
    uploading: &'a Uploading,
    tenant: String,
}

impl Drop for UploadGuard<'_> {
    fn drop(&mut self) {
        self.uploading.lock().remove(&self.tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_uploads_one_at_a_time_others_meanwhile() {
        let uploading = Uploading::default();
        let first = uploading.begin("acme").unwrap();
        assert!(matches!(uploading.begin("acme"), Err(StoreError::TooMany(_))), "a second of the same tenant waits");
        let other = uploading.begin("globex");
        assert!(other.is_ok(), "another tenant goes on");
        drop(first);
        assert!(uploading.begin("acme").is_ok(), "the place comes back");
    }
}
