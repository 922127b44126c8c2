//! Requests and responses over `wasi:http`, kept simple: a handler gets a
//! buffered [`Request`] and returns a [`Response`] (or an [`Error`]).
//!
//! [`serve`] does the `wasi:http` work: it checks the method and the body's
//! size before reading it, reads the body up to the limit, calls the
//! [`Handler`] and writes its answer; an error becomes a JSON error
//! response with the right status. Everything but [`serve`] and
//! [`Response::send`] is plain Rust, testable natively.

pub mod multipart;
pub mod query;

use serde::Serialize;
use wasi::http::types::{Fields, IncomingBody, IncomingRequest, Method, OutgoingBody, OutgoingResponse, ResponseOutparam};
use wasi::io::streams::StreamError;

pub use self::query::Query;
use crate::Error;

/// Default [`Handler::MAX_BODY_BYTES`]: 16 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;
/// [`Handler::METHODS`] for a handler that accepts every method (`"*"`).
pub const ANY_METHOD: &[&str] = &["*"];
/// The `multipart/form-data` field that carries the image.
pub const IMAGE_FIELD: &str = "image";
/// Bytes read from the body per call.
const READ_CHUNK: u64 = 64 * 1024;
/// Most bytes `blocking-write-and-flush` takes per call.
const WRITE_CHUNK: usize = 4096;

/// A facegate handler: one buffered request in, one response out.
///
/// Export it with [`export_handler!`](crate::export_handler).
pub trait Handler {
    /// Methods the handler accepts; others get 405 with `Allow`, before the
    /// body is read. [`ANY_METHOD`] lets every method through (a handler
    /// that routes by path and checks each route's methods itself).
    const METHODS: &'static [&'static str] = &["POST"];
    /// Largest body accepted, in bytes; a larger one gets 413 unread.
    const MAX_BODY_BYTES: usize = DEFAULT_MAX_BODY_BYTES;

    /// Answers one request. An `Err` becomes a JSON error response.
    fn handle(request: Request) -> Result<Response, Error>;
}

/// Why a request is refused before the image is looked at.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    /// The request has no image bytes (400).
    #[error("the request has no image: send the image as the body or as the form field \"image\"")]
    EmptyBody,
    /// The body is larger than the handler accepts (413).
    #[error("the body is larger than {limit} bytes")]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The body could not be read (400).
    #[error("the body could not be read: {0}")]
    BodyRead(String),
    /// The method is not one the handler accepts (405, with `Allow`).
    #[error("method {method} is not allowed; use {}", allowed.join(" or "))]
    MethodNotAllowed {
        /// The request's method.
        method: String,
        /// The methods the handler accepts.
        allowed: Vec<String>,
    },
    /// A query parameter is invalid (400).
    #[error("query parameter {name}: {message}")]
    InvalidParameter {
        /// The parameter's name.
        name: String,
        /// What is wrong, in words.
        message: String,
    },
    /// The `multipart/form-data` body is malformed (400).
    #[error("malformed multipart/form-data body: {0}")]
    InvalidMultipart(String),
    /// The form has no field of that name (400).
    #[error("the form has no field named {0:?}")]
    MissingField(String),
}

impl HttpError {
    /// An [`HttpError::InvalidParameter`] for `name`.
    pub fn invalid_parameter(name: &str, message: &str) -> Self {
        Self::InvalidParameter { name: name.to_string(), message: message.to_string() }
    }

    /// The HTTP status this error answers with.
    pub fn status(&self) -> u16 {
        match self {
            Self::BodyTooLarge { .. } => 413,
            Self::MethodNotAllowed { .. } => 405,
            _ => 400,
        }
    }

    /// The stable `snake_case` code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            Self::EmptyBody => "empty_body",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::BodyRead(_) => "body_read_failed",
            Self::MethodNotAllowed { .. } => "method_not_allowed",
            Self::InvalidParameter { .. } => "invalid_parameter",
            Self::InvalidMultipart(_) => "invalid_multipart",
            Self::MissingField(_) => "missing_field",
        }
    }
}

/// A request whose body has been read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    method: String,
    path: String,
    query: Query,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

impl Request {
    /// A request from its parts (how [`serve`] builds it; handy in tests).
    pub fn new(method: &str, path_with_query: &str, headers: Vec<(String, Vec<u8>)>, body: Vec<u8>) -> Self {
        let (path, query) = path_with_query.split_once('?').unwrap_or((path_with_query, ""));
        Self { method: method.to_ascii_uppercase(), path: path.to_string(), query: Query::parse(query), headers, body }
    }

