//! The ONNX Runtime backend on the real CenterFace model, against outputs
//! that Python's onnxruntime produced from the model as shipped
//! (deploy/scripts/make_reference.py).

use std::path::PathBuf;

use facegate_host_gpu::backend::Backend;
use facegate_host_gpu::backend::onnx::{ImageModelConfig, OnnxBackend, init_onnx_runtime};
use facegate_host_gpu::device::{DeviceKind, OpenOptions};
use facegate_host_gpu::{ElementType, Tensor};

const H: usize = 192;
const W: usize = 160;

/// The runtime library and prepared model that `deploy/setup.sh` installs.
pub fn artifacts() -> (PathBuf, PathBuf) {
    let home = std::env::var_os("FACEGATE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.facegate"));
    let lib = std::env::var_os("ORT_DYLIB_PATH").map(PathBuf::from).unwrap_or_else(|| home.join("lib/libonnxruntime.so"));
    let model = home.join("models/centerface.onnx");
    assert!(lib.exists() && model.exists(), "{} or {} missing: run deploy/setup.sh", lib.display(), model.display());
    (lib, model)
}

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A CPU session's options: `threads` intra-op threads pinned to `cores`.
fn cpu(threads: usize, cores: Vec<usize>) -> OpenOptions {
    OpenOptions { cpu_threads: threads, cpu_cores: cores, ..OpenOptions::default() }
}

fn backend() -> OnnxBackend {
    let (lib, model) = artifacts();
    init_onnx_runtime(&lib).unwrap();
    OnnxBackend::new(ImageModelConfig::centerface(model, 4), DeviceKind::Cpu.into(), &cpu(2, Vec::new())).unwrap()
}

fn reference_input() -> Tensor {
    Tensor::new(vec![H, W, 3], ElementType::U8, fixture("centerface_input_192x160.u8")).unwrap()
}

fn max_abs_diff(outputs: &[Tensor], reference: &[f32]) -> f32 {
    let ours: Vec<f32> = outputs.iter().flat_map(|t| t.to_f32_vec().unwrap()).collect();
    assert_eq!(ours.len(), reference.len());
    ours.iter().zip(reference).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}

fn reference_output() -> Vec<f32> {
    fixture("centerface_output_192x160.f32").chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

#[test]
fn raw_outputs_match_onnxruntime_reference() {
    let mut backend = backend();
    let input = reference_input();
    let outputs = backend.run(&[&input]).unwrap().remove(0);
    let shapes: Vec<&[usize]> = outputs.iter().map(|t| t.shape()).collect();
    assert_eq!(shapes, vec![&[1, 48, 40][..], &[2, 48, 40], &[2, 48, 40], &[10, 48, 40]]);
    let diff = max_abs_diff(&outputs, &reference_output());
    assert!(diff <= 1e-3, "max abs diff {diff}");
}

#[test]
fn each_sample_of_a_batch_gets_its_own_outputs() {
    let mut backend = backend();
    let input = reference_input();
    let blank = Tensor::new(vec![H, W, 3], ElementType::U8, vec![0; H * W * 3]).unwrap();
    let outputs = backend.run(&[&blank, &input, &blank]).unwrap();
    assert_eq!(outputs.len(), 3);
    let diff = max_abs_diff(&outputs[1], &reference_output());
    assert!(diff <= 1e-3, "batched sample differs from reference by {diff}");
    assert_eq!(outputs[0], outputs[2], "identical inputs give identical outputs");
    assert_ne!(outputs[0], outputs[1]);
}

#[test]
fn missing_model_is_a_clear_error() {
    let (lib, _) = artifacts();
    init_onnx_runtime(&lib).unwrap();
    let config = ImageModelConfig::centerface("/nonexistent/model.onnx", 1);
    let err = OnnxBackend::new(config, DeviceKind::Cpu.into(), &cpu(1, Vec::new())).err().unwrap();
    assert!(err.0.contains("/nonexistent/model.onnx"), "{err}");
}

/// Threads of this process named `ort-intra-op` that may run only on `cores`.
#[cfg(target_os = "linux")]
fn pool_threads_on(cores: &[usize]) -> usize {
    let list = cores.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let tasks = std::fs::read_dir("/proc/self/task").unwrap();
    tasks
        .filter_map(|task| {
            let path = task.ok()?.path();
            let name = std::fs::read_to_string(path.join("comm")).ok()?;
            let status = std::fs::read_to_string(path.join("status")).ok()?;
            let allowed = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?.trim().to_owned();
            (name.trim() == "ort-intra-op" && allowed == list).then_some(())
        })
        .count()
}

/// A CPU session given cores of its own (`--inference-cores`) runs its
/// pool thread and its worker thread only there, and computes the same.
#[cfg(target_os = "linux")]
#[test]
fn a_session_with_cores_of_its_own_runs_only_there() {
    use facegate_host_gpu::affinity::allowed_cores;
    let (lib, model) = artifacts();
    init_onnx_runtime(&lib).unwrap();
    // The first core: other tests' unpinned pool threads may use every core.
    let first = allowed_cores().unwrap()[0];
    let before = pool_threads_on(&[first]);
    let mut backend = OnnxBackend::new(ImageModelConfig::centerface(model, 4), DeviceKind::Cpu.into(), &cpu(2, vec![first])).unwrap();
    assert_eq!(pool_threads_on(&[first]), before + 1, "two threads: the worker and one pool thread, pinned");
    let (worker_cores, outputs) = std::thread::spawn(move || {
        backend.on_worker_thread();
        let outputs = backend.run(&[&reference_input()]).unwrap().remove(0);
        (allowed_cores().unwrap(), outputs)
    })
    .join()
    .unwrap();
    assert_eq!(worker_cores, vec![first]);
    let diff = max_abs_diff(&outputs, &reference_output());
    assert!(diff <= 1e-3, "max abs diff {diff}");
}
