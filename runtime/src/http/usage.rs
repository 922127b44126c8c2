//! `GET /admin/v1/usage`: the tenants' usage for bills, as JSON or CSV
//! (see [`crate::control::usage`]).

use std::sync::Arc;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::json;

use super::app::App;
use super::response::{self, Body};
use crate::control::store::now_ms;
use crate::control::usage::{Rollup, to_csv};
use crate::telemetry::usage::BUCKET_MS;

/// Longest period one report may cover: a year and a bit of minute buckets.
const MAX_SPAN_MS: i64 = 400 * 86_400_000;
/// The period a report covers when `from` is not given.
const DEFAULT_SPAN_MS: i64 = 86_400_000;
/// Latest time `from` or `to` may name, Unix seconds: 9999-12-31T23:59:59Z.
/// Usage starts at 1970 (0) and ends long before; with both bounded, the
/// span check cannot overflow.
const MAX_SECONDS: i64 = 253_402_300_799;

/// What a usage request asks for.
#[derive(Debug, PartialEq)]
struct UsageQuery {
    tenant: Option<String>,
    from_ms: i64,
    to_ms: i64,
    by: Rollup,
    csv: bool,
}

impl UsageQuery {
    /// Parses `tenant`, `from` and `to` (Unix seconds; the last day to now
    /// by default), `by` (`minute`, `hour`, `day`; `hour` by default) and
    /// `format` (`json`, `csv`); the error says what is wrong.
    fn parse(query: &str, now_ms: i64) -> Result<Self, String> {
        let mut parsed = Self { tenant: None, from_ms: 0, to_ms: now_ms, by: Rollup::Hour, csv: false };
        let mut from = None;
        for (name, value) in query.split('&').filter(|kv| !kv.is_empty()).map(|kv| kv.split_once('=').unwrap_or((kv, ""))) {
            match name {
                "tenant" => parsed.tenant = Some(value.to_owned()),
                "from" => from = Some(seconds(name, value)?),
                "to" => parsed.to_ms = seconds(name, value)?,
                "by" => parsed.by = Rollup::parse(value).ok_or_else(|| format!("by must be minute, hour or day, not {value:?}"))?,
                "format" => {
                    parsed.csv = match value {
                        "csv" => true,
                        "json" => false,
                        _ => return Err(format!("format must be json or csv, not {value:?}")),
                    }
                }
                _ => return Err(format!("unknown parameter {name:?} (tenant, from, to, by, format)")),
            }
        }
        parsed.from_ms = from.unwrap_or(parsed.to_ms.saturating_sub(DEFAULT_SPAN_MS));
        let span = parsed.to_ms.checked_sub(parsed.from_ms);
        if !span.is_some_and(|span| span > 0 && span <= MAX_SPAN_MS) {
            return Err("from must be before to, and at most 400 days before it".into());
        }
        Ok(parsed)
    }
}

/// A parameter in Unix seconds (0 to [`MAX_SECONDS`]), as ms; the refusal
/// names the parameter.
fn seconds(name: &str, value: &str) -> Result<i64, String> {
    let seconds: i64 = value.parse().map_err(|_| format!("{name} must be Unix seconds, not {value:?}"))?;
    if !(0..=MAX_SECONDS).contains(&seconds) {
        return Err(format!("{name} is out of range: Unix seconds from 0 to {MAX_SECONDS}, not {seconds}"));
    }
    Ok(seconds * 1000)
}

