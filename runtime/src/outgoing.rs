//! Outgoing HTTP of tenants granted it (`outgoing_http`): where a request
//! may go, and the client that sends it.
//!
//! A granted handler must not reach what only the host can: the gateway's
//! own listeners and admin API on loopback, the cloud's metadata service
//! (169.254.169.254, credentials), databases and other services on private
//! networks. So the name is resolved here, every address is checked, and
//! the connection goes to a checked address: no second lookup that DNS
//! rebinding could answer differently. By default only public addresses
//! are allowed; `--outgoing-allow-private` lifts that for deployments whose
//! handlers call internal services on purpose.
//!
//! This host's own interface addresses are refused too, public ones
//! included: through them a handler would reach services bound to all
//! addresses (`0.0.0.0`) from inside, past any firewall in front.
//!
//! Name lookups run on blocking threads and keep running after a request
//! gives up, so at most [`MAX_LOOKUPS`] run at once (a lookup holds its
//! place until its thread returns): a guest cannot fill the pool the admin
//! API also uses. One tenant holds at most [`TENANT_LOOKUPS`] of them: a
//! tenant whose names never answer (its own DNS server, say) waits on its
//! own share and leaves the other granted tenants theirs.
//!
//! The client follows wasmtime-wasi-http's `default_send_request` (HTTP/1.1,
//! TLS by rustls; the same timeouts), trying each allowed address in turn;
//! connecting (lookup, TCP, TLS, HTTP handshake) must finish within the
//! connect timeout, and no timeout runs past the request's deadline.

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::{Pin, pin};
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use wasmtime_wasi_http::{Error as HttpError, RequestOptions, WasiBody};

/// Name lookups running at once, all requests together.
pub const MAX_LOOKUPS: usize = 16;
/// Name lookups one tenant's requests may run at once.
pub const TENANT_LOOKUPS: usize = MAX_LOOKUPS / 4;

/// Which destinations a granted handler may reach.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Egress {
    /// Also loopback, private, link-local and other non-public addresses.
    pub allow_private: bool,
}

/// What the client hands back: the response, and the connection's I/O,
/// which the caller drives while the body is read.
pub type Sent = (hyper::Response<WasiBody>, Box<dyn Future<Output = Result<(), HttpError>> + Send>);

/// Sends `tenant`'s `request` to a destination `egress` allows, giving up
/// at `deadline`.
pub async fn send(
    request: hyper::Request<WasiBody>,
    options: Option<RequestOptions>,
    egress: Egress,
    tenant: Arc<str>,
    deadline: Instant,
) -> Result<Sent, HttpError> {
    let uri = request.uri();
    let authority = uri.authority().ok_or(HttpError::HttpRequestUriInvalid)?;
    let tls = uri.scheme() == Some(&hyper::http::uri::Scheme::HTTPS);
    let default_port = if tls { 443 } else { 80 };
    let port = match authority.port_u16() {
        Some(port) => port,
        // `host:99999` or `host:abc`: the URI crate keeps them, but has no port.
        None if has_port_part(authority.as_str()) => return Err(HttpError::HttpRequestUriInvalid),
        None => default_port,
    };
    let host = authority.host().to_owned();
    let timeouts = Timeouts::new(options, deadline);
    let connect = async {
        let addrs = destinations(&host, port, egress, &tenant).await?;
        let tcp = connect_any(&addrs).await?;
        let stream: Box<dyn Stream> = if tls { Box::new(tls_connect(&host, tcp).await?) } else { Box::new(tcp) };
        Ok::<_, HttpError>(hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?)
    };
    let (mut sender, conn) = tokio::time::timeout(timeouts.connect, connect).await.map_err(|_| HttpError::ConnectionTimeout)??;
    let request = origin_form(request);
    let send = async move {
        let response = tokio::time::timeout(timeouts.first_byte, sender.send_request(request))
            .await
            .map_err(|_| HttpError::ConnectionReadTimeout)??;
        Ok::<_, HttpError>(response.map(|incoming| TimedBody::new(incoming, timeouts.between_bytes).boxed_unsync()))
    };
    let (response, conn) = drive_until_response(send, conn).await?;
    let io = async move {
        match conn {
            Some(conn) => conn.await.map_err(|e| if e.is_timeout() { HttpError::HttpResponseTimeout } else { e.into() }),
            None => Ok(()),
        }
    };
    Ok((response, Box::new(io)))
}

