//! A registry client speaking the OCI distribution API over HTTP/1.1: one
//! connection per request (a pull is two or three), authentication by the
//! registry's challenge, redirects followed with each hop checked, bodies
//! read under a size limit and charged to the node's memory as they grow.
//! On a node every connection (registry, token service, redirect target)
//! first passes the handlers' egress rules; the CLI connects anywhere.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST, LOCATION, USER_AGENT, WWW_AUTHENTICATE};
use hyper::{Method, Request, Response, StatusCode, Uri};

use super::artifact::{self, DOCKER_MANIFEST, MAX_MANIFEST_BYTES, OCI_MANIFEST, digest_of};
use super::auth::{Challenge, Credentials, parse_challenge};
use super::reference::Reference;
use crate::admission::memory::{Charge, REQUEST_BASE_BYTES};
use crate::http::body::{BodyError, collect_charged, declared_length};
use crate::http::client::{Options, send_with};
use crate::sandbox::outgoing::{EgressRules, allowed_addresses};

/// Redirects (and authentication retries) one request follows at most.
const MAX_HOPS: usize = 5;
/// The most of an error answer read for its message.
const MAX_ERROR_BYTES: usize = 4 << 10;
/// The most a token service's answer may take.
const MAX_TOKEN_BYTES: usize = 64 << 10;

/// Why a registry operation failed; each maps to one status of the deploy API.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// This node may not go there (allowlist, egress rules, plain HTTP): 403.
    #[error("{0}")]
    Refused(String),
    /// The registry refused the credentials, or asked for some: 403.
    #[error("{0}")]
    Denied(String),
    /// No such repository, tag, manifest or blob: 404.
    #[error("{0}")]
    NotFound(String),
    /// The artifact is not a component, or does not match its digest: 422.
    #[error("{0}")]
    Invalid(String),
    /// The component is larger than an upload may be: 413.
    #[error("{0}")]
    TooLarge(String),
    /// The node's memory budget refused the download's buffer: 503.
    #[error("{0}")]
    NoMemory(String),
    /// The registry could not be reached or answered wrongly: 502.
    #[error("{0}")]
    Unreachable(String),
}

/// Where a node's registry connections may go: the handlers' egress rules,
/// with name lookups charged to the tenant the pull is for.
#[derive(Debug, Clone)]
pub struct Egress {
    /// The rules.
    pub rules: Arc<EgressRules>,
    /// The tenant the pull is for.
    pub tenant: Arc<str>,
}

/// A component pulled from a registry.
#[derive(Debug)]
pub struct Pulled {
    /// The layer's bytes, checked against its digest.
    pub component: Bytes,
    /// The reference pinned to the manifest's digest: `oci://REG/REPO@sha256:…`.
    pub source: String,
}

/// One repository of one registry, and the authorization it has earned.
pub struct Registry {
    /// As the reference names it (messages, the allowlist).
    registry: String,
    /// Where its API is: the registry, or Docker Hub's API host for `docker.io`.
    api_host: String,
    repository: String,
    https: bool,
    credentials: Option<Credentials>,
    egress: Option<Egress>,
    /// What a token is asked for: `pull`, or `pull,push`.
    actions: &'static str,
    authorization: Option<String>,
}

impl Registry {
    /// A client for `reference`'s repository, over HTTPS unless `plain_http`,
    /// for pulls only or pulls and pushes (`push`); on a node, `egress`.
    pub fn new(reference: &Reference, plain_http: bool, credentials: Option<Credentials>, egress: Option<Egress>, push: bool) -> Self {
        Self {
            registry: reference.registry.clone(),
            api_host: api_host(&reference.registry).to_owned(),
            repository: reference.repository.clone(),
            https: !plain_http,
            credentials,
            egress,
            actions: if push { "pull,push" } else { "pull" },
            authorization: None,
        }
    }

    /// `scheme://host[:port]` of the registry's API: the only origin its
    /// credentials go to.
    fn origin(&self) -> String {
        format!("{}://{}", if self.https { "https" } else { "http" }, self.api_host)
    }

