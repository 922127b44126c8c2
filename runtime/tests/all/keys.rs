//! A tenant's keys: at most `max_keys` unrevoked, and churning them costs
//! the other tenants nothing. A key created or revoked changes only the
//! key map of this node's snapshot, after the store's lock is released, so
//! another tenant's deploy does not queue behind snapshot rebuilds.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use reqwest::Method;
use reqwest::blocking::RequestBuilder;
use serde_json::{Value, json};

use crate::harness::{self, ADMIN_TOKEN, anonymous, client_with_key, guest};

/// The churning tenant's `max_keys`.
const MAX_KEYS: usize = 20;
/// Deploys timed, idle and under churn (the median of each is compared).
const DEPLOYS: usize = 5;

/// A gateway of this test's own: no other test's load in its timings.
struct Node {
    base: String,
}

impl Node {
    fn admin(&self, method: Method, path: &str) -> RequestBuilder {
        anonymous().request(method, format!("{}/admin/v1/{path}", self.base)).bearer_auth(ADMIN_TOKEN)
    }

    fn tenant_api(&self, key: &str, method: Method, path: &str) -> RequestBuilder {
        client_with_key(key).request(method, format!("{}/tenant/v1/{path}", self.base))
    }

    /// Creates `name` with `limits`; returns a key of `scopes`.
    fn tenant(&self, name: &str, limits: Value, scopes: &[&str]) -> String {
        let created = self.admin(Method::POST, "tenants").json(&json!({ "name": name, "limits": limits })).send().unwrap();
        assert_eq!(created.status(), 201);
        let key: Value =
            self.admin(Method::POST, &format!("tenants/{name}/keys")).json(&json!({ "scopes": scopes })).send().unwrap().json().unwrap();
        key["key"].as_str().unwrap().to_owned()
    }

