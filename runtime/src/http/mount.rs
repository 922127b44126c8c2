//! Where a request meets its handler, and the path the guest sees.
//!
//! A handler is mounted at `/v1/{tenant}/{handler}` and answers everything
//! below it (`/v1/{tenant}/{handler}/{rest…}`), or at `/` of a hostname the
//! operator routed to it. Its guest sees the path below the mount
//! (`/{rest…}` with the query, `/` for the mount itself), as a component
//! written for `wasmtime serve` expects, or the whole path when its version
//! was deployed with `path=full`; the mount and the request's own URL go
//! in headers ([`BASE_PATH_HEADER`], [`PATH_INFO_HEADER`],
//! [`FULL_URL_HEADER`]) that replace any a client sent.
//!
//! Dot segments (`.`, `..`, also percent-encoded) below the mount are
//! resolved inside it: `..` never climbs above the mount's root. In the
//! mount's own segments they are refused (400): `/v1/acme/../bob/x` names
//! no mount.

use hyper::header::{HeaderName, HeaderValue};
use hyper::http::uri::PathAndQuery;
use hyper::{Request, Uri};

use crate::sandbox::handler::GuestPath;

/// The mount the handler answers under: `/v1/{tenant}/{handler}`, or `/`
/// under a routed hostname.
pub const BASE_PATH_HEADER: &str = "x-facegate-base-path";
/// The path below the mount, without the query: `/` for the mount itself.
pub const PATH_INFO_HEADER: &str = "x-facegate-path-info";
/// The URL the client asked for: scheme, host, the whole path and the query.
pub const FULL_URL_HEADER: &str = "x-facegate-full-url";

/// A request's place under a handler's mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Where the handler is mounted: `/v1/{tenant}/{handler}`, or `/`.
    pub base: String,
    /// The path below the mount, dot segments resolved: `/` or `/rest…`.
    pub rest: String,
    /// The route's template, for traces (`http.route`).
    pub route: &'static str,
}

/// Why a path names no mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadPath(pub String);

/// The mount of a `/v1/{tenant}/{handler}[/{rest…}]` path (as received,
/// percent-encoded): tenant, handler and the mount. `None` for a path of
/// another shape; a dot segment among the mount's own is a [`BadPath`].
pub fn parse_v1(path: &str) -> Option<Result<(String, String, Mount), BadPath>> {
    let below = path.strip_prefix("/v1/")?;
    let mut parts = below.splitn(3, '/');
    let (tenant, handler) = (parts.next()?, parts.next()?);
    if tenant.is_empty() || handler.is_empty() {
        return None;
    }
    if is_dot_segment(tenant) || is_dot_segment(handler) {
        return Some(Err(BadPath(format!("{path:?} climbs out of /v1/{{tenant}}/{{handler}}: dot segments name no handler"))));
    }
    let rest = parts.next().map_or_else(|| "/".to_owned(), |rest| resolve_dots(&format!("/{rest}")));
    let route = if rest == "/" { "/v1/{tenant}/{handler}" } else { "/v1/{tenant}/{handler}/{path}" };
    let mount = Mount { base: format!("/v1/{tenant}/{handler}"), rest, route };
    Some(Ok((tenant.to_owned(), handler.to_owned(), mount)))
}

/// The mount of a request to a routed hostname: the whole path is below it.
pub fn at_root(path: &str) -> Mount {
    Mount { base: "/".to_owned(), rest: resolve_dots(path), route: "/{path}" }
}

impl Mount {
    /// The path the guest sees under `guest_path`, with `query`.
    fn guest_path_and_query(&self, guest_path: GuestPath, query: Option<&str>) -> String {
        let path = match guest_path {
            GuestPath::Full if self.base != "/" => match self.rest.as_str() {
                "/" => self.base.clone(),
                rest => format!("{}{rest}", self.base),
            },
            _ => self.rest.clone(),
        };
        match query {
            Some(query) => format!("{path}?{query}"),
            None => path,
        }
    }

