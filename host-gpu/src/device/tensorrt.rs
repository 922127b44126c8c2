//! The `tensorrt` kind's execution provider: TensorRT on one GPU, with CUDA
//! for the nodes TensorRT cannot run.

#[cfg(feature = "tensorrt")]
use ort::session::builder::SessionBuilder;

use crate::backend::onnx::ImageModelConfig;

/// Runs the session on GPU `target.ordinal` through TensorRT (failing if
/// TensorRT cannot drive it), its engines and timing cache kept in
/// `target.cache_dir`.
#[cfg(feature = "tensorrt")]
pub(super) fn register(builder: SessionBuilder, target: &super::Target<'_>) -> ort::Result<SessionBuilder> {
    let [min, opt, max] = profile(target.model);
    // One optimisation profile covering every batch and size the model
    // accepts: without it TensorRT builds a new engine for each new shape.
    let mut trt = ort::ep::TensorRT::default()
        .with_device_id(target.ordinal)
        .with_fp16(true)
        .with_profile_min_shapes(min)
        .with_profile_opt_shapes(opt)
        .with_profile_max_shapes(max);
    if let Some(dir) = target.cache_dir {
        trt =
            trt.with_engine_cache(true).with_engine_cache_path(dir.display()).with_timing_cache(true).with_timing_cache_path(dir.display());
    }
    let cuda = ort::ep::CUDA::default().with_device_id(target.ordinal).build();
    Ok(builder.with_execution_providers([trt.build().error_on_failure(), cuda])?)
}

/// TensorRT's min, opt and max input shapes (`name:BxCxHxW`): one sample of
/// the smallest side up to `max_batch` samples of the largest, tuned for
/// full batches of 640×640.
#[cfg_attr(not(feature = "tensorrt"), allow(dead_code, reason = "used by the tensorrt feature; tested in every build"))]
fn profile(config: &ImageModelConfig) -> [String; 3] {
    let shape = |batch: usize, side: usize| format!("{}:{batch}x3x{side}x{side}", config.input_name);
    let opt_side = 640usize.clamp(config.dim_multiple, config.max_side);
    [shape(1, config.dim_multiple), shape(config.max_batch.max(1), opt_side), shape(config.max_batch.max(1), config.max_side)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_spans_every_accepted_shape() {
        let config = ImageModelConfig::centerface("m.onnx", 16);
        assert_eq!(profile(&config), ["input.1:1x3x32x32".to_owned(), "input.1:16x3x640x640".into(), "input.1:16x3x2048x2048".into()]);
    }
}
