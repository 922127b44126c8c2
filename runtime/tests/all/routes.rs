//! Handlers own their routes: everything below `/v1/{tenant}/{handler}`
//! runs the handler, whose guest sees the path below its mount (or the
//! whole path, deployed with `path=full`) and the mount in headers; dot
//! segments never leave the mount; the operator routes tenants' own
//! hostnames to their handlers, over HTTP and over TLS with a certificate
//! per hostname chosen by SNI (reloaded without a restart), and a
//! hostname of one tenant never reaches another's handlers.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use tokio_rustls::rustls::StreamOwned;
use tokio_rustls::rustls::pki_types::CertificateDer;

use crate::harness::{ADMIN_TOKEN, admin, admin_json, anonymous, client_as, fresh_dir, gateway, guest, image, key, start, url};

/// The headers the gateway gives a handler (see `facegate::http::mount`).
const BASE_PATH: &str = "x-facegate-base-path";
const PATH_INFO: &str = "x-facegate-path-info";
const FULL_URL: &str = "x-facegate-full-url";

/// A raw HTTP/1.0 exchange with `addr` (no client normalises the path):
/// `head` is the request line and headers without the final blank line.
/// Returns the status and the body.
pub(crate) fn raw(addr: SocketAddr, head: &str) -> (u16, String) {
    split_answer(&crate::control::raw_exchange(addr, &format!("{head}\r\n\r\n"), &[], Duration::from_secs(30)))
}

/// The status and body of a raw HTTP/1.0 answer read from `stream` to its close.
fn read_answer(stream: &mut impl Read) -> (u16, String) {
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    split_answer(&String::from_utf8_lossy(&answer))
}

/// A raw answer's status and body.
fn split_answer(answer: &str) -> (u16, String) {
    let status = answer.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, body)| body).to_owned();
    (status, body)
}

/// What the hostile handler's `echo` saw (its JSON), from a raw `GET`.
fn asked(addr: SocketAddr, path: &str, host: &str, key: &str) -> (u16, Value) {
    let (status, body) = raw(addr, &format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nAuthorization: Bearer {key}"));
    (status, serde_json::from_str(&body).unwrap_or(Value::String(body)))
}

/// A header the echo saw (its first value).
fn seen<'a>(echo: &'a Value, header: &str) -> &'a str {
    echo["headers"][header][0].as_str().unwrap_or_else(|| panic!("no {header} in {echo}"))
}

#[test]
fn everything_below_a_handler_runs_it_with_the_path_below_its_mount() {
    let (addr, evil) = (gateway().addr, key("evil"));
    let host = addr.to_string();
    // The tenant's handler `attack` is the hostile test program; `echo` answers what it saw.
    for (path, guest_path, info) in [
        ("/v1/evil/attack/v2/detect?attack=echo&x=a%20b", "/v2/detect", "/v2/detect"),
        ("/v1/evil/attack?attack=echo", "/", "/"),
        ("/v1/evil/attack/?attack=echo", "/", "/"),
        ("/v1/evil/attack/a%2Fb//c/?attack=echo", "/a%2Fb//c/", "/a%2Fb//c/"),
    ] {
        let (status, echo) = asked(addr, path, &host, &evil);
        assert_eq!(status, 200, "{path}: {echo}");
        assert_eq!(echo["path"], guest_path, "{path}");
        assert_eq!(seen(&echo, BASE_PATH), "/v1/evil/attack");
        assert_eq!(seen(&echo, PATH_INFO), info);
        assert_eq!(seen(&echo, FULL_URL), format!("http://{host}{path}"));
    }
    let (_, echo) = asked(addr, "/v1/evil/attack/v2/detect?attack=echo&x=a%20b", &host, &evil);
    assert_eq!(echo["query"], json!([["attack", "echo"], ["x", "a b"]]), "the query reaches the guest, decoded by it");

    // Every method; a client's own mount headers are replaced, never passed on.
    let client = client_as("evil");
    for method in [Method::POST, Method::PUT, Method::DELETE, Method::PATCH] {
        let response = client
            .request(method.clone(), url("/v1/evil/attack/items/7?attack=echo"))
            .header(PATH_INFO, "/forged")
            .header(BASE_PATH, "/v1/demo/detect")
            .send()
            .unwrap();
        assert_eq!(response.status(), 200, "{method}");
        let echo: Value = response.json().unwrap();
        assert_eq!((echo["method"].as_str(), echo["path"].as_str()), (Some(method.as_str()), Some("/items/7")));
        assert_eq!(echo["headers"][PATH_INFO], json!(["/items/7"]), "one value, the gateway's");
        assert_eq!(echo["headers"][BASE_PATH], json!(["/v1/evil/attack"]));
    }
    // Auth, limits and logs are per handler, as at the mount itself.
    assert_eq!(anonymous().get(url("/v1/evil/attack/deep/path?attack=echo")).send().unwrap().status(), 401);
    assert_eq!(client_as("demo").get(url("/v1/evil/attack/deep/path?attack=echo")).send().unwrap().status(), 404);
    // The Rust example still answers at its mount, as the README's first curl does.
    let detect = client_as("demo").post(url("/v1/demo/detect")).body(image("city.jpg")).send().unwrap();
    assert_eq!(detect.status(), 200);
    assert!(!detect.json::<Value>().unwrap()["faces"].as_array().unwrap().is_empty());
}

