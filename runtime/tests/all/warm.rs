//! Warm instances (a tenant's `instance_reuse` above 1): an instance serves
//! several requests of one handler version, and only after requests that
//! ended cleanly; by default every request gets a fresh instance. The
//! hostile test handler's `count` answers how many requests its instance
//! has served (1 in a fresh one).

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{self, ADMIN_TOKEN, admin, admin_json, anonymous, client_with_key, guest, url};

/// Creates `tenant` with `limits`, deploys the hostile handler as `attack`;
/// returns the tenant's key.
pub(crate) fn hostile_tenant(tenant: &str, limits: Value) -> String {
    let (status, body) = admin_json(admin(Method::POST, "tenants").json(&json!({ "name": tenant, "limits": limits })));
    assert_eq!(status, 201, "{body}");
    let (status, body) = admin_json(admin(Method::POST, &format!("tenants/{tenant}/keys")));
    assert_eq!(status, 201, "{body}");
    let key = body["key"].as_str().unwrap().to_owned();
    let (status, body) =
        admin_json(admin(Method::PUT, &format!("tenants/{tenant}/handlers/attack")).body(std::fs::read(guest("hostile")).unwrap()));
    assert_eq!(status, 201, "{body}");
    key
}

/// One request to `tenant`'s hostile handler: status and JSON answer. No
/// wait between calls: an answer ends once its instance is back with its
/// handler (or gone).
pub(crate) fn call(key: &str, tenant: &str, attack: &str) -> (u16, Value) {
    let response = client_with_key(key).get(url(&format!("/v1/{tenant}/attack?attack={attack}"))).send().unwrap();
    let status = response.status().as_u16();
    (status, response.json().unwrap_or(Value::Null))
}

/// `served` of `n` `count` requests in a row.
fn counts(key: &str, tenant: &str, n: usize) -> Vec<u64> {
    (0..n)
        .map(|_| {
            let (status, body) = call(key, tenant, "count");
            assert_eq!(status, 200, "{body}");
            body["served"].as_u64().unwrap()
        })
        .collect()
}

#[test]
fn instances_are_fresh_by_default_and_serve_at_most_instance_reuse_requests() {
    let key = hostile_tenant("warm-limit", json!({}));
    assert_eq!(counts(&key, "warm-limit", 3), [1, 1, 1], "by default nothing of a request is left for the next");
    let (status, body) = admin_json(admin(Method::PATCH, "tenants/warm-limit").json(&json!({ "instance_reuse": 3 })));
    assert_eq!((status, body["limits"]["instance_reuse"].as_u64()), (200, Some(3)), "{body}");
    assert_eq!(counts(&key, "warm-limit", 7), [1, 2, 3, 1, 2, 3, 1], "one instance, replaced after 3 requests");
    let (status, body) = admin_json(admin(Method::PATCH, "tenants/warm-limit").json(&json!({ "instance_reuse": 1 })));
    assert_eq!(status, 200, "{body}");
    assert_eq!(counts(&key, "warm-limit", 2), [1, 1], "turned off, the warm instance is dropped");
    let (status, body) = admin_json(admin(Method::PATCH, "tenants/warm-limit").json(&json!({ "instance_reuse": 0 })));
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("instance_reuse"), "{body}");
}

#[test]
fn an_instance_that_trapped_timed_out_or_kept_host_resources_is_never_reused() {
    let key = hostile_tenant("warm-dirty", json!({ "instance_reuse": 100, "timeout_ms": 1000 }));
    let tenant = "warm-dirty";
    assert_eq!(counts(&key, tenant, 2), [1, 2]);
    assert_eq!(call(&key, tenant, "panic").0, 500);
    assert_eq!(counts(&key, tenant, 2), [1, 2], "after a trap, a fresh instance");
    assert_eq!(call(&key, tenant, "loop").0, 504);
    assert_eq!(counts(&key, tenant, 1), [1], "after a timeout, a fresh instance");
    let (status, body) = call(&key, tenant, "leak");
    assert_eq!((status, body["served"].as_u64()), (200, Some(2)), "{body}");
    assert_eq!(counts(&key, tenant, 2), [1, 2], "an instance that left a resource in the host's table is dropped");
    // Memory-limit trap: the instance is gone too.
    assert_eq!(call(&key, tenant, "memory").0, 500);
    assert_eq!(counts(&key, tenant, 1), [1]);
}

