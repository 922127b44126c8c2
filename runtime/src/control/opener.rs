//! What the control plane asks of the node to serve the model repository
//! ([`ModelOpener`], implemented by `serve::models`), the accuracy gate's
//! rule and figures ([`Accuracy`]), and what the node keeps of the
//! repository ([`RepositoryServing`], in [`super::shared::Shared`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use facegate_host_gpu::{Arbiter, Loaded};
use serde::{Deserialize, Serialize};

/// A face of the model must overlap the reference face this much.
pub const GATE_IOU: f64 = 0.8;
/// … with a score at most this far from the reference face's.
pub const GATE_SCORE: f64 = 0.1;
/// The least share of the reference faces found.
pub const GATE_RECALL: f64 = 0.65;

/// What the gate measured of a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Accuracy {
    /// Reference faces the model found, by the gate's rule.
    pub matched: usize,
    /// Faces the reference model found on the photos.
    pub reference: usize,
    /// `matched / reference`.
    pub recall: f64,
    /// Whether the recall reaches [`GATE_RECALL`].
    pub passes: bool,
}

/// Opens model files on this node's devices (the node's engine settings:
/// `serve::models`). The control plane knows no engine.
pub trait ModelOpener: Send + Sync {
    /// What a model file of `file_bytes` counts against the model-memory bound.
    fn footprint(&self, file_bytes: u64) -> u64;

    /// Opens the model at `path` as `name` on every device, its batcher
    /// started in `arbiter` (the node's registry's), blocking.
    fn load(&self, name: &str, path: &Path, arbiter: &Arbiter) -> Result<Loaded, String>;

    /// Opens the model at `path` once on the CPU, checks it has the
    /// reference's contract (input and outputs), and runs the accuracy gate.
    fn examine(&self, path: &Path) -> Result<Accuracy, String>;
}

/// What this node serves of the repository (in [`super::shared::Shared`]).
pub(super) struct RepositoryServing {
    /// Opens the files; `None`: the repository is served by no one here.
    pub opener: Option<Arc<dyn ModelOpener>>,
    /// The models this node serves from its flags.
    pub fixed: BTreeSet<String>,
    /// The repository's models registered here: name → sha256.
    pub served: Mutex<BTreeMap<String, String>>,
}
