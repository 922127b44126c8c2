//! Outgoing HTTP of tenants granted it (`outgoing_http`): where a request
//! may go, how many connections it may hold, and the client that sends it.
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
//! Address class is not enough where internal networks are public: a
//! cluster may give its pods and nodes global IPv6 addresses. The ranges of
//! `--outgoing-deny` are refused always, public or not, and whether private
//! addresses are allowed or not. Only the ports of `--outgoing-ports` (80
//! and 443 by default) may be reached: a handler speaks HTTP to web
//! servers, not to the mail, cache or database servers a public address may
//! also run. A port is checked before any lookup or connection.
//!
//! Each connection holds a place of its tenant's share and one of the
//! node's, from before it connects until it closes (the places travel with
//! its socket, so they are held while the response body is read): one
//! tenant's handlers cannot open enough connections to take the process's
//! file descriptors, which `accept` needs for everyone. Past the cap a
//! request fails at once with `connection-limit-reached`; it does not wait.
//!
//! Name lookups run on blocking threads and keep running after a request
//! gives up, so at most [`MAX_LOOKUPS`] run at once (a lookup holds its
//! place until its thread returns): a guest cannot fill the pool the admin
//! API also uses. One tenant holds at most [`TENANT_LOOKUPS`] of them: a
//! tenant whose names never answer (its own DNS server, say) waits on its
//! own share and leaves the other granted tenants theirs.
//!
//! A refusal is logged once per request and kind (a handler may retry in a
//! loop; the log must not grow with it); connections refused by the cap
//! count as a limit hit of the request (see [`Refusals`]).
//!
//! The client follows wasmtime-wasi-http's `default_send_request` (HTTP/1.1,
//! TLS by rustls; the same timeouts), trying each allowed address in turn;
//! connecting (lookup, TCP, TLS, HTTP handshake) must finish within the
//! connect timeout, and no timeout runs past the request's deadline.

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use ipnet::{IpNet, Ipv4Net};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use wasmtime_wasi_http::{Error as HttpError, RequestOptions, WasiBody};

/// Name lookups running at once, all requests together.
pub const MAX_LOOKUPS: usize = 16;
/// Name lookups one tenant's requests may run at once.
pub const TENANT_LOOKUPS: usize = MAX_LOOKUPS / 4;
/// Default ports granted requests may go to: HTTP and HTTPS.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];
/// Default outgoing connections open at once, all tenants together: a
/// bounded share of the process's file descriptors.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 256;
/// Default outgoing connections of one tenant open at once: one for each
/// request in flight at the default tenant concurrency.
pub const DEFAULT_TENANT_CONNECTIONS: u32 = 32;

/// What granted handlers may reach, and how many connections they may hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressRules {
    /// Also loopback, private, link-local and other non-public addresses.
    pub allow_private: bool,
    /// The only ports requests may go to.
    pub ports: Vec<u16>,
    /// Ranges refused whatever their class (see [`parse_cidr`]).
    pub deny: Vec<IpNet>,
    /// Most connections open at once, all tenants together.
    pub max_connections: usize,
    /// Most connections of one tenant open at once.
    pub tenant_connections: usize,
}

impl Default for EgressRules {
    /// Public addresses, ports 80 and 443, nothing denied beyond that, the default caps.
    fn default() -> Self {
        Self {
            allow_private: false,
            ports: DEFAULT_PORTS.to_vec(),
            deny: Vec::new(),
            max_connections: DEFAULT_MAX_CONNECTIONS as usize,
            tenant_connections: DEFAULT_TENANT_CONNECTIONS as usize,
        }
    }
}

/// The server's egress: its rules and the connection places they grant.
/// Clones share the places.
#[derive(Debug, Clone)]
pub struct Egress {
    rules: Arc<EgressRules>,
    connections: Arc<Places>,
}

impl Egress {
    /// Egress by `rules`, no connection open yet.
    pub fn new(rules: EgressRules) -> Self {
        let connections = Arc::new(Places::new(rules.max_connections, rules.tenant_connections));
        Self { rules: Arc::new(rules), connections }
    }

