//! A tenant's own log through the tenant API: each request's outcome and
//! its handler's output, read with a `read` key, followed as it grows, of
//! no other tenant, and bounded however much a handler writes.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{self, ADMIN_TOKEN, anonymous, client_with_key, guest};

/// The log gateway's bound on each tenant's log.
const LOG_BYTES: u64 = 64 << 10;

/// A gateway of its own (tenants' logs bounded at [`LOG_BYTES`]) with
/// tenants `loga` and `logb`, each running the hostile handler as
/// `attack`; their read and invoke keys.
struct LogGateway {
    addr: SocketAddr,
    keys: std::collections::HashMap<String, (String, String)>,
}

fn log_gateway() -> &'static LogGateway {
    static GATEWAY: OnceLock<LogGateway> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        let mut config = harness::config(harness::fresh_dir("logs-data"), None);
        config.tenant_log_bytes = LOG_BYTES;
        let addr = harness::start(config);
        let admin =
            |method: Method, path: String| anonymous().request(method, format!("http://{addr}/admin/v1/{path}")).bearer_auth(ADMIN_TOKEN);
        let mut keys = std::collections::HashMap::new();
        for tenant in ["loga", "logb"] {
            let created =
                admin(Method::POST, "tenants".into()).json(&json!({ "name": tenant, "limits": { "rps": 0, "timeout_ms": 1000 } }));
            assert_eq!(created.send().unwrap().status(), 201);
            let deployed = admin(Method::PUT, format!("tenants/{tenant}/handlers/attack")).body(std::fs::read(guest("hostile")).unwrap());
            assert_eq!(deployed.send().unwrap().status(), 201);
            let key = |scopes: &[&str]| -> String {
                let made: Value = admin(Method::POST, format!("tenants/{tenant}/keys"))
                    .json(&json!({ "scopes": scopes }))
                    .send()
                    .unwrap()
                    .json()
                    .unwrap();
                made["key"].as_str().unwrap().to_owned()
            };
            keys.insert(tenant.to_owned(), (key(&["read"]), key(&["invoke"])));
        }
        LogGateway { addr, keys }
    })
}

impl LogGateway {
    /// `attack` by `tenant`'s handler: its status and request id.
    fn attack(&self, tenant: &str, attack: &str) -> (u16, String) {
        let response =
            client_with_key(&self.keys[tenant].1).get(format!("http://{}/v1/{tenant}/attack?attack={attack}", self.addr)).send().unwrap();
        (response.status().as_u16(), response.headers()["x-request-id"].to_str().unwrap().to_owned())
    }

    /// `tenant`'s log (with its read key): the records and the dropped count.
    fn read(&self, tenant: &str, query: &str) -> (Vec<Value>, u64) {
        let response = client_with_key(&self.keys[tenant].0).get(format!("http://{}/tenant/v1/logs?{query}", self.addr)).send().unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["content-type"], "application/x-ndjson");
        let dropped = response.headers()["x-facegate-logs-dropped"].to_str().unwrap().parse().unwrap();
        let records = response.text().unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        (records, dropped)
    }
}

