//! Handlers from OCI registries: `facegate push`, deploys by reference
//! (the CLI's and the APIs' server-side pull), a registry with basic auth,
//! the operator's allowlist, hostile registries (a layer that does not
//! match its digest, one past the size limit, one that stalls) and
//! interoperation with a client we did not write (oras-py). The registry
//! is the CNCF distribution registry (Debian's `docker-registry`), started
//! here on 127.0.0.1.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::harness::{self, ADMIN_TOKEN, anonymous, client_with_key, guest};

/// The registry user of the basic-auth tests and its bcrypt hash (`htpasswd -nbB`).
pub(crate) const USER: &str = "ci";
pub(crate) const PASSWORD: &str = "registry-pass-7f3a";
const HTPASSWD: &str = "ci:$2y$05$meEL7NhuVWf65Om30pG2ZO6rbutEBHBnCKZbAO9BCGNE1MY9gGxvm\n";

/// A distribution registry on 127.0.0.1 over plain HTTP, stopped when dropped.
pub(crate) struct Registry {
    pub(crate) addr: SocketAddr,
    child: Child,
}

impl Registry {
    /// Starts one storing under `dir`, with basic auth if `auth`.
    pub(crate) fn start(dir: &Path, auth: bool) -> Self {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let addr = free_port();
        let mut config = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            dir.join("data").display()
        );
        if auth {
            std::fs::write(dir.join("htpasswd"), HTPASSWD).unwrap();
            config += &format!("auth:\n  htpasswd:\n    realm: facegate-test\n    path: {}\n", dir.join("htpasswd").display());
        }
        std::fs::write(dir.join("config.yml"), config).unwrap();
        let child = Command::new("docker-registry")
            .args(["serve", &dir.join("config.yml").display().to_string()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("log")).unwrap())
            .spawn()
            .expect("docker-registry (Debian's package, deploy/test.sh installs it)");
        let registry = Self { addr, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "the registry did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        registry
    }

