//! Durability and lifecycle: the gateway is killed (SIGKILL) while an
//! upload arrives and while it is being compiled and stored; after a
//! restart the store passes its integrity check and serves exactly what
//! was active. SIGTERM drains it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;

use crate::harness::{fresh_dir, guest, image};
use crate::process::Server;

fn assert_store_ok(data: &Path) {
    let report = facegate::control::check_store(None, data).unwrap();
    assert!(report.ok, "{report:?}");
}

#[test]
fn sigkill_during_uploads_loses_nothing_and_serves_no_partial_file() {
    let data = fresh_dir("restart");
    let server = Server::start(&data);
    server.json(server.admin(Method::POST, "tenants").json(&json!({ "name": "t" })));
    let key = server.json(server.admin(Method::POST, "tenants/t/keys"))["key"].as_str().unwrap().to_owned();
    let v1 = server.json(server.admin(Method::PUT, "tenants/t/handlers/h").body(std::fs::read(guest("detect")).unwrap()));
    assert_eq!(v1["version"], 1);
    assert_eq!(server.call(&key), (200, Some(1)));
    let blur = std::fs::read(guest("blur")).unwrap();

    // Killed while the body is still arriving.
    let upload = server.start_upload(&blur, blur.len() / 2);
    std::thread::sleep(Duration::from_millis(300));
    server.kill();
    drop(upload);
    assert_store_ok(&data);
    let mut server = Server::start(&data);
    assert_eq!(server.call(&key), (200, Some(1)), "the previous version serves");
    let mut previous_active = 1;
    let versions = server.json(server.admin(Method::GET, "tenants/t/handlers/h/versions"));
    assert_eq!(versions["versions"].as_array().unwrap().len(), 1, "{versions}");

    // Killed at points while the whole upload is validated, compiled and
    // stored; the last kill comes once the upload has been answered.
    let mut outcomes = Vec::new();
    for delay_ms in [0, 30, 100, 250, 600, 900, 1200, u64::MAX] {
        let mut upload = server.start_upload(&blur, blur.len());
        if delay_ms == u64::MAX {
            let mut answer = String::new();
            std::io::Read::read_to_string(&mut upload, &mut answer).unwrap();
            assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
        } else {
            std::thread::sleep(Duration::from_millis(delay_ms));
        }
        server.kill();
        drop(upload);
        assert_store_ok(&data);
        server = Server::start(&data);
        let versions = server.json(server.admin(Method::GET, "tenants/t/handlers/h/versions"));
        let active = versions["active_version"].as_i64().unwrap();
        let newest = versions["versions"].as_array().unwrap().last().unwrap()["version"].as_i64().unwrap();
        assert_eq!(active, newest, "an upload is active once recorded: {versions}");
        outcomes.push((delay_ms, active > previous_active));
        previous_active = active;
        assert_eq!(server.call(&key), (200, Some(active)), "after a kill {delay_ms} ms into an upload");
        assert!(std::fs::read_dir(data.join("tmp")).unwrap().next().is_none(), "temp files are cleared at start");
    }
    eprintln!("(kill delay ms, upload recorded): {outcomes:?}");
    assert!(outcomes.iter().any(|(_, recorded)| !recorded), "every kill came after the upload was recorded");
    assert!(outcomes.iter().any(|(_, recorded)| *recorded));

    // Precompiled artifacts that do not match their record are rebuilt, not loaded.
    server.kill();
    let artifacts: Vec<_> = std::fs::read_dir(data.join("compiled")).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(!artifacts.is_empty());
    for artifact in &artifacts {
        std::fs::write(artifact, b"not machine code").unwrap();
    }
    let server = Server::start(&data);
    assert_eq!(server.call(&key), (200, Some(previous_active)), "the version active before, served after recompiling");
    let rebuilt = artifacts.iter().filter(|a| std::fs::read(a).unwrap() != b"not machine code").count();
    assert!(rebuilt >= 1, "the active version's artifact was rebuilt");
    server.kill();
    assert_store_ok(&data);
}

