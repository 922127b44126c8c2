//! The batcher and device pool driven by the fake `a + b·n` backend.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use facegate_host_gpu::backend::fake::FakeBackend;
use facegate_host_gpu::backend::{Backend, BackendError};
use facegate_host_gpu::metrics::MetricsSnapshot;
use facegate_host_gpu::{
    Arbiter, BatchObserver, BatchReport, Batcher, BatcherConfig, CallOptions, CallTag, ElementType, InferError, InferRequest, ModelSpec,
    Models, Sizing, Tensor,
};

const MS: Duration = Duration::from_millis(1);

fn fake_pool(devices: usize, max_batch: usize, fixed: Duration, per_sample: Duration) -> Batcher {
    let backends = (0..devices).map(|_| Box::new(FakeBackend::new("fake", max_batch, fixed, per_sample)) as Box<dyn Backend>).collect();
    let config = BatcherConfig { max_batch, tenant_capacity: 256, ..BatcherConfig::default() };
    Batcher::start(backends, &config).unwrap()
}

fn request(tenant: &str, value: u8) -> InferRequest {
    InferRequest {
        tenant: tenant.into(),
        input: Tensor::new(vec![2], ElementType::U8, vec![value, 1]).unwrap(),
        deadline: Instant::now() + Duration::from_secs(30),
    }
}

/// Each caller gets its own answer back (the fake sums the input bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_go_back_to_their_callers() {
    let batcher = fake_pool(1, 8, 5 * MS, MS);
    let calls: Vec<_> = (0..40u8)
        .map(|i| {
            let b = batcher.clone();
            tokio::spawn(async move { (i, b.infer(request("t", i)).await) })
        })
        .collect();
    for call in calls {
        let (i, result) = call.await.unwrap();
        let sum = result.unwrap()[0].to_f32_vec().unwrap()[0];
        assert_eq!(sum, f32::from(i) + 1.0);
    }
    assert!(batcher.metrics().mean_batch_size() > 1.0, "concurrent calls were batched");
}

/// A light tenant's calls are not stuck behind a heavy one that keeps 150
/// or more calls queued: while each waited, at most three batches ran that
/// took none of the light tenant's calls (the flood's queue alone is about
/// 19 batches deep, so first come, first served would make it wait that
/// long). Fair is not zero: a call in one of the sizer's probe batches of
/// one sample is charged the whole batch's device time, about seven of its
/// estimates, and the flooding tenant then runs a batch or two of its own
/// to catch up. Batches that took an earlier call of the light tenant do
/// not count (a call waits behind its own tenant's). Counted in batches,
/// not milliseconds: on a loaded machine the clock stretches, the order of
/// batches does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_does_not_starve_a_light_one() {
    let record = Arc::new(Mutex::new(Vec::new()));
    let backends = (0..2)
        .map(|_| {
            let inner = FakeBackend::new("fake", 8, 20 * MS, MS / 2);
            Box::new(Recording { inner, batches: Arc::clone(&record) }) as Box<dyn Backend>
        })
        .collect();
    // Adaptive sizing: its probes run smaller batches now and then.
    let config = BatcherConfig { max_batch: 8, tenant_capacity: 256, ..BatcherConfig::default() };
    let batcher = Batcher::start(backends, &config).expect("batcher starts");
    let stop = Arc::new(AtomicBool::new(false));
    // Tenant "a": 200 clients that resubmit at once, so its queue stays full.
    let flood: Vec<_> = (0..200)
        .map(|_| {
            let (b, stop) = (batcher.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    b.infer(request("a", 0)).await.unwrap();
                }
            })
        })
        .collect();
    while batcher.tenant_queue_depth("a") < 150 {
        tokio::time::sleep(MS).await;
    }
    let arrived = light_tenant_calls(&batcher, &record).await;
    let a_left = batcher.tenant_queue_depth("a");
    stop.store(true, Ordering::SeqCst);
    assert!(a_left > 0, "B finished while A still had {a_left} calls queued");
    let batches = record.lock().expect("record lock").clone();
    let passed_over: Vec<usize> = arrived
        .iter()
        .map(|&(value, queued_after)| {
            let own = batches.iter().position(|values| values.contains(&value)).expect("every B call ran");
            batches[queued_after..own].iter().filter(|values| values.iter().all(|&v| v == 0)).count()
        })
        .collect();
    assert!(passed_over.iter().all(|&n| n <= 3), "batches of A alone run while each B call waited: {passed_over:?}");
    for call in flood {
        call.await.unwrap();
    }
}

