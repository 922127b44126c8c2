//! The inference queue as the operator and the autoscaler see it:
//! `facegate_queue_depth` (the gauge the Kubernetes HPA scales on,
//! deploy/k8s/base/hpa.yaml) counts the calls waiting for a device while
//! they wait and falls back to 0; `facegate_queue_wait_seconds` counts each
//! call's wait once.

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{self, ADMIN_TOKEN, anonymous, client_with_key, metric};

/// Clients calling at once, one request each.
const CLIENTS: usize = 16;
/// `infer` calls in each request (`big-tensor&n=2`): 32 calls for one
/// device that takes at most 4 a batch, so calls wait.
const CALLS_PER_REQUEST: usize = 2;
/// The deadline of this test's requests, ms.
const QUEUED_DEADLINE_MS: u64 = 60_000;
/// The queue-depth series the HPA selects (its metric name and label).
const DEPTH: &str = "facegate_queue_depth{model=\"centerface\"}";
/// How many calls' waits have been counted.
const WAITS: &str = "facegate_queue_wait_seconds_count{model=\"centerface\"}";
/// How many calls waited at most 1 ms (the first bucket).
const QUICK_WAITS: &str = "facegate_queue_wait_seconds_bucket{model=\"centerface\",le=\"0.001\"}";
/// The waits' total, seconds.
const WAITED: &str = "facegate_queue_wait_seconds_sum{model=\"centerface\"}";

#[test]
fn queue_depth_and_wait_follow_the_calls_waiting_for_a_device() {
    let hpa = std::fs::read_to_string(harness::root().join("deploy/k8s/base/hpa.yaml")).unwrap();
    assert!(hpa.contains("name: facegate_queue_depth") && hpa.contains("model: centerface"), "the HPA scales on another series:\n{hpa}");

    // A gateway of its own: nothing but these clients calls its device.
    let seed = harness::fresh_dir("queue-seed");
    harness::install(&seed, "busy", "attack", &harness::guest("hostile"));
    let data = harness::fresh_dir("queue-data");
    let mut config = harness::config(data.clone(), Some(seed));
    // 32 calls queue for one CPU device: on a machine busy with other tests
    // the last may wait far longer than the tests' usual deadline.
    config.limits.timeout_ms = QUEUED_DEADLINE_MS;
    let addr = harness::start(config);
    let key = std::fs::read_to_string(data.join("busy.key")).unwrap().trim().to_owned();
    let metrics = || anonymous().get(format!("http://{addr}/metrics")).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap();
    let value = |text: &str, series: &str| metric(text, series).unwrap_or_else(|| panic!("no {series} in\n{text}"));
    let before = metrics();
    assert_eq!(value(&before, DEPTH), 0.0, "nothing waits on an idle gateway");

    let deepest = std::thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                let client = client_with_key(&key);
                s.spawn(move || {
                    let url = format!("http://{addr}/v1/busy/attack?attack=big-tensor&side=640&n={CALLS_PER_REQUEST}");
                    let body: Value = client.get(url).send().unwrap().json().unwrap();
                    assert_eq!(body["outcomes"], json!(vec!["ok"; CALLS_PER_REQUEST]), "{body}");
                })
            })
            .collect();
        let mut deepest: f64 = 0.0;
        // Until every client is done, answered or failed (a failed one
        // fails the test when the scope joins it).
        while !clients.iter().all(|client| client.is_finished()) {
            deepest = deepest.max(value(&metrics(), DEPTH));
            std::thread::sleep(Duration::from_millis(10));
        }
        deepest
    });

    let after = metrics();
    // Most of the clients' first calls wait at once (the device takes one batch at a time).
    assert!(deepest >= (CLIENTS / 2) as f64, "the deepest queue seen while {CLIENTS} clients called was {deepest}");
    assert_eq!(value(&after, DEPTH), 0.0, "nothing waits once every call is answered");
    let calls = (CLIENTS * CALLS_PER_REQUEST) as f64;
    assert_eq!(value(&after, WAITS) - value(&before, WAITS), calls, "each call's wait is counted once");
    let quick = value(&after, QUICK_WAITS) - value(&before, QUICK_WAITS);
    let waited = value(&after, WAITED) - value(&before, WAITED);
    eprintln!("queue: {deepest} calls waiting at most; {quick} of {calls} calls waited 1 ms or less; {waited:.2} s waited in all");
    assert!(quick < calls, "calls that queued behind a batch waited more than 1 ms: {quick} of {calls} did not");
    assert!(waited > 0.0, "{waited}");
}
