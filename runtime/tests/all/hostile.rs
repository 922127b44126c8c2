//! A hostile tenant (guests/hostile) attacks while a well-behaved tenant
//! keeps calling: each attack ends its own request only, within the
//! deadline, and the well-behaved requests keep succeeding throughout —
//! requests that overlap the attack, checked by their start and end. Each
//! test attacks a gateway of its own (isolation.rs's `Attacked`: a child
//! process, whose RSS is measured alone).

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{MAX_INFER_CALLS, REQUEST_TIMEOUT_MS, client_with_key};
use crate::isolation::{Attacked, limit_hits, one_instance_bound};

/// Runs `attack` once on a gateway of its own (named `name`) while a
/// well-behaved tenant's request is in flight; asserts every one of that
/// tenant's requests succeeded, at least one overlapped the attack,
/// `/healthz` kept answering and the peak RSS stayed within one instance's
/// bound. Returns the attack's result.
fn while_well_behaved_tenant_calls<T: Send>(name: &str, attack: impl FnOnce(&Attacked) -> T + Send) -> T {
    let gateway = Attacked::start(name);
    let mut attack = Some(attack);
    let observed = gateway.under_attack(1, || (attack.take().expect("one attack"))(&gateway));
    observed.assert_isolated(one_instance_bound());
    observed.attack.into_iter().next().expect("one attack")
}

/// `evil/attack?<query>` on `gateway`: the status, the JSON answer and how long it took.
fn attack(gateway: &Attacked, query: &str) -> (u16, Value, Duration) {
    let started = Instant::now();
    let (status, body) = gateway.attack(query);
    (status, body, started.elapsed())
}

#[test]
fn infinite_loop_is_stopped_at_the_deadline() {
    let (status, body, elapsed) = while_well_behaved_tenant_calls("hostile-loop", |g| attack(g, "attack=loop"));
    assert_eq!((status, body["error"]["code"].as_str()), (504, Some("handler_timeout")), "{body}");
    let deadline = Duration::from_millis(REQUEST_TIMEOUT_MS);
    assert!(elapsed >= deadline && elapsed < deadline + Duration::from_secs(2), "stopped after {elapsed:?}, the deadline is {deadline:?}");
}

/// An instance's memory is reset before the next request in its slot (the
/// vendored wasmtime resets the pages the guest wrote): the 8 MiB one
/// request filled with 0xA5 read as zeroes when the next one grows into them.
#[test]
fn a_fresh_instance_sees_nothing_of_the_memory_an_earlier_one_wrote() {
    let gateway = Attacked::start("hostile-residue");
    for round in 0..5 {
        let (status, body, _) = attack(&gateway, "attack=hold&mib=8&ms=0");
        assert_eq!((status, &body["held_mib"]), (200, &json!(8)), "{body}");
        let (status, body, _) = attack(&gateway, "attack=inspect&mib=16");
        assert_eq!((status, &body["grown_mib"], &body["nonzero"]), (200, &json!(16), &json!(0)), "round {round}: {body}");
    }
}

/// The peak RSS during the attack is bounded, and what the instance held
/// is given back after it: the gateway keeps little of the tenant's 256 MiB.
#[test]
fn memory_bomb_traps_and_memory_stays_bounded() {
    let gateway = Attacked::start("hostile-memory");
    let before = gateway.rss_mib();
    let observed = gateway.under_attack(1, || attack(&gateway, "attack=memory"));
    observed.assert_isolated(one_instance_bound());
    let (status, body, _) = &observed.attack[0];
    assert_eq!((*status, body["error"]["code"].as_str()), (500, Some("handler_trapped")), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("memory limit"), "{body}");
    let kept = gateway.rss_mib().saturating_sub(before);
    assert!(
        kept < KEPT_AFTER_A_BOMB_MIB,
        "the gateway kept {kept} MiB after the attack (it peaked {} MiB over)",
        observed.peak_rss_growth_mib
    );
}

/// What the gateway may keep resident after a memory bomb trapped: a small
/// part of the tenant's 256 MiB (the neighbour's last request, allocator slack).
const KEPT_AFTER_A_BOMB_MIB: u64 = 64;

#[test]
fn deep_recursion_traps_with_stack_overflow() {
    let (status, body, _) = while_well_behaved_tenant_calls("hostile-recursion", |g| attack(g, "attack=recursion"));
    assert_eq!((status, body["error"]["code"].as_str()), (500, Some("handler_trapped")), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("stack overflow"), "{body}");
}

#[test]
fn panic_traps_only_its_request() {
    let (status, body, _) = while_well_behaved_tenant_calls("hostile-panic", |g| attack(g, "attack=panic"));
    assert_eq!((status, body["error"]["code"].as_str()), (500, Some("handler_trapped")), "{body}");
}

