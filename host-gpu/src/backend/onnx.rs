//! ONNX Runtime backend (through `ort`), for image models that take one
//! float NCHW input. Runs on the CPU by default; with the `cuda` or
//! `tensorrt` features the same code drives GPUs through ONNX Runtime's
//! execution providers, each registered as its device kind's row in
//! [`crate::device`] says.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use ort::environment::Environment;
use ort::session::Session;
use ort::session::builder::GraphOptimizationLevel;
use ort::value::TensorRef;

use super::intra_op::{self, IntraOpThreads};
use super::{Backend, BackendError};
use crate::device::{DeviceSpec, OpenOptions, Target};
use crate::model::{ModelSpec, TensorSpec};
use crate::tensor::{ElementType, Tensor};

/// An image model in ONNX form: one `[B,3,H,W]` f32 input, outputs `[B,C,H/s,W/s]`.
#[derive(Debug, Clone)]
pub struct ImageModelConfig {
    /// Name callers use.
    pub name: String,
    /// The `.onnx` file.
    pub path: PathBuf,
    /// Name of the graph input.
    pub input_name: String,
    /// Graph outputs and their channel counts, in the order returned to callers.
    pub outputs: Vec<(String, usize)>,
    /// Output stride: output spatial dims are input dims divided by this.
    pub stride: usize,
    /// Input H and W must be multiples of this.
    pub dim_multiple: usize,
    /// Largest H or W accepted.
    pub max_side: usize,
    /// Most samples per device batch.
    pub max_batch: usize,
    /// Per-channel (RGB) mean subtracted from the raw 0-255 values.
    pub mean: [f32; 3],
    /// Per-channel (RGB) divisor applied after the mean.
    pub std: [f32; 3],
}

impl ImageModelConfig {
    /// CenterFace as prepared by `deploy/scripts/prepare_model.py`: raw RGB
    /// 0-255 in, stride-4 heatmap, scale, offset and landmarks out.
    pub fn centerface(path: impl Into<PathBuf>, max_batch: usize) -> Self {
        Self {
            name: "centerface".into(),
            path: path.into(),
            input_name: "input.1".into(),
            outputs: vec![("537".into(), 1), ("538".into(), 2), ("539".into(), 2), ("540".into(), 10)],
            stride: 4,
            dim_multiple: 32,
            max_side: 2048,
            max_batch,
            mean: [0.0; 3],
            std: [1.0; 3],
        }
    }

    /// The per-sample contract callers see: `[H, W, 3]` u8 in, `[C, H/s, W/s]` f32 out.
    pub fn spec(&self) -> ModelSpec {
        let outputs = self
            .outputs
            .iter()
            .map(|(name, c)| TensorSpec { name: name.clone(), shape: vec![*c, 0, 0], element: ElementType::F32 })
            .collect();
        ModelSpec {
            name: self.name.clone(),
            input: TensorSpec { name: self.input_name.clone(), shape: vec![0, 0, 3], element: ElementType::U8 },
            outputs,
            dim_multiple: self.dim_multiple,
            max_side: self.max_side,
            max_batch: self.max_batch,
        }
    }
}

static ORT_ENV: OnceLock<Result<Environment, String>> = OnceLock::new();

/// Loads the ONNX Runtime shared library and creates its environment, once
/// per process. Later calls return the first call's outcome, whatever path
/// they pass.
pub fn init_onnx_runtime(library: &Path) -> Result<(), BackendError> {
    ORT_ENV
        .get_or_init(|| {
            let builder = ort::init_from(library).map_err(|e| format!("cannot load ONNX Runtime from {}: {e}", library.display()))?;
            builder.with_name("facegate").build().map_err(|e| format!("cannot start ONNX Runtime: {e}"))
        })
        .as_ref()
        .map(|_| ())
        .map_err(|e| BackendError(e.clone()))
}

fn environment() -> ort::Result<&'static Environment> {
    match ORT_ENV.get() {
        Some(Ok(env)) => Ok(env),
        Some(Err(e)) => Err(ort::Error::new(e.clone())),
        None => Err(ort::Error::new("ONNX Runtime is not initialised: call init_onnx_runtime first")),
    }
}