#[test]
fn dot_segments_never_leave_the_mount_and_long_paths_are_handled() {
    let (addr, evil) = (gateway().addr, key("evil"));
    let host = addr.to_string();
    // Below the mount, `..` stops at the mount's root: the handler stays the same.
    for (path, inside) in [
        ("/v1/evil/attack/../../demo/detect?attack=echo", "/demo/detect"),
        ("/v1/evil/attack/%2e%2e/%2E%2E/demo/detect?attack=echo", "/demo/detect"),
        ("/v1/evil/attack/a/./b/../c?attack=echo", "/a/c"),
        ("/v1/evil/attack/..?attack=echo", "/"),
    ] {
        let (status, echo) = asked(addr, path, &host, &evil);
        assert_eq!((status, echo["path"].as_str()), (200, Some(inside)), "{path}: {echo}");
        assert_eq!(seen(&echo, BASE_PATH), "/v1/evil/attack");
    }
    // In the mount's own segments, a dot segment names no handler: 400.
    for climbing in ["/v1/evil/../demo/detect", "/v1/demo/%2e%2e/evil/attack", "/v1/evil/./attack"] {
        let (status, body) = raw(addr, &format!("GET {climbing} HTTP/1.0\r\nHost: {host}\r\nAuthorization: Bearer {evil}"));
        assert_eq!(status, 400, "{climbing}: {body}");
        assert!(body.contains("bad_path"), "{body}");
    }
    // A long path within the head limit reaches the guest whole; one past it is refused, not served.
    let long = format!("/v1/evil/attack/{}?attack=echo", "segment/".repeat(2_000));
    let (status, echo) = asked(addr, &long, &host, &evil);
    assert_eq!(status, 200);
    assert_eq!(echo["path"].as_str().unwrap().len(), 1 + "segment/".len() * 2_000);
    let too_long = format!("/v1/evil/attack/{}", "x".repeat(64 << 10));
    let (status, _) = raw(addr, &format!("GET {too_long} HTTP/1.0\r\nHost: {host}\r\nAuthorization: Bearer {evil}"));
    assert!((400..500).contains(&status) || status == 0, "a path past the head limit is refused: {status}");
    assert_eq!(echo_status(addr, &host, &evil), 200, "and the gateway goes on");
}

fn echo_status(addr: SocketAddr, host: &str, key: &str) -> u16 {
    asked(addr, "/v1/evil/attack/after?attack=echo", host, key).0
}

/// A tenant serving the hostile test program as `echo`, deployed with
/// `query` (`path=full`, say), and a key of its.
fn echo_tenant(name: &str, query: &str) -> String {
    tenant_serving(name, ("echo", "hostile"), query)
}

