//! The host side of the `face-detect` WIT interface: a thin adapter from
//! guest calls onto host-gpu's batchers, enforcing per-request policy
//! (call budget, deadline) before any work reaches an engine.
//!
//! Shape follows wasmtime's WASI crates: a per-store [`FaceDetectCtx`], a
//! borrowed [`FaceDetectView`] that implements the generated `Host` trait,
//! and [`add_to_linker`].

mod bindings;
mod profile;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use facegate_host_gpu::queue::sample_cost;
use facegate_host_gpu::{CallOptions, InferError, InferRequest, ModelSpec, Models, TensorSpec};
use opentelemetry::{Array, KeyValue, Value};
use wasmtime::component::{HasData, Linker};

use self::bindings::facegate::face_detect::face_detect as wit;
use crate::admission::memory::Charge;
use crate::admission::models::ModelAllow;
use crate::telemetry::trace::RequestTrace;
use crate::telemetry::usage::{ByModel, Meter, ModelUsage, Usage, UsageKey};

pub use self::profile::{CallProfile, Habits};

/// Per-request state of the `face-detect` capability.
pub struct FaceDetectCtx {
    models: Models,
    tenant: Arc<str>,
    profile: Arc<CallProfile>,
    /// When the request started, its first call was made and its last
    /// call answered: what the handler's [`CallProfile`] learns from.
    started: Instant,
    first_call: Option<Instant>,
    last_answer: Option<Instant>,
    /// This request's share of device time on each model it called, µs
    /// (the batcher adds to it), and the calls each answered with outputs.
    per_model: Vec<ModelMeter>,
    /// Where this request's usage goes, until [`FaceDetectCtx::settle`].
    meter: Option<(Arc<Meter>, UsageKey)>,
    deadline: Instant,
    calls_left: u32,
    /// The models the tenant may call (its limit `models`).
    allowed: ModelAllow,
    /// Time this request spent inside `infer` (queueing + device).
    pub infer_time: Duration,
    /// `infer` calls refused for the per-request call budget.
    pub quota_refusals: u32,
    /// `infer` calls refused because the queue (global or the tenant's) was full.
    pub overloaded_refusals: u32,
    /// `infer` calls refused because the work ahead would outlast the deadline.
    pub backlog_refusals: u32,
    /// `infer` calls refused because the node's memory budget could not
    /// hold their input while it waits for a batch.
    pub memory_refusals: u32,
    /// The input of the call in flight, in the node's memory budget: the
    /// host's copy waits in the batcher's queue, outside the guest's memory.
    memory: Charge,
    /// The guest's span: each call is an `infer` span of it.
    pub trace: RequestTrace,
}

impl FaceDetectCtx {
    /// A context for one request of `tenant`'s handler, allowed `max_calls`
    /// inferences of the `allowed` models before `deadline`; each call's input is charged to
    /// `memory` (a charge of the tenant's) while it is in flight, and each
    /// call is noted in the handler's `profile`.
    pub fn new(
        models: Models,
        (tenant, profile): (Arc<str>, Arc<CallProfile>),
        (deadline, max_calls, allowed): (Instant, u32, ModelAllow),
        memory: Charge,
    ) -> Self {
        Self {
            models,
            tenant,
            profile,
            started: Instant::now(),
            first_call: None,
            last_answer: None,
            per_model: Vec::new(),
            meter: None,
            deadline,
            calls_left: max_calls,
            allowed,
            infer_time: Duration::ZERO,
            quota_refusals: 0,
            overloaded_refusals: 0,
            backlog_refusals: 0,
            memory_refusals: 0,
            memory,
            trace: RequestTrace::default(),
        }
    }
}

impl FaceDetectCtx {
    /// Meters this request as `key` in `meter` (see [`FaceDetectCtx::settle`]).
    pub fn meter_as(&mut self, meter: Arc<Meter>, key: UsageKey) {
        self.meter = Some((meter, key));
    }

