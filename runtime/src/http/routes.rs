//! The routing table: which route a request on a listener of each
//! [`Plane`] reaches, and the small routes (health, readiness, metrics,
//! models).

use std::time::Duration;

use hyper::body::Incoming;
use hyper::header::{CACHE_CONTROL, CONNECTION};
use hyper::{Method, Request, Response, StatusCode, Version};
use std::sync::atomic::Ordering;

use super::app::{App, Plane};
use super::body::has_body;
use super::conn::Tls;
use super::mount::{self, BadPath};
use super::response::{self, Body};
use crate::control::HostRoute;
use crate::telemetry;
use hyper::header::HOST;

impl App {
    /// Dispatches one request arriving on a listener serving `plane`.
    /// Never fails: every problem becomes a response.
    pub async fn route(&self, req: Request<Incoming>, plane: Plane) -> Response<Body> {
        let may_leave_body_unread = req.version() < Version::HTTP_2 && has_body(&req);
        let private = is_private_answer(req.uri().path());
        let mut response = self.dispatch(req, plane).await;
        if private {
            // Keys, tenants and metrics must not stay in a proxy's or browser's cache.
            response.headers_mut().insert(CACHE_CONTROL, hyper::header::HeaderValue::from_static("no-store"));
        }
        // Refusals before the body is read (auth, limits, 413 on the declared
        // length) leave it unread, and hyper may then close the connection.
        // Say so, or a keep-alive client may send its next request on a
        // connection that is going away.
        if may_leave_body_unread && response.extensions().get::<response::BodyUnread>().is_some() {
            response.headers_mut().insert(CONNECTION, hyper::header::HeaderValue::from_static("close"));
        }
        response
    }

    async fn dispatch(&self, req: Request<Incoming>, plane: Plane) -> Response<Body> {
        let path = req.uri().path().to_owned();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (data, admin) = (matches!(plane, Plane::Data | Plane::Both), plane != Plane::Data);
        // A tenant's own hostname: every path is its handler's.
        if data {
            match self.host_route(&req) {
                Ok(None) => {}
                Ok(Some(route)) => return self.call_handler((&route.tenant, &route.handler, mount::at_root(&path)), req).await,
                Err(misdirected) => return misdirected.answer(),
            }
        }
        match (req.method(), segments.as_slice()) {
            (&Method::GET, ["healthz"]) => self.health(),
            (&Method::GET, ["readyz"]) => self.readiness(),
            (&Method::GET, [""] | ["console", _]) if plane != Plane::Reserve => {
                super::console::asset(path.trim_start_matches('/')).unwrap_or_else(not_found_path(&path))
            }
            (&Method::GET, ["v1", "me"]) if data => self.me(&req),
            // Metrics name tenants and handlers: they are for the operator.
            (&Method::GET, ["metrics"]) if admin => match self.metrics_refusal(&req) {
                Some(refusal) => self.token_failures.slowed("metrics", &req, refusal).await,
                None => self.prometheus(),
            },
            (&Method::GET, ["v1", "models"]) if data => self.list_models(),
            (_, ["v1", _, _, ..]) if data => match mount::parse_v1(&path) {
                Some(Ok((tenant, handler, mount))) => self.call_handler((&tenant, &handler, mount), req).await,
                Some(Err(BadPath(message))) => response::before_body(response::error(StatusCode::BAD_REQUEST, "bad_path", message)),
                None => response::before_body(response::error(StatusCode::NOT_FOUND, "not_found", format!("no route for {path}"))),
            },
            (_, ["admin", "v1", rest @ ..]) if admin => self.admin(rest, req).await,
            (_, ["tenant", "v1", rest @ ..]) if data => self.tenant_api(rest, req).await,
            (_, ["healthz" | "readyz"]) => method_not_allowed(),
            (_, ["metrics"]) if admin => method_not_allowed(),
            (_, ["v1", "models"]) if data => method_not_allowed(),
            // Reserve slots are for the operator; tenants wait for a main slot.
            _ if plane == Plane::Reserve => response::before_body(response::retry_later(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                "all connection slots are in use",
                1,
            )),
            _ => response::before_body(response::error(StatusCode::NOT_FOUND, "not_found", format!("no route for {path}"))),
        }
    }
}

