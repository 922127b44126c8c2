//! The control plane end to end, on the shared gateway: the admin token,
//! upload validation, API keys, per-tenant limits, hot swap and rollback
//! under load, and the `facegate` CLI. Each test uses tenants of its own.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{ADMIN_TOKEN, admin, admin_json, anonymous, client_with_key, gateway, guest, image, key, url};

/// Creates `name` with `limits` and one key; returns the key.
fn tenant_with_key(name: &str, limits: Value) -> String {
    let (status, body) = admin_json(admin(Method::POST, "tenants").json(&json!({ "name": name, "limits": limits })));
    assert_eq!(status, 201, "{body}");
    let (status, body) = admin_json(admin(Method::POST, &format!("tenants/{name}/keys")));
    assert_eq!(status, 201, "{body}");
    body["key"].as_str().unwrap().to_owned()
}

fn upload(tenant: &str, handler: &str, bytes: Vec<u8>, activate: bool) -> (u16, Value) {
    let query = if activate { "" } else { "?activate=false" };
    admin_json(admin(Method::PUT, &format!("tenants/{tenant}/handlers/{handler}{query}")).body(bytes))
}

fn component(name: &str) -> Vec<u8> {
    std::fs::read(guest(name)).unwrap()
}

fn stored_components() -> usize {
    std::fs::read_dir(gateway().data_dir.join("components")).unwrap().count()
}

#[test]
fn the_admin_api_needs_the_admin_token() {
    let path = url("/admin/v1/tenants");
    assert_eq!(anonymous().get(&path).send().unwrap().status(), 401);
    // A wrong token waits for its refusal: guessing is slow (the right one does not wait).
    let guessed = std::time::Instant::now();
    assert_eq!(anonymous().get(&path).bearer_auth("wrong-token-wrong-token").send().unwrap().status(), 401);
    assert!(guessed.elapsed() >= facegate::http::TOKEN_FAILURE_DELAY, "refused after {:?}", guessed.elapsed());
    let scrape = anonymous().get(url("/metrics")).bearer_auth("wrong-token-wrong-token");
    let guessed = std::time::Instant::now();
    assert_eq!(scrape.send().unwrap().status(), 401);
    assert!(guessed.elapsed() >= facegate::http::TOKEN_FAILURE_DELAY, "a metrics scrape too: {:?}", guessed.elapsed());
    assert_eq!(anonymous().get(&path).bearer_auth(key("demo")).send().unwrap().status(), 401, "a tenant key is not the admin token");
    let (status, body) = admin_json(anonymous().get(&path).bearer_auth(ADMIN_TOKEN));
    assert_eq!(status, 200, "{body}");
    let names: Vec<&str> = body["tenants"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"demo") && names.contains(&"evil"), "{names:?}");
    // The console's live view: tenants' traffic is for the operator only.
    let stats = url("/admin/v1/stats");
    assert_eq!(anonymous().get(&stats).bearer_auth(key("demo")).send().unwrap().status(), 401);
    let (status, body) = admin_json(anonymous().get(&stats).bearer_auth(ADMIN_TOKEN));
    assert_eq!(status, 200, "{body}");
    assert!(body["tenants"]["demo"]["requests"].is_u64() && body["models"][0]["name"] == "centerface", "{body}");
}

