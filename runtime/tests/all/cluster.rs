//! Three gateway nodes (separate `facegate serve` processes) on one real
//! PostgreSQL store: what one node is told, the others serve within a
//! second; a node killed mid-upload leaves nothing partial; without the
//! database every node keeps serving, the admin API answers 503, and once
//! it is back the nodes catch up.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use facegate::throwaway_pg::ThrowawayPostgres;
use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{fresh_dir, guest};
use crate::process::Server;

/// How soon a change made through one node must be served by the others.
const PROPAGATION: Duration = Duration::from_secs(1);
/// The same for a deploy of a component the other nodes have not compiled:
/// each compiles it at the compile threads' low priority first (0.24 s for
/// 262 KiB, 0.85 s for 1 MiB on an idle 2-core machine; much longer while
/// the rest of the test suite loads both cores, as it does in CI).
const DEPLOY_PROPAGATION: Duration = Duration::from_secs(10);

/// A node; `node-a` turns not ready once its snapshot is 5 s unconfirmed, the others after the default 300 s.
fn node(url: &str, id: &str) -> (Server, PathBuf) {
    let data = fresh_dir(&format!("cluster-{id}"));
    let stale_after = if id == "node-a" { "5" } else { "300" };
    (Server::start_with(&data, &["--store", url, "--node-id", id, "--stale-after-s", stale_after]), data)
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
    within(PROPAGATION, "the key reaches B and C", || b.call(&key).0 == 404 && c.call(&key).0 == 404);
    a.json(a.admin(Method::PUT, "tenants/t/handlers/h").body(detect.clone()));
    let mut figures = Vec::new();
    for (name, other) in [("B", &b), ("C", &c)] {
        let took = within(Duration::from_secs(30), "v1 served", || other.call(&key) == (200, Some(1)));
        figures.push(format!("first deploy (detect, {} KiB, compiled by {name}): {took:?}", detect.len() >> 10));
    }

    // New versions through A: served by B and C once each has compiled them
    // (what it has not cached; a big component takes longer).
    for (version, bytes, limit) in [(2, &small, DEPLOY_PROPAGATION), (3, &blur, Duration::from_secs(30))] {
        a.json(a.admin(Method::PUT, "tenants/t/handlers/h").body(bytes.clone()));
        for (name, other) in [("B", &b), ("C", &c)] {
            let took = within(limit, "a deploy through A served by the others", || other.call(&key).1 == Some(version));
            figures.push(format!("v{version} ({} KiB) served by {name} after {took:?}", bytes.len() >> 10));
        }
    }
    // A rollback through C, then an activation through B (versions they have loaded before).
    c.json(c.admin(Method::POST, "tenants/t/handlers/h/rollback"));
    for (name, other) in [("A", &a), ("B", &b)] {
        let took = within(PROPAGATION, "a rollback through C", || other.call(&key).1 == Some(2));
        figures.push(format!("rollback through C served by {name} after {took:?}"));
    }
    b.json(b.admin(Method::POST, "tenants/t/handlers/h/activate").json(&json!({ "version": 1 })));
    for (name, other) in [("A", &a), ("C", &c)] {
        let took = within(PROPAGATION, "an activation through B", || other.call(&key) == (200, Some(1)));
        figures.push(format!("activation through B served by {name} after {took:?}"));
    }
    // A key revoked through B is refused by A.
    let second = a.json(a.admin(Method::POST, "tenants/t/keys"));
    let (id, doomed) = (second["id"].as_str().unwrap(), second["key"].as_str().unwrap());
    within(PROPAGATION, "the new key reaches B", || b.call(doomed).0 == 200);
    b.json(b.admin(Method::DELETE, &format!("tenants/t/keys/{id}")));
    let took = within(PROPAGATION, "a key revoked through B refused by A", || a.call(doomed).0 == 401);
    figures.push(format!("revocation through B refused by A after {took:?}"));
    // Limits changed through A hold on C.
    a.json(a.admin(Method::PATCH, "tenants/t").json(&json!({ "max_concurrency": 3 })));
    within(PROPAGATION, "a limit change through A", || status(&c, Method::GET, "tenants/t").1["limits"]["max_concurrency"] == 3);

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

    // C is killed in the middle of an upload through C.
    let before = a.json(a.admin(Method::GET, "tenants/t/handlers/h/versions"));
    let upload = c.start_upload(&detect, detect.len());
    std::thread::sleep(Duration::from_millis(150));
    c.kill();
    drop(upload);
    for other in [&a, &b] {
        assert_eq!(other.call(&key), (200, Some(1)), "the others serve on");
    }
    let after = a.json(a.admin(Method::GET, "tenants/t/handlers/h/versions"));
    let (n_before, n_after) = (before["versions"].as_array().unwrap().len(), after["versions"].as_array().unwrap().len());
    assert!(n_after == n_before || n_after == n_before + 1, "{after}");
    let report = facegate::control::check_store(Some(&url), &c_data).unwrap();
    assert!(report.ok, "nothing partial: {report:?}");
    figures.push(format!("C killed 150 ms into an upload: versions {n_before} -> {n_after}, store check ok"));
    c = Server::start_with(&c_data, &["--store", &url, "--node-id", "node-c"]);
    assert_eq!(c.call(&key).0, 200, "a restarted node serves what the store says");

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
