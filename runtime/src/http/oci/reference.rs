//! `oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]`: where a component is
//! stored in a registry, as the ecosystem's tools spell it.

use std::fmt;
use std::str::FromStr;

/// The tag a reference without tag or digest means, as every OCI tool reads it.
pub const DEFAULT_TAG: &str = "latest";

/// A component's place in a registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `host[:port]`, as the registry is named (its allowlist entry).
    pub registry: String,
    /// `name/space/repo`, lowercase.
    pub repository: String,
    /// A tag, if given (without a digest, [`DEFAULT_TAG`]).
    pub tag: Option<String>,
    /// `sha256:…` of the manifest, if given: it pins the reference.
    pub digest: Option<String>,
}

impl Reference {
    /// What the manifest is asked for by: the digest if pinned, else the tag.
    pub fn manifest_ref(&self) -> &str {
        self.digest.as_deref().or(self.tag.as_deref()).unwrap_or(DEFAULT_TAG)
    }

    /// The same place pinned to the manifest `digest` (no tag): what a
    /// version records as its source.
    pub fn pinned(&self, digest: &str) -> Reference {
        Reference { registry: self.registry.clone(), repository: self.repository.clone(), tag: None, digest: Some(digest.to_owned()) }
    }

    /// The registry's host without its port (a Docker config key may carry either).
    pub fn host(&self) -> &str {
        host_of(&self.registry)
    }
}

/// `host` of `host[:port]` (an IPv6 literal keeps its brackets).
pub fn host_of(registry: &str) -> &str {
    if registry.starts_with('[') {
        return registry.find(']').map_or(registry, |end| &registry[..=end]);
    }
    registry.rsplit_once(':').map_or(registry, |(host, _)| host)
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "oci://{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

impl FromStr for Reference {
    type Err = String;

    /// Parses `oci://REGISTRY/REPO[:TAG][@sha256:HEX]`; the scheme is required.
    fn from_str(text: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("{text:?} is not an OCI reference (oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]): {why}");
        let rest = text.strip_prefix("oci://").ok_or_else(|| bad("it must start with oci://"))?;
        let (registry, rest) = rest.split_once('/').ok_or_else(|| bad("no repository"))?;
        let registry = crate::config::registry_name(registry).map_err(|_| bad("the registry must be HOST or HOST:PORT"))?;
        let (rest, digest) = match rest.split_once('@') {
            Some((name, digest)) if valid_digest(digest) => (name, Some(digest.to_owned())),
            Some(_) => return Err(bad("the digest must be sha256: and 64 lowercase hex digits")),
            None => (rest, None),
        };
        let (repository, tag) = match rest.rsplit_once(':') {
            Some((name, tag)) if !tag.contains('/') => (name, Some(tag)),
            _ => (rest, None),
        };
        if !valid_repository(repository) {
            return Err(bad("the repository must be lowercase path components (a-z, 0-9, and . _ - between them)"));
        }
        if let Some(tag) = tag
            && !valid_tag(tag)
        {
            return Err(bad("a tag is 1 to 128 of A-Z a-z 0-9 _ . -, not starting with . or -"));
        }
        let tag = tag.map(str::to_owned).or_else(|| digest.is_none().then(|| DEFAULT_TAG.to_owned()));
        Ok(Reference { registry, repository: repository.to_owned(), tag, digest })
    }
}

/// `sha256:` and 64 lowercase hex digits: the only digest accepted (the
/// OCI spec's registered one every registry supports).
pub fn valid_digest(digest: &str) -> bool {
    digest.strip_prefix("sha256:").is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// The distribution spec's repository name: components of `[a-z0-9]+`
/// joined by `.`, `_`, `__` or `-`s, separated by `/`.
fn valid_repository(repository: &str) -> bool {
    repository.len() <= 255
        && repository.split('/').all(|component| {
            let bytes = component.as_bytes();
            let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
            !bytes.is_empty()
                && bytes.first().is_some_and(alnum)
                && bytes.last().is_some_and(alnum)
                && bytes.iter().all(|b| alnum(b) || matches!(b, b'.' | b'_' | b'-'))
                && !component.contains("..")
        })
}

fn valid_tag(tag: &str) -> bool {
    (1..=128).contains(&tag.len())
        && !tag.starts_with(['.', '-'])
        && tag.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn references_parse_as_the_ecosystems_tools_write_them() {
        let r: Reference = "oci://127.0.0.1:5000/acme/faces:v2".parse().unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_deref(), r.digest.as_deref()),
            ("127.0.0.1:5000", "acme/faces", Some("v2"), None)
        );
        assert_eq!(r.manifest_ref(), "v2");
        assert_eq!(r.host(), "127.0.0.1");
        let r: Reference = format!("oci://ghcr.io/acme/faces@{D}").parse().unwrap();
        assert_eq!((r.tag.as_deref(), r.manifest_ref()), (None, D));
        assert_eq!(r.to_string(), format!("oci://ghcr.io/acme/faces@{D}"));
        let r: Reference = "oci://Registry.Example:0443/faces".parse().unwrap();
        assert_eq!(r.registry, "registry.example:443", "one spelling of a registry");
        let r: Reference = "oci://registry.example/faces".parse().unwrap();
        assert_eq!(r.tag.as_deref(), Some("latest"), "no tag means latest");
        let r: Reference = format!("oci://[::1]:5000/faces:v1@{D}").parse().unwrap();
        assert_eq!((r.host(), r.manifest_ref()), ("[::1]", D), "a digest wins over a tag");
        assert_eq!(r.pinned(D).to_string(), format!("oci://[::1]:5000/faces@{D}"));
    }

    #[test]
    fn malformed_references_are_refused_with_the_reason() {
        for (text, why) in [
            ("registry.example/faces:v1", "oci://"),
            ("oci://registry.example", "no repository"),
            ("oci://registry.example/Faces", "lowercase"),
            ("oci://registry.example/faces/../x", "lowercase"),
            ("oci://registry.example/faces:-x", "tag"),
            ("oci://registry.example/faces@sha256:abc", "digest"),
            ("oci://registry.example/faces@md5:0123", "digest"),
            ("oci://user@registry.example/faces", "registry"),
            ("oci://registry.example:0/faces", "registry"),
            ("oci://registry.example:99999/faces", "registry"),
        ] {
            let e = text.parse::<Reference>().unwrap_err();
            assert!(e.contains(why), "{text}: {e}");
        }
    }
}
