//! The admin API under `/admin/v1/`: tenants, keys, handler versions. It
//! requires the admin token (`Authorization: Bearer <token>`; the metrics
//! token is refused like any wrong one) and is off when none is configured.
//! Also who may read `/metrics`: the metrics token or the admin token. Store work (SQLite, compilation, fsync) runs on
//! blocking threads, never on the async workers.

use std::sync::Arc;

use bytes::Bytes;
use facegate_host_gpu::{ModelSpec, ModelState};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::app::App;
use super::auth::bearer;
use super::body::{content_length, read_body};
use super::response::{self, Body};
use crate::admission::limits::Limit;
use crate::admission::limits::LimitOverrides;
use crate::admission::memory::{self, Charge, REQUEST_BASE_BYTES};
use crate::control::ALIVE_WITHIN;
use crate::control::keys::{self, Scopes};
use crate::control::models::spec_json;
use crate::control::store::AbortRule;
use crate::control::store::ModelRow;
use crate::control::store::UPLOADED;
use crate::control::store::{StoreError, now_ms};
use crate::control::{Change, ChangePlace, ControlPlane, Release, Releasing, UploadHold};
use crate::sandbox::compile::CompileError;
use crate::sandbox::handler::GuestPath;

/// `PUT /admin/v1/routes/{hostname}`'s body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddRoute {
    tenant: String,
    handler: String,
}

/// `POST /admin/v1/models/{name}/activate`'s body.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ActivateModel {
    version: i64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateTenant {
    name: String,
    #[serde(default)]
    limits: LimitOverrides,
}

/// `PUT …/config/{name}`'s body. No `Debug`: it may hold a secret.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SetSetting {
    pub(super) value: String,
    #[serde(default)]
    pub(super) secret: bool,
}

/// The handler a settings call's query names (`handler=H`), if any.
pub(super) fn setting_handler(query: &str) -> Result<Option<String>, StoreError> {
    let mut handler = None;
    for (name, value) in form_urlencoded::parse(query.as_bytes()) {
        match &*name {
            "handler" => handler = Some(value.into_owned()),
            _ => return Err(StoreError::Invalid(format!("unknown parameter {name:?} (handler)"))),
        }
    }
    Ok(handler)
}

/// `GET`, `PUT` and `DELETE` of a tenant's settings (`rest`: the path
/// after the tenant, from `config`), for the admin and tenant APIs.
pub(super) fn settings_op(control: &ControlPlane, t: &str, (method, rest, query): (&Method, &[&str], &str), body: &Bytes) -> AdminResult {
    match (method, rest) {
        (&Method::GET, ["config"]) => ok(json!({ "tenant": t, "settings": control.settings.list(t)? })),
        (&Method::PUT, ["config", name]) => {
            let set: SetSetting = parse(body)?;
            ok(control.settings.set(t, setting_handler(query)?.as_deref(), name, &set.value, set.secret)?)
        }
        (&Method::DELETE, ["config", name]) => {
            control.settings.unset(t, setting_handler(query)?.as_deref(), name)?;
            ok(json!({ "tenant": t, "unset": name }))
        }
        _ => Err(StoreError::NotFound(format!("no settings route {method} {}", rest.join("/")))),
    }
}

/// `PUT …/registries/{registry}`'s body. No `Debug`: it holds a password.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RegistryLogin {
    pub(super) username: String,
    pub(super) password: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Activate {
    pub(super) version: i64,
}

/// An admin operation's answer: a status and a JSON body.
pub(super) type AdminResult = Result<(StatusCode, Value), StoreError>;

impl App {
    /// The refusal of a request that lacks the admin token (`None`: let it
    /// through). Without a configured token every such request is refused.
    pub(super) fn admin_refusal(&self, req: &Request<Incoming>) -> Option<Response<Body>> {
        let Some(expected) = self.config.admin_token.as_deref() else {
            return Some(response::before_body(response::error(
                StatusCode::FORBIDDEN,
                "admin_disabled",
                "the admin API is off: start facegate with --admin-token (FACEGATE_ADMIN_TOKEN)",
            )));
        };
        if keys::token_matches(bearer(req).unwrap_or(""), expected) {
            return None;
        }
        let mut refusal = response::error(StatusCode::UNAUTHORIZED, "unauthorized", "missing or wrong admin token");
        refusal.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
        Some(response::before_body(refusal))
    }

