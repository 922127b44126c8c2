//! The state API: a tenant's buckets, keys and values (what its handlers
//! keep through `wasi:keyvalue`), for the operator (admin API
//! `tenants/{t}/kv/…`) and the tenant itself (`/tenant/v1/kv/…`: `read`
//! or `deploy` lists and reads, `deploy` writes and deletes).
//!
//! | route | answer |
//! |---|---|
//! | `GET kv` | `{"tenant","keys","bytes","buckets":[{"name","keys","bytes"}]}` |
//! | `GET kv/{bucket}` (`?after=KEY&limit=N`, N ≤ 1000) | `{"bucket","keys":[…],"next"}` (`next`: the `after` of the next page, or null) |
//! | `GET kv/{bucket}/{key}` | the value, `application/octet-stream`; 404 without one |
//! | `PUT kv/{bucket}/{key}` | sets the body as the value (the tenant's limits apply: 403 `quota_exceeded` naming the limit) |
//! | `DELETE kv/{bucket}/{key}` | deletes the key |
//! | `DELETE kv/{bucket}` | deletes every key of the bucket |
//!
//! A key is the rest of the path, percent-decoded (`a%2Fb` is `a/b`).
//! Calls run on the state's pool like handlers' ([`crate::kv::KvPool`]),
//! within the tenant's share of it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::json;

use super::app::App;
use super::body::read_body;
use super::response::{self, Body};
use crate::admission::memory::{Charge, REQUEST_BASE_BYTES};
use crate::kv::{self, KvError, KvPool, LIST_PAGE, Owner, Quota};
use crate::sandbox::keyvalue::KvLimits;

/// Most keys one listing page may ask for.
const MAX_PAGE: usize = 1000;
/// How long a state call of the API may wait for the database.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A state call's answer: its status and JSON, or a value's bytes.
enum Answer {
    Json(StatusCode, serde_json::Value),
    Value(Vec<u8>),
}

impl App {
    /// Serves `tenant`'s state route `rest` (from `kv`), its scope already checked.
    pub(super) async fn kv_api(&self, tenant: &str, rest: &[&str], req: Request<Incoming>) -> Response<Body> {
        let Some(pool) = self.sandbox.state().cloned() else {
            return refused(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", "this node keeps no state");
        };
        let found = {
            let live = self.control.serving.live();
            live.tenants.get(tenant).map(|e| (Arc::clone(&e.incarnation), KvLimits::of(&e.gate.limits).quota))
        };
        let Some((incarnation, quota)) = found else {
            return refused(StatusCode::NOT_FOUND, "not_found", format!("no tenant {tenant:?}"));
        };
        let owner = Owner { tenant: tenant.into(), incarnation };
        let method = req.method().clone();
        let query = req.uri().query().unwrap_or("").to_owned();
        let route = match Route::parse(&method, rest, &query) {
            Ok(route) => route,
            Err(Unrouted::NoRoute(e)) => return refused(StatusCode::NOT_FOUND, "not_found", e),
            Err(Unrouted::Invalid(e)) => return refused(StatusCode::BAD_REQUEST, "invalid", e),
        };
        // What the call holds (a PUT's body, a GET's value), charged before and until it is answered.
        let mut memory = match self.sandbox.memory().charge(&owner.tenant, REQUEST_BASE_BYTES) {
            Ok(charge) => charge,
            Err(refusal) => return refused(StatusCode::SERVICE_UNAVAILABLE, "overloaded", refusal),
        };
        let value = match route {
            Route::Put(..) => match self.value_of(quota, req, &mut memory).await {
                Ok(value) => Some(value),
                Err(refusal) => return refusal,
            },
            Route::Get(..) => {
                let most = usize::try_from(quota.value_bytes).unwrap_or(usize::MAX).saturating_add(REQUEST_BASE_BYTES);
                if let Err(refusal) = memory.resize(most) {
                    return refused(StatusCode::SERVICE_UNAVAILABLE, "overloaded", refusal);
                }
                None
            }
            _ => None,
        };
        let answered = run(&pool, owner, quota, route, value).await;
        drop(memory);
        match answered {
            Ok(Answer::Json(status, body)) => response::json(status, &body),
            Ok(Answer::Value(bytes)) => {
                let mut answer = Response::new(response::full(bytes));
                answer.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
                answer
            }
            Err(e) => kv_error(tenant, e),
        }
    }

    /// A `PUT`'s body: at most the tenant's largest value, charged to
    /// `memory` as it arrives.
    async fn value_of(&self, quota: Quota, req: Request<Incoming>, memory: &mut Charge) -> Result<Vec<u8>, Response<Body>> {
        let max = usize::try_from(quota.value_bytes).unwrap_or(usize::MAX);
        match read_body(req, max, self.config.upload_timeout(), Some(memory)).await {
            Ok(req) => match req.into_body().collect().await {
                Ok(collected) => Ok(collected.to_bytes().to_vec()),
                Err(never) => match never {},
            },
            Err((_, refusal)) => Err(refusal),
        }
    }
}

/// A state route.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Buckets,
    Keys { bucket: String, after: Option<String>, limit: usize },
    Get(String, String),
    Put(String, String),
    Delete(String, String),
    Clear(String),
}

