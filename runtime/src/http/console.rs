//! The web console (`/`): "Try it" for a tenant's key, "Operate" for the
//! admin token. Its assets are embedded in the binary and served with a
//! strict Content-Security-Policy (no inline script, same-origin requests
//! only); it talks to the gateway through `/v1/me`, the handlers and the
//! admin API, and refreshes its live view from `/admin/v1/stats`.

use hyper::body::Incoming;
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode};
use serde_json::json;
use std::sync::LazyLock;

use crate::admission::limits::{LimitKind, TenantLimits};

use super::app::App;
use super::auth::bearer;
use super::response::{self, Body};

const INDEX: &str = include_str!("../../console/index.html");
const SCRIPT: &str = include_str!("../../console/console.js");
const STYLE: &str = include_str!("../../console/console.css");

/// The console's Content-Security-Policy: its own script and style only,
/// images from blobs (the chosen photo, a returned image), no framing.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' blob: data:; media-src 'self' blob: mediastream:; connect-src 'self'; \
     base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The page, its limits form generated from the limits' table
/// ([`TenantLimits::FIELDS`]): every limit, none spelled here.
static PAGE: LazyLock<String> = LazyLock::new(|| INDEX.replace("<!-- tenant limits -->", &limit_inputs()));

/// One labelled input per tenant limit, its doc comment as its title.
fn limit_inputs() -> String {
    let mut html = String::new();
    for field in TenantLimits::FIELDS {
        let input = match field.kind {
            LimitKind::Integer => r#"type="number" min="0" step="1""#,
            LimitKind::Number => r#"type="number" min="0" step="any""#,
            LimitKind::Flag => r#"type="checkbox""#,
            LimitKind::Text => r#"type="text""#,
        };
        let help = field.help.trim().replace('&', "&amp;").replace('"', "&quot;").replace('<', "&lt;");
        html.push_str(&format!("        <label title=\"{help}\">{} <input name=\"{}\" {input}></label>\n", field.name, field.name));
    }
    html
}

/// The asset at `path` (`""` is the page), if the console has one.
pub fn asset(path: &str) -> Option<Response<Body>> {
    let (content_type, body) = match path {
        "" => ("text/html; charset=utf-8", PAGE.as_str()),
        "console/console.js" => ("text/javascript; charset=utf-8", SCRIPT),
        "console/console.css" => ("text/css; charset=utf-8", STYLE),
        _ => return None,
    };
    let mut response = Response::new(response::full(body));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(HeaderName::from_static("content-security-policy"), HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    headers.insert(HeaderName::from_static("x-content-type-options"), HeaderValue::from_static("nosniff"));
    headers.insert(HeaderName::from_static("x-frame-options"), HeaderValue::from_static("DENY"));
    headers.insert(HeaderName::from_static("referrer-policy"), HeaderValue::from_static("no-referrer"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Some(response)
}

impl App {
    /// `GET /v1/me`: the key's tenant and its handlers with their active
    /// versions (what "Try it" offers).
    pub(super) fn me(&self, req: &Request<Incoming>) -> Response<Body> {
        let live = self.control.serving.live();
        let Some((tenant, scopes)) = live.authenticate(bearer(req)) else {
            let mut refusal = response::error(StatusCode::UNAUTHORIZED, "unauthorized", "missing, invalid or revoked API key");
            refusal.headers_mut().insert(hyper::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return refusal;
        };
        let mut handlers: Vec<_> = live
            .tenants
            .get(tenant)
            .map(|entry| entry.handlers.iter().map(|(name, h)| json!({ "name": name, "version": h.version })).collect())
            .unwrap_or_default();
        handlers.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
        response::json(StatusCode::OK, &json!({ "tenant": tenant, "scopes": scopes, "handlers": handlers }))
    }

    /// `GET /admin/v1/stats`: per tenant, requests by status, latency
    /// quantiles (bucket bounds), queue depth and device time; per model,
    /// the batch-size histogram and device busy time. The console's live view.
    pub(super) fn stats(&self) -> Response<Body> {
        let requests = self.metrics.by_tenant();
        // One snapshot per model, read for every tenant.
        let snapshots: Vec<_> = self
            .models
            .iter()
            .map(|m| {
                let metrics = m.metrics();
                (m, metrics)
            })
            .collect();
        let live = self.control.serving.live();
        let mut tenants = serde_json::Map::new();
        for name in live.tenants.keys() {
            let summary = requests.get(name).cloned().unwrap_or_default();
            let queue_depth: usize = snapshots.iter().map(|(m, _)| m.tenant_queue_depth(name)).sum();
            let device_seconds: f64 = snapshots.iter().filter_map(|(_, s)| s.tenant_busy_seconds.get(name).copied()).sum();
            tenants.insert(
                name.clone(),
                json!({
                    "requests": summary.requests,
                    "by_status": summary.by_status,
                    "p50_seconds": summary.quantile(0.5),
                    "p99_seconds": summary.quantile(0.99),
                    "queue_depth": queue_depth,
                    "device_seconds": device_seconds,
                }),
            );
        }
        let models: Vec<_> = snapshots
            .iter()
            .map(|(m, s)| json!({ "name": m.spec().name, "queue_depth": s.queue_depth, "batch_sizes": s.batch_sizes, "busy_seconds": s.busy_seconds }))
            .collect();
        response::json(StatusCode::OK, &json!({ "tenants": tenants, "models": models }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limits_form_has_an_input_for_every_limit_of_the_table() {
        let form_start = PAGE.find(r#"<form id="limits-form""#).expect("the limits form");
        let form = &PAGE[form_start..form_start + PAGE[form_start..].find("</form>").unwrap()];
        let inputs: Vec<&str> = form.split(r#"<input name=""#).skip(1).map(|rest| &rest[..rest.find('"').unwrap()]).collect();
        assert_eq!(inputs, TenantLimits::NAMES, "one input per limit, in table order");
        assert!(form.contains(r#"<input name="outgoing_http" type="checkbox">"#), "a flag is a checkbox: {form}");
        assert!(form.contains(r#"<input name="rps" type="number" min="0" step="any">"#), "a rate takes fractions: {form}");
    }
}