    /// The refusal of a `/metrics` scrape (`None`: let it through). It takes
    /// the metrics token (read-only: it opens `/metrics` and nothing else)
    /// or the admin token; without either configured it is refused.
    pub(super) fn metrics_refusal(&self, req: &Request<Incoming>) -> Option<Response<Body>> {
        let tokens = [self.config.metrics_token.as_deref(), self.config.admin_token.as_deref()];
        if tokens.iter().all(Option::is_none) {
            return Some(response::before_body(response::error(
                StatusCode::FORBIDDEN,
                "metrics_disabled",
                "/metrics is off: start facegate with --metrics-token (FACEGATE_METRICS_TOKEN) or --admin-token",
            )));
        }
        let given = bearer(req).unwrap_or("");
        // Both compared, in constant time each: which one matched leaks nothing.
        let matched = tokens.iter().flatten().fold(false, |any, expected| keys::token_matches(given, expected) | any);
        if matched {
            return None;
        }
        let mut refusal = response::error(StatusCode::UNAUTHORIZED, "unauthorized", "missing or wrong metrics token");
        refusal.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
        Some(response::before_body(refusal))
    }

    /// Serves one admin request (`rest` is the path after `/admin/v1/`).
    pub(super) async fn admin(&self, rest: &[&str], req: Request<Incoming>) -> Response<Body> {
        if let Some(refusal) = self.admin_refusal(&req) {
            return self.token_failures.slowed("admin", &req, refusal).await;
        }
        if req.method() == Method::GET && rest == ["stats"] {
            return self.stats();
        }
        if req.method() == Method::GET && rest == ["usage"] {
            return self.usage_report(&req, None).await;
        }
        if let ["tenants", tenant, state @ ..] = rest
            && state.first() == Some(&"kv")
        {
            return self.kv_api(tenant, state, req).await;
        }
        let method = req.method().clone();
        let query = req.uri().query().unwrap_or("").to_owned();
        let path: Vec<String> = rest.iter().map(|s| (*s).to_owned()).collect();
        let call = match rest {
            ["tenants", tenant, of_tenant @ ..] => StoreCall { tenant: Some(*tenant), change: change_of(&method, of_tenant) },
            _ => StoreCall { tenant: None, change: None },
        };
        // The operator's calls all take bodies up to the largest upload.
        let max_body = self.config.max_component_bytes;
        self.store_op(req, (call, max_body), move |control, body, held| admin_op(control, (&method, &path, &query), body, held)).await
    }