/// SIGTERM, what Kubernetes sends a pod it stops (after the preStop
/// pause), drains the process: a request in flight, its body still
/// arriving, is answered in full; new connections are refused; the
/// process exits 0 well before the grace period ends.
#[test]
fn sigterm_finishes_the_request_in_flight_then_exits() {
    let data = fresh_dir("sigterm");
    let mut server = Server::start(&data);
    server.json(server.admin(Method::POST, "tenants").json(&json!({ "name": "t" })));
    let key = server.json(server.admin(Method::POST, "tenants/t/keys"))["key"].as_str().unwrap().to_owned();
    server.json(server.admin(Method::PUT, "tenants/t/handlers/h").body(std::fs::read(guest("detect")).unwrap()));
    let photo = image("grace_hopper.jpg");
    let mut stream = TcpStream::connect(server.addr).unwrap();
    let head = format!(
        "POST /v1/t/h HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        photo.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&photo[..photo.len() / 2]).unwrap();
    std::thread::sleep(Duration::from_millis(300));

    let signalled = Instant::now();
    server.terminate();
    let refused_by = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(server.addr).is_ok() {
        assert!(Instant::now() < refused_by, "still accepting connections 5 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(server.wait_exit(Duration::ZERO).is_none(), "exited with a request in flight");
    stream.write_all(&photo[photo.len() / 2..]).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "the request in flight is answered: {answer}");
    assert!(answer.contains("\"faces\""), "{answer}");
    let status = server.wait_exit(facegate::http::SHUTDOWN_GRACE).expect("exits once drained");
    assert!(status.success(), "exit status {status}");
    assert!(signalled.elapsed() < facegate::http::SHUTDOWN_GRACE, "drained before the grace period ended");
    assert_store_ok(&data);
}

/// An activation that must compile (this node has no artifact for the
/// version) goes through the compile pool and its time budget, as an
/// upload does, instead of compiling under the store's lock: past the
/// budget it is refused 503 `busy` and nothing changes.
#[test]
fn a_rollback_that_must_compile_keeps_to_the_compile_budget() {
    let data = fresh_dir("rollback-budget");
    let server = Server::start(&data);
    server.json(server.admin(Method::POST, "tenants").json(&json!({ "name": "t" })));
    let key = server.json(server.admin(Method::POST, "tenants/t/keys"))["key"].as_str().unwrap().to_owned();
    for name in ["detect", "blur"] {
        server.json(server.admin(Method::PUT, "tenants/t/handlers/h").body(std::fs::read(guest(name)).unwrap()));
    }
    let versions = server.json(server.admin(Method::GET, "tenants/t/handlers/h/versions"));
    let first = versions["versions"][0]["sha256"].as_str().unwrap().to_owned();
    server.kill();
    // Version 1's artifact leaves the cache; the node restarts with a 1 ms compile budget.
    for entry in std::fs::read_dir(data.join("compiled")).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap().to_string_lossy().starts_with(&first) {
            std::fs::remove_file(path).unwrap();
        }
    }
    let server = Server::start_with(&data, &["--compile-timeout-ms", "1"]);
    let response = server.admin(Method::POST, "tenants/t/handlers/h/rollback").send().unwrap();
    let status = response.status().as_u16();
    let body: serde_json::Value = response.json().unwrap();
    assert_eq!((status, body["error"]["code"].as_str()), (503, Some("busy")), "{body}");
    assert_eq!(server.call(&key), (200, Some(2)), "nothing changed: version 2 still serves");
    // Within the budget (a node with the default one), the same rollback compiles and serves version 1.
    server.kill();
    let server = Server::start(&data);
    assert_eq!(server.json(server.admin(Method::POST, "tenants/t/handlers/h/rollback"))["active_version"], 1);
    assert_eq!(server.call(&key), (200, Some(1)));
}