    /// The rules.
    pub fn rules(&self) -> &EgressRules {
        &self.rules
    }

    /// Places for one connection of `caller`'s tenant, held until the
    /// connection closes; `ConnectionLimitReached` (logged, counted) when
    /// the tenant or the node has no place free.
    fn connection_places(&self, caller: &Caller, host: &str, port: u16) -> Result<Held, HttpError> {
        self.connections.try_take(&caller.tenant).map_err(|full| {
            let why = match full {
                Full::Share => "the tenant's outgoing connections at --outgoing-max-connections-per-tenant",
                Full::All => "outgoing connections at --outgoing-max-connections",
            };
            caller.refuse(Refusal::Connections, host, port, why);
            HttpError::ConnectionLimitReached
        })
    }
}

impl Default for Egress {
    fn default() -> Self {
        Self::new(EgressRules::default())
    }
}

/// Logs `rules` at start, for an operator to check against the cluster's networks.
pub fn log_rules(rules: &EgressRules) {
    let deny: Vec<String> = rules.deny.iter().map(ToString::to_string).collect();
    tracing::info!(
        allow_private = rules.allow_private,
        ports = ?rules.ports,
        deny = ?deny,
        max_connections = rules.max_connections,
        max_connections_per_tenant = rules.tenant_connections,
        "outgoing HTTP of granted handlers"
    );
}

/// `text` as a range for `--outgoing-deny`: `ADDRESS/PREFIX`, IPv4 or IPv6,
/// its host bits cleared; an IPv4-mapped IPv6 range (`::ffff:10.0.0.0/104`)
/// becomes the IPv4 range it maps, as addresses are checked.
pub fn parse_cidr(text: &str) -> Result<IpNet, String> {
    let net: IpNet = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a CIDR range: expected ADDRESS/PREFIX, e.g. 10.0.0.0/8 or 2001:db8::/32"))?;
    Ok(match net.trunc() {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.network().to_ipv4_mapped() {
            Some(v4) => Ipv4Net::new(v4, v6.prefix_len() - 96).map_or(IpNet::V6(v6), IpNet::V4),
            None => IpNet::V6(v6),
        },
        other => other,
    })
}

/// Why an outgoing request was refused (each kind logged once per request).
#[derive(Debug, Clone, Copy)]
enum Refusal {
    /// Its port is not in `--outgoing-ports`.
    Port,
    /// No address of its host may be reached.
    Address,
    /// No connection place free.
    Connections,
}

/// The refusals of one request's outgoing requests, shared by the request
/// (its [`crate::sandbox::state::GatewayHooks`]) and its requests in flight.
#[derive(Debug, Default)]
pub struct Refusals {
    /// Per [`Refusal`], in its order.
    counts: [AtomicU32; 3],
}

impl Refusals {
    /// Counts one refusal of `kind`; whether it is the first of its kind
    /// (the one logged).
    fn count(&self, kind: Refusal) -> bool {
        self.counts[kind as usize].fetch_add(1, Ordering::Relaxed) == 0
    }

    /// At the end of a request: its connections refused by the cap (a limit
    /// hit), every count started afresh for the instance's next request.
    pub fn take_refused_connections(&self) -> u32 {
        let [port, address, connections] = &self.counts;
        port.store(0, Ordering::Relaxed);
        address.store(0, Ordering::Relaxed);
        connections.swap(0, Ordering::Relaxed)
    }
}

/// Who sends an outgoing request: the tenant whose shares it takes, and
/// its request's refusals.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The tenant.
    pub tenant: Arc<str>,
    /// Its request's refusals.
    pub refusals: Arc<Refusals>,
}

impl Caller {
    /// Records a refusal of `kind` for the request to `host:port`, logged
    /// with `why` if it is the request's first of that kind.
    fn refuse(&self, kind: Refusal, host: &str, port: u16, why: &str) {
        if self.refusals.count(kind) {
            // Only the request's first refusal of each kind: a handler may retry in a loop.
            tracing::info!(tenant = %self.tenant, host, port, refusal = ?kind, "outgoing request refused: {why}");
        }
    }
}