    /// Pulls the component `reference` names: its manifest (by tag or
    /// digest; a pinned digest must match the manifest's bytes), then its
    /// one `application/wasm` layer, refused past `max_bytes` before it is
    /// fetched (by its declared size) and while it arrives (by its bytes),
    /// and checked against its digest and size. Buffers are charged to `memory`.
    pub async fn pull(&mut self, reference: &Reference, max_bytes: usize, mut memory: Option<&mut Charge>) -> Result<Pulled, OciError> {
        let path = format!("/v2/{}/manifests/{}", self.repository, reference.manifest_ref());
        let accept = format!("{OCI_MANIFEST}, {DOCKER_MANIFEST}");
        let response = self.send(Method::GET, &path, &[(ACCEPT, &accept)], Bytes::new()).await?;
        let response = expect(response, &format!("the manifest of {reference}")).await?;
        let manifest = read_limited(response, MAX_MANIFEST_BYTES, memory.as_deref_mut(), "the manifest").await?;
        let digest = digest_of(&manifest);
        if let Some(pinned) = &reference.digest
            && *pinned != digest
        {
            return Err(OciError::Invalid(format!("the registry's manifest has digest {digest}, not the {pinned} the reference pins")));
        }
        let layer = artifact::component_layer(&manifest).map_err(OciError::Invalid)?;
        drop(manifest);
        if layer.size > max_bytes as u64 {
            let message = format!("the component is {} bytes, over the {max_bytes} an upload may carry", layer.size);
            return Err(OciError::TooLarge(message));
        }
        let path = format!("/v2/{}/blobs/{}", self.repository, layer.digest);
        let response = self.send(Method::GET, &path, &[], Bytes::new()).await?;
        let response = expect(response, &format!("the layer {}", layer.digest)).await?;
        // Never more than the manifest declared: a registry sending more is refused at that point.
        let component = read_limited(response, layer.size as usize, memory, "the component").await?;
        if component.len() as u64 != layer.size {
            return Err(OciError::Invalid(format!("the layer is {} bytes, its manifest says {}", component.len(), layer.size)));
        }
        let actual = digest_of(&component);
        if actual != layer.digest {
            return Err(OciError::Invalid(format!("the layer's bytes have digest {actual}, not the {} its manifest names", layer.digest)));
        }
        Ok(Pulled { component, source: reference.pinned(&digest).to_string() })
    }

    /// Pushes `component` as the wasm artifact under `tag` (its layer named
    /// `title`); returns the manifest's digest. Blobs the registry has are not sent again.
    pub async fn push(&mut self, tag: &str, component: Bytes, title: &str) -> Result<String, OciError> {
        let packed = artifact::pack(&component, title, artifact::created_rfc3339());
        let config_digest = digest_of(&packed.config);
        self.push_blob(Bytes::from(packed.config), &config_digest).await?;
        self.push_blob(component, &packed.layer.digest).await?;
        let manifest = Bytes::from(packed.manifest);
        let path = format!("/v2/{}/manifests/{tag}", self.repository);
        let response = self.send(Method::PUT, &path, &[(CONTENT_TYPE, OCI_MANIFEST)], manifest.clone()).await?;
        expect(response, "the manifest's push").await?;
        Ok(digest_of(&manifest))
    }

    /// Uploads one blob (monolithic: `POST` for a session, one `PUT` with its digest).
    async fn push_blob(&mut self, bytes: Bytes, digest: &str) -> Result<(), OciError> {
        let path = format!("/v2/{}/blobs/{digest}", self.repository);
        let head = self.send(Method::HEAD, &path, &[], Bytes::new()).await?;
        match head.status() {
            StatusCode::OK => return Ok(()),
            StatusCode::NOT_FOUND => {}
            // Refused credentials end the push here, with the registry's answer.
            _ => drop(expect(head, &format!("the blob {digest}")).await?),
        }
        let path = format!("/v2/{}/blobs/uploads/", self.repository);
        let started = expect(self.send(Method::POST, &path, &[], Bytes::new()).await?, "a blob upload").await?;
        let location = started
            .headers()
            .get(LOCATION)
            .and_then(|l| l.to_str().ok())
            .ok_or_else(|| OciError::Unreachable("the registry started a blob upload without a Location".into()))?;
        // Checked like a redirect: credentials never go to it over plain HTTP.
        let location = self.follow(&self.origin(), location)?;
        let separator = if location.contains('?') { '&' } else { '?' };
        let target = format!("{location}{separator}digest={digest}");
        let octets = [(CONTENT_TYPE, "application/octet-stream")];
        expect(self.send(Method::PUT, &target, &octets, bytes).await?, &format!("the blob {digest}")).await?;
        Ok(())
    }