/// Why a path is not a state route.
#[derive(Debug, PartialEq, Eq)]
enum Unrouted {
    /// No such route (404).
    NoRoute(String),
    /// A route with a bad bucket, key or parameter (400).
    Invalid(String),
}

impl Route {
    /// The route of `method` on `rest` (from `kv`) with `query`.
    fn parse(method: &Method, rest: &[&str], query: &str) -> Result<Self, Unrouted> {
        let bucket = |name: &str| kv::check_bucket(name).map(|()| name.to_owned()).map_err(|e| Unrouted::Invalid(e.to_string()));
        let key = |segments: &[&str]| -> Result<String, Unrouted> {
            let joined = segments.join("/");
            let decoded = percent_encoding::percent_decode_str(&joined)
                .decode_utf8()
                .map_err(|_| Unrouted::Invalid("a key is UTF-8 text".to_owned()))?;
            kv::check_key(&decoded).map(|()| decoded.into_owned()).map_err(|e| Unrouted::Invalid(e.to_string()))
        };
        Ok(match (method, rest) {
            (&Method::GET, ["kv"]) => Self::Buckets,
            (&Method::GET, ["kv", b]) => {
                let (after, limit) = page(query).map_err(Unrouted::Invalid)?;
                Self::Keys { bucket: bucket(b)?, after, limit }
            }
            (&Method::GET, ["kv", b, k @ ..]) => Self::Get(bucket(b)?, key(k)?),
            (&Method::PUT, ["kv", b, k @ ..]) if !k.is_empty() => Self::Put(bucket(b)?, key(k)?),
            (&Method::DELETE, ["kv", b]) => Self::Clear(bucket(b)?),
            (&Method::DELETE, ["kv", b, k @ ..]) => Self::Delete(bucket(b)?, key(k)?),
            _ => return Err(Unrouted::NoRoute(format!("no state route {method} {}", rest.join("/")))),
        })
    }
}

/// A listing's `after` and `limit` (default [`LIST_PAGE`], at most [`MAX_PAGE`]).
fn page(query: &str) -> Result<(Option<String>, usize), String> {
    let (mut after, mut limit) = (None, LIST_PAGE);
    for (name, value) in form_urlencoded::parse(query.as_bytes()) {
        match &*name {
            "after" => {
                kv::check_key(&value).map_err(|e| format!("after is a key: {e}"))?;
                after = Some(value.into_owned());
            }
            "limit" => limit = value.parse().ok().filter(|n| (1..=MAX_PAGE).contains(n)).ok_or(format!("limit is 1 to {MAX_PAGE}"))?,
            _ => return Err(format!("unknown parameter {name:?} (after, limit)")),
        }
    }
    Ok((after, limit))
}

