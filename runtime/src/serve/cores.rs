//! Cores set apart for CPU inference (`--inference-cores`): the CPU device
//! workers and their ONNX Runtime threads on some cores, every other thread
//! of the gateway (the tenants' handlers, HTTP, compiling) on the others.
//!
//! On a machine whose cores all do both, a request's handler work and its
//! inference take turns on the same cores, so a tenant's heavy handlers
//! slow every tenant's inference, and the gateway's throughput is the
//! engine's times E / (E + G) (E, G: a request's inference and handler CPU
//! time). With inference on cores of its own it is the layout of an
//! accelerator: the handlers only have to feed the device faster than it
//! consumes.

use anyhow::{Context, bail};
use facegate_host_gpu::affinity;

use crate::config::EngineConfig;
use facegate_host_gpu::DeviceKind;

/// How the process's cores are split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// Cores of the CPU device workers and their ONNX Runtime threads.
    pub inference: Vec<usize>,
    /// Cores of everything else.
    pub handlers: Vec<usize>,
}

/// Splits `allowed` (the cores the process may use, ascending): the last
/// `n` for inference, the others for the handlers, who must keep one.
pub fn split(allowed: &[usize], n: usize) -> anyhow::Result<Split> {
    if n >= allowed.len() {
        bail!("--inference-cores {n} leaves no core for the handlers: this process may use {} core(s) ({allowed:?})", allowed.len());
    }
    let (handlers, inference) = allowed.split_at(allowed.len() - n);
    Ok(Split { inference: inference.to_vec(), handlers: handlers.to_vec() })
}

/// Sets `config.inference_cores` cores apart for CPU inference: pins the
/// calling thread, and so every thread it creates afterwards (the async
/// runtime's workers, the compile pool, the epoch ticker), to the other
/// cores, and records the reserved ones in `config.inference_cpus`, where
/// the CPU workers take them from. Call it before starting the async
/// runtime. Nothing to do when no cores are asked for or they are already
/// set apart.
pub fn reserve(config: &mut EngineConfig) -> anyhow::Result<Option<Split>> {
    if config.inference_cores == 0 || !config.inference_cpus.is_empty() {
        return Ok(None);
    }
    if !config.devices.iter().any(|device| device.kind().info().host_cpu) {
        bail!("--inference-cores reserves cores for CPU inference, but no {} device is configured (--devices)", host_cpu_kinds());
    }
    let allowed = affinity::allowed_cores().context("cannot read which cores this process may use (--inference-cores)")?;
    let split = split(&allowed, config.inference_cores)?;
    affinity::pin_current_thread(&split.handlers).context("cannot keep the handlers off the inference cores")?;
    config.inference_cpus.clone_from(&split.inference);
    tracing::info!(inference = ?split.inference, handlers = ?split.handlers, "cores reserved for CPU inference");
    Ok(Some(split))
}

/// The kinds that compute on the host's CPU, as `--devices` spells them:
/// `` `cpu` ``.
fn host_cpu_kinds() -> String {
    let names: Vec<String> =
        DeviceKind::ALL.iter().map(|kind| kind.info()).filter(|kind| kind.host_cpu).map(|kind| format!("`{}`", kind.name)).collect();
    names.join(" or ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_cores_go_to_inference_and_one_is_left_to_the_handlers() {
        let split = split(&[0, 1, 2, 3], 3).unwrap();
        assert_eq!(split, Split { inference: vec![1, 2, 3], handlers: vec![0] });
        // A process confined to some cores (taskset, a cpuset) splits those.
        let split = super::split(&[2, 5, 7], 1).unwrap();
        assert_eq!(split, Split { inference: vec![7], handlers: vec![2, 5] });
        let err = super::split(&[0, 1], 2).unwrap_err().to_string();
        assert!(err.contains("no core for the handlers"), "{err}");
    }

    /// Reserving pins the calling thread (and what it starts) to the
    /// handlers' cores and hands the others to the CPU workers.
    #[cfg(target_os = "linux")]
    #[test]
    fn reserving_pins_the_calling_thread_and_its_children_to_the_handler_cores() {
        let allowed = affinity::allowed_cores().unwrap();
        let mut config = crate::config::ServeConfig::with_data_dir("unused".into()).unwrap().engine;
        config.inference_cores = 1;
        let (result, own, child) = std::thread::spawn(move || {
            let result = reserve(&mut config).map(|split| (split, config));
            let child = std::thread::spawn(|| affinity::allowed_cores().unwrap()).join().unwrap();
            (result, affinity::allowed_cores().unwrap(), child)
        })
        .join()
        .unwrap();
        if allowed.len() < 2 {
            assert!(result.is_err(), "one core cannot be split");
            return;
        }
        let (split, config) = result.unwrap();
        let split = split.expect("one core reserved");
        assert_eq!(split.inference, vec![*allowed.last().unwrap()]);
        assert_eq!(config.inference_cpus, split.inference);
        assert_eq!(config.workers(), 1);
        assert_eq!(config.threads_per_worker(), 1, "the workers' threads default to the reserved cores");
        assert_eq!(own, split.handlers);
        assert_eq!(child, split.handlers, "threads started afterwards (the runtime's) keep off the inference cores");
        assert_eq!(affinity::allowed_cores().unwrap(), allowed, "only the thread that reserved (and its children) moved");
    }

    #[test]
    fn reserving_needs_a_cpu_device() {
        let mut config = crate::config::ServeConfig::with_data_dir("unused".into()).unwrap().engine;
        config.inference_cores = 1;
        config.devices = vec!["cuda:0".parse().unwrap()];
        let err = reserve(&mut config).unwrap_err().to_string();
        assert!(err.contains("no `cpu` device"), "{err}");
        config.inference_cores = 0;
        assert!(reserve(&mut config).unwrap().is_none(), "nothing asked, nothing done");
    }
}