    /// Sends a request to `target` (a path on the registry, or a URL the
    /// registry gave), authenticating once when challenged and following
    /// redirects of `GET` and `HEAD`; the registry's authorization goes to
    /// the registry only, never to a redirect's other host.
    async fn send(
        &mut self,
        method: Method,
        target: &str,
        headers: &[(hyper::header::HeaderName, &str)],
        body: Bytes,
    ) -> Result<Response<Incoming>, OciError> {
        let mut url = resolve(&self.origin(), target)?;
        let mut authenticated = false;
        for _ in 0..=MAX_HOPS {
            let own = origin_of(&url) == self.origin();
            let authorization = if own { self.authorization.clone() } else { None };
            let response = self.exchange(&method, &url, headers, body.clone(), authorization.as_deref()).await?;
            let status = response.status();
            if status == StatusCode::UNAUTHORIZED && own && !authenticated {
                let challenge = response.headers().get(WWW_AUTHENTICATE).and_then(|h| h.to_str().ok()).and_then(parse_challenge);
                self.authenticate(challenge).await?;
                authenticated = true;
                continue;
            }
            if status.is_redirection() && matches!(method, Method::GET | Method::HEAD) {
                let location = response.headers().get(LOCATION).and_then(|l| l.to_str().ok()).unwrap_or("");
                url = self.follow(&url, location)?;
                continue;
            }
            return Ok(response);
        }
        Err(OciError::Unreachable(format!("{} redirected or challenged more than {MAX_HOPS} times", self.registry)))
    }

    /// Where a location the registry gave from `from` (a redirect, a blob
    /// upload's session) goes: HTTPS anywhere the egress rules allow, plain
    /// HTTP only on a plain-HTTP registry itself.
    fn follow(&self, from: &str, location: &str) -> Result<String, OciError> {
        let url = resolve(from, location)?;
        if url.starts_with("http://") && origin_of(&url) != self.origin() {
            return Err(OciError::Refused(format!("{} sent us to plain HTTP ({url}); only HTTPS is followed", self.registry)));
        }
        Ok(url)
    }

    /// Earns an authorization by `challenge`: Basic sends the credentials;
    /// Bearer trades them (or nothing, for anonymous pulls) for a token.
    async fn authenticate(&mut self, challenge: Option<Challenge>) -> Result<(), OciError> {
        let (registry, credentials) = (&self.registry, self.credentials.as_ref());
        let basic = credentials.map(Credentials::basic);
        match challenge {
            Some(Challenge::Basic) => {
                let Some(basic) = basic else {
                    return Err(OciError::Denied(format!("the registry {registry} asks for credentials and none were given")));
                };
                self.authorization = Some(basic);
            }
            Some(Challenge::Bearer { realm, service, scope }) => {
                let token = self.token(&realm, service, scope, basic.as_deref()).await?;
                self.authorization = Some(format!("Bearer {token}"));
            }
            None => return Err(OciError::Denied(format!("the registry {registry} refused the request (401) without a challenge we know"))),
        }
        Ok(())
    }

    /// A token from the token service at `realm` for this repository.
    async fn token(&self, realm: &str, service: Option<String>, scope: Option<String>, basic: Option<&str>) -> Result<String, OciError> {
        let scheme = realm.parse::<Uri>().ok().and_then(|u| u.scheme_str().map(str::to_ascii_lowercase));
        match scheme.as_deref() {
            Some("https") => {}
            Some("http") if !self.https => {}
            _ => {
                return Err(OciError::Refused(format!("the registry {} names a token service that is not HTTPS ({realm})", self.registry)));
            }
        }
        let scope = scope.unwrap_or_else(|| format!("repository:{}:{}", self.repository, self.actions));
        let query = {
            let mut query = form_urlencoded::Serializer::new(String::new());
            query.extend_pairs(service.iter().map(|s| ("service", s.as_str())));
            query.append_pair("scope", &scope);
            query.finish()
        };
        let separator = if realm.contains('?') { '&' } else { '?' };
        let url = format!("{realm}{separator}{query}");
        let response = self.exchange(&Method::GET, &url, &[], Bytes::new(), basic).await?;
        if matches!(response.status(), StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) {
            return Err(OciError::Denied(format!(
                "the token service of {} refused the credentials ({})",
                self.registry,
                response.status()
            )));
        }
        let response = expect(response, "a token").await?;
        let body = read_limited(response, MAX_TOKEN_BYTES, None, "the token").await?;
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let token = value["token"].as_str().or_else(|| value["access_token"].as_str());
        token.map(str::to_owned).ok_or_else(|| OciError::Unreachable(format!("the token service of {} answered no token", self.registry)))
    }