/// What the client hands back: the response, and the connection's I/O,
/// which the caller drives while the body is read.
pub type Sent = (hyper::Response<WasiBody>, Box<dyn Future<Output = Result<(), HttpError>> + Send>);

/// Sends `caller`'s `request` to a destination `egress` allows, giving up
/// at `deadline`: `HTTP-request-denied` for a port not allowed,
/// `destination-IP-prohibited` for an address, `connection-limit-reached`
/// past the connection caps.
pub async fn send(
    request: hyper::Request<WasiBody>,
    options: Option<RequestOptions>,
    egress: Egress,
    caller: Caller,
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
    if !egress.rules.ports.contains(&port) {
        caller.refuse(Refusal::Port, &host, port, "port not in --outgoing-ports");
        return Err(HttpError::HttpRequestDenied);
    }
    let timeouts = Timeouts::new(options, deadline);
    let connect = async {
        let addrs = destinations(&host, port, &egress.rules, &caller).await?;
        let places = egress.connection_places(&caller, &host, port)?;
        let tcp = Counted { stream: connect_any(&addrs).await?, _places: places };
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
/// those `rules` allow; `DestinationIpProhibited` (logged) when they allow none.
async fn destinations(host: &str, port: u16, rules: &EgressRules, caller: &Caller) -> Result<Vec<SocketAddr>, HttpError> {
    let addrs: Vec<SocketAddr> = match bare_host(host).parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => lookup(host.to_owned(), port, &caller.tenant).await?,
    };
    let own = if rules.allow_private { Vec::new() } else { own_addresses() };
    let mut first_refusal = None;
    let mut allowed = Vec::with_capacity(addrs.len());
    for addr in addrs {
        match refusal(addr.ip(), rules, &own) {
            None => allowed.push(addr),
            Some(why) => first_refusal = first_refusal.or(Some((addr.ip(), why))),
        }
    }
    if let (true, Some((ip, why))) = (allowed.is_empty(), first_refusal) {
        caller.refuse(Refusal::Address, host, port, &format!("its address {ip} is {why}"));
        return Err(HttpError::DestinationIpProhibited);
    }
    Ok(allowed)
}

/// `host`'s addresses (at `port`) that `rules` let this node reach on
/// `tenant`'s behalf for its own requests (a registry pull): the same
/// address rules as a handler's, the name looked up under `tenant`'s
/// lookup places; when none is allowed, why, for the caller's error.
pub async fn allowed_addresses(host: &str, port: u16, rules: &EgressRules, tenant: &Arc<str>) -> Result<Vec<SocketAddr>, String> {
    let addrs: Vec<SocketAddr> = match bare_host(host).parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => lookup(host.to_owned(), port, tenant).await.map_err(|e| format!("cannot look up {host}: {e:?}"))?,
    };
    let own = if rules.allow_private { Vec::new() } else { own_addresses() };
    let mut first_refusal = None;
    let allowed: Vec<SocketAddr> = addrs
        .into_iter()
        .filter(|addr| match refusal(addr.ip(), rules, &own) {
            None => true,
            Some(why) => {
                first_refusal = first_refusal.or(Some((addr.ip(), why)));
                false
            }
        })
        .collect();
    match (allowed.is_empty(), first_refusal) {
        (true, Some((ip, why))) => Err(format!("{host}'s address {ip} is {why}")),
        _ => Ok(allowed),
    }
}

/// Why a granted request may not go to `ip`, if it may not: a range of
/// `rules.deny` always; unless private addresses are allowed, an address
/// that is not public or is one of `own`.
fn refusal(ip: IpAddr, rules: &EgressRules, own: &[IpAddr]) -> Option<&'static str> {
    if denied(ip, &rules.deny) {
        Some("in a range of --outgoing-deny")
    } else if rules.allow_private {
        None
    } else if !is_public(ip) {
        Some("not public (see --outgoing-allow-private)")
    } else if own.contains(&ip.to_canonical()) {
        Some("this host's own")
    } else {
        None
    }
}

