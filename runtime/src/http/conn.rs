//! One listener's connections: admission (the connection cap, the cap per
//! client address, the admin reserve), the deadline on the first request
//! head, the idle timeout, and the drain at shutdown.
//!
//! Each connection runs in a task beside a watchdog. The watchdog sleeps
//! until the next moment a limit could expire, then looks at the
//! connection's [`Activity`]: whether a request has started, how many are in
//! flight, and when bytes last moved.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::{App, Plane};
use crate::metrics::{CloseReason, ConnectionMetrics};

/// Extra connections a listener serving everything ([`Plane::Both`]) accepts
/// once its slots are full, served as [`Plane::Reserve`] (admin API,
/// `/metrics`, `/healthz`): the operator can still reach a listener that
/// clients have filled.
pub const ADMIN_RESERVE_CONNECTIONS: usize = 32;

/// Head and idle timeout of a reserve connection (at most the configured
/// ones): reserve slots are few, so whoever holds one must use it at once.
pub const RESERVE_TIMEOUT: Duration = Duration::from_secs(2);

/// How one kind of connection is served.
struct Profile {
    builder: auto::Builder<TokioExecutor>,
    plane: Plane,
    head_timeout: Duration,
    idle_timeout: Duration,
}

impl Profile {
    fn new(plane: Plane, head_timeout: Duration, idle_timeout: Duration) -> Self {
        let mut builder = auto::Builder::new(TokioExecutor::new());
        // hyper restarts this timer whenever an HTTP/1 connection waits for a
        // head, idle keep-alive included. The watchdog enforces the first head
        // and idleness; hyper's timer bounds a later head that trickles in
        // (the trickle is I/O to the watchdog) and fires only after the idle
        // timeout, so idle connections are closed (and counted) by the watchdog.
        builder.http1().timer(TokioTimer::new()).header_read_timeout(head_timeout + idle_timeout);
        if plane == Plane::Reserve {
            // One request per reserve connection: the slot comes back at once.
            builder.http1().keep_alive(false);
        }
        // No HTTP/2 keep-alive pings: the idle timeout closes idle
        // connections, and our own pings would count as I/O and keep them.
        builder.http2().timer(TokioTimer::new());
        Self { builder, plane, head_timeout, idle_timeout }
    }
}

/// A listener's connection settings and slots.
pub(super) struct Listener {
    app: Arc<App>,
    tls: Option<TlsAcceptor>,
    main: Profile,
    /// Only for [`Plane::Both`].
    reserve: Option<(Profile, Arc<Semaphore>)>,
    slots: Arc<Semaphore>,
    per_ip: Option<PerIp>,
    metrics: Arc<ConnectionMetrics>,
}

impl Listener {
    /// The settings `app`'s configuration asks for, serving `plane`.
    pub(super) fn new(app: Arc<App>, plane: Plane, tls: Option<TlsAcceptor>) -> Self {
        let config = &app.config;
        let (head, idle) = (config.request_head_timeout(), config.idle_timeout());
        let main = Profile::new(plane, head, idle);
        let reserve = (plane == Plane::Both).then(|| {
            let profile = Profile::new(Plane::Reserve, head.min(RESERVE_TIMEOUT), idle.min(RESERVE_TIMEOUT));
            (profile, Arc::new(Semaphore::new(ADMIN_RESERVE_CONNECTIONS)))
        });
        let slots = Arc::new(Semaphore::new(config.max_connections as usize));
        let per_ip = (config.max_connections_per_ip > 0).then(|| PerIp { cap: config.max_connections_per_ip, open: Arc::default() });
        let metrics = Arc::clone(&app.metrics.connections);
        Self { app, tls, main, reserve, slots, per_ip, metrics }
    }

    /// Takes a slot for a connection from `peer`: a main one, else (on a
    /// shared listener) a reserve one. Over a cap, counts and logs the refusal.
    pub(super) fn admit(&self, peer: SocketAddr) -> Option<Slot> {
        let admitted = self.try_admit(peer.ip());
        if let Err(reason) = admitted {
            closed(&self.metrics, peer, reason);
        }
        admitted.ok()
    }

