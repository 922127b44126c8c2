//! The control plane's part for the model repository ([`ModelRepository`]):
//! the operator adds an ONNX model of CenterFace's contract under a name
//! (each add a new version, active at once), activates a version, removes
//! a model; the store keeps the files, so every node of a cluster serves
//! the same set. A model must pass the accuracy gate (`serve::gate`) to be
//! added, unless forced. Serving follows the store ([`reconcile`], at every
//! rebuild of the snapshot): a model added is served on demand (loaded at
//! its first call, from this node's file cache, fetched from the store when
//! absent), one removed is unknown to handlers at once. The models a node
//! serves from its flags (`centerface`, `--extra-model`) are not the
//! repository's: their names are refused.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use facegate_host_gpu::{Arbiter, Loaded, ModelLoader, ModelSpec};
use serde::Serialize;
use serde_json::{Value, json};

use super::keys::sha256_hex;
pub use super::opener::{Accuracy, GATE_IOU, GATE_RECALL, GATE_SCORE, ModelOpener};
use super::shared::Shared;
use super::store::{ModelRow, NewModel, Store, StoreError, StoreResult};
use crate::admission::models::valid_model_name;

/// A model added: its row and what the gate measured.
#[derive(Debug, Serialize)]
pub struct ModelAdded {
    /// The version stored (active).
    #[serde(flatten)]
    pub row: ModelRow,
    /// The gate's figures.
    pub accuracy: Accuracy,
    /// Added though it did not pass the gate.
    pub forced: bool,
}

/// The model repository (see the module docs).
pub struct ModelRepository {
    shared: Arc<Shared>,
    /// Held by the add running (its gate takes a core for seconds): one at a time.
    adding: Mutex<()>,
}

impl ModelRepository {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared, adding: Mutex::new(()) }
    }

    /// Adds `bytes` (an ONNX file) as the next version of `name`, active at
    /// once, after the gate: refused ([`StoreError::Invalid`]) when it does
    /// not load, has another contract than the reference's, or finds too
    /// few of the reference's faces (unless `force`).
    pub fn add(&self, name: &str, bytes: &[u8], force: bool) -> StoreResult<ModelAdded> {
        self.check_name(name)?;
        if bytes.is_empty() {
            return Err(StoreError::Invalid("the body is empty: send the .onnx file".into()));
        }
        let opener = self.opener()?;
        let _adding = self.adding.try_lock().map_err(|_| StoreError::TooMany {
            code: "change_in_progress",
            message: "another model is being added on this node; retry when it is done".into(),
        })?;
        let needs = opener.footprint(bytes.len() as u64);
        if let (_, Some(bound)) = self.shared.models.memory()
            && needs > bound
        {
            return Err(StoreError::Invalid(format!(
                "model {name} would hold about {} MiB loaded, more than the {} MiB model-memory bound (--model-memory-mib)",
                needs.div_ceil(1 << 20),
                bound >> 20
            )));
        }
        let sha256 = sha256_hex(bytes);
        // Examined from a file of its own, the cache's once it is stored.
        let candidate = write_file(&self.shared.data_dir.join("models"), &format!("{sha256}.candidate"), bytes)?;
        let _candidate = RemoveOnDrop(&candidate);
        let accuracy = match opener.examine(&candidate) {
            Ok(accuracy) if accuracy.passes || force => accuracy,
            Ok(accuracy) => return Err(gate_refusal(name, accuracy)),
            Err(e) => return Err(StoreError::Invalid(format!("model {name}: {e}"))),
        };
        let forced = !accuracy.passes;
        let spec = spec_json(&self.reference_spec()?).to_string();
        let accuracy_json = json!({ "accuracy": accuracy, "forced": forced }).to_string();
        let version = self.shared.db().add_model(NewModel { name, sha256: &sha256, bytes, spec: &spec, accuracy: &accuracy_json })?;
        // Cached here (else fetched from the store at its first call).
        let _ = std::fs::rename(&candidate, cached_path(&self.shared.data_dir, &sha256));
        self.refresh();
        let row = self.list()?.into_iter().find(|r| r.name == name && r.version == version).ok_or_else(|| super::store::no_model(name))?;
        tracing::info!(model = name, version, sha256 = %sha256, matched = accuracy.matched, reference = accuracy.reference, forced, "model added");
        Ok(ModelAdded { row, accuracy, forced })
    }

    /// Whether this node serves `name` from its flags, not the repository.
    pub fn from_flags(&self, name: &str) -> bool {
        self.shared.repository.fixed.contains(name)
    }

    /// Every version of every model in the repository.
    pub fn list(&self) -> StoreResult<Vec<ModelRow>> {
        self.shared.db().models()
    }

    /// Makes `version` of `name` the one served.
    pub fn activate(&self, name: &str, version: i64) -> StoreResult<()> {
        self.shared.db().activate_model(name, version)?;
        self.refresh();
        tracing::info!(model = name, version, "model version activated");
        Ok(())
    }

    /// Removes a model: handlers calling it get `unknown-model` from now on.
    pub fn remove(&self, name: &str) -> StoreResult<()> {
        self.shared.db().remove_model(name)?;
        self.refresh();
        tracing::info!(model = name, "model removed");
        Ok(())
    }

    /// Serves what the store holds now, after a change made here: the
    /// change stands whatever happens next, so a failure is logged and left
    /// to the sync, which reconciles at its next rebuild.
    fn refresh(&self) {
        if let Err(e) = reconcile(&self.shared, &mut **self.shared.db()) {
            tracing::warn!(error = %e, "model change stored; this node serves it when the store answers again");
        }
    }

    fn check_name(&self, name: &str) -> StoreResult<()> {
        if !valid_model_name(name) {
            return Err(StoreError::Invalid(format!(
                "{name:?}: a model name is a-z, 0-9, '.', '_', '-', first a letter or digit, at most 64 bytes"
            )));
        }
        if self.shared.repository.fixed.contains(name) {
            return Err(StoreError::Conflict(format!(
                "model {name} is served from this node's flags (--model, --extra-model); choose another name"
            )));
        }
        Ok(())
    }

    fn opener(&self) -> StoreResult<Arc<dyn ModelOpener>> {
        self.shared.repository.opener.clone().ok_or_else(|| StoreError::Conflict("this node serves no model repository".into()))
    }

    /// The reference model's spec: every repository model has its contract.
    fn reference_spec(&self) -> StoreResult<ModelSpec> {
        self.shared
            .models
            .specs()
            .into_iter()
            .find(|s| s.name == REFERENCE)
            .ok_or_else(|| StoreError::Internal(anyhow::anyhow!("the reference model {REFERENCE} is not served")))
    }
}