/// Runs `route` for `owner` on `pool` (`value`: a `PUT`'s).
async fn run(pool: &KvPool, owner: Owner, quota: Quota, route: Route, value: Option<Vec<u8>>) -> Result<Answer, KvError> {
    let tenant = Arc::clone(&owner.tenant);
    let deadline = Instant::now() + CALL_TIMEOUT;
    pool.run(&tenant, deadline, move |conn| {
        Ok(match route {
            Route::Buckets => {
                let totals = conn.totals(&owner)?;
                let buckets = conn.buckets(&owner)?;
                Answer::Json(
                    StatusCode::OK,
                    json!({ "tenant": &*owner.tenant, "keys": totals.keys, "bytes": totals.bytes, "buckets": buckets }),
                )
            }
            Route::Keys { bucket, after, limit } => {
                let keys = conn.keys(&owner, &bucket, after.as_deref(), limit)?;
                let next = (keys.len() == limit).then(|| keys.last().cloned()).flatten();
                Answer::Json(StatusCode::OK, json!({ "bucket": bucket, "keys": keys, "next": next }))
            }
            Route::Get(bucket, key) => {
                match conn.entries(&owner, &bucket, std::slice::from_ref(&key), quota.value_bytes)?.pop().flatten() {
                    Some(entry) => Answer::Value(entry.value),
                    None => Answer::Json(StatusCode::NOT_FOUND, error_body("not_found", &format!("no key {key:?} in bucket {bucket:?}"))),
                }
            }
            Route::Put(bucket, key) => {
                let totals = kv::set_many(conn, &owner, quota, &bucket, &[(key.clone(), value.unwrap_or_default())])?;
                Answer::Json(StatusCode::OK, json!({ "bucket": bucket, "key": key, "state": totals }))
            }
            Route::Delete(bucket, key) => {
                let totals = kv::delete_many(conn, &owner, &bucket, std::slice::from_ref(&key))?;
                Answer::Json(StatusCode::OK, json!({ "bucket": bucket, "deleted": key, "state": totals }))
            }
            Route::Clear(bucket) => {
                let totals = kv::clear_bucket(conn, &owner, &bucket)?;
                Answer::Json(StatusCode::OK, json!({ "bucket": bucket, "cleared": true, "state": totals }))
            }
        })
    })
    .await
}

fn error_body(code: &str, message: &str) -> serde_json::Value {
    json!({ "error": { "code": code, "message": message } })
}

/// A refusal before the body was read.
fn refused(status: StatusCode, code: &str, message: impl std::fmt::Display) -> Response<Body> {
    response::before_body(response::error(status, code, message))
}

/// A state error as the API answers it; a database's own words stay in this node's log.
fn kv_error(tenant: &str, e: KvError) -> Response<Body> {
    match e {
        KvError::Limit(m) => response::error(StatusCode::FORBIDDEN, "quota_exceeded", m),
        KvError::Invalid(m) => response::error(StatusCode::BAD_REQUEST, "invalid", m),
        KvError::Gone => response::error(StatusCode::NOT_FOUND, "not_found", format!("no tenant {tenant:?}")),
        KvError::Busy(m) => response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "busy", &m, 1),
        KvError::Store(why) | KvError::Failed(why) => {
            tracing::warn!(tenant, error = %why, "state API call failed");
            response::retry_later(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", "the state store failed; retry", 5)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_name_a_bucket_and_a_percent_decoded_key() {
        let parse = |m: &Method, path: &str, query: &str| Route::parse(m, &path.split('/').collect::<Vec<_>>(), query);
        assert_eq!(parse(&Method::GET, "kv", ""), Ok(Route::Buckets));
        assert_eq!(
            parse(&Method::GET, "kv/cache", "after=k1&limit=5"),
            Ok(Route::Keys { bucket: "cache".into(), after: Some("k1".into()), limit: 5 })
        );
        assert_eq!(parse(&Method::GET, "kv/cache/a%2Fb/c", ""), Ok(Route::Get("cache".into(), "a/b/c".into())));
        assert_eq!(parse(&Method::PUT, "kv/cache/k", ""), Ok(Route::Put("cache".into(), "k".into())));
        assert_eq!(parse(&Method::DELETE, "kv/cache", ""), Ok(Route::Clear("cache".into())));
        assert!(parse(&Method::GET, "kv/no%20spaces", "").is_err(), "a bucket's name is checked");
        assert!(parse(&Method::GET, "kv/cache", "limit=0").is_err());
        assert!(parse(&Method::GET, "kv/cache/%00", "").is_err(), "no NUL in a key");
        assert!(matches!(parse(&Method::POST, "kv/cache/k", ""), Err(Unrouted::NoRoute(_))), "no such route: 404");
        assert!(matches!(parse(&Method::GET, "kv/cache", "after=%00"), Err(Unrouted::Invalid(_))), "a cursor is a key");
    }
}