/// Tenant "b" sends 20 calls (input values 1..=20), one every 13 ms (open
/// loop: arrivals are not tied to batch boundaries, as a real light
/// tenant's are not); returns each call's value with the number of batches
/// started before it was queued.
async fn light_tenant_calls(batcher: &Batcher, record: &Arc<Mutex<Vec<Vec<u8>>>>) -> Vec<(u8, usize)> {
    let calls: Vec<_> = (1..=20u8)
        .map(|value| {
            let (b, record) = (batcher.clone(), Arc::clone(record));
            tokio::spawn(async move {
                tokio::time::sleep(13 * MS * u32::from(value)).await;
                // No await between the reading and the queueing: `infer`
                // queues the call in its first poll.
                let queued_after = record.lock().expect("record lock").len();
                b.infer(request("b", value)).await.unwrap();
                (value, queued_after)
            })
        })
        .collect();
    let mut arrived = Vec::new();
    for call in calls {
        arrived.push(call.await.unwrap());
    }
    arrived
}

/// A backend that records, in the order batches start on any device, the
/// first input byte of each call in each batch.
struct Recording {
    inner: FakeBackend,
    batches: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Backend for Recording {
    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }

    fn run(&mut self, inputs: &[&Tensor]) -> Result<Vec<Vec<Tensor>>, BackendError> {
        self.batches.lock().expect("record lock").push(inputs.iter().map(|t| t.data()[0]).collect());
        self.inner.run(inputs)
    }
}

/// A backend error fails the calls of its batch only; the worker goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_batch_fails_only_its_own_calls() {
    let backend = FakeBackend::new("fake", 4, 10 * MS, Duration::ZERO).failing_batches(&[1]);
    let batches = backend.batch_counter();
    // Fixed sizing: the four doomed calls must make one batch.
    let config = BatcherConfig { max_batch: 4, sizing: Sizing::Fixed, ..Default::default() };
    let batcher = Batcher::start(vec![Box::new(backend)], &config).unwrap();
    // Batch 0: one call that occupies the device while the next four queue up.
    let first = {
        let b = batcher.clone();
        tokio::spawn(async move { b.infer(request("t", 1)).await })
    };
    while batches.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(MS).await;
    }
    let doomed: Vec<_> = (0..4)
        .map(|_| {
            let b = batcher.clone();
            tokio::spawn(async move { b.infer(request("t", 2)).await })
        })
        .collect();
    assert!(first.await.unwrap().is_ok());
    for call in doomed {
        let err = call.await.unwrap().unwrap_err();
        assert!(matches!(&err, InferError::Backend(m) if m.contains("injected failure in batch 1")), "{err}");
    }
    assert!(batcher.infer(request("t", 3)).await.is_ok(), "the batch after the failure succeeds");
    assert_eq!(batcher.metrics().samples_failed, 4);
}

/// A full queue refuses at once instead of growing: with the one device
/// busy, of 10 callers exactly the queue's 4 are admitted (and answered
/// correctly once the device frees up) and the other 6 refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_overloaded() {
    let backend = FakeBackend::new("fake", 1, 200 * MS, Duration::ZERO);
    let batches = backend.batch_counter();
    let config = BatcherConfig { max_batch: 1, queue_capacity: 4, tenant_capacity: 4, ..Default::default() };
    let batcher = Batcher::start(vec![Box::new(backend)], &config).unwrap();
    // The device is busy (for 200 ms) before the 10 callers come.
    let busy = {
        let b = batcher.clone();
        tokio::spawn(async move { b.infer(request("t", 100)).await })
    };
    while batches.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(MS).await;
    }
    let calls: Vec<_> = (0..10u8)
        .map(|i| {
            let b = batcher.clone();
            tokio::spawn(async move { (i, b.infer(request("t", i)).await) })
        })
        .collect();
    let (mut admitted, mut overloaded) = (Vec::new(), 0);
    for call in calls {
        match call.await.unwrap() {
            (_, Err(InferError::Overloaded)) => overloaded += 1,
            (i, Ok(outputs)) => {
                assert_eq!(outputs[0].to_f32_vec().unwrap(), [f32::from(i) + 1.0], "call {i} got another's answer");
                admitted.push(i);
            }
            (i, Err(e)) => panic!("call {i} failed: {e}"),
        }
    }
    assert_eq!((admitted.len(), overloaded), (4, 6), "admitted {admitted:?}, with a queue of 4 and the device busy");
    assert_eq!(busy.await.unwrap().unwrap()[0].to_f32_vec().unwrap(), [101.0]);
    assert_eq!(batcher.metrics().rejected_overloaded, 6);
    assert_eq!(batches.load(Ordering::SeqCst), 5, "the busy call and the 4 admitted ran");
}