/// No directory is preopened and no variable is set: every path is refused
/// for want of a capability (WASI's ENOTCAPABLE, 76), the environment is
/// empty and the working directory is wasi-libc's default `/`.
#[test]
fn handler_sees_no_files_or_environment() {
    let (status, body, _) = while_well_behaved_tenant_calls("hostile-snoop", |g| attack(g, "attack=snoop"));
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
    let (status, body, _) = while_well_behaved_tenant_calls("hostile-sockets", |g| attack(g, "attack=sockets"));
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
    while_well_behaved_tenant_calls("hostile-bad-tensors", |g| {
        for (case, error) in expected {
            let (status, body, _) = attack(g, &format!("attack=bad-tensor&case={case}"));
            assert_eq!(status, 200, "{case}: {body}");
            let result = &body["results"][0];
            assert_eq!(result["ok"], false, "{case}: {body}");
            let message = result["error"].as_str().unwrap();
            assert!(message.starts_with(error), "{case}: {body}");
            // The host never echoes an input's shape in full (a million dimensions here).
            assert!(message.len() < 300, "{case}: a message of {} bytes", message.len());
        }
        let (status, body, _) = attack(g, "attack=bad-tensor&case=valid");
        assert_eq!((status, &body["results"][0]["ok"]), (200, &Value::Bool(true)), "{body}");
        assert_eq!(body["results"][0]["outputs"].as_array().unwrap().len(), 4);
    });
}

/// A guest's error code carrying 8 MiB of control bytes: the host neither
/// logs nor answers it in full (escaped, it would be 40 MB).
#[test]
fn a_huge_error_message_from_a_guest_is_cut() {
    let (status, body, _) = while_well_behaved_tenant_calls("hostile-error-code", |g| attack(g, "attack=error-code&mib=8"));
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
    let gateway = Attacked::start("hostile-lift");
    let observed = gateway.under_attack(1, || attack(&gateway, "attack=lift&mib=64"));
    observed.assert_isolated(one_instance_bound());
    let (status, body, _) = &observed.attack[0];
    assert_eq!((*status, body["error"]["code"].as_str()), (500, Some("resource_limit")), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("more data than the host takes in one call"), "{body}");
    let (status, body, _) = attack(&gateway, "attack=lift&mib=12");
    assert_eq!(status, 200, "a largest-input-sized call is taken: {body}");
    assert!(body["outcome"].as_str().unwrap().starts_with("invalid-input"), "{body}");
}

#[test]
fn infer_calls_per_request_are_capped() {
    let (status, body, _) = attack(&Attacked::start("hostile-many-calls"), "attack=many-calls");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["succeeded"], u64::from(MAX_INFER_CALLS), "{body}");
    assert!(body["first_error"].as_str().unwrap().starts_with("quota-exceeded"), "{body}");
}

/// The gateway removes the tenant's key before the handler runs: the
/// handler sees the request's other headers (one of them sent twice), never
/// `Authorization`, and the key nowhere.
#[test]
fn handlers_never_see_the_authorization_header() {
    let gateway = Attacked::start("hostile-headers");
    let key = gateway.key("evil");
    let request = client_with_key(&key)
        .get(gateway.url("/v1/evil/attack?attack=headers"))
        .header("x-probe", "seen")
        .header("x-twice", "1")
        .header("x-twice", "2");
    let response = request.send().unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().unwrap();
    let seen: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (&seen["x-probe"], &seen["x-twice"]),
        (&json!(["seen"]), &json!(["1", "2"])),
        "the handler sees the request's headers: {seen}"
    );
    let names: Vec<&String> = seen.as_object().unwrap().keys().collect();
    assert!(!names.iter().any(|n| n.eq_ignore_ascii_case("authorization")), "the handler saw {names:?}");
    assert!(!text.contains(&key), "the key reached the handler: {text}");
}

/// A tenant's `max_response_bytes` holds its handler's answers: one that
/// declares a longer body gets 502 `response_too_large`, counted; a short
/// one is answered whole.
#[test]
fn a_response_past_the_tenants_limit_gets_502() {
    let gateway = Attacked::start("hostile-response-size");
    let patched = gateway.admin(reqwest::Method::PATCH, "tenants/evil").json(&json!({ "max_response_bytes": 64 })).send().unwrap();
    assert_eq!(patched.status(), 200);
    let before = limit_hits(&gateway, "evil", "response_size");
    // The handler echoes the request's headers: a long one makes its answer long.
    let echoed = client_with_key(&gateway.key("evil")).get(gateway.url("/v1/evil/attack?attack=headers")).header("x-pad", "x".repeat(100));
    let response = echoed.send().unwrap();
    let status = response.status().as_u16();
    let body: Value = response.json().unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (502, Some("response_too_large")), "{body}");
    assert_eq!(limit_hits(&gateway, "evil", "response_size"), before + 1);
    let (status, body) = gateway.attack("attack=count");
    assert_eq!((status, body["served"].as_u64()), (200, Some(1)), "{body}");
}
