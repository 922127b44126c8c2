//! The CPU-heavy part of a deploy, run on the compile pool (its own thread,
//! at a lower priority, under a time budget): compiling, validating and
//! linking the component, hashing its bytes and caching its precompiled
//! artifact. What is left for the caller: storing the bytes with the row
//! that makes the version visible, under the store's lock.

use std::sync::Arc;

use bytes::Bytes;
use wasmtime::component::Component;

use super::artifacts::write_artifact;
use super::blobs::ArtifactCache;
use super::compose;
use super::keys::sha256_hex;
use super::seal::ArtifactKey;
use super::store::{SharedArtifact, StoreError, StoreResult};
use super::validate;
use crate::admission::memory::Charge;
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
    /// Whether `bytes` import the pipeline (see [`validate::check_interface`]).
    pub imports_pipeline: bool,
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
        if !self.imports_pipeline {
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

/// What a tenant's change in progress on this node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// A new version: its body read, linked, compiled and stored.
    Upload,
    /// A version made active or a canary (activate, rollback, promote, abort).
    Release,
    /// A key created or revoked.
    Keys,
}

impl Change {
    fn described(self) -> &'static str {
        match self {
            Change::Upload => "an upload",
            Change::Release => "an activation",
            Change::Keys => "a key change",
        }
    }
}

/// The tenants with a change in progress on this node: one at a time each,
/// taken before the change's body is read, so that no tenant holds more
/// than one of the compile pool's places, one upload's memory, or the
/// store's writer more than once at a time, however many calls it sends at once.
#[derive(Default, Clone)]
pub struct Changes(Arc<std::sync::Mutex<std::collections::HashMap<String, Change>>>);

impl Changes {
    /// `tenant`'s place for `change` until the [`ChangePlace`] drops, or a
    /// refusal ([`StoreError::TooMany`]) while it has a change in progress.
    pub fn begin(&self, tenant: &str, change: Change) -> StoreResult<ChangePlace> {
        let mut changes = self.lock();
        if let Some(holding) = changes.get(tenant) {
            let code = if change == Change::Upload { "upload_in_progress" } else { "change_in_progress" };
            let message = format!("{} of tenant {tenant:?} is in progress on this node; one change at a time", holding.described());
            return Err(StoreError::TooMany { code, message });
        }
        changes.insert(tenant.to_owned(), change);
        Ok(ChangePlace { changes: self.clone(), tenant: tenant.to_owned() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Change>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A tenant's change in progress (see [`Changes`]); owned, so it can move
/// with an upload onto a compile thread and outlive a caller that gave up.
pub struct ChangePlace {
    changes: Changes,
    tenant: String,
}

impl ChangePlace {
    /// Whose place it is.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }
}

impl Drop for ChangePlace {
    fn drop(&mut self) {
        self.changes.lock().remove(&self.tenant);
    }
}

/// What an upload holds on this node from before its body is read until it
/// is stored or refused: its tenant's place and its memory charge (its body,
/// then the compile's estimate). Both go with the compile job: a compile
/// running past the upload's budget keeps them until it ends.
pub struct UploadHold {
    /// The tenant's one change place.
    pub place: ChangePlace,
    /// The upload's charge to the node's memory budget.
    pub memory: Charge,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_changes_one_thing_at_a_time_others_meanwhile() {
        let changes = Changes::default();
        let first = changes.begin("acme", Change::Upload).unwrap();
        let code = |r: StoreResult<ChangePlace>| match r {
            Err(StoreError::TooMany { code, message }) => (code, message),
            _ => panic!("not refused"),
        };
        let (refused, message) = code(changes.begin("acme", Change::Upload));
        assert_eq!(refused, "upload_in_progress", "a second upload of the same tenant waits");
        assert!(message.contains("an upload"), "{message}");
        assert_eq!(code(changes.begin("acme", Change::Keys)).0, "change_in_progress", "so does any other change of it");
        let other = changes.begin("globex", Change::Release);
        assert!(other.is_ok(), "another tenant goes on");
        drop(first);
        assert!(changes.begin("acme", Change::Keys).is_ok(), "the place comes back");
    }
}