    /// Reads `req`'s body (up to `max_body`) and runs `op` on it on a
    /// blocking thread. Before the body is read: an upload is refused while
    /// the compile pool is full (a client retrying at once costs little), a
    /// tenant's change while it has another in progress on this node (429),
    /// and any call whose declared body does not fit the node's memory
    /// budget (503 `overloaded`); the body is charged as it arrives, and
    /// what the call holds ([`Held`]) is held until it is answered (an
    /// upload's, until its compile ends). An upload whose body is JSON names
    /// a component in a registry instead (see `oci::pull`): it is pulled
    /// here, holding the same place and charge, within the upload time limit.
    pub(super) async fn store_op(
        &self,
        req: Request<Incoming>,
        (call, max_body): (StoreCall<'_>, usize),
        op: impl FnOnce(&ControlPlane, &Bytes, Held) -> AdminResult + Send + 'static,
    ) -> Response<Body> {
        if call.change == Some(Change::Upload) && self.control.releases.uploads_busy() {
            return response::before_body(response::store_error(&StoreError::Busy(CompileError::Busy.to_string())));
        }
        let place = match (call.tenant, call.change) {
            (Some(tenant), Some(change)) => match self.control.releases.begin_change(tenant, change) {
                Ok(place) => Some(place),
                Err(e) => return response::before_body(response::store_error(&e)),
            },
            _ => None,
        };
        let owner: Arc<str> = Arc::from(call.tenant.unwrap_or(OPERATOR));
        let pull = call.change == Some(Change::Upload) && super::oci::pull::is_pull(&req);
        let declared = content_length(&req).map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX).min(max_body));
        let mut memory = match self.sandbox.memory().charge(&owner, declared.saturating_add(REQUEST_BASE_BYTES)) {
            Ok(charge) => charge,
            Err(refusal) => return self.control_refused_memory(&owner, refusal),
        };
        let body = match read_body(req, max_body, self.config.upload_timeout(), Some(&mut memory)).await {
            Ok(req) => match req.into_body().collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(never) => match never {},
            },
            Err((_, refusal)) => return refusal,
        };
        let (body, source) = if pull {
            match self.pull_for_deploy(&owner, &body, &mut memory).await {
                Ok(pulled) => (pulled.component, pulled.source),
                Err(refusal) => return refusal,
            }
        } else {
            (body, UPLOADED.to_owned())
        };
        // Held from now on: the body, not the buffer's growth. A body read or
        // pulled was charged as it grew, so this shrinks; were it ever to
        // grow, the budget would say so.
        if let Err(refusal) = memory.resize(body.len().saturating_add(REQUEST_BASE_BYTES)) {
            return self.control_refused_memory(&owner, refusal);
        }
        let held = Held { place, memory, source };
        let control = Arc::clone(&self.control);
        let outcome = tokio::task::spawn_blocking(move || op(&control, &body, held)).await;
        match outcome {
            Ok(Ok((status, value))) => response::json(status, &value),
            Ok(Err(e)) => response::store_error(&e),
            Err(e) => {
                // Cancelled only when the runtime shuts down; anything else is a panic.
                if e.is_cancelled() {
                    tracing::debug!("admin operation cancelled at shutdown");
                } else {
                    tracing::error!(error = %e, "admin operation panicked");
                }
                response::error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error")
            }
        }
    }
}

impl App {
    /// A control-plane call refused before its body by the node's memory
    /// budget: 503 `overloaded` + `Retry-After`, counted against its tenant.
    fn control_refused_memory(&self, owner: &str, refusal: memory::Refusal) -> Response<Body> {
        if owner != OPERATOR {
            self.hits().hit(owner, Limit::NodeMemory);
        }
        response::before_body(response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "overloaded", &refusal.to_string(), 1))
    }
}

/// Whom the node's memory budget charges for an operator's call that names no tenant.
const OPERATOR: &str = "(operator)";

/// What a control-plane call is, as far as the node must know before its body.
pub(super) struct StoreCall<'a> {
    /// The tenant it changes or reads (charged for its body), if any.
    pub tenant: Option<&'a str>,
    /// The change it makes to that tenant, if any: one at a time each.
    pub change: Option<Change>,
}

/// What a control-plane call holds from before its body is read until it
/// is answered: its tenant's change place (if it makes a change) and its
/// charge to the node's memory budget (its body).
pub(super) struct Held {
    place: Option<ChangePlace>,
    memory: Charge,
    /// Where an upload's bytes came from (see [`Releasing::source`]).
    source: String,
}

impl Held {
    /// How an upload is released: as its `query` says (see [`release_of`]),
    /// recording where its bytes came from.
    pub(super) fn releasing(&self, query: &str) -> Result<Releasing, StoreError> {
        let (release, guest_path) = release_of(query)?;
        Ok(Releasing { release, guest_path, source: self.source.clone() })
    }

    /// What an upload takes with it to the compile pool.
    pub(super) fn upload(self) -> Result<UploadHold, StoreError> {
        let place = self.place.ok_or_else(|| StoreError::Internal(anyhow::anyhow!("an upload without its tenant's place")))?;
        Ok(UploadHold { place, memory: self.memory })
    }
}