/// Whether `/metrics` (read by `metrics`) shows `n` idle instances within 10 s.
fn warm_becomes(metrics: &dyn Fn() -> String, n: f64) -> bool {
    (0..200).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        harness::metric(&metrics(), "facegate_instances_warm") == Some(n)
    })
}

#[test]
fn a_warm_instance_gets_each_request_its_own_infer_budget() {
    let key = hostile_tenant("warm-budget", json!({ "instance_reuse": 100, "max_infer_calls": 2 }));
    assert_eq!(counts(&key, "warm-budget", 1), [1]);
    for _ in 0..3 {
        let (status, body) = call(&key, "warm-budget", "big-tensor&side=64&n=2");
        assert_eq!((status, &body["outcomes"]), (200, &json!(["ok", "ok"])), "{body}");
    }
    assert_eq!(counts(&key, "warm-budget", 1), [2], "one instance served them all (big-tensor does not count)");
}

/// A tenant keeps at most its concurrency limit of idle instances, all its
/// handlers together: with `max_concurrency` 1, a second handler's
/// instance is not kept while the first handler's waits.
#[test]
fn a_tenant_keeps_at_most_its_concurrency_of_idle_instances() {
    let key = hostile_tenant("warm-share", json!({ "instance_reuse": 100, "max_concurrency": 1 }));
    let (status, body) =
        admin_json(admin(Method::PUT, "tenants/warm-share/handlers/second").body(std::fs::read(guest("hostile")).unwrap()));
    assert_eq!(status, 201, "{body}");
    // One concurrency slot: each answer ends once its guest is gone (and
    // its instance kept), so the next call, sent at once, finds both.
    let served = |handler: &str| {
        let response = client_with_key(&key).get(url(&format!("/v1/warm-share/{handler}?attack=count"))).send().unwrap();
        assert_eq!(response.status(), 200, "{handler}: {}", response.text().unwrap());
        response.json::<Value>().unwrap()["served"].as_u64().unwrap()
    };
    assert_eq!([served("attack"), served("attack")], [1, 2]);
    assert_eq!([served("second"), served("second")], [1, 1], "the tenant's one idle place is taken by the first handler");
    assert_eq!(served("attack"), 3, "whose instance still waits");
}

/// Idle instances go when the tenant's limits change (they were made
/// under the old ones) and when they waited `--warm-idle-secs`, without a
/// request to notice.
#[test]
fn idle_instances_go_when_limits_change_and_when_they_wait_too_long() {
    let seed = harness::fresh_dir("warm-expiry-seed");
    harness::install(&seed, "idler", "attack", &guest("hostile"));
    let data = harness::fresh_dir("warm-expiry-data");
    let mut config = harness::config(data.clone(), Some(seed));
    config.limits.instance_reuse = 100;
    config.warm_idle_secs = 2;
    let addr = harness::start(config);
    let key = std::fs::read_to_string(data.join("idler.key")).unwrap().trim().to_owned();
    let count = || {
        let response = client_with_key(&key).get(format!("http://{addr}/v1/idler/attack?attack=count")).send().unwrap();
        response.json::<Value>().unwrap()["served"].as_u64().unwrap()
    };
    let metrics = || anonymous().get(format!("http://{addr}/metrics")).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap();
    let patch = |limits: Value| {
        let response =
            anonymous().patch(format!("http://{addr}/admin/v1/tenants/idler")).bearer_auth(ADMIN_TOKEN).json(&limits).send().unwrap();
        assert_eq!(response.status(), 200);
    };
    assert_eq!([count(), count()], [1, 2]);
    assert!(warm_becomes(&metrics, 1.0));
    patch(json!({ "max_concurrency": 7 }));
    assert_eq!(harness::metric(&metrics(), "facegate_instances_warm"), Some(0.0), "dropped with the change, no request needed");
    assert_eq!([count(), count()], [1, 2], "a fresh instance under the new limits");
    assert!(warm_becomes(&metrics, 1.0));
    patch(json!({ "instance_reuse": 1 }));
    assert_eq!(harness::metric(&metrics(), "facegate_instances_warm"), Some(0.0), "reuse turned off: none kept");
    patch(json!({ "instance_reuse": 100 }));
    assert_eq!(count(), 1);
    assert!(warm_becomes(&metrics, 1.0));
    assert!(warm_becomes(&metrics, 0.0), "gone after 2 s idle");
    assert_eq!(count(), 1, "the next request gets a fresh instance");
}