/// Whether `ip` is in one of the `deny` ranges; an IPv6 address that
/// carries an IPv4 one (mapped, NAT64, 6to4, ...) is also checked as that
/// IPv4 address, which is where it leads.
fn denied(ip: IpAddr, deny: &[IpNet]) -> bool {
    let carried = match ip {
        IpAddr::V6(v6) => embedded_v4(v6).map(IpAddr::V4),
        IpAddr::V4(_) => None,
    };
    deny.iter().any(|range| range.contains(&ip) || carried.is_some_and(|v4| range.contains(&v4)))
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
    static PLACES: LazyLock<Places> = LazyLock::new(|| Places::new(MAX_LOOKUPS, TENANT_LOOKUPS));
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

/// Places (for name lookups, for connections): `total` for all tenants
/// together, at most `share` of them for each.
#[derive(Debug)]
struct Places {
    all: Arc<Semaphore>,
    share: usize,
    /// Each tenant holding or waiting for places: its share's places.
    tenants: Mutex<HashMap<Arc<str>, Arc<Semaphore>>>,
}

/// One place of a tenant's share and one of all, given back when dropped.
type Held = (OwnedSemaphorePermit, OwnedSemaphorePermit);

/// Which places ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Full {
    /// The tenant's share.
    Share,
    /// All tenants' places.
    All,
}

impl Places {
    fn new(total: usize, share: usize) -> Self {
        Self { all: Arc::new(Semaphore::new(total)), share, tenants: Mutex::default() }
    }

    /// Waits for a place of `tenant`'s share, then for one of all: a
    /// tenant at its share waits without holding a place others need.
    async fn take(&self, tenant: &Arc<str>) -> Result<Held, AcquireError> {
        let own = self.share_of(tenant).acquire_owned().await?;
        let any = Arc::clone(&self.all).acquire_owned().await?;
        Ok((own, any))
    }

    /// A place of `tenant`'s share and one of all if both are free now.
    fn try_take(&self, tenant: &Arc<str>) -> Result<Held, Full> {
        let own = self.share_of(tenant).try_acquire_owned().map_err(|_| Full::Share)?;
        let any = Arc::clone(&self.all).try_acquire_owned().map_err(|_| Full::All)?;
        Ok((own, any))
    }