/// A tenant serving the built guest `component` as `handler`, deployed
/// with `query`, and a key of its.
fn tenant_serving(name: &str, (handler, component): (&str, &str), query: &str) -> String {
    let (status, body) = admin_json(admin(Method::POST, "tenants").json(&json!({ "name": name })));
    assert!(status == 201 || status == 409, "{status} {body}");
    let bytes = std::fs::read(guest(component)).unwrap();
    let (status, body) = admin_json(admin(Method::PUT, &format!("tenants/{name}/handlers/{handler}{query}")).body(bytes));
    assert_eq!(status, 201, "{body}");
    let (status, body) = admin_json(admin(Method::POST, &format!("tenants/{name}/keys")));
    assert_eq!(status, 201, "{body}");
    body["key"].as_str().unwrap().to_owned()
}

/// The Spin SDK's own router example (guests/spin-router, its source
/// unchanged), built as a wasi:http component: under its mount, and under
/// a hostname, it answers as under `wasmtime serve` (the component's
/// routes see the path they were written for).
#[test]
fn a_spin_router_component_answers_as_under_wasmtime_serve() {
    let (addr, host) = (gateway().addr, gateway().addr.to_string());
    let key = tenant_serving("spinport", ("router", "spin_router"), "");
    let get = |method: &str, path: &str, host: &str| {
        raw(addr, &format!("{method} {path} HTTP/1.0\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\nContent-Length: 0"))
    };
    // What `wasmtime serve` gives for each path (the router's own routes: `/hello/:planet`, `/goodbye/:planet`, `/*`).
    let answers = [
        ("GET", "/hello/earth?x=1", "earth"),
        ("GET", "/goodbye/mars", "mars"),
        ("POST", "/hello/earth", "hello/earth"),
        ("PUT", "/goodbye/mars", "goodbye/mars"),
        ("GET", "/anything/else?x=1", "anything/else"),
        ("GET", "/hello/caf%C3%A9", "caf%C3%A9"),
        ("GET", "/", ""),
    ];
    for (method, path, body) in answers {
        let mounted = if path == "/" { "/v1/spinport/router".to_owned() } else { format!("/v1/spinport/router{path}") };
        assert_eq!(get(method, &mounted, &host), (200, body.to_owned()), "{method} {mounted}");
    }
    let base = format!("http://{addr}");
    let request = anonymous().put(format!("{base}/admin/v1/routes/spin.spinport.test")).bearer_auth(ADMIN_TOKEN);
    assert_eq!(admin_json(request.json(&json!({ "tenant": "spinport", "handler": "router" }))).0, 200);
    for (method, path, body) in answers {
        assert_eq!(get(method, path, "spin.spinport.test"), (200, body.to_owned()), "{method} {path} on its hostname");
    }
}

#[test]
fn a_version_deployed_with_path_full_sees_the_whole_path() {
    let (addr, host) = (gateway().addr, gateway().addr.to_string());
    let key = echo_tenant("fullpath", "?path=full");
    let (status, echo) = asked(addr, "/v1/fullpath/echo/items/7?attack=echo", &host, &key);
    assert_eq!((status, echo["path"].as_str()), (200, Some("/v1/fullpath/echo/items/7")), "{echo}");
    assert_eq!(seen(&echo, PATH_INFO), "/items/7", "the headers say where the mount ends either way");
    let (_, versions) = admin_json(admin(Method::GET, "tenants/fullpath/handlers/echo/versions"));
    assert_eq!(versions["versions"][0]["guest_path"], "full", "{versions}");

    // The next version, deployed without it, sees the relative path; a rollback brings the whole path back.
    let bytes = std::fs::read(guest("hostile")).unwrap();
    assert_eq!(admin_json(admin(Method::PUT, "tenants/fullpath/handlers/echo").body(bytes)).0, 201);
    assert_eq!(asked(addr, "/v1/fullpath/echo/items/7?attack=echo", &host, &key).1["path"], "/items/7");
    assert_eq!(admin_json(admin(Method::POST, "tenants/fullpath/handlers/echo/rollback")).0, 200);
    assert_eq!(asked(addr, "/v1/fullpath/echo/items/7?attack=echo", &host, &key).1["path"], "/v1/fullpath/echo/items/7");
    let (status, body) = admin_json(admin(Method::PUT, "tenants/fullpath/handlers/echo?path=whole").body(vec![0u8; 8]));
    assert_eq!(status, 400, "an unknown path option is refused: {body}");
}

