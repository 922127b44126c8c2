//! Handlers' state (`wasi:keyvalue`): kept per tenant in the store, within
//! the tenant's limits, read and cleared through the APIs and the CLI, and
//! the caching example answering a repeated image without `infer`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{self, ADMIN_TOKEN, anonymous, client_with_key, guest, image};
use crate::registry::cli;
use crate::usage::{field, until_requests};

/// A seeded gateway of its own.
fn gateway(name: &str) -> (SocketAddr, PathBuf) {
    let data = harness::fresh_dir(&format!("state-{name}"));
    (harness::start(harness::config(data.clone(), Some(harness::seed_dir()))), data)
}

fn key_of(data: &Path, tenant: &str) -> String {
    std::fs::read_to_string(data.join(format!("{tenant}.key"))).unwrap().trim().to_owned()
}

fn admin(addr: SocketAddr, method: Method, path: &str) -> reqwest::blocking::RequestBuilder {
    anonymous().request(method, format!("http://{addr}/admin/v1/{path}")).bearer_auth(ADMIN_TOKEN)
}

/// Creates `tenant` with `limits`, the hostile program as its `attack`; its key.
fn hostile_tenant(addr: SocketAddr, tenant: &str, limits: Value) -> String {
    let created = admin(addr, Method::POST, "tenants").json(&json!({ "name": tenant, "limits": limits })).send().unwrap();
    assert_eq!(created.status(), 201);
    let deployed = admin(addr, Method::PUT, &format!("tenants/{tenant}/handlers/attack")).body(std::fs::read(guest("hostile")).unwrap());
    assert_eq!(deployed.send().unwrap().status(), 201);
    let key: Value = admin(addr, Method::POST, &format!("tenants/{tenant}/keys")).send().unwrap().json().unwrap();
    key["key"].as_str().unwrap().to_owned()
}

/// `tenant`'s hostile handler's answer to `attack=ATTACK&QUERY`.
fn attack(addr: SocketAddr, key: &str, tenant: &str, query: &str) -> Value {
    let response = client_with_key(key).get(format!("http://{addr}/v1/{tenant}/attack?{query}")).send().unwrap();
    assert_eq!(response.status(), 200);
    response.json().unwrap()
}

