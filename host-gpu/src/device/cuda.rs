//! The `cuda` kind's execution provider: ONNX Runtime's CUDA, on one GPU.
#![cfg(feature = "cuda")]

use ort::session::builder::SessionBuilder;

use super::Target;

/// Runs the session on GPU `target.ordinal` through CUDA; fails if CUDA
/// cannot drive it rather than falling back to the CPU.
pub(super) fn register(builder: SessionBuilder, target: &Target<'_>) -> ort::Result<SessionBuilder> {
    let cuda = ort::ep::CUDA::default().with_device_id(target.ordinal).build().error_on_failure();
    Ok(builder.with_execution_providers([cuda])?)
}