/// The refusal of a model below the accuracy gate.
fn gate_refusal(name: &str, accuracy: Accuracy) -> StoreError {
    StoreError::Invalid(format!(
        "model {name} fails the accuracy gate: it finds {} of the reference's {} faces on the test photos ({:.0} %; the gate is {:.0} % \
         at IoU ≥ {GATE_IOU} and a score within {GATE_SCORE}); add it with force to serve it anyway",
        accuracy.matched,
        accuracy.reference,
        accuracy.recall * 100.0,
        GATE_RECALL * 100.0,
    ))
}

/// The model every other is measured against, and whose contract they share.
const REFERENCE: &str = "centerface";

/// A spec as the API shows it.
pub fn spec_json(spec: &ModelSpec) -> Value {
    let tensor = |t: &facegate_host_gpu::TensorSpec| json!({ "name": t.name, "shape": t.shape, "element": t.element });
    json!({ "input": tensor(&spec.input), "outputs": spec.outputs.iter().map(tensor).collect::<Vec<_>>(), "max_batch": spec.max_batch })
}

/// Makes this node serve the repository's active versions: registers those
/// it does not serve yet (loaded at their first call) and drops those
/// removed or replaced. Called by every rebuild of the snapshot.
pub(super) fn reconcile(shared: &Arc<Shared>, db: &mut dyn Store) -> StoreResult<()> {
    let repository = &shared.repository;
    let Some(opener) = repository.opener.clone() else { return Ok(()) };
    // Held before the store is read: a reconcile that read before a change
    // never applies its read after the change's own reconcile.
    let mut served = repository.served.lock().unwrap_or_else(PoisonError::into_inner);
    let rows = db.models()?;
    forget_unused_files(&shared.data_dir, &rows);
    let active: BTreeMap<String, ModelRow> = rows.into_iter().filter(|r| r.active).map(|r| (r.name.clone(), r)).collect();
    served.retain(|name, sha256| {
        let keep = active.get(name).is_some_and(|row| row.sha256 == *sha256);
        if !keep {
            shared.models.remove(name);
            tracing::info!(model = %name, "repository model no longer served here");
        }
        keep
    });
    let Some(reference) = shared.models.specs().into_iter().find(|s| s.name == REFERENCE) else { return Ok(()) };
    for (name, row) in active {
        if served.contains_key(&name) {
            continue;
        }
        if repository.fixed.contains(&name) {
            tracing::warn!(model = %name, "the repository's model has the name of one this node serves from its flags; the flags' is served");
            continue;
        }
        let spec = ModelSpec { name: name.clone(), ..reference.clone() };
        let loader = RepositoryLoader {
            name: name.clone(),
            sha256: row.sha256.clone(),
            shared: Arc::downgrade(shared),
            opener: Arc::clone(&opener),
        };
        let bytes = opener.footprint(u64::try_from(row.size).unwrap_or(0));
        if let Err(e) = shared.models.insert_on_demand(spec, bytes, Arc::new(loader), None) {
            tracing::warn!(model = %name, error = %e, "repository model not served here");
            continue;
        }
        tracing::info!(model = %name, version = row.version, sha256 = %row.sha256, "repository model served here (loaded at its first call)");
        served.insert(name, row.sha256);
    }
    Ok(())
}

