//! The tenant API under `/tenant/v1/`: a tenant manages its own handlers
//! and keys with a scoped API key, as the operator does through the admin
//! API, with the same validation, limits, compile pool and answers. The
//! key's tenant is the only one it reaches: a handler of another tenant is
//! not even nameable here, so it is the same 404 as a missing one.
//!
//! | route | scope |
//! |---|---|
//! | `GET handlers`, `GET handlers/{h}/versions` | `read` or `deploy` |
//! | `PUT handlers/{h}` (`?canary=P`), `POST handlers/{h}/activate`, `…/rollback`, `…/promote`, `…/abort` | `deploy` |
//! | `GET keys`, `POST keys` (an `invoke` key), `DELETE keys/{id}` (an `invoke` key) | `deploy` |
//! | `GET usage`, `GET logs` (every live node's records) | `read` |
//! | `GET config`, `GET kv…` (the state: buckets, keys, values) | `read` or `deploy` |
//! | `PUT`/`DELETE config/{name}`, `PUT`/`DELETE kv/{bucket}[/{key}]` | `deploy` |
//!
//! A missing, wrong or revoked key is 401 (slowed like a wrong admin
//! token); a key without the route's scope is 403. A tenant's calls past
//! its `api_rps` on this node are 429 `api_rate_limited`.

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;

use super::admin::{Activate, AdminResult, Held, RegistryLogin, StoreCall, change_of, created, key_scopes, ok, parse, settings_op};
use super::app::{App, REQUEST_ID_HEADER};
use super::auth::bearer;
use super::response::{self, Body};
use crate::admission::limits::Limit;
use crate::control::keys::Scopes;
use crate::control::store::StoreError;
use crate::control::{Change, ControlPlane};

/// Largest body of a tenant's call that uploads nothing (JSON of a few fields).
const SMALL_BODY_BYTES: usize = 64 << 10;

/// What a route needs of the key: any one of these scopes.
fn required(method: &Method, rest: &[&str]) -> Option<Scopes> {
    let manage = Scopes::DEPLOY;
    let look = Scopes::DEPLOY.with(Scopes::READ);
    Some(match (method, rest) {
        (&Method::GET, ["handlers"] | ["handlers", _, "versions"] | ["routes"] | ["registries"] | ["config"]) => look,
        (&Method::PUT | &Method::DELETE, ["config", _]) => manage,
        (&Method::GET, ["kv", ..]) => look,
        (&Method::PUT | &Method::DELETE, ["kv", _, ..]) => manage,
        (&Method::PUT | &Method::DELETE, ["registries", _]) => manage,
        (&Method::PUT, ["handlers", _]) | (&Method::POST, ["handlers", _, "activate" | "rollback" | "promote" | "abort"]) => manage,
        (&Method::GET | &Method::POST, ["keys"]) | (&Method::DELETE, ["keys", _]) => manage,
        (&Method::GET, ["usage" | "logs"]) => Scopes::READ,
        _ => return None,
    })
}

impl App {
    /// Serves one tenant API request (`rest` is the path after `/tenant/v1/`).
    pub(super) async fn tenant_api(&self, rest: &[&str], req: Request<Incoming>) -> Response<Body> {
        let live = self.control.serving.live();
        let found = live.authenticate(bearer(&req)).map(|(tenant, scopes)| (tenant.to_owned(), scopes));
        let Some((tenant, scopes)) = found else {
            let mut refusal = response::error(StatusCode::UNAUTHORIZED, "unauthorized", "missing, invalid or revoked API key");
            refusal.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
            return self.token_failures.slowed("tenant", &req, response::before_body(refusal)).await;
        };
        // Every call a key makes counts, refused or not: what a flood of
        // them costs this node (and, for log reads, every node) is bounded.
        if let Some(Err(wait)) = live.tenants.get(&tenant).map(|entry| entry.gate.api.try_take()) {
            return self.api_rate_limited(&tenant, wait);
        }
        drop(live);
        let method = req.method().clone();
        let Some(needed) = required(&method, rest) else {
            let path = format!("/tenant/v1/{}", rest.join("/"));
            return response::before_body(response::error(StatusCode::NOT_FOUND, "not_found", format!("no route {method} {path}")));
        };
        if !scopes.any(needed) {
            let names = needed.names().join(" or ");
            let message = format!("this key ({scopes}) lacks the {names} scope this call needs");
            return response::before_body(response::error(StatusCode::FORBIDDEN, "forbidden", message));
        }
        if rest == ["usage"] {
            return self.usage_report(&req, Some(&tenant)).await;
        }
        if rest == ["logs"] {
            return self.tenant_logs(&req, &tenant).await;
        }
        if rest.first() == Some(&"kv") {
            return self.kv_api(&tenant, rest, req).await;
        }
        let query = req.uri().query().unwrap_or("").to_owned();
        let path: Vec<String> = rest.iter().map(|s| (*s).to_owned()).collect();
        let change = change_of(&method, rest);
        let max_body = if change == Some(Change::Upload) { self.config.max_component_bytes } else { SMALL_BODY_BYTES };
        let owner = tenant.clone();
        let call = StoreCall { tenant: Some(&owner), change };
        // Named in the answer and in this node's log line about a failure.
        let request_id = self.request_ids.next();
        let id = Arc::clone(&request_id);
        let op = move |control: &ControlPlane, body: &bytes::Bytes, held: Held| {
            tenant_op(control, &tenant, (&method, &path, &query), body, held).map_err(|e| for_tenant(e, &tenant, &id))
        };
        with_request_id(self.store_op(req, (call, max_body), op).await, &request_id)
    }