#[test]
fn warm_instances_belong_to_one_tenant_and_one_handler_version() {
    let a = hostile_tenant("warm-a", json!({ "instance_reuse": 100 }));
    let b = hostile_tenant("warm-b", json!({ "instance_reuse": 100 }));
    assert_eq!(counts(&a, "warm-a", 2), [1, 2]);
    assert_eq!(counts(&b, "warm-b", 1), [1], "tenant b never gets tenant a's instance");
    assert_eq!(counts(&a, "warm-a", 1), [3]);
    // A new version of the same component: a fresh instance of it.
    let (status, body) = admin_json(admin(Method::PUT, "tenants/warm-a/handlers/attack").body(std::fs::read(guest("hostile")).unwrap()));
    assert_eq!(status, 201, "{body}");
    assert_eq!(counts(&a, "warm-a", 2), [1, 2], "the new version starts afresh");
}

/// Idle instances hold instance slots of their own: with three request
/// slots and two instances kept warm by one tenant, another tenant still
/// runs two requests at once (which would need four instances of a pool of
/// three).
#[test]
fn idle_warm_instances_never_keep_another_tenants_requests_from_running() {
    let seed = harness::fresh_dir("warm-seed");
    for tenant in ["keeper", "other"] {
        harness::install(&seed, tenant, "attack", &guest("hostile"));
    }
    let data = harness::fresh_dir("warm-data");
    let mut config = harness::config(data.clone(), Some(seed));
    config.max_instances = 3;
    config.limits.max_concurrency = 3;
    config.warm_instances = 2;
    config.limits.instance_reuse = 100;
    config.limits.timeout_ms = 1000;
    let addr = harness::start(config);
    let key = |tenant: &str| std::fs::read_to_string(data.join(format!("{tenant}.key"))).unwrap().trim().to_owned();
    let get = |tenant: &str, query: &str| {
        let response = client_with_key(&key(tenant)).get(format!("http://{addr}/v1/{tenant}/attack?{query}")).send().unwrap();
        (response.status().as_u16(), response.text().unwrap())
    };
    let metrics = || anonymous().get(format!("http://{addr}/metrics")).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap();
    // Two overlapping requests (each holds its instance 500 ms) leave two warm instances.
    std::thread::scope(|s| {
        let calls: Vec<_> = (0..2).map(|_| s.spawn(|| get("keeper", "attack=nap&ms=500"))).collect();
        for call in calls {
            let (status, body) = call.join().unwrap();
            assert_eq!(status, 200, "{body}");
        }
    });
    assert!(warm_becomes(&metrics, 2.0), "both instances kept warm");
    // Both request slots are free for the other tenant: each request runs
    // (and meets its deadline) instead of 503 (no slot) or 500 (no instance).
    std::thread::scope(|s| {
        let calls: Vec<_> = (0..2).map(|_| s.spawn(|| get("other", "attack=loop"))).collect();
        for call in calls {
            let (status, body) = call.join().unwrap();
            assert_eq!(status, 504, "{body}");
        }
    });
    // And the keeper's next request runs on one of its warm instances.
    let reused = || harness::metric(&metrics(), "facegate_instances_reused_total").unwrap();
    let before = reused();
    assert_eq!(get("keeper", "attack=count").0, 200);
    assert_eq!(reused(), before + 1.0);
}
