//! How a node reaches PostgreSQL: the `--store` URL as libpq takes it, and
//! TLS with rustls (ring, as the HTTPS listener).
//!
//! - `sslmode`: `disable`, `prefer`, `require`; libpq's `verify-ca` and
//!   `verify-full` mean `require` here, because every TLS connection
//!   verifies the server's certificate chain and host name — there is no
//!   unverified TLS. Without one, `require` for a server over the network
//!   (`prefer` would let anyone on the path refuse TLS and read the
//!   password), `prefer` for localhost and Unix sockets.
//! - `sslrootcert=<PEM file>`: a CA the server's certificate may chain to
//!   (a private or cloud provider's CA), trusted besides the system's
//!   roots; it implies `require` unless `sslmode=disable`.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use postgres::Config;
use postgres::config::{Host, SslMode};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

/// The connection settings and the TLS connector a `--store` URL asks for.
pub fn connector(url: &str) -> anyhow::Result<(Config, MakeRustlsConnect)> {
    let (url, root_cert) = split_libpq_options(url);
    let mut config: Config = url.parse().map_err(|e| anyhow::anyhow!("bad --store URL: {e}"))?;
    let explicit = url.contains("sslmode=");
    let disabled = matches!(config.get_ssl_mode(), SslMode::Disable);
    if (!explicit && !local_only(&config)) || (root_cert.is_some() && !disabled) {
        config.ssl_mode(SslMode::Require);
    }
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        // A system certificate rustls cannot use is skipped, as by every rustls client.
        let _ = roots.add(cert);
    }
    if let Some(path) = &root_cert {
        for cert in read_certs(Path::new(path))? {
            roots.add(cert).with_context(|| format!("sslrootcert {path}: unusable certificate"))?;
        }
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let tls = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok((config, MakeRustlsConnect::new(tls)))
}

/// Whether every host is this machine (loopback or a Unix socket).
fn local_only(config: &Config) -> bool {
    config.get_hosts().iter().all(|host| match host {
        Host::Tcp(name) => matches!(name.as_str(), "localhost" | "127.0.0.1" | "::1" | "[::1]"),
        #[cfg(unix)]
        Host::Unix(_) => true,
    })
}

/// Takes `sslrootcert` out of the URL's query (tokio-postgres does not know
/// it) and maps `sslmode=verify-ca|verify-full` to `require`.
fn split_libpq_options(url: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else { return (url.to_owned(), None) };
    let mut root_cert = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("sslrootcert", path)) => root_cert = Some(path.replace("%2F", "/").replace("%2f", "/")),
            Some(("sslmode", "verify-ca" | "verify-full")) => kept.push("sslmode=require"),
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    (url, root_cert)
}

fn read_certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("cannot read certificates from sslrootcert {}", path.display()))?;
    anyhow::ensure!(!certs.is_empty(), "no certificate in sslrootcert {}", path.display());
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libpq_options_are_taken_out_or_mapped() {
        let (url, ca) = split_libpq_options("postgres://u:p@db:5432/fg?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x");
        assert_eq!(url, "postgres://u:p@db:5432/fg?sslmode=require&application_name=x");
        assert_eq!(ca.as_deref(), Some("/etc/ca.pem"));
        assert_eq!(split_libpq_options("postgres://db/fg"), ("postgres://db/fg".to_owned(), None));
        assert_eq!(split_libpq_options("postgres://db/fg?sslrootcert=/ca.pem").0, "postgres://db/fg");
    }

    #[test]
    fn tls_is_required_over_the_network_unless_disabled() {
        let mode = |url: &str| connector(url).unwrap().0.get_ssl_mode();
        assert!(matches!(mode("postgres://u@db.internal/fg"), SslMode::Require), "remote: no silent downgrade");
        assert!(matches!(mode("postgres://u@127.0.0.1:5432/fg"), SslMode::Prefer), "loopback keeps the default");
        assert!(matches!(mode("postgres://u@db.internal/fg?sslmode=disable"), SslMode::Disable), "an explicit choice holds");
        assert!(matches!(mode("postgres://u@127.0.0.1/fg?sslmode=prefer"), SslMode::Prefer));
    }

    #[test]
    fn a_missing_root_certificate_file_is_a_clear_error() {
        let error = connector("postgres://db/fg?sslrootcert=/nonexistent/ca.pem").err().unwrap().to_string();
        assert!(error.contains("sslrootcert"), "{error}");
    }
}