/// The change a call of a tenant's (`rest`: the path after the tenant, as
/// `handlers/{h}/activate`) makes, if any: taken before its body is read.
pub(super) fn change_of(method: &Method, rest: &[&str]) -> Option<Change> {
    match (method, rest) {
        (&Method::PUT, ["handlers", _]) => Some(Change::Upload),
        (&Method::POST, ["handlers", _, "activate" | "rollback" | "promote" | "abort"]) => Some(Change::Release),
        (&Method::POST, ["keys"]) | (&Method::DELETE, ["keys", _]) => Some(Change::Keys),
        _ => None,
    }
}

fn admin_op(control: &ControlPlane, (method, path, query): (&Method, &[String], &str), body: &Bytes, held: Held) -> AdminResult {
    let p: Vec<&str> = path.iter().map(String::as_str).collect();
    match (method.clone(), p.as_slice()) {
        (Method::GET, ["tenants"]) => ok(json!({ "tenants": control.tenants.list()? })),
        (Method::GET, ["nodes"]) => ok(json!({ "nodes": nodes(control)? })),
        (Method::GET, ["models"]) => ok(models(control)?),
        (Method::PUT, ["models", name]) => {
            let added = control.repository.add(name, body, forced(query))?;
            let mut value = model_row(&added.row);
            value["accuracy"] = json!(added.accuracy);
            value["forced"] = json!(added.forced);
            created(value)
        }
        (Method::POST, ["models", name, "activate"]) => {
            let req: ActivateModel = parse(body)?;
            control.repository.activate(name, req.version)?;
            ok(json!({ "model": name, "active_version": req.version }))
        }
        (Method::DELETE, ["models", name]) => {
            control.repository.remove(name)?;
            ok(json!({ "removed": name }))
        }
        (Method::GET, ["routes"]) => ok(json!({ "routes": control.routes.list()? })),
        (Method::PUT, ["routes", hostname]) => {
            let req: AddRoute = parse(body)?;
            ok(control.routes.add(hostname, &req.tenant, &req.handler)?)
        }
        (Method::DELETE, ["routes", hostname]) => {
            control.routes.remove(hostname)?;
            ok(json!({ "removed": hostname }))
        }
        (Method::POST, ["tenants"]) => {
            let req: CreateTenant = parse(body)?;
            created(control.tenants.create(&req.name, &req.limits)?)
        }
        (Method::GET, ["tenants", t]) => ok(control.tenants.get(t)?),
        (Method::PATCH, ["tenants", t]) => ok(control.tenants.update_limits(t, &parse(body)?)?),
        (Method::DELETE, ["tenants", t]) => {
            control.tenants.delete(t)?;
            ok(json!({ "deleted": t }))
        }
        (Method::GET, ["tenants", t, "keys"]) => ok(json!({ "tenant": t, "keys": control.tenants.keys(t)? })),
        (Method::POST, ["tenants", t, "keys"]) => created(control.tenants.create_key(t, key_scopes(body)?)?),
        (Method::DELETE, ["tenants", t, "keys", id]) => {
            control.tenants.revoke_key(t, id)?;
            ok(json!({ "tenant": t, "revoked": id }))
        }
        (_, ["tenants", t, rest @ ..]) if rest.first() == Some(&"config") => settings_op(control, t, (method, rest, query), body),
        (Method::GET, ["tenants", t, "registries"]) => ok(json!({ "tenant": t, "registries": control.registries.list(t)? })),
        (Method::PUT, ["tenants", t, "registries", registry]) => {
            let login: RegistryLogin = parse(body)?;
            ok(control.registries.login(t, registry, &login.username, &login.password)?)
        }
        (Method::DELETE, ["tenants", t, "registries", registry]) => {
            control.registries.logout(t, registry)?;
            ok(json!({ "tenant": t, "forgotten": registry }))
        }
        (Method::GET, ["tenants", t, "handlers"]) => ok(json!({ "tenant": t, "handlers": control.tenants.get(t)?.handlers })),
        (Method::PUT, ["tenants", t, "handlers", h]) => {
            created(control.releases.release(t, h, body.clone(), held.releasing(query)?, held.upload()?)?)
        }
        (Method::GET, ["tenants", t, "handlers", h, "versions"]) => ok(control.releases.versions(t, h)?),
        (Method::POST, ["tenants", t, "handlers", h, "activate"]) => {
            let req: Activate = parse(body)?;
            ok(control.releases.activate(t, h, req.version)?)
        }
        (Method::POST, ["tenants", t, "handlers", h, "rollback"]) => ok(control.releases.rollback(t, h)?),
        (Method::POST, ["tenants", t, "handlers", h, "promote"]) => ok(control.releases.promote(t, h)?),
        (Method::POST, ["tenants", t, "handlers", h, "abort"]) => ok(json!({ "aborted": control.releases.abort_canary(t, h, None)? })),
        _ => Err(StoreError::NotFound(format!("no admin route {method} /admin/v1/{}", path.join("/")))),
    }
}