/// Calls whose deadline passes while queued never reach the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_calls_are_answered_deadline_exceeded() {
    let backend = FakeBackend::new("fake", 1, 100 * MS, Duration::ZERO);
    let batches = backend.batch_counter();
    let batcher = Batcher::start(vec![Box::new(backend)], &BatcherConfig { max_batch: 1, ..Default::default() }).unwrap();
    let busy = {
        let b = batcher.clone();
        tokio::spawn(async move { b.infer(request("t", 0)).await })
    };
    while batches.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(MS).await;
    }
    let mut short = request("t", 0);
    short.deadline = Instant::now() + 20 * MS;
    assert_eq!(batcher.infer(short).await, Err(InferError::DeadlineExceeded));
    busy.await.unwrap().unwrap();
    assert_eq!(batches.load(Ordering::SeqCst), 1, "the expired call was never run");
}

/// A call whose tenant has more queued ahead of it than its deadline
/// leaves is refused at once, with the estimated wait, instead of queueing
/// to time out; a light tenant's call with the same deadline goes ahead of
/// the flood and is served; admission (`admit`) says the same before any
/// work is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_cannot_finish_in_time_is_refused_at_once() {
    let backend = FakeBackend::new("fake", 1, 20 * MS, Duration::ZERO);
    let config = BatcherConfig { max_batch: 1, tenant_capacity: 256, ..Default::default() };
    let batcher = Batcher::start(vec![Box::new(backend)], &config).unwrap();
    for i in 0..6 {
        batcher.infer(request("flood", i)).await.unwrap();
    }
    let pace = batcher.estimate_wait("light", 128).expect("a pace learned from six batches");
    assert!(pace >= 15 * MS, "one sample takes about 20 ms: {pace:?}");
    // About 2 s of the flood's work queued.
    let flood: Vec<_> = (0..100u8)
        .map(|i| {
            let b = batcher.clone();
            tokio::spawn(async move { b.infer(request("flood", i)).await })
        })
        .collect();
    while batcher.queue_depth() < 90 {
        tokio::time::sleep(MS).await;
    }
    let (mut late, mut light) = (request("flood", 0), request("light", 7));
    late.deadline = Instant::now() + Duration::from_secs(1);
    light.deadline = late.deadline;
    let started = Instant::now();
    match batcher.infer(late).await {
        Err(InferError::Backlog { wait }) => assert!(wait > Duration::from_secs(1), "estimated {wait:?}"),
        other => panic!("a call 2 s deep with 1 s left was not refused: {other:?}"),
    }
    assert!(started.elapsed() < 200 * MS, "refused at once, not after {:?}", started.elapsed());
    assert!(batcher.admit(&"flood".into(), 128, Duration::from_secs(1)).is_err(), "admission refuses the flood too");
    let promise = batcher.admit(&"light".into(), 128, Duration::from_secs(1)).expect("the light tenant is admitted");
    drop(promise);
    assert_eq!(batcher.infer(light).await.unwrap()[0].to_f32_vec().unwrap(), [8.0], "the light call went ahead");
    for call in flood {
        call.await.unwrap().unwrap();
    }
}

/// Invalid inputs are refused before they are queued.
#[tokio::test]
async fn invalid_input_is_refused_up_front() {
    let batcher = fake_pool(1, 4, MS, MS);
    let mut bad = request("t", 0);
    bad.input = Tensor::new(vec![2, 1], ElementType::U8, vec![0, 0]).unwrap();
    assert!(matches!(batcher.infer(bad).await, Err(InferError::InvalidInput(_))));
    assert_eq!(batcher.metrics().batches(), 0);
}

/// With many concurrent callers, batches fill up (the bench reports the
/// throughput ratio) once the device has learned that full batches pay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_64_fills_batches() {
    let batcher = fake_pool(1, 8, 4 * MS, MS / 4);
    closed_loop(&batcher, 64, 10).await; // learning
    let before = batcher.metrics();
    closed_loop(&batcher, 64, 10).await;
    let mean = mean_batch_since(&before, &batcher.metrics());
    assert!(mean >= 0.8 * 8.0, "mean batch size {mean}");
    assert_eq!(batcher.metrics().batch_limit, vec![8]);
}

