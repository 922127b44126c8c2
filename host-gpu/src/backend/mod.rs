//! The device side: a small synchronous trait that one worker thread drives.
//!
//! A backend owns one engine instance (an ONNX Runtime session on a CPU
//! thread budget or on one GPU). It is never shared: the pool gives each
//! worker thread its own, so `run` takes `&mut self` and needs no locks.

pub mod fake;
mod intra_op;
pub mod onnx;

use std::time::Duration;

use crate::model::ModelSpec;
use crate::tensor::Tensor;

/// One engine instance that runs batches of same-shaped samples.
pub trait Backend: Send + 'static {
    /// What this backend's model accepts and returns, per sample.
    fn spec(&self) -> &ModelSpec;

    /// Runs one batch. All `inputs` have already been validated against
    /// [`Backend::spec`] and share one shape. Returns, for each input in
    /// order, its outputs in the order of `spec().outputs`.
    fn run(&mut self, inputs: &[&Tensor]) -> Result<Vec<Vec<Tensor>>, BackendError>;

    /// Whether this backend computes on the host's CPU (false for
    /// accelerators, the default). Adaptive sizing on a CPU starts at single
    /// samples (on an accelerator at `max_batch`) and weighs a batch by the
    /// CPU time it took (see [`Backend::pool_cpu_time`]) rather than wall
    /// time: on a CPU shared with the wasm guests, wall time also counts the
    /// guests' work, in amounts that depend on the batch size, while CPU
    /// time is what the batch takes from the machine.
    fn runs_on_cpu(&self) -> bool {
        false
    }

    /// The device, named for people (traces): `cpu`, `cuda:0`, ….
    /// `device` by default.
    fn device(&self) -> &str {
        "device"
    }

    /// CPU time used so far by threads that run this backend's batches
    /// besides the worker thread that calls [`Backend::run`] (ONNX Runtime's
    /// intra-op pool). On a CPU a batch costs the worker thread's CPU time
    /// plus the change in this. Zero by default.
    fn pool_cpu_time(&self) -> Duration {
        Duration::ZERO
    }

    /// Called once on the worker thread that drives this backend, before
    /// its first batch (a CPU session with cores of its own pins the
    /// thread to them there). Nothing by default.
    fn on_worker_thread(&mut self) {}
}

/// The engine failed on a batch. Every call of that batch gets this error;
/// the worker then goes on with the next batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BackendError(pub String);

impl BackendError {
    /// Wraps any displayable error.
    pub fn from_display(err: impl std::fmt::Display) -> Self {
        Self(err.to_string())
    }
}
