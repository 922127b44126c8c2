//! A hostile tenant (guests/hostile) attacks while a well-behaved tenant
//! keeps calling: each attack ends its own request only, within the
//! deadline, and the well-behaved requests keep succeeding throughout —
//! requests that overlap the attack, checked by their start and end (the
//! helper is isolation.rs's `under_attack`).

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{MAX_INFER_CALLS, REQUEST_TIMEOUT_MS, client_as, url};
use crate::isolation::{one_instance_bound, under_attack};

/// Runs `attack` once while a well-behaved tenant's request is in flight;
/// asserts every one of that tenant's requests succeeded, at least one
/// overlapped the attack, `/healthz` kept answering and the peak RSS stayed
/// within one instance's bound. Returns the attack's result.
fn while_well_behaved_tenant_calls<T: Send>(attack: impl FnOnce() -> T + Send) -> T {
    let mut attack = Some(attack);
    let observed = under_attack(1, || (attack.take().expect("one attack"))());
    observed.assert_isolated(one_instance_bound());
    observed.attack.into_iter().next().expect("one attack")
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

/// The peak RSS during the attack is bounded (by the helper), and what the
/// instance held is given back after it.
#[test]
fn memory_bomb_traps_and_memory_stays_bounded() {
    crate::harness::gateway();
    let before = rss_kib();
    let (status, body, _) = while_well_behaved_tenant_calls(|| attack("attack=memory"));
    assert_eq!((status, body["error"]["code"].as_str()), (500, Some("handler_trapped")), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("memory limit"), "{body}");
    let grown_mib = rss_kib().saturating_sub(before) / 1024;
    assert!(grown_mib < 300, "process kept {grown_mib} MiB after the attack");
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

/// No directory is preopened and no variable is set: every path is refused
/// for want of a capability (WASI's ENOTCAPABLE, 76), the environment is
/// empty and the working directory is wasi-libc's default `/`.
#[test]
fn handler_sees_no_files_or_environment() {
    let (status, body, _) = while_well_behaved_tenant_calls(|| attack("attack=snoop"));
    assert_eq!(status, 200, "{body}");
    let refused = "error: Capabilities insufficient (os error 76)";
    let expected = json!({
        "files": { "read_dir_root": refused, "passwd": refused, "cargo_toml": refused },
        "env": { "count": 0, "home": null },
        "cwd": "ok: /",
    });
    assert_eq!(body, expected);
}

/// `wasi:sockets` is linked (Python components import it) but every use
/// is denied: no TCP or UDP socket is created, no name resolved.
#[test]
fn sockets_are_linked_but_every_use_is_denied() {
    let (status, body, _) = while_well_behaved_tenant_calls(|| attack("attack=sockets"));
    assert_eq!(status, 200, "{body}");
    assert_eq!((&body["tcp"], &body["udp"]), (&json!("access-denied"), &json!("access-denied")), "{body}");
    let lookup = body["lookup"].as_str().unwrap();
    assert_ne!(lookup, "ok", "{body}");
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
        ("huge_rank", "invalid-input: a tensor has at most 8 dimensions, this one has 1048576"),
    ];
    while_well_behaved_tenant_calls(|| {
        for (case, error) in expected {
            let (status, body, _) = attack(&format!("attack=bad-tensor&case={case}"));
            assert_eq!(status, 200, "{case}: {body}");
            let result = &body["results"][0];
            assert_eq!(result["ok"], false, "{case}: {body}");
            let message = result["error"].as_str().unwrap();
            assert!(message.starts_with(error), "{case}: {body}");
            // The host never echoes an input's shape in full (a million dimensions here).
            assert!(message.len() < 300, "{case}: a message of {} bytes", message.len());
        }
        let (status, body, _) = attack("attack=bad-tensor&case=valid");
        assert_eq!((status, &body["results"][0]["ok"]), (200, &Value::Bool(true)), "{body}");
        assert_eq!(body["results"][0]["outputs"].as_array().unwrap().len(), 4);
    });
}

/// A guest's error code carrying 8 MiB of control bytes: the host neither
/// logs nor answers it in full (escaped, it would be 40 MB).
#[test]
fn a_huge_error_message_from_a_guest_is_cut() {
    let (status, body, _) = while_well_behaved_tenant_calls(|| attack("attack=error-code&mib=8"));
    assert_eq!((status, body["error"]["code"].as_str()), (500, Some("handler_failed")), "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.len() < 2048 && message.contains("InternalError") && message.ends_with("… (cut)"), "{} bytes", message.len());
}

/// wasmtime copies a host call's arguments into host memory, outside the
/// tenant's memory limit, before the host function runs. One call may
/// hand over the largest valid model input (2048²×3 bytes) with room to
/// spare, not 64 MiB.
#[test]
fn a_host_call_past_the_per_call_cap_ends_only_its_request() {
    let (status, body, _) = while_well_behaved_tenant_calls(|| attack("attack=lift&mib=64"));
    assert_eq!((status, body["error"]["code"].as_str()), (500, Some("resource_limit")), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("more data than the host takes in one call"), "{body}");
    let (status, body, _) = attack("attack=lift&mib=12");
    assert_eq!(status, 200, "a largest-input-sized call is taken: {body}");
    assert!(body["outcome"].as_str().unwrap().starts_with("invalid-input"), "{body}");
}

#[test]
fn infer_calls_per_request_are_capped() {
    let (status, body, _) = attack("attack=many-calls");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["succeeded"], u64::from(MAX_INFER_CALLS), "{body}");
    assert!(body["first_error"].as_str().unwrap().starts_with("quota-exceeded"), "{body}");
}