/// Whether `authority` (`[userinfo@]host[:port]`) has a port part.
fn has_port_part(authority: &str) -> bool {
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, rest)| rest);
    let after_host = host_port.rsplit_once(']').map_or(host_port, |(_, rest)| rest);
    after_host.contains(':')
}

/// `host` without the brackets of an IPv6 literal.
fn bare_host(host: &str) -> &str {
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}

/// The addresses to try: `host` resolved (or parsed, for an IP literal),
/// those `egress` allows; `DestinationIpProhibited` when it allows none.
async fn destinations(host: &str, port: u16, egress: Egress, tenant: &Arc<str>) -> Result<Vec<SocketAddr>, HttpError> {
    let addrs: Vec<SocketAddr> = match bare_host(host).parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => lookup(host.to_owned(), port, tenant).await?,
    };
    let own = if egress.allow_private { Vec::new() } else { own_addresses() };
    let allowed: Vec<SocketAddr> = addrs.into_iter().filter(|a| allowed(a.ip(), egress, &own)).collect();
    if allowed.is_empty() {
        return Err(HttpError::DestinationIpProhibited);
    }
    Ok(allowed)
}

/// Whether a granted request may go to `ip`: anywhere with private
/// addresses allowed; else a public address that is not one of `own`.
fn allowed(ip: IpAddr, egress: Egress, own: &[IpAddr]) -> bool {
    egress.allow_private || (is_public(ip) && !own.contains(&ip.to_canonical()))
}

/// This host's interface addresses, read at each request (interfaces come
/// and go; reading them is one netlink dump).
fn own_addresses() -> Vec<IpAddr> {
    match if_addrs::get_if_addrs() {
        Ok(interfaces) => interfaces.iter().map(|i| i.ip().to_canonical()).collect(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read this host's interface addresses");
            Vec::new()
        }
    }
}

/// `host`'s addresses, resolved on a blocking thread that holds one of
/// `tenant`'s [`TENANT_LOOKUPS`] places and one of all [`MAX_LOOKUPS`]
/// until it returns, even if the request gave up.
async fn lookup(host: String, port: u16, tenant: &Arc<str>) -> Result<Vec<SocketAddr>, HttpError> {
    static PLACES: LazyLock<LookupPlaces> = LazyLock::new(|| LookupPlaces::new(MAX_LOOKUPS, TENANT_LOOKUPS));
    let places = PLACES.take(tenant).await.map_err(|_| HttpError::DnsTimeout)?;
    let found = tokio::task::spawn_blocking(move || {
        let _held = places;
        std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), port)).map(Iterator::collect::<Vec<_>>)
    })
    .await
    .map_err(|_| HttpError::DnsTimeout)?;
    let addrs = found.map_err(|e| HttpError::DnsError { rcode: Some(e.to_string()), info_code: None })?;
    if addrs.is_empty() {
        return Err(HttpError::DestinationNotFound);
    }
    Ok(addrs)
}

/// Places for name lookups: `total` for all tenants together, at most
/// `share` of them for each.
struct LookupPlaces {
    all: Arc<Semaphore>,
    share: usize,
    /// Each tenant with lookups running or waiting: its share's places.
    tenants: Mutex<HashMap<Arc<str>, Arc<Semaphore>>>,
}

/// A lookup's places, its tenant's and one of all, given back when dropped.
type Places = (OwnedSemaphorePermit, OwnedSemaphorePermit);

impl LookupPlaces {
    fn new(total: usize, share: usize) -> Self {
        Self { all: Arc::new(Semaphore::new(total)), share, tenants: Mutex::default() }
    }

    /// Waits for a place of `tenant`'s share, then for one of all: a
    /// tenant at its share waits without holding a place others need.
    async fn take(&self, tenant: &Arc<str>) -> Result<Places, AcquireError> {
        let own = self.share_of(tenant).acquire_owned().await?;
        let any = Arc::clone(&self.all).acquire_owned().await?;
        Ok((own, any))
    }

    /// `tenant`'s share, made on its first lookup; the shares of tenants
    /// with no lookup running or waiting (nobody else holds them) are
    /// dropped here, so the map holds only tenants with lookups.
    fn share_of(&self, tenant: &Arc<str>) -> Arc<Semaphore> {
        // Nothing panics while the map is held, so a poisoned lock still holds a sound map.
        let mut tenants = self.tenants.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        tenants.retain(|_, share| Arc::strong_count(share) > 1);
        Arc::clone(tenants.entry(Arc::clone(tenant)).or_insert_with(|| Arc::new(Semaphore::new(self.share))))
    }
}