    fn try_admit(&self, ip: IpAddr) -> Result<Slot, CloseReason> {
        let (permit, reserve) = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(permit) => (permit, false),
            Err(_) => match &self.reserve {
                Some((_, reserve)) => (Arc::clone(reserve).try_acquire_owned().map_err(|_| CloseReason::OverCapacity)?, true),
                None => return Err(CloseReason::OverCapacity),
            },
        };
        let address = match &self.per_ip {
            Some(per_ip) => Some(per_ip.take(ip)?),
            None => None,
        };
        self.metrics.opened();
        Ok(Slot { accepted: Instant::now(), _permit: permit, reserve, _address: address, metrics: Arc::clone(&self.metrics) })
    }

    /// Serves one admitted connection to its end: TLS handshake, then HTTP
    /// under the watchdog, until it closes, a limit closes it, or the drain
    /// (`draining` turning true) shuts it down.
    pub(super) async fn serve(self: Arc<Self>, stream: TcpStream, peer: SocketAddr, slot: Slot, draining: watch::Receiver<bool>) {
        let profile = match (&self.reserve, slot.reserve) {
            (Some((reserve, _)), true) => reserve,
            _ => &self.main,
        };
        let activity = Arc::new(Activity::new(slot.accepted));
        let stream = Tracked { inner: stream, activity: Arc::clone(&activity) };
        let watch = Watch { profile, activity, peer, metrics: &self.metrics, draining };
        match &self.tls {
            None => watch.run(&self.app, stream).await,
            Some(tls) => {
                let mut draining = watch.draining.clone();
                let deadline = watch.activity.epoch + profile.head_timeout;
                tokio::select! {
                    handshake = tokio::time::timeout_at(deadline, tls.accept(stream)) => match handshake {
                        Ok(Ok(stream)) => watch.run(&self.app, stream).await,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            closed(&self.metrics, peer, CloseReason::TlsHandshake);
                        }
                        Err(_) => closed(&self.metrics, peer, CloseReason::HeadTimeout),
                    },
                    () = drained(&mut draining) => {}
                }
            }
        }
        drop(slot);
    }
}

/// Resolves once the listener drains (or is gone).
async fn drained(draining: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns is dropped here, never held across an await.
    let _ = draining.wait_for(|draining| *draining).await;
}

/// Counts and logs a connection closed by a limit.
fn closed(metrics: &ConnectionMetrics, peer: SocketAddr, reason: CloseReason) {
    metrics.closed(reason);
    tracing::debug!(%peer, reason = reason.label(), "connection closed by a limit");
}

/// Open connections per client address.
struct PerIp {
    cap: u32,
    open: Arc<Mutex<HashMap<IpAddr, u32>>>,
}

impl PerIp {
    fn take(&self, ip: IpAddr) -> Result<AddressShare, CloseReason> {
        let ip = client_key(ip);
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(ip).or_insert(0);
        if *count >= self.cap {
            return Err(CloseReason::PerIpCap);
        }
        *count += 1;
        Ok(AddressShare { ip, open: Arc::clone(&self.open) })
    }
}

/// The address a cap counts: IPv4 (mapped ones included) as is, IPv6 by
/// its /64, the block one host usually gets.
fn client_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !(u128::from(u64::MAX)))),
        v4 => v4,
    }
}

/// One connection's share of its address's cap, given back on drop.
struct AddressShare {
    ip: IpAddr,
    open: Arc<Mutex<HashMap<IpAddr, u32>>>,
}

impl Drop for AddressShare {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// An admitted connection's slot (and its address's share), held until the
/// connection ends.
pub(super) struct Slot {
    /// When the connection was accepted: its head deadline counts from here.
    accepted: Instant,
    _permit: OwnedSemaphorePermit,
    reserve: bool,
    _address: Option<AddressShare>,
    metrics: Arc<ConnectionMetrics>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.metrics.ended();
    }
}

/// What the watchdog looks at, shared by the I/O, the service and the watchdog.
struct Activity {
    /// When the connection was accepted.
    epoch: Instant,
    /// When bytes last moved either way, in ms since `epoch`.
    last_io_ms: AtomicU64,
    /// Service calls not yet answered.
    in_flight: AtomicUsize,
    /// Whether a request head has arrived.
    requested: AtomicBool,
}

impl Activity {
    fn new(epoch: Instant) -> Self {
        Self { epoch, last_io_ms: AtomicU64::new(0), in_flight: AtomicUsize::new(0), requested: AtomicBool::new(false) }
    }

