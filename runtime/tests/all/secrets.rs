//! One secret per purpose, tried as an attacker would: the metrics token
//! Prometheus holds reads `/metrics` and opens nothing else; an artifact
//! sealed with the admin token (as the gateway sealed them before
//! `--artifact-key`) is not loaded from a cluster's store, and an artifact
//! changed in a node's cache is not loaded either: the node compiles the
//! component itself and answers as the tenant's handler should; the data
//! directory is this user's own and closed to others.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use facegate::control::ArtifactKey;
use facegate::control::store::SharedArtifact;
use facegate_throwaway_pg::ThrowawayPostgres;
use hmac::{Hmac, Mac};
use reqwest::Method;
use serde_json::{Value, json};
use sha2::Sha256;

use crate::harness::{
    ADMIN_TOKEN, ARTIFACT_KEY, anonymous, client_with_key, config, engine_config, facegate_home, fresh_dir, guest, image, start,
};
use crate::process::Server;

/// The metrics token of these tests' gateways.
const METRICS_TOKEN: &str = "test-metrics-token-0123456789";

/// The status and error code of `method path` with `token`.
fn refusal(base: &str, method: Method, path: &str, token: &str) -> (u16, Value) {
    let response =
        anonymous().request(method, format!("{base}{path}")).bearer_auth(token).json(&json!({ "name": "intruder" })).send().unwrap();
    (response.status().as_u16(), response.json().unwrap_or(Value::Null)["error"]["code"].clone())
}

#[test]
fn the_metrics_token_reads_metrics_and_opens_nothing_else() {
    let mut config = config(fresh_dir("metrics-token"), None);
    config.metrics_token = Some(METRICS_TOKEN.to_owned());
    let base = format!("http://{}", start(config));

    let scrape = |token: &str| anonymous().get(format!("{base}/metrics")).bearer_auth(token).send().unwrap();
    let scraped = scrape(METRICS_TOKEN);
    assert_eq!(scraped.status(), 200);
    assert!(scraped.text().unwrap().contains("facegate_"), "Prometheus text");
    assert_eq!(scrape(ADMIN_TOKEN).status(), 200, "the admin token reads metrics too");
    assert_eq!(scrape("a-wrong-token-0123456789").status(), 401);
    assert_eq!(anonymous().get(format!("{base}/metrics")).send().unwrap().status(), 401, "no token");

    for (method, path) in [
        (Method::GET, "/admin/v1/tenants"),
        (Method::POST, "/admin/v1/tenants"),
        (Method::GET, "/admin/v1/stats"),
        (Method::GET, "/admin/v1/nodes"),
        (Method::POST, "/admin/v1/tenants/intruder/keys"),
        (Method::PUT, "/admin/v1/tenants/intruder/handlers/h"),
    ] {
        assert_eq!(refusal(&base, method.clone(), path, METRICS_TOKEN), (401, json!("unauthorized")), "{method} {path}: as a wrong token");
    }
    let (status, _) = refusal(&base, Method::GET, "/admin/v1/tenants/intruder", ADMIN_TOKEN);
    assert_eq!(status, 404, "nothing was created with the metrics token");
}

/// What the gateway stored before `--artifact-key`: an artifact sealed
/// under a key derived from the admin token. Whoever holds that token can
/// compute it.
fn sealed_with_the_admin_token(engine: &str, component: &str, bytes: Vec<u8>) -> SharedArtifact {
    let hmac = |key: &[u8]| <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap();
    let mut derive = hmac(ADMIN_TOKEN.as_bytes());
    derive.update(b"facegate shared artifact key v1");
    let mut tag = hmac(&derive.finalize().into_bytes());
    for part in [engine.as_bytes(), component.as_bytes()] {
        tag.update(&(part.len() as u64).to_le_bytes());
        tag.update(part);
    }
    tag.update(&bytes);
    let mac = tag.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
    SharedArtifact { engine: engine.to_owned(), bytes, mac }
}

/// The engine id under which `data`'s cache holds the artifact of `component`.
fn cached_engine(data: &Path, component: &str) -> String {
    std::fs::read_dir(data.join("compiled"))
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().into_string().ok())
        .find_map(|name| name.strip_prefix(&format!("{component}-"))?.strip_suffix(".cwasm").map(str::to_owned))
        .unwrap_or_else(|| panic!("no artifact of {component} cached in {}", data.display()))
}