/// One ONNX Runtime session on one device.
pub struct OnnxBackend {
    config: ImageModelConfig,
    spec: ModelSpec,
    session: Session,
    /// The session's intra-op threads, on the CPU only (where batches
    /// rarely pay, and cost CPU time rather than device time).
    intra_op: Option<IntraOpThreads>,
    /// Reused NCHW input buffer, so steady state allocates nothing per batch.
    scratch: Vec<f32>,
    /// The device, as [`Backend::device`] names it.
    label: String,
}

/// Whether to free an input buffer of `capacity` floats before a batch of
/// `needed`: when it is past `keep` (a full batch of 640×640 images; the
/// batcher gives larger images smaller batches, so only a single sample
/// larger than that can pass it) and this batch is not.
fn drop_scratch(capacity: usize, needed: usize, keep: usize) -> bool {
    capacity > keep && needed <= keep
}

impl OnnxBackend {
    /// Opens a session for `config` on `device`, set up as `options` say
    /// for its kind (see [`crate::device::Kind`]). [`init_onnx_runtime`]
    /// must have succeeded.
    pub fn new(config: ImageModelConfig, device: DeviceSpec, options: &OpenOptions) -> Result<Self, BackendError> {
        let intra_op = device.kind().info().host_cpu.then(|| IntraOpThreads::new(options.cpu_cores.clone()));
        let session = build_session(&config, device, options, intra_op.clone())
            .map_err(|e| BackendError(format!("cannot load model {} from {}: {e}", config.name, config.path.display())))?;
        let spec = config.spec();
        Ok(Self { config, spec, session, intra_op, scratch: Vec::new(), label: device.to_string() })
    }

    fn fill_input(&mut self, inputs: &[&Tensor], h: usize, w: usize) {
        let sample = 3 * h * w;
        // One batch of the largest images grows the buffer to hundreds of
        // MB: keep that only while such batches come, not for good.
        let keep = self.config.max_batch.max(1).saturating_mul(crate::sizing::REFERENCE_SAMPLE);
        if drop_scratch(self.scratch.capacity(), inputs.len() * sample, keep) {
            self.scratch = Vec::new();
        }
        self.scratch.clear();
        self.scratch.resize(inputs.len() * sample, 0.0);
        for (input, out) in inputs.iter().zip(self.scratch.chunks_exact_mut(sample)) {
            hwc_u8_to_chw_f32(input.data(), out, self.config.mean, self.config.std);
        }
    }
}

/// A session for `config` on `device`: on the host's CPU with `intra_op`'s
/// threads, through the execution provider its kind registers.
fn build_session(
    config: &ImageModelConfig,
    device: DeviceSpec,
    options: &OpenOptions,
    intra_op: Option<IntraOpThreads>,
) -> ort::Result<Session> {
    let mut builder = Session::builder(environment()?)?
        .with_optimization_level(GraphOptimizationLevel::Level3)?
        // Spinning threads burn the cores the wasm guests need while idle.
        .with_intra_op_spinning(false)?
        .with_inter_threads(1)?;
    if let Some(threads) = intra_op {
        builder = builder.with_intra_threads(options.cpu_threads.max(1))?.with_thread_manager(threads)?;
    }
    let target = Target { ordinal: device.ordinal().unwrap_or(0), model: config, cache_dir: options.cache_dir.as_deref() };
    builder = device.kind().info().register(builder, &target)?;
    builder.commit_from_file(&config.path)
}

impl Backend for OnnxBackend {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn runs_on_cpu(&self) -> bool {
        self.intra_op.is_some()
    }

    fn device(&self) -> &str {
        &self.label
    }

    fn pool_cpu_time(&self) -> Duration {
        self.intra_op.as_ref().map_or(Duration::ZERO, IntraOpThreads::cpu_time)
    }

    /// Pins the worker thread, which computes its share of each run, to the
    /// session's cores, as its pool threads are.
    fn on_worker_thread(&mut self) {
        if let Some(pool) = &self.intra_op {
            intra_op::pin_current_thread(pool.cores(), "the device worker");
        }
    }

