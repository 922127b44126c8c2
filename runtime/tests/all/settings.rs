//! Settings and secrets (`wasi:config/store`): set through the APIs and
//! the CLI, read by handlers as the request started, without a redeploy; a
//! handler's own over its tenant's; secrets sealed in the store, read by
//! their handler and shown by nothing else.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::harness::{self, ADMIN_TOKEN, anonymous, client_with_key, image};
use crate::registry::cli;

/// A seeded gateway of its own (these tests change what `demo` and `evil` read).
fn gateway(name: &str) -> (SocketAddr, PathBuf) {
    let data = harness::fresh_dir(&format!("settings-{name}"));
    (harness::start(harness::config(data.clone(), Some(harness::seed_dir()))), data)
}

fn key_of(data: &Path, tenant: &str) -> String {
    std::fs::read_to_string(data.join(format!("{tenant}.key"))).unwrap().trim().to_owned()
}

/// `demo`'s `detect` on city.jpg with `query`: its faces' scores and its version header.
fn scores(addr: SocketAddr, data: &Path, query: &str) -> (u16, Vec<f64>, String) {
    let response =
        client_with_key(&key_of(data, "demo")).post(format!("http://{addr}/v1/demo/detect{query}")).body(image("city.jpg")).send().unwrap();
    let status = response.status().as_u16();
    let version = response.headers().get("x-facegate-handler-version").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
    let body: Value = response.json().unwrap();
    let scores = body["faces"].as_array().map(|f| f.iter().map(|f| f["score"].as_f64().unwrap()).collect()).unwrap_or_default();
    (status, scores, version)
}

fn ok(out: (i32, String, String)) -> String {
    assert_eq!(out.0, 0, "{}{}", out.1, out.2);
    out.1
}