    /// The method, upper case (`POST`).
    pub fn method(&self) -> &str {
        &self.method
    }

    /// The path, without the query.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The decoded query parameters.
    pub fn query(&self) -> &Query {
        &self.query
    }

    /// The first header of that name (case-insensitive), if it is UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    /// All headers, as received.
    pub fn headers(&self) -> &[(String, Vec<u8>)] {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The parsed `Content-Type`, if any.
    pub fn content_type(&self) -> Option<ContentType> {
        self.header("content-type").map(ContentType::parse)
    }

    /// The image: the `image` field of a `multipart/form-data` body, else
    /// the whole body. [`HttpError::EmptyBody`] when there are no bytes.
    pub fn image_bytes(&self) -> Result<&[u8], HttpError> {
        if self.body.is_empty() {
            return Err(HttpError::EmptyBody);
        }
        let bytes = match self.content_type() {
            Some(ct) if ct.mime == "multipart/form-data" => {
                let boundary =
                    ct.param("boundary").ok_or_else(|| HttpError::InvalidMultipart("the Content-Type has no boundary".into()))?;
                multipart::field(&self.body, boundary, IMAGE_FIELD)?
            }
            _ => &self.body,
        };
        if bytes.is_empty() {
            return Err(HttpError::EmptyBody);
        }
        Ok(bytes)
    }
}

/// A parsed `Content-Type` (or any `type; key=value` header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContentType {
    /// The media type, lower case (`multipart/form-data`).
    pub mime: String,
    /// Parameters, keys lower case, values unquoted.
    pub params: Vec<(String, String)>,
}

impl ContentType {
    /// Parses `type/subtype; key=value; key="quoted value"`.
    pub fn parse(value: &str) -> Self {
        let (mime, params) = value.split_once(';').unwrap_or((value, ""));
        Self { mime: mime.trim().to_ascii_lowercase(), params: parse_params(params) }
    }

    /// The value of a parameter (key case-insensitive).
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params.iter().find(|(k, _)| k.eq_ignore_ascii_case(key)).map(|(_, v)| v.as_str())
    }
}

/// Parses `; key=value; key="quoted \"value\""` parameters. Keys are lower
/// cased; quoted values may contain `;` and backslash escapes.
pub(crate) fn parse_params(mut rest: &str) -> Vec<(String, String)> {
    let mut params = Vec::new();
    loop {
        rest = rest.trim_start_matches(|c: char| c == ';' || c.is_whitespace());
        let Some((key, after)) = rest.split_once('=') else {
            return params;
        };
        let (value, next) = match after.strip_prefix('"') {
            Some(quoted) => unquote(quoted),
            None => {
                let end = after.find(';').unwrap_or(after.len());
                (after[..end].trim().to_string(), &after[end..])
            }
        };
        params.push((key.trim().to_ascii_lowercase(), value));
        rest = next;
    }
}

/// Reads a quoted string's content (after its opening quote); returns it
/// and what follows the closing quote.
fn unquote(quoted: &str) -> (String, &str) {
    let mut value = String::new();
    let mut chars = quoted.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return (value, &quoted[i + 1..]),
            '\\' => value.extend(chars.next().map(|(_, c)| c)),
            c => value.push(c),
        }
    }
    (value, "")
}