    fn run(&mut self, inputs: &[&Tensor]) -> Result<Vec<Vec<Tensor>>, BackendError> {
        let (h, w) = match inputs.first().map(|t| t.shape()) {
            Some(&[h, w, 3]) => (h, w),
            other => return Err(BackendError(format!("batch input must be [H, W, 3], got {other:?}"))),
        };
        self.fill_input(inputs, h, w);
        let shape = [inputs.len(), 3, h, w];
        let input = TensorRef::from_array_view((shape, &self.scratch[..])).map_err(BackendError::from_display)?;
        let outputs = self.session.run(ort::inputs![self.config.input_name.as_str() => input]).map_err(BackendError::from_display)?;
        let mut per_sample: Vec<Vec<Tensor>> = (0..inputs.len()).map(|_| Vec::new()).collect();
        for (name, _) in &self.config.outputs {
            let output = outputs.get(name.as_str()).ok_or_else(|| BackendError(format!("model has no output {name}")))?;
            let (shape, data) = output.try_extract_tensor::<f32>().map_err(BackendError::from_display)?;
            split_batch(shape, data, &mut per_sample)?;
        }
        Ok(per_sample)
    }
}

/// Converts one u8 HWC image into planar (CHW) floats, normalising per channel.
fn hwc_u8_to_chw_f32(src: &[u8], dst: &mut [f32], mean: [f32; 3], std: [f32; 3]) {
    let plane = dst.len() / 3;
    let (r, rest) = dst.split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    for (i, px) in src.chunks_exact(3).enumerate() {
        r[i] = (f32::from(px[0]) - mean[0]) / std[0];
        g[i] = (f32::from(px[1]) - mean[1]) / std[1];
        b[i] = (f32::from(px[2]) - mean[2]) / std[2];
    }
}

/// Cuts a `[B, ...]` output into B per-sample tensors and appends each to its sample.
fn split_batch(shape: &[i64], data: &[f32], per_sample: &mut [Vec<Tensor>]) -> Result<(), BackendError> {
    let dims: Vec<usize> = shape.iter().map(|&d| usize::try_from(d).unwrap_or(0)).collect();
    let (&batch, sample_shape) = dims.split_first().ok_or_else(|| BackendError("scalar model output".into()))?;
    if batch != per_sample.len() {
        return Err(BackendError(format!("model returned batch {batch} for {} inputs", per_sample.len())));
    }
    let stride = sample_shape.iter().product::<usize>();
    if data.len() != batch * stride {
        return Err(BackendError(format!("output of shape {dims:?} holds {} values", data.len())));
    }
    for (outputs, chunk) in per_sample.iter_mut().zip(data.chunks_exact(stride.max(1))) {
        outputs.push(Tensor::from_f32(sample_shape.to_vec(), chunk).map_err(BackendError::from_display)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hwc_to_chw_is_planar_and_normalised() {
        let src = [10u8, 20, 30, 40, 50, 60];
        let mut dst = [0f32; 6];
        hwc_u8_to_chw_f32(&src, &mut dst, [10.0, 0.0, 0.0], [1.0, 2.0, 1.0]);
        assert_eq!(dst, [0.0, 30.0, 10.0, 25.0, 30.0, 60.0]);
    }

    #[test]
    fn a_buffer_grown_by_huge_images_is_freed_at_the_next_normal_batch() {
        let (keep, huge) = (8 * 3 * 640 * 640, 8 * 3 * 2048 * 2048);
        assert!(!drop_scratch(huge, huge, keep), "kept while huge batches come");
        assert!(drop_scratch(huge, 3 * 640 * 640, keep), "freed for a normal one");
        assert!(!drop_scratch(keep, 3 * 32 * 32, keep), "a normal-sized buffer is kept");
    }

    #[test]
    fn split_batch_cuts_per_sample() {
        let mut per_sample = vec![Vec::new(), Vec::new()];
        split_batch(&[2, 1, 2], &[1.0, 2.0, 3.0, 4.0], &mut per_sample).unwrap();
        assert_eq!(per_sample[1][0].to_f32_vec().unwrap(), vec![3.0, 4.0]);
        assert_eq!(per_sample[0][0].shape(), &[1, 2]);
        assert!(split_batch(&[3, 1], &[0.0; 3], &mut per_sample).is_err());
    }
}
