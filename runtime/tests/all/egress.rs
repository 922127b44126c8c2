//! Outgoing HTTP: denied without the tenant's grant; with it, public
//! addresses only unless the operator allows private ones
//! (`--outgoing-allow-private`). The hostile handler's `fetch` makes the
//! request through `wasi:http/outgoing-handler` and answers its outcome.

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{self, ADMIN_TOKEN, anonymous, client_as, client_with_key, guest, url};
use crate::warm::{call, hostile_tenant};

/// `fetch` of `target` by `tenant`'s hostile handler: its outcome.
fn fetch(key: &str, tenant: &str, target: &str) -> String {
    let (status, body) = call(key, tenant, &format!("fetch&url={target}"));
    assert_eq!(status, 200, "{body}");
    body["outcome"].as_str().unwrap().to_owned()
}

#[test]
fn a_handler_without_the_grant_sends_nothing() {
    let port = harness::gateway().addr.port();
    let response = client_as("evil").get(url(&format!("/v1/evil/attack?attack=fetch&url=http://127.0.0.1:{port}/healthz"))).send().unwrap();
    let body: Value = response.json().unwrap();
    assert!(body["outcome"].as_str().unwrap().contains("HttpRequestDenied"), "{body}");
}

/// The gateway itself (by address and by name, IPv4 and IPv6, IPv4 inside
/// IPv6), the cloud metadata service and a private network are refused
/// before any connection: nothing listens at the last two here, so only the
/// check can answer at once.
#[test]
fn a_granted_handler_reaches_no_loopback_private_or_link_local_address() {
    let key = hostile_tenant("egress", json!({ "outgoing_http": true }));
    let port = harness::gateway().addr.port();
    for target in [
        format!("http://127.0.0.1:{port}/healthz"),
        format!("http://localhost:{port}/healthz"),
        format!("http://[::1]:{port}/healthz"),
        format!("http://[::ffff:127.0.0.1]:{port}/healthz"),
        "http://169.254.169.254/latest/meta-data/".to_owned(),
        "http://10.0.0.1/".to_owned(),
    ] {
        let outcome = fetch(&key, "egress", &target);
        assert!(outcome.contains("DestinationIpProhibited"), "{target}: {outcome}");
    }
}

/// With private addresses allowed the same request reaches the gateway's
/// `/healthz`: what refused it above is the address check, not the client.
#[test]
fn with_private_addresses_allowed_a_granted_handler_reaches_the_host() {
    let seed = harness::fresh_dir("egress-private-seed");
    harness::install(&seed, "inner", "attack", &guest("hostile"));
    let data = harness::fresh_dir("egress-private-data");
    let mut config = harness::config(data.clone(), Some(seed));
    config.outgoing_allow_private = true;
    let addr = harness::start(config);
    let grant = anonymous()
        .request(Method::PATCH, format!("http://{addr}/admin/v1/tenants/inner"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({ "outgoing_http": true }))
        .send()
        .unwrap();
    assert_eq!(grant.status(), 200);
    let key = std::fs::read_to_string(data.join("inner.key")).unwrap().trim().to_owned();
    let response = client_with_key(&key)
        .get(format!("http://{addr}/v1/inner/attack?attack=fetch&url=http://127.0.0.1:{}/healthz", addr.port()))
        .send()
        .unwrap();
    let body: Value = response.json().unwrap();
    assert_eq!(body["outcome"], "ok: 200", "{body}");
}