/// `clients` callers, each making `calls` calls one after another.
async fn closed_loop(batcher: &Batcher, clients: usize, calls: usize) {
    let clients: Vec<_> = (0..clients)
        .map(|_| {
            let b = batcher.clone();
            tokio::spawn(async move {
                for _ in 0..calls {
                    b.infer(request("t", 0)).await.unwrap();
                }
            })
        })
        .collect();
    for c in clients {
        c.await.unwrap();
    }
}

fn mean_batch_since(before: &MetricsSnapshot, after: &MetricsSnapshot) -> f64 {
    let batches = after.batches() - before.batches();
    (after.samples_ok - before.samples_ok) as f64 / batches as f64
}

/// On a device where batches cost more per sample than single runs (a CPU
/// at large images), the batcher learns to stop batching: more throughput
/// and lower latency. On a GPU-like one (above) it fills batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_shrink_where_they_do_not_pay() {
    // Each other sample in a batch adds 10 % to a sample's 10 ms: batches of
    // 2 cost 1 ms more per sample, far more than the timer's own per-batch
    // overhead (which batching amortises) on a loaded machine.
    let backend = FakeBackend::new("fake", 8, Duration::ZERO, 10 * MS).crowding(0.1);
    let config = BatcherConfig { max_batch: 8, tenant_capacity: 256, ..BatcherConfig::default() };
    let batcher = Batcher::start(vec![Box::new(backend)], &config).unwrap();
    closed_loop(&batcher, 16, 40).await; // learning (half of it suffices)
    let before = batcher.metrics();
    closed_loop(&batcher, 16, 10).await;
    let mean = mean_batch_since(&before, &batcher.metrics());
    assert!(mean < 2.0, "mean batch {mean} after learning that batching does not pay");
    assert_eq!(batcher.metrics().batch_limit, vec![1]);
}

/// A backend that times each batch and adds the time to its input length
/// (in these tests each tenant sends one length: busy time per tenant).
struct Timed {
    inner: FakeBackend,
    busy: Arc<Mutex<HashMap<usize, Duration>>>,
}

impl Backend for Timed {
    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }

    fn run(&mut self, inputs: &[&Tensor]) -> Result<Vec<Vec<Tensor>>, BackendError> {
        let started = Instant::now();
        let outputs = self.inner.run(inputs);
        let len = inputs[0].shape()[0];
        *self.busy.lock().expect("busy lock").entry(len).or_default() += started.elapsed();
        outputs
    }
}

/// Device time spent on each of two busy tenants of equal weight, "big"
/// sending `big_len`-element samples and "small" `small_len`, over 2.5 s
/// once the batcher has settled; and the batcher, all calls answered.
async fn shared_device_time(inner: FakeBackend, big_len: usize, small_len: usize) -> (Duration, Duration, Batcher) {
    let busy = Arc::new(Mutex::new(HashMap::new()));
    let backend = Timed { inner, busy: Arc::clone(&busy) };
    let config = BatcherConfig { max_batch: 8, tenant_capacity: 256, sizing: Sizing::Fixed, ..Default::default() };
    let batcher = Batcher::start(vec![Box::new(backend)], &config).expect("batcher starts");
    let stop = Arc::new(AtomicBool::new(false));
    // Closed loops with enough clients to keep both tenants' queues full.
    let clients: Vec<_> = [("big", big_len, 12), ("small", small_len, 24)]
        .into_iter()
        .flat_map(|(tenant, len, clients)| std::iter::repeat_n((tenant, len), clients))
        .map(|(tenant, len)| {
            let (b, stop) = (batcher.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let input = Tensor::new(vec![len], ElementType::U8, vec![0; len]).expect("input tensor");
                    let deadline = Instant::now() + Duration::from_secs(30);
                    b.infer(InferRequest { tenant: tenant.into(), input, deadline }).await.expect("call answered");
                }
            })
        })
        .collect();
    tokio::time::sleep(300 * MS).await;
    let before = busy.lock().expect("busy lock").clone();
    tokio::time::sleep(2500 * MS).await;
    let after = busy.lock().expect("busy lock").clone();
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.await.expect("client task");
    }
    let spent = |len| after.get(&len).copied().unwrap_or_default() - before.get(&len).copied().unwrap_or_default();
    // The per-tenant device time the batcher reports is the time the device
    // spent on each (totals, now that every call is answered).
    let (charged, total) = (batcher.metrics().tenant_busy_seconds, busy.lock().expect("busy lock").clone());
    for (tenant, len) in [("big", big_len), ("small", small_len)] {
        let (reported, timed) = (charged[tenant], total[&len].as_secs_f64());
        assert!((reported - timed).abs() <= 0.05 * timed + 0.02, "{tenant}: reported {reported:.3} s, device ran {timed:.3} s");
    }
    (spent(big_len), spent(small_len), batcher)
}

