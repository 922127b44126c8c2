//! HTTPS: a rustls acceptor from PEM files (ring provider, TLS 1.2 and 1.3,
//! ALPN h2 and http/1.1), for the public listener and the admin listener;
//! and the admin client's connector (the CLI), trusting the system's roots
//! or a private CA.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Builds an acceptor from a certificate chain and a private key, both PEM.
pub fn acceptor(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("cannot read certificates from {}", cert.display()))?;
    anyhow::ensure!(!chain.is_empty(), "no certificate in {}", cert.display());
    let key = PrivateKeyDer::from_pem_file(key).with_context(|| format!("cannot read a private key from {}", key.display()))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("certificate and key do not match")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// A connector for the admin client: it trusts the certificates in `ca`
/// (PEM: a private CA, or the server's own self-signed certificate) or,
/// without one, the system's roots. Server names are verified either way.
pub fn connector(ca: Option<&Path>) -> anyhow::Result<TlsConnector> {
    let mut roots = RootCertStore::empty();
    match ca {
        Some(ca) => {
            let certs = CertificateDer::pem_file_iter(ca)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .with_context(|| format!("cannot read certificates from {}", ca.display()))?;
            anyhow::ensure!(!certs.is_empty(), "no certificate in {}", ca.display());
            for cert in certs {
                roots.add(cert).with_context(|| format!("{}: not a usable CA certificate", ca.display()))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            // Some unreadable system certificates are not fatal while others load.
            roots.add_parsable_certificates(found.certs);
            anyhow::ensure!(!roots.is_empty(), "no system CA certificates found; pass --ca-cert (FACEGATE_CA_CERT)");
        }
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}
