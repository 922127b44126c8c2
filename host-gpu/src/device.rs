//! Devices as operators name them (`cpu`, `cuda:N`, `tensorrt:N`), and the
//! engines opened on them.
//!
//! This is the one place a device kind is spelled: a new backend is its own
//! module under [`crate::backend`] plus a variant here with its name, its
//! ordinal and the arm of [`open`] that starts it.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::backend::onnx::{Device, ImageModelConfig, OnnxBackend};
use crate::backend::{Backend, BackendError};

/// One device of `--devices`: where a model's batches may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceSpec {
    /// The host's CPU, as [`OpenOptions::cpu_workers`] sessions.
    Cpu,
    /// NVIDIA GPU N through ONNX Runtime's CUDA execution provider.
    Cuda(i32),
    /// NVIDIA GPU N through TensorRT (CUDA for what TensorRT cannot run).
    TensorRt(i32),
}

impl FromStr for DeviceSpec {
    type Err = String;

    /// Parses `cpu`, `cuda:N` or `tensorrt:N` (N a non-negative ordinal).
    fn from_str(s: &str) -> Result<Self, String> {
        let ordinal = |n: &str| n.parse::<i32>().ok().filter(|n| *n >= 0).ok_or_else(|| format!("bad device ordinal in {s:?}"));
        match s.split_once(':') {
            None if s == "cpu" => Ok(Self::Cpu),
            Some(("cuda", n)) => Ok(Self::Cuda(ordinal(n)?)),
            Some(("tensorrt", n)) => Ok(Self::TensorRt(ordinal(n)?)),
            _ => Err(format!("unknown device {s:?}: use cpu, cuda:N or tensorrt:N")),
        }
    }
}

impl fmt::Display for DeviceSpec {
    /// The spelling [`DeviceSpec::from_str`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
            Self::TensorRt(n) => write!(f, "tensorrt:{n}"),
        }
    }
}

/// How devices are set up when opened: the CPU's share of sessions and
/// threads, and where engines cache what they build.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Sessions (device workers) on the CPU, each pulling its own batches.
    pub cpu_workers: usize,
    /// Intra-op threads per CPU session.
    pub cpu_threads: usize,
    /// Cores the CPU sessions are pinned to; empty: not pinned.
    pub cpu_cores: Vec<usize>,
    /// TensorRT's engine and timing cache, so restarts skip the build.
    pub cache_dir: Option<PathBuf>,
}

/// Opens `model` on `spec`: one backend per device worker (one per GPU,
/// [`OpenOptions::cpu_workers`] on the CPU). ONNX Runtime must have been
/// loaded ([`crate::backend::onnx::init_onnx_runtime`]).
pub fn open(spec: DeviceSpec, model: &ImageModelConfig, options: &OpenOptions) -> Result<Vec<Box<dyn Backend>>, BackendError> {
    let devices = match spec {
        DeviceSpec::Cpu => {
            let cpu = Device::Cpu { threads: options.cpu_threads.max(1), cores: options.cpu_cores.clone() };
            vec![cpu; options.cpu_workers.max(1)]
        }
        DeviceSpec::Cuda(device_id) => vec![Device::Cuda { device_id }],
        DeviceSpec::TensorRt(device_id) => vec![Device::TensorRt { device_id, cache_dir: options.cache_dir.clone() }],
    };
    devices
        .iter()
        .map(|device| {
            let backend =
                OnnxBackend::new(model.clone(), device).map_err(|e| BackendError(format!("cannot start the model on {spec}: {e}")))?;
            Ok(Box::new(backend) as Box<dyn Backend>)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_device_reads_back_as_it_is_written() {
        for spec in [DeviceSpec::Cpu, DeviceSpec::Cuda(0), DeviceSpec::TensorRt(3)] {
            assert_eq!(spec.to_string().parse::<DeviceSpec>(), Ok(spec));
        }
        assert_eq!("cuda:1".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(1)));
    }

    #[test]
    fn unknown_devices_and_bad_ordinals_are_refused_with_the_spelling() {
        for bad in ["gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "tensorrt:1.5", ""] {
            let err = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{bad}: {err}");
        }
    }
}
