//! Three gateway nodes (separate `facegate serve` processes) on one real
//! PostgreSQL store: what one node is told, the others serve within a
//! second; a node killed mid-upload leaves nothing partial; without the
//! database every node keeps serving, the admin API answers 503, and once
//! it is back the nodes catch up.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use facegate_throwaway_pg::ThrowawayPostgres;
use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{fresh_dir, guest};
use crate::process::Server;

/// How soon a change made through one node must be served by the others,
/// a deploy included: the deploying node stores the component's compiled
/// artifact with the version, and the others load it instead of compiling.
const PROPAGATION: Duration = Duration::from_secs(1);
/// The same for an 18 MB Python handler: its artifact is 38 MB to fetch,
/// authenticate and cache, on sync threads that yield the CPU to serving
/// (niced) while this test keeps the nodes busy serving and a fourth node
/// compiles it (0.04–3.1 s measured here).
const LARGE_DEPLOY_PROPAGATION: Duration = Duration::from_secs(10);

/// A node; `node-a` turns not ready once its snapshot is 5 s unconfirmed, the others after the default 300 s.
fn node(url: &str, id: &str) -> (Server, PathBuf) {
    node_with(url, id, &[])
}

/// [`node`] with more arguments.
fn node_with(url: &str, id: &str, extra: &[&str]) -> (Server, PathBuf) {
    // A directory of its own for each node started: the tests run at once,
    // each with its own `node-a`.
    static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let data = fresh_dir(&format!("cluster-{id}-{n}"));
    let stale_after = if id == "node-a" { "5" } else { "300" };
    let mut args = vec!["--store", url, "--node-id", id, "--stale-after-s", stale_after];
    args.extend_from_slice(extra);
    (Server::start_with(&data, &args), data)
}

/// The live nodes `server` counts (`facegate_live_nodes`).
fn live(server: &Server) -> Option<f64> {
    let text = crate::harness::anonymous().get(format!("http://{}/metrics", server.addr)).bearer_auth(crate::harness::ADMIN_TOKEN);
    crate::harness::metric(&text.send().unwrap().text().unwrap(), "facegate_live_nodes")
}

fn ready(server: &Server) -> u16 {
    crate::harness::anonymous().get(format!("http://{}/readyz", server.addr)).send().unwrap().status().as_u16()
}