/// Two busy tenants of equal weight, one sending 1024×1024 images and one
/// 320×320 (a tenth of the pixels), on a device whose time grows with the
/// pixels: each gets about the same device time. (Charging each sample 1,
/// as before, gave the large-image tenant about ten times as much.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_time_is_shared_by_pixels_not_samples() {
    // 4 ms per million elements: 12.6 ms per large sample, 1.2 ms per small one.
    let inner = FakeBackend::new("fake", 8, Duration::ZERO, Duration::ZERO).size_cost(4 * MS);
    let (big, small, _) = shared_device_time(inner, 1024 * 1024 * 3, 320 * 320 * 3).await;
    let ratio = big.as_secs_f64() / small.as_secs_f64();
    assert!((0.6..1.6).contains(&ratio), "device time big/small {ratio:.2} ({big:?} vs {small:?})");
}

/// Device time is shared as the device measures it, where the pixel
/// estimate is wrong: on a device whose every sample takes 4 ms whatever
/// its size, a 640² tenant and a 320² one (a quarter of the pixels) still
/// get about the same device time. (By the estimate alone the small one
/// would get four times the samples, so four times the time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_time_is_shared_as_measured_where_pixels_mislead() {
    let inner = FakeBackend::new("fake", 8, Duration::ZERO, 4 * MS);
    let (big, small, _) = shared_device_time(inner, 640 * 640 * 3, 320 * 320 * 3).await;
    let ratio = big.as_secs_f64() / small.as_secs_f64();
    assert!((0.7..1.4).contains(&ratio), "device time big/small {ratio:.2} ({big:?} vs {small:?})");
}

/// Two models on one device (a fast one, 2 ms a sample, and a slow one,
/// 6 ms), one tenant busy on both and another on the slow one alone: each
/// tenant gets about half the device, summed over the models. Were each
/// model fair on its own, with the models' batches running side by side,
/// the tenant on both would get its share of the slow model and the whole
/// of the fast one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_on_two_models_gets_no_more_device_time_than_one_on_one() {
    let arbiter = Arbiter::new();
    let config = BatcherConfig { max_batch: 4, tenant_capacity: 256, sizing: Sizing::Fixed, ..Default::default() };
    let model = |name: &str, per_sample: Duration| {
        let backend = FakeBackend::new(name, 4, MS, per_sample);
        Batcher::start_in(&arbiter, vec![Box::new(backend)], &config).expect("batcher starts")
    };
    let (fast, slow) = (model("fast", 2 * MS), model("slow", 6 * MS));
    let stop = Arc::new(AtomicBool::new(false));
    let load = [("both", &fast), ("both", &slow), ("one", &slow)];
    let clients: Vec<_> = load
        .into_iter()
        .flat_map(|(tenant, batcher)| std::iter::repeat_n((tenant, batcher.clone()), 8))
        .map(|(tenant, batcher)| {
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    batcher.infer(request(tenant, 1)).await.expect("call answered");
                }
            })
        })
        .collect();
    let device_seconds =
        |tenant: &str| -> f64 { [&fast, &slow].iter().map(|b| b.metrics().tenant_busy_seconds.get(tenant).copied().unwrap_or(0.0)).sum() };
    tokio::time::sleep(300 * MS).await;
    let before = (device_seconds("both"), device_seconds("one"));
    tokio::time::sleep(2500 * MS).await;
    let (both, one) = (device_seconds("both") - before.0, device_seconds("one") - before.1);
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.await.expect("client task");
    }
    let ratio = both / one;
    assert!((0.75..1.33).contains(&ratio), "device time tenant on both / tenant on one: {ratio:.2} ({both:.2} s vs {one:.2} s)");
    assert!(both + one < 2.6, "one batch at a time on the device: {:.2} s of device time in 2.5 s", both + one);
}