/// A connection to the first of `addrs` that accepts one.
async fn connect_any(addrs: &[SocketAddr]) -> Result<TcpStream, HttpError> {
    let mut last = None;
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(stream) => return Ok(stream),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or(HttpError::DestinationUnavailable, HttpError::Connect))
}

/// Whether `ip` is a public (globally routed) address: not loopback,
/// private, shared (CGNAT), link-local, unique-local, multicast,
/// documentation, benchmarking, reserved or unspecified; IPv4 inside IPv6
/// (mapped, compatible, NAT64, 6to4) is judged as the IPv4 it carries.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => embedded_v4(v6).map_or_else(|| is_public_v6(v6), is_public_v4),
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    let special = ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_broadcast()
        || ip.is_multicast()
        || ip.is_documentation()
        || a == 0
        || (a == 100 && b & 0xC0 == 64) // shared address space (CGNAT), 100.64/10
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments, 192.0.0/24
        || (a == 198 && b & 0xFE == 18) // benchmarking, 198.18/15
        || a >= 240; // reserved
    !special
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    let s = ip.segments();
    let special = ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || s[0] & 0xFE00 == 0xFC00 // unique local, fc00::/7
        || s[0] & 0xFFC0 == 0xFE80 // link-local, fe80::/10
        || s[0] & 0xFFC0 == 0xFEC0 // site-local (deprecated), fec0::/10
        || (s[0] == 0x2001 && s[1] == 0x0DB8) // documentation
        || s[0] & 0xFFF0 == 0x3FF0 // documentation, 3fff::/20
        || (s[0] == 0x2001 && s[1] == 0) // Teredo, 2001::/32: an obfuscated IPv4 inside
        || (s[0] == 0x2001 && s[1] == 2 && s[2] == 0) // benchmarking, 2001:2::/48
        || (s[0] == 0x64 && s[1] == 0xFF9B && s[2] == 1) // local-use NAT64, 64:ff9b:1::/48 (RFC 8215)
        || (s[0..4] == [0, 0, 0, 0] && s[4] == 0xFFFF && s[5] == 0) // IPv4-translated, ::ffff:0:0:0/96
        || (s[0] == 0x0100 && s[1..4] == [0, 0, 0]); // discard-only, 100::/64
    !special
}

/// The IPv4 address an IPv6 one carries: mapped (`::ffff:a.b.c.d`),
/// compatible (`::a.b.c.d`), NAT64 (`64:ff9b::/96`) or 6to4 (`2002::/16`).
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let tail = |hi: u16, lo: u16| Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
    match s {
        [0, 0, 0, 0, 0, 0xFFFF, hi, lo] | [0, 0, 0, 0, 0, 0, hi, lo] if !ip.is_loopback() && !ip.is_unspecified() => Some(tail(hi, lo)),
        [0x64, 0xFF9B, 0, 0, 0, 0, hi, lo] => Some(tail(hi, lo)),
        [0x2002, hi, lo, ..] => Some(tail(hi, lo)),
        _ => None,
    }
}

/// The client's timeouts: the guest's options (600 s each by default, as
/// wasmtime's client), none past the request's deadline.
#[derive(Clone, Copy)]
struct Timeouts {
    connect: Duration,
    first_byte: Duration,
    between_bytes: Duration,
}

impl Timeouts {
    fn new(options: Option<RequestOptions>, deadline: Instant) -> Self {
        const DEFAULT: Duration = Duration::from_secs(600);
        let left = deadline.saturating_duration_since(Instant::now());
        let pick = |chosen: Option<Duration>| chosen.unwrap_or(DEFAULT).min(left);
        Self {
            connect: pick(options.and_then(|o| o.connect_timeout)),
            first_byte: pick(options.and_then(|o| o.first_byte_timeout)),
            // Tokio's interval panics on zero.
            between_bytes: pick(options.and_then(|o| o.between_bytes_timeout)).max(Duration::from_nanos(1)),
        }
    }
}

/// What a connection runs over: TCP, or TLS over TCP.
trait Stream: AsyncRead + AsyncWrite + Send + Sync + Unpin + 'static {}
impl<T> Stream for T where T: AsyncRead + AsyncWrite + Send + Sync + Unpin + 'static {}

