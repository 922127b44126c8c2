//! Loading the models a node serves: `centerface` (`--model`), loaded at
//! start and for good, the reference every other model is measured
//! against; and the `--extra-model`s, loaded on demand under the
//! model-memory bound (`--model-memory-mib`) and unloaded, least recently
//! used first, to make room (host-gpu's `Models`). Those that fit are
//! loaded at start, so a node's first calls do not wait.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use facegate_host_gpu::backend::Backend;
use facegate_host_gpu::backend::onnx::{ImageModelConfig, init_onnx_runtime};
use facegate_host_gpu::device::{self, OpenOptions};
use facegate_host_gpu::{Arbiter, Batcher, BatcherConfig, DeviceKind, InferError, Loaded, ModelLoader, Models};

use super::gate::{self, Accuracy};
use crate::config::EngineConfig;
use crate::control::models::ModelOpener;

/// What ONNX Runtime holds per session beyond its weights, at least: the
/// arena of a batch's activations (CenterFace at 640×640 needs tens of MiB).
const SESSION_OVERHEAD: u64 = 32 << 20;

/// Loads ONNX Runtime and the models (`centerface` and the extra ones),
/// each with its own batcher, one device worker per GPU and per configured
/// CPU worker.
pub fn load_models(config: &EngineConfig) -> anyhow::Result<Models> {
    if config.inference_cores > 0 && config.inference_cpus.is_empty() {
        anyhow::bail!("--inference-cores: the cores are not set apart yet (cores::reserve, before the async runtime starts)");
    }
    init_onnx_runtime(&config.onnxruntime)?;
    let models = Models::new();
    models.set_memory_bound((config.model_memory_mib > 0).then_some(config.model_memory_mib << 20));
    models.insert(load_model(config, &ImageModelConfig::centerface(&config.model, config.max_batch), models.arbiter())?);
    for (name, path) in config.extra_models.iter().filter(|(name, _)| !name.is_empty()) {
        if models.contains(name) {
            anyhow::bail!("--extra-model: two models named {name}");
        }
        if !path.exists() && format!("{name}={}", path.display()) == crate::config::DEFAULT_EXTRA_MODEL {
            tracing::warn!(model = %name, path = %path.display(), "model file absent (deploy/setup.sh makes it); not served");
            continue;
        }
        let model = ImageModelConfig { name: name.clone(), ..ImageModelConfig::centerface(path, config.max_batch) };
        add_on_demand(&models, config, model).with_context(|| format!("model {name} ({})", path.display()))?;
    }
    Ok(models)
}

/// Adds a model loaded on demand: loaded now when it fits under the bound
/// (which also checks that it loads), else at its first call.
fn add_on_demand(models: &Models, config: &EngineConfig, model: ImageModelConfig) -> anyhow::Result<()> {
    let bytes = footprint(&model.path, config)?;
    let loader = Arc::new(OnnxLoader { config: config.clone(), model });
    let loaded = loader.load(models.arbiter()).map_err(anyhow::Error::msg)?;
    let spec = loaded.batcher.spec().clone();
    match models.insert_on_demand(spec.clone(), bytes, Arc::clone(&loader) as Arc<dyn ModelLoader>, Some(loaded)) {
        Ok(()) => Ok(()),
        Err(InferError::ModelMemory(why)) => {
            tracing::info!(model = %spec.name, %why, "model not kept loaded at start: loaded at its first call");
            models.insert_on_demand(spec, bytes, loader, None).map_err(anyhow::Error::from)
        }
        Err(e) => Err(e.into()),
    }
}

/// What a model counts against the model-memory bound while loaded: per
/// session, its weights three times over (the file's, ONNX Runtime's
/// initializers, their prepacked copies) and [`SESSION_OVERHEAD`].
fn footprint(path: &Path, config: &EngineConfig) -> anyhow::Result<u64> {
    let file = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?.len();
    Ok(footprint_of(file, config))
}

/// [`footprint`] of a file of `file` bytes.
fn footprint_of(file: u64, config: &EngineConfig) -> u64 {
    let sessions = config.devices.iter().map(|d| if d.kind().info().host_cpu { config.workers().max(1) } else { 1 }).sum::<usize>();
    (file.saturating_mul(3).saturating_add(SESSION_OVERHEAD)).saturating_mul(sessions.max(1) as u64)
}

