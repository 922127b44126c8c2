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

/// The deadline of the backlog test's requests, ms.
const BACKLOG_DEADLINE_MS: u64 = 3_000;
/// Requests of the flooding tenant at once: at a 1280² tensor each (tens
/// of milliseconds of device time or more), far more work than fits in
/// [`BACKLOG_DEADLINE_MS`].
const FLOOD: usize = 48;

/// What a refused (or served) request answered: status, error code,
/// `Retry-After` (seconds) and message.
struct Answer {
    status: u16,
    code: String,
    retry_after: Option<u64>,
    message: String,
    /// The handler's `infer` outcomes (`["ok"]` when its call ran).
    outcomes: Value,
}

/// One `infer` call of a `side`² tensor by `tenant`'s hostile handler.
fn big_tensor(addr: std::net::SocketAddr, key: &str, tenant: &str, side: u32) -> Answer {
    let url = format!("http://{addr}/v1/{tenant}/attack?attack=big-tensor&side={side}");
    let response = client_with_key(key).get(url).send().unwrap();
    let status = response.status().as_u16();
    let retry_after = response.headers().get("retry-after").map(|v| v.to_str().unwrap().parse().unwrap());
    let body: Value = response.json().unwrap_or_default();
    let (code, message) = (body["error"]["code"].as_str().unwrap_or(""), body["error"]["message"].as_str().unwrap_or(""));
    Answer { status, code: code.to_owned(), retry_after, message: message.to_owned(), outcomes: body["outcomes"].clone() }
}

/// The wait a backlog refusal states ("the inference work queued ahead
/// would take 3.2 s, ..."), seconds.
fn stated_wait(message: &str) -> f64 {
    let rest = message.split("would take ").nth(1).unwrap_or_else(|| panic!("no wait stated: {message}"));
    rest.split(' ').next().unwrap().parse().unwrap_or_else(|e| panic!("{e}: {message}"))
}

/// A request is refused at admission because the inference work queued
/// ahead of it would outlast its deadline, not because the gateway is
/// busy: one after another (a short backlog) nothing is refused; with
/// [`FLOOD`] of one tenant's requests at once, some are refused 503
/// `overloaded`, each stating a wait past the admission headroom (0.8) of
/// its deadline and carrying that wait, rounded up to whole seconds, as
/// `Retry-After`; each refusal is counted as the tenant's `backlog` hit;
/// and a neighbour tenant with the same deadline, whose own work ahead is
/// short (a 320² call: its fair share waits for about the batch in flight),
/// is served meanwhile, its call run.
#[test]
fn requests_are_refused_when_the_backlog_would_outlast_their_deadline() {
    let seed = harness::fresh_dir("backlog-seed");
    for tenant in ["flood", "light"] {
        harness::install(&seed, tenant, "attack", &harness::guest("hostile"));
    }
    let data = harness::fresh_dir("backlog-data");
    let mut config = harness::config(data.clone(), Some(seed));
    config.limits.timeout_ms = BACKLOG_DEADLINE_MS;
    config.limits.max_concurrency = FLOOD as u32;
    let addr = harness::start(config);
    let key = |tenant: &str| std::fs::read_to_string(data.join(format!("{tenant}.key"))).unwrap().trim().to_owned();
    let (flood, light) = (key("flood"), key("light"));

    // A short backlog: one request at a time. (The first teaches the
    // gateway the handler's usual call, which admission then predicts.)
    for _ in 0..3 {
        let answer = big_tensor(addr, &flood, "flood", 1280);
        assert_eq!(answer.status, 200, "one at a time, nothing waits: {} {}", answer.code, answer.message);
    }
    assert_eq!(big_tensor(addr, &light, "light", 320).status, 200);

    let (answers, neighbour) = std::thread::scope(|s| {
        let flood: Vec<_> = (0..FLOOD).map(|_| s.spawn(|| big_tensor(addr, &flood, "flood", 1280))).collect();
        // The neighbour asks once the flood is queued.
        std::thread::sleep(Duration::from_millis(300));
        let neighbour = big_tensor(addr, &light, "light", 320);
        (flood.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>(), neighbour)
    });
    let refused: Vec<&Answer> = answers.iter().filter(|a| a.status == 503).collect();
    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    eprintln!("backlog: {} of {FLOOD} refused; statuses {statuses:?}", refused.len());
    assert!(!refused.is_empty(), "{FLOOD} requests of far more work than their deadline: none refused: {statuses:?}");
    assert!(answers.iter().any(|a| a.status == 200), "the work that fits is served: {statuses:?}");
    let deadline = BACKLOG_DEADLINE_MS as f64 / 1000.0;
    for answer in &refused {
        assert_eq!(answer.code, "overloaded", "{}", answer.message);
        let wait = stated_wait(&answer.message);
        // Admission keeps the usual call's predicted wait within 0.8 of the
        // deadline less the guest's own time (a few milliseconds here).
        assert!(wait > 0.8 * deadline - 0.2, "refused with only {wait} s of work ahead of a {deadline} s deadline: {}", answer.message);
        let retry = answer.retry_after.unwrap_or_else(|| panic!("a refusal without Retry-After: {}", answer.message));
        // The message rounds the wait to 0.1 s; Retry-After rounds it up to whole seconds.
        assert!(
            retry as f64 >= wait - 0.05 && (retry as f64) < wait.max(1.0) + 1.0,
            "Retry-After {retry} s for an estimated wait of {wait} s"
        );
    }
    assert_eq!(
        (neighbour.status, &neighbour.outcomes),
        (200, &json!(["ok"])),
        "the neighbour's own backlog is short: {} {}",
        neighbour.code,
        neighbour.message
    );
    let metrics = anonymous().get(format!("http://{addr}/metrics")).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap();
    let hits = |tenant: &str| metric(&metrics, &format!("facegate_limit_hits_total{{tenant=\"{tenant}\",limit=\"backlog\"}}"));
    // (A call checked again as it queues may be refused inside a served request too.)
    let counted = hits("flood").unwrap_or(0.0);
    assert!(counted >= refused.len() as f64, "{} refusals, {counted} counted as the flood's backlog hits:\n{metrics}", refused.len());
    assert_eq!(hits("light"), None, "the neighbour was never refused for the backlog");
}