/// TLS to `host` over `tcp`, verified against the system's roots.
async fn tls_connect(host: &str, tcp: TcpStream) -> Result<impl Stream, HttpError> {
    let server = ServerName::try_from(bare_host(host).to_owned()).map_err(HttpError::InvalidDnsNameError)?;
    // The first use reads the system's certificates: on a blocking thread.
    let config = match TLS_CONFIG.get() {
        Some(config) => config.clone(),
        None => tokio::task::spawn_blocking(tls_config).await.map_err(|_| HttpError::ConfigurationError)?,
    };
    let config = config.ok_or(HttpError::ConfigurationError)?;
    tokio_rustls::TlsConnector::from(config).connect(server, tcp).await.map_err(HttpError::Tls)
}

/// See [`tls_config`].
static TLS_CONFIG: OnceLock<Option<Arc<ClientConfig>>> = OnceLock::new();

/// The client TLS configuration, built once: ring, the system's roots;
/// `None` if rustls refused it (then every HTTPS request fails).
fn tls_config() -> Option<Arc<ClientConfig>> {
    TLS_CONFIG
        .get_or_init(|| {
            let mut roots = RootCertStore::empty();
            let (added, _) = roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            if added == 0 {
                tracing::warn!("no system root certificates found: outgoing HTTPS requests will fail (install ca-certificates)");
            }
            let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
            let builder = ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions();
            match builder {
                Ok(builder) => Some(Arc::new(builder.with_root_certificates(roots).with_no_client_auth())),
                Err(e) => {
                    tracing::error!(error = %e, "outgoing HTTPS unavailable: no TLS client configuration");
                    None
                }
            }
        })
        .clone()
}

/// The request with only path and query in its URI (scheme and authority
/// go only to a proxy); the `Host` header carries the authority.
fn origin_form(mut request: hyper::Request<WasiBody>) -> hyper::Request<WasiBody> {
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned();
    if let Ok(uri) = hyper::Uri::builder().path_and_query(path).build() {
        *request.uri_mut() = uri;
    }
    request
}

/// Waits for the response head while driving the connection's I/O;
/// returns the connection too if it has not finished (it carries the body).
async fn drive_until_response<S, C>(send: S, conn: C) -> Result<(hyper::Response<WasiBody>, Option<C>), HttpError>
where
    S: Future<Output = Result<hyper::Response<WasiBody>, HttpError>>,
    C: Future<Output = Result<(), hyper::Error>> + Unpin,
{
    let mut send = pin!(send);
    let mut conn = Some(conn);
    let response = poll_fn(|cx| match send.as_mut().poll(cx) {
        Poll::Ready(result) => Poll::Ready(result),
        Poll::Pending => {
            let Some(running) = conn.as_mut() else { return Poll::Pending };
            let finished = ready!(Pin::new(running).poll(cx));
            conn = None;
            match finished {
                Ok(()) => send.as_mut().poll(cx),
                Err(e) => Poll::Ready(Err(HttpError::from(e))),
            }
        }
    })
    .await?;
    Ok((response, conn))
}

/// A response body that fails when no bytes come for `between_bytes`.
struct TimedBody {
    incoming: Incoming,
    timeout: tokio::time::Interval,
}

impl TimedBody {
    fn new(incoming: Incoming, between_bytes: Duration) -> Self {
        let mut timeout = tokio::time::interval(between_bytes);
        timeout.reset();
        Self { incoming, timeout }
    }
}

