//! HTTPS: a gateway started with `--tls-cert`/`--tls-key` answers over TLS
//! (and not in clear text).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};

use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

use crate::harness::{fresh_dir, start, tls_config};

/// A TLS gateway with a fresh self-signed certificate for `localhost`.
fn tls_gateway() -> &'static (SocketAddr, CertificateDer<'static>) {
    static GATEWAY: OnceLock<(SocketAddr, CertificateDer<'static>)> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        let (config, cert) = tls_config(&fresh_dir("tls"));
        (start(config), cert)
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

/// Clear-text HTTP to the TLS port gets, promptly, a fatal TLS alert (a
/// record of content type 21, level 2) and then the close; no HTTP
/// answer, and no waiting for the handshake timeout.
#[test]
fn clear_text_on_the_tls_port_gets_a_tls_alert_and_the_close() {
    let (addr, _) = tls_gateway();
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
