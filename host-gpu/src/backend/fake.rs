//! A backend with a GPU-like cost model, `a + b·n` per batch of `n`, for
//! tests and benchmarks of the batching machinery. Never served to users.
//! With [`FakeBackend::crowding`] its cost model becomes CPU-like instead:
//! each sample of a batch costs more the larger the batch (caches
//! overflow). It still reports itself as an accelerator
//! (`runs_on_cpu` false: it starts at `max_batch` and is timed by wall time).
//! With [`FakeBackend::size_cost`] each sample also costs time in proportion
//! to its size, as large images do on a real device.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::{Backend, BackendError};
use crate::model::{ModelSpec, TensorSpec};
use crate::tensor::{ElementType, Tensor};

/// Sleeps `fixed + per_sample·n·(1 + crowding·(n−1)) + per_million·elements/10⁶`
/// per batch of `n` samples holding `elements` input elements in all, and
/// echoes each input's bytes summed into a one-element f32 output, so tests
/// can match answers to calls.
pub struct FakeBackend {
    spec: ModelSpec,
    fixed: Duration,
    per_sample: Duration,
    /// Time per million input elements (zero unless [`FakeBackend::size_cost`]).
    per_million: Duration,
    /// Extra cost per sample for each other sample in its batch, as a
    /// fraction of `per_sample` (0 for GPU-like devices).
    crowding: f64,
    /// Batches whose index is in this set fail (for error-isolation tests).
    fail_batches: Vec<usize>,
    batches_run: Arc<AtomicUsize>,
}

impl FakeBackend {
    /// A fake model named `name` taking `[0]` u8 vectors (any length up to
    /// 2^26, enough for a flattened 4096×4096 RGB image), batching up to
    /// `max_batch`.
    pub fn new(name: &str, max_batch: usize, fixed: Duration, per_sample: Duration) -> Self {
        let spec = ModelSpec {
            name: name.to_owned(),
            input: TensorSpec { name: "x".into(), shape: vec![0], element: ElementType::U8 },
            outputs: vec![TensorSpec { name: "sum".into(), shape: vec![1], element: ElementType::F32 }],
            dim_multiple: 1,
            max_side: 1 << 26,
            max_batch,
        };
        Self { spec, fixed, per_sample, per_million: Duration::ZERO, crowding: 0.0, fail_batches: Vec::new(), batches_run: Arc::default() }
    }

    /// Makes each sample cost `per_million` more for each million elements
    /// of its input, so a sample's device time grows with its size (its
    /// pixels, for a flattened image).
    pub fn size_cost(mut self, per_million: Duration) -> Self {
        self.per_million = per_million;
        self
    }

    /// Makes each sample cost `rate × per_sample` more for each other sample
    /// in its batch, so batches cost more per sample than single runs, as
    /// ONNX Runtime's do on a small CPU at large images.
    pub fn crowding(mut self, rate: f64) -> Self {
        self.crowding = rate.max(0.0);
        self
    }

    /// The time a batch takes.
    fn cost(&self, inputs: &[&Tensor]) -> Duration {
        let n = inputs.len() as f64;
        let elements: usize = inputs.iter().map(|t| t.shape().iter().product::<usize>()).sum();
        self.fixed + self.per_sample.mul_f64(n * (1.0 + self.crowding * (n - 1.0))) + self.per_million.mul_f64(elements as f64 / 1e6)
    }

    /// Makes the batches with these zero-based indices fail.
    pub fn failing_batches(mut self, indices: &[usize]) -> Self {
        self.fail_batches = indices.to_vec();
        self
    }

    /// A counter of batches run, shared with the caller.
    pub fn batch_counter(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.batches_run)
    }
}

impl Backend for FakeBackend {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn device(&self) -> &str {
        "fake"
    }

    fn run(&mut self, inputs: &[&Tensor]) -> Result<Vec<Vec<Tensor>>, BackendError> {
        let index = self.batches_run.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.cost(inputs));
        if self.fail_batches.contains(&index) {
            return Err(BackendError(format!("injected failure in batch {index}")));
        }
        inputs.iter().map(|t| echo(t)).collect()
    }
}

fn echo(input: &Tensor) -> Result<Vec<Tensor>, BackendError> {
    let sum: f32 = input.data().iter().map(|&b| f32::from(b)).sum();
    Tensor::from_f32(vec![1], &[sum]).map(|t| vec![t]).map_err(BackendError::from_display)
}