impl App {
    /// Serves `GET /admin/v1/usage` (the caller checked the admin token),
    /// or, with `only`, `GET /tenant/v1/usage` of that tenant alone (the
    /// caller checked its key's `read` scope; `tenant=` is ignored).
    pub(super) async fn usage_report(&self, req: &Request<Incoming>, only: Option<&str>) -> Response<Body> {
        let wants_csv = req.headers().get(hyper::header::ACCEPT).is_some_and(|a| a.to_str().is_ok_and(|a| a.contains("text/csv")));
        let mut query = match UsageQuery::parse(req.uri().query().unwrap_or(""), now_ms()) {
            Ok(query) => query,
            Err(message) => return response::error(StatusCode::BAD_REQUEST, "invalid_parameter", message),
        };
        if let Some(tenant) = only {
            query.tenant = Some(tenant.to_owned());
        }
        let control = Arc::clone(&self.control);
        let (tenant, span, by) = (query.tenant.clone(), (query.from_ms, query.to_ms), query.by);
        let own = only.is_some();
        let rows = tokio::task::spawn_blocking(move || {
            // A tenant reads its own usage since it was created: an earlier
            // tenant of the same name's rows stay the operator's. From the
            // start of the usage bucket (minute) it was created in: its
            // first requests are metered in that bucket, which starts
            // before it.
            let from_ms = match (&tenant, own) {
                (Some(t), true) => {
                    let created_ms = control.tenants.get(t)?.created_at.saturating_mul(1000);
                    span.0.max(created_ms - created_ms.rem_euclid(BUCKET_MS))
                }
                _ => span.0,
            };
            control.usage.read(tenant.as_deref(), (from_ms, span.1), by)
        })
        .await;
        match rows {
            Ok(Ok(rows)) if query.csv || wants_csv => response::text("text/csv; charset=utf-8", to_csv(&rows)),
            Ok(Ok(rows)) => {
                response::json(StatusCode::OK, &json!({ "from_ms": query.from_ms, "to_ms": query.to_ms, "by": query.by, "rows": rows }))
            }
            Ok(Err(e)) => match only {
                // A tenant sees no store detail (see `tenant::for_tenant`).
                Some(tenant) => {
                    let id = self.request_ids.next();
                    super::tenant::with_request_id(super::response::store_error(&super::tenant::for_tenant(e, tenant, &id)), &id)
                }
                None => super::response::store_error(&e),
            },
            Err(_) => response::error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000_000;

    #[test]
    fn a_query_defaults_to_the_last_day_by_the_hour() {
        let q = UsageQuery::parse("", NOW).unwrap();
        assert_eq!(q, UsageQuery { tenant: None, from_ms: NOW - DEFAULT_SPAN_MS, to_ms: NOW, by: Rollup::Hour, csv: false });
        let q = UsageQuery::parse("tenant=acme&from=100&to=200&by=minute&format=csv", NOW).unwrap();
        assert_eq!(q, UsageQuery { tenant: Some("acme".into()), from_ms: 100_000, to_ms: 200_000, by: Rollup::Minute, csv: true });
    }

    #[test]
    fn a_bad_query_says_what_is_wrong() {
        for (query, says) in [
            ("by=week", "by must be"),
            ("from=yesterday", "Unix seconds"),
            ("from=200&to=100", "before"),
            ("from=0&to=99999999999", "400 days"),
            ("format=xml", "format"),
            ("color=red", "unknown parameter"),
            ("to=99999999999999999", "out of range"),
            ("from=-1&to=100", "from is out of range"),
            ("from=0&to=253402300800", "to is out of range"),
        ] {
            let error = UsageQuery::parse(query, NOW).unwrap_err();
            assert!(error.contains(says), "{query}: {error}");
        }
    }

    /// Bounds whose difference overflows an i64 of ms were once wrapped
    /// into a short span and served.
    #[test]
    fn bounds_whose_span_overflows_are_refused_naming_the_parameter() {
        for (query, says) in [
            ("from=-9223372036854775&to=9223372036854775", "from is out of range"),
            ("from=0&to=9223372036854775", "to is out of range"),
            ("to=-9223372036854775", "to is out of range"),
        ] {
            let error = UsageQuery::parse(query, NOW).unwrap_err();
            assert!(error.contains(says), "{query}: {error}");
        }
        assert!(UsageQuery::parse(&format!("from={}&to={MAX_SECONDS}", MAX_SECONDS - 86_400), NOW).is_ok(), "the last day allowed");
    }
}
