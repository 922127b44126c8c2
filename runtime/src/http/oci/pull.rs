//! A deploy that names its component in a registry: the deploy APIs take
//! `{"source": "oci://…", "username": …, "password": …}` (JSON) instead
//! of the component's bytes, and the node pulls it from a registry its
//! operator allows, under the handlers' egress rules, the upload size
//! limit, the node's memory budget and the upload time limit, holding the
//! tenant's upload place like any upload. Credentials in the body serve
//! this pull only (neither stored nor logged); without them, those the
//! tenant keeps for the registry (`control::Registries`) are used.

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::CONTENT_TYPE;
use hyper::{Request, Response, StatusCode};
use serde::Deserialize;

use super::allow::AllowedRegistries;
use super::auth::Credentials;
use super::client::{Egress, OciError, Pulled, Registry};
use super::reference::Reference;
use crate::admission::memory::Charge;
use crate::http::app::App;
use crate::http::response::{self, Body};

/// A deploy body naming a component in a registry. No `Debug`: it holds a password.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PullRequest {
    /// `oci://REGISTRY/REPO[:TAG|@sha256:…]`.
    source: String,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// Whether an upload names a registry's component (a JSON body) rather than carrying one.
pub(in crate::http) fn is_pull(req: &Request<Incoming>) -> bool {
    let content_type = req.headers().get(CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    content_type.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

impl App {
    /// Pulls the component `body` names for `tenant`, its buffers charged
    /// to `memory`; a refusal answers the deploy.
    pub(in crate::http) async fn pull_for_deploy(
        &self,
        tenant: &Arc<str>,
        body: &Bytes,
        memory: &mut Charge,
    ) -> Result<Pulled, Response<Body>> {
        let (reference, credentials) =
            parse_request(body).map_err(|message| response::error(StatusCode::BAD_REQUEST, "bad_pull", message))?;
        let allowed = AllowedRegistries::new(&self.config.oci_registries, &self.config.oci_insecure_registries);
        let plain_http = allowed.check(&reference).map_err(|e| refusal(&e))?;
        let credentials = match credentials {
            Some(given) => Some(given),
            None => self.kept_credentials(tenant, &reference.registry).await?,
        };
        let egress = Egress { rules: Arc::new(self.config.egress_rules()), tenant: Arc::clone(tenant) };
        let mut registry = Registry::new(&reference, plain_http, credentials, Some(egress), false);
        let timeout = self.config.upload_timeout();
        let pulled = tokio::time::timeout(timeout, registry.pull(&reference, self.config.max_component_bytes, Some(memory))).await;
        match pulled {
            Ok(Ok(pulled)) => {
                tracing::info!(tenant = %tenant, source = %pulled.source, bytes = pulled.component.len(), "component pulled");
                Ok(pulled)
            }
            Ok(Err(e)) => {
                tracing::info!(tenant = %tenant, reference = %reference, error = %e, "pull refused");
                Err(refusal(&e))
            }
            Err(_) => {
                tracing::info!(tenant = %tenant, reference = %reference, "pull past the upload time limit");
                let message = format!(
                    "the pull of {reference} did not finish within the upload time limit ({} s, --upload-timeout-secs)",
                    timeout.as_secs()
                );
                Err(response::error(StatusCode::GATEWAY_TIMEOUT, "pull_timeout", message))
            }
        }
    }
}

impl App {
    /// The credentials `tenant` keeps for `registry`, opened on a blocking
    /// thread (the store); a refusal when they do not open.
    async fn kept_credentials(&self, tenant: &Arc<str>, registry: &str) -> Result<Option<Credentials>, Response<Body>> {
        let (control, tenant, registry) = (Arc::clone(&self.control), tenant.to_string(), registry.to_owned());
        let kept = tokio::task::spawn_blocking(move || control.registries.credentials(&tenant, &registry)).await;
        match kept {
            Ok(Ok(kept)) => Ok(kept.map(|(username, password)| Credentials { username, password })),
            Ok(Err(e)) => Err(response::store_error(&e)),
            Err(_) => Err(response::error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error")),
        }
    }
}

/// The reference and credentials of a pull's body.
fn parse_request(body: &[u8]) -> Result<(Reference, Option<Credentials>), String> {
    let request: PullRequest = serde_json::from_slice(body).map_err(|e| {
        format!("a JSON deploy body names the component to pull: {{\"source\": \"oci://REGISTRY/REPO:TAG\"}} (and \"username\", \"password\" for a private registry): {e}")
    })?;
    let reference: Reference = request.source.parse()?;
    let credentials = match (request.username, request.password) {
        (Some(username), Some(password)) => Some(Credentials { username, password }),
        (None, None) => None,
        _ => return Err("\"username\" and \"password\" go together".to_owned()),
    };
    Ok((reference, credentials))
}

/// The deploy's answer to a failed pull.
fn refusal(e: &OciError) -> Response<Body> {
    let (status, code) = match e {
        OciError::Refused(_) => (StatusCode::FORBIDDEN, "registry_not_allowed"),
        OciError::Denied(_) => (StatusCode::FORBIDDEN, "registry_denied"),
        OciError::NotFound(_) => (StatusCode::NOT_FOUND, "not_in_registry"),
        OciError::Invalid(_) => (StatusCode::UNPROCESSABLE_ENTITY, "bad_artifact"),
        OciError::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
        OciError::Unreachable(_) => (StatusCode::BAD_GATEWAY, "registry_unreachable"),
        OciError::NoMemory(_) => return response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "overloaded", &e.to_string(), 1),
    };
    response::error(status, code, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pull_body_names_a_reference_and_credentials_go_in_pairs() {
        let (reference, credentials) = parse_request(br#"{"source": "oci://127.0.0.1:5000/acme/faces:v1"}"#).unwrap();
        assert_eq!((reference.repository.as_str(), credentials), ("acme/faces", None));
        let (_, credentials) = parse_request(br#"{"source": "oci://r.example/a:b", "username": "ci", "password": "p"}"#).unwrap();
        assert_eq!(credentials.unwrap().username, "ci");
        assert!(parse_request(br#"{"source": "oci://r.example/a:b", "username": "ci"}"#).unwrap_err().contains("go together"));
        assert!(parse_request(br#"{"source": "r.example/a:b"}"#).unwrap_err().contains("oci://"));
        assert!(parse_request(b"\0asm").unwrap_err().contains("names the component to pull"));
        assert!(parse_request(br#"{"source": "oci://r.example/a:b", "tag": "x"}"#).is_err(), "unknown fields are refused");
    }
}
