//! A deployed handler version, ready to instantiate: compiled once (at
//! upload, or loaded from its precompiled artifact) and pre-instantiated
//! once; each request instantiates from the pre-instance in its own store,
//! or takes a warm instance of the same version (see [`crate::sandbox::warm`]).

use std::sync::Arc;

use anyhow::bail;
use wasmtime::component::{Component, Linker};
use wasmtime_wasi_http::p2::bindings::ProxyPre;

use crate::sandbox::face_detect::CallProfile;
use crate::sandbox::state::RequestState;
use crate::sandbox::warm::WarmInstances;

/// One active handler version.
pub struct Handler {
    /// Owning tenant.
    pub tenant: Arc<str>,
    /// Handler name (the last path segment of its route).
    pub name: String,
    /// The version being served.
    pub version: i64,
    /// Its component's SHA-256 (hex), compared with the version number when
    /// a snapshot reuses a loaded handler: the code itself must match.
    pub sha256: String,
    /// Whether its outgoing HTTP requests are sent (the tenant's grant) or denied.
    pub outgoing_http: bool,
    /// The pre-instantiated component.
    pub pre: ProxyPre<RequestState>,
    /// Instances of this version kept between requests (tenants with
    /// `instance_reuse` above 1).
    pub warm: WarmInstances,
    /// What its requests usually do around `infer` (for admission's estimate).
    pub profile: Arc<CallProfile>,
    /// The path its guest sees (its version's, chosen at deploy).
    pub guest_path: GuestPath,
}

/// The path a handler's guest sees, chosen per version at deploy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestPath {
    /// The path below the handler's mount, with the query (`/detect?x=1`
    /// for `/v1/acme/faces/detect?x=1`, `/` for the mount itself): what a
    /// component written for `wasmtime serve` expects.
    #[default]
    Relative,
    /// The whole path the client asked for, with the query.
    Full,
}

impl GuestPath {
    /// Its name in the store and the APIs: `relative` or `full`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Relative => "relative",
            Self::Full => "full",
        }
    }

    /// The guest path named `name`, if it is one.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "relative" => Some(Self::Relative),
            "full" => Some(Self::Full),
            _ => None,
        }
    }

    /// A store column's value (a value this version does not know reads as the default).
    pub fn from_column(value: &str) -> Self {
        Self::parse(value).unwrap_or_default()
    }
}

impl Handler {
    /// Links a compiled component: every import must resolve against
    /// `linker` and it must export `wasi:http/incoming-handler`.
    pub fn link(
        linker: &Linker<RequestState>,
        component: &Component,
        tenant: &str,
        name: &str,
        version: i64,
        sha256: &str,
        outgoing_http: bool,
    ) -> Result<Self, String> {
        let pre =
            linker.instantiate_pre(component).map_err(|e| format!("the component's imports do not match what facegate provides: {e:#}"))?;
        let pre = ProxyPre::new(pre).map_err(|e| format!("the component's wasi:http/incoming-handler export does not match: {e:#}"))?;
        Ok(Self {
            tenant: tenant.into(),
            name: name.to_owned(),
            version,
            sha256: sha256.to_owned(),
            outgoing_http,
            pre,
            warm: WarmInstances::default(),
            profile: Arc::default(),
            guest_path: GuestPath::default(),
        })
    }
}

/// Tenant and handler names: 1-63 chars of `[a-z0-9-]`, not starting with `-`.
pub fn valid_name(name: &str) -> anyhow::Result<String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with('-')
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !ok {
        bail!("invalid name {name:?}: use 1-63 characters of a-z, 0-9 and '-'");
    }
    Ok(name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_restricted() {
        assert!(valid_name("demo").is_ok());
        assert!(valid_name("team-7").is_ok());
        for bad in ["", "-x", "Demo", "a/b", "a.b", &"x".repeat(64)] {
            assert!(valid_name(bad).is_err(), "{bad:?} accepted");
        }
    }
}
