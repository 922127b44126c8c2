//! HTTPS: a rustls acceptor from PEM files (ring provider, TLS 1.2 and 1.3,
//! ALPN h2 and http/1.1).

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

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