/// Routes `hostname` to `tenant`'s `echo` through the admin API of `base` (`http://addr`).
fn route(base: &str, hostname: &str, tenant: &str) -> (u16, Value) {
    let request = anonymous().put(format!("{base}/admin/v1/routes/{hostname}")).bearer_auth(ADMIN_TOKEN);
    admin_json(request.json(&json!({ "tenant": tenant, "handler": "echo" })))
}

#[test]
fn a_tenants_hostname_runs_its_handler_with_the_whole_path_and_never_another_tenants() {
    let addr = gateway().addr;
    let base = format!("http://{addr}");
    let (a, b) = (echo_tenant("hosta", ""), echo_tenant("hostb", ""));
    assert_eq!(route(&base, "faces.hosta.test", "hosta").0, 200);
    assert_eq!(route(&base, "Faces.HostB.test.", "hostb").1["hostname"], "faces.hostb.test", "kept lowercase, without the dot");

    let (status, echo) = asked(addr, "/health?attack=echo", "faces.hosta.test:8080", &a);
    assert_eq!((status, echo["path"].as_str()), (200, Some("/health")), "{echo}");
    assert_eq!((seen(&echo, BASE_PATH), seen(&echo, PATH_INFO)), ("/", "/health"));
    assert_eq!(seen(&echo, FULL_URL), "http://faces.hosta.test:8080/health?attack=echo");
    // The whole path is the handler's, `/v1/...` included: B's hostname never reaches A's handlers.
    let (status, echo) = asked(addr, "/v1/hosta/echo?attack=echo", "faces.hostb.test", &b);
    assert_eq!((status, echo["path"].as_str()), (200, Some("/v1/hosta/echo")), "B's own handler answers: {echo}");
    assert_eq!(asked(addr, "/v1/hosta/echo?attack=echo", "faces.hostb.test", &a).0, 404, "A's key on B's hostname");
    assert_eq!(asked(addr, "/?attack=echo", "faces.hosta.test", &b).0, 404, "B's key on A's hostname");
    assert_eq!(asked(addr, "/?attack=echo", "faces.hosta.test", "fg_nope_nope").0, 401);

    // A hostname belongs to one tenant; malformed ones are refused.
    let (status, body) = route(&base, "faces.hosta.test", "hostb");
    assert_eq!(status, 409, "{body}");
    for bad in ["localhost", "127.0.0.1", "a_b.test"] {
        assert_eq!(route(&base, bad, "hosta").0, 400, "{bad}");
    }
    assert_eq!(route(&base, "faces.nobody.test", "nobody").0, 404, "an unknown tenant");
    let (_, listed) = admin_json(admin(Method::GET, "routes"));
    let names: Vec<&str> = listed["routes"].as_array().unwrap().iter().filter_map(|r| r["hostname"].as_str()).collect();
    assert!(names.contains(&"faces.hosta.test") && names.contains(&"faces.hostb.test"), "{listed}");

    // A tenant lists its own hostnames, not the others'.
    let read_key =
        admin_json(admin(Method::POST, "tenants/hosta/keys").json(&json!({ "scopes": ["read"] }))).1["key"].as_str().unwrap().to_owned();
    let own: Value = crate::harness::client_with_key(&read_key).get(url("/tenant/v1/routes")).send().unwrap().json().unwrap();
    let own: Vec<&str> = own["routes"].as_array().unwrap().iter().filter_map(|r| r["hostname"].as_str()).collect();
    assert_eq!(own, ["faces.hosta.test"]);

    // Unknown hostnames fall through to the normal routes.
    assert_eq!(asked(addr, "/v1/hosta/echo/x?attack=echo", "unknown.test", &a).1["path"], "/x");
    // Removed, the hostname falls through; the tenant deleted, its hostnames go with it.
    assert_eq!(admin_json(admin(Method::DELETE, "routes/faces.hostb.test")).0, 200);
    assert_eq!(asked(addr, "/health?attack=echo", "faces.hostb.test", &b).0, 404, "no route for /health any more");
    assert_eq!(admin_json(admin(Method::DELETE, "routes/faces.hostb.test")).0, 404);
    assert_eq!(admin_json(admin(Method::DELETE, "tenants/hosta")).0, 200);
    let (_, listed) = admin_json(admin(Method::GET, "routes"));
    assert!(!listed.to_string().contains("faces.hosta.test"), "{listed}");
    assert_eq!(route(&base, "faces.hosta.test", "hostb").0, 200, "the hostname is free again");
}