#[test]
fn uploads_that_are_not_handlers_are_refused_and_nothing_is_stored() {
    tenant_with_key("uploads", json!({}));
    let before = stored_components();
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("garbage", b"hello, not wasm".to_vec(), "not a WebAssembly binary"),
        ("core module", wat::parse_str("(module)").unwrap(), "core WebAssembly module"),
        (
            "import outside the world",
            wat::parse_str(r#"(component (import "wasi:keyvalue/store@0.2.0-draft" (instance)))"#).unwrap(),
            "`wasi:keyvalue/store@0.2.0-draft`",
        ),
        ("no incoming handler", wat::parse_str("(component)").unwrap(), "does not export wasi:http/incoming-handler"),
    ];
    for (case, bytes, expected) in cases {
        let (status, body) = upload("uploads", "h", bytes, true);
        assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid")), "{case}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(expected), "{case}: {message}");
    }
    assert_eq!(stored_components(), before, "a refused upload stores no file");
    // Any tenant may import the outgoing handler: without the grant its
    // requests are denied (this one is still refused, for exporting nothing).
    let bytes = wat::parse_str(r#"(component (import "wasi:http/outgoing-handler@0.2.12" (instance)))"#).unwrap();
    let (status, body) = upload("uploads", "h", bytes, true);
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("does not export"), "{body}");
    let (status, _) = admin_json(admin(Method::GET, "tenants/uploads/handlers/h/versions"));
    assert_eq!(status, 404, "a refused upload creates no handler");
    let (status, body) = upload("nobody-at-all", "h", component("detect"), true);
    assert_eq!(status, 404, "{body}");
}

#[test]
fn keys_missing_wrong_revoked_or_of_another_tenant_are_refused() {
    let good = tenant_with_key("keys-a", json!({}));
    assert_eq!(upload("keys-a", "detect", component("detect"), true).0, 201);
    let post = |client: reqwest::blocking::Client, path: &str| client.post(url(path)).body(image("grace_hopper.jpg")).send().unwrap();

    let response = post(anonymous(), "/v1/keys-a/detect");
    assert_eq!(response.status(), 401);
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
    assert_eq!(post(client_with_key("not-a-key"), "/v1/keys-a/detect").status(), 401);
    let (id, _) = good.strip_prefix("fg_").unwrap().split_once('_').unwrap();
    let forged = format!("fg_{id}_{}", "0".repeat(64));
    assert_eq!(post(client_with_key(&forged), "/v1/keys-a/detect").status(), 401, "right id, wrong secret");

    let response = post(client_with_key(&good), "/v1/keys-a/detect");
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("cache-control").is_none(), "a handler's answer is its own");

    // Answers carrying keys or tenants' data are never cached.
    let created = admin(Method::POST, "tenants/demo/keys").send().unwrap();
    assert_eq!((created.status().as_u16(), created.headers()["cache-control"].to_str().unwrap()), (201, "no-store"));
    let me = client_with_key(&good).get(url("/v1/me")).send().unwrap();
    assert_eq!(me.headers()["cache-control"], "no-store");

    // Another tenant's key: the same 404 as for a tenant that does not exist.
    let other = post(client_with_key(&key("demo")), "/v1/keys-a/detect");
    let missing = post(client_with_key(&key("demo")), "/v1/no-such-tenant/detect");
    assert_eq!((other.status().as_u16(), missing.status().as_u16()), (404, 404));
    let (other, missing): (Value, Value) = (other.json().unwrap(), missing.json().unwrap());
    assert_eq!(other["error"]["code"], missing["error"]["code"]);

    let (status, body) = admin_json(admin(Method::DELETE, &format!("tenants/keys-a/keys/{id}")));
    assert_eq!(status, 200, "{body}");
    assert_eq!(post(client_with_key(&good), "/v1/keys-a/detect").status(), 401, "revoked");
    let (_, keys) = admin_json(admin(Method::GET, "tenants/keys-a/keys"));
    assert!(!keys["keys"][0]["revoked_at"].is_null(), "{keys}");
    assert!(!keys.to_string().contains(&good[20..]), "the key is never shown again");
}

