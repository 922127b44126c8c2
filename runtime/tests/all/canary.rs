//! Canaries on one node, counted request by request: the abort rule ends a
//! failing canary at its `abort_after`-th answer with no request more, and
//! never one that fails no more than the active version; `promote` without
//! a canary is refused; `abort_after` past what the stores keep is clamped,
//! not wrapped.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{admin, admin_json, client_with_key, gateway, guest, url};

/// Creates `tenant` on the shared gateway with the detect handler active as
/// `h` (its GET answers a 4xx, never a 5xx); its invoke key.
fn tenant_with_detect(tenant: &str) -> String {
    let _ = gateway();
    let (status, created) = admin_json(admin(Method::POST, "tenants").json(&json!({ "name": tenant, "limits": { "rps": 0 } })));
    assert_eq!(status, 201, "{created}");
    let (status, key) = admin_json(admin(Method::POST, &format!("tenants/{tenant}/keys")));
    assert_eq!(status, 201, "{key}");
    let (status, active) =
        admin_json(admin(Method::PUT, &format!("tenants/{tenant}/handlers/h")).body(std::fs::read(guest("detect")).unwrap()));
    assert_eq!((status, active["active_version"].as_i64()), (201, Some(1)), "{active}");
    key["key"].as_str().unwrap().to_owned()
}

/// Uploads the hostile handler as `tenant`'s `h` with `query`; the status and answer.
fn upload_hostile(tenant: &str, query: &str) -> (u16, Value) {
    admin_json(admin(Method::PUT, &format!("tenants/{tenant}/handlers/h?{query}")).body(std::fs::read(guest("hostile")).unwrap()))
}

/// `tenant`'s canary as `GET …/versions` shows it (`null` when none).
fn canary(tenant: &str) -> Value {
    let (status, versions) = admin_json(admin(Method::GET, &format!("tenants/{tenant}/handlers/h/versions")));
    assert_eq!(status, 200, "{versions}");
    versions["canary"].clone()
}

/// A GET of `tenant`'s `h` with `attack`: the status and the version that
/// answered (a trap's 500 names none).
fn get(key: &str, tenant: &str, attack: &str) -> (u16, Option<i64>) {
    let response = client_with_key(key).get(url(&format!("/v1/{tenant}/h?attack={attack}"))).send().unwrap();
    let version = response.headers().get("x-facegate-handler-version").map(|v| v.to_str().unwrap().parse().unwrap());
    (response.status().as_u16(), version)
}

/// Sends GETs one at a time until the canary (`version`) has answered `n`
/// of them; checks each answer's status by its side (the active version,
/// 1, answers a 4xx; only the canary answers a 5xx, which may name no
/// version). Returns the requests sent.
fn until_canary_answered(key: &str, tenant: &str, attack: &str, version: i64, n: usize, canary_status: u16) -> usize {
    let (mut sent, mut answered) = (0, 0);
    while answered < n {
        let (status, by) = get(key, tenant, attack);
        sent += 1;
        assert!(sent < 40 * n, "the canary answered {answered} of {sent} requests");
        if by == Some(version) || status >= 500 {
            assert_eq!(status, canary_status, "the canary's answer");
            answered += 1;
        } else {
            assert_eq!(by, Some(1), "the active version answered");
            assert!((400..500).contains(&status), "the active version answers a GET with a 4xx, not {status}");
        }
    }
    sent
}

const AFTER: usize = 5;

/// Counted request by request: a canary answering 500s beside an active
/// version answering 4xx is still on after its 4th answer and ended after
/// its 5th (`abort_after=5`) with no request more; a canary answering 200s
/// beside the same active version is never ended, however many it answers.
#[test]
fn a_failing_canary_is_aborted_at_its_abort_after_th_answer_and_a_sound_one_never() {
    let tenant = "canary1";
    let key = tenant_with_detect(tenant);
    let rule = format!("canary=80&abort_margin=0.5&abort_after={AFTER}");

    // A sound canary: 4 × AFTER answers, 200 each, and still on.
    let (status, sound) = upload_hostile(tenant, &rule);
    assert_eq!((status, sound["version"].as_i64()), (201, Some(2)), "{sound}");
    until_canary_answered(&key, tenant, "count", 2, 4 * AFTER, 200);
    assert_eq!(canary(tenant)["version"], 2, "a canary failing no more than the active version stays on");
    let (status, ended) = admin_json(admin(Method::POST, &format!("tenants/{tenant}/handlers/h/abort")));
    assert_eq!((status, ended["aborted"]["version"].as_i64()), (200, Some(2)), "{ended}");

    // A failing canary: on through its (AFTER - 1)th 500, whatever the
    // active version answered meanwhile.
    let (status, failing) = upload_hostile(tenant, &rule);
    assert_eq!((status, failing["version"].as_i64()), (201, Some(3)), "{failing}");
    until_canary_answered(&key, tenant, "panic", 3, AFTER - 1, 500);
    assert_eq!(canary(tenant)["version"], 3, "not aborted before its {AFTER}th answer");
    // Its AFTER-th 500, and no request after it: the node ends it by itself.
    until_canary_answered(&key, tenant, "panic", 3, 1, 500);
    let until = Instant::now() + Duration::from_secs(10);
    while !canary(tenant).is_null() {
        assert!(Instant::now() < until, "the canary is still on 10 s after its {AFTER}th 500: {}", canary(tenant));
        std::thread::sleep(Duration::from_millis(20));
    }
    // Every request to the active version again.
    for _ in 0..20 {
        assert_eq!(get(&key, tenant, "panic").1, Some(1));
    }
}