#[test]
fn a_setting_changes_detects_answer_without_a_redeploy_a_handlers_own_winning() {
    let (addr, data) = gateway("detect");
    let (status, before, version) = scores(addr, &data, "");
    assert_eq!(status, 200);
    // A threshold between two of the faces' scores: some stay, some go.
    let mut sorted = before.clone();
    sorted.sort_by(f64::total_cmp);
    let at = sorted.windows(2).find(|w| w[1] - w[0] > 0.02).expect("two faces of different scores");
    let threshold = (at[0] + at[1]) / 2.0;
    let kept = before.iter().filter(|&&s| s > threshold).count();
    assert!(kept > 0 && kept < before.len(), "{before:?} at {threshold}");

    let t = format!("{threshold:.4}");
    ok(cli(addr, &["config", "set", "--tenant", "demo", "--handler", "detect", "min_score", &t], &[], ""));
    let (status, after, same) = scores(addr, &data, "");
    assert_eq!((status, after.len(), same.as_str()), (200, kept, version.as_str()), "the next request, the same version");
    assert_eq!(scores(addr, &data, "?threshold=0.5").1.len(), before.len(), "the query still wins");
    // The tenant's own value is under the handler's.
    ok(cli(addr, &["config", "set", "--tenant", "demo", "min_score", "0.99"], &[], ""));
    assert_eq!(scores(addr, &data, "").1.len(), kept, "the handler's own wins");
    let listed = ok(cli(addr, &["config", "list", "--tenant", "demo"], &[], ""));
    assert!(listed.contains(&format!("detect\tmin_score\t{t}")) && listed.contains("*\tmin_score\t0.99"), "{listed}");
    ok(cli(addr, &["config", "unset", "--tenant", "demo", "--handler", "detect", "min_score"], &[], ""));
    let tenant_wide = scores(addr, &data, "").1;
    assert!(tenant_wide.iter().all(|&s| s > 0.99) && tenant_wide.len() < before.len(), "the tenant's: {tenant_wide:?}");
    // Through the tenant API, with a deploy key; a value detect cannot use is its clear 500.
    let deploy = anonymous()
        .post(format!("http://{addr}/admin/v1/tenants/demo/keys"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({ "scopes": ["deploy"] }));
    let deploy: Value = deploy.send().unwrap().json().unwrap();
    let put = client_with_key(deploy["key"].as_str().unwrap())
        .put(format!("http://{addr}/tenant/v1/config/min_score"))
        .json(&json!({ "value": "lots" }));
    assert_eq!(put.send().unwrap().status(), 200);
    let response =
        client_with_key(&key_of(&data, "demo")).post(format!("http://{addr}/v1/demo/detect")).body(image("city.jpg")).send().unwrap();
    assert_eq!(response.status(), 500);
    let body: Value = response.json().unwrap();
    assert_eq!(body["error"]["code"], "bad_setting", "{body}");
    ok(cli(addr, &["config", "unset", "--tenant", "demo", "min_score"], &[], ""));
    assert_eq!(scores(addr, &data, "").1, before, "back to the default");
}

/// `tenant`'s hostile handler's answer to `attack=config&name=NAME`.
fn read_setting(addr: SocketAddr, key: &str, tenant: &str, name: Option<&str>) -> Value {
    let query = name.map_or_else(String::new, |n| format!("&name={n}"));
    let url = format!("http://{addr}/v1/{tenant}/attack?attack=config{query}");
    let response = client_with_key(key).get(url).send().unwrap();
    assert_eq!(response.status(), 200);
    response.json().unwrap()
}

#[test]
fn secrets_reach_their_handler_sealed_and_nothing_else_shows_them() {
    const SECRET: &str = "whsec-5f2b9c-not-for-anyone";
    let (addr, data) = gateway("secrets");
    // A second tenant with the same handler, to ask for the same name.
    let admin = |m: reqwest::Method, path: &str| anonymous().request(m, format!("http://{addr}/admin/v1/{path}")).bearer_auth(ADMIN_TOKEN);
    assert_eq!(admin(reqwest::Method::POST, "tenants").json(&json!({ "name": "neighbour" })).send().unwrap().status(), 201);
    let neighbour: Value = admin(reqwest::Method::POST, "tenants/neighbour/keys").send().unwrap().json().unwrap();
    let neighbour = neighbour["key"].as_str().unwrap().to_owned();
    let deployed = admin(reqwest::Method::PUT, "tenants/neighbour/handlers/attack").body(std::fs::read(harness::guest("hostile")).unwrap());
    assert_eq!(deployed.send().unwrap().status(), 201);

    let set = ok(cli(addr, &["secret", "set", "--tenant", "evil", "--handler", "attack", "webhook_token"], &[], &format!("{SECRET}\n")));
    assert!(!set.contains(SECRET), "{set}");
    ok(cli(addr, &["config", "set", "--tenant", "evil", "webhook_url", "https://hooks.example/evil"], &[], ""));
    let evil = key_of(&data, "evil");
    assert_eq!(read_setting(addr, &evil, "evil", Some("webhook_token")), json!({ "value": SECRET }), "its handler reads it");
    let all = read_setting(addr, &evil, "evil", None);
    assert_eq!(all["all"]["webhook_url"], "https://hooks.example/evil", "{all}");
    assert_eq!(read_setting(addr, &neighbour, "neighbour", Some("webhook_token")), json!({ "value": null }), "another tenant's does not");

    // No answer, log, metric or file shows it.
    let listed = ok(cli(addr, &["config", "list", "--tenant", "evil", "--json"], &[], ""));
    assert!(listed.contains("webhook_token") && listed.contains("fingerprint") && !listed.contains(SECRET), "{listed}");
    let read_key: Value =
        admin(reqwest::Method::POST, "tenants/evil/keys").json(&json!({ "scopes": ["read"] })).send().unwrap().json().unwrap();
    let read_key = read_key["key"].as_str().unwrap();
    for path in ["config", "logs?handler=attack", "usage"] {
        let text = client_with_key(read_key).get(format!("http://{addr}/tenant/v1/{path}")).send().unwrap().text().unwrap();
        assert!(!text.contains(SECRET), "{path}: {text}");
    }
    let put = client_with_key(read_key).put(format!("http://{addr}/tenant/v1/config/x")).json(&json!({ "value": "y" }));
    assert_eq!(put.send().unwrap().status(), 403, "a read key sets nothing");
    let metrics = anonymous().get(format!("http://{addr}/metrics")).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap();
    assert!(!metrics.contains(SECRET));
    for entry in std::fs::read_dir(&data).unwrap().flatten().filter(|e| e.path().is_file()) {
        let bytes = std::fs::read(entry.path()).unwrap();
        assert!(!bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()), "{} holds the secret in clear", entry.path().display());
    }
    // Gone with `unset`, for the next request.
    ok(cli(addr, &["config", "unset", "--tenant", "evil", "--handler", "attack", "webhook_token"], &[], ""));
    assert_eq!(read_setting(addr, &evil, "evil", Some("webhook_token")), json!({ "value": null }));
}