#[test]
fn hot_swap_and_rollback_under_load_fail_no_request() {
    let key = tenant_with_key("swap", json!({ "max_concurrency": 64, "rps": 0 }));
    assert_eq!(upload("swap", "h", component("detect"), true).0, 201);
    let (status, body) = upload("swap", "h", component("blur"), false);
    assert_eq!((status, body["version"].as_i64(), body["active_version"].as_i64()), (201, Some(2), Some(1)), "{body}");

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (stop, seen, key) = (Arc::clone(&stop), Arc::clone(&seen), key.clone());
            std::thread::spawn(move || {
                let (client, photo) = (client_with_key(&key), image("grace_hopper.jpg"));
                while !stop.load(Ordering::SeqCst) {
                    let started = Instant::now();
                    let response = client.post(url("/v1/swap/h")).body(photo.clone()).send().unwrap();
                    let version = response.headers().get("x-facegate-handler-version").map(|v| v.to_str().unwrap().to_owned());
                    let content_type = response.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned());
                    let answer = (response.status().as_u16(), version, content_type);
                    seen.lock().unwrap().push(Seen { started, ended: Instant::now(), answer });
                }
            })
        })
        .collect();
    let wait_for_requests = |n: usize| {
        let start = seen.lock().unwrap().len();
        let deadline = Instant::now() + Duration::from_secs(60);
        while seen.lock().unwrap().len() < start + n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for_requests(8);
    let activating = Instant::now();
    let (status, body) = admin_json(admin(Method::POST, "tenants/swap/handlers/h/activate").json(&json!({ "version": 2 })));
    let activated = Instant::now();
    assert_eq!((status, body["previous_version"].as_i64()), (200, Some(1)), "{body}");
    wait_for_requests(8);
    let rolling_back = Instant::now();
    let (status, body) = admin_json(admin(Method::POST, "tenants/swap/handlers/h/rollback"));
    let rolled_back = Instant::now();
    assert_eq!((status, body["active_version"].as_i64()), (200, Some(1)), "{body}");
    wait_for_requests(8);
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.join().unwrap();
    }

    let seen = seen.lock().unwrap();
    let failed: Vec<_> = seen.iter().filter(|s| s.answer.0 != 200).collect();
    assert!(failed.is_empty(), "{} of {} requests failed: {failed:?}", failed.len(), seen.len());
    for Seen { answer: (_, version, content_type), .. } in seen.iter() {
        // Each answer comes whole from one version: detect answers JSON, blur a JPEG.
        let expected = if version.as_deref() == Some("1") { "application/json" } else { "image/jpeg" };
        assert_eq!(content_type.as_deref(), Some(expected), "version {version:?}");
    }
    let version_of = |s: &Seen| s.answer.1.clone().unwrap();
    // Requests in flight while a switch happened finished (200, above) on
    // one version or the other; those wholly before or after it saw the
    // version active then.
    let straddling = seen.iter().filter(|s| s.started < activated && s.ended > activating).count();
    assert!(straddling >= 1, "no request was in flight during the activation");
    assert!(seen.iter().filter(|s| s.ended < activating).all(|s| version_of(s) == "1"));
    assert!(seen.iter().filter(|s| s.started > activated && s.ended < rolling_back).all(|s| version_of(s) == "2"));
    assert!(seen.iter().filter(|s| s.started > rolled_back).all(|s| version_of(s) == "1"));
    assert!(seen.iter().any(|s| s.started > activated && s.ended < rolling_back), "version 2 was never measured alone");
}

/// One request of the hot-swap test.
#[derive(Debug)]
struct Seen {
    started: Instant,
    ended: Instant,
    answer: (u16, Option<String>, Option<String>),
}