/// How an upload's query releases it: `activate=false` stores it only;
/// `canary=P` serves it to P percent of the requests, aborted by a node
/// once it served `abort_after` requests with a 5xx share over the active
/// version's by `abort_margin` (both or neither); otherwise it is active.
/// `path=full` gives its guest the whole path, not the path below its
/// mount (`path=relative`, the default).
pub(super) fn release_of(query: &str) -> Result<(Release, GuestPath), StoreError> {
    let (mut activate, mut percent, mut margin, mut after) = (true, None, None, None);
    let mut guest_path = GuestPath::default();
    let bad = |name: &str, value: &str| StoreError::Invalid(format!("{name}={value:?} is not a valid value"));
    for (name, value) in query.split('&').filter(|kv| !kv.is_empty()).map(|kv| kv.split_once('=').unwrap_or((kv, ""))) {
        match name {
            "activate" => activate = !matches!(value, "false" | "0" | "no"),
            "canary" => percent = Some(value.parse::<u8>().map_err(|_| bad(name, value))?),
            "abort_margin" => margin = Some(value.parse::<f64>().ok().filter(|m| (0.0..=1.0).contains(m)).ok_or_else(|| bad(name, value))?),
            // The stores keep it as a signed 64-bit number.
            "abort_after" => after = Some(value.parse::<u64>().map_err(|_| bad(name, value))?.min(i64::MAX as u64)),
            "path" => guest_path = GuestPath::parse(value).ok_or_else(|| bad(name, value))?,
            _ => {
                let known = "activate, canary, abort_margin, abort_after, path";
                return Err(StoreError::Invalid(format!("unknown parameter {name:?} ({known})")));
            }
        }
    }
    let abort = match (margin, after) {
        (Some(margin), Some(after)) => Some(AbortRule { margin, after }),
        (None, None) => None,
        _ => return Err(StoreError::Invalid("abort_margin and abort_after go together".into())),
    };
    let release = match percent {
        Some(percent) => Release::Canary { percent, abort },
        None if abort.is_some() => return Err(StoreError::Invalid("an abort rule needs a canary (canary=P)".into())),
        None if activate => Release::Activate,
        None => Release::Store,
    };
    Ok((release, guest_path))
}

/// The models this node serves, each with its state (see [`ModelState`]),
/// where it comes from and its input/output spec; the bytes loaded against
/// the bound; and every version in the repository.
fn models(control: &ControlPlane) -> Result<Value, StoreError> {
    let models = control.models();
    let specs: std::collections::BTreeMap<String, ModelSpec> = models.specs().into_iter().map(|s| (s.name.clone(), s)).collect();
    let list: Vec<Value> = models
        .states()
        .into_iter()
        .map(|state: ModelState| {
            let mut value = json!({
                "name": state.name,
                "source": if control.repository.from_flags(&state.name) { "flags" } else { "repository" },
                "loaded": state.loaded,
                "pinned": state.pinned,
                "memory_bytes": state.bytes,
                "loads": state.loads,
                "evictions": state.evictions,
                "last_load_ms": state.last_load.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            });
            if let (Some(spec), Value::Object(fields)) = (specs.get(&state.name), &mut value) {
                fields.extend(spec_json(spec).as_object().cloned().unwrap_or_default());
            }
            value
        })
        .collect();
    let repository: Vec<Value> = control.repository.list()?.into_iter().map(|row| model_row(&row)).collect();
    let (loaded, bound) = models.memory();
    Ok(json!({ "models": list, "repository": repository, "memory": { "loaded_bytes": loaded, "bound_bytes": bound } }))
}