    pub(crate) fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

pub(crate) fn scratch(name: &str) -> PathBuf {
    harness::scratch_dir(&format!("oci-{name}"))
}

/// A seeded gateway pulling from `registries` over plain HTTP, private
/// addresses allowed (the registries listen on 127.0.0.1) unless `public_only`.
fn gateway(name: &str, registries: &[SocketAddr], edit: impl FnOnce(&mut facegate::config::ServeConfig)) -> (SocketAddr, PathBuf) {
    let data = harness::fresh_dir(&format!("oci-gateway-{name}"));
    let mut config = harness::config(data.clone(), Some(harness::seed_dir()));
    config.oci_insecure_registries = registries.iter().map(ToString::to_string).collect();
    config.outgoing_allow_private = true;
    edit(&mut config);
    (harness::start(config), data)
}

/// `facegate ARGS` against the gateway at `addr` with the admin token and `env`.
pub(crate) fn cli(addr: SocketAddr, args: &[&str], env: &[(&str, &str)], stdin: &str) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_facegate"))
        .args(args)
        .env("FACEGATE_URL", format!("http://{addr}"))
        .env("FACEGATE_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("DOCKER_CONFIG", scratch("no-docker-config"))
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (output.status.code().unwrap_or(-1), text(&output.stdout), text(&output.stderr))
}

/// Pushes `component` to `reference` with the CLI (`created` pinned by
/// `SOURCE_DATE_EPOCH`, as a reproducible build does); returns the digest it printed.
fn push(addr: SocketAddr, component: &str, reference: &str) -> String {
    let args = ["push", &guest(component).display().to_string(), reference, "--plain-http"];
    let (code, out, err) = cli(addr, &args, &[("SOURCE_DATE_EPOCH", "1764892800")], "");
    assert_eq!(code, 0, "push: {out}{err}");
    let digest = out.trim().to_owned();
    assert!(digest.starts_with("sha256:") && digest.len() == 71, "{out}");
    digest
}

/// Pushes the hello component to `reference` with the CLI as [`USER`] (password from stdin).
pub(crate) fn push_as_user(addr: SocketAddr, reference: &str) {
    let file = guest("hello").display().to_string();
    let args = ["push", &file, reference, "--plain-http", "--registry-username", USER, "--registry-password-stdin"];
    let (code, out, err) = cli(addr, &args, &[], &format!("{PASSWORD}\n"));
    assert_eq!(code, 0, "{out}{err}");
}

/// A deploy by reference through an API: `PUT` `path` with the JSON body.
fn pull_deploy(addr: SocketAddr, path: &str, token: &str, body: Value) -> (u16, Value) {
    let response = anonymous().put(format!("http://{addr}{path}")).bearer_auth(token).json(&body).send().unwrap();
    let status = response.status().as_u16();
    (status, response.json().unwrap_or(Value::Null))
}

fn admin_deploy(addr: SocketAddr, tenant: &str, handler: &str, body: Value) -> (u16, Value) {
    pull_deploy(addr, &format!("/admin/v1/tenants/{tenant}/handlers/{handler}"), ADMIN_TOKEN, body)
}

fn versions(addr: SocketAddr, tenant: &str, handler: &str) -> Value {
    let url = format!("http://{addr}/admin/v1/tenants/{tenant}/handlers/{handler}/versions");
    anonymous().get(url).bearer_auth(ADMIN_TOKEN).send().unwrap().json().unwrap()
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// `GET /v1/demo/{handler}{rest}` with demo's key: status and body.
fn call(addr: SocketAddr, data: &Path, handler: &str, rest: &str) -> (u16, String) {
    let key = std::fs::read_to_string(data.join("demo.key")).unwrap();
    let response = client_with_key(key.trim()).get(format!("http://{addr}/v1/demo/{handler}{rest}")).send().unwrap();
    (response.status().as_u16(), response.text().unwrap())
}

/// A `deploy` key of `tenant`.
fn deploy_key(addr: SocketAddr, tenant: &str) -> String {
    let response = anonymous()
        .post(format!("http://{addr}/admin/v1/tenants/{tenant}/keys"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({ "scopes": ["deploy", "read"] }))
        .send()
        .unwrap();
    response.json::<Value>().unwrap()["key"].as_str().unwrap().to_owned()
}

#[test]
fn pushed_components_deploy_by_tag_and_by_digest_and_roll_back_with_the_registry_stopped() {
    let mut registry = Registry::start(&scratch("plain"), false);
    let reg = registry.addr;
    let (addr, data) = gateway("plain", &[reg], |_| {});
    let hello = push(addr, "hello", &format!("oci://{reg}/acme/hello:v1"));
    let faces = push(addr, "faces", &format!("oci://{reg}/acme/faces:v1"));
    assert_eq!(
        push(addr, "hello", &format!("oci://{reg}/acme/hello:v1")),
        hello,
        "the same component and SOURCE_DATE_EPOCH, the same digest"
    );

    // The CLI's deploy by tag: the node pulls it; the version records the digest the tag resolved to.
    let (code, out, err) = cli(addr, &["deploy", "--tenant", "demo", "--handler", "reg", &format!("oci://{reg}/acme/hello:v1")], &[], "");
    assert_eq!(code, 0, "{out}{err}");
    let pinned_hello = format!("oci://{reg}/acme/hello@{hello}");
    assert!(out.contains(&pinned_hello), "{out}");
    assert_eq!(call(addr, &data, "reg", "/"), (200, "hello\n".to_owned()));

    // The tenant API's deploy by digest, with a deploy key: the bytes never pass through the caller.
    let key = deploy_key(addr, "demo");
    let source = format!("oci://{reg}/acme/faces@{faces}");
    let (status, deployed) = pull_deploy(addr, "/tenant/v1/handlers/reg", &key, json!({ "source": source }));
    assert_eq!(status, 201, "{deployed}");
    assert_eq!((deployed["version"].as_i64(), deployed["source"].as_str()), (Some(2), Some(source.as_str())));
    assert_eq!(deployed["sha256"].as_str().unwrap(), sha256_hex(&std::fs::read(guest("faces")).unwrap()), "the layer, byte for byte");
    let (status, health) = call(addr, &data, "reg", "/health");
    assert_eq!(status, 200, "{health}");

    // `versions` shows where each came from, in the API and the CLI.
    let listed = versions(addr, "demo", "reg");
    let sources: Vec<&str> = listed["versions"].as_array().unwrap().iter().map(|v| v["source"].as_str().unwrap()).collect();
    assert_eq!(sources, [pinned_hello.as_str(), source.as_str()]);
    let (code, out, _) = cli(addr, &["versions", "--tenant", "demo", "--handler", "reg"], &[], "");
    assert!(code == 0 && out.contains(&hello) && out.contains(&faces), "{out}");

    // The CLI's deploy by digest, with the tenant's deploy key, as a CI job would.
    let (code, out, err) = cli(addr, &["deploy", "--handler", "pinned", &source, "--key", &key], &[], "");
    assert!(code == 0 && out.contains(&source), "{out}{err}");

    // A tag the registry does not have.
    let (status, refused) = admin_deploy(addr, "demo", "reg", json!({ "source": format!("oci://{reg}/acme/hello:nope") }));
    assert_eq!((status, refused["error"]["code"].as_str()), (404, Some("not_in_registry")), "{refused}");

    // The registry gone: rollback runs the stored component; a new pull is a clear 502.
    registry.stop();
    let (code, out, err) = cli(addr, &["rollback", "--tenant", "demo", "--handler", "reg"], &[], "");
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(call(addr, &data, "reg", "/"), (200, "hello\n".to_owned()));
    let (status, refused) = admin_deploy(addr, "demo", "reg", json!({ "source": format!("oci://{reg}/acme/hello:v1") }));
    assert_eq!((status, refused["error"]["code"].as_str()), (502, Some("registry_unreachable")), "{refused}");
    // A password without its user name.
    let (status, refused) = admin_deploy(addr, "demo", "reg", json!({ "source": "oci://nowhere.example/x:y", "password": "p" }));
    assert_eq!((status, refused["error"]["code"].as_str()), (400, Some("bad_pull")), "{refused}");
}

#[test]
fn a_registry_with_basic_auth_takes_credentials_from_the_docker_config_or_the_deploy() {
    let registry = Registry::start(&scratch("auth"), true);
    let reg = registry.addr;
    let (addr, data) = gateway("auth", &[reg], |_| {});
    let reference = format!("oci://{reg}/acme/hello:v1");
    let file = guest("hello").display().to_string();

    let (code, _, err) = cli(addr, &["push", &file, &reference, "--plain-http"], &[], "");
    assert!(code != 0 && err.contains("asks for credentials"), "{err}");
    let (code, _, err) =
        cli(addr, &["push", &file, &reference, "--plain-http", "--registry-username", USER, "--registry-password-stdin"], &[], "wrong\n");
    assert!(code != 0 && err.contains("401"), "a wrong password: {err}");
    // The Docker config file, as `docker login` writes it.
    let docker = scratch("docker-config");
    std::fs::create_dir_all(&docker).unwrap();
    let auth = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, format!("{USER}:{PASSWORD}"));
    std::fs::write(docker.join("config.json"), json!({ "auths": { reg.to_string(): { "auth": auth } } }).to_string()).unwrap();
    let docker_env = [("DOCKER_CONFIG", docker.to_str().unwrap())];
    let (code, out, err) = cli(addr, &["push", &file, &reference, "--plain-http"], &docker_env, "");
    assert_eq!(code, 0, "{out}{err}");

    // Without credentials the node is refused; asked to, the CLI's deploy passes the Docker config's for this pull.
    let (status, refused) = admin_deploy(addr, "demo", "private", json!({ "source": reference }));
    assert_eq!((status, refused["error"]["code"].as_str()), (403, Some("registry_denied")), "{refused}");
    let wrong = json!({ "source": reference, "username": USER, "password": "wrong" });
    assert_eq!(admin_deploy(addr, "demo", "private", wrong).0, 403);
    let deploy = ["deploy", "--tenant", "demo", "--handler", "private", &reference, "--json"];
    let (code, out, err) = cli(addr, &deploy, &docker_env, "");
    assert!(code != 0 && err.contains("403"), "the user's own Docker credentials leave only when asked to: {out}{err}");
    let (code, out, err) = cli(addr, &[&deploy[..], &["--send-docker-credentials"]].concat(), &docker_env, "");
    assert_eq!(code, 0, "{out}{err}");
    assert!(!out.contains(PASSWORD), "the answer never carries the password");
    assert_eq!(call(addr, &data, "private", "/"), (200, "hello\n".to_owned()));
    // And with the flags.
    let args = ["deploy", "--tenant", "demo", "--handler", "private", &reference, "--registry-username", USER, "--registry-password-stdin"];
    let (code, out, err) = cli(addr, &args, &[], &format!("{PASSWORD}\n"));
    assert_eq!(code, 0, "{out}{err}");
    assert!(!serde_json::to_string(&versions(addr, "demo", "private")).unwrap().contains(PASSWORD));
}

#[test]
fn registries_the_operator_did_not_allow_and_private_addresses_without_leave_are_refused() {
    let registry = Registry::start(&scratch("allow"), false);
    let reg = registry.addr;
    let reference = format!("oci://{reg}/acme/hello:v1");
    let (none, _) = gateway("allow-none", &[], |_| {});
    push(none, "hello", &reference);
    let (status, refused) = admin_deploy(none, "demo", "h", json!({ "source": reference }));
    assert_eq!((status, refused["error"]["code"].as_str()), (403, Some("registry_not_allowed")), "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains(&format!("--oci-registry {reg}")), "{refused}");
    // Allowed, but at a private address: the handlers' egress rules hold for pulls too.
    let (public_only, _) = gateway("allow-public", &[reg], |c| c.outgoing_allow_private = false);
    let (status, refused) = admin_deploy(public_only, "demo", "h", json!({ "source": reference }));
    assert_eq!((status, refused["error"]["code"].as_str()), (403, Some("registry_not_allowed")), "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("not public"), "{refused}");
    // Named as an HTTPS registry, it is not reached over plain HTTP.
    let (https, _) = gateway("allow-https", &[], |c| c.oci_registries = vec![reg.to_string()]);
    let (status, refused) = admin_deploy(https, "demo", "h", json!({ "source": reference }));
    assert_eq!((status, refused["error"]["code"].as_str()), (502, Some("registry_unreachable")), "{refused}");
}

/// How the hostile registry misbehaves, by repository name.
const WRONG_DIGEST: &str = "wrong";
const ENDLESS: &str = "endless";
const DECLARED_HUGE: &str = "huge";
const STALL: &str = "stall";
/// Declares (in its manifest and its `Content-Length`) a layer of [`BIG`] bytes.
const BIG_LAYER: &str = "big";
const BIG: u64 = 96 << 20;

/// A registry that lies: its manifests name a layer of `LAYER` bytes, and
/// its blobs are the wrong bytes, never end, or stall halfway. Counts the
/// blob bytes it managed to send.
struct Hostile {
    addr: SocketAddr,
    sent: Arc<AtomicU64>,
    blob_requests: Arc<AtomicU64>,
}

const LAYER: usize = 64 << 10;

impl Hostile {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (sent, blob_requests) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let (s, b) = (Arc::clone(&sent), Arc::clone(&blob_requests));
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (s, b) = (Arc::clone(&s), Arc::clone(&b));
                std::thread::spawn(move || serve_hostile(stream, &s, &b));
            }
        });
        Self { addr, sent, blob_requests }
    }
}