#[test]
fn tenant_limits_apply_per_tenant() {
    // Rate: a burst of 2, then 429 with Retry-After.
    let key = tenant_with_key("rate", json!({ "rps": 0.2, "burst": 2 }));
    assert_eq!(upload("rate", "detect", component("detect"), true).0, 201);
    let client = client_with_key(&key);
    let statuses: Vec<u16> = (0..2).map(|_| client.post(url("/v1/rate/detect")).send().unwrap().status().as_u16()).collect();
    assert_eq!(statuses, [400, 400], "an empty body reaches the handler, which refuses it");
    let response = client.post(url("/v1/rate/detect")).send().unwrap();
    assert!(response.headers()["retry-after"].to_str().unwrap().parse::<u32>().unwrap() >= 1);
    assert_eq!(refusal(response), (429, "rate_limited".to_owned()));

    // Body size, deadline and face-detect calls.
    let key = tenant_with_key("small", json!({ "max_body_bytes": 1000, "timeout_ms": 700, "max_infer_calls": 1 }));
    assert_eq!(upload("small", "detect", component("detect"), true).0, 201);
    assert_eq!(upload("small", "attack", component("hostile"), true).0, 201);
    let client = client_with_key(&key);
    let response = client.post(url("/v1/small/detect")).body(image("grace_hopper.jpg")).send().unwrap();
    assert_eq!(response.status(), 413);
    let started = Instant::now();
    let response = client.get(url("/v1/small/attack?attack=loop")).send().unwrap();
    let took = started.elapsed();
    assert_eq!(refusal(response), (504, "handler_timeout".to_owned()));
    // Stopped at the tenant's deadline, not the server's (5 s), nor before it.
    assert!(took >= Duration::from_millis(700) && took < Duration::from_millis(700 + 1500), "took {took:?}");
    let body: Value = client.get(url("/v1/small/attack?attack=many-calls")).send().unwrap().json().unwrap();
    assert_eq!(body["succeeded"], 1, "{body}");

    // Memory: the photo another tenant's detect handles fits in 256 MiB, not in 4.
    let key = tenant_with_key("lowmem", json!({ "memory_mib": 4 }));
    assert_eq!(upload("lowmem", "detect", component("detect"), true).0, 201);
    let response = client_with_key(&key).post(url("/v1/lowmem/detect")).body(image("city.jpg")).send().unwrap();
    assert_eq!(response.status(), 500);
    let body: Value = response.json().unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("memory limit exceeded"), "{body}");
    let response = crate::harness::client().post(url("/v1/demo/detect")).body(image("city.jpg")).send().unwrap();
    assert_eq!(response.status(), 200);

    // Concurrency: one request in flight, the second is refused.
    let key = tenant_with_key("single", json!({ "max_concurrency": 1, "timeout_ms": 4000 }));
    assert_eq!(upload("single", "attack", component("hostile"), true).0, 201);
    let busy = {
        let key = key.clone();
        std::thread::spawn(move || client_with_key(&key).get(url("/v1/single/attack?attack=loop")).send().unwrap().status())
    };
    std::thread::sleep(Duration::from_millis(1500));
    let response = client_with_key(&key).get(url("/v1/single/attack?attack=panic")).send().unwrap();
    assert!(response.headers()["retry-after"].to_str().unwrap().parse::<u32>().unwrap() >= 1);
    assert_eq!(refusal(response), (429, "concurrency_limited".to_owned()));
    assert_eq!(busy.join().unwrap(), 504);

    // Limits above the server's ceilings, or nonsensical, are refused.
    for (limits, named) in [
        (json!({ "memory_mib": 100000 }), "memory_mib"),
        (json!({ "max_concurrency": 100000 }), "max_concurrency"),
        (json!({ "rps": 1e-30 }), "rps"),
        (json!({ "memroy_mib": 1 }), "memroy_mib"),
    ] {
        let (status, body) = admin_json(admin(Method::POST, "tenants").json(&json!({ "name": "greedy", "limits": limits })));
        assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid")), "{body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(named), "{body}");
    }
}

/// Sends `head` (a request's head, `Connection: close`) and `body` over a
/// connection of its own to `addr`; the raw answer, read until the close
/// or for `wait` at most.
pub(crate) fn raw_exchange(addr: SocketAddr, head: &str, body: &[u8], wait: Duration) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body).unwrap();
    stream.set_read_timeout(Some(wait)).unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// A body that arrives slower than the tenant's deadline is answered 408