/// `promote` with no canary (none started, or one aborted) is refused, 404,
/// and changes nothing; with a canary it makes the canary active.
#[test]
fn promote_without_a_canary_is_refused_and_changes_nothing() {
    let tenant = "canary2";
    let key = tenant_with_detect(tenant);
    let promote = || admin_json(admin(Method::POST, &format!("tenants/{tenant}/handlers/h/promote")));
    let (status, refused) = promote();
    assert_eq!((status, refused["error"]["code"].as_str()), (404, Some("not_found")), "{refused}");

    let (status, _) = upload_hostile(tenant, "canary=50");
    assert_eq!(status, 201);
    let (status, _) = admin_json(admin(Method::POST, &format!("tenants/{tenant}/handlers/h/abort")));
    assert_eq!(status, 200);
    let (status, refused) = promote();
    assert_eq!((status, refused["error"]["code"].as_str()), (404, Some("not_found")), "an aborted canary is not promoted: {refused}");
    let (_, versions) = admin_json(admin(Method::GET, &format!("tenants/{tenant}/handlers/h/versions")));
    assert_eq!((versions["active_version"].as_i64(), versions["canary"].is_null()), (Some(1), true), "{versions}");
    assert!((0..10).all(|_| get(&key, tenant, "count").1 == Some(1)), "version 1 still answers every request");

    let (status, _) = upload_hostile(tenant, "canary=50");
    assert_eq!(status, 201);
    let (status, promoted) = promote();
    assert_eq!((status, promoted["active_version"].as_i64()), (200, Some(3)), "{promoted}");
    assert!(canary(tenant).is_null());
    assert!((0..10).all(|_| get(&key, tenant, "count") == (200, Some(3))), "the promoted canary answers every request");
}

/// `abort_after` past what the stores keep (a signed 64-bit number) is
/// clamped to its largest value, never wrapped to one that aborts at once;
/// a negative or unparsable one, or a margin outside 0 to 1, is refused.
#[test]
fn abort_after_is_clamped_to_what_the_store_keeps_and_bad_values_are_refused() {
    let tenant = "canary3";
    tenant_with_detect(tenant);
    for bad in ["abort_margin=0.1&abort_after=-1", "abort_margin=0.1&abort_after=18446744073709551616", "abort_margin=1.5&abort_after=10"] {
        let (status, refused) = upload_hostile(tenant, &format!("canary=10&{bad}"));
        assert_eq!((status, refused["error"]["code"].as_str()), (400, Some("invalid")), "{bad}: {refused}");
    }
    assert!(canary(tenant).is_null(), "a refused upload starts no canary");
    let (status, answer) = upload_hostile(tenant, "canary=10&abort_margin=0.1&abort_after=18446744073709551615");
    assert_eq!(status, 201, "{answer}");
    assert_eq!(canary(tenant)["abort"], json!({ "margin": 0.1, "after": i64::MAX }), "clamped to i64::MAX, not wrapped");
}

/// `promote` and `abort` of one canary at once: exactly one of them wins.
/// A promote that wins makes the canary active; one that loses changes
/// nothing and says why: 429 `change_in_progress` (the abort was under
/// way), 404 (the canary gone before it looked) or 409 `conflict` (it
/// ended while the promote loaded it). Never both, never a 5xx.
#[test]
fn promote_and_abort_at_once_one_wins_and_the_loser_changes_nothing() {
    let tenant = "canary4";
    tenant_with_detect(tenant);
    let post = |what: &str| admin_json(admin(Method::POST, &format!("tenants/{tenant}/handlers/h/{what}")));
    let mut outcomes = std::collections::BTreeMap::new();
    for _ in 0..10 {
        let (status, released) = upload_hostile(tenant, "canary=50");
        assert_eq!(status, 201, "{released}");
        let (canary_version, active_before) = (released["version"].as_i64().unwrap(), released["active_version"].as_i64().unwrap());
        let barrier = std::sync::Barrier::new(2);
        let ((promoted, p), (aborted, a)) = std::thread::scope(|s| {
            let promote = s.spawn(|| {
                barrier.wait();
                post("promote")
            });
            let abort = s.spawn(|| {
                barrier.wait();
                post("abort")
            });
            (promote.join().unwrap(), abort.join().unwrap())
        });
        let (_, versions) = admin_json(admin(Method::GET, &format!("tenants/{tenant}/handlers/h/versions")));
        assert!(versions["canary"].is_null(), "the canary ended either way: {versions}");
        let active = versions["active_version"].as_i64();
        let code = |answer: &Value, status: u16| match status {
            404 => answer["error"]["code"] == "not_found",
            409 => answer["error"]["code"] == "conflict",
            // A node makes one change of a tenant at a time.
            429 => answer["error"]["code"] == "change_in_progress",
            _ => false,
        };
        match (promoted, aborted) {
            (200, _) if code(&a, aborted) => assert_eq!(active, Some(canary_version), "promoted: {a}"),
            (_, 200) if code(&p, promoted) => assert_eq!(active, Some(active_before), "aborted: the promote changed nothing: {p}"),
            other => panic!("promote and abort answered {other:?}: {p} {a}"),
        }
        *outcomes.entry((promoted, aborted)).or_insert(0) += 1;
    }
    eprintln!("(promote, abort) outcomes of 10 races: {outcomes:?}");
}