/// Polls `check` until it holds; returns how long that took, or panics after `limit`.
fn within(limit: Duration, what: &str, mut check: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    loop {
        if check() {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn status(server: &Server, method: Method, path: &str) -> (u16, Value) {
    let response = server.admin(method, path).send().unwrap();
    (response.status().as_u16(), response.json().unwrap_or(Value::Null))
}

/// What `tenant`'s hostile handler `attack` on `server` says its instance
/// has served (`attack=count`); `None` unless it answered 200.
fn served(server: &Server, key: &str, tenant: &str) -> Option<u64> {
    // No wait: an answer ends once its instance is back with its handler.
    let response =
        crate::harness::client_with_key(key).get(format!("http://{}/v1/{tenant}/attack?attack=count", server.addr)).send().unwrap();
    if response.status() != 200 {
        return None;
    }
    response.json::<Value>().ok()?["served"].as_u64()
}

/// Creates `tenant` (warm instances on) through `server` with the hostile
/// handler as `attack`; returns its new key.
fn warm_hostile_tenant(server: &Server, tenant: &str) -> String {
    server.json(server.admin(Method::POST, "tenants").json(&json!({ "name": tenant, "limits": { "instance_reuse": 100 } })));
    let key = server.json(server.admin(Method::POST, &format!("tenants/{tenant}/keys")))["key"].as_str().unwrap().to_owned();
    server.json(server.admin(Method::PUT, &format!("tenants/{tenant}/handlers/attack")).body(std::fs::read(guest("hostile")).unwrap()));
    key
}

/// A tenant deleted and created again under its name, with the same
/// component at the same version number, while another node looked away
/// (its sync sees all of it at once): that node serves the new tenant from
/// a fresh instance, never one left warm by the deleted tenant.
#[test]
fn a_tenant_deleted_and_created_again_gets_nothing_of_the_old_one_on_another_node() {
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let (a, _) = node(&url, "node-a");
    let (b, _) = node(&url, "node-b");
    let old_key = warm_hostile_tenant(&a, "reborn");
    within(Duration::from_secs(10), "B serves the tenant", || served(&b, &old_key, "reborn").is_some());
    assert!(served(&b, &old_key, "reborn").unwrap() >= 2, "B keeps the instance warm");

    b.pause();
    a.json(a.admin(Method::DELETE, "tenants/reborn"));
    let new_key = warm_hostile_tenant(&a, "reborn");
    b.resume();

    let mut first = None;
    within(Duration::from_secs(10), "B takes the change", || {
        first = served(&b, &new_key, "reborn");
        first.is_some()
    });
    assert_eq!(b.probe(&old_key).0, 401, "the deleted tenant's key is gone");
    assert_eq!(first, Some(1), "the new tenant's first request runs in a fresh instance, not the old tenant's");
    assert_eq!(served(&b, &new_key, "reborn"), Some(2), "then its own instance is kept warm");
}

#[test]
fn three_nodes_on_one_postgres_store_act_as_one_gateway() {
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let (a, _) = node(&url, "node-a");
    let (b, _) = node(&url, "node-b");
    let (mut c, c_data) = node(&url, "node-c");
    let small = std::fs::read(guest("hostile")).unwrap();
    let detect = std::fs::read(guest("detect")).unwrap();
    let blur = std::fs::read(guest("blur")).unwrap();

    // A tenant, a key and a handler made through A.
    a.json(a.admin(Method::POST, "tenants").json(&json!({ "name": "t" })));
    let key = a.json(a.admin(Method::POST, "tenants/t/keys"))["key"].as_str().unwrap().to_owned();
    within(PROPAGATION, "the key reaches B and C", || b.probe(&key).0 == 404 && c.probe(&key).0 == 404);
    // Deploys through A (the response comes once A has compiled and stored
    // the version): served by B and C, which load A's artifact.
    let mut figures = Vec::new();
    let sources = |server: &Server| {
        let text = crate::harness::anonymous().get(format!("http://{}/metrics", server.addr)).bearer_auth(crate::harness::ADMIN_TOKEN);
        let text = text.send().unwrap().text().unwrap();
        let count = |series: &str| crate::harness::metric(&text, series).unwrap_or_else(|| panic!("no {series}"));
        (count("facegate_components_compiled_total"), count("facegate_components_shared_loaded_total"))
    };
    let before = [&a, &b, &c].map(sources);
    for (version, bytes) in [(1, &detect), (2, &small), (3, &blur)] {
        a.json(a.admin(Method::PUT, "tenants/t/handlers/h").body(bytes.clone()));
        for (name, other) in [("B", &b), ("C", &c)] {
            // (The hostile component answers its own status: the version is what counts.)
            let took = within(PROPAGATION, "a deploy through A served by the others", || other.probe(&key).1 == Some(version));
            figures.push(format!("v{version} ({} KiB) deployed through A, served by {name} after {took:?}", bytes.len() >> 10));
        }
    }
    // A compiled each deploy; B and C compiled none of them: they loaded the artifacts A shared.
    let after = [&a, &b, &c].map(sources);
    let deltas: Vec<(f64, f64)> = before.iter().zip(&after).map(|(b, a)| (a.0 - b.0, a.1 - b.1)).collect();
    assert_eq!(deltas, [(3.0, 0.0), (0.0, 3.0), (0.0, 3.0)], "(compiled, shared artifacts loaded) by A, B and C over the deploys");
    // A rollback through C, then an activation through B (versions they have loaded before).
    c.json(c.admin(Method::POST, "tenants/t/handlers/h/rollback"));
    for (name, other) in [("A", &a), ("B", &b)] {
        let took = within(PROPAGATION, "a rollback through C", || other.probe(&key).1 == Some(2));
        figures.push(format!("rollback through C served by {name} after {took:?}"));
    }
    b.json(b.admin(Method::POST, "tenants/t/handlers/h/activate").json(&json!({ "version": 1 })));
    for (name, other) in [("A", &a), ("C", &c)] {
        let took = within(PROPAGATION, "an activation through B", || other.probe(&key).1 == Some(1));
        let (status, version, faces) = crate::detect::detect_at(other.addr, "/v1/t/h", &key);
        assert_eq!((status, version), (200, Some(1)), "{name} serves v1: {faces}");
        crate::detect::assert_body_matches_reference("grace_hopper.jpg", &faces);
        figures.push(format!("activation through B served by {name} after {took:?}"));
    }
    // A key revoked through B is refused by A.
    let second = a.json(a.admin(Method::POST, "tenants/t/keys"));
    let (id, doomed) = (second["id"].as_str().unwrap(), second["key"].as_str().unwrap());
    within(PROPAGATION, "the new key reaches B", || b.probe(doomed).1.is_some());
    b.json(b.admin(Method::DELETE, &format!("tenants/t/keys/{id}")));
    let took = within(PROPAGATION, "a key revoked through B refused by A", || a.probe(doomed).0 == 401);
    figures.push(format!("revocation through B refused by A after {took:?}"));
    // A tenant's deploy key, revoked through A, is refused by B and C on
    // the tenant API.
    let deploy = a.json(a.admin(Method::POST, "tenants/t/keys").json(&json!({ "scopes": ["deploy"] })));
    let (id, doomed) = (deploy["id"].as_str().unwrap(), deploy["key"].as_str().unwrap());
    let versions = |server: &Server| {
        let response = crate::harness::client_with_key(doomed).get(format!("http://{}/tenant/v1/handlers/h/versions", server.addr));
        response.send().unwrap().status().as_u16()
    };
    within(PROPAGATION, "the deploy key reaches B and C", || versions(&b) == 200 && versions(&c) == 200);
    a.json(a.admin(Method::DELETE, &format!("tenants/t/keys/{id}")));
    let took = within(PROPAGATION, "a deploy key revoked through A refused by B and C", || versions(&b) == 401 && versions(&c) == 401);
    figures.push(format!("deploy key revoked through A refused by B and C after {took:?}"));
    // Limits changed through A hold on C. (High enough that each node's
    // share, 12 over four live nodes, never refuses the test's own calls: a
    // guest that has answered may still run, and hold its slot, a moment.)
    a.json(a.admin(Method::PATCH, "tenants/t").json(&json!({ "max_concurrency": 12 })));
    within(PROPAGATION, "a limit change through A", || status(&c, Method::GET, "tenants/t").1["limits"]["max_concurrency"] == 12);

    // Every node reports itself; `facegate nodes` lists them.
    let nodes = within(Duration::from_secs(5), "three nodes alive", || {
        let listed = c.json(c.admin(Method::GET, "nodes"));
        listed["nodes"].as_array().unwrap().iter().filter(|n| n["alive"] == true).count() == 3
    });
    figures.push(format!("three nodes listed alive after {nodes:?}"));
    let cli = std::process::Command::new(env!("CARGO_BIN_EXE_facegate"))
        .args(["nodes", "--url", &format!("http://{}", a.addr)])
        .env("FACEGATE_ADMIN_TOKEN", crate::harness::ADMIN_TOKEN)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&cli.stdout);
    assert!(cli.status.success(), "{table}");
    for (id, server) in [("node-a", &a), ("node-b", &b), ("node-c", &c)] {
        let line = table.lines().find(|l| l.starts_with(id)).unwrap_or_else(|| panic!("{id} missing:\n{table}"));
        assert!(line.contains(&server.addr.to_string()) && line.contains("\tyes\t") && line.contains("cpu"), "{line}");
    }

    // A fourth node that compiles for itself (no shared artifacts): while it
    // compiles a large deploy (a Python handler, seconds of work), the rest
    // of a change applies at once: a key revoked through A is refused by D
    // within a second, while D still serves the version before.
    let (d, _) = node_with(&url, "node-d", &["--share-artifacts", "false"]);
    let third = a.json(a.admin(Method::POST, "tenants/t/keys"));
    let (id, doomed) = (third["id"].as_str().unwrap(), third["key"].as_str().unwrap());
    within(PROPAGATION, "the new key reaches D", || d.probe(doomed).1.is_some());
    let before = d.probe(&key).1;
    let python = std::fs::read(crate::scripts::built("python", "detect")).unwrap();
    let version = a.json(a.admin(Method::PUT, "tenants/t/handlers/h").body(python.clone()))["version"].as_i64().unwrap();
    a.json(a.admin(Method::DELETE, &format!("tenants/t/keys/{id}")));
    let took = within(PROPAGATION, "a key revoked through A, refused by D while D compiles", || d.probe(doomed).0 == 401);
    assert_eq!(d.probe(&key).1, before, "D is still compiling the deploy (seconds): it serves the version before");
    figures.push(format!("revocation through A refused by D after {took:?}, while D compiled v{version}"));
    for (name, other) in [("B", &b), ("C", &c)] {
        let took = within(LARGE_DEPLOY_PROPAGATION, "a Python deploy through A served by B and C", || other.probe(&key).1 == Some(version));
        figures.push(format!("v{version} (Python, {} KiB) served by {name} after {took:?}", python.len() >> 10));
    }
    let compiled = within(Duration::from_secs(180), "D serves the deploy once compiled", || d.call(&key) == (200, Some(version)));
    figures.push(format!("D compiled v{version} itself and served it after {compiled:?}"));
    drop(d);

    // C is killed in the middle of an upload through C: once with half the
    // body sent, once with all of it sent (C is compiling or storing it).
    for (sent, when) in [(detect.len() / 2, "half its body sent"), (detect.len(), "its body sent")] {
        let count = |listing: &Value| listing["versions"].as_array().unwrap().len();
        let before = count(&a.json(a.admin(Method::GET, "tenants/t/handlers/h/versions")));
        let upload = c.start_upload(&detect, sent);
        std::thread::sleep(Duration::from_millis(150));
        c.kill();
        drop(upload);
        let after = a.json(a.admin(Method::GET, "tenants/t/handlers/h/versions"));
        let stored = count(&after) == before + 1;
        assert!(count(&after) == before || (stored && sent == detect.len()), "{when}: {after}");
        let active = after["active_version"].as_i64().unwrap();
        for (name, other) in [("A", &a), ("B", &b)] {
            within(PROPAGATION, "the others serve on, the version the store says", || other.probe(&key).1 == Some(active));
            assert_eq!(other.call(&key), (200, Some(active)), "{name}");
        }
        let report = facegate::control::check_store(Some(&url), &c_data).unwrap();
        assert!(report.ok, "nothing partial: {report:?}");
        figures.push(format!("C killed 150 ms into an upload ({when}): stored {stored}, v{active} served, store check ok"));
        c = Server::start_with(&c_data, &["--store", &url, "--node-id", "node-c"]);
        assert_eq!(c.call(&key), (200, Some(active)), "a restarted node serves what the store says");
    }

    // PostgreSQL stops for 60 s.
    pg.stop().unwrap();
    let outage = Instant::now();
    let mut calls = 0;
    while outage.elapsed() < Duration::from_secs(60) {
        for (name, server) in [("A", &a), ("B", &b), ("C", &c)] {
            assert_eq!(server.call(&key).0, 200, "{name} serves its snapshot without the database");
            calls += 1;
        }
        let (code, body) = status(&b, Method::GET, "tenants");
        assert_eq!(code, 503, "admin calls are refused while the store is away: {body}");
        assert_eq!(body["error"]["code"], "store_unavailable");
        assert_eq!(ready(&b), 200, "a store outage does not take the nodes out of service");
        if outage.elapsed() > Duration::from_secs(7) {
            assert_eq!(ready(&a), 503, "A's snapshot is stale after its --stale-after-s (5 s), though it still serves");
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    figures.push(format!("60 s without PostgreSQL: {calls} calls served, all 200; admin 503"));
    pg.start_again().unwrap();

    // Back: admin works again (after the client reconnects) and changes propagate.
    within(Duration::from_secs(10), "the admin API answers again", || status(&a, Method::GET, "tenants").0 == 200);
    within(Duration::from_secs(5), "A ready again", || ready(&a) == 200);
    a.json(a.admin(Method::POST, "tenants/t/handlers/h/activate").json(&json!({ "version": 3 })));
    for (name, other) in [("B", &b), ("C", &c)] {
        let took = within(Duration::from_secs(5), "a change after the outage", || other.call(&key).1 == Some(3));
        figures.push(format!("after the outage, an activation through A served by {name} after {took:?}"));
    }
    eprintln!("cluster figures:\n  {}", figures.join("\n  "));
}

/// `tenant`'s `attack=nap&ms=1500` on `server`, `n` at once: their statuses
/// and error codes.
fn naps_at_once(server: &Server, key: &str, tenant: &str, n: usize) -> Vec<(u16, String)> {
    let url = format!("http://{}/v1/{tenant}/attack?attack=nap&ms=1500", server.addr);
    std::thread::scope(|s| {
        let calls: Vec<_> = (0..n)
            .map(|_| {
                s.spawn(|| {
                    let response = crate::harness::client_with_key(key).get(&url).send().unwrap();
                    let status = response.status().as_u16();
                    (status, response.json::<Value>().unwrap_or_default()["error"]["code"].as_str().unwrap_or("").to_owned())
                })
            })
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    })
}

/// A tenant's concurrency holds cluster-wide: each of two live nodes
/// admits its share (half, rounded up), so the tenant cannot run its
/// limit on every node at once; when one node stops, the other takes the
/// whole limit again.
#[test]
fn a_tenants_concurrency_is_shared_among_the_live_nodes() {
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let (a, _) = node(&url, "node-a");
    let (mut b, _) = node(&url, "node-b");
    a.json(a.admin(Method::POST, "tenants").json(&json!({ "name": "shared", "limits": { "max_concurrency": 4, "rps": 0.0 } })));
    let key = a.json(a.admin(Method::POST, "tenants/shared/keys"))["key"].as_str().unwrap().to_owned();
    a.json(a.admin(Method::PUT, "tenants/shared/handlers/attack").body(std::fs::read(guest("hostile")).unwrap()));
    within(Duration::from_secs(10), "both nodes count two live nodes", || live(&a) == Some(2.0) && live(&b) == Some(2.0));
    within(Duration::from_secs(10), "B serves the tenant", || served(&b, &key, "shared").is_some());

    let mut statuses: Vec<_> = naps_at_once(&a, &key, "shared", 3);
    statuses.sort();
    let expected = vec![(200, String::new()), (200, String::new()), (429, "concurrency_limited".to_owned())];
    assert_eq!(statuses, expected, "node A admits its half of 4");
    let on_b = naps_at_once(&b, &key, "shared", 2);
    assert!(on_b.iter().all(|(s, _)| *s == 200), "node B admits its own half: {on_b:?}");

    // B stops cleanly (deregisters): A takes the whole limit at its next heartbeat.
    b.terminate();
    let exit = b.wait_exit(Duration::from_secs(20));
    assert!(exit.is_some_and(|status| status.success()), "B drains and exits cleanly: {exit:?}");
    within(Duration::from_secs(10), "A counts one live node", || live(&a) == Some(1.0));
    let alone = naps_at_once(&a, &key, "shared", 4);
    assert!(alone.iter().all(|(s, _)| *s == 200), "the whole limit on the last node: {alone:?}");
}

/// A GET of `tenant`'s handler `h` with `query` on `server`: its status and
/// the version that answered.
fn get(server: &Server, key: &str, tenant: &str, query: &str) -> (u16, Option<i64>) {
    let response = crate::harness::client_with_key(key).get(format!("http://{}/v1/{tenant}/h?{query}", server.addr)).send().unwrap();
    let version = response.headers().get("x-facegate-handler-version").map(|v| v.to_str().unwrap().parse().unwrap());
    (response.status().as_u16(), version)
}

/// Canary releases on two nodes: a 10 % canary gets 10 % ± 3 of 1,000
/// requests sent to both; `abort` through one node sends every request to
/// the active version again on both, with no request failing meanwhile;
/// and a canary answering 500s where the active version does not is
/// aborted by the nodes themselves.
#[test]
fn canaries_split_the_traffic_on_every_node_and_abort() {
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let (a, _) = node(&url, "node-a");
    let (b, _) = node(&url, "node-b");
    let hostile = std::fs::read(guest("hostile")).unwrap();
    a.json(a.admin(Method::POST, "tenants").json(&json!({ "name": "canary", "limits": { "rps": 0 } })));
    let key = a.json(a.admin(Method::POST, "tenants/canary/keys"))["key"].as_str().unwrap().to_owned();
    a.json(a.admin(Method::PUT, "tenants/canary/handlers/h").body(hostile.clone()));
    let released = a.json(a.admin(Method::PUT, "tenants/canary/handlers/h?canary=10").body(hostile.clone()));
    assert_eq!((released["version"].as_i64(), released["active_version"].as_i64()), (Some(2), Some(1)), "{released}");
    let versions = a.json(a.admin(Method::GET, "tenants/canary/handlers/h/versions"));
    assert_eq!(versions["canary"], json!({ "version": 2, "percent": 10 }));
    within(Duration::from_secs(10), "B serves the canary", || (0..50).any(|_| get(&b, &key, "canary", "attack=count").1 == Some(2)));

    let mut to_canary = [0u32; 2];
    for i in 0..1000 {
        let node = if i % 2 == 0 { &a } else { &b };
        let (status, version) = get(node, &key, "canary", "attack=count");
        assert_eq!(status, 200);
        to_canary[i % 2] += u32::from(version == Some(2));
    }
    let share = f64::from(to_canary[0] + to_canary[1]) / 1000.0;
    assert!((0.07..=0.13).contains(&share), "the canary got {share} (A {}, B {})", to_canary[0], to_canary[1]);
    assert!(to_canary.iter().all(|&n| n > 0), "both nodes split: {to_canary:?}");

    // Abort through B while both nodes serve: nothing fails, and then all goes to version 1.
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let load = s.spawn(|| {
            let mut failed = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for node in [&a, &b] {
                    let (status, _) = get(node, &key, "canary", "attack=count");
                    if status != 200 {
                        failed.push(status);
                    }
                }
            }
            failed
        });
        std::thread::sleep(Duration::from_millis(300));
        let aborted = b.json(b.admin(Method::POST, "tenants/canary/handlers/h/abort"));
        assert_eq!(aborted["aborted"]["version"], 2);
        let took = within(PROPAGATION, "the abort reaches A and B", || {
            (0..20).all(|_| get(&a, &key, "canary", "attack=count").1 == Some(1) && get(&b, &key, "canary", "attack=count").1 == Some(1))
        });
        eprintln!("abort through B: all requests to version 1 on A and B after {took:?}");
        for node in [&a, &b] {
            assert!((0..100).all(|_| get(node, &key, "canary", "attack=count").1 == Some(1)), "no request reaches the aborted canary");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(load.join().unwrap(), Vec::<u16>::new(), "no request failed during the abort");
    });

    // The automatic abort: the active version (detect) answers a GET with a
    // 4xx, the canary (hostile, `attack=panic`) with 500s.
    a.json(a.admin(Method::PUT, "tenants/canary/handlers/h").body(std::fs::read(guest("detect")).unwrap()));
    let rule = "canary=50&abort_margin=0.2&abort_after=10";
    let canary = a.json(a.admin(Method::PUT, &format!("tenants/canary/handlers/h?{rule}")).body(hostile));
    let canary_version = canary["version"].as_i64().unwrap();
    within(Duration::from_secs(10), "B serves the failing canary", || (0..20).any(|_| get(&b, &key, "canary", "attack=panic").0 == 500));
    let took = within(Duration::from_secs(30), "the nodes abort the failing canary", || {
        for node in [&a, &b] {
            get(node, &key, "canary", "attack=panic");
        }
        a.json(a.admin(Method::GET, "tenants/canary/handlers/h/versions"))["canary"].is_null()
    });
    eprintln!("failing canary (version {canary_version}) aborted after {took:?}");
    within(PROPAGATION, "every request to the active version again", || {
        (0..20).all(|_| get(&a, &key, "canary", "attack=panic").0 < 500 && get(&b, &key, "canary", "attack=panic").0 < 500)
    });
}

/// `tenant`'s log read through `server` with `key` (and `query`): the
/// records, and the answer's cursor and unreachable nodes.
fn read_log(server: &Server, key: &str, query: &str) -> (Vec<Value>, String, Option<String>) {
    let response = crate::harness::client_with_key(key).get(format!("http://{}/tenant/v1/logs?{query}", server.addr)).send().unwrap();
    assert_eq!(response.status(), 200);
    let header = |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_owned());
    let (cursor, unreachable) = (header("x-facegate-logs-cursor").unwrap(), header("x-facegate-logs-unreachable"));
    let records = response.text().unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (records, cursor, unreachable)
}

/// The request ids of `n` calls of `tenant`'s `attack` handler on `server`.
fn calls(server: &Server, key: &str, tenant: &str, n: usize) -> Vec<String> {
    let client = crate::harness::client_with_key(key);
    let call = |_| {
        let response = client.get(format!("http://{}/v1/{tenant}/attack?attack=count", server.addr)).send().unwrap();
        assert_eq!(response.status(), 200);
        response.headers()["x-request-id"].to_str().unwrap().to_owned()
    };
    (0..n).map(call).collect()
}

/// A tenant's log in a cluster: read through one node, it holds the
/// requests every live node served, each naming its node, in time order;
/// the cursor it returns gives what came after; a follower on one node gets
/// a request served by the other within a second; and a node that dies is
/// named as unreadable while the rest is still served.
#[test]
fn a_tenants_log_is_read_from_every_live_node() {
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let (a, _) = node(&url, "node-a");
    let (b, _) = node(&url, "node-b");
    a.json(a.admin(Method::POST, "tenants").json(&json!({ "name": "logged", "limits": { "rps": 0 } })));
    let key = |scopes: &[&str]| {
        a.json(a.admin(Method::POST, "tenants/logged/keys").json(&json!({ "scopes": scopes })))["key"].as_str().unwrap().to_owned()
    };
    let (invoke, read) = (key(&["invoke"]), key(&["read"]));
    a.json(a.admin(Method::PUT, "tenants/logged/handlers/attack").body(std::fs::read(guest("hostile")).unwrap()));
    within(Duration::from_secs(10), "both nodes count two live nodes", || live(&a) == Some(2.0) && live(&b) == Some(2.0));
    within(Duration::from_secs(10), "B serves the tenant", || served(&b, &invoke, "logged").is_some());

    let (_, start, _) = read_log(&a, &read, "");
    let mut ids = calls(&a, &invoke, "logged", 3);
    ids.extend(calls(&b, &invoke, "logged", 3));
    let (records, cursor, unreachable) = read_log(&a, &read, &format!("since={start}"));
    assert_eq!(unreachable, None, "both nodes read");
    let requests: Vec<&Value> = records.iter().filter(|r| r["kind"] == "request").collect();
    let by_id = |id: &String| requests.iter().find(|r| r["request_id"] == id.as_str()).map(|r| r["node"].as_str().unwrap().to_owned());
    let nodes: Vec<Option<String>> = ids.iter().map(by_id).collect();
    let expected: Vec<Option<String>> = ["node-a", "node-a", "node-a", "node-b", "node-b", "node-b"].map(|n| Some(n.to_owned())).into();
    assert_eq!(nodes, expected, "each request named by the node that served it: {records:?}");
    let times_seen = |id: &String| requests.iter().filter(|r| r["request_id"] == id.as_str()).count();
    assert_eq!(ids.iter().map(times_seen).collect::<Vec<_>>(), [1; 6], "each request exactly once in the merged log: {records:?}");
    let mut places: Vec<(&str, u64)> = records.iter().map(|r| (r["node"].as_str().unwrap(), r["seq"].as_u64().unwrap())).collect();
    places.sort_unstable();
    places.dedup();
    assert_eq!(places.len(), records.len(), "no record twice (by node and seq): {records:?}");
    let times: Vec<i64> = records.iter().map(|r| r["time_ms"].as_i64().unwrap()).collect();
    assert!(times.is_sorted(), "in time order: {times:?}");
    assert!(cursor.contains("node-a:") && cursor.contains("node-b:"), "the cursor names both nodes: {cursor}");
    let (after, _, _) = read_log(&b, &read, &format!("since={cursor}"));
    assert!(
        after.iter().all(|r| !ids.contains(&r["request_id"].as_str().unwrap().to_owned())),
        "nothing twice after the cursor: {after:?}"
    );

    // Following through A, a request B serves arrives within a second.
    let follow = crate::harness::client_with_key(&read).get(format!("http://{}/tenant/v1/logs?follow=true&since={cursor}", a.addr));
    let response = follow.send().unwrap();
    assert_eq!(response.status(), 200);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(response).lines() {
            let Ok(line) = line else { return };
            if tx.send((Instant::now(), serde_json::from_str::<Value>(&line).unwrap())).is_err() {
                return;
            }
        }
    });
    let sent = Instant::now();
    let id = calls(&b, &invoke, "logged", 1).remove(0);
    let arrived = loop {
        let (when, record) = rx.recv_timeout(Duration::from_secs(5)).expect("B's record reaches A's follower");
        if record["kind"] == "request" && record["request_id"] == id.as_str() {
            assert_eq!(record["node"], "node-b");
            break when;
        }
    };
    let took = arrived.saturating_duration_since(sent);
    eprintln!("a request sent to B reached a follower on A {took:?} after it was sent");
    assert!(took < Duration::from_secs(1), "within a second: {took:?}");

    // B dies: A still answers with its own records and names B as unread.
    b.kill();
    let a_id = calls(&a, &invoke, "logged", 1).remove(0);
    let (records, _, unreachable) = read_log(&a, &read, &format!("since={cursor}"));
    assert_eq!(unreachable.as_deref(), Some("node-b"), "the dead node is named");
    assert!(records.iter().any(|r| r["request_id"] == a_id.as_str()), "A's own records still come");
}

