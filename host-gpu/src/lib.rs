//! # facegate-host-gpu
//!
//! The inference side of facegate, usable on its own by any native program:
//! backends that own devices ([`backend::Backend`]: ONNX Runtime on CPU, or
//! CUDA / TensorRT behind features), named and opened by [`device`], a dynamic batcher per model that
//! coalesces concurrent calls into device batches fairly across tenants
//! ([`Batcher`]), and a registry of the models served ([`Models`]).
//!
//! It knows nothing of HTTP, tenants' code or wasm.
//!
//! ```no_run
//! use std::time::{Duration, Instant};
//! use facegate_host_gpu::backend::onnx::{init_onnx_runtime, ImageModelConfig, OnnxBackend};
//! use facegate_host_gpu::device::{DeviceKind, OpenOptions};
//! use facegate_host_gpu::{Batcher, BatcherConfig, InferRequest, Tensor, ElementType};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! init_onnx_runtime("libonnxruntime.so".as_ref())?;
//! let config = ImageModelConfig::centerface("centerface.onnx", 8);
//! let options = OpenOptions { cpu_threads: 2, ..OpenOptions::default() };
//! let backend = OnnxBackend::new(config, DeviceKind::Cpu.into(), &options)?;
//! let batcher = Batcher::start(vec![Box::new(backend)], &BatcherConfig::default())?;
//! let image = Tensor::new(vec![640, 640, 3], ElementType::U8, vec![0; 640 * 640 * 3])?;
//! let deadline = Instant::now() + Duration::from_secs(5);
//! let outputs = batcher.infer(InferRequest { tenant: "demo".into(), input: image, deadline }).await?;
//! assert_eq!(outputs.len(), 4);
//! # Ok(()) }
//! ```

pub mod affinity;
pub mod backend;
pub mod backlog;
mod batcher;
pub mod device;
mod error;
pub mod metrics;
mod model;
pub mod observe;
pub mod queue;
pub mod sizing;
mod tensor;

use std::collections::BTreeMap;

pub use backlog::Promise;
pub use batcher::{Batcher, BatcherConfig, CallOptions, DEFAULT_QUEUE_CAPACITY, DEFAULT_TENANT_CAPACITY, InferRequest};
pub use device::{DeviceKind, DeviceSpec};
pub use error::InferError;
pub use model::{ModelSpec, TensorSpec};
pub use observe::{BatchMember, BatchObserver, BatchReport, CallTag};
pub use sizing::Sizing;
pub use tensor::{ElementType, ShapeMismatch, Tensor, byte_len};

/// The models a host serves, by name, each behind its own batcher.
#[derive(Clone, Default)]
pub struct Models {
    batchers: BTreeMap<String, Batcher>,
}

impl Models {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a model, keyed by its spec's name.
    pub fn insert(&mut self, batcher: Batcher) {
        self.batchers.insert(batcher.spec().name.clone(), batcher);
    }

    /// The batcher of a model.
    pub fn get(&self, name: &str) -> Option<&Batcher> {
        self.batchers.get(name)
    }

    /// All models, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Batcher> {
        self.batchers.values()
    }

    /// Sets a tenant's fairness weight in every model's batcher
    /// (see [`Batcher::set_tenant_weight`]).
    pub fn set_tenant_weight(&self, tenant: &str, weight: u32) {
        for batcher in self.iter() {
            batcher.set_tenant_weight(tenant, weight);
        }
    }

    /// Forgets a tenant in every model's batcher, answering its waiting
    /// calls [`InferError::ShuttingDown`] (see [`Batcher::remove_tenant`]);
    /// returns how many calls were answered so.
    pub fn remove_tenant(&self, tenant: &str) -> usize {
        self.iter().map(|batcher| batcher.remove_tenant(tenant)).sum()
    }

    /// Runs one sample through the named model.
    pub async fn infer(&self, model: &str, request: InferRequest) -> Result<Vec<Tensor>, InferError> {
        self.infer_with(model, request, CallOptions::default()).await
    }

    /// [`Models::infer`] with `options` (see [`Batcher::infer_with`]).
    pub async fn infer_with(&self, model: &str, request: InferRequest, options: CallOptions) -> Result<Vec<Tensor>, InferError> {
        let batcher = self.get(model).ok_or_else(|| InferError::UnknownModel(model.to_owned()))?;
        batcher.infer_with(request, options).await
    }
}