/// Waits (up to 5 s) until `tenant`'s log has a request record for each of `ids`.
fn requests_logged(gateway: &LogGateway, tenant: &str, ids: &[&str]) -> Vec<Value> {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let (records, _) = gateway.read(tenant, "");
        let logged = |id: &&str| records.iter().any(|r| r["kind"] == "request" && r["request_id"] == **id);
        if ids.iter().all(logged) {
            return records;
        }
        assert!(Instant::now() < until, "not all of {ids:?} logged: {records:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A handler that prints, fails and times out: its tenant reads exactly
/// those requests (statuses, request ids, the limit of the timeout) and the
/// lines it printed, escaped; another tenant reads none of it.
#[test]
fn a_tenant_reads_its_own_requests_and_output_and_no_one_else_does() {
    let gateway = log_gateway();
    let printed = gateway.attack("loga", "stderr");
    let failed = gateway.attack("loga", "panic");
    let late = gateway.attack("loga", "sleep");
    assert_eq!((printed.0, failed.0, late.0), (200, 500, 504));
    let records = requests_logged(gateway, "loga", &[&printed.1, &failed.1, &late.1]);
    let request = |id: &str| records.iter().find(|r| r["kind"] == "request" && r["request_id"] == id).unwrap().clone();
    assert_eq!(request(&printed.1)["status"], 200);
    assert_eq!(request(&failed.1)["status"], 500);
    let timeout = request(&late.1);
    assert_eq!((timeout["status"].as_u64(), timeout["limit"].as_str()), (Some(504), Some("deadline")), "{timeout}");
    assert!(timeout["duration_ms"].as_f64().unwrap() >= 900.0, "{timeout}");
    assert!(records.iter().all(|r| r["handler"] == "attack" && r["version"] == 1));
    let lines: Vec<&Value> = records.iter().filter(|r| r["kind"] == "output" && r["request_id"] == printed.1.as_str()).collect();
    assert!(!lines.is_empty(), "the printed lines are in the log");
    assert!(lines.iter().all(|l| !l["line"].as_str().unwrap().contains('\n')), "one line a record, escaped");
    let (theirs, _) = gateway.read("logb", "");
    let ids = [&printed.1, &failed.1, &late.1];
    assert!(theirs.iter().all(|r| !ids.contains(&&r["request_id"].as_str().unwrap().to_owned())), "logb reads nothing of loga's");
    let after = records.iter().map(|r| r["seq"].as_u64().unwrap()).max().unwrap();
    let (newer, _) = gateway.read("loga", &format!("since={after}"));
    assert!(newer.iter().all(|r| r["seq"].as_u64().unwrap() > after), "since= gives what came after");
    let refused = client_with_key(&gateway.keys["loga"].1).get(format!("http://{}/tenant/v1/logs", gateway.addr)).send().unwrap();
    assert_eq!(refused.status(), 403, "an invoke key reads no log");

    // The CLI prints the same, a line a record.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_facegate"))
        .args(["logs", "--handler", "attack"])
        .env("FACEGATE_URL", format!("http://{}", gateway.addr))
        .env("FACEGATE_KEY", &gateway.keys["loga"].0)
        .output()
        .unwrap();
    let printed_by_cli = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{printed_by_cli}");
    let timeout_line = printed_by_cli.lines().find(|l| l.contains(late.1.as_str())).unwrap_or_default();
    assert!(timeout_line.contains(" 504 ") && timeout_line.ends_with("limit=deadline"), "{printed_by_cli}");
}

/// Following, a new request's record arrives within a second.
#[test]
fn a_follower_gets_a_new_record_within_a_second() {
    let gateway = log_gateway();
    let (records, _) = gateway.read("logb", "");
    let since = records.iter().filter_map(|r| r["seq"].as_u64()).max();
    let query = since.map_or_else(|| "follow=true".to_owned(), |s| format!("follow=true&since={s}"));
    let response = client_with_key(&gateway.keys["logb"].0).get(format!("http://{}/tenant/v1/logs?{query}", gateway.addr)).send().unwrap();
    assert_eq!(response.status(), 200);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(response).lines() {
            let Ok(line) = line else { return };
            if tx.send((Instant::now(), serde_json::from_str::<Value>(&line).unwrap())).is_err() {
                return;
            }
        }
    });
    let (status, id) = gateway.attack("logb", "count");
    assert_eq!(status, 200);
    let answered = Instant::now();
    loop {
        let (at, record) = rx.recv_timeout(Duration::from_secs(5)).expect("the follower got the record");
        if record["kind"] == "request" && record["request_id"] == id.as_str() {
            assert!(at.saturating_duration_since(answered) < Duration::from_secs(1), "{:?}", at - answered);
            break;
        }
    }
}

/// Follows a log with `key` from its start; the records it sends come on
/// the receiver, which hangs up when the follow's answer ends.
fn follow(addr: SocketAddr, key: &str) -> (u16, std::sync::mpsc::Receiver<Value>) {
    let url = format!("http://{addr}/tenant/v1/logs?follow=true");
    let response = client_with_key(key).get(url).send().unwrap();
    let status = response.status().as_u16();
    let (tx, rx) = std::sync::mpsc::channel();
    if status == 200 {
        std::thread::spawn(move || {
            for line in BufReader::new(response).lines() {
                let Ok(line) = line else { return };
                let _ = tx.send(serde_json::from_str::<Value>(&line).unwrap());
            }
        });
    }
    (status, rx)
}

