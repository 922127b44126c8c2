//! The control plane's part for tenants' own hostnames ([`Routes`]): the
//! operator routes a hostname to one tenant's handler, in the store, so
//! every node of a cluster routes it; the snapshot ([`super::Live`]) holds
//! them for the data plane ([`super::live::HostRoute`]). A hostname belongs
//! to one tenant; deleting the tenant deletes its hostnames.

use std::net::IpAddr;
use std::sync::Arc;

use super::serving::Serving;
use super::shared::Shared;
use super::store::{RouteRow, StoreError, StoreResult, now};
use crate::sandbox::handler::valid_name;

/// The routed hostnames (see the module docs).
pub struct Routes {
    shared: Arc<Shared>,
    serving: Arc<Serving>,
}

impl Routes {
    pub(super) fn new(shared: Arc<Shared>, serving: Arc<Serving>) -> Self {
        Self { shared, serving }
    }

    /// Routes `hostname` to `tenant`'s `handler` (which need not be
    /// deployed yet), or moves it to another handler of the same tenant.
    /// Refused when the hostname is malformed or belongs to another tenant.
    pub fn add(&self, hostname: &str, tenant: &str, handler: &str) -> StoreResult<RouteRow> {
        let hostname = valid_hostname(hostname).map_err(StoreError::Invalid)?;
        let handler = valid_name(handler).map_err(|e| StoreError::Invalid(e.to_string()))?;
        let row = RouteRow { hostname, tenant: tenant.to_owned(), handler, created_at: now() };
        self.shared.db().add_route(&row)?;
        self.serving.refresh_routes()?;
        tracing::info!(hostname = %row.hostname, tenant, handler = %row.handler, "hostname routed");
        Ok(row)
    }

    /// Every routed hostname, by name.
    pub fn list(&self) -> StoreResult<Vec<RouteRow>> {
        self.shared.db().routes()
    }

    /// Removes `hostname`'s route.
    pub fn remove(&self, hostname: &str) -> StoreResult<()> {
        let hostname = valid_hostname(hostname).map_err(StoreError::Invalid)?;
        self.shared.db().remove_route(&hostname)?;
        self.serving.refresh_routes()?;
        tracing::info!(%hostname, "hostname route removed");
        Ok(())
    }
}

/// A hostname as routes keep it: a DNS name of at least two labels, each
/// 1 to 63 characters of letters, digits and `-` (not at either end), 253
/// characters at most; lowercased, a trailing dot dropped. IP addresses
/// and names with a port are refused.
pub fn valid_hostname(name: &str) -> Result<String, String> {
    let lower = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    let labels: Vec<&str> = lower.split('.').collect();
    let ok = lower.len() <= 253 && labels.len() >= 2 && labels.iter().all(|l| label_ok(l)) && lower.parse::<IpAddr>().is_err();
    // A last label of digits only is an IPv4 address's, not a name's.
    let numeric_tld = labels.last().is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()));
    if ok && !numeric_tld {
        Ok(lower)
    } else {
        Err(format!("{name:?} is not a hostname: two or more labels of a-z, 0-9 and '-' joined by dots, no port (e.g. faces.acme.example)"))
    }
}

/// The hostname a request's `Host` (or `:authority`) names, as routes keep
/// it: lowercase, the port and a trailing dot dropped. `None` for an IP
/// address or a malformed value (which no route matches).
pub fn host_of(authority: &str) -> Option<String> {
    let host = match authority.rsplit_once(':') {
        // `[v6]:port` and `name:port`; an IPv6 literal has more colons.
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) && !host.contains(':') => host,
        Some(_) => return None,
        None => authority,
    };
    valid_hostname(host).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames_are_dns_names_of_two_labels_or_more() {
        assert_eq!(valid_hostname("Faces.ACME.example.").unwrap(), "faces.acme.example");
        assert_eq!(valid_hostname("a-1.b").unwrap(), "a-1.b");
        for bad in ["localhost", "", ".", "a..b", "-a.b", "a-.b", "a_b.c", "1.2.3.4", "a.b:80", "[::1]", "x.123", "ä.example"] {
            assert!(valid_hostname(bad).is_err(), "{bad:?}");
        }
        assert!(valid_hostname(&format!("{}.example", "a".repeat(64))).is_err(), "a label of 64");
        let long = vec!["a".repeat(60); 5].join(".");
        assert!(valid_hostname(&long).is_err(), "254 characters");
    }

    #[test]
    fn a_host_header_is_matched_without_its_port_or_case() {
        assert_eq!(host_of("Faces.Acme.Example:8443").as_deref(), Some("faces.acme.example"));
        assert_eq!(host_of("faces.acme.example.").as_deref(), Some("faces.acme.example"));
        assert_eq!(host_of("faces.acme.example"), Some("faces.acme.example".to_owned()));
        for none in ["127.0.0.1:8080", "[::1]:8080", "localhost:8080", "faces.acme.example:http", "a.b:1:2"] {
            assert_eq!(host_of(none), None, "{none:?}");
        }
    }
}