fn serve_hostile(mut stream: TcpStream, sent: &AtomicU64, blob_requests: &AtomicU64) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap_or(0);
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
            break;
        }
    }
    let repo = path.split('/').nth(2).unwrap_or("");
    let layer = vec![b'x'; LAYER];
    let digest = format!("sha256:{}", sha256_hex(&layer));
    if path.contains("/manifests/") {
        let size = match repo {
            DECLARED_HUGE => 1u64 << 40,
            BIG_LAYER => BIG,
            _ => LAYER as u64,
        };
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": { "mediaType": "application/vnd.wasm.config.v0+json", "digest": digest, "size": 2 },
            "layers": [{ "mediaType": "application/wasm", "digest": digest, "size": size }],
        })
        .to_string();
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            manifest.len()
        );
        let _ = stream.write_all(format!("{head}{manifest}").as_bytes());
        return;
    }
    blob_requests.fetch_add(1, Ordering::Relaxed);
    let chunk = vec![b'y'; 16 << 10];
    match repo {
        WRONG_DIGEST => {
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {LAYER}\r\nConnection: close\r\n\r\n");
            let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(&vec![b'y'; LAYER]));
        }
        BIG_LAYER => {
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {BIG}\r\nConnection: close\r\n\r\n");
            let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(&chunk));
        }
        ENDLESS => {
            // Chunked, without end: only the reader can stop it.
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
            for _ in 0..(256 << 20) / chunk.len() {
                let framed = [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
                if stream.write_all(&framed).is_err() {
                    return;
                }
                sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
        }
        _ => {
            let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {LAYER}\r\nConnection: close\r\n\r\n");
            let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(&layer[..LAYER / 2]));
            std::thread::sleep(Duration::from_secs(120));
        }
    }
    let _ = stream.read(&mut [0u8; 1]);
}