    /// One deploy of `wasm` with `key` (upload, compile, store, activate); how long it took.
    fn deploy(&self, key: &str, wasm: &[u8]) -> Duration {
        let started = Instant::now();
        let answer = self.tenant_api(key, Method::PUT, "handlers/faces").body(wasm.to_vec()).send().unwrap();
        let took = started.elapsed();
        assert_eq!(answer.status(), 201, "{:?}", answer.text());
        took
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// What the churning tenant's threads did.
#[derive(Default)]
struct Churned {
    created: AtomicUsize,
    revoked: AtomicUsize,
    refused: AtomicUsize,
    /// Calls refused while another key change of the tenant was in
    /// progress, or past the tenant's `api_rps`.
    queued: AtomicUsize,
}

/// How long a refused call (429) waits before it is tried again: the churn
/// stays at the tenant's API rate, not a flood of refusals that would only
/// measure the node's CPU.
const PACE: Duration = Duration::from_millis(20);

impl Churned {
    /// Creates an invoke key: its id and key, or `None` when refused past
    /// `max_keys`. The tenant's key changes run one at a time on a node:
    /// one refused as in progress (429) is tried again at once.
    fn create(&self, node: &Node, deploy: &str) -> Option<(String, String)> {
        let (status, body) = loop {
            match self.call(node.tenant_api(deploy, Method::POST, "keys")) {
                (429, _) => {}
                answer => break answer,
            }
        };
        if status == 403 {
            assert_eq!(body["error"]["code"], "quota_exceeded", "{body}");
            assert!(body["error"]["message"].as_str().unwrap_or("").contains("max_keys"), "a clear refusal: {body}");
            self.refused.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        assert_eq!(status, 201, "{body}");
        self.created.fetch_add(1, Ordering::Relaxed);
        Some((body["id"].as_str().unwrap().to_owned(), body["key"].as_str().unwrap().to_owned()))
    }

    /// Revokes `id`; its key is refused at once on this node.
    fn revoke(&self, node: &Node, deploy: &str, (id, key): (String, String)) {
        while self.call(node.tenant_api(deploy, Method::DELETE, &format!("keys/{id}"))).0 == 429 {}
        let used = client_with_key(&key).get(format!("{}/v1/churn/none", node.base)).send().unwrap();
        assert_eq!(used.status(), 401, "a revoked key is refused at once");
        self.revoked.fetch_add(1, Ordering::Relaxed);
    }

    /// Sends a key call: its status and JSON answer; a 429 (the tenant's
    /// change in progress, or its API rate) is counted and paced.
    fn call(&self, request: RequestBuilder) -> (u16, Value) {
        let answer = request.send().unwrap();
        let status = answer.status().as_u16();
        let body: Value = answer.json().unwrap_or(Value::Null);
        if status == 429 {
            let code = body["error"]["code"].as_str().unwrap_or("");
            assert!(matches!(code, "change_in_progress" | "api_rate_limited"), "{body}");
            self.queued.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(PACE);
        }
        (status, body)
    }
}

/// One tenant creates keys as fast as its limits let it (the default
/// `api_rps`; four threads creating and revoking) while another deploys:
/// the other's deploy takes at most twice its idle time, measured first on
/// the same node. A key past `max_keys` is refused (403 `quota_exceeded`,
/// naming the limit), before the churn and after it.
#[test]
fn key_churn_leaves_other_deploys_alone_and_stops_at_max_keys() {
    let addr = harness::start(harness::config(harness::fresh_dir("keys-data"), None));
    let node = Node { base: format!("http://{addr}") };
    let churner = node.tenant("churn", json!({ "max_keys": MAX_KEYS }), &["deploy"]);
    let steady = node.tenant("steady", json!({ "api_rps": 0 }), &["deploy"]);
    let filled = fill_up(&node, &churner);
    // Room for the churning threads, one key each at most.
    for key in filled.into_iter().take(CHURNERS) {
        Churned::default().revoke(&node, &churner, key);
    }
    let wasm = std::fs::read(guest("detect")).unwrap();
    node.deploy(&steady, &wasm);
    let idle = median((0..DEPLOYS).map(|_| node.deploy(&steady, &wasm)).collect());

    let (stop, churned) = (AtomicBool::new(false), Churned::default());
    let busy = std::thread::scope(|s| {
        for _ in 0..CHURNERS {
            let (node, churner, stop, churned) = (&node, &churner, &stop, &churned);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let key = churned.create(node, churner).expect("a churning thread has its place");
                    churned.revoke(node, churner, key);
                }
            });
        }
        let busy = median((0..DEPLOYS).map(|_| node.deploy(&steady, &wasm)).collect());
        stop.store(true, Ordering::Relaxed);
        busy
    });
    let (created, revoked, queued) = (churned.created.into_inner(), churned.revoked.into_inner(), churned.queued.into_inner());
    let ratio = busy.as_secs_f64() / idle.as_secs_f64();
    eprintln!(
        "deploy median idle {idle:?}, under key churn {busy:?} ({ratio:.2}x); keys created {created}, revoked {revoked}, 429s {queued}"
    );
    assert!(revoked >= 20, "the churn ran: {revoked} keys created and revoked");
    assert!(ratio <= 2.0, "a deploy took {busy:?} under another tenant's key churn, {ratio:.2}x its idle {idle:?}");
    fill_up(&node, &churner);
}

/// Threads creating and revoking keys while the other tenant deploys.
const CHURNERS: usize = 4;

/// Creates keys until one is refused past `max_keys`; then the tenant has
/// exactly `max_keys` unrevoked keys (its deploy key among them). Returns
/// the keys made.
fn fill_up(node: &Node, churner: &str) -> Vec<(String, String)> {
    let filler = Churned::default();
    let made: Vec<_> = std::iter::from_fn(|| filler.create(node, churner)).take(MAX_KEYS).collect();
    assert_eq!(filler.refused.load(Ordering::Relaxed), 1, "refused past max_keys after {} keys", made.len());
    let keys = loop {
        match filler.call(node.tenant_api(churner, Method::GET, "keys")) {
            (429, _) => {}
            (_, keys) => break keys,
        }
    };
    let active = keys["keys"].as_array().unwrap().iter().filter(|k| k["revoked_at"].is_null()).count();
    assert_eq!(active, MAX_KEYS, "never more than max_keys: {keys}");
    made
}

/// Keys an operator creates for one tenant while another deploys.
const KEYS_CREATED: usize = 200;