    /// Adds this request's guest time (its instance's time less its waits
    /// for inference), device time, calls and the instance's
    /// `memory_bytes` to its meter, once; a request that never settles (it
    /// was stopped) is metered when its context drops, without memory.
    pub fn settle(&mut self, memory_bytes: usize) {
        let Some((meter, key)) = self.meter.take() else { return };
        let guest = self.started.elapsed().saturating_sub(self.infer_time);
        let by_model: ByModel = self.per_model.iter().map(ModelMeter::read).filter(|(_, u)| *u != ModelUsage::default()).collect();
        let usage = Usage {
            guest_us: u64::try_from(guest.as_micros()).unwrap_or(u64::MAX),
            device_us: by_model.values().map(|u| u.device_us).fold(0, u64::saturating_add),
            infer_calls: by_model.values().map(|u| u.infer_calls).sum(),
            peak_memory_bytes: memory_bytes as u64,
            ..Usage::default()
        };
        meter.add(&key, &usage);
        meter.add_models(&key, &by_model);
    }

    /// The meter of this request's calls to `model`, if the node serves it
    /// (the name is then bounded and one of few): a guest's made-up names
    /// hold nothing here.
    fn model_meter(&mut self, model: &str) -> Option<&mut ModelMeter> {
        match self.per_model.iter().position(|m| m.model == model) {
            Some(i) => self.per_model.get_mut(i),
            None if self.models.contains(model) => {
                self.per_model.push(ModelMeter { model: model.to_owned(), device_us: Arc::default(), calls: 0 });
                self.per_model.last_mut()
            }
            None => None,
        }
    }

    /// The request's guest ended: teaches the handler's profile how long
    /// it worked before its first call and after its last.
    pub fn ended(&self) {
        if let (Some(first), Some(last)) = (self.first_call, self.last_answer) {
            self.profile.timed(first.saturating_duration_since(self.started), last.elapsed());
        }
    }
}

/// One model's part of a request: its device time, µs (the batcher adds to
/// it, even after the call returned), and the calls it answered.
#[derive(Debug)]
struct ModelMeter {
    model: String,
    device_us: Arc<AtomicU64>,
    calls: u64,
}

impl ModelMeter {
    fn read(&self) -> (String, ModelUsage) {
        (self.model.clone(), ModelUsage { device_us: self.device_us.load(Ordering::Relaxed), infer_calls: self.calls })
    }
}

impl Drop for FaceDetectCtx {
    fn drop(&mut self) {
        // Stopped (deadline, client gone) before it settled: its device time was spent all the same.
        self.settle(0);
    }
}

/// A borrowed view of [`FaceDetectCtx`]; the generated `Host` trait is implemented on it.
pub struct FaceDetectView<'a> {
    ctx: &'a mut FaceDetectCtx,
}

impl<'a> FaceDetectView<'a> {
    /// Borrows a context.
    pub fn new(ctx: &'a mut FaceDetectCtx) -> Self {
        Self { ctx }
    }
}

struct FaceDetect;

impl HasData for FaceDetect {
    type Data<'a> = FaceDetectView<'a>;
}

/// Adds `facegate:face-detect/face-detect` to a linker; `get` projects the store's view.
pub fn add_to_linker<T: Send + 'static>(linker: &mut Linker<T>, get: fn(&mut T) -> FaceDetectView<'_>) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, FaceDetect>(linker, get)
}