/// Creates tenant `t` with `detect` as handler `h` and `blur` as `other`
/// through `server`; returns the key and both components' SHA-256.
fn detect_and_blur(server: &Server) -> (String, String, String) {
    server.json(server.admin(Method::POST, "tenants").json(&json!({ "name": "t" })));
    let key = server.json(server.admin(Method::POST, "tenants/t/keys"))["key"].as_str().unwrap().to_owned();
    let deploy = |handler: &str, component: &str| {
        let deployed =
            server.json(server.admin(Method::PUT, &format!("tenants/t/handlers/{handler}")).body(std::fs::read(guest(component)).unwrap()));
        deployed["sha256"].as_str().unwrap().to_owned()
    };
    let detect = deploy("h", "detect");
    let blur = deploy("other", "blur");
    (key, detect, blur)
}

/// Whether `server`'s t/h answers as `detect` does: JSON with the faces of
/// the photo (blur, whose artifact the attacker planted, answers an image).
fn answers_as_detect(server: &Server, key: &str) -> bool {
    let response = client_with_key(key).post(format!("http://{}/v1/t/h", server.addr)).body(image("grace_hopper.jpg")).send().unwrap();
    let json = response.status() == 200
        && response.headers().get("content-type").is_some_and(|v| v.to_str().unwrap().starts_with("application/json"));
    json && response.json::<Value>().unwrap()["faces"].as_array().is_some_and(|faces| !faces.is_empty())
}

#[test]
fn an_artifact_sealed_with_the_admin_token_alone_is_refused() {
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    // Each node has a data directory of its own; all but C the artifact key.
    let node = |id: &str, artifact_key: bool| {
        let data = fresh_dir(&format!("secrets-{id}"));
        let args = ["--store", url.as_str(), "--node-id", id];
        let server = if artifact_key { Server::start_with(&data, &args) } else { Server::start_without_artifact_key(&data, &args) };
        (server, data)
    };
    let (a, a_data) = node("a", true);
    let (key, detect, blur) = detect_and_blur(&a);
    let engine = cached_engine(&a_data, &detect);
    let mut store = facegate::control::store::open(Some(&url), &fresh_dir("secrets-attacker")).unwrap();
    let shared = store.shared_artifact(&detect, &engine).unwrap().expect("A shares what it compiled");
    assert!(ArtifactKey::derive(ARTIFACT_KEY).verify(&detect, &shared), "sealed with the artifact key");

    // The attacker, with the admin token and the database, puts blur's
    // native code in place of detect's, sealed as the gateway used to.
    let planted = std::fs::read(a_data.join(format!("compiled/{blur}-{engine}.cwasm"))).unwrap();
    store.share_artifact(&detect, &sealed_with_the_admin_token(&engine, &detect, planted.clone())).unwrap();

    let (b, _) = node("b", true);
    assert!(answers_as_detect(&b, &key), "B compiled detect itself instead of loading the planted code");
    let row = store.shared_artifact(&detect, &engine).unwrap().unwrap();
    assert!(row.bytes != planted && ArtifactKey::derive(ARTIFACT_KEY).verify(&detect, &row), "B shared its own compile, sealed");
    drop((a, b));

    // Without an artifact key nothing is shared (and nothing shared is loaded).
    let (c, _) = node("c", false);
    assert!(answers_as_detect(&c, &key));
    let crop = c.json(c.admin(Method::PUT, "tenants/t/handlers/crop").body(std::fs::read(guest("crop")).unwrap()))["sha256"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(store.shared_artifact(&crop, &engine).unwrap(), None, "C shares nothing");
}

#[test]
fn a_tampered_cached_artifact_is_not_loaded() {
    // A single node as most run: its cache key is the random one in its data directory.
    let data = fresh_dir("secrets-cache");
    let server = Server::start_without_artifact_key(&data, &[]);
    let (key, detect, blur) = detect_and_blur(&server);
    assert!(answers_as_detect(&server, &key));
    server.kill();

    // With write access to the cache (not the key), blur's artifact and its
    // MAC are copied over detect's, and a hash of them beside it (what the
    // cache trusted before it was sealed).
    let engine = cached_engine(&data, &detect);
    let file = |sha: &str, ext: &str| data.join(format!("compiled/{sha}-{engine}.{ext}"));
    let planted = std::fs::read(file(&blur, "cwasm")).unwrap();
    std::fs::write(file(&detect, "cwasm"), &planted).unwrap();
    std::fs::copy(file(&blur, "mac"), file(&detect, "mac")).unwrap();
    std::fs::write(file(&detect, "sha256"), facegate::control::keys::sha256_hex(&planted)).unwrap();

    let server = Server::start_without_artifact_key(&data, &[]);
    assert!(answers_as_detect(&server, &key), "detect compiled again instead of loading the planted code");
    assert_ne!(std::fs::read(file(&detect, "cwasm")).unwrap(), planted, "the refused artifact was replaced");
}

#[cfg(unix)]
fn mode(dir: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(dir).unwrap().permissions().mode() & 0o7777
}

/// A data directory open to everyone (an `emptyDir` is 0777) is closed to
/// its owner at start; one that another user owns is refused before
/// anything is loaded.
#[cfg(target_os = "linux")]
#[test]
fn the_data_directory_is_its_owners_alone() {
    use std::os::unix::fs::PermissionsExt;
    let open = fresh_dir("secrets-open-dir");
    std::fs::create_dir_all(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    start(config(open.clone(), None));
    assert_eq!(mode(&open), 0o700, "tightened at start");
    assert_eq!(mode(&open.join(facegate::control::CACHE_KEY_FILE)) & 0o077, 0, "the cache key is the owner's alone");

    let foreign = foreign_dir();
    let before = foreign.as_ref().map(|dir| mode(dir));
    let dir = foreign.unwrap_or_else(|| PathBuf::from("/"));
    let engine = engine_config(&facegate_home());
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_facegate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin-token", ADMIN_TOKEN])
        .arg("--data-dir")
        .arg(&dir)
        .arg("--model")
        .arg(&engine.model)
        .arg("--onnxruntime")
        .arg(&engine.onnxruntime)
        .env_remove("FACEGATE_STORE")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("facegate started on a data directory another user owns");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("belongs to uid") && stderr.contains("another user could change"), "a clear refusal: {stderr}");
    if let Some(before) = before {
        assert_eq!(mode(&dir), before, "refused before anything was changed");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "nothing written");
    }
}