/// `body_timeout` once the deadline has passed (not before), and counted
/// against the tenant.
#[test]
fn a_body_slower_than_the_deadline_gets_408() {
    const DEADLINE: Duration = Duration::from_millis(800);
    let key = tenant_with_key("slow-body", json!({ "timeout_ms": DEADLINE.as_millis() }));
    assert_eq!(upload("slow-body", "detect", component("detect"), true).0, 201);
    let head = format!(
        "POST /v1/slow-body/detect HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Length: 100000\r\nConnection: close\r\n\r\n"
    );
    let started = Instant::now();
    // A tenth of the body, then nothing.
    let answer = raw_exchange(gateway().addr, &head, &[0; 10_000], Duration::from_secs(30));
    let took = started.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408") && answer.contains("\"body_timeout\""), "{answer}");
    assert!(took >= DEADLINE, "answered after {took:?}, before the deadline");
    let hits = crate::harness::metric(&metrics(), "facegate_limit_hits_total{tenant=\"slow-body\",limit=\"body_timeout\"}");
    assert_eq!(hits, Some(1.0));
}

/// An upload declared larger than `--max-component-bytes` (64 MiB by
/// default) is refused 413 `body_too_large` from its `Content-Length`,
/// before any of its body is sent; nothing is stored.
#[test]
fn a_component_past_the_upload_limit_gets_413() {
    let limit = crate::harness::config(std::path::PathBuf::from("/nonexistent"), None).max_component_bytes;
    let (status, body) = admin_json(admin(Method::POST, "tenants").json(&json!({ "name": "big-upload" })));
    assert_eq!(status, 201, "{body}");
    let head = format!(
        "PUT /admin/v1/tenants/big-upload/handlers/h HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        limit + 1
    );
    let answer = raw_exchange(gateway().addr, &head, &[], Duration::from_secs(30));
    assert!(answer.starts_with("HTTP/1.1 413") && answer.contains("\"body_too_large\""), "{answer}");
    let (status, body) = admin_json(admin(Method::GET, "tenants/big-upload/handlers/h/versions"));
    assert_eq!(status, 404, "nothing stored: {body}");
}

/// Past the compile pool's bound — one compile thread here: one upload
/// compiling, two waiting, of three tenants — an upload is refused 503 `busy` with
/// `Retry-After`, from its head alone (before its body is read); the three
/// in the pool are all stored. A gateway of its own, whose pool only this
/// test fills.
#[test]
fn an_upload_past_the_compile_bound_gets_503_busy() {
    let mut config = crate::harness::config(crate::harness::fresh_dir("busy-uploads"), None);
    config.compile_threads = 1;
    let addr = crate::harness::start(config);
    let admin_at =
        |method: Method, path: &str| anonymous().request(method, format!("http://{addr}/admin/v1/{path}")).bearer_auth(ADMIN_TOKEN);
    // Three tenants uploading (a tenant has one upload at a time on a node),
    // and a fourth probing: its place is free, so only the pool refuses it.
    for tenant in ["t", "u", "v", "w"] {
        assert_eq!(admin_json(admin_at(Method::POST, "tenants").json(&json!({ "name": tenant }))).0, 201);
    }
    // Only a head: the gateway answers at once if it refuses, else waits for the body.
    let head = format!(
        "PUT /admin/v1/tenants/w/handlers/probe HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: 1000000\r\nConnection: close\r\n\r\n"
    );
    let (refusal, stored) = std::thread::scope(|s| {
        // Three different components (the same bytes again might not be compiled again).
        let uploads: Vec<_> = [("t", "detect"), ("u", "blur"), ("v", "crop")]
            .into_iter()
            .map(|(tenant, name)| {
                let admin_at = &admin_at;
                s.spawn(move || admin_json(admin_at(Method::PUT, &format!("tenants/{tenant}/handlers/{name}")).body(component(name))))
            })
            .collect();
        let mut refusal = None;
        // Until a refusal, or every upload is done (answered or failed).
        while refusal.is_none() && !uploads.iter().all(|upload| upload.is_finished()) {
            let answer = raw_exchange(addr, &head, &[], Duration::from_millis(150));
            refusal = (!answer.is_empty()).then_some(answer);
        }
        (refusal, uploads.into_iter().map(|u| u.join().unwrap()).collect::<Vec<_>>())
    });
    let refusal = refusal.expect("no upload was refused while three filled the pool");
    assert!(refusal.starts_with("HTTP/1.1 503") && refusal.contains("\"busy\""), "{refusal}");
    assert!(refusal.to_ascii_lowercase().contains("\r\nretry-after: "), "{refusal}");
    for (status, body) in &stored {
        assert_eq!(*status, 201, "{body}");
    }
}