impl App {
    /// The route of the hostname a request names, if the operator routed
    /// it: its `Host` (or `:authority`), or over TLS the handshake's server
    /// name. A request whose `Host` and server name disagree where either
    /// is routed is refused 421: one connection serves one tenant's names.
    fn host_route<B>(&self, req: &Request<B>) -> Result<Option<HostRoute>, Misdirected> {
        let live = self.control.serving.live();
        if live.routes_empty() {
            return Ok(None);
        }
        let authority = req.uri().authority().map(|a| a.as_str()).or_else(|| req.headers().get(HOST).and_then(|h| h.to_str().ok()));
        let host = authority.and_then(crate::control::host_of);
        let sni = req.extensions().get::<Tls>().and_then(|tls| tls.server_name.as_deref()).and_then(crate::control::host_of);
        let (by_host, by_sni) = (host.as_deref().and_then(|h| live.route(h)), sni.as_deref().and_then(|s| live.route(s)));
        match (&host, &sni) {
            (Some(host), Some(sni)) if host != sni && (by_host.is_some() || by_sni.is_some()) => {
                Err(Misdirected { host: host.clone(), sni: sni.clone() })
            }
            (Some(_), _) => Ok(by_host.cloned()),
            (None, _) => Ok(by_sni.cloned()),
        }
    }
}

/// A request whose `Host` names another hostname than its connection's
/// TLS server name.
struct Misdirected {
    host: String,
    sni: String,
}

impl Misdirected {
    /// 421: the client should open a connection for that hostname.
    fn answer(&self) -> Response<Body> {
        let message = format!("this connection is for {}, not {}", self.sni, self.host);
        response::before_body(response::error(StatusCode::MISDIRECTED_REQUEST, "misdirected", message))
    }
}

fn not_found_path(path: &str) -> impl FnOnce() -> Response<Body> + '_ {
    move || response::error(StatusCode::NOT_FOUND, "not_found", format!("no route for {path}"))
}

/// Whether the answer to `path` is the operator's or a tenant's own (the
/// admin API, the tenant API, `/metrics`, `/v1/me`), never to be cached; a handler's
/// answers are its own business.
fn is_private_answer(path: &str) -> bool {
    path.starts_with("/admin/") || path.starts_with("/tenant/") || path == "/metrics" || path.trim_end_matches('/') == "/v1/me"
}

fn method_not_allowed() -> Response<Body> {
    response::before_body(response::error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "use GET"))
}

impl App {
    fn health(&self) -> Response<Body> {
        let models: Vec<_> = self.models.iter().map(|b| b.spec().name.clone()).collect();
        response::json(
            StatusCode::OK,
            &serde_json::json!({ "status": "ok", "handlers": self.control.serving.live().handler_count(), "models": models }),
        )
    }

    /// Ready: not draining, and the snapshot confirmed against the store
    /// within `--stale-after-s` (the model is loaded before the gateway listens).
    fn readiness(&self) -> Response<Body> {
        let age = self.control.serving.snapshot_age();
        let stale = self.config.stale_after_s > 0 && age > Duration::from_secs(self.config.stale_after_s);
        let draining = self.draining.load(Ordering::Acquire);
        let ready = !stale && !draining;
        let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
        response::json(
            status,
            &serde_json::json!({
                "ready": ready,
                "draining": draining,
                "stale": stale,
                "snapshot_age_ms": age.as_millis() as u64,
                "generation": self.control.serving.generation(),
            }),
        )
    }

    fn prometheus(&self) -> Response<Body> {
        let instances = telemetry::InstanceCounts {
            in_use: self.instances.in_use(),
            warm: self.sandbox.warm_instances(),
            reused: self.sandbox.reused_instances(),
        };
        let mut text = telemetry::render(&self.metrics, self.hits(), &self.models, instances);
        let memory = self.sandbox.memory();
        let (components_compiled, components_shared) = self.control.artifacts.sources();
        let node = telemetry::NodeGauges {
            memory_budget: memory.total(),
            memory_charged: memory.used(),
            live_nodes: self.control.cluster.live_nodes(),
            components_compiled,
            components_shared,
        };
        telemetry::render_node(&mut text, node);
        response::text("text/plain; version=0.0.4", text)
    }

    fn list_models(&self) -> Response<Body> {
        let models: Vec<_> = self
            .models
            .iter()
            .map(|b| {
                let s = b.spec();
                serde_json::json!({
                    "name": s.name, "input": {"shape": s.input.shape, "element": s.input.element},
                    "dim_multiple": s.dim_multiple, "max_side": s.max_side, "max_batch": s.max_batch,
                })
            })
            .collect();
        response::json(StatusCode::OK, &serde_json::json!({ "models": models }))
    }
}