    /// One request on a connection of its own; on a node, only to addresses the egress rules allow.
    async fn exchange(
        &self,
        method: &Method,
        url: &str,
        headers: &[(hyper::header::HeaderName, &str)],
        body: Bytes,
        authorization: Option<&str>,
    ) -> Result<Response<Incoming>, OciError> {
        let uri: Uri = url.parse().map_err(|_| OciError::Unreachable(format!("the registry gave a malformed URL {url:?}")))?;
        let authority = uri.authority().map(|a| a.as_str().to_owned()).unwrap_or_default();
        let addresses = self.addresses(&uri).await?;
        let mut request = Request::builder()
            .method(method.clone())
            .uri(uri.path_and_query().map_or("/", |p| p.as_str()))
            .header(HOST, &authority)
            .header(USER_AGENT, concat!("facegate/", env!("CARGO_PKG_VERSION")));
        for (name, value) in headers {
            request = request.header(name, *value);
        }
        if let Some(authorization) = authorization {
            request = request.header(AUTHORIZATION, authorization);
        }
        let request = request.body(Full::new(body)).map_err(|e| OciError::Unreachable(format!("cannot build a request to {url}: {e}")))?;
        let options = Options { addresses: addresses.as_deref(), ..Options::default() };
        send_with(&uri, request, options).await.map_err(|e| OciError::Unreachable(format!("cannot reach {authority}: {e:#}")))
    }

    /// The addresses `uri`'s host may be reached at on a node (`None`: the
    /// CLI's, resolved as usual).
    async fn addresses(&self, uri: &Uri) -> Result<Option<Vec<SocketAddr>>, OciError> {
        let Some(egress) = &self.egress else { return Ok(None) };
        let host = uri.host().unwrap_or("");
        let port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("http") { 80 } else { 443 });
        let allowed = allowed_addresses(host, port, &egress.rules, &egress.tenant).await.map_err(OciError::Refused)?;
        Ok(Some(allowed))
    }
}

/// `target` against `base`: a URL as it is (its scheme lowercased), a
/// scheme-relative `//host/…` on `base`'s scheme, a path on `base`'s origin.
fn resolve(base: &str, target: &str) -> Result<String, OciError> {
    for scheme in ["https://", "http://"] {
        if target.len() >= scheme.len() && target[..scheme.len()].eq_ignore_ascii_case(scheme) {
            return Ok(format!("{scheme}{}", &target[scheme.len()..]));
        }
    }
    let base_scheme = if base.starts_with("https://") { "https:" } else { "http:" };
    if let Some(rest) = target.strip_prefix("//") {
        return Ok(format!("{base_scheme}//{rest}"));
    }
    if !target.starts_with('/') {
        return Err(OciError::Unreachable(format!("the registry gave a location we cannot follow: {target:?}")));
    }
    Ok(format!("{}{target}", origin_of(base)))
}

/// `scheme://host[:port]` of a URL made by [`resolve`], lowercased.
fn origin_of(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    format!("{scheme}://{authority}").to_ascii_lowercase()
}

/// Where `registry`'s API is: Docker Hub's for `docker.io` (as `docker`
/// and `oras` resolve it), the registry itself otherwise.
fn api_host(registry: &str) -> &str {
    if registry == "docker.io" { "registry-1.docker.io" } else { registry }
}

