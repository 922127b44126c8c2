//! HTTPS: a gateway started with `--tls-cert`/`--tls-key` answers over TLS
//! (and not in clear text), HTTP/2 to clients that offer it by ALPN; an admin listener started with
//! `--admin-tls-cert`/`--admin-tls-key` serves the admin API over TLS, and
//! the CLI reaches it at an `https://` URL.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

use crate::harness::{ADMIN_TOKEN, anonymous, config, fresh_dir, start, start_split, tls_config};

/// A TLS gateway with a fresh self-signed certificate for `localhost`: its
/// address, the certificate and tenant `demo`'s key.
fn tls_gateway() -> &'static (SocketAddr, CertificateDer<'static>, String) {
    static GATEWAY: OnceLock<(SocketAddr, CertificateDer<'static>, String)> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        let (config, cert) = tls_config(&fresh_dir("tls"));
        let data = config.data_dir.clone();
        let addr = start(config);
        let key = std::fs::read_to_string(data.join("demo.key")).unwrap().trim().to_owned();
        (addr, cert, key)
    })
}

fn get_over_tls(path: &str) -> String {
    let (addr, cert, _) = tls_gateway();
    get_over_tls_from(*addr, cert, path, None)
}

/// `GET path` over TLS to `addr` (as `localhost`), trusting `root` only,
/// with `token` as the bearer token if given; the raw response.
fn get_over_tls_from(addr: SocketAddr, root: &CertificateDer<'static>, path: &str, token: Option<&str>) -> String {
    let name = ServerName::try_from("localhost").unwrap();
    let conn = ClientConnection::new(client_config(root, &[]), name).unwrap();
    let mut tls = StreamOwned::new(conn, TcpStream::connect(addr).unwrap());
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(tls, "GET {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Connection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    let _ = tls.read_to_string(&mut response);
    response
}

/// A TLS client's settings: it trusts `root` only and offers the protocols
/// `alpn` by ALPN (none if empty), in order of preference.
fn client_config(root: &CertificateDer<'static>, alpn: &[&[u8]]) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots.add(root.clone()).unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(client)
}

/// A private CA and a certificate for `localhost` it signed, written as PEM
/// under `dir`: the CA's certificate, the server's certificate and its key.
fn private_ca(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose};
    std::fs::create_dir_all(dir).unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    ca_params.distinguished_name.push(DnType::CommonName, "facegate test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["localhost".to_owned()]).unwrap().signed_by(&server_key, &ca).unwrap();
    let paths = (dir.join("ca.pem"), dir.join("admin-cert.pem"), dir.join("admin-key.pem"));
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, server.pem()).unwrap();
    std::fs::write(&paths.2, server_key.serialize_pem()).unwrap();
    paths
}

/// The admin listener serves HTTPS with its own certificate (from a private
/// CA) while the public listener stays plain HTTP: the admin API answers
/// over TLS, clear text gets no answer there, and the CLI reaches it at an
/// `https://` URL when told to trust the CA (`--ca-cert`), and only then.
#[test]
fn the_admin_listener_serves_https_and_the_cli_trusts_a_private_ca() {
    let dir = fresh_dir("admin-tls");
    let (ca, cert, key) = private_ca(&dir);
    let mut config = config(dir.join("data"), None);
    config.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    config.admin_tls_cert = Some(cert);
    config.admin_tls_key = Some(key);
    let (public, admin) = start_split(config);
    let ca_der = CertificateDer::from_pem_file(&ca).unwrap();

    let response = get_over_tls_from(admin, &ca_der, "/admin/v1/tenants", Some(ADMIN_TOKEN));
    assert!(response.starts_with("HTTP/1.1 200") && response.contains("\"tenants\""), "{response}");
    let metrics = get_over_tls_from(admin, &ca_der, "/metrics", Some(ADMIN_TOKEN));
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert_admin_speaks_h2_when_offered(admin, &ca_der);
    let plain = anonymous().get(format!("http://{admin}/admin/v1/tenants")).bearer_auth(ADMIN_TOKEN).send();
    assert!(plain.is_err(), "clear text to the admin listener gets no HTTP answer: {plain:?}");
    assert_eq!(anonymous().get(format!("http://{public}/healthz")).send().unwrap().status(), 200, "the public listener stays plain");

    let cli = |extra: &[&std::ffi::OsStr]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_facegate"))
            .args(["tenant", "list", "--json", "--url", &format!("https://localhost:{}", admin.port())])
            .args(extra)
            .env("FACEGATE_ADMIN_TOKEN", ADMIN_TOKEN)
            .env_remove("FACEGATE_CA_CERT")
            .env_remove("FACEGATE_URL")
            .output()
            .unwrap()
    };
    let trusted = cli(&["--ca-cert".as_ref(), ca.as_os_str()]);
    let out = String::from_utf8_lossy(&trusted.stdout);
    assert!(trusted.status.success(), "{out}{}", String::from_utf8_lossy(&trusted.stderr));
    assert!(serde_json::from_str::<serde_json::Value>(&out).unwrap()["tenants"].is_array(), "{out}");
    let untrusted = cli(&[]);
    let err = String::from_utf8_lossy(&untrusted.stderr);
    assert!(!untrusted.status.success(), "a certificate of an unknown CA is refused");
    assert!(err.contains("certificate"), "the refusal says why: {err}");
}