/// Runs the `facegate` binary as a client of the shared gateway.
pub(crate) fn cli(args: &[&str]) -> (i32, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_facegate"))
        .args(args)
        .env("FACEGATE_URL", format!("http://{}", gateway().addr))
        .env("FACEGATE_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    (output.status.code().unwrap_or(-1), stdout + &String::from_utf8_lossy(&output.stderr))
}

fn cli_json(args: &[&str]) -> Value {
    let (code, out) = cli(args);
    assert_eq!(code, 0, "facegate {args:?}: {out}");
    let json_start = out.find(['{', '[']).unwrap_or(0);
    serde_json::Deserializer::from_str(&out[json_start..]).into_iter::<Value>().next().unwrap().unwrap()
}

#[test]
fn the_cli_manages_tenants_keys_and_versions() {
    let detect = guest("detect").display().to_string();
    let blur = guest("blur").display().to_string();
    assert_eq!(cli_json(&["tenant", "create", "cli-t", "--rps", "0", "--json"])["name"], "cli-t");
    let key = cli_json(&["key", "create", "cli-t", "--json"])["key"].as_str().unwrap().to_owned();
    let deployed = cli_json(&["deploy", "--tenant", "cli-t", "--handler", "h", &detect, "--json"]);
    assert_eq!(deployed["version"], 1);
    assert_eq!(cli_json(&["deploy", "--tenant", "cli-t", "--handler", "h", &blur, "--json"])["active_version"], 2);
    let call = || client_with_key(&key).post(url("/v1/cli-t/h")).body(image("grace_hopper.jpg")).send().unwrap();
    assert_eq!(call().headers()["content-type"], "image/jpeg");
    let versions = cli_json(&["versions", "--tenant", "cli-t", "--handler", "h", "--json"]);
    assert_eq!((versions["versions"].as_array().unwrap().len(), &versions["active_version"]), (2, &json!(2)));
    assert_eq!(cli_json(&["rollback", "--tenant", "cli-t", "--handler", "h", "--json"])["active_version"], 1);
    assert_eq!(call().headers()["content-type"], "application/json");
    let (code, out) = cli(&["rollback", "--tenant", "cli-t", "--handler", "h"]);
    assert_eq!(code, 1, "nothing older than version 1: {out}");
    assert!(out.contains("no version older"), "{out}");
    let listed = cli_json(&["tenant", "list", "--json"]);
    assert!(listed["tenants"].as_array().unwrap().iter().any(|t| t["name"] == "cli-t"), "{listed}");
    let id = key.strip_prefix("fg_").unwrap().split_once('_').unwrap().0;
    let (code, out) = cli(&["key", "revoke", "cli-t", id]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(call().status(), 401);
    let (code, out) = cli(&["tenant", "delete", "cli-t"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = cli(&["tenant", "delete", "cli-t"]);
    assert_eq!(code, 1, "{out}");
    let report = cli_json(&["check", "--data-dir", gateway().data_dir.to_str().unwrap(), "--json"]);
    assert_eq!(report["ok"], true, "{report}");
}

#[test]
fn the_seeded_key_file_is_private_and_works() {
    use std::os::unix::fs::PermissionsExt;
    let path = gateway().data_dir.join("demo.key");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{}", path.display());
    let response = client_with_key(&key("demo")).post(url("/v1/demo/detect")).body(image("grace_hopper.jpg")).send().unwrap();
    assert_eq!(response.status(), 200);
}

#[test]
fn with_an_admin_listener_the_admin_api_and_metrics_leave_the_public_one() {
    use crate::harness::{config, fresh_dir, install};
    let seed = fresh_dir("split-seed");
    install(&seed, "demo", "detect", &guest("detect"));
    let data = fresh_dir("split-data");
    let config = config(data.clone(), Some(seed));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        runtime.block_on(async move {
            let models = facegate::load_models(&config.engine).unwrap();
            let gateway = facegate::Gateway::new(&config, models).unwrap();
            let (public, public_addr) = facegate::bind(config.listen).await.unwrap();
            let (admin, admin_addr) = facegate::bind(config.listen).await.unwrap();
            tx.send((public_addr, admin_addr)).unwrap();
            gateway.serve_split(public, admin, std::future::pending()).await.unwrap();
        });
    });
    let (public, admin) = rx.recv().unwrap();
    let get = |addr: std::net::SocketAddr, path: &str, token: &str| {
        anonymous().get(format!("http://{addr}{path}")).bearer_auth(token).send().unwrap().status().as_u16()
    };
    let key = std::fs::read_to_string(data.join("demo.key")).unwrap().trim().to_owned();
    assert_eq!(get(public, "/admin/v1/tenants", ADMIN_TOKEN), 404);
    assert_eq!(get(public, "/metrics", ADMIN_TOKEN), 404);
    assert_eq!(get(admin, "/admin/v1/tenants", ADMIN_TOKEN), 200);
    assert_eq!(get(admin, "/metrics", ADMIN_TOKEN), 200);
    assert_eq!(get(admin, "/v1/models", &key), 404, "tenants are not served on the admin listener");
    let response = client_with_key(&key).post(format!("http://{public}/v1/demo/detect")).body(image("grace_hopper.jpg")).send().unwrap();
    assert_eq!(response.status(), 200);
}

/// Raising a tenant's concurrency limit resizes its gate in place: requests
/// already running count against the new limit, so it never runs more.
/// Deleting a tenant ends its keys and its device-time account; a new
/// tenant of the same name starts afresh.
#[test]
fn tenant_state_follows_limit_changes_and_deletion() {
    let key = tenant_with_key("follow", json!({ "max_concurrency": 1, "timeout_ms": 3000, "weight": 7 }));
    assert_eq!(upload("follow", "attack", component("hostile"), true).0, 201);
    let client = client_with_key(&key);
    let body: Value = client.get(url("/v1/follow/attack?attack=big-tensor&side=64")).send().unwrap().json().unwrap();
    assert_eq!(body["outcomes"], json!(["ok"]), "{body}");
    let device_series = "facegate_tenant_device_seconds_total{model=\"centerface\",tenant=\"follow\"}";
    assert!(metrics().contains(device_series), "the tenant's device time is reported");

    let looping = |key: &str| {
        let key = key.to_owned();
        std::thread::spawn(move || client_with_key(&key).get(url("/v1/follow/attack?attack=loop")).send().unwrap().status().as_u16())
    };
    let first = looping(&key);
    std::thread::sleep(Duration::from_millis(500));
    let (status, body) = admin_json(admin(Method::PATCH, "tenants/follow").json(&json!({ "max_concurrency": 2 })));
    assert_eq!((status, body["limits"]["max_concurrency"].as_u64()), (200, Some(2)), "{body}");
    let second = looping(&key);
    std::thread::sleep(Duration::from_millis(500));
    let third = refusal(client.get(url("/v1/follow/attack?attack=panic")).send().unwrap());
    assert_eq!(third, (429, "concurrency_limited".to_owned()), "two running, the limit is two");
    assert_eq!((first.join().unwrap(), second.join().unwrap()), (504, 504));

    let before = metrics();
    assert!(before.contains("tenant=\"follow\",limit=\"concurrency\"") && before.contains("tenant=\"follow\",handler=\"attack\""));
    let (status, body) = admin_json(admin(Method::DELETE, "tenants/follow"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(client.get(url("/v1/follow/attack?attack=panic")).send().unwrap().status(), 401, "its key is gone");
    let after = metrics();
    let left: Vec<&str> = after.lines().filter(|l| l.contains("tenant=\"follow\"")).collect();
    assert!(left.is_empty(), "its series (device time, requests, limit hits) are gone: {left:?}");
    assert!(!after.contains(device_series));
    let key = tenant_with_key("follow", json!({}));
    let (status, body) = admin_json(admin(Method::GET, "tenants/follow"));
    assert_eq!(
        (status, body["limits"]["weight"].as_u64(), body["limits"]["max_concurrency"].as_u64()),
        (200, Some(1), Some(gateway_default_concurrency())),
        "{body}"
    );
    assert_eq!(body["handlers"], json!([]), "no handler of the old tenant: {body}");
    assert_eq!(client_with_key(&key).get(url("/v1/follow/attack?attack=panic")).send().unwrap().status(), 404);
}

/// A client that reads each answer in full and then sends its next call is
/// never refused by its own finished calls, at a concurrency of one, though
/// the handler keeps running 300 ms after each answer is written: an
/// answer ends only once its handler has returned and its slot is free.
#[test]
fn a_call_read_in_full_leaves_its_slot_free_for_the_next() {
    let key = tenant_with_key("one-by-one", json!({ "max_concurrency": 1 }));
    assert_eq!(upload("one-by-one", "attack", component("hostile"), true).0, 201);
    let client = client_with_key(&key);
    let lingering = url("/v1/one-by-one/attack?attack=count&linger=300");
    for method in [Method::GET, Method::GET, Method::HEAD, Method::GET] {
        let response = client.request(method.clone(), &lingering).send().unwrap();
        let status = response.status().as_u16();
        let body = response.text().unwrap();
        assert_eq!(status, 200, "{method} answered {body}");
    }
}

/// A refusal's status and JSON error code.
fn refusal(response: reqwest::blocking::Response) -> (u16, String) {
    let status = response.status().as_u16();
    let body: Value = response.json().unwrap_or(Value::Null);
    (status, body["error"]["code"].as_str().unwrap_or_default().to_owned())
}

fn metrics() -> String {
    anonymous().get(url("/metrics")).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap()
}

/// The shared gateway's default per-tenant concurrency.
fn gateway_default_concurrency() -> u64 {
    let config = crate::harness::config(std::path::PathBuf::from("/nonexistent"), None);
    u64::from(config.limits.max_concurrency)
}

/// Two uploads of one tenant at once: one is stored, the other gets 429
/// `upload_in_progress` (so one tenant takes at most one of the compile
/// pool's places), while another tenant's upload at the same time is
/// stored. A gateway of its own: nothing cached, each upload compiles.
#[test]
fn a_tenants_second_upload_at_once_gets_429_another_tenants_goes_on() {
    let addr = crate::harness::start(crate::harness::config(crate::harness::fresh_dir("uploads-at-once"), None));
    let admin_at =
        |method: Method, path: &str| anonymous().request(method, format!("http://{addr}/admin/v1/{path}")).bearer_auth(ADMIN_TOKEN);
    for tenant in ["twice", "meanwhile"] {
        assert_eq!(admin_json(admin_at(Method::POST, "tenants").json(&json!({ "name": tenant }))).0, 201);
    }
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let uploads: Vec<_> = [("twice", "detect"), ("twice", "blur"), ("meanwhile", "crop")]
            .into_iter()
            .map(|(tenant, name)| {
                let admin_at = &admin_at;
                s.spawn(move || admin_json(admin_at(Method::PUT, &format!("tenants/{tenant}/handlers/{name}")).body(component(name))))
            })
            .collect();
        uploads.into_iter().map(|u| u.join().unwrap()).collect()
    });
    let mut twice: Vec<u16> = answers[..2].iter().map(|(status, _)| *status).collect();
    twice.sort_unstable();
    assert_eq!(twice, [201, 429], "{answers:?}");
    let refused = answers[..2].iter().find(|(status, _)| *status == 429).map(|(_, body)| body["error"]["code"].clone());
    assert_eq!(refused, Some(json!("upload_in_progress")), "{answers:?}");
    assert_eq!(answers[2].0, 201, "another tenant's upload goes on: {answers:?}");
}