/// A hostname routed through one node of a PostgreSQL cluster is routed by
/// another within [`PROPAGATION`], there over TLS with the hostname's own
/// certificate by SNI; its removal reaches that node as soon.
#[test]
fn a_hostname_routed_through_one_node_is_routed_by_the_others() {
    use crate::routes::{get_tls, host_cert};
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let certs = fresh_dir("cluster-host-certs");
    let hostname_cert = host_cert(&certs, "faces.clustered.test");
    let defaults = fresh_dir("cluster-default-cert");
    let default_cert = host_cert(&defaults, "localhost");
    let (cert, key) = (defaults.join("localhost.crt"), defaults.join("localhost.key"));
    let tls: Vec<String> = ["--tls-cert".into(), cert.display().to_string(), "--tls-key".into(), key.display().to_string()]
        .into_iter()
        .chain(["--tls-host-certs".into(), certs.display().to_string()])
        .collect();
    let (a, _) = node(&url, "node-a");
    let (b, _) = node_with(&url, "node-b", &tls.iter().map(String::as_str).collect::<Vec<_>>());
    let tenant_key = warm_hostile_tenant(&a, "clustered");
    within(Duration::from_secs(10), "B serves the tenant's handler", || {
        get_tls(b.addr, ("localhost", &default_cert), "localhost", "/v1/clustered/attack?attack=count", &tenant_key)
            .is_some_and(|(s, _)| s == 200)
    });
    let routed =
        || get_tls(b.addr, ("faces.clustered.test", &hostname_cert), "faces.clustered.test", "/deep/path?attack=echo", &tenant_key);

    let added = a.json(a.admin(Method::PUT, "routes/faces.clustered.test").json(&json!({ "tenant": "clustered", "handler": "attack" })));
    assert_eq!(added["hostname"], "faces.clustered.test", "{added}");
    let took = within(PROPAGATION, "B routes the hostname", || {
        routed().is_some_and(|(s, body)| s == 200 && body.contains("\"path\":\"/deep/path\""))
    });
    eprintln!("a route made through A reached B in {took:?}");
    assert_eq!(status(&a, Method::DELETE, "routes/faces.clustered.test").0, 200);
    within(PROPAGATION, "B forgets the hostname", || routed().is_some_and(|(s, _)| s == 404));
}