impl wit::Host for FaceDetectView<'_> {
    async fn models(&mut self) -> wasmtime::Result<Vec<wit::ModelInfo>> {
        let allowed = self.ctx.allowed;
        Ok(self.ctx.models.specs().iter().filter(|spec| allowed.allows(&spec.name)).map(model_info).collect())
    }

    async fn infer(&mut self, model: String, input: wit::Tensor) -> wasmtime::Result<Result<Vec<wit::Tensor>, wit::Error>> {
        if self.ctx.calls_left == 0 {
            self.ctx.quota_refusals += 1;
            let now = Instant::now();
            self.ctx.trace.failed("infer", (now, now), "infer_calls");
            return Ok(Err(wit::Error::QuotaExceeded("this request has used all its face-detect calls".into())));
        }
        self.ctx.calls_left -= 1;
        if !self.ctx.allowed.allows(&model) {
            let now = Instant::now();
            self.ctx.trace.failed("infer", (now, now), "models");
            return Ok(Err(not_allowed(&model)));
        }
        let input = match to_host_tensor(input) {
            Ok(t) => t,
            Err(e) => return Ok(Err(e)),
        };
        if self.ctx.memory.resize(input.data().len()).is_err() {
            self.ctx.memory_refusals += 1;
            let now = Instant::now();
            self.ctx.trace.failed("infer", (now, now), "memory_budget");
            return Ok(Err(wit::Error::Overloaded));
        }
        let cost = sample_cost(input.shape());
        self.ctx.profile.called(&model, cost);
        self.ctx.first_call.get_or_insert_with(Instant::now);
        let request = InferRequest { tenant: Arc::clone(&self.ctx.tenant), input, deadline: self.ctx.deadline };
        // Refused at once if the work ahead would leave the guest less than
        // its usual time after the call.
        let span = self.ctx.trace.start("infer", || infer_attributes(&model, &request));
        let device_us = self.ctx.model_meter(&model).map(|m| Arc::clone(&m.device_us));
        let options = CallOptions { device_us, keep: self.ctx.profile.after(), tag: span.call_tag() };
        let started = Instant::now();
        let result = self.ctx.models.infer_with(&model, request, options).await;
        if let Err(err) = &result {
            span.trace().set([KeyValue::new("error.type", err.kind())]);
            span.trace().fail(err.to_string());
        }
        drop(span);
        if result.is_ok()
            && let Some(meter) = self.ctx.model_meter(&model)
        {
            meter.calls += 1;
        }
        // Shrinking always succeeds.
        let _ = self.ctx.memory.resize(0);
        self.ctx.infer_time += started.elapsed();
        self.ctx.last_answer = Some(Instant::now());
        self.ctx.overloaded_refusals += u32::from(matches!(result, Err(InferError::Overloaded)));
        self.ctx.backlog_refusals += u32::from(matches!(result, Err(InferError::Backlog { .. })));
        Ok(result.map(|outputs| outputs.into_iter().map(to_wit_tensor).collect()).map_err(to_wit_error))
    }
}

/// A model outside the tenant's limit `models`: to the handler, one the
/// host does not serve, named with the limit that hides it.
fn not_allowed(model: &str) -> wit::Error {
    let shown: String = model.chars().take(crate::admission::models::MAX_MODEL_NAME).collect();
    wit::Error::UnknownModel(format!("{shown} (not among the models this tenant may call: its limit `models`)"))
}

/// What an `infer` span records of its call (when traced).
fn infer_attributes(model: &str, request: &InferRequest) -> Vec<KeyValue> {
    let shape: Vec<i64> = request.input.shape().iter().map(|&d| i64::try_from(d).unwrap_or(i64::MAX)).collect();
    vec![KeyValue::new("facegate.model", model.to_owned()), KeyValue::new("facegate.input.shape", Value::Array(Array::I64(shape)))]
}

/// Most dimensions an input tensor may have. A longer shape is refused
/// before the host converts or describes it: a guest can pass millions.
const MAX_RANK: usize = 8;

fn to_host_tensor(t: wit::Tensor) -> Result<facegate_host_gpu::Tensor, wit::Error> {
    if t.shape.len() > MAX_RANK {
        return Err(wit::Error::InvalidInput(format!("a tensor has at most {MAX_RANK} dimensions, this one has {}", t.shape.len())));
    }
    let shape = t.shape.into_iter().map(|d| d as usize).collect();
    facegate_host_gpu::Tensor::new(shape, element_from_wit(t.element), t.data).map_err(|e| wit::Error::InvalidInput(e.to_string()))
}

fn to_wit_tensor(t: facegate_host_gpu::Tensor) -> wit::Tensor {
    let (shape, element, data) = t.into_parts();
    wit::Tensor { shape: shape.into_iter().map(saturating_u32).collect(), element: element_to_wit(element), data }
}

fn element_from_wit(e: wit::ElementType) -> facegate_host_gpu::ElementType {
    match e {
        wit::ElementType::U8 => facegate_host_gpu::ElementType::U8,
        wit::ElementType::F32 => facegate_host_gpu::ElementType::F32,
    }
}

fn element_to_wit(e: facegate_host_gpu::ElementType) -> wit::ElementType {
    match e {
        facegate_host_gpu::ElementType::U8 => wit::ElementType::U8,
        facegate_host_gpu::ElementType::F32 => wit::ElementType::F32,
    }
}

