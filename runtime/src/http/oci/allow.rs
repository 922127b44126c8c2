//! The registries a node pulls handlers from (`--oci-registry`,
//! `--oci-insecure-registry`): none unless the operator names them.

use super::client::OciError;
use super::reference::Reference;

/// The operator's allowlist of registries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedRegistries {
    /// `(HOST[:PORT], plain HTTP)`, lowercase.
    entries: Vec<(String, bool)>,
}

impl AllowedRegistries {
    /// Those of `secure` (over HTTPS) and `insecure` (over plain HTTP),
    /// named canonically (`config::registry_name`); one named in both is
    /// reached over HTTPS (the configuration check refuses it at start).
    pub fn new(secure: &[String], insecure: &[String]) -> Self {
        let entries = secure.iter().map(|r| (r.clone(), false));
        let entries = entries.chain(insecure.iter().map(|r| (r.clone(), true))).collect();
        Self { entries }
    }

    /// Whether `reference`'s registry may be pulled from, and over plain
    /// HTTP (`true`) or HTTPS; a clear refusal if not.
    pub fn check(&self, reference: &Reference) -> Result<bool, OciError> {
        let registry = &reference.registry;
        if let Some((_, plain_http)) = self.entries.iter().find(|(allowed, _)| allowed == registry) {
            return Ok(*plain_http);
        }
        let message = if self.entries.is_empty() {
            format!("this gateway pulls from no registry; its operator allows one with --oci-registry {registry}")
        } else {
            let names: Vec<&str> = self.entries.iter().map(|(r, _)| r.as_str()).collect();
            format!("the registry {registry} is not one this gateway pulls from ({}); see --oci-registry", names.join(", "))
        };
        Err(OciError::Refused(message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_named_registries_are_pulled_from_plain_http_only_where_said() {
        let allowed = AllowedRegistries::new(&["ghcr.io".into()], &["registry.internal:5000".into()]);
        let at = |text: &str| allowed.check(&text.parse().unwrap());
        assert!(!at("oci://ghcr.io/acme/faces:v1").unwrap(), "over HTTPS");
        assert!(at("oci://registry.internal:5000/faces:v1").unwrap(), "over plain HTTP");
        let refused = at("oci://ghcr.io:8443/acme/faces:v1").unwrap_err().to_string();
        assert!(refused.contains("not one this gateway pulls from") && refused.contains("ghcr.io"), "{refused}");
        let none = AllowedRegistries::default().check(&"oci://ghcr.io/a:b".parse().unwrap()).unwrap_err().to_string();
        assert!(none.contains("--oci-registry ghcr.io"), "{none}");
    }
}