/// A self-signed certificate for `name`, written as `dir/NAME.crt` and `dir/NAME.key`.
pub(crate) fn host_cert(dir: &Path, name: &str) -> CertificateDer<'static> {
    let certified = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    // The key first: a reader between the two writes sees a mismatched pair and keeps the old one.
    std::fs::write(dir.join(format!("{name}.key")), certified.signing_key.serialize_pem()).unwrap();
    std::fs::write(dir.join(format!("{name}.crt")), certified.cert.pem()).unwrap();
    certified.cert.der().clone()
}

/// One HTTP/1.0 exchange over TLS with `addr`, asking for `sni` and
/// trusting `root` only: `head` (the request line and headers, without the
/// blank line), then `body`. `None` when the handshake or the write fails.
fn exchange_tls(addr: SocketAddr, (sni, root): (&str, &CertificateDer<'static>), head: &str, body: &[u8]) -> Option<(u16, String)> {
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut tls = StreamOwned::new(crate::harness::tls_client(root, sni), tcp);
    tls.write_all(format!("{head}\r\n\r\n").as_bytes()).ok()?;
    tls.write_all(body).ok()?;
    let answer = read_answer(&mut tls);
    (answer.0 != 0).then_some(answer)
}

/// `GET path` over TLS to `addr`, asking for `sni` and trusting `root`
/// only, with `host` as the `Host`; `None` when the handshake fails.
pub(crate) fn get_tls(addr: SocketAddr, tls: (&str, &CertificateDer<'static>), host: &str, path: &str, key: &str) -> Option<(u16, String)> {
    exchange_tls(addr, tls, &format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nAuthorization: Bearer {key}"), &[])
}

/// A TLS gateway with a default certificate for `localhost` and the host
/// certificates in `certs`: its address and the default certificate.
pub(crate) fn tls_gateway_with_hosts(name: &str, certs: &Path) -> (SocketAddr, CertificateDer<'static>, PathBuf) {
    let dir = fresh_dir(name);
    let (mut config, default) = crate::harness::tls_config(&dir);
    config.tls_host_certs = Some(certs.to_owned());
    let data = config.data_dir.clone();
    (start(config), default, data)
}

#[test]
fn over_tls_each_hostname_gets_its_own_certificate_by_sni_reloaded_without_a_restart() {
    let certs = fresh_dir("host-certs");
    let (cert_a, cert_b) = (host_cert(&certs, "faces.tlsa.test"), host_cert(&certs, "faces.tlsb.test"));
    let (addr, default, _) = tls_gateway_with_hosts("routes-tls", &certs);
    // The admin API over the same TLS listener (as `localhost`, the default certificate).
    let admin_tls = |method: &str, path: &str, body: &[u8]| {
        let head = format!(
            "{method} /admin/v1/{path} HTTP/1.0\r\nHost: localhost\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: {}",
            body.len()
        );
        let (status, body) = exchange_tls(addr, ("localhost", &default), &head, body).unwrap();
        (status, serde_json::from_str::<Value>(&body).unwrap_or(Value::String(body)))
    };
    let mut keys = Vec::new();
    for tenant in ["tlsa", "tlsb"] {
        assert_eq!(admin_tls("POST", "tenants", json!({ "name": tenant }).to_string().as_bytes()).0, 201);
        keys.push(admin_tls("POST", &format!("tenants/{tenant}/keys"), b"{}").1["key"].as_str().unwrap().to_owned());
        let route = json!({ "tenant": tenant, "handler": "echo" }).to_string();
        assert_eq!(admin_tls("PUT", &format!("routes/faces.{tenant}.test"), route.as_bytes()).0, 200);
        // Deployed over TLS too.
        let deployed = admin_tls("PUT", &format!("tenants/{tenant}/handlers/echo"), &std::fs::read(guest("hostile")).unwrap());
        assert_eq!(deployed.0, 201, "{}", deployed.1);
    }

    // Each hostname's own certificate (the client trusts only that one), and its own tenant's handler.
    let (status, body) = get_tls(addr, ("faces.tlsa.test", &cert_a), "faces.tlsa.test", "/detect?attack=echo", &keys[0]).unwrap();
    let echo: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, echo["path"].as_str()), (200, Some("/detect")), "{body}");
    assert_eq!(seen(&echo, FULL_URL), "https://faces.tlsa.test/detect?attack=echo");
    let (status, _) = get_tls(addr, ("faces.tlsb.test", &cert_b), "faces.tlsb.test", "/x?attack=echo", &keys[1]).unwrap();
    assert_eq!(status, 200);
    assert!(
        get_tls(addr, ("faces.tlsa.test", &cert_b), "faces.tlsa.test", "/", &keys[0]).is_none(),
        "A's name gets A's certificate, not B's"
    );
    assert!(get_tls(addr, ("localhost", &default), "localhost", "/healthz", "").is_some(), "other names get the default");
    // One tenant's connection cannot carry requests for another's hostname.
    let (status, body) = get_tls(addr, ("faces.tlsa.test", &cert_a), "faces.tlsb.test", "/?attack=echo", &keys[1]).unwrap();
    assert_eq!(status, 421, "{body}");
    assert_eq!(get_tls(addr, ("faces.tlsa.test", &cert_a), "faces.tlsa.test", "/?attack=echo", &keys[1]).unwrap().0, 404);

    // A renewed certificate is served without a restart.
    std::thread::sleep(Duration::from_millis(50));
    let renewed = host_cert(&certs, "faces.tlsa.test");
    let mut served = false;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        if get_tls(addr, ("faces.tlsa.test", &renewed), "faces.tlsa.test", "/?attack=echo", &keys[0]).is_some_and(|(s, _)| s == 200) {
            served = true;
            break;
        }
    }
    assert!(served, "the renewed certificate is served within 5 s");
    assert!(get_tls(addr, ("faces.tlsa.test", &cert_a), "faces.tlsa.test", "/", &keys[0]).is_none(), "and the old one no more");
}