/// A component pulled from a registry through one node is served by the
/// others, which never ask the registry; credentials a tenant keeps
/// through one node open on another that has the same secrets key, and a
/// node of a shared store without a secrets key keeps none.
#[test]
fn a_component_pulled_through_one_node_is_served_by_the_others_with_credentials_kept_through_another() {
    use crate::registry::{PASSWORD, Registry, USER, push_as_user, scratch};
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let mut registry = Registry::start(&scratch("cluster"), true);
    let reg = registry.addr.to_string();
    let secrets_key = "5e".repeat(32);
    let pulling = ["--oci-insecure-registry", &reg, "--outgoing-allow-private"];
    let (a, _) = node_with(&url, "node-a", &[&pulling[..], &["--secrets-key", &secrets_key]].concat());
    let (b, _) = node_with(&url, "node-b", &[&pulling[..], &["--secrets-key", &secrets_key]].concat());
    let (c, _) = node_with(&url, "node-c", &pulling);
    let reference = format!("oci://{reg}/acme/hello:v1");
    push_as_user(a.addr, &reference);

    a.json(a.admin(Method::POST, "tenants").json(&json!({ "name": "pulled" })));
    let key = a.json(a.admin(Method::POST, "tenants/pulled/keys"))["key"].as_str().unwrap().to_owned();
    let login = json!({ "username": USER, "password": PASSWORD });
    let (code, refused) = status_of(c.admin(Method::PUT, &format!("tenants/pulled/registries/{reg}")).json(&login));
    assert_eq!(code, 409, "a node of a shared store without a secrets key keeps no secrets: {refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("FACEGATE_SECRETS_KEY"), "{refused}");
    a.json(a.admin(Method::PUT, &format!("tenants/pulled/registries/{reg}")).json(&login));

    // B pulls with the credentials A sealed; A serves what B pulled.
    let (code, deployed) = status_of(b.admin(Method::PUT, "tenants/pulled/handlers/h").json(&json!({ "source": reference })));
    assert_eq!(code, 201, "{deployed}");
    let source = deployed["source"].as_str().unwrap().to_owned();
    assert!(source.starts_with(&format!("oci://{reg}/acme/hello@sha256:")), "{source}");
    let hello = || {
        let response = crate::harness::client_with_key(&key).get(format!("http://{}/v1/pulled/h", a.addr)).send().unwrap();
        (response.status().as_u16(), response.text().unwrap())
    };
    within(PROPAGATION, "A serves the pulled version", || hello() == (200, "hello\n".to_owned()));
    assert_eq!(status(&a, Method::GET, "tenants/pulled/handlers/h/versions").1["versions"][0]["source"], source.as_str());
    // C has no key for the credentials: its pull is refused, naming why, not tried with garbage.
    let (code, refused) = status_of(c.admin(Method::PUT, "tenants/pulled/handlers/h").json(&json!({ "source": reference })));
    assert_eq!(code, 409, "{refused}");
    // The registry gone, a node started now still serves the version: it never asks the registry.
    registry.stop();
    let (d, _) = node(&url, "node-d");
    let served = || crate::harness::client_with_key(&key).get(format!("http://{}/v1/pulled/h", d.addr)).send().unwrap().status().as_u16();
    within(Duration::from_secs(10), "a new node serves the pulled version", || served() == 200);
}

/// The status and JSON answer of `request`.
fn status_of(request: reqwest::blocking::RequestBuilder) -> (u16, Value) {
    let response = request.send().unwrap();
    (response.status().as_u16(), response.json().unwrap_or(Value::Null))
}

/// A setting changed through the tenant API of one node is read by the
/// next request on another within 2 s, without a redeploy; a secret sealed
/// by one node opens on another with the same secrets key, is not in the
/// database in clear, and a node with another key gives its handler an
/// error for it, never other bytes.
#[test]
fn a_setting_changed_through_one_node_is_read_on_another_and_a_foreign_key_opens_no_secret() {
    const SECRET: &str = "cluster-secret-7d1e";
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let key_a = "a1".repeat(32);
    let (a, _) = node_with(&url, "node-a", &["--secrets-key", &key_a]);
    let (b, _) = node_with(&url, "node-b", &["--secrets-key", &key_a]);
    let (c, _) = node_with(&url, "node-c", &["--secrets-key", &"c3".repeat(32)]);
    let invoke = warm_hostile_tenant(&a, "configured");
    let deploy =
        a.json(a.admin(Method::POST, "tenants/configured/keys").json(&json!({ "scopes": ["deploy"] })))["key"].as_str().unwrap().to_owned();
    let read = |server: &Server, name: &str| -> Value {
        let url = format!("http://{}/v1/configured/attack?attack=config&name={name}", server.addr);
        let response = crate::harness::client_with_key(&invoke).get(url).send().unwrap();
        if response.status() != 200 {
            return Value::Null;
        }
        response.json().unwrap_or(Value::Null)
    };
    within(Duration::from_secs(10), "B serves the handler", || read(&b, "threshold") == json!({ "value": null }));

    for value in ["0.7", "0.9"] {
        let put = crate::harness::client_with_key(&deploy).put(format!("http://{}/tenant/v1/config/threshold", a.addr));
        assert_eq!(put.json(&json!({ "value": value })).send().unwrap().status(), 200);
        let took = within(Duration::from_secs(2), "B reads the new value", || read(&b, "threshold") == json!({ "value": value }));
        eprintln!("a setting changed through A was read on B after {took:?}");
    }

    let secret = crate::harness::client_with_key(&deploy).put(format!("http://{}/tenant/v1/config/token?handler=attack", a.addr));
    assert_eq!(secret.json(&json!({ "value": SECRET, "secret": true })).send().unwrap().status(), 200);
    within(Duration::from_secs(2), "B opens the secret", || read(&b, "token") == json!({ "value": SECRET }));
    within(Duration::from_secs(10), "C gives an error", || {
        read(&c, "token")["error"].as_str().is_some_and(|e| e.contains("cannot be opened"))
    });
    assert_eq!(read(&c, "threshold"), json!({ "value": "0.9" }), "C reads the plain values");
    let mut db = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    for row in db.query("SELECT value FROM settings", &[]).unwrap() {
        let bytes: Vec<u8> = row.get(0);
        assert!(!bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()), "the database holds the secret in clear");
    }
}

