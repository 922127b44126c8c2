//! A hostile tenant (guests/hostile) attacks while a well-behaved tenant
//! keeps calling: each attack ends its own request only, within the
//! deadline, and the well-behaved requests keep succeeding throughout.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::{MAX_INFER_CALLS, REQUEST_TIMEOUT_MS, client, client_as, image, url};

/// Runs `attack` while another thread keeps posting a photo to `demo/detect`;
/// asserts every one of those succeeded. Returns the attack's result.
fn while_well_behaved_tenant_calls<T>(attack: impl FnOnce() -> T) -> T {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let victim = std::thread::spawn(move || {
        let (client, photo) = (client(), image("grace_hopper.jpg"));
        let mut statuses = Vec::new();
        while !flag.load(Ordering::SeqCst) || statuses.is_empty() {
            let response = client.post(url("/v1/demo/detect")).body(photo.clone()).send().unwrap();
            statuses.push(response.status().as_u16());
        }
        statuses
    });
    let result = attack();
    stop.store(true, Ordering::SeqCst);
    let statuses = victim.join().unwrap();
    assert!(statuses.iter().all(|&s| s == 200), "well-behaved tenant got {statuses:?}");
    result
}

fn attack(query: &str) -> (u16, Value, Duration) {
    let started = Instant::now();
    let response = client_as("evil").get(url(&format!("/v1/evil/attack?{query}"))).send().unwrap();
    let status = response.status().as_u16();
    let body = response.json().unwrap_or(Value::Null);
    (status, body, started.elapsed())
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn infinite_loop_is_stopped_at_the_deadline() {
    let (status, body, elapsed) = while_well_behaved_tenant_calls(|| attack("attack=loop"));
    assert_eq!((status, body["error"]["code"].as_str()), (504, Some("handler_timeout")), "{body}");
    let deadline = Duration::from_millis(REQUEST_TIMEOUT_MS);
    assert!(elapsed < deadline + Duration::from_secs(2), "took {elapsed:?}");
}

#[test]
fn memory_bomb_traps_and_memory_stays_bounded() {
    let before = rss_kib();
    let (status, body, _) = while_well_behaved_tenant_calls(|| attack("attack=memory"));
    assert_eq!((status, body["error"]["code"].as_str()), (500, Some("handler_trapped")), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("memory limit"), "{body}");
    let grown_mib = rss_kib().saturating_sub(before) / 1024;
    assert!(grown_mib < 300, "process grew by {grown_mib} MiB");
}

#[test]
fn deep_recursion_traps_with_stack_overflow() {
    let (status, body, _) = while_well_behaved_tenant_calls(|| attack("attack=recursion"));
    assert_eq!((status, body["error"]["code"].as_str()), (500, Some("handler_trapped")), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("stack overflow"), "{body}");
}

#[test]
fn panic_traps_only_its_request() {
    let (status, body, _) = while_well_behaved_tenant_calls(|| attack("attack=panic"));
    assert_eq!((status, body["error"]["code"].as_str()), (500, Some("handler_trapped")), "{body}");
}

#[test]
fn handler_sees_no_files_or_environment() {
    let (status, body, _) = while_well_behaved_tenant_calls(|| attack("attack=snoop"));
    assert_eq!(status, 200, "{body}");
    for (name, seen) in body["files"].as_object().unwrap() {
        assert!(seen.as_str().unwrap().starts_with("error"), "{name}: {seen}");
    }
    assert_eq!(body["env"]["count"], 0, "{body}");
    assert!(body["env"]["home"].is_null(), "{body}");
}

#[test]
fn malformed_tensors_get_clean_errors() {
    let expected = [
        ("short_data", "invalid-input"),
        ("empty_shape", "invalid-input"),
        ("overflowing_shape", "invalid-input"),
        ("wrong_element", "invalid-input"),
        ("bad_side", "invalid-input"),
        ("unknown_model", "unknown-model"),
    ];
    while_well_behaved_tenant_calls(|| {
        for (case, error) in expected {
            let (status, body, _) = attack(&format!("attack=bad-tensor&case={case}"));
            assert_eq!(status, 200, "{case}: {body}");
            let result = &body["results"][0];
            assert_eq!(result["ok"], false, "{case}: {body}");
            assert!(result["error"].as_str().unwrap().starts_with(error), "{case}: {body}");
        }
        let (status, body, _) = attack("attack=bad-tensor&case=valid");
        assert_eq!((status, &body["results"][0]["ok"]), (200, &Value::Bool(true)), "{body}");
        assert_eq!(body["results"][0]["outputs"].as_array().unwrap().len(), 4);
    });
}

#[test]
fn infer_calls_per_request_are_capped() {
    let (status, body, _) = attack("attack=many-calls");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["succeeded"], u64::from(MAX_INFER_CALLS), "{body}");
    assert!(body["first_error"].as_str().unwrap().starts_with("quota-exceeded"), "{body}");
}