/// The CLI: `route add|list|remove`, `deploy --full-path` and the guest
/// path `versions` prints.
#[test]
fn the_cli_routes_hostnames_and_deploys_with_the_whole_path() {
    let key = echo_tenant("clihost", "");
    let (code, out) = crate::control::cli(&["route", "add", "api.clihost.test", "--tenant", "clihost", "--handler", "echo"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("api.clihost.test -> clihost/echo"), "{out}");
    let (code, out) = crate::control::cli(&["route", "list"]);
    assert!(code == 0 && out.lines().any(|l| l == "api.clihost.test\tclihost/echo"), "{out}");
    let (code, out) = crate::control::cli(&["route", "add", "api.clihost.test", "--tenant", "demo", "--handler", "detect"]);
    assert_ne!(code, 0, "another tenant's hostname: {out}");
    assert!(out.contains("belongs to another tenant"), "{out}");

    let hostile = guest("hostile").display().to_string();
    let (code, out) = crate::control::cli(&["deploy", &hostile, "--tenant", "clihost", "--handler", "echo", "--full-path"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = crate::control::cli(&["versions", "--tenant", "clihost", "--handler", "echo"]);
    assert!(code == 0 && out.contains("path=relative") && out.contains("path=full\tupload\tactive"), "{out}");
    let (status, echo) = asked(gateway().addr, "/x?attack=echo", "api.clihost.test", &key);
    assert_eq!((status, echo["path"].as_str()), (200, Some("/x")), "under a hostname the whole path is the path: {echo}");

    let (code, out) = crate::control::cli(&["route", "remove", "api.clihost.test"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(asked(gateway().addr, "/x?attack=echo", "api.clihost.test", &key).0, 404);
}