/// The admin listener over TLS, as the public one: a client offering `h2`
/// and `http/1.1` by ALPN gets h2 and the admin API answers over it; one
/// offering only `http/1.1` gets HTTP/1.1.
fn assert_admin_speaks_h2_when_offered(admin: SocketAddr, root: &CertificateDer<'static>) {
    use http_body_util::{BodyExt, Empty};
    use hyper::{Request, StatusCode, Version};
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let connect = |alpn: &'static [&'static [u8]]| async move {
            let tcp = tokio::net::TcpStream::connect(admin).await.unwrap();
            let connector = tokio_rustls::TlsConnector::from(client_config(root, alpn));
            connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap()
        };
        let http1 = connect(&[b"http/1.1"]).await;
        assert_eq!(http1.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
        let tls = connect(&[b"h2", b"http/1.1"]).await;
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "the admin listener picks h2");
        let (mut sender, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await.unwrap();
        tokio::spawn(connection);
        let tenants = Request::get("https://localhost/admin/v1/tenants")
            .header(hyper::header::AUTHORIZATION, format!("Bearer {ADMIN_TOKEN}"))
            .body(Empty::<bytes::Bytes>::new())
            .unwrap();
        let response = sender.send_request(tenants).await.unwrap();
        assert_eq!((response.status(), response.version()), (StatusCode::OK, Version::HTTP_2));
        let body: serde_json::Value = serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert!(body["tenants"].is_array(), "{body}");
    });
}

#[test]
fn serves_https_with_the_configured_certificate() {
    let response = get_over_tls("/healthz");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("\"status\":\"ok\""), "{response}");
}

/// Clear-text HTTP to the TLS port gets, promptly, a fatal TLS alert (a
/// record of content type 21, level 2) and then the close; no HTTP
/// answer, and no waiting for the handshake timeout.
#[test]
fn clear_text_on_the_tls_port_gets_a_tls_alert_and_the_close() {
    let (addr, _, _) = tls_gateway();
    let mut stream = TcpStream::connect(addr).unwrap();
    // Half the server's handshake timeout: a server that waits fails the test.
    let limit = std::time::Duration::from_millis(facegate::config::DEFAULT_REQUEST_HEAD_TIMEOUT_MS) / 2;
    stream.set_read_timeout(Some(limit)).unwrap();
    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = Vec::new();
    let read = stream.read_to_end(&mut response);
    let closed = match &read {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    };
    assert!(closed, "not closed within {limit:?}: {read:?}, got {response:?}");
    // A TLS alert record: type 21, version 3.x, length 2, level fatal, a description.
    assert!(
        matches!(response.as_slice(), [21, 3, _, 0, 2, 2, _]),
        "expected one fatal TLS alert record, got {response:?} ({:?})",
        String::from_utf8_lossy(&response)
    );
}

/// HTTP/2 over TLS: a client offering `h2` and `http/1.1` by ALPN gets h2
/// and is served over it — `/healthz`, and a tenant's detection with its
/// image in DATA frames; one offering only `http/1.1` gets HTTP/1.1.
#[test]
fn clients_offering_h2_by_alpn_are_served_http2() {
    use http_body_util::{BodyExt, Full};
    use hyper::{Request, StatusCode, Version};
    use hyper_util::rt::{TokioExecutor, TokioIo};

    let (addr, cert, key) = tls_gateway();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let connect = |alpn: &'static [&'static [u8]]| async move {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let connector = tokio_rustls::TlsConnector::from(client_config(cert, alpn));
            connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap()
        };
        let http1 = connect(&[b"http/1.1"]).await;
        assert_eq!(http1.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
        let tls = connect(&[b"h2", b"http/1.1"]).await;
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "the gateway picks h2");

        let (mut sender, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await.unwrap();
        tokio::spawn(connection);
        let health = Request::get("https://localhost/healthz").body(Full::new(bytes::Bytes::new())).unwrap();
        let health = sender.send_request(health).await.unwrap();
        assert_eq!((health.status(), health.version()), (StatusCode::OK, Version::HTTP_2));
        let detect = Request::post("https://localhost/v1/demo/detect")
            .header(hyper::header::AUTHORIZATION, format!("Bearer {key}"))
            .body(Full::new(bytes::Bytes::from(crate::harness::image("grace_hopper.jpg"))))
            .unwrap();
        let response = sender.send_request(detect).await.unwrap();
        assert_eq!((response.status(), response.version()), (StatusCode::OK, Version::HTTP_2));
        let body: serde_json::Value = serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
        assert_eq!(body["faces"].as_array().map(Vec::len), Some(1), "{body}");
    });
}