/// A tenant's 8 follows on a node hold its 8 follower places: a 9th is
/// refused, 429 `too_many_followers` with `Retry-After`. Revoking their
/// key ends all 8 within a few seconds (checked every second, well before
/// a follow's minute), and their places come back.
#[test]
fn a_follow_ends_when_its_key_is_revoked_and_a_ninth_is_refused() {
    let addr = log_gateway().addr;
    let admin = |method: Method, path: &str| anonymous().request(method, format!("http://{addr}/admin/v1/{path}")).bearer_auth(ADMIN_TOKEN);
    let created = admin(Method::POST, "tenants").json(&json!({ "name": "followed", "limits": { "rps": 0, "api_rps": 0 } }));
    assert_eq!(created.send().unwrap().status(), 201);
    let deployed = admin(Method::PUT, "tenants/followed/handlers/attack").body(std::fs::read(guest("hostile")).unwrap());
    assert_eq!(deployed.send().unwrap().status(), 201);
    let key = |scopes: &[&str]| -> (String, String) {
        let made: Value = admin(Method::POST, "tenants/followed/keys").json(&json!({ "scopes": scopes })).send().unwrap().json().unwrap();
        (made["key"].as_str().unwrap().to_owned(), made["id"].as_str().unwrap().to_owned())
    };
    let ((revoked, revoked_id), (other, _), (invoke, _)) = (key(&["read"]), key(&["read"]), key(&["invoke"]));

    let follows: Vec<_> = (0..8).map(|_| follow(addr, &revoked)).collect();
    assert!(follows.iter().all(|(status, _)| *status == 200), "8 follows let in");
    let ninth = client_with_key(&other).get(format!("http://{addr}/tenant/v1/logs?follow=true")).send().unwrap();
    assert_eq!(ninth.status(), 429, "a 9th follow of the tenant, whatever its key");
    assert!(ninth.headers().contains_key("retry-after"), "{:?}", ninth.headers());
    let body: Value = ninth.json().unwrap();
    assert_eq!(body["error"]["code"], "too_many_followers", "{body}");

    // They follow: each gets a new request's record.
    let id = client_with_key(&invoke).get(format!("http://{addr}/v1/followed/attack?attack=count")).send().unwrap();
    assert_eq!(id.status(), 200);
    let id = id.headers()["x-request-id"].to_str().unwrap().to_owned();
    for (_, records) in &follows {
        let got = std::iter::from_fn(|| records.recv_timeout(Duration::from_secs(5)).ok()).find(|r| r["request_id"] == id.as_str());
        assert!(got.is_some(), "each follower gets the request's record");
    }

    let revoke = admin(Method::DELETE, &format!("tenants/followed/keys/{revoked_id}")).send().unwrap();
    assert_eq!(revoke.status(), 200);
    let revoked_at = Instant::now();
    for (_, records) in &follows {
        loop {
            match records.recv_timeout(Duration::from_secs(10).saturating_sub(revoked_at.elapsed())) {
                Ok(_) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("a follow still open 10 s after its key was revoked"),
            }
        }
    }
    eprintln!("8 follows ended {:?} after their key was revoked", revoked_at.elapsed());
    let until = Instant::now() + Duration::from_secs(5);
    while follow(addr, &other).0 != 200 {
        assert!(Instant::now() < until, "the revoked key's follower places are given back");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `facegate logs --json` as `key`'s tenant, with `args`: the records printed.
fn cli_logs(addr: SocketAddr, key: &str, args: &[&str]) -> Vec<Value> {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_facegate"))
        .args(["logs", "--json"])
        .args(args)
        .env("FACEGATE_URL", format!("http://{addr}"))
        .env("FACEGATE_KEY", key)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "facegate logs {args:?}: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// `facegate logs --since` with the last record printed (as `node:seq`, or
/// its bare `seq`) prints exactly what came after: the two reads together
/// are the whole log, no record twice, none missing.
#[test]
fn the_cli_resumes_from_a_cursor_with_no_duplicate_and_no_gap() {
    let addr = log_gateway().addr;
    let admin = |method: Method, path: &str| anonymous().request(method, format!("http://{addr}/admin/v1/{path}")).bearer_auth(ADMIN_TOKEN);
    let created = admin(Method::POST, "tenants").json(&json!({ "name": "resumed", "limits": { "rps": 0, "api_rps": 0 } }));
    assert_eq!(created.send().unwrap().status(), 201);
    let deployed = admin(Method::PUT, "tenants/resumed/handlers/attack").body(std::fs::read(guest("hostile")).unwrap());
    assert_eq!(deployed.send().unwrap().status(), 201);
    let key = |scopes: &[&str]| -> String {
        let made: Value = admin(Method::POST, "tenants/resumed/keys").json(&json!({ "scopes": scopes })).send().unwrap().json().unwrap();
        made["key"].as_str().unwrap().to_owned()
    };
    let (read, invoke) = (key(&["read"]), key(&["invoke"]));
    let call = || {
        let response = client_with_key(&invoke).get(format!("http://{addr}/v1/resumed/attack?attack=count")).send().unwrap();
        assert_eq!(response.status(), 200);
        response.headers()["x-request-id"].to_str().unwrap().to_owned()
    };
    let request_ids = |records: &[Value]| -> Vec<String> {
        records.iter().filter(|r| r["kind"] == "request").map(|r| r["request_id"].as_str().unwrap().to_owned()).collect()
    };
    let seqs = |records: &[Value]| -> Vec<u64> { records.iter().map(|r| r["seq"].as_u64().unwrap()).collect() };

    let before: Vec<String> = (0..3).map(|_| call()).collect();
    let first = cli_logs(addr, &read, &[]);
    assert_eq!(request_ids(&first), before, "{first:?}");
    let last = first.last().unwrap();
    let (node, seq) = (last["node"].as_str().unwrap(), last["seq"].as_u64().unwrap());
    let after: Vec<String> = (0..3).map(|_| call()).collect();
    let all = cli_logs(addr, &read, &[]);
    for cursor in [format!("{node}:{seq}"), seq.to_string()] {
        let resumed = cli_logs(addr, &read, &["--since", &cursor]);
        assert_eq!(request_ids(&resumed), after, "--since {cursor}: exactly the requests after it, once each: {resumed:?}");
        assert!(seqs(&resumed).iter().all(|s| *s > seq), "--since {cursor}: nothing at or before it");
        assert_eq!([seqs(&first), seqs(&resumed)].concat(), seqs(&all), "--since {cursor}: the two reads make the whole log");
    }
}

/// A handler flooding its output keeps its tenant's log within the bound:
/// the oldest records go, and are counted; the newest request's stay.
#[test]
fn a_flood_of_output_stays_within_the_bound() {
    let gateway = log_gateway();
    // Each writes 64 MiB to stderr, of which its log keeps 16 KiB: eight
    // of them are twice the bound.
    let ids: Vec<String> = (0..8)
        .map(|_| {
            let (status, id) = gateway.attack("logb", "stderr");
            assert_eq!(status, 200);
            id
        })
        .collect();
    // A request's records are in its log before its answer.
    let (records, dropped) = gateway.read("logb", "");
    assert!(dropped > 0, "the oldest were dropped");
    let kept = |id: &String| records.iter().filter(|r| r["request_id"] == id.as_str()).count();
    let newest = ids.last().unwrap();
    assert!(records.iter().any(|r| r["kind"] == "request" && r["request_id"] == newest.as_str()), "the newest request's record kept");
    assert!(kept(newest) > 1, "and its output lines");
    assert_eq!(kept(&ids[0]), 0, "the oldest request's records all dropped");
    let has: Vec<bool> = ids.iter().map(|id| kept(id) > 0).collect();
    assert!(has.windows(2).all(|w| !w[0] || w[1]), "only the oldest dropped, oldest first: {has:?}");
    let text: usize = records.iter().map(|r| r["line"].as_str().map_or(0, str::len) + r["request_id"].as_str().unwrap().len()).sum();
    assert!(text <= LOG_BYTES as usize, "{text} bytes of text kept");
}

/// A tenant deleted while one of its requests runs, and created again under
/// its name: the new tenant's log holds nothing of the old one, not even
/// that request's record, written after the deletion.
#[test]
fn a_tenant_created_again_under_a_deleted_ones_name_reads_nothing_of_it() {
    let addr = log_gateway().addr;
    let admin = |method: Method, path: &str| anonymous().request(method, format!("http://{addr}/admin/v1/{path}")).bearer_auth(ADMIN_TOKEN);
    let create = || -> (String, String) {
        let created = admin(Method::POST, "tenants").json(&json!({ "name": "reborn", "limits": { "rps": 0, "timeout_ms": 10000 } }));
        assert_eq!(created.send().unwrap().status(), 201);
        let deployed = admin(Method::PUT, "tenants/reborn/handlers/attack").body(std::fs::read(guest("hostile")).unwrap());
        assert_eq!(deployed.send().unwrap().status(), 201);
        let key = |scopes: &[&str]| -> String {
            let made: Value = admin(Method::POST, "tenants/reborn/keys").json(&json!({ "scopes": scopes })).send().unwrap().json().unwrap();
            made["key"].as_str().unwrap().to_owned()
        };
        (key(&["read"]), key(&["invoke"]))
    };
    let (_, first_invoke) = create();
    let in_flight = std::thread::spawn(move || {
        let url = format!("http://{addr}/v1/reborn/attack?attack=nap&ms=2000");
        let response = client_with_key(&first_invoke).get(url).send().unwrap();
        (response.status().as_u16(), response.headers()["x-request-id"].to_str().unwrap().to_owned())
    });
    std::thread::sleep(Duration::from_millis(500));
    let deleted = admin(Method::DELETE, "tenants/reborn").send().unwrap();
    assert!(deleted.status().is_success(), "{}", deleted.status());
    let (read, invoke) = create();
    let (status, old_id) = in_flight.join().unwrap();
    assert_eq!(status, 200, "the deleted tenant's request ran across the deletion (so it wrote its record after it)");
    let mine = client_with_key(&invoke).get(format!("http://{addr}/v1/reborn/attack?attack=count")).send().unwrap();
    let mine = mine.headers()["x-request-id"].to_str().unwrap().to_owned();
    let until = Instant::now() + Duration::from_secs(5);
    let records: Vec<Value> = loop {
        let text = client_with_key(&read).get(format!("http://{addr}/tenant/v1/logs")).send().unwrap().text().unwrap();
        let records: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        if records.iter().any(|r| r["request_id"] == mine.as_str()) {
            break records;
        }
        assert!(Instant::now() < until, "the new tenant's own request is logged: {records:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(records.iter().all(|r| r["request_id"] != old_id.as_str()), "nothing of the deleted tenant's: {records:?}");
}

/// Bytes of the stalled-followers gateway's log per tenant: each follower
/// starting from the first record has all of it to send.
const STALLED_LOG_MIB: u64 = 8;
/// The most the stalled-followers gateway's RSS may grow while 8 followers
/// take nothing: each reader holds a few hundred KiB; the old code held the
/// whole log as JSON per follower (8 × ~9 MiB) and more.
const STALLED_RSS_GROWTH_MIB: u64 = 32;
/// How soon a follower whose client takes nothing is ended: the write
/// timeout (10 s) after its answer backs up, with room for a busy machine.
const FOLLOWER_ENDED_WITHIN: Duration = Duration::from_secs(25);

/// A follow of `tenant`'s log over a raw socket that is never read.
fn stalled_follow(addr: SocketAddr, key: &str) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    let head = format!("GET /tenant/v1/logs?follow=true HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    stream
}

/// The status of a follow of the log with `key`, read for a moment.
fn follow_status(addr: SocketAddr, key: &str) -> u16 {
    let url = format!("http://{addr}/tenant/v1/logs?follow=true&since=18446744073709551615");
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
    client.get(url).bearer_auth(key).send().map_or(0, |r| r.status().as_u16())
}

/// 8 followers of one tenant that never read, on a node whose log is
/// filling: the gateway's RSS stays bounded, the followers are ended (their
/// places come back: a new follow is let in), and another tenant's log
/// reads are answered throughout. The connection layer's idle timeout is
/// set long: ending them is the log reader's own write timeout.
#[test]
fn followers_that_never_read_are_ended_and_hold_little() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use crate::isolation::rss_mib;
    use crate::process::Server;
    let (data, seed) = (harness::fresh_dir("stalled-followers"), harness::fresh_dir("stalled-followers-seed"));
    for tenant in ["noisy", "quiet"] {
        harness::install(&seed, tenant, "attack", &guest("hostile"));
    }
    let log_bytes = (STALLED_LOG_MIB << 20).to_string();
    let args = ["--seed-dir", seed.to_str().unwrap(), "--tenant-log-bytes", &log_bytes, "--idle-timeout-ms", "120000"];
    let server = Server::start_with(&data, &args);
    let invoke = |tenant: &str| std::fs::read_to_string(data.join(format!("{tenant}.key"))).unwrap().trim().to_owned();
    let read = |tenant: &str| -> String {
        let made = server.json(server.admin(Method::POST, &format!("tenants/{tenant}/keys")).json(&json!({ "scopes": ["read"] })));
        made["key"].as_str().unwrap().to_owned()
    };
    let (noisy, noisy_read, quiet_read) = (invoke("noisy"), read("noisy"), read("quiet"));
    assert_eq!(
        client_with_key(&invoke("quiet")).get(format!("http://{}/v1/quiet/attack?attack=count", server.addr)).send().unwrap().status(),
        200
    );
    let addr = server.addr;
    let flood = || {
        let response = client_with_key(&noisy).get(format!("http://{addr}/v1/noisy/attack?attack=stderr")).send().unwrap();
        assert_eq!(response.status(), 200);
    };
    // The log filled (its oldest records dropping) before the baseline.
    let filled = Instant::now();
    std::thread::scope(|s| (0..2).for_each(|_| drop(s.spawn(|| (0..100).for_each(|_| flood())))));
    let dropped = |key: &str| -> u64 {
        let response = client_with_key(key).get(format!("http://{addr}/tenant/v1/logs?since=18446744073709551615")).send().unwrap();
        response.headers()["x-facegate-logs-dropped"].to_str().unwrap().parse().unwrap()
    };
    assert!(dropped(&noisy_read) > 0, "the log is full");
    eprintln!("noisy's {STALLED_LOG_MIB} MiB log filled in {:?}", filled.elapsed());
    let baseline = rss_mib(server.pid());

    let (stop, peak, quiet_slowest) = (AtomicBool::new(false), AtomicU64::new(0), AtomicU64::new(0));
    let followers: Vec<_> = (0..8).map(|_| stalled_follow(addr, &noisy_read)).collect();
    let ended_after = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                flood();
            }
        });
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                peak.fetch_max(rss_mib(server.pid()), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                let started = Instant::now();
                let response = client_with_key(&quiet_read).get(format!("http://{addr}/tenant/v1/logs")).send().unwrap();
                assert_eq!(response.status(), 200, "another tenant's log read is answered");
                let records = response.text().unwrap();
                assert!(records.contains("\"kind\":\"request\""), "with its records: {records}");
                quiet_slowest.fetch_max(started.elapsed().as_millis() as u64, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        std::thread::sleep(Duration::from_secs(1));
        assert_eq!(follow_status(addr, &noisy_read), 429, "the 8 stalled followers hold the tenant's places");
        let start = Instant::now();
        let ended = loop {
            if follow_status(addr, &noisy_read) == 200 {
                break Some(start.elapsed());
            }
            if start.elapsed() > FOLLOWER_ENDED_WITHIN {
                break None;
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        // The log keeps filling a while after they ended.
        std::thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::SeqCst);
        ended
    });
    drop(followers);
    let (peak, slowest) = (peak.load(Ordering::SeqCst), quiet_slowest.load(Ordering::SeqCst));
    eprintln!(
        "8 stalled followers: ended {ended_after:?} after their answers backed up; RSS {baseline} MiB -> peak {peak} MiB; quiet's slowest log read {slowest} ms"
    );
    assert!(peak <= baseline + STALLED_RSS_GROWTH_MIB, "RSS grew {} MiB with 8 stalled followers", peak.saturating_sub(baseline));
    assert!(ended_after.is_some(), "the stalled followers still hold their places after {FOLLOWER_ENDED_WITHIN:?}");
    assert!(slowest < 2000, "another tenant's log read took {slowest} ms");
}