#[test]
fn tenants_keep_their_own_state_within_their_limits_and_lose_it_with_the_tenant() {
    let (addr, data) = gateway("limits");
    let evil = key_of(&data, "evil");
    let small = json!({ "kv_keys": 1000, "kv_bytes": 10_000, "kv_ops": 50 });
    let neighbour = hostile_tenant(addr, "neighbour", small.clone());

    // The same bucket and key names, two tenants, two values.
    assert_eq!(attack(addr, &evil, "evil", "attack=kv-put&bucket=b&key=k&value=mine"), json!({ "ok": true }));
    assert_eq!(attack(addr, &neighbour, "neighbour", "attack=kv-get&bucket=b&key=k"), json!({ "value": null }));
    assert_eq!(attack(addr, &neighbour, "neighbour", "attack=kv-put&bucket=b&key=k&value=theirs"), json!({ "ok": true }));
    assert_eq!(attack(addr, &evil, "evil", "attack=kv-get&bucket=b&key=k"), json!({ "value": "mine" }));
    assert_eq!(attack(addr, &neighbour, "neighbour", "attack=kv-list&bucket=b"), json!({ "keys": ["k"] }));
    // Counters add up across requests.
    attack(addr, &evil, "evil", "attack=kv-incr&bucket=c&key=n&by=40");
    assert_eq!(attack(addr, &evil, "evil", "attack=kv-incr&bucket=c&key=n&by=2"), json!({ "value": 42 }));
    assert!(attack(addr, &evil, "evil", "attack=kv-incr&bucket=b&key=k")["error"].as_str().unwrap().contains("not a decimal integer"));

    // Each bound, past it, is an error naming it; nothing is written past it.
    let ops = attack(addr, &neighbour, "neighbour", "attack=kv-fill&bucket=small&bytes=1");
    assert_eq!(ops["written"], 50, "{ops}");
    assert!(ops["error"].as_str().unwrap().contains("kv_ops"), "{ops}");
    let bytes = attack(addr, &neighbour, "neighbour", "attack=kv-fill&bucket=big&bytes=1000");
    assert!(bytes["error"].as_str().unwrap().contains("kv_bytes"), "{bytes}");
    let huge = attack(addr, &neighbour, "neighbour", "attack=kv-fill&bucket=huge&bytes=2000000");
    assert_eq!(huge["written"], 0);
    assert!(huge["error"].as_str().unwrap().contains("kv_value_bytes"), "{huge}");
    // A loop of writes, request after request, never grows it past kv_bytes.
    for _ in 0..3 {
        let again = attack(addr, &neighbour, "neighbour", "attack=kv-fill&bucket=more&bytes=100");
        assert!(again["error"].as_str().unwrap().contains("kv_bytes"), "{again}");
    }
    let state: Value = admin(addr, Method::GET, "tenants/neighbour/kv").send().unwrap().json().unwrap();
    assert!(state["bytes"].as_u64().unwrap() <= 10_000, "{state}");
    let big_keys = state["buckets"].as_array().unwrap().iter().find(|b| b["name"] == "big").unwrap()["keys"].as_u64().unwrap();
    assert_eq!(big_keys, bytes["written"].as_u64().unwrap(), "{state}");

    // The tenant API: a key reaches its own tenant's state only, with the read or deploy scope.
    let invoke = client_with_key(&evil).get(format!("http://{addr}/tenant/v1/kv/b/k")).send().unwrap();
    assert_eq!(invoke.status(), 403, "an invoke key reads no state");
    let evil_read: Value =
        admin(addr, Method::POST, "tenants/evil/keys").json(&json!({ "scopes": ["read"] })).send().unwrap().json().unwrap();
    let theirs = client_with_key(evil_read["key"].as_str().unwrap()).get(format!("http://{addr}/tenant/v1/kv/b/k")).send().unwrap();
    assert_eq!(theirs.bytes().unwrap().as_ref(), b"mine", "evil's key reads evil's value");
    let read: Value =
        admin(addr, Method::POST, "tenants/neighbour/keys").json(&json!({ "scopes": ["read"] })).send().unwrap().json().unwrap();
    let read = read["key"].as_str().unwrap();
    let value = client_with_key(read).get(format!("http://{addr}/tenant/v1/kv/b/k")).send().unwrap();
    assert_eq!((value.status().as_u16(), value.bytes().unwrap().to_vec()), (200, b"theirs".to_vec()));
    let put = client_with_key(read).put(format!("http://{addr}/tenant/v1/kv/b/k")).body("x").send().unwrap();
    assert_eq!(put.status(), 403, "a read key writes nothing");
    let missing = client_with_key(read).get(format!("http://{addr}/tenant/v1/kv/b/nothing")).send().unwrap();
    assert_eq!(missing.status(), 404);

    // Usage meters the state's reads and writes.
    let report = || admin(addr, Method::GET, "usage?tenant=neighbour&by=minute").send().unwrap().json::<Value>().unwrap();
    let usage = until_requests(9, report);
    assert!(field(&usage, "kv_writes") >= 50 + 2 && field(&usage, "kv_reads") >= 2, "{usage}");

    // Deleting the tenant deletes its state: created again, it starts empty.
    assert_eq!(admin(addr, Method::DELETE, "tenants/neighbour").send().unwrap().status(), 200);
    let neighbour = hostile_tenant(addr, "neighbour", small);
    assert_eq!(attack(addr, &neighbour, "neighbour", "attack=kv-get&bucket=b&key=k"), json!({ "value": null }));
    let state: Value = admin(addr, Method::GET, "tenants/neighbour/kv").send().unwrap().json().unwrap();
    assert_eq!((state["keys"].as_u64(), state["bytes"].as_u64()), (Some(0), Some(0)), "{state}");
    assert_eq!(attack(addr, &evil, "evil", "attack=kv-get&bucket=b&key=k"), json!({ "value": "mine" }), "the other tenant's stays");
}