#[test]
fn a_hostile_registry_cannot_feed_a_wrong_oversized_or_stalled_layer() {
    let hostile = Hostile::start();
    let reg = hostile.addr;
    let (addr, data) = gateway("hostile", &[reg], |c| c.upload_timeout_secs = 3);
    let deploy = |repo: &str| admin_deploy(addr, "demo", "h", json!({ "source": format!("oci://{reg}/{repo}:v1") }));

    let (status, refused) = deploy(WRONG_DIGEST);
    assert_eq!((status, refused["error"]["code"].as_str()), (422, Some("bad_artifact")), "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("digest"), "{refused}");
    // A digest the manifest does not have.
    let pinned = format!("oci://{reg}/{WRONG_DIGEST}@sha256:{}", "0".repeat(64));
    let (status, refused) = admin_deploy(addr, "demo", "h", json!({ "source": pinned }));
    assert_eq!((status, refused["error"]["code"].as_str()), (422, Some("bad_artifact")), "{refused}");

    // Declared past the upload limit: refused before the layer is asked for.
    let before = hostile.blob_requests.load(Ordering::Relaxed);
    let (status, refused) = deploy(DECLARED_HUGE);
    assert_eq!((status, refused["error"]["code"].as_str()), (413, Some("body_too_large")), "{refused}");
    assert_eq!(hostile.blob_requests.load(Ordering::Relaxed), before, "the layer was never fetched");
    // Declared small, sent without end: refused once past what was declared, never read whole.
    let (status, refused) = deploy(ENDLESS);
    assert_eq!((status, refused["error"]["code"].as_str()), (413, Some("body_too_large")), "{refused}");
    std::thread::sleep(Duration::from_millis(500));
    let sent = hostile.sent.load(Ordering::Relaxed);
    assert!(sent < 32 << 20, "the gateway stopped reading after {LAYER} bytes; the registry got {sent} bytes out (socket buffers)");

    // Stalled halfway: the deploy ends within the upload time limit and the tenant's upload place is free again.
    let started = Instant::now();
    let (status, refused) = deploy(STALL);
    assert_eq!((status, refused["error"]["code"].as_str()), (504, Some("pull_timeout")), "{refused}");
    assert!(started.elapsed() < Duration::from_secs(8), "{:?}", started.elapsed());
    let response = anonymous()
        .put(format!("http://{addr}/admin/v1/tenants/demo/handlers/h"))
        .bearer_auth(ADMIN_TOKEN)
        .body(std::fs::read(guest("hello")).unwrap())
        .send()
        .unwrap();
    assert_eq!(response.status(), 201, "the next upload of the tenant goes through: {}", response.text().unwrap());
    assert_eq!(call(addr, &data, "h", "/"), (200, "hello\n".to_owned()));

    // A layer the node's memory budget cannot hold is refused before its buffer is made.
    // (A budget of 64 MiB seeds nothing: an empty store and a tenant of its own.)
    let mut config = harness::config(harness::fresh_dir("oci-gateway-hostile-budget"), None);
    (config.oci_insecure_registries, config.outgoing_allow_private) = (vec![reg.to_string()], true);
    (config.memory_budget_mib, config.max_component_bytes) = (Some(64), 256 << 20);
    let small = harness::start(config);
    let created =
        anonymous().post(format!("http://{small}/admin/v1/tenants")).bearer_auth(ADMIN_TOKEN).json(&json!({ "name": "budget" })).send();
    assert_eq!(created.unwrap().status(), 201);
    let (status, refused) = admin_deploy(small, "budget", "h", json!({ "source": format!("oci://{reg}/{BIG_LAYER}:v1") }));
    assert_eq!((status, refused["error"]["code"].as_str()), (503, Some("overloaded")), "{refused}");
}

/// Runs `script` with the project's Python (oras-py, installed by deploy/setup.sh).
fn python(script: &str, args: &[&str]) -> String {
    let python = harness::facegate_home().join("venv/bin/python");
    let output = Command::new(python).arg("-c").arg(script).args(args).output().expect("the venv's python (deploy/setup.sh)");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn components_pushed_by_oras_deploy_and_ours_pull_with_oras_byte_identical() {
    let registry = Registry::start(&scratch("oras"), false);
    let reg = registry.addr;
    let (addr, data) = gateway("oras", &[reg], |_| {});
    let work = scratch("oras-work");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    std::fs::copy(guest("hello"), work.join("hello.wasm")).unwrap();
    std::fs::write(work.join("config.json"), r#"{"architecture":"wasm","os":"wasip2"}"#).unwrap();
    // oras-py pushes the wasm artifact as its README shows.
    let pushed = python(
        "import os, sys, oras.client\n\
         os.chdir(sys.argv[2])\n\
         c = oras.client.OrasClient(insecure=True)\n\
         r = c.push(target=sys.argv[1], files=['hello.wasm:application/wasm'], manifest_config='config.json:application/vnd.wasm.config.v0+json', disable_path_validation=True)\n\
         print(r.headers['Docker-Content-Digest'])",
        &[&format!("{reg}/oras/hello:v1"), work.to_str().unwrap()],
    );
    let (status, deployed) = admin_deploy(addr, "demo", "oras", json!({ "source": format!("oci://{reg}/oras/hello:v1") }));
    assert_eq!(status, 201, "{deployed}");
    assert_eq!(deployed["source"].as_str().unwrap(), format!("oci://{reg}/oras/hello@{}", pushed.trim()));
    assert_eq!(call(addr, &data, "oras", "/"), (200, "hello\n".to_owned()));

    // What we push, oras-py pulls: the same bytes under the file's name.
    push(addr, "faces", &format!("oci://{reg}/acme/faces:v1"));
    let out = work.join("pulled");
    let files = python(
        "import sys, oras.client\n\
         print('\\n'.join(oras.client.OrasClient(insecure=True).pull(target=sys.argv[1], outdir=sys.argv[2])))",
        &[&format!("{reg}/acme/faces:v1"), out.to_str().unwrap()],
    );
    assert_eq!(files.trim(), out.join("faces.wasm").display().to_string());
    assert_eq!(std::fs::read(out.join("faces.wasm")).unwrap(), std::fs::read(guest("faces")).unwrap(), "byte-identical");
}

#[test]
fn credentials_a_tenant_keeps_are_sealed_serve_its_own_pulls_only_and_are_never_shown() {
    let registry = Registry::start(&scratch("kept"), true);
    let reg = registry.addr;
    let (addr, data) = gateway("kept", &[reg], |_| {});
    let reference = format!("oci://{reg}/acme/hello:v1");
    push_as_user(addr, &reference);

    // demo keeps its credentials through the tenant API (deploy scope); an invoke key may not.
    let key = deploy_key(addr, "demo");
    let put = |key: &str, body: Value| {
        let response = anonymous().put(format!("http://{addr}/tenant/v1/registries/{reg}")).bearer_auth(key).json(&body).send().unwrap();
        (response.status().as_u16(), response.text().unwrap())
    };
    let invoke = std::fs::read_to_string(data.join("demo.key")).unwrap();
    assert_eq!(put(invoke.trim(), json!({ "username": USER, "password": PASSWORD })).0, 403);
    let (status, answer) = put(&key, json!({ "username": USER, "password": PASSWORD }));
    assert_eq!(status, 200, "{answer}");
    assert!(!answer.contains(PASSWORD), "{answer}");
    let listed = client_with_key(&key).get(format!("http://{addr}/tenant/v1/registries")).send().unwrap().text().unwrap();
    assert!(listed.contains(USER) && listed.contains(&reg.to_string()) && !listed.contains(PASSWORD), "{listed}");
    // At rest: nowhere in the data directory in clear.
    for entry in std::fs::read_dir(&data).unwrap().flatten().filter(|e| e.path().is_file()) {
        let bytes = std::fs::read(entry.path()).unwrap();
        assert!(!bytes.windows(PASSWORD.len()).any(|w| w == PASSWORD.as_bytes()), "{} holds the password", entry.path().display());
    }

    // Its deploys by reference need no credentials now; another tenant's get none of them.
    let (status, deployed) = pull_deploy(addr, "/tenant/v1/handlers/kept", &key, json!({ "source": reference }));
    assert_eq!(status, 201, "{deployed}");
    assert_eq!(call(addr, &data, "kept", "/"), (200, "hello\n".to_owned()));
    let (status, refused) = admin_deploy(addr, "evil", "stolen", json!({ "source": reference }));
    assert_eq!((status, refused["error"]["code"].as_str()), (403, Some("registry_denied")), "{refused}");

    // The CLI lists (user names only) and forgets them; then demo is refused too.
    let (code, out, _) = cli(addr, &["registry", "list", "--key", &key], &[], "");
    assert!(code == 0 && out.contains(USER) && !out.contains(PASSWORD), "{out}");
    let (code, out, err) = cli(addr, &["registry", "logout", &reg.to_string(), "--tenant", "demo"], &[], "");
    assert_eq!(code, 0, "{out}{err}");
    let (status, refused) = pull_deploy(addr, "/tenant/v1/handlers/kept", &key, json!({ "source": reference }));
    assert_eq!((status, refused["error"]["code"].as_str()), (403, Some("registry_denied")), "{refused}");
    // And keeps them again from the operator's CLI, the password from stdin.
    let args = ["registry", "login", &reg.to_string(), "--tenant", "demo", "--registry-username", USER, "--registry-password-stdin"];
    let (code, out, err) = cli(addr, &args, &[], &format!("{PASSWORD}\n"));
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(pull_deploy(addr, "/tenant/v1/handlers/kept", &key, json!({ "source": reference })).0, 201);
}