    /// Gives `req` the URI its guest sees and the mount's headers (those a
    /// client sent are replaced); `scheme` is the connection's. A value a
    /// header cannot carry is left out; a URI that cannot be built leaves
    /// the request's own (never the case for a path hyper parsed).
    pub fn apply<B>(&self, req: &mut Request<B>, guest_path: GuestPath, scheme: &str) {
        let full_url = match req.uri().authority().map(|a| a.as_str().to_owned()).or_else(|| host_header(req)) {
            Some(host) => format!("{scheme}://{host}{}", req.uri().path_and_query().map_or("/", |p| p.as_str())),
            None => req.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned(),
        };
        if let Ok(guest) = PathAndQuery::try_from(self.guest_path_and_query(guest_path, req.uri().query())) {
            // Scheme and authority stay as the host's wasi:http reads them (the `Host` header).
            let mut parts = req.uri().clone().into_parts();
            parts.path_and_query = Some(guest);
            if let Ok(uri) = Uri::from_parts(parts) {
                *req.uri_mut() = uri;
            }
        }
        let headers = req.headers_mut();
        for (name, value) in [(BASE_PATH_HEADER, self.base.as_str()), (PATH_INFO_HEADER, self.rest.as_str()), (FULL_URL_HEADER, &full_url)]
        {
            // `insert` drops any values a client sent under the name.
            let name = HeaderName::from_static(name);
            match HeaderValue::from_str(value) {
                Ok(value) => headers.insert(name, value),
                Err(_) => headers.remove(name),
            };
        }
    }
}

fn host_header<B>(req: &Request<B>) -> Option<String> {
    req.headers().get(hyper::header::HOST)?.to_str().ok().map(str::to_owned)
}

/// How many dots a dot segment (`.` or `..`, each dot also as `%2e` or
/// `%2E`) is made of; `None` for any other segment.
fn dots(segment: &str) -> Option<usize> {
    let (mut rest, mut count) = (segment.as_bytes(), 0);
    while !rest.is_empty() {
        rest = match rest {
            [b'.', tail @ ..] => tail,
            [b'%', b'2', b'e' | b'E', tail @ ..] => tail,
            _ => return None,
        };
        count += 1;
    }
    (1..=2).contains(&count).then_some(count)
}

/// Whether a segment is `.` or `..`, also percent-encoded.
fn is_dot_segment(segment: &str) -> bool {
    dots(segment).is_some()
}

