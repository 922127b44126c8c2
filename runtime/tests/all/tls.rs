//! HTTPS: a gateway started with `--tls-cert`/`--tls-key` answers over TLS
//! (and not in clear text).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

use crate::harness::{config, seed_dir, start};

/// A TLS gateway with a fresh self-signed certificate for `localhost`.
fn tls_gateway() -> &'static (SocketAddr, CertificateDer<'static>) {
    static GATEWAY: OnceLock<(SocketAddr, CertificateDer<'static>)> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();

        let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert, certified.cert.pem()).unwrap();
        std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
        let mut config = config(dir.join("data"), Some(seed_dir()));
        config.tls_cert = Some(cert);
        config.tls_key = Some(key);
        (start(config), certified.cert.der().clone())
    })
}

fn get_over_tls(path: &str) -> String {
    let (addr, cert) = tls_gateway();
    let mut roots = RootCertStore::empty();
    roots.add(cert.clone()).unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from("localhost").unwrap();
    let conn = ClientConnection::new(Arc::new(client), name).unwrap();
    let mut tls = StreamOwned::new(conn, TcpStream::connect(addr).unwrap());
    write!(tls, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    let _ = tls.read_to_string(&mut response);
    response
}

#[test]
fn serves_https_with_the_configured_certificate() {
    let response = get_over_tls("/healthz");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("\"status\":\"ok\""), "{response}");
}

#[test]
fn clear_text_is_not_answered_on_the_tls_port() {
    let (addr, _) = tls_gateway();
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(std::time::Duration::from_secs(15))).unwrap();
    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    assert!(!String::from_utf8_lossy(&response).contains("200 OK"));
}