/// The control plane's parts keep out of each other's way: an operator
/// creates 200 keys for one tenant (as fast as the admin API takes them,
/// two threads, one change of the tenant at a time), while that tenant follows its log and reads it again and
/// again, and another tenant deploys. The deploy's median stays within 2×
/// its idle median on the same node, each deployed version serves at once
/// (the serving snapshot follows each change without waiting), and every
/// key created authenticates as soon as it is returned.
#[test]
fn two_hundred_keys_and_log_reads_leave_a_neighbours_deploy_and_snapshot_alone() {
    let addr = harness::start(harness::config(harness::fresh_dir("keys-200-data"), None));
    let node = Node { base: format!("http://{addr}") };
    let keyed = node.tenant("keyed", json!({ "max_keys": KEYS_CREATED + 10, "api_rps": 0 }), &["deploy", "read"]);
    let steady = node.tenant("steady", json!({ "api_rps": 0 }), &["deploy"]);
    let wasm = std::fs::read(guest("detect")).unwrap();
    node.deploy(&steady, &wasm);
    let idle = median((0..DEPLOYS).map(|_| node.deploy(&steady, &wasm)).collect());

    let (status, invoke) = harness::admin_json(node.admin(Method::POST, "tenants/steady/keys").json(&json!({ "scopes": ["invoke"] })));
    assert_eq!(status, 201, "{invoke}");
    let invoke = invoke["key"].as_str().unwrap().to_owned();
    // A follower of the churning tenant's log, open throughout.
    let follow = node.tenant_api(&keyed, Method::GET, "logs?follow=true").send().unwrap();
    assert_eq!(follow.status(), 200);
    let (created, reads, stop) = (AtomicUsize::new(0), AtomicUsize::new(0), AtomicBool::new(false));
    let (busy, versions) = std::thread::scope(|s| {
        for _ in 0..2 {
            let (node, created) = (&node, &created);
            s.spawn(move || {
                while created.fetch_add(1, Ordering::Relaxed) < KEYS_CREATED {
                    // A tenant's key changes run one at a time on a node: the other thread's is retried.
                    let key = loop {
                        match harness::admin_json(node.admin(Method::POST, "tenants/keyed/keys").json(&json!({}))) {
                            (429, refused) => assert_eq!(refused["error"]["code"], "change_in_progress", "{refused}"),
                            (status, key) => {
                                assert_eq!(status, 201, "{key}");
                                break key;
                            }
                        }
                    };
                    let used = client_with_key(key["key"].as_str().unwrap()).get(format!("{}/v1/keyed/none", node.base)).send().unwrap();
                    assert_eq!(used.status(), 404, "a key created authenticates at once (no such handler, not 401)");
                }
            });
        }
        let (node, keyed_key, reads, stop) = (&node, &keyed, &reads, &stop);
        s.spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let read = node.tenant_api(keyed_key, Method::GET, "logs").send().unwrap();
                assert_eq!(read.status(), 200);
                reads.fetch_add(1, Ordering::Relaxed);
            }
        });
        let mut versions = Vec::new();
        let mut times = Vec::new();
        while times.len() < DEPLOYS || created.load(Ordering::Relaxed) < KEYS_CREATED {
            times.push(node.deploy(&steady, &wasm));
            let served = client_with_key(&invoke).get(format!("{}/v1/steady/faces", node.base)).send().unwrap();
            versions.push(served.headers().get("x-facegate-handler-version").and_then(|v| v.to_str().ok()).map(str::to_owned));
        }
        stop.store(true, Ordering::Relaxed);
        (median(times), versions)
    });
    drop(follow);
    let ratio = busy.as_secs_f64() / idle.as_secs_f64();
    let reads = reads.into_inner();
    eprintln!("deploy median idle {idle:?}, beside {KEYS_CREATED} keys created and {reads} log reads {busy:?} ({ratio:.2}x)");
    assert!(created.into_inner() >= KEYS_CREATED, "all the keys were created");
    assert!(reads > 0, "the log was read meanwhile");
    // Deploys 1 and DEPLOYS + 1 before these: each one after is the next version, served at once.
    let expected: Vec<Option<String>> = (0..versions.len()).map(|i| Some((DEPLOYS + 2 + i).to_string())).collect();
    assert_eq!(versions, expected, "each deployed version serves as soon as its deploy returns");
    assert!(ratio <= 2.0, "a deploy took {busy:?} beside another tenant's keys and log reads, {ratio:.2}x its idle {idle:?}");
}