/// `path` (starting with `/`) with its dot segments resolved (RFC 3986
/// 5.2.4) and `..` stopping at the root: the result starts with `/` and
/// never climbs above it. Other segments, empty ones too, are kept as sent.
pub fn resolve_dots(path: &str) -> String {
    if path.starts_with('/') && !path.split('/').any(is_dot_segment) {
        // Most paths: nothing to resolve.
        return path.to_owned();
    }
    let segments: Vec<&str> = path.strip_prefix('/').unwrap_or(path).split('/').collect();
    let last = segments.len() - 1;
    let mut kept: Vec<&str> = Vec::with_capacity(segments.len());
    let mut trailing_slash = false;
    for (i, segment) in segments.iter().enumerate() {
        match dots(segment) {
            Some(1) => trailing_slash = i == last,
            Some(_) => {
                kept.pop();
                trailing_slash = i == last;
            }
            None => {
                kept.push(segment);
                trailing_slash = false;
            }
        }
    }
    let mut resolved = format!("/{}", kept.join("/"));
    if trailing_slash && !resolved.ends_with('/') {
        resolved.push('/');
    }
    resolved
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v1(path: &str) -> Option<Result<(String, String, Mount), BadPath>> {
        parse_v1(path)
    }

    #[test]
    fn everything_below_a_handler_is_its_own() {
        let (tenant, handler, mount) = v1("/v1/acme/faces").unwrap().unwrap();
        assert_eq!((tenant.as_str(), handler.as_str(), mount.base.as_str(), mount.rest.as_str()), ("acme", "faces", "/v1/acme/faces", "/"));
        assert_eq!(v1("/v1/acme/faces/").unwrap().unwrap().2.rest, "/");
        assert_eq!(v1("/v1/acme/faces/v2/detect").unwrap().unwrap().2.rest, "/v2/detect");
        assert_eq!(v1("/v1/acme/faces/a%20b//c/").unwrap().unwrap().2.rest, "/a%20b//c/");
        for other in ["/v1/me", "/v1/models", "/v1/acme", "/v1/acme/", "/v1//faces", "/v2/acme/faces", "/admin/v1/tenants"] {
            assert!(v1(other).is_none(), "{other}");
        }
    }

    #[test]
    fn dot_segments_stay_inside_the_mount() {
        for (path, rest) in [
            ("/v1/acme/faces/../../bob/x", "/bob/x"),
            ("/v1/acme/faces/a/./b/../c", "/a/c"),
            ("/v1/acme/faces/%2e%2E/%2E/x", "/x"),
            ("/v1/acme/faces/a/..", "/"),
            ("/v1/acme/faces/a/b/..", "/a/"),
            ("/v1/acme/faces/..", "/"),
            ("/v1/acme/faces/...", "/..."),
        ] {
            assert_eq!(v1(path).unwrap().unwrap().2.rest, rest, "{path}");
        }
        for climbing in ["/v1/acme/../bob/faces", "/v1/../acme/faces", "/v1/acme/%2e%2e/x", "/v1/acme/./faces"] {
            assert!(v1(climbing).unwrap().is_err(), "{climbing}");
        }
        assert_eq!(at_root("/../../etc/passwd").rest, "/etc/passwd");
        assert_eq!(at_root("/").rest, "/");
    }

    fn applied(path_and_query: &str, mount: &Mount, guest_path: GuestPath) -> Request<()> {
        let mut req =
            Request::builder().uri(path_and_query).header("host", "gw.example:8080").header(PATH_INFO_HEADER, "/forged").body(()).unwrap();
        mount.apply(&mut req, guest_path, "https");
        req
    }

    #[test]
    fn the_guest_sees_the_path_below_its_mount_and_the_mount_in_headers() {
        let (_, _, mount) = v1("/v1/acme/faces/v2/detect").unwrap().unwrap();
        let req = applied("/v1/acme/faces/v2/detect?x=1&y=%20", &mount, GuestPath::Relative);
        assert_eq!(req.uri().path_and_query().unwrap().as_str(), "/v2/detect?x=1&y=%20");
        let header = |name: &str| req.headers().get(name).unwrap().to_str().unwrap().to_owned();
        assert_eq!(header(BASE_PATH_HEADER), "/v1/acme/faces");
        assert_eq!(header(PATH_INFO_HEADER), "/v2/detect", "the client's own value is replaced");
        assert_eq!(req.headers().get_all(PATH_INFO_HEADER).iter().count(), 1);
        assert_eq!(header(FULL_URL_HEADER), "https://gw.example:8080/v1/acme/faces/v2/detect?x=1&y=%20");

        let full = applied("/v1/acme/faces/v2/detect?x=1", &mount, GuestPath::Full);
        assert_eq!(full.uri().path_and_query().unwrap().as_str(), "/v1/acme/faces/v2/detect?x=1");
        let (_, _, at_mount) = v1("/v1/acme/faces").unwrap().unwrap();
        assert_eq!(applied("/v1/acme/faces?q", &at_mount, GuestPath::Relative).uri().path_and_query().unwrap().as_str(), "/?q");
        assert_eq!(applied("/v1/acme/faces", &at_mount, GuestPath::Full).uri().path(), "/v1/acme/faces");
    }

    #[test]
    fn under_a_hostname_the_guest_sees_the_whole_path() {
        let mount = at_root("/health");
        for guest_path in [GuestPath::Relative, GuestPath::Full] {
            let req = applied("/health?deep=1", &mount, guest_path);
            assert_eq!(req.uri().path_and_query().unwrap().as_str(), "/health?deep=1");
            assert_eq!(req.headers().get(BASE_PATH_HEADER).unwrap(), "/");
        }
    }
}