    /// `tenant`'s share, made on its first use; the shares of tenants
    /// holding and waiting for nothing (nobody else holds them) are
    /// dropped here, so the map holds only tenants using places.
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

/// A connection's stream with the places it holds, given back when the
/// stream is dropped: when the connection closes, after its response body
/// (the connection's I/O outlives the response head).
struct Counted<S> {
    stream: S,
    _places: Held,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// TLS to `host` over `tcp`, verified against the system's roots.
async fn tls_connect(host: &str, tcp: impl Stream) -> Result<impl Stream, HttpError> {
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
        let places = Places::new(5, 2);
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

    /// The connection places: a tenant past its share is refused at once
    /// while another tenant is not, until all tenants together hold the
    /// total; a refused try holds nothing.
    #[test]
    fn connection_places_are_refused_past_the_share_or_the_total() {
        let places = Places::new(3, 2);
        let (busy, other): (Arc<str>, Arc<str>) = ("busy".into(), "other".into());
        let held = [places.try_take(&busy).unwrap(), places.try_take(&busy).unwrap()];
        assert_eq!(places.try_take(&busy).err(), Some(Full::Share));
        let last = places.try_take(&other).unwrap();
        assert_eq!(places.try_take(&other).err(), Some(Full::All));
        drop(held);
        assert_eq!(places.all.available_permits(), 2, "the refused tries hold nothing");
        drop((places.try_take(&busy).unwrap(), last));
        assert_eq!(places.all.available_permits(), 3);
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn caller() -> Caller {
        Caller { tenant: "t".into(), refusals: Arc::default() }
    }

    #[test]
    fn this_hosts_own_addresses_are_refused_even_public_ones() {
        let own = [ip("93.184.215.14"), ip("10.0.0.5")];
        let strict = EgressRules::default();
        assert_eq!(refusal(ip("93.184.215.14"), &strict, &own), Some("this host's own"), "own public address");
        assert_eq!(refusal(ip("::ffff:93.184.215.14"), &strict, &own), Some("this host's own"), "the same, mapped");
        assert_eq!(refusal(ip("8.8.8.8"), &strict, &own), None);
        assert_eq!(refusal(ip("93.184.215.14"), &EgressRules { allow_private: true, ..strict }, &own), None);
        assert!(own_addresses().contains(&ip("127.0.0.1")), "the interfaces are read");
    }

    #[test]
    fn cidr_ranges_parse_and_anything_else_is_refused_with_the_format() {
        assert_eq!(parse_cidr("10.1.2.3/8").unwrap().to_string(), "10.0.0.0/8", "host bits cleared");
        assert_eq!(parse_cidr(" 2001:db8:1::5/48 ").unwrap().to_string(), "2001:db8:1::/48");
        assert_eq!(parse_cidr("::ffff:10.0.0.0/104").unwrap().to_string(), "10.0.0.0/8", "IPv4-mapped: as IPv4");
        assert_eq!(parse_cidr("::ffff:0:0/96").unwrap().to_string(), "0.0.0.0/0");
        assert_eq!(parse_cidr("::/0").unwrap().to_string(), "::/0");
        for bad in ["10.0.0.1", "10.0.0.0/33", "fd00::/129", "pods", "", "10.0.0.0/8/1", "10.0.0/8", "10.0.0.0/-1"] {
            let error = parse_cidr(bad).unwrap_err();
            assert!(error.contains("not a CIDR range") && error.contains("ADDRESS/PREFIX"), "{bad:?}: {error}");
        }
    }

    /// A denied range wins over everything: a public address in it, the
    /// same address inside IPv6 (mapped, NAT64, 6to4), and a private one
    /// with private addresses allowed are all refused.
    #[test]
    fn denied_ranges_are_refused_whatever_the_address_class() {
        let deny: Vec<IpNet> = ["2600:1f00::/24", "10.0.0.0/8", "93.184.215.0/24"].map(|r| parse_cidr(r).unwrap()).to_vec();
        let strict = EgressRules { deny: deny.clone(), ..EgressRules::default() };
        let open = EgressRules { allow_private: true, deny, ..EgressRules::default() };
        let in_deny = Some("in a range of --outgoing-deny");
        for rules in [&strict, &open] {
            for inside in
                ["2600:1f00::1", "2600:1fff::1", "93.184.215.14", "::ffff:93.184.215.14", "64:ff9b::5db8:d70e", "2002:5db8:d70e::1"]
            {
                assert_eq!(refusal(ip(inside), rules, &[]), in_deny, "{inside}");
            }
            for outside in ["8.8.8.8", "2600:2000::1", "93.184.216.1", "::ffff:8.8.8.8"] {
                assert_eq!(refusal(ip(outside), rules, &[]), None, "{outside}");
            }
        }
        assert_eq!(refusal(ip("10.1.2.3"), &open, &[]), in_deny, "private allowed, but denied");
        assert_eq!(refusal(ip("::ffff:10.1.2.3"), &open, &[]), in_deny);
        assert_eq!(refusal(ip("192.168.1.1"), &open, &[]), None, "private allowed, not denied");
    }

    #[tokio::test]
    async fn literals_and_names_of_internal_addresses_are_prohibited() {
        let (strict, caller) = (EgressRules::default(), caller());
        for host in ["127.0.0.1", "[::1]", "169.254.169.254", "localhost", "2130706433", "127.1"] {
            let outcome = destinations(host, 80, &strict, &caller).await;
            assert!(matches!(outcome, Err(HttpError::DestinationIpProhibited)), "{host}: {outcome:?}");
        }
        let open = EgressRules { allow_private: true, ..strict };
        assert_eq!(destinations("127.0.0.1", 8080, &open, &caller).await.unwrap(), ["127.0.0.1:8080".parse().unwrap()]);
        assert_eq!(destinations("[::1]", 80, &open, &caller).await.unwrap(), ["[::1]:80".parse().unwrap()]);
    }

    fn get(url: &str) -> hyper::Request<WasiBody> {
        hyper::Request::get(url).body(WasiBody::default()).unwrap()
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    /// A port outside the list is refused before the name is looked up (a
    /// `.invalid` name would fail the lookup) and before the address is
    /// checked; a scheme's default port is the one checked.
    #[tokio::test]
    async fn a_port_not_allowed_is_refused_before_anything_else() {
        let egress = Egress::new(EgressRules { ports: vec![443], ..EgressRules::default() });
        let caller = caller();
        for url in ["http://no-such-host.invalid:6379/", "http://no-such-host.invalid/", "https://10.0.0.1:8443/"] {
            let outcome = send(get(url), None, egress.clone(), caller.clone(), soon()).await;
            assert!(matches!(outcome, Err(HttpError::HttpRequestDenied)), "{url}: {:?}", outcome.err());
        }
        let outcome = send(get("https://10.0.0.1/"), None, egress, caller.clone(), soon()).await;
        assert!(matches!(outcome, Err(HttpError::DestinationIpProhibited)), "443 passes, the address does not: {:?}", outcome.err());
        assert_eq!(caller.refusals.take_refused_connections(), 0, "no connection refused");
        assert!(caller.refusals.count(Refusal::Port), "the counts start afresh");
    }

    /// A local server whose responses send their head and the first half
    /// of a 4-byte body at once, the rest when `release` gets a permit.
    async fn held_body_server() -> (u16, Arc<Semaphore>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let release = Arc::new(Semaphore::new(0));
        let gate = Arc::clone(&release);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let gate = Arc::clone(&gate);
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    while !head.ends_with(b"\r\n\r\n") {
                        let mut byte = [0];
                        if socket.read(&mut byte).await.unwrap() == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    socket.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\nconnection: close\r\n\r\nhe").await.unwrap();
                    gate.acquire().await.unwrap().forget();
                    socket.write_all(b"ll").await.unwrap();
                });
            }
        });
        (port, release)
    }