fn to_wit_error(e: InferError) -> wit::Error {
    match e {
        InferError::InvalidInput(m) => wit::Error::InvalidInput(m),
        InferError::UnknownModel(m) => wit::Error::UnknownModel(m),
        InferError::Overloaded | InferError::Backlog { .. } | InferError::ShuttingDown => wit::Error::Overloaded,
        InferError::ModelMemory(m) => {
            // The operator's bound, not the tenant's doing: retry later.
            tracing::warn!(error = %m, "model not loadable under the model-memory bound");
            wit::Error::Overloaded
        }
        InferError::DeadlineExceeded => wit::Error::DeadlineExceeded,
        InferError::Backend(m) => {
            // The engine's own message (paths, library internals) stays in the log.
            tracing::warn!(error = %m, "inference batch failed");
            wit::Error::Backend("the inference engine failed on this batch".into())
        }
    }
}

fn spec_to_wit(spec: &TensorSpec) -> wit::TensorSpec {
    wit::TensorSpec {
        name: spec.name.clone(),
        shape: spec.shape.iter().map(|&d| saturating_u32(d)).collect(),
        element: element_to_wit(spec.element),
    }
}

fn model_info(spec: &ModelSpec) -> wit::ModelInfo {
    wit::ModelInfo {
        name: spec.name.clone(),
        input: spec_to_wit(&spec.input),
        outputs: spec.outputs.iter().map(spec_to_wit).collect(),
        dim_multiple: saturating_u32(spec.dim_multiple),
        max_side: saturating_u32(spec.max_side),
        max_batch: saturating_u32(spec.max_batch),
    }
}