/// Removing a tenant answers its waiting calls at once, leaves other
/// tenants' calls alone and forgets its weight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_tenant_is_answered_and_forgotten() {
    let backend = FakeBackend::new("fake", 1, 100 * MS, Duration::ZERO);
    let batches = backend.batch_counter();
    let batcher = Batcher::start(vec![Box::new(backend)], &BatcherConfig { max_batch: 1, ..Default::default() }).expect("batcher starts");
    batcher.set_tenant_weight("gone", 4);
    let busy = {
        let b = batcher.clone();
        tokio::spawn(async move { b.infer(request("stay", 0)).await })
    };
    while batches.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(MS).await;
    }
    let queued: Vec<_> = ["gone", "gone", "gone", "stay"]
        .into_iter()
        .map(|tenant| {
            let b = batcher.clone();
            tokio::spawn(async move { b.infer(request(tenant, 1)).await })
        })
        .collect();
    while batcher.queue_depth() < 4 {
        tokio::time::sleep(MS).await;
    }

    assert_eq!(batcher.remove_tenant("gone"), 3);
    assert_eq!((batcher.tenant_queue_depth("gone"), batcher.queue_depth()), (0, 1));
    assert_eq!(batcher.tenant_weight("gone"), 1, "a namesake starts at weight 1");
    let mut results = Vec::new();
    for call in queued {
        results.push(call.await.expect("call task"));
    }
    assert!(results[..3].iter().all(|r| *r == Err(InferError::ShuttingDown)), "{results:?}");
    assert!(results[3].is_ok());
    busy.await.expect("call task").expect("call answered");
    assert!(batcher.infer(request("gone", 2)).await.is_ok(), "the name can be used again");
}

/// `Models` passes tenant weights and removals on to every model.
#[tokio::test]
async fn models_forward_tenant_settings_to_every_model() {
    let models = Models::new();
    for name in ["m1", "m2"] {
        let backend = FakeBackend::new(name, 4, Duration::ZERO, Duration::ZERO);
        models.insert(Batcher::start(vec![Box::new(backend)], &BatcherConfig::default()).expect("batcher starts"));
    }
    models.set_tenant_weight("t", 3);
    assert!(models.iter().all(|b| b.tenant_weight("t") == 3));
    assert_eq!(models.remove_tenant("t"), 0);
    assert!(models.iter().all(|b| b.tenant_weight("t") == 1));
}

/// Records what the batcher reports: each batch's size and the tags of its tagged calls.
#[derive(Default)]
struct Reports(Mutex<Vec<(usize, Vec<u32>)>>);

impl BatchObserver for Reports {
    fn ran(&self, report: &BatchReport<'_>) {
        assert_eq!(report.model, "fake");
        assert!(report.ok && report.members.iter().all(|m| m.enqueued <= report.started));
        let tags = report.members.iter().map(|m| *m.tag.get::<u32>().unwrap()).collect();
        self.0.lock().unwrap().push((report.size, tags));
    }
}

/// The observer hears of every batch that ran a tagged call, with the tags
/// of exactly those calls, and of no batch of untagged calls only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_observer_hears_of_each_batch_with_its_tagged_calls() {
    let batcher = fake_pool(1, 8, 5 * MS, MS);
    let reports = Arc::new(Reports::default());
    assert!(batcher.observe(Arc::clone(&reports) as Arc<dyn BatchObserver>));
    assert!(!batcher.observe(Arc::new(Reports::default())), "the first observer stays");
    for i in 0..4u8 {
        batcher.infer(request("t", i)).await.unwrap();
    }
    assert!(reports.0.lock().unwrap().is_empty(), "untagged batches are not reported");
    let calls: Vec<_> = (0..24u32)
        .map(|i| {
            let b = batcher.clone();
            // Every third call is tagged with its number.
            let tag = (i % 3 == 0).then(|| CallTag::new(i));
            tokio::spawn(async move { b.infer_with(request("t", 1), CallOptions { tag, ..CallOptions::default() }).await })
        })
        .collect();
    for call in calls {
        call.await.unwrap().unwrap();
    }
    // A batch is reported after its calls are answered (the answers do
    // not wait for the observer): the last report may come just after.
    let reported = || {
        let mut tags: Vec<u32> = reports.0.lock().unwrap().iter().flat_map(|(_, tags)| tags.clone()).collect();
        tags.sort_unstable();
        tags
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    while reported().len() < 8 && Instant::now() < deadline {
        tokio::time::sleep(MS).await;
    }
    assert_eq!(reported(), (0..24).step_by(3).collect::<Vec<u32>>(), "each tagged call reported once");
    let reports = reports.0.lock().unwrap();
    assert!(reports.iter().all(|(size, tags)| !tags.is_empty() && tags.len() <= *size), "{reports:?}");
}