/// A response to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status.
    pub status: u16,
    /// Headers (names lower case by convention); `content-length` is added
    /// when sending.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Response {
    /// A response with a body of the given media type.
    pub fn bytes(status: u16, content_type: &str, body: Vec<u8>) -> Self {
        Self { status, headers: vec![("content-type".into(), content_type.into())], body }
    }

    /// A JSON response.
    pub fn json<T: Serialize + ?Sized>(status: u16, value: &T) -> Self {
        match serde_json::to_vec(value) {
            Ok(body) => Self::bytes(status, "application/json", body),
            Err(e) => Self::error(&Error::custom(500, "internal", format!("cannot serialise: {e}"))),
        }
    }

    /// `{"error":{"code":…,"message":…}}` with the error's status and
    /// headers (`Allow`, `Retry-After`).
    pub fn error(error: &Error) -> Self {
        let body = serde_json::json!({
            "error": { "code": error.code(), "message": error.to_string() }
        });
        let mut response = Self::bytes(error.status(), "application/json", body.to_string().into_bytes());
        response.headers.extend(error.headers());
        response
    }

    /// Adds a header.
    pub fn with_header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_string(), value.into()));
        self
    }

    /// The first header of that name (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Sends the response through `wasi:http` (inside a component only).
    pub fn send(self, out: ResponseOutparam) {
        let mut fields: Vec<(String, Vec<u8>)> = self.headers.into_iter().map(|(n, v)| (n, v.into_bytes())).collect();
        fields.push(("content-length".into(), self.body.len().to_string().into_bytes()));
        let headers = Fields::from_list(&fields).unwrap_or_else(|e| {
            eprintln!("facegate-guest-sdk: invalid response header ({e:?}); sending none");
            Fields::new()
        });
        let response = OutgoingResponse::new(headers);
        if response.set_status_code(self.status).is_err() {
            eprintln!("facegate-guest-sdk: invalid status {}; sending 200", self.status);
        }
        let body = response.body();
        ResponseOutparam::set(out, Ok(response));
        match body {
            Ok(body) => {
                if let Err(e) = write_body(body, &self.body) {
                    eprintln!("facegate-guest-sdk: writing the response body failed: {e}");
                }
            }
            Err(()) => eprintln!("facegate-guest-sdk: the response body was already taken"),
        }
    }
}

fn write_body(body: OutgoingBody, bytes: &[u8]) -> Result<(), String> {
    let stream = body.write().map_err(|()| "the body stream was already taken".to_string())?;
    for chunk in bytes.chunks(WRITE_CHUNK) {
        stream.blocking_write_and_flush(chunk).map_err(|e| format!("{e:?}"))?;
    }
    drop(stream); // the stream must be gone before the body is finished
    OutgoingBody::finish(body, None).map_err(|e| format!("{e:?}"))
}

/// Runs handler `H` on one `wasi:http` request (what
/// [`export_handler!`](crate::export_handler) calls).
pub fn serve<H: Handler>(request: IncomingRequest, out: ResponseOutparam) {
    let response = match receive::<H>(&request) {
        Ok(request) => H::handle(request).unwrap_or_else(|e| Response::error(&e)),
        Err(e) => Response::error(&e.into()),
    };
    response.send(out);
}

/// Checks the method and size, then reads the body into a [`Request`].
fn receive<H: Handler>(request: &IncomingRequest) -> Result<Request, HttpError> {
    let method = method_name(&request.method());
    check_method(&method, H::METHODS)?;
    let headers = request.headers().entries();
    let announced = content_length(&headers);
    check_length(announced, H::MAX_BODY_BYTES)?;
    let body = read_body(request, announced.unwrap_or(0), H::MAX_BODY_BYTES)?;
    let path = request.path_with_query().unwrap_or_else(|| "/".into());
    Ok(Request::new(&method, &path, headers, body))
}

fn method_name(method: &Method) -> String {
    match method {
        Method::Get => "GET".into(),
        Method::Head => "HEAD".into(),
        Method::Post => "POST".into(),
        Method::Put => "PUT".into(),
        Method::Delete => "DELETE".into(),
        Method::Connect => "CONNECT".into(),
        Method::Options => "OPTIONS".into(),
        Method::Trace => "TRACE".into(),
        Method::Patch => "PATCH".into(),
        Method::Other(other) => other.to_ascii_uppercase(),
    }
}

/// 405 unless `method` is one of `allowed` (`"*"` allows any).
pub fn check_method(method: &str, allowed: &[&str]) -> Result<(), HttpError> {
    if allowed.iter().any(|m| *m == "*" || m.eq_ignore_ascii_case(method)) {
        return Ok(());
    }
    Err(HttpError::MethodNotAllowed { method: method.to_string(), allowed: allowed.iter().map(|m| m.to_string()).collect() })
}

/// The `Content-Length` header's value, if present and a number.
fn content_length(headers: &[(String, Vec<u8>)]) -> Option<usize> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
        .and_then(|v| v.trim().parse().ok())
}

/// 413 when the announced length is over the limit.
fn check_length(announced: Option<usize>, limit: usize) -> Result<(), HttpError> {
    match announced {
        Some(length) if length > limit => Err(HttpError::BodyTooLarge { limit }),
        _ => Ok(()),
    }
}