fn saturating_u32(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use facegate_host_gpu::backend::fake::FakeBackend;
    use facegate_host_gpu::{Batcher, BatcherConfig};
    use wit::Host as _;

    fn models() -> Models {
        let backend = FakeBackend::new("fake", 4, Duration::ZERO, Duration::ZERO);
        let models = Models::new();
        models.insert(Batcher::start(vec![Box::new(backend)], &BatcherConfig::default()).unwrap());
        models
    }

    fn ctx(max_calls: u32) -> FaceDetectCtx {
        ctx_in(max_calls, &crate::admission::memory::MemoryBudget::new(usize::MAX))
    }

    fn ctx_in(max_calls: u32, budget: &Arc<crate::admission::memory::MemoryBudget>) -> FaceDetectCtx {
        let deadline = Instant::now() + Duration::from_secs(5);
        FaceDetectCtx::new(models(), ("t".into(), Arc::default()), (deadline, max_calls, ModelAllow::ALL), budget.empty(&"t".into()))
    }

    fn tensor(data: Vec<u8>) -> wit::Tensor {
        wit::Tensor { shape: vec![data.len() as u32], element: wit::ElementType::U8, data }
    }

    #[tokio::test]
    async fn infer_reaches_the_batcher() {
        let mut ctx = ctx(4);
        let out = FaceDetectView::new(&mut ctx).infer("fake".into(), tensor(vec![2, 3])).await.unwrap().unwrap();
        assert_eq!(out[0].data, 5f32.to_le_bytes().to_vec());
    }

    #[tokio::test]
    async fn malformed_tensor_is_a_clean_error() {
        let mut ctx = ctx(4);
        let bad = wit::Tensor { shape: vec![10], element: wit::ElementType::U8, data: vec![0; 3] };
        let err = FaceDetectView::new(&mut ctx).infer("fake".into(), bad).await.unwrap().unwrap_err();
        assert!(matches!(err, wit::Error::InvalidInput(m) if m.contains("needs 10 bytes")));
        let huge = wit::Tensor { shape: vec![u32::MAX, u32::MAX, u32::MAX], element: wit::ElementType::F32, data: vec![] };
        let err = FaceDetectView::new(&mut ctx).infer("fake".into(), huge).await.unwrap().unwrap_err();
        assert!(matches!(err, wit::Error::InvalidInput(_)));
    }

    #[tokio::test]
    async fn unknown_model_is_named() {
        let mut ctx = ctx(4);
        let err = FaceDetectView::new(&mut ctx).infer("nope".into(), tensor(vec![1])).await.unwrap().unwrap_err();
        assert!(matches!(err, wit::Error::UnknownModel(m) if m == "nope"));
    }

    #[tokio::test]
    async fn call_budget_is_enforced() {
        let mut ctx = ctx(1);
        let mut view = FaceDetectView::new(&mut ctx);
        assert!(view.infer("fake".into(), tensor(vec![1])).await.unwrap().is_ok());
        let err = view.infer("fake".into(), tensor(vec![1])).await.unwrap().unwrap_err();
        assert!(matches!(err, wit::Error::QuotaExceeded(_)));
    }

    #[tokio::test]
    async fn an_input_the_node_cannot_hold_is_refused_and_a_call_gives_its_charge_back() {
        let budget = crate::admission::memory::MemoryBudget::new(1 << 20);
        let mut ctx = ctx_in(4, &budget);
        let mut view = FaceDetectView::new(&mut ctx);
        let err = view.infer("fake".into(), tensor(vec![1; 2 << 20])).await.unwrap().unwrap_err();
        assert!(matches!(err, wit::Error::Overloaded));
        assert!(view.infer("fake".into(), tensor(vec![1; 4096])).await.unwrap().is_ok());
        assert_eq!(budget.used(), 0, "the input's charge ends with its call");
        assert_eq!(ctx.memory_refusals, 1);
    }

    #[tokio::test]
    async fn a_model_outside_the_tenants_list_is_unknown_to_it_and_unlisted() {
        let deadline = Instant::now() + Duration::from_secs(5);
        let budget = crate::admission::memory::MemoryBudget::new(usize::MAX);
        let only_other: ModelAllow = "other".parse().unwrap();
        let mut ctx = FaceDetectCtx::new(models(), ("t".into(), Arc::default()), (deadline, 4, only_other), budget.empty(&"t".into()));
        let mut view = FaceDetectView::new(&mut ctx);
        let err = view.infer("fake".into(), tensor(vec![1])).await.unwrap().unwrap_err();
        assert!(matches!(&err, wit::Error::UnknownModel(m) if m.starts_with("fake (") && m.contains("`models`")), "{err:?}");
        assert!(view.models().await.unwrap().is_empty());
        assert!(ctx.per_model.is_empty(), "nothing metered for a model it may not call");
    }

    /// A request's device time and calls are metered whole and per model;
    /// a name the node does not serve is metered nowhere.
    #[tokio::test]
    async fn usage_names_the_model_of_each_call() {
        let models = Models::new();
        for name in ["fp32", "int8"] {
            let backend = FakeBackend::new(name, 4, Duration::from_millis(2), Duration::ZERO);
            models.insert(Batcher::start_in(models.arbiter(), vec![Box::new(backend)], &BatcherConfig::default()).unwrap());
        }
        let budget = crate::admission::memory::MemoryBudget::new(usize::MAX);
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut ctx = FaceDetectCtx::new(models, ("t".into(), Arc::default()), (deadline, 8, ModelAllow::ALL), budget.empty(&"t".into()));
        let (meter, key) = (Meter::new("n".into()), UsageKey::new("t", "detect", 1, 0));
        ctx.meter_as(Arc::clone(&meter), key.clone());
        let mut view = FaceDetectView::new(&mut ctx);
        for model in ["fp32", "int8", "fp32", "nope"] {
            let _ = view.infer(model.into(), tensor(vec![1])).await.unwrap();
        }
        ctx.settle(0);
        let (whole, parts) = (meter.unwritten()[&key], meter.unwritten_models()[&key].clone());
        assert_eq!(parts.keys().collect::<Vec<_>>(), ["fp32", "int8"]);
        assert_eq!((parts["fp32"].infer_calls, parts["int8"].infer_calls, whole.infer_calls), (2, 1, 3));
        assert!(parts["fp32"].device_us >= 2 * 2000 && parts["int8"].device_us >= 2000, "{parts:?}");
        assert_eq!(whole.device_us, parts["fp32"].device_us + parts["int8"].device_us);
    }

    #[tokio::test]
    async fn models_lists_specs() {
        let mut ctx = ctx(1);
        let infos = FaceDetectView::new(&mut ctx).models().await.unwrap();
        assert_eq!(infos.len(), 1);
        assert_eq!((infos[0].name.as_str(), infos[0].max_batch), ("fake", 4));
    }
}
