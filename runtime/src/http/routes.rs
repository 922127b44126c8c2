//! Routing and per-request limits, in front of the sandbox.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_LENGTH, HOST};
use hyper::{Method, Request, Response, StatusCode};
use tokio::sync::Semaphore;

use super::response::{self, Body};
use crate::config::ServeConfig;
use crate::handlers::{Handler, Registry};
use crate::metrics::{self, HttpMetrics};
use crate::sandbox::{Sandbox, SandboxError};
use facegate_host_gpu::Models;

/// Longest a client may take to send a request body (also capped by the request timeout).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Everything a request needs: handlers, sandbox, models, limits, counters.
pub struct App {
    registry: Registry,
    sandbox: Sandbox,
    models: Models,
    config: ServeConfig,
    metrics: HttpMetrics,
    instances: Arc<Semaphore>,
}

impl App {
    /// Assembles the app from loaded parts.
    pub fn new(registry: Registry, sandbox: Sandbox, models: Models, config: ServeConfig) -> Self {
        let instances = Arc::new(Semaphore::new(config.max_instances as usize));
        Self { registry, sandbox, models, config, metrics: HttpMetrics::default(), instances }
    }

    /// Dispatches one request. Never fails: every problem becomes a response.
    pub async fn route(&self, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path().to_owned();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (req.method(), segments.as_slice()) {
            (&Method::GET, ["healthz"]) => self.health(),
            (&Method::GET, ["metrics"]) => self.prometheus(),
            (&Method::GET, ["v1", "models"]) => self.list_models(),
            (_, ["v1", tenant, handler]) => self.call_handler(tenant, handler, req).await,
            (_, ["healthz" | "metrics"] | ["v1", "models"]) => {
                response::error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "use GET")
            }
            _ => response::error(StatusCode::NOT_FOUND, "not_found", format!("no route for {path}")),
        }
    }

    fn health(&self) -> Response<Body> {
        let models: Vec<_> = self.models.iter().map(|b| b.spec().name.clone()).collect();
        response::json(StatusCode::OK, &serde_json::json!({ "status": "ok", "handlers": self.registry.len(), "models": models }))
    }

    fn prometheus(&self) -> Response<Body> {
        let in_use = self.config.max_instances as usize - self.instances.available_permits();
        response::text("text/plain; version=0.0.4", metrics::render(&self.metrics, &self.models, in_use))
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

    async fn call_handler(&self, tenant: &str, name: &str, req: Request<Incoming>) -> Response<Body> {
        let started = Instant::now();
        let Some(handler) = self.registry.get(tenant, name) else {
            return response::error(StatusCode::NOT_FOUND, "unknown_handler", format!("no handler {name:?} for tenant {tenant:?}"));
        };
        let response = self.run_handler(&handler, req).await;
        self.metrics.record(tenant, name, response.status().as_u16(), started.elapsed());
        response
    }

    async fn run_handler(&self, handler: &Arc<Handler>, req: Request<Incoming>) -> Response<Body> {
        // Refuse before reading the body when no instance slot is free. The
        // permit lives as long as the guest (it moves into the guest's task).
        let Ok(permit) = Arc::clone(&self.instances).try_acquire_owned() else {
            return response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "overloaded", "all handler instances are busy", 1);
        };
        let req = match self.buffer_body(req).await {
            Ok(req) => req,
            Err(refusal) => return refusal,
        };
        // The deadline covers the guest, queueing and inference, not the upload.
        let deadline = Instant::now() + self.config.request_timeout();
        match self.sandbox.handle(handler, req, deadline, permit).await {
            Ok(response) => response,
            Err(e) => sandbox_error(handler, &e),
        }
    }

    /// Reads the whole body under the size limit and a read timeout.
    async fn buffer_body(&self, req: Request<Incoming>) -> Result<Request<Full<Bytes>>, Response<Body>> {
        let limit = self.config.max_body_bytes;
        let too_large = || response::error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", format!("request body exceeds {limit} bytes"));
        if content_length(&req).is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        let (mut parts, body) = req.into_parts();
        // A slow upload holds an instance slot: bound it like a request.
        let read_timeout = BODY_READ_TIMEOUT.min(self.config.request_timeout());
        let collected = tokio::time::timeout(read_timeout, Limited::new(body, limit).collect()).await;
        let bytes = match collected {
            Ok(Ok(c)) => c.to_bytes(),
            Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => return Err(too_large()),
            Ok(Err(_)) => return Err(response::error(StatusCode::BAD_REQUEST, "bad_body", "the request body could not be read")),
            Err(_) => return Err(response::error(StatusCode::REQUEST_TIMEOUT, "body_timeout", "request body was not received in time")),
        };
        if parts.headers.get(HOST).is_some_and(|h| h.to_str().is_err()) {
            return Err(response::error(StatusCode::BAD_REQUEST, "bad_host", "the Host header is not valid text"));
        }
        if parts.uri.authority().is_none() && !parts.headers.contains_key(HOST) {
            parts.headers.insert(HOST, hyper::header::HeaderValue::from_static("localhost"));
        }
        Ok(Request::from_parts(parts, Full::new(bytes)))
    }
}

fn content_length(req: &Request<Incoming>) -> Option<u64> {
    req.headers().get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

fn sandbox_error(handler: &Handler, err: &SandboxError) -> Response<Body> {
    tracing::warn!(tenant = %handler.tenant, handler = %handler.name, error = %err, "handler failed");
    match err {
        SandboxError::Timeout(_) => response::error(StatusCode::GATEWAY_TIMEOUT, "handler_timeout", err),
        SandboxError::Trap(_) => response::error(StatusCode::INTERNAL_SERVER_ERROR, "handler_trapped", err),
        SandboxError::NoResponse | SandboxError::Guest(_) => {
            response::error(StatusCode::INTERNAL_SERVER_ERROR, "handler_failed", err)
        }
        SandboxError::Internal(_) => response::error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error"),
    }
}
