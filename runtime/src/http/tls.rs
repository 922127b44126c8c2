//! HTTPS: a rustls acceptor from PEM files (ring provider, TLS 1.2 and 1.3,
//! ALPN h2 and http/1.1), for the public listener and the admin listener,
//! with tenants' own hostnames' certificates by server name
//! ([`HostCerts`]); and the admin client's connector (the CLI), trusting
//! the system's roots or a private CA.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Builds an acceptor from a certificate chain and a private key, both PEM;
/// with `hosts` (`--tls-host-certs`), a client asking for a name that has
/// files there gets that name's certificate instead (see [`HostCerts`]).
pub fn acceptor((cert, key): (&Path, &Path), hosts: Option<&Path>) -> anyhow::Result<TlsAcceptor> {
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let default = Arc::new(certified_key((cert, key), &provider)?);
    if let Some(dir) = hosts {
        anyhow::ensure!(dir.is_dir(), "--tls-host-certs {}: not a directory", dir.display());
    }
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider)).with_safe_default_protocol_versions()?.with_no_client_auth();
    let resolver = HostCerts { dir: hosts.map(Path::to_owned), default, provider, cache: Mutex::default() };
    let mut config = builder.with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// A certificate chain and its private key from PEM files, checked to match.
fn certified_key((cert, key_file): (&Path, &Path), provider: &CryptoProvider) -> anyhow::Result<CertifiedKey> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("cannot read certificates from {}", cert.display()))?;
    anyhow::ensure!(!chain.is_empty(), "no certificate in {}", cert.display());
    let key = PrivateKeyDer::from_pem_file(key_file).with_context(|| format!("cannot read a private key from {}", key_file.display()))?;
    let signing =
        provider.key_provider.load_private_key(key).with_context(|| format!("{}: not a usable private key", key_file.display()))?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().with_context(|| format!("certificate and key do not match ({}, {})", cert.display(), key_file.display()))?;
    Ok(certified)
}

/// How often a hostname's files are looked at again for a change.
pub const HOST_CERT_RECHECK: Duration = Duration::from_secs(1);

/// The server's certificates by the name a client asks for (SNI): a name
/// with `NAME.crt` and `NAME.key` in the directory gets them, read when
/// first asked for and again once their modification times change (looked
/// at no more than every [`HOST_CERT_RECHECK`]), so a renewed certificate
/// is served without a restart; any other name, or none, gets the default.
/// A pair that cannot be read (half-written, mismatched) keeps the one read
/// before, or the default, and is logged. Only names with files are kept:
/// clients naming random hosts grow nothing.
#[derive(Debug)]
pub struct HostCerts {
    dir: Option<PathBuf>,
    default: Arc<CertifiedKey>,
    provider: Arc<CryptoProvider>,
    cache: Mutex<HashMap<String, HostCert>>,
}

#[derive(Debug)]
struct HostCert {
    key: Arc<CertifiedKey>,
    /// The files' modification times when `key` was read.
    stamp: (SystemTime, SystemTime),
    checked: Instant,
}

impl HostCerts {
    /// The certificate for `name` (lowercase, validated by rustls) from `dir`, if it has one.
    fn for_name(&self, dir: &Path, name: &str) -> Option<Arc<CertifiedKey>> {
        // Only a DNS name maps to a file name: no separators, no dot segments.
        let name = crate::control::valid_hostname(name).ok()?;
        let mut cache = self.cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(cached) = cache.get(&name)
            && cached.checked.elapsed() < HOST_CERT_RECHECK
        {
            return Some(Arc::clone(&cached.key));
        }
        let files = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let Some(stamp) = modified(&files.0).zip(modified(&files.1)) else {
            // Removed: the name gets the default from now on.
            cache.remove(&name);
            return None;
        };
        if let Some(cached) = cache.get_mut(&name)
            && cached.stamp == stamp
        {
            cached.checked = Instant::now();
            return Some(Arc::clone(&cached.key));
        }
        match certified_key((&files.0, &files.1), &self.provider) {
            Ok(key) => {
                tracing::info!(hostname = %name, "hostname certificate loaded");
                let key = Arc::new(key);
                cache.insert(name, HostCert { key: Arc::clone(&key), stamp, checked: Instant::now() });
                Some(key)
            }
            Err(e) => {
                tracing::warn!(hostname = %name, error = %format!("{e:#}"), "hostname certificate not loaded; serving the one before");
                let cached = cache.get_mut(&name)?;
                cached.checked = Instant::now();
                Some(Arc::clone(&cached.key))
            }
        }
    }
}

impl ResolvesServerCert for HostCerts {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let named = self.dir.as_deref().zip(hello.server_name()).and_then(|(dir, name)| self.for_name(dir, name));
        Some(named.unwrap_or_else(|| Arc::clone(&self.default)))
    }
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