/// Handlers' state is the cluster's: a key written through one node is
/// read on the other, and 1,000 concurrent `increment`s spread over both
/// nodes end at exactly 1,000, each answered with a value of its own.
#[test]
fn a_thousand_increments_spread_over_two_nodes_end_at_exactly_a_thousand() {
    const INCREMENTS: usize = 1000;
    const CLIENTS: usize = 32;
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let (a, _) = node(&url, "node-a");
    let (b, _) = node(&url, "node-b");
    let limits = json!({ "rps": 0.0, "max_concurrency": 64 });
    a.json(a.admin(Method::POST, "tenants").json(&json!({ "name": "counted", "limits": limits })));
    let key = a.json(a.admin(Method::POST, "tenants/counted/keys"))["key"].as_str().unwrap().to_owned();
    a.json(a.admin(Method::PUT, "tenants/counted/handlers/attack").body(std::fs::read(guest("hostile")).unwrap()));
    let call = |server: &Server, query: &str| -> Option<Value> {
        let url = format!("http://{}/v1/counted/attack?{query}", server.addr);
        let response = crate::harness::client_with_key(&key).get(url).send().ok()?;
        (response.status() == 200).then(|| response.json().ok()).flatten()
    };
    within(Duration::from_secs(10), "B serves the handler", || call(&b, "attack=kv-get&bucket=c&key=n").is_some());
    assert_eq!(call(&a, "attack=kv-put&bucket=c&key=greeting&value=hi"), Some(json!({ "ok": true })));
    assert_eq!(call(&b, "attack=kv-get&bucket=c&key=greeting"), Some(json!({ "value": "hi" })), "written on A, read on B");

    let values = std::sync::Mutex::new(Vec::with_capacity(INCREMENTS));
    std::thread::scope(|s| {
        for client in 0..CLIENTS {
            let (a, b, values, key) = (&a, &b, &values, &key);
            s.spawn(move || {
                let http = crate::harness::client_with_key(key);
                for i in (client..INCREMENTS).step_by(CLIENTS) {
                    let server = if i % 2 == 0 { a } else { b };
                    let url = format!("http://{}/v1/counted/attack?attack=kv-incr&bucket=c&key=n", server.addr);
                    loop {
                        let response = http.get(&url).send().unwrap();
                        // Refused before the handler ran (admission): safe to send again.
                        if matches!(response.status().as_u16(), 429 | 503) {
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                        assert_eq!(response.status(), 200);
                        let body: Value = response.json().unwrap();
                        let value = body["value"].as_i64().unwrap_or_else(|| panic!("{body}"));
                        values.lock().unwrap().push(value);
                        break;
                    }
                }
            });
        }
    });
    let mut values = values.into_inner().unwrap();
    values.sort_unstable();
    assert_eq!(values, (1..=INCREMENTS as i64).collect::<Vec<_>>(), "every increment counted once");
    assert_eq!(call(&b, "attack=kv-get&bucket=c&key=n"), Some(json!({ "value": "1000" })));
    assert_eq!(call(&a, "attack=kv-get&bucket=c&key=n"), Some(json!({ "value": "1000" })));
}

/// What `model` does for a hostile handler on `server`: `"ok"` when served,
/// else the handler's description of its error.
fn infer_outcome(server: &Server, key: &str, tenant: &str, model: &str) -> String {
    let url = format!("http://{}/v1/{tenant}/attack?attack=big-tensor&side=160&model={model}", server.addr);
    let body: Value = crate::harness::client_with_key(key).get(url).send().unwrap().json().unwrap();
    body["outcomes"][0].as_str().map_or_else(|| body["outcomes"][0].to_string(), str::to_owned)
}

/// A model added to the repository through one node is served by another
/// without a restart (fetched from the store, loaded at its first call),
/// and once removed through the first it is unknown on the second.
#[test]
fn a_model_added_through_one_node_is_served_by_another() {
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let (a, _) = node(&url, "node-a");
    let (b, _) = node(&url, "node-b");
    let key = warm_hostile_tenant(&a, "modelled");
    within(Duration::from_secs(10), "B serves the tenant's handler", || served(&b, &key, "modelled").is_some());
    let before = infer_outcome(&b, &key, "modelled", "int8-shared");
    assert!(before.contains("unknown"), "not in the repository yet: {before}");

    let int8 = std::fs::read(crate::harness::facegate_home().join("models/centerface-int8.onnx")).unwrap();
    let added = a.json(a.admin(Method::PUT, "models/int8-shared").body(int8));
    assert_eq!((added["version"].clone(), added["accuracy"]["passes"].clone()), (json!(1), json!(true)), "{added}");
    // The change reaches B within a second; its first call also fetches and loads the file.
    let took = within(Duration::from_secs(10), "B serves the model", || infer_outcome(&b, &key, "modelled", "int8-shared") == "ok");
    eprintln!("a model added through A was served by B after {took:?}");
    let listed = b.json(b.admin(Method::GET, "models"));
    let on_b = listed["models"].as_array().unwrap().iter().find(|m| m["name"] == "int8-shared").unwrap().clone();
    assert_eq!(
        (on_b["source"].clone(), on_b["loaded"].clone(), on_b["loads"].clone()),
        (json!("repository"), json!(true), json!(1)),
        "{on_b}"
    );

    assert_eq!(status(&a, Method::DELETE, "models/int8-shared").0, 200);
    within(PROPAGATION, "B forgets the model", || infer_outcome(&b, &key, "modelled", "int8-shared").contains("unknown"));
    assert_eq!(infer_outcome(&b, &key, "modelled", "centerface"), "ok", "B goes on serving");
}