    /// The answer to a tenant whose tenant-API bucket on this node is empty
    /// for another `wait`; counted as a limit hit.
    fn api_rate_limited(&self, tenant: &str, wait: std::time::Duration) -> Response<Body> {
        self.hits().hit(tenant, Limit::ApiRate);
        let message = "the tenant's calls to the tenant API on this node are past its api_rps";
        response::before_body(response::retry_after_wait(StatusCode::TOO_MANY_REQUESTS, "api_rate_limited", message, wait))
    }
}

/// What a tenant sees of a store error: an internal one (a database's
/// message, a file path, a host name) becomes a generic 500 naming
/// `request_id`, and an unavailable store a generic 503, their detail
/// logged on this node with the id; the others describe the tenant's own
/// request and pass as they are.
pub(super) fn for_tenant(e: StoreError, tenant: &str, request_id: &str) -> StoreError {
    match e {
        StoreError::Internal(err) => {
            tracing::error!(tenant, request_id, error = %format!("{err:#}"), "tenant API call failed");
            StoreError::Internal(anyhow::anyhow!("internal error; the operator's log has it under request id {request_id}"))
        }
        StoreError::Unavailable(detail) => {
            tracing::warn!(tenant, request_id, error = %detail, "tenant API call: store unavailable");
            StoreError::Unavailable(format!("the store is unavailable; retry (request id {request_id})"))
        }
        other => other,
    }
}

