//! # facegate-host-gpu
//!
//! The inference side of facegate, usable on its own by any native program:
//! backends that own devices ([`backend::Backend`]: ONNX Runtime on CPU, or
//! CUDA / TensorRT behind features), named and opened by [`device`], a dynamic batcher per model that
//! coalesces concurrent calls into device batches fairly across tenants
//! ([`Batcher`]), models sharing devices under one virtual clock
//! ([`Arbiter`]), and a registry of the models served, loaded on demand under a memory bound
//! ([`Models`]).
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
pub mod arbiter;
pub mod backend;
pub mod backlog;
mod batcher;
pub mod device;
mod error;
pub mod metrics;
mod model;
mod models;
pub mod observe;
pub mod queue;
pub mod sizing;
mod tensor;

pub use arbiter::Arbiter;
pub use backlog::Promise;
pub use batcher::{Batcher, BatcherConfig, CallOptions, DEFAULT_QUEUE_CAPACITY, DEFAULT_TENANT_CAPACITY, InferRequest};
pub use device::{DeviceKind, DeviceSpec};
pub use error::InferError;
pub use model::{ModelSpec, TensorSpec};
pub use models::{Loaded, ModelLoader, ModelState, Models};
pub use observe::{BatchMember, BatchObserver, BatchReport, CallTag};
pub use sizing::Sizing;
pub use tensor::{ElementType, ShapeMismatch, Tensor, byte_len};