/// Loads a repository model: its file from this node's cache, fetched
/// from the store first when absent.
struct RepositoryLoader {
    name: String,
    sha256: String,
    /// Weak: the registry holding this loader is the node's (a cycle otherwise).
    shared: Weak<Shared>,
    opener: Arc<dyn ModelOpener>,
}

impl ModelLoader for RepositoryLoader {
    fn load(&self, arbiter: &Arbiter) -> Result<Loaded, String> {
        let shared = self.shared.upgrade().ok_or("the node is shutting down")?;
        let path = cached_path(&shared.data_dir, &self.sha256);
        let intact = std::fs::read(&path).is_ok_and(|bytes| sha256_hex(&bytes) == self.sha256);
        if !intact {
            // The compiler's connection, for bulk reads: changes, key
            // checks and tenants' reads never wait behind a model's bytes.
            let bytes = shared.compile_db().model_bytes(&self.sha256).map_err(|e| e.to_string())?;
            let _ = std::fs::remove_file(&path);
            cache_file(&shared.data_dir, &self.sha256, &bytes).map_err(|e| e.to_string())?;
        }
        self.opener.load(&self.name, &path, arbiter)
    }
}

/// Where this node keeps a model file: `<data-dir>/models/<sha256>.onnx`.
fn cached_path(data_dir: &Path, sha256: &str) -> PathBuf {
    data_dir.join("models").join(format!("{sha256}.onnx"))
}

/// Removes the cached files no version in `rows` names (the models
/// removed); those of versions not served stay, for an activation.
fn forget_unused_files(data_dir: &Path, rows: &[ModelRow]) {
    let Ok(entries) = std::fs::read_dir(data_dir.join("models")) else { return };
    let named: BTreeSet<&str> = rows.iter().map(|r| r.sha256.as_str()).collect();
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(sha256) = file.to_str().and_then(|f| f.strip_suffix(".onnx")) else { continue };
        if !named.contains(sha256) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Writes a model file into this node's cache (a temporary file, fsynced,
/// renamed), unless it is there; returns its path.
fn cache_file(data_dir: &Path, sha256: &str, bytes: &[u8]) -> StoreResult<PathBuf> {
    let path = cached_path(data_dir, sha256);
    write_file(&data_dir.join("models"), &format!("{sha256}.onnx"), bytes)?;
    Ok(path)
}

/// Writes `dir/name` whole or not at all: a temporary file of its own (two
/// writers of one file each write theirs), fsynced, renamed.
fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> StoreResult<PathBuf> {
    static WRITES: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(dir).map_err(anyhow::Error::from)?;
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), WRITES.fetch_add(1, Ordering::Relaxed)));
    let written = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, &path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(StoreError::Internal(anyhow::anyhow!("writing model file {}: {e}", path.display())));
    }
    Ok(path)
}

/// Removes a file when dropped (a candidate refused, or not renamed).
struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}