/// `response` with the `x-request-id` header.
pub(super) fn with_request_id(mut response: Response<Body>, request_id: &str) -> Response<Body> {
    if let Ok(value) = hyper::header::HeaderValue::from_str(request_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

/// One tenant API operation of `tenant` (its key's scope already checked).
fn tenant_op(
    control: &ControlPlane,
    tenant: &str,
    (method, path, query): (&Method, &[String], &str),
    body: &bytes::Bytes,
    held: Held,
) -> AdminResult {
    let p: Vec<&str> = path.iter().map(String::as_str).collect();
    let t = tenant;
    match (method.clone(), p.as_slice()) {
        (Method::GET, ["handlers"]) => ok(json!({ "tenant": t, "handlers": control.tenants.get(t)?.handlers })),
        (Method::PUT, ["handlers", h]) => created(control.releases.release(t, h, body.clone(), held.releasing(query)?, held.upload()?)?),
        (Method::GET, ["handlers", h, "versions"]) => ok(control.releases.versions(t, h)?),
        (Method::POST, ["handlers", h, "activate"]) => {
            let req: Activate = parse(body)?;
            ok(control.releases.activate(t, h, req.version)?)
        }
        (Method::POST, ["handlers", h, "rollback"]) => ok(control.releases.rollback(t, h)?),
        (Method::POST, ["handlers", h, "promote"]) => ok(control.releases.promote(t, h)?),
        (Method::POST, ["handlers", h, "abort"]) => ok(json!({ "aborted": control.releases.abort_canary(t, h, None)? })),
        (Method::GET, ["keys"]) => ok(json!({ "tenant": t, "keys": control.tenants.keys(t)? })),
        (_, ["config", ..]) => settings_op(control, t, (method, p.as_slice(), query), body),
        (Method::GET, ["registries"]) => ok(json!({ "tenant": t, "registries": control.registries.list(t)? })),
        (Method::PUT, ["registries", registry]) => {
            let login: RegistryLogin = parse(body)?;
            ok(control.registries.login(t, registry, &login.username, &login.password)?)
        }
        (Method::DELETE, ["registries", registry]) => {
            control.registries.logout(t, registry)?;
            ok(json!({ "tenant": t, "forgotten": registry }))
        }
        (Method::GET, ["routes"]) => {
            let own: Vec<_> = control.routes.list()?.into_iter().filter(|r| r.tenant == t).collect();
            ok(json!({ "tenant": t, "routes": own }))
        }
        (Method::POST, ["keys"]) => {
            if key_scopes(body)? != Scopes::INVOKE {
                return Err(StoreError::Forbidden("a tenant's deploy key creates invoke keys only; ask the operator for others".into()));
            }
            created(control.tenants.create_key(t, Scopes::INVOKE)?)
        }
        (Method::DELETE, ["keys", id]) => {
            // A key's scopes never change: the store's row says what this one is.
            let key = control.tenants.keys(t)?.into_iter().find(|k| k.id == *id && k.revoked_at.is_none());
            if let Some(key) = key.filter(|k| k.scopes != Scopes::INVOKE) {
                let scopes = key.scopes;
                return Err(StoreError::Forbidden(format!("key {id:?} is a {scopes} key; a tenant's deploy key revokes invoke keys only")));
            }
            control.tenants.revoke_key(t, id)?;
            ok(json!({ "tenant": t, "revoked": id }))
        }
        _ => Err(StoreError::NotFound(format!("no tenant route {method} /tenant/v1/{}", path.join("/")))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_route_names_the_scopes_it_takes() {
        let get = |path: &[&str]| required(&Method::GET, path);
        assert_eq!(get(&["handlers"]), Some(Scopes::DEPLOY.with(Scopes::READ)));
        assert_eq!(get(&["usage"]), Some(Scopes::READ));
        assert_eq!(get(&["routes"]), Some(Scopes::DEPLOY.with(Scopes::READ)));
        assert_eq!(get(&["registries"]), Some(Scopes::DEPLOY.with(Scopes::READ)));
        assert_eq!(get(&["config"]), Some(Scopes::DEPLOY.with(Scopes::READ)), "read lists settings (secrets' names only)");
        assert_eq!(required(&Method::PUT, &["config", "min_score"]), Some(Scopes::DEPLOY), "deploy writes them");
        assert_eq!(get(&["kv", "cache", "k"]), Some(Scopes::DEPLOY.with(Scopes::READ)), "read reads the state");
        assert_eq!(required(&Method::DELETE, &["kv", "cache"]), Some(Scopes::DEPLOY), "deploy clears it");
        assert_eq!(required(&Method::DELETE, &["kv"]), None, "not all of it at once");
        assert_eq!(required(&Method::PUT, &["registries", "ghcr.io"]), Some(Scopes::DEPLOY), "credentials are set with deploy only");
        assert_eq!(required(&Method::PUT, &["handlers", "faces"]), Some(Scopes::DEPLOY));
        assert_eq!(required(&Method::POST, &["handlers", "faces", "rollback"]), Some(Scopes::DEPLOY));
        assert_eq!(required(&Method::DELETE, &["keys", "abc"]), Some(Scopes::DEPLOY));
        assert_eq!(required(&Method::DELETE, &["handlers", "faces"]), None, "no such route");
        assert!(!Scopes::INVOKE.any(get(&["handlers"]).unwrap()), "an invoke key manages nothing");
    }

    /// A store's internal error reaches the tenant as a generic 500 naming
    /// the request id, without its detail; the tenant's own mistakes pass.
    #[tokio::test]
    async fn a_store_errors_detail_stays_in_the_nodes_log() {
        use http_body_util::BodyExt;
        let detail = "disk I/O error at /var/lib/facegate/facegate.db";
        let hidden = for_tenant(StoreError::Internal(anyhow::anyhow!("{detail}")), "acme", "5eed-7");
        let answer = with_request_id(super::super::response::store_error(&hidden), "5eed-7");
        assert_eq!(
            (answer.status(), answer.headers()[REQUEST_ID_HEADER].to_str().ok()),
            (StatusCode::INTERNAL_SERVER_ERROR, Some("5eed-7"))
        );
        let body = answer.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        let text = String::from_utf8_lossy(&body);
        assert!(!text.contains("disk I/O") && !text.contains("/var/lib") && text.contains("5eed-7"), "{text}");
        assert!(text.contains("\"internal\""), "{text}");
        let unavailable = for_tenant(StoreError::Unavailable("connect db.internal:5432: refused".into()), "acme", "5eed-8");
        assert!(!unavailable.to_string().contains("db.internal"), "{unavailable}");
        assert_eq!(super::super::response::store_error(&unavailable).status(), StatusCode::SERVICE_UNAVAILABLE);
        let own = for_tenant(StoreError::Quota("tenant \"acme\" has 100 keys".into()), "acme", "5eed-9");
        assert!(own.to_string().contains("100 keys"), "{own}");
    }
}