/// A repository row as the API shows it: its spec and accuracy as JSON.
fn model_row(row: &ModelRow) -> Value {
    let parsed = |text: &str| serde_json::from_str::<Value>(text).unwrap_or(Value::Null);
    json!({
        "name": row.name,
        "version": row.version,
        "active": row.active,
        "sha256": row.sha256,
        "size": row.size,
        "created_at": row.created_at,
        "spec": parsed(&row.spec),
        "accuracy": parsed(&row.accuracy),
    })
}

/// Whether an add asks to skip the accuracy gate: `?force=true`.
fn forced(query: &str) -> bool {
    form_urlencoded::parse(query.as_bytes()).any(|(k, v)| k == "force" && (v == "true" || v == "1"))
}

/// Every node with whether it is alive (a heartbeat within [`ALIVE_WITHIN`]).
fn nodes(control: &ControlPlane) -> Result<Vec<Value>, StoreError> {
    let now = now_ms();
    let alive_ms = i64::try_from(ALIVE_WITHIN.as_millis()).unwrap_or(i64::MAX);
    control
        .cluster
        .nodes()?
        .into_iter()
        .map(|node| {
            let seen_ms_ago = now - node.heartbeat_at;
            let mut value = serde_json::to_value(node).map_err(anyhow::Error::from)?;
            value["alive"] = json!(seen_ms_ago <= alive_ms);
            value["seen_ms_ago"] = json!(seen_ms_ago);
            Ok(value)
        })
        .collect()
}

/// The scopes a key-creation body asks for: `{"scopes": ["deploy", "read"]}`;
/// an empty body, or none named, is `invoke`.
pub(super) fn key_scopes(body: &Bytes) -> Result<Scopes, StoreError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct CreateKey {
        #[serde(default)]
        scopes: Vec<String>,
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Scopes::default());
    }
    let req: CreateKey = parse(body)?;
    if req.scopes.is_empty() {
        return Ok(Scopes::default());
    }
    Scopes::parse(&req.scopes.join(",")).map_err(StoreError::Invalid)
}

pub(super) fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, StoreError> {
    serde_json::from_slice(body).map_err(|e| StoreError::Invalid(format!("bad JSON body: {e}")))
}

pub(super) fn ok(value: impl serde::Serialize) -> AdminResult {
    Ok((StatusCode::OK, serde_json::to_value(value).map_err(anyhow::Error::from)?))
}

pub(super) fn created(value: impl serde::Serialize) -> AdminResult {
    Ok((StatusCode::CREATED, serde_json::to_value(value).map_err(anyhow::Error::from)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upload_query_says_how_it_is_released() {
        let relative = GuestPath::Relative;
        assert_eq!(release_of("").unwrap(), (Release::Activate, relative));
        assert_eq!(release_of("activate=false").unwrap(), (Release::Store, relative));
        let rule = Some(AbortRule { margin: 0.05, after: 50 });
        let canary = Release::Canary { percent: 10, abort: rule };
        assert_eq!(release_of("canary=10&abort_margin=0.05&abort_after=50").unwrap(), (canary, relative));
        assert_eq!(release_of("canary=25&path=full").unwrap(), (Release::Canary { percent: 25, abort: None }, GuestPath::Full));
        assert_eq!(release_of("path=relative").unwrap(), (Release::Activate, relative));
        let bad_ones = ["canary=ten", "abort_margin=0.1", "canary=5&abort_after=3", "abort_margin=2&abort_after=1&canary=5", "color=red"];
        for bad in bad_ones.into_iter().chain(["path=whole", "path="]) {
            assert!(release_of(bad).is_err(), "{bad}");
        }
    }
}