impl hyper::body::Body for TimedBody {
    type Data = Bytes;
    type Error = HttpError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<hyper::body::Frame<Bytes>, HttpError>>> {
        match Pin::new(&mut self.incoming).poll_frame(cx) {
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Ready(Some(Err(e))) => {
                Poll::Ready(Some(Err(if e.is_timeout() { HttpError::HttpResponseTimeout } else { HttpError::from(e) })))
            }
            Poll::Ready(Some(Ok(frame))) => {
                self.timeout.reset();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => {
                ready!(self.timeout.poll_tick(cx));
                Poll::Ready(Some(Err(HttpError::ConnectionReadTimeout)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.incoming.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.incoming.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tenant gets no more than its share of the lookup places, while
    /// another tenant still gets its own; all tenants together no more
    /// than the total; a place given back is taken by the next in line.
    #[tokio::test]
    async fn one_tenant_holds_at_most_its_share_of_lookup_places() {
        let places = LookupPlaces::new(5, 2);
        let quick = Duration::from_millis(50);
        let (busy, other, third): (Arc<str>, Arc<str>, Arc<str>) = ("busy".into(), "other".into(), "third".into());
        let mut held = vec![places.take(&busy).await.unwrap(), places.take(&busy).await.unwrap()];
        assert!(tokio::time::timeout(quick, places.take(&busy)).await.is_err(), "a third place for one tenant");
        held.push(tokio::time::timeout(quick, places.take(&other)).await.expect("another tenant waits").unwrap());
        held.push(places.take(&other).await.unwrap());
        held.push(places.take(&third).await.unwrap());
        assert!(tokio::time::timeout(quick, places.take(&third)).await.is_err(), "past the total");
        drop(held.remove(0));
        let next = tokio::time::timeout(quick, places.take(&busy)).await.expect("a place given back").unwrap();
        drop((held, next));
        assert_eq!(places.all.available_permits(), 5, "every place given back");
        let _share = places.share_of(&third);
        assert_eq!(places.tenants.lock().unwrap().len(), 1, "idle tenants' shares are dropped");
    }

    fn public(text: &str) -> bool {
        is_public(text.parse().unwrap())
    }

    #[test]
    fn only_public_addresses_are_public() {
        for internal in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "198.18.0.1",
            "240.0.0.1",
            "::1",
            "::",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a00:1",
            "2002:c0a8:101::1",
            "64:ff9b:1::a00:1",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
            "3fff::1",
        ] {
            assert!(!public(internal), "{internal} counted as public");
        }
        for external in ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"] {
            assert!(public(external), "{external} counted as internal");
        }
    }

    #[test]
    fn this_hosts_own_addresses_are_refused_even_public_ones() {
        let own: Vec<IpAddr> = vec!["93.184.215.14".parse().unwrap(), "10.0.0.5".parse().unwrap()];
        let strict = Egress::default();
        assert!(!allowed("93.184.215.14".parse().unwrap(), strict, &own), "own public address");
        assert!(!allowed("::ffff:93.184.215.14".parse().unwrap(), strict, &own), "the same, mapped");
        assert!(allowed("8.8.8.8".parse().unwrap(), strict, &own));
        assert!(allowed("93.184.215.14".parse().unwrap(), Egress { allow_private: true }, &own));
        assert!(own_addresses().contains(&"127.0.0.1".parse().unwrap()), "the interfaces are read");
    }

    #[tokio::test]
    async fn literals_and_names_of_internal_addresses_are_prohibited() {
        let (denied, tenant): (Egress, Arc<str>) = (Egress::default(), "t".into());
        for host in ["127.0.0.1", "[::1]", "169.254.169.254", "localhost", "2130706433", "127.1"] {
            let outcome = destinations(host, 80, denied, &tenant).await;
            assert!(matches!(outcome, Err(HttpError::DestinationIpProhibited)), "{host}: {outcome:?}");
        }
        let allowed = Egress { allow_private: true };
        assert_eq!(destinations("127.0.0.1", 8080, allowed, &tenant).await.unwrap(), ["127.0.0.1:8080".parse().unwrap()]);
        assert_eq!(destinations("[::1]", 80, allowed, &tenant).await.unwrap(), ["[::1]:80".parse().unwrap()]);
    }

    #[tokio::test]
    async fn a_port_out_of_range_is_an_invalid_uri_not_port_80() {
        let request = hyper::Request::get("http://example.com:99999/").body(WasiBody::default()).unwrap();
        let outcome = send(request, None, Egress::default(), "t".into(), Instant::now() + Duration::from_secs(5)).await;
        assert!(matches!(outcome, Err(HttpError::HttpRequestUriInvalid)), "{:?}", outcome.err());
        assert!(has_port_part("a:b@example.com:") && has_port_part("[::1]:x") && has_port_part("h:80"));
        assert!(!has_port_part("a:b@example.com") && !has_port_part("[::1]") && !has_port_part("example.com"));
    }

    #[tokio::test]
    async fn the_next_address_is_tried_when_one_refuses() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = listener.local_addr().unwrap();
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let stream = connect_any(&[closed, open]).await.unwrap();
        assert_eq!(stream.peer_addr().unwrap(), open);
        assert!(matches!(connect_any(&[closed]).await, Err(HttpError::Connect(_))));
    }

    #[test]
    fn no_timeout_outlives_the_deadline() {
        let timeouts = Timeouts::new(None, Instant::now() + Duration::from_secs(2));
        assert!(timeouts.connect <= Duration::from_secs(2) && timeouts.first_byte <= Duration::from_secs(2));
        let past = Timeouts::new(None, Instant::now() - Duration::from_secs(1));
        assert_eq!(past.between_bytes, Duration::from_nanos(1), "never zero");
    }
}