    fn touch(&self) {
        // `as` saturates; a connection open 584 million years stays open.
        self.last_io_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// A request head arrived: counted in flight until the guard drops (the
    /// response head is ready, or the request was dropped). A response body
    /// streaming after that shows up as I/O.
    fn begin(self: &Arc<Self>) -> InFlight {
        self.requested.store(true, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(Arc::clone(self))
    }

    /// What to do at `now`.
    fn check(&self, profile: &Profile, now: Instant) -> Verdict {
        if !self.requested.load(Ordering::Relaxed) {
            let deadline = self.epoch + profile.head_timeout;
            return if now >= deadline { Verdict::Expired(CloseReason::HeadTimeout) } else { Verdict::CheckAt(deadline) };
        }
        if self.in_flight.load(Ordering::Acquire) > 0 {
            // A request in flight is never idle; its own deadline bounds it.
            return Verdict::CheckAt(now + profile.idle_timeout);
        }
        let idle_at = self.epoch + Duration::from_millis(self.last_io_ms.load(Ordering::Relaxed)) + profile.idle_timeout;
        if now >= idle_at { Verdict::Expired(CloseReason::Idle) } else { Verdict::CheckAt(idle_at) }
    }
}

enum Verdict {
    Expired(CloseReason),
    CheckAt(Instant),
}

/// A request in flight (see [`Activity::begin`]).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        // Idleness counts from the answer, not from the last byte before it.
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One connection's HTTP, watched.
struct Watch<'a> {
    profile: &'a Profile,
    activity: Arc<Activity>,
    peer: SocketAddr,
    metrics: &'a ConnectionMetrics,
    draining: watch::Receiver<bool>,
}

impl Watch<'_> {
    /// Serves HTTP on `io` until the connection ends. Past the head deadline
    /// the connection is dropped; idle, or at the drain, it is shut down
    /// gracefully (HTTP/2: GOAWAY), and dropped if it then stays idle.
    async fn run<I>(mut self, app: &Arc<App>, io: I)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let service = service(app, self.profile.plane, &self.activity);
        let conn = self.profile.builder.serve_connection_with_upgrades(TokioIo::new(io), service);
        tokio::pin!(conn);
        let mut closing = false;
        // The first moment a limit could expire; rechecked when it comes.
        let mut check_at = self.activity.epoch + self.profile.head_timeout;
        loop {
            tokio::select! {
                ended = conn.as_mut() => {
                    if let Err(e) = ended {
                        tracing::debug!(peer = %self.peer, error = %e, "connection ended with an error");
                    }
                    return;
                }
                () = tokio::time::sleep_until(check_at) => match self.activity.check(self.profile, Instant::now()) {
                    Verdict::CheckAt(at) => check_at = at,
                    Verdict::Expired(CloseReason::Idle) if !closing => {
                        closed(self.metrics, self.peer, CloseReason::Idle);
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                        // The graceful close gets one more idle period.
                        check_at = Instant::now() + self.profile.idle_timeout;
                    }
                    Verdict::Expired(reason) => {
                        if !closing {
                            closed(self.metrics, self.peer, reason);
                        }
                        return;
                    }
                },
                () = drained(&mut self.draining), if !closing => {
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}

/// The connection's service: `app`'s routes for `plane`, each call counted
/// in flight.
fn service(
    app: &Arc<App>,
    plane: Plane,
    activity: &Arc<Activity>,
) -> impl hyper::service::Service<hyper::Request<Incoming>, Response = hyper::Response<super::response::Body>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    let (app, activity) = (Arc::clone(app), Arc::clone(activity));
    service_fn(move |req: hyper::Request<Incoming>| {
        let (app, in_flight) = (Arc::clone(&app), activity.begin());
        async move {
            let response = app.route(req, plane).await;
            drop(in_flight);
            Ok::<_, Infallible>(response)
        }
    })
}

/// A socket that records, in its [`Activity`], when bytes last moved.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote(&polled);
        polled
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Tracked {
    fn wrote(&self, polled: &Poll<io::Result<usize>>) {
        if matches!(polled, Poll::Ready(Ok(n)) if *n > 0) {
            self.activity.touch();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]
mod tests {
    use super::*;

    #[test]
    fn caps_count_ipv6_by_its_64_and_mapped_ipv4_as_ipv4() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(client_key(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
        assert_eq!(client_key(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
        assert_eq!(client_key(ip("10.0.0.1")), ip("10.0.0.1"));
    }

    #[test]
    fn per_ip_shares_come_back_on_drop() {
        let per_ip = PerIp { cap: 2, open: Arc::default() };
        let ip: IpAddr = "192.0.2.7".parse().unwrap();
        let (a, b) = (per_ip.take(ip).unwrap(), per_ip.take(ip).unwrap());
        assert_eq!(per_ip.take(ip).err(), Some(CloseReason::PerIpCap));
        assert!(per_ip.take("192.0.2.8".parse().unwrap()).is_ok(), "other addresses are not affected");
        drop(a);
        let c = per_ip.take(ip).unwrap();
        drop((b, c));
        assert!(per_ip.open.lock().unwrap().is_empty(), "no entry outlives its connections");
    }

    #[test]
    fn watchdog_verdicts() {
        let profile = Profile::new(Plane::Data, Duration::from_secs(10), Duration::from_secs(30));
        let t0 = Instant::now();
        let activity = Arc::new(Activity::new(t0));
        assert!(matches!(activity.check(&profile, t0), Verdict::CheckAt(at) if at == t0 + Duration::from_secs(10)));
        assert!(matches!(activity.check(&profile, t0 + Duration::from_secs(10)), Verdict::Expired(CloseReason::HeadTimeout)));
        let in_flight = activity.begin();
        let later = t0 + Duration::from_secs(100);
        assert!(
            matches!(activity.check(&profile, later), Verdict::CheckAt(at) if at == later + Duration::from_secs(30)),
            "in flight: never idle"
        );
        drop(in_flight);
        let answered = activity.epoch + Duration::from_millis(activity.last_io_ms.load(Ordering::Relaxed));
        assert!(matches!(activity.check(&profile, answered), Verdict::CheckAt(at) if at == answered + Duration::from_secs(30)));
        assert!(matches!(activity.check(&profile, answered + Duration::from_secs(30)), Verdict::Expired(CloseReason::Idle)));
    }
}