/// A fresh directory of another user's (root gives one away), or `None`
/// for a user who cannot: `/` is then root's, not theirs.
#[cfg(target_os = "linux")]
fn foreign_dir() -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if !rustix::process::geteuid().is_root() {
        return None;
    }
    let dir = fresh_dir("secrets-foreign-dir");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::os::unix::fs::chown(&dir, Some(65_534), Some(65_534)).unwrap();
    Some(dir)
}

/// `FACEGATE_METRICS_TOKEN` sets the metrics token as `--metrics-token`
/// does: `/metrics` opens with it and with the admin token, not without a
/// token or with another, and the admin API does not open with it.
#[test]
fn the_metrics_token_is_set_from_the_environment() {
    let server = Server::start_after(&format!("export FACEGATE_METRICS_TOKEN={METRICS_TOKEN}"), &fresh_dir("metrics-token-env"), &[]);
    let base = format!("http://{}", server.addr);
    let scrape = |token: Option<&str>| {
        let request = anonymous().get(format!("{base}/metrics"));
        token.map_or(request.try_clone().unwrap(), |t| request.bearer_auth(t)).send().unwrap()
    };
    let scraped = scrape(Some(METRICS_TOKEN));
    assert_eq!(scraped.status(), 200);
    assert!(scraped.text().unwrap().contains("facegate_"), "Prometheus text");
    assert_eq!(scrape(Some(ADMIN_TOKEN)).status(), 200, "the admin token reads metrics too");
    assert_eq!(scrape(Some("a-wrong-token-0123456789")).status(), 401);
    assert_eq!(scrape(None).status(), 401, "no token");
    for (method, path) in [(Method::GET, "/admin/v1/tenants"), (Method::POST, "/admin/v1/tenants")] {
        assert_eq!(refusal(&base, method.clone(), path, METRICS_TOKEN), (401, json!("unauthorized")), "{method} {path}");
    }
}
