//! Errors a caller of [`crate::Batcher::infer`] can see.

/// Why an inference call failed. Every variant is something the caller
/// (ultimately a tenant's handler) can act on; none is a host bug.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InferError {
    /// The input does not match the model's spec.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// No model of that name is served.
    #[error("unknown model: {0}")]
    UnknownModel(String),
    /// The queue is full; the caller should retry later.
    #[error("overloaded: inference queue is full")]
    Overloaded,
    /// The work queued ahead of the call would take `wait`, past what is
    /// left of its deadline: refused at once rather than queued to time out.
    #[error("overloaded: the work queued ahead would take {:.1} s, past the call's deadline", wait.as_secs_f64())]
    Backlog {
        /// The estimated wait.
        wait: std::time::Duration,
    },
    /// The call's deadline passed before a device ran it.
    #[error("deadline exceeded before inference ran")]
    DeadlineExceeded,
    /// The engine failed on the batch this call was part of.
    #[error("backend error: {0}")]
    Backend(String),
    /// The model is not loaded and cannot be: the models that cannot be
    /// unloaded leave it no room under the model-memory bound.
    #[error("model not loadable: {0}")]
    ModelMemory(String),
    /// The batcher is shutting down, or stopped serving the caller's tenant
    /// ([`crate::Batcher::remove_tenant`]).
    #[error("inference engine is shutting down")]
    ShuttingDown,
}

impl InferError {
    /// A short, stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidInput(_) => "invalid_input",
            Self::UnknownModel(_) => "unknown_model",
            Self::Overloaded => "overloaded",
            Self::Backlog { .. } => "backlog",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::Backend(_) => "backend",
            Self::ModelMemory(_) => "model_memory",
            Self::ShuttingDown => "shutting_down",
        }
    }
}