#[test]
fn the_cli_lists_reads_writes_and_deletes_a_tenants_state() {
    let (addr, data) = gateway("cli");
    let evil = key_of(&data, "evil");
    let ok = |args: &[&str], stdin: &str| {
        let (code, out, err) = cli(addr, args, &[], stdin);
        assert_eq!(code, 0, "{args:?}: {out}{err}");
        out
    };
    ok(&["kv", "put", "--tenant", "evil", "notes", "greeting/en", "hello"], "");
    ok(&["kv", "put", "--tenant", "evil", "notes", "blob", "--from-stdin"], "from stdin\n");
    assert_eq!(
        attack(addr, &evil, "evil", "attack=kv-get&bucket=notes&key=greeting/en"),
        json!({ "value": "hello" }),
        "the handler reads it"
    );
    attack(addr, &evil, "evil", "attack=kv-incr&bucket=notes&key=count&by=7");
    assert_eq!(ok(&["kv", "get", "--tenant", "evil", "notes", "count"], ""), "7");
    assert_eq!(ok(&["kv", "get", "--tenant", "evil", "notes", "blob"], ""), "from stdin\n");
    let keys = ok(&["kv", "list", "--tenant", "evil", "notes"], "");
    assert_eq!(keys.lines().collect::<Vec<_>>(), ["blob", "count", "greeting/en"]);
    let buckets = ok(&["kv", "list", "--tenant", "evil", "--json"], "");
    let buckets: Value = serde_json::from_str(&buckets).unwrap();
    assert_eq!(buckets["keys"], 3, "{buckets}");
    ok(&["kv", "delete", "--tenant", "evil", "notes", "greeting/en"], "");
    assert_eq!(attack(addr, &evil, "evil", "attack=kv-get&bucket=notes&key=greeting/en"), json!({ "value": null }));
    let (code, _, err) = cli(addr, &["kv", "get", "--tenant", "evil", "notes", "greeting/en"], &[], "");
    assert_ne!(code, 0);
    assert!(err.contains("not_found") || err.contains("no key"), "{err}");
    let (code, _, err) = cli(addr, &["kv", "delete", "--tenant", "evil", "notes"], &[], "");
    assert_ne!(code, 0, "a whole bucket only with --all");
    assert!(err.contains("--all"), "{err}");
    ok(&["kv", "delete", "--tenant", "evil", "notes", "--all"], "");
    assert_eq!(ok(&["kv", "list", "--tenant", "evil", "notes"], ""), "");
}

#[test]
fn the_caching_example_answers_a_repeated_image_from_state_without_inference() {
    let (addr, data) = gateway("cached");
    let deployed = admin(addr, Method::PUT, "tenants/demo/handlers/detect-cached").body(std::fs::read(guest("detect_cached")).unwrap());
    assert_eq!(deployed.send().unwrap().status(), 201);
    let demo = client_with_key(&key_of(&data, "demo"));
    let post = |query: &str| demo.post(format!("http://{addr}/v1/demo/detect-cached{query}")).body(image("city.jpg")).send().unwrap();
    let first = post("");
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["x-facegate-cache"], "miss");
    let first: Value = first.json().unwrap();
    assert!(!first["faces"].as_array().unwrap().is_empty());
    let second = post("");
    assert_eq!(second.headers()["x-facegate-cache"], "hit");
    assert_eq!(second.json::<Value>().unwrap(), first, "the same answer");
    // Other options are another answer.
    let other = post("?threshold=0.9");
    assert_eq!(other.headers()["x-facegate-cache"], "miss");
    // Answers like detect's.
    let plain: Value = demo.post(format!("http://{addr}/v1/demo/detect")).body(image("city.jpg")).send().unwrap().json().unwrap();
    assert_eq!(plain["faces"], first["faces"]);

    // Two inferences for three answers: the hit cost no device time.
    let report = || admin(addr, Method::GET, "usage?tenant=demo&by=minute").send().unwrap().json::<Value>().unwrap();
    until_requests(4, report);
    let rows = report();
    let cached: Vec<&Value> = rows["rows"].as_array().unwrap().iter().filter(|r| r["handler"] == "detect-cached").collect();
    let calls: u64 = cached.iter().map(|r| r["infer_calls"].as_u64().unwrap_or(0)).sum();
    assert_eq!(calls, 2, "{rows}");
    let writes: u64 = cached.iter().map(|r| r["kv_writes"].as_u64().unwrap_or(0)).sum();
    assert_eq!(writes, 2, "{rows}");
}