    /// A connection holds its tenant's place until it closes, after its
    /// body, not just until its response head: a second connection of the
    /// tenant is refused meanwhile (counted once), another tenant's is not.
    #[tokio::test]
    async fn a_connection_holds_its_place_while_its_body_is_read() {
        let (port, release) = held_body_server().await;
        let rules = EgressRules { allow_private: true, ports: vec![port], tenant_connections: 1, ..EgressRules::default() };
        let (egress, busy) = (Egress::new(rules), caller());
        let other = Caller { tenant: "other".into(), refusals: Arc::default() };
        let url = format!("http://127.0.0.1:{port}/");
        let (first, io) = send(get(&url), None, egress.clone(), busy.clone(), soon()).await.unwrap();
        let io = tokio::spawn(Box::into_pin(io));
        let refused = send(get(&url), None, egress.clone(), busy.clone(), soon()).await;
        assert!(matches!(refused, Err(HttpError::ConnectionLimitReached)), "{:?}", refused.err());
        let (second, other_io) = send(get(&url), None, egress.clone(), other, soon()).await.expect("another tenant's own place");
        let other_io = tokio::spawn(Box::into_pin(other_io));
        release.add_permits(2);
        for (response, io) in [(first, io), (second, other_io)] {
            assert_eq!(response.into_body().collect().await.unwrap().to_bytes(), "hell");
            io.await.unwrap().unwrap();
        }
        assert!(send(get(&url), None, egress, busy.clone(), soon()).await.is_ok(), "the place is given back when the connection closes");
        assert_eq!(busy.refusals.take_refused_connections(), 1);
    }

    #[tokio::test]
    async fn a_port_out_of_range_is_an_invalid_uri_not_port_80() {
        let outcome = send(get("http://example.com:99999/"), None, Egress::default(), caller(), soon()).await;
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