/// `response` if it succeeded; else the error its status means, with the
/// registry's own message (its first `errors[]` entry) when it sent one.
async fn expect(response: Response<Incoming>, what: &str) -> Result<Response<Incoming>, OciError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let body = read_limited(response, MAX_ERROR_BYTES, None, "an error").await.unwrap_or_default();
    let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let said = match (value["errors"][0]["code"].as_str(), value["errors"][0]["message"].as_str()) {
        (Some(code), Some(message)) => format!(": {code}: {message}"),
        _ if !body.is_empty() && value.is_null() => format!(": {}", String::from_utf8_lossy(&body[..body.len().min(200)]).trim()),
        _ => String::new(),
    };
    let message = format!("{what}: the registry answered {status}{said}");
    Err(match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => OciError::Denied(message),
        StatusCode::NOT_FOUND => OciError::NotFound(message),
        _ => OciError::Unreachable(message),
    })
}

/// `response`'s body, at most `limit` bytes (a longer one is refused as it
/// arrives, never held whole), its buffer charged to `memory` before it is
/// made (the declared length) and as it grows.
async fn read_limited(response: Response<Incoming>, limit: usize, mut memory: Option<&mut Charge>, what: &str) -> Result<Bytes, OciError> {
    let declared = declared_length(response.headers()).unwrap_or(0);
    if declared > limit as u64 {
        return Err(OciError::TooLarge(format!("{what} is {declared} bytes, over its bound of {limit}")));
    }
    if let Some(memory) = memory.as_deref_mut() {
        memory.resize((declared as usize).saturating_add(REQUEST_BASE_BYTES)).map_err(|refusal| OciError::NoMemory(refusal.to_string()))?;
    }
    collect_charged(response.into_body(), limit, declared as usize, memory).await.map_err(|e| match e {
        BodyError::TooLarge => OciError::TooLarge(format!("{what} runs past its bound of {limit} bytes")),
        BodyError::Unreadable => OciError::Unreachable(format!("{what} could not be read to its end")),
        BodyError::NoMemory(refusal) => OciError::NoMemory(refusal.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_resolve_against_the_registry_and_hosts_are_told_apart() {
        assert_eq!(
            resolve("http://127.0.0.1:5000/v2/x", "/v2/x/blobs/uploads/1?_state=a").unwrap(),
            "http://127.0.0.1:5000/v2/x/blobs/uploads/1?_state=a"
        );
        assert_eq!(resolve("https://r.example", "/v2/").unwrap(), "https://r.example/v2/");
        assert_eq!(resolve("https://r.example/v2/", "https://cdn.example/b?sig=1").unwrap(), "https://cdn.example/b?sig=1");
        assert!(resolve("https://r.example/", "relative/path").is_err());
        assert_eq!(resolve("https://r.example/v2/", "//cdn.example/b").unwrap(), "https://cdn.example/b");
        assert_eq!(resolve("https://r.example/v2/", "HTTP://r.example/x").unwrap(), "http://r.example/x");
        assert_eq!(origin_of("https://CDN.example/b?sig=1"), "https://cdn.example");
        assert_eq!(origin_of("http://127.0.0.1:5000?x"), "http://127.0.0.1:5000");
        assert_eq!(api_host("docker.io"), "registry-1.docker.io");
    }

    #[test]
    fn redirects_to_plain_http_are_refused_off_a_plain_http_registry() {
        let reference: Reference = "oci://r.example/faces:v1".parse().unwrap();
        let https = Registry::new(&reference, false, None, None, false);
        assert!(https.follow("https://r.example/v2/", "https://cdn.example/blob").is_ok());
        assert!(matches!(https.follow("https://r.example/v2/", "http://cdn.example/blob"), Err(OciError::Refused(_))));
        // A blob upload's session on the registry's own host, but over plain HTTP (a TLS proxy's mistake).
        assert!(matches!(https.follow("https://r.example/v2/", "HTTP://r.example/v2/uploads/1"), Err(OciError::Refused(_))));
        let plain = Registry::new(&reference, true, None, None, false);
        assert!(plain.follow("http://r.example/v2/", "/v2/other").is_ok(), "the plain-HTTP registry itself");
        assert!(matches!(plain.follow("http://r.example/v2/", "http://elsewhere.example/"), Err(OciError::Refused(_))));
    }
}