/// Reads the whole body, failing as soon as it passes `limit` bytes.
fn read_body(request: &IncomingRequest, expected: usize, limit: usize) -> Result<Vec<u8>, HttpError> {
    let failed = |what: &str| HttpError::BodyRead(what.to_string());
    let body = request.consume().map_err(|()| failed("the body was already consumed"))?;
    let stream = body.stream().map_err(|()| failed("the body stream was already taken"))?;
    let mut bytes = Vec::with_capacity(expected.min(limit));
    loop {
        match stream.blocking_read(READ_CHUNK) {
            Ok(chunk) => bytes.extend_from_slice(&chunk),
            Err(StreamError::Closed) => break,
            Err(StreamError::LastOperationFailed(e)) => return Err(failed(&e.to_debug_string())),
        }
        if bytes.len() > limit {
            return Err(HttpError::BodyTooLarge { limit });
        }
    }
    drop(stream); // the stream must be gone before the body is finished
    let _trailers = IncomingBody::finish(body);
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(content_type: Option<&str>, body: &[u8]) -> Request {
        let headers = content_type.map(|ct| vec![("Content-Type".to_string(), ct.as_bytes().to_vec())]).unwrap_or_default();
        Request::new("post", "/detect?threshold=0.6", headers, body.to_vec())
    }

    #[test]
    fn request_parts_are_parsed() {
        let r = request(Some("image/jpeg"), b"abc");
        assert_eq!((r.method(), r.path()), ("POST", "/detect"));
        assert_eq!(r.query().get("threshold").expect("once"), Some("0.6"));
        assert_eq!(r.header("content-type"), Some("image/jpeg"));
        assert_eq!(r.image_bytes().expect("bytes"), b"abc");
    }

    #[test]
    fn empty_bodies_and_empty_fields_are_empty_body() {
        assert_eq!(request(None, b"").image_bytes().expect_err("must fail"), HttpError::EmptyBody);
        let body = b"--b\r\nContent-Disposition: form-data; name=\"image\"\r\n\r\n\r\n--b--";
        let r = request(Some("multipart/form-data; boundary=b"), body);
        assert_eq!(r.image_bytes().expect_err("must fail").code(), "empty_body");
    }

    #[test]
    fn multipart_bodies_yield_the_image_field() {
        let body = b"--xyz\r\nContent-Disposition: form-data; name=\"image\"; filename=\"a.png\"\r\n\r\nPNG!\r\n--xyz--\r\n";
        let r = request(Some("Multipart/Form-Data; boundary=\"xyz\""), body);
        assert_eq!(r.image_bytes().expect("field"), b"PNG!");
        let no_boundary = request(Some("multipart/form-data"), body);
        assert_eq!(no_boundary.image_bytes().expect_err("must fail").code(), "invalid_multipart");
    }

    #[test]
    fn content_type_params_handle_quotes() {
        let ct = ContentType::parse("multipart/form-data; Boundary=\"a;b \\\"c\\\"\"; charset=utf-8");
        assert_eq!(ct.mime, "multipart/form-data");
        assert_eq!(ct.param("boundary"), Some("a;b \"c\""));
        assert_eq!(ct.param("charset"), Some("utf-8"));
        assert_eq!(ContentType::parse("image/png").params, vec![]);
    }

    #[test]
    fn method_and_length_checks() {
        assert!(check_method("POST", &["POST"]).is_ok());
        assert!(check_method("PROPFIND", ANY_METHOD).is_ok());
        let error = check_method("GET", &["POST"]).expect_err("must fail");
        assert_eq!((error.status(), error.code()), (405, "method_not_allowed"));
        assert_eq!(check_length(Some(11), 10), Err(HttpError::BodyTooLarge { limit: 10 }));
        assert!(check_length(Some(10), 10).is_ok() && check_length(None, 10).is_ok());
        let headers = vec![("Content-Length".to_string(), b" 42 ".to_vec())];
        assert_eq!(content_length(&headers), Some(42));
    }

    #[test]
    fn error_responses_are_json_with_status_and_headers() {
        let error = Error::from(HttpError::MethodNotAllowed { method: "GET".into(), allowed: vec!["POST".into()] });
        let response = Response::error(&error);
        assert_eq!(response.status, 405);
        assert_eq!(response.header("allow"), Some("POST"));
        assert_eq!(response.header("content-type"), Some("application/json"));
        let json: serde_json::Value = serde_json::from_slice(&response.body).expect("json");
        assert_eq!(json["error"]["code"], "method_not_allowed");
        assert!(json["error"]["message"].as_str().expect("text").contains("GET"));
    }
}