/// Opens the repository's model files (see [`ModelOpener`]) as this
/// node's flags configure its devices; the gate runs on one CPU session.
pub struct OnnxOpener {
    config: EngineConfig,
}

impl OnnxOpener {
    /// An opener for the devices and settings of `config`.
    pub fn new(config: &EngineConfig) -> Self {
        Self { config: config.clone() }
    }

    /// One CPU session on the model at `path`.
    fn one_session(&self, name: &str, path: &Path) -> anyhow::Result<Box<dyn Backend>> {
        let model = ImageModelConfig { name: name.to_owned(), ..ImageModelConfig::centerface(path, 1) };
        let options = OpenOptions { cpu_workers: 1, cpu_threads: self.config.threads_per_worker(), ..OpenOptions::default() };
        device::open(DeviceKind::Cpu.into(), &model, &options)?.pop().context("no session")
    }
}

impl ModelOpener for OnnxOpener {
    fn footprint(&self, file_bytes: u64) -> u64 {
        footprint_of(file_bytes, &self.config)
    }

    fn load(&self, name: &str, path: &Path, arbiter: &Arbiter) -> Result<Loaded, String> {
        let model = ImageModelConfig { name: name.to_owned(), ..ImageModelConfig::centerface(path, self.config.max_batch) };
        load_model(&self.config, &model, arbiter).map(Loaded::new).map_err(|e| format!("{e:#}"))
    }

    fn examine(&self, path: &Path) -> Result<Accuracy, String> {
        let mut reference = self.one_session("centerface", &self.config.model).map_err(|e| format!("the reference model: {e:#}"))?;
        let mut candidate = self.one_session("centerface", path).map_err(|e| format!("it does not load as an ONNX model: {e:#}"))?;
        if candidate.spec() != reference.spec() {
            return Err(format!(
                "its input and outputs are not CenterFace's: {:?} → {:?}, where the reference has {:?} → {:?}",
                candidate.spec().input,
                candidate.spec().outputs,
                reference.spec().input,
                reference.spec().outputs
            ));
        }
        gate::measure(&mut *reference, &mut *candidate).map_err(|e| format!("{e:#}"))
    }
}

/// Opens a model from its file on every configured device (see [`ModelLoader`]).
struct OnnxLoader {
    config: EngineConfig,
    model: ImageModelConfig,
}

impl ModelLoader for OnnxLoader {
    fn load(&self, arbiter: &Arbiter) -> Result<Loaded, String> {
        load_model(&self.config, &self.model, arbiter).map(Loaded::new).map_err(|e| format!("{e:#}"))
    }
}

/// One model's batcher over every configured device, started in `arbiter`
/// (the node's: the models share the devices, one batch at a time each).
fn load_model(config: &EngineConfig, model: &ImageModelConfig, arbiter: &Arbiter) -> anyhow::Result<Batcher> {
    let threads = config.threads_per_worker();
    let options = OpenOptions {
        cpu_workers: config.workers(),
        cpu_threads: threads,
        cpu_cores: config.inference_cpus.clone(),
        cache_dir: model.path.parent().map(|dir| dir.join("tensorrt-cache")),
    };
    let mut backends = Vec::new();
    for spec in &config.devices {
        backends.extend(device::open(*spec, model, &options)?);
    }
    let batcher = Batcher::start_in(arbiter, backends, &batcher_config(config))?;
    for (tenant, weight) in &config.tenant_weights {
        batcher.set_tenant_weight(tenant, *weight);
    }
    tracing::info!(model = %batcher.spec().name, devices = ?config.devices, cpu_workers = config.workers(), threads, inference_cores = ?config.inference_cpus, max_batch = batcher.spec().max_batch, "model loaded");
    Ok(batcher)
}

/// The batcher settings an engine config asks for.
pub fn batcher_config(config: &EngineConfig) -> BatcherConfig {
    BatcherConfig {
        max_batch: config.max_batch,
        queue_capacity: config.queue_capacity,
        tenant_capacity: config.tenant_queue_capacity,
        max_delay: std::time::Duration::from_micros(config.batch_delay_us),
        sizing: config.batch_sizing,
    }
}
