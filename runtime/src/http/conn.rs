//! One listener's connections: admission (the connection cap, the cap per
//! client address, the admin reserve, and the eviction of the longest-idle
//! connection to make room for a newcomer), the deadline on the first
//! request head, the idle timeout, the maximum age, and the drain at
//! shutdown.
//!
//! Each connection runs in a task beside a watchdog. The watchdog sleeps
//! until the next moment a limit could expire, then looks at the
//! connection's [`Activity`]: whether a request has started, how many are in
//! flight (a response counts until its body is sent), and when the last one
//! ended. Only requests count: bytes that carry none (HTTP/2 PINGs and
//! WINDOW_UPDATEs, a head trickling in) do not keep a connection from being
//! idle.
//!
//! A request in flight keeps its connection, but not forever: a client that
//! stops taking its answers (its receive window or socket buffer full) has
//! its connection dropped after the idle timeout ([`CloseReason::Stalled`]),
//! and a connection told to close (idle, too old, evicted, draining) is
//! dropped with whatever is still in flight once its closing limit
//! ([`closing_limit`]) has passed.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::app::{App, Plane};
use super::auth::ClientAddr;
use super::response::Body;
use crate::telemetry::{CloseReason, ConnectionMetrics};

/// Extra connections a listener serving everything ([`Plane::Both`]) accepts
/// once its slots are full and none is idle, served as [`Plane::Reserve`]
/// (admin API, `/metrics`, `/healthz`): the operator can still reach a
/// listener that clients have filled.
pub const ADMIN_RESERVE_CONNECTIONS: usize = 32;

/// Head and idle timeout of a reserve connection (at most the configured
/// ones): reserve slots are few, so whoever holds one must use it at once.
pub const RESERVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Largest request head: hyper's HTTP/1 read buffer (`max_buf_size`; a head
/// must fit in it, else 431) and HTTP/2's header list. The HTTP/1 read
/// buffer is what a client makes the gateway hold without finishing a
/// request: 4096 connections × 32 KiB is 128 MiB at most, where hyper's
/// default (about 400 KiB) would allow 1.6 GiB. (An HTTP/2 client can make
/// it hold its receive window besides: see `H2_CONNECTION_WINDOW`.) It
/// also bounds the HTTP/1 write buffer: an answer is read ahead of a slow
/// client by at most this much. 32 KiB is what nginx allows a head by
/// default (4 × 8 KiB), far above what browsers and bearer tokens need.
pub const MAX_HEAD_BYTES: usize = 32 << 10;

/// Streams one HTTP/2 connection may have open at once: nginx's default,
/// and as many requests as a node runs handler instances for by default
/// (`--max-instances`), so more would only wait. Set here because hyper's
/// own default (200) is not part of its stable API.
const H2_MAX_CONCURRENT_STREAMS: u32 = 128;

/// HTTP/2 receive window of one stream: request body bytes a client may
/// send ahead of the handler reading them. 256 KiB per round trip is about
/// 25 MB/s at 10 ms, plenty for an image upload; hyper's default (1 MiB)
/// would let one connection park 1 MiB per stream.
pub const H2_STREAM_WINDOW: u32 = 256 << 10;

/// HTTP/2 receive window of one connection, all its streams together: what
/// an HTTP/2 client can make the gateway hold besides its head
/// ([`MAX_HEAD_BYTES`]). Worst case, every connection of a full listener
/// with its window full: 4096 × (256 + 32) KiB = 1.1 GiB by default (unread
/// bodies only: a handler reading its body frees the window). Without it,
/// hyper's defaults (1 MiB a stream and a connection) would allow 4 GiB.
pub const H2_CONNECTION_WINDOW: u32 = 256 << 10;

/// Answer bytes one HTTP/2 stream buffers ahead of the client's window: a
/// streamed answer is read from the handler no further ahead than this
/// (answers whole in memory are sent as they are). Worst case a connection
/// buffers streams × this: 128 × 64 KiB = 8 MiB, and only of answers that
/// exist anyway; a client that takes none is dropped ([`CloseReason::Stalled`]).
/// hyper's default is 400 KiB.
const H2_MAX_SEND_BUF: usize = 64 << 10;

/// How long a connection shutting down gracefully (idle, too old, evicted,
/// draining) with nothing in flight may take to close by itself before it
/// is dropped: HTTP/2's GOAWAY waits for the answer to a PING.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// How often, per idle timeout, a connection with a request in flight is
/// looked at for a stall: a stall is seen at most a quarter of the idle
/// timeout late, for a timer per busy connection every few seconds.
const STALL_CHECKS: u32 = 4;

/// How long a connection told to close (idle, too old, evicted, draining)
/// may keep requests in flight before it is dropped with them: a request
/// that arrived just before has its deadline (`--request-timeout-ms`) for
/// its handler, then an idle timeout for its answer to be sent. A client
/// still taking an answer then sees the connection cut mid-answer (HTTP/1:
/// fewer bytes than its `Content-Length`, or no last chunk; HTTP/2: the
/// connection closes after its GOAWAY, the stream unfinished). A tenant
/// whose deadline is longer than the default loses a request still running
/// then; the drain at shutdown cuts sooner still (`SHUTDOWN_GRACE`).
fn closing_limit(request_timeout: Duration, idle_timeout: Duration) -> Duration {
    request_timeout + idle_timeout
}

/// Evicted connections still closing, at most, per listener. Each holds a
/// file descriptor past the cap until it closes (within `CLOSE_GRACE`
/// unless a request raced in), so they count in the open-file limit
/// (`open_files`); past them a newcomer to a full listener is refused.
pub const EVICTION_BACKLOG: usize = 32;

/// How much shorter than `--max-connection-age-s` a connection's own age
/// limit may be (a fraction), spread by its port: connections opened
/// together (a restart, a client's burst) do not all close together.
const AGE_SPREAD: f64 = 0.1;

/// Refusals (429, 503) in a row after which a connection is shut down
/// gracefully ([`CloseReason::Refusing`]): a client that ignores
/// `Retry-After` pays a new connection (and the per-address cap) for its
/// next tries, instead of refusals costing the node as fast as it can send.
pub const REFUSALS_BEFORE_CLOSE: u32 = 8;

/// How one kind of connection is served.
struct Profile {
    builder: auto::Builder<TokioExecutor>,
    plane: Plane,
    head_timeout: Duration,
    /// How long a connection may have no request in flight, or an answer
    /// the client does not take.
    idle_timeout: Duration,
    /// See [`closing_limit`].
    closing_limit: Duration,
}

impl Profile {
    fn new(plane: Plane, head_timeout: Duration, idle_timeout: Duration, request_timeout: Duration) -> Self {
        let mut builder = auto::Builder::new(TokioExecutor::new());
        // hyper restarts this timer whenever an HTTP/1 connection waits for a
        // head, idle keep-alive included. The watchdog enforces the first head
        // and idleness (a later head trickling in is no request, so its
        // connection is closed as idle); hyper's timer is a backstop that
        // fires only after the watchdog's, so the watchdog counts closures.
        builder.http1().timer(TokioTimer::new()).header_read_timeout(head_timeout + idle_timeout).max_buf_size(MAX_HEAD_BYTES);
        if plane == Plane::Reserve {
            // One request per reserve connection: the slot comes back at once.
            builder.http1().keep_alive(false);
        }
        // No HTTP/2 keep-alive pings of our own: idle connections are closed,
        // not probed.
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_concurrent_streams(H2_MAX_CONCURRENT_STREAMS)
            .max_header_list_size(MAX_HEAD_BYTES as u32)
            .initial_stream_window_size(H2_STREAM_WINDOW)
            .initial_connection_window_size(H2_CONNECTION_WINDOW)
            // Fixed windows: an adaptive one would grow past them.
            .adaptive_window(false)
            .max_send_buf_size(H2_MAX_SEND_BUF);
        let closing_limit = closing_limit(request_timeout, idle_timeout);
        Self { builder, plane, head_timeout, idle_timeout, closing_limit }
    }
}

/// A listener's connection settings and slots.
pub(super) struct Listener {
    app: Arc<App>,
    tls: Option<TlsAcceptor>,
    main: Profile,
    /// Longest a connection stays open (`--max-connection-age-s`), if bounded.
    max_age: Option<Duration>,
    /// The main slots.
    open: Arc<Registry>,
    /// Only for [`Plane::Both`].
    reserve: Option<(Profile, Arc<Semaphore>)>,
    per_ip: Option<PerIp>,
    metrics: Arc<ConnectionMetrics>,
}

impl Listener {
    /// The settings `app`'s configuration asks for, serving `plane`.
    pub(super) fn new(app: Arc<App>, plane: Plane, tls: Option<TlsAcceptor>) -> Self {
        let config = &app.config;
        let (head, idle, request) = (config.request_head_timeout(), config.idle_timeout(), config.request_timeout());
        let main = Profile::new(plane, head, idle, request);
        let reserve = (plane == Plane::Both).then(|| {
            let profile = Profile::new(Plane::Reserve, head.min(RESERVE_TIMEOUT), idle.min(RESERVE_TIMEOUT), request);
            (profile, Arc::new(Semaphore::new(ADMIN_RESERVE_CONNECTIONS)))
        });
        let open = Arc::new(Registry::new(config.max_connections as usize));
        let per_ip = (config.max_connections_per_ip > 0).then(|| PerIp { cap: config.max_connections_per_ip, open: Arc::default() });
        let metrics = Arc::clone(&app.metrics.connections);
        let max_age = config.max_connection_age();
        Self { app, tls, main, max_age, open, reserve, per_ip, metrics }
    }

    /// Takes a slot for a connection from `peer`: a free main one, else the
    /// one of the longest-idle connection (closed to make room), else (on a
    /// shared listener) a reserve one. Over a cap, counts and logs the refusal.
    pub(super) fn admit(&self, peer: SocketAddr) -> Option<Slot> {
        let admitted = self.try_admit(peer);
        if let Err(reason) = admitted {
            closed(&self.metrics, peer, reason);
        }
        admitted.ok()
    }

    fn try_admit(&self, peer: SocketAddr) -> Result<Slot, CloseReason> {
        // An address at its cap is refused before it can evict anyone.
        let address = match &self.per_ip {
            Some(per_ip) => Some(per_ip.take(peer.ip())?),
            None => None,
        };
        let activity = Arc::new(Activity::new(Instant::now(), self.max_age.map(|age| age_limit(age, peer))));
        let held = match self.open.take(&activity) {
            Some((main, evicted)) => {
                if evicted {
                    self.metrics.closed(CloseReason::Evicted);
                    tracing::debug!(%peer, "listener full: its longest-idle connection closes to admit this one");
                }
                Held::Main(main)
            }
            None => match &self.reserve {
                Some((_, reserve)) => Held::Reserve(Arc::clone(reserve).try_acquire_owned().map_err(|_| CloseReason::OverCapacity)?),
                None => return Err(CloseReason::OverCapacity),
            },
        };
        self.metrics.opened();
        Ok(Slot { activity, held, _address: address, metrics: Arc::clone(&self.metrics) })
    }

    /// Serves one admitted connection to its end: TLS handshake, then HTTP
    /// under the watchdog, until it closes, a limit closes it, or the drain
    /// (`draining` turning true) shuts it down.
    pub(super) async fn serve(self: Arc<Self>, stream: TcpStream, peer: SocketAddr, slot: Slot, draining: watch::Receiver<bool>) {
        let profile = match (&self.reserve, &slot.held) {
            (Some((reserve, _)), Held::Reserve(_)) => reserve,
            _ => &self.main,
        };
        let activity = Arc::clone(&slot.activity);
        // Under TLS too: a blocked write is the client's socket being full.
        let stream = Watched { inner: stream, activity: Arc::clone(&activity), linger: None };
        let watch = Watch { profile, activity: Arc::clone(&activity), peer, metrics: &self.metrics, draining };
        match &self.tls {
            None => watch.run(&self.app, stream, None).await,
            Some(tls) => {
                let mut draining = watch.draining.clone();
                let deadline = activity.epoch + profile.head_timeout;
                tokio::select! {
                    handshake = tokio::time::timeout_at(deadline, tls.accept(stream)) => match handshake {
                        Ok(Ok(stream)) => {
                            let tls = Tls::of(stream.get_ref().1);
                            watch.run(&self.app, stream, Some(tls)).await
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            closed(&self.metrics, peer, CloseReason::TlsHandshake);
                        }
                        Err(_) => closed(&self.metrics, peer, CloseReason::HeadTimeout),
                    },
                    // Evicted (counted there) or drained mid-handshake: nothing to finish.
                    () = activity.eviction.notified() => {}
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

/// A connection's own age limit: `max_age`, less up to [`AGE_SPREAD`] of it
/// by the client's port (as good as random here, and free).
fn age_limit(max_age: Duration, peer: SocketAddr) -> Duration {
    let spread = f64::from(peer.port() % 1000) / 1000.0 * AGE_SPREAD;
    max_age.mul_f64(1.0 - spread)
}

/// A listener's main connections: the cap, and the eviction that makes room
/// for a newcomer once it is reached.
struct Registry {
    cap: usize,
    open: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    next_id: u64,
    connections: HashMap<u64, Arc<Activity>>,
    /// Evicted connections not yet ended.
    evicted: usize,
}

impl Registry {
    fn new(cap: usize) -> Self {
        Self { cap, open: Mutex::default() }
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A main slot for `activity`'s connection: a free one, else the slot of
    /// the connection idle the longest, which is told to close (the `bool`
    /// says so). `None` when every connection has a request in flight, or
    /// [`EVICTION_BACKLOG`] evicted ones are still closing.
    fn take(self: &Arc<Self>, activity: &Arc<Activity>) -> Option<(MainSlot, bool)> {
        let mut open = self.lock();
        let evicted = open.connections.len() >= self.cap;
        if evicted {
            if open.evicted >= EVICTION_BACKLOG {
                return None;
            }
            // A scan of every connection, only when full: microseconds for thousands.
            let longest_idle = open.connections.iter().filter_map(|(id, a)| Some((a.idle_since()?, *id))).min()?.1;
            let victim = open.connections.remove(&longest_idle)?;
            // Heard by its watchdog, now or as soon as it next waits.
            victim.eviction.notify_one();
            open.evicted += 1;
        }
        let id = open.next_id;
        open.next_id += 1;
        open.connections.insert(id, Arc::clone(activity));
        Some((MainSlot { id, registry: Arc::clone(self) }, evicted))
    }

    fn release(&self, id: u64) {
        let mut open = self.lock();
        if open.connections.remove(&id).is_none() {
            // Evicted before: one fewer still closing.
            open.evicted = open.evicted.saturating_sub(1);
        }
    }
}

/// A main slot, given back on drop.
struct MainSlot {
    id: u64,
    registry: Arc<Registry>,
}

impl Drop for MainSlot {
    fn drop(&mut self) {
        self.registry.release(self.id);
    }
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
    /// What its watchdog looks at; its epoch is the moment of admission.
    activity: Arc<Activity>,
    held: Held,
    _address: Option<AddressShare>,
    metrics: Arc<ConnectionMetrics>,
}

/// Which slot a connection holds.
enum Held {
    Main(#[allow(dead_code, reason = "held for its Drop: the slot comes back when the connection ends")] MainSlot),
    Reserve(#[allow(dead_code, reason = "held for its Drop: the slot comes back when the connection ends")] OwnedSemaphorePermit),
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.metrics.ended();
    }
}

/// What the watchdog looks at, shared by the service, the registry and the watchdog.
struct Activity {
    /// When the connection was accepted.
    epoch: Instant,
    /// This connection's age limit (see [`age_limit`]), if any.
    age_limit: Option<Duration>,
    /// When the last request ended, in ms since `epoch` (0: none has).
    last_done_ms: AtomicU64,
    /// Requests not yet answered, or whose response body is still being sent.
    in_flight: AtomicUsize,
    /// Whether a request head has arrived.
    requested: AtomicBool,
    /// Told when a newcomer takes this connection's slot.
    eviction: Notify,
    /// Answers in a row that refused the request (429, 503).
    refused_in_a_row: AtomicU32,
    /// Told when [`REFUSALS_BEFORE_CLOSE`] refusals came in a row.
    refusing: Notify,
    /// Answers waiting for the client: hyper holds a frame of theirs (or
    /// their head) and has not asked for the next.
    waiting_answers: AtomicUsize,
    /// When an answer last moved (was made, or asked for its next frame),
    /// in ms since `epoch`.
    answer_moved_ms: AtomicU64,
    /// Since when writes to the socket have been blocked (it is full: the
    /// client does not read), in ms since `epoch`; [`NOT_BLOCKED`] if not.
    write_blocked_ms: AtomicU64,
}

/// [`Activity::write_blocked_ms`] when the last write went through.
const NOT_BLOCKED: u64 = u64::MAX;

impl Activity {
    fn new(epoch: Instant, age_limit: Option<Duration>) -> Self {
        Self {
            epoch,
            age_limit,
            last_done_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            requested: AtomicBool::new(false),
            eviction: Notify::new(),
            refused_in_a_row: AtomicU32::new(0),
            refusing: Notify::new(),
            waiting_answers: AtomicUsize::new(0),
            answer_moved_ms: AtomicU64::new(0),
            write_blocked_ms: AtomicU64::new(NOT_BLOCKED),
        }
    }

    /// Milliseconds from `epoch` to now.
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 // `as` saturates
    }

    /// A request was answered `status`: counts refusals in a row, and tells
    /// the watchdog once there were [`REFUSALS_BEFORE_CLOSE`]; returns
    /// whether this answer is the one that closes the connection.
    fn answered(&self, status: hyper::StatusCode) -> bool {
        let refused = matches!(status, hyper::StatusCode::TOO_MANY_REQUESTS | hyper::StatusCode::SERVICE_UNAVAILABLE);
        if !refused {
            self.refused_in_a_row.store(0, Ordering::Relaxed);
            return false;
        }
        let last = self.refused_in_a_row.fetch_add(1, Ordering::Relaxed) + 1 == REFUSALS_BEFORE_CLOSE;
        if last {
            self.refusing.notify_one();
        }
        last
    }

    /// An answer moved, and now waits for the client until the guard drops.
    fn wait(self: &Arc<Self>) -> Waiting {
        self.moved();
        self.waiting_answers.fetch_add(1, Ordering::AcqRel);
        Waiting(Arc::clone(self))
    }

    /// An answer moved: hyper asked for its next frame.
    fn moved(&self) {
        self.answer_moved_ms.fetch_max(self.now_ms(), Ordering::Relaxed);
    }

    /// A write to the socket went through (`blocked`: it did not).
    fn wrote(&self, blocked: bool) {
        if blocked {
            // From the first blocked write on, not the latest.
            let _ = self.write_blocked_ms.compare_exchange(NOT_BLOCKED, self.now_ms(), Ordering::Relaxed, Ordering::Relaxed);
        } else if self.write_blocked_ms.load(Ordering::Relaxed) != NOT_BLOCKED {
            self.write_blocked_ms.store(NOT_BLOCKED, Ordering::Relaxed);
        }
    }

    /// Whether the last write to the socket was blocked (it is full).
    fn write_blocked(&self) -> bool {
        self.write_blocked_ms.load(Ordering::Relaxed) != NOT_BLOCKED
    }

    /// Since when the client has taken nothing: its socket full, or an
    /// answer waiting for it with none moving. `None` while it takes them.
    fn stalled_since(&self) -> Option<Instant> {
        let blocked = self.write_blocked_ms.load(Ordering::Relaxed);
        let blocked = (blocked != NOT_BLOCKED).then_some(blocked);
        let waiting = self.waiting_answers.load(Ordering::Acquire) > 0;
        let unmoved = waiting.then(|| self.answer_moved_ms.load(Ordering::Relaxed));
        let since = blocked.into_iter().chain(unmoved).min()?;
        Some(self.epoch + Duration::from_millis(since))
    }

    /// A request head arrived: counted in flight until the guard drops
    /// (its response body is sent, or the request was dropped).
    fn begin(self: &Arc<Self>) -> InFlight {
        self.requested.store(true, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(Arc::clone(self))
    }

    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Since when the connection has had no request in flight (its accept,
    /// or its last request's end); `None` while one is.
    fn idle_since(&self) -> Option<Instant> {
        if self.in_flight() > 0 {
            return None;
        }
        Some(self.epoch + Duration::from_millis(self.last_done_ms.load(Ordering::Relaxed)))
    }

    /// What a connection not yet shutting down should do at `now`.
    fn check(&self, profile: &Profile, now: Instant) -> Verdict {
        let too_old_at = self.age_limit.map(|age| self.epoch + age);
        if too_old_at.is_some_and(|at| now >= at) {
            return Verdict::Expired(CloseReason::MaxAge);
        }
        let next = if !self.requested.load(Ordering::Relaxed) {
            let deadline = self.epoch + profile.head_timeout;
            if now >= deadline {
                return Verdict::Expired(CloseReason::HeadTimeout);
            }
            deadline
        } else if let Some(since) = self.idle_since() {
            let deadline = since + profile.idle_timeout;
            if now >= deadline {
                // HTTP/1 reads no request while its last answer waits to be
                // flushed: a client that does not read is idle, and stalled.
                let reason = if self.write_blocked() { CloseReason::Stalled } else { CloseReason::Idle };
                return Verdict::Expired(reason);
            }
            deadline
        } else if let Some(since) = self.stalled_since() {
            // In flight, but the client takes nothing: as good as idle.
            let deadline = since + profile.idle_timeout;
            if now >= deadline {
                return Verdict::Expired(CloseReason::Stalled);
            }
            deadline
        } else {
            // A request in flight is never idle; its own deadline bounds it,
            // and a stall is looked for again soon.
            now + profile.idle_timeout / STALL_CHECKS
        };
        Verdict::CheckAt(too_old_at.map_or(next, |at| at.min(next)))
    }

    /// What a connection shutting down since `cut_at` less its closing
    /// limit should do at `now`: go once nothing is in flight; past
    /// `cut_at`, or with its client taking nothing for the idle timeout, go
    /// with its requests in flight (not counted again: its closure was).
    fn check_closing(&self, profile: &Profile, cut_at: Instant, now: Instant) -> Closing {
        if self.in_flight() == 0 {
            return Closing::Done;
        }
        if now >= cut_at {
            return Closing::Cut("its closing limit passed");
        }
        let stalled_at = self.stalled_since().map(|since| since + profile.idle_timeout);
        if stalled_at.is_some_and(|at| now >= at) {
            return Closing::Cut("its client takes no answer");
        }
        Closing::Wait((now + CLOSE_GRACE).min(cut_at).min(stalled_at.unwrap_or(cut_at)))
    }
}

/// See [`Activity::check_closing`].
#[derive(Debug, PartialEq)]
enum Closing {
    /// Look again then.
    Wait(Instant),
    /// Nothing in flight: drop it.
    Done,
    /// Drop it with its requests in flight, for this reason.
    Cut(&'static str),
}

#[derive(Debug, PartialEq)]
enum Verdict {
    Expired(CloseReason),
    CheckAt(Instant),
}

/// A request in flight (see [`Activity::begin`]).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        // Idleness counts from the answer. `fetch_max`: streams of one
        // HTTP/2 connection end concurrently.
        self.0.last_done_ms.fetch_max(self.0.now_ms(), Ordering::Relaxed);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer waiting for the client (see [`Activity::wait`]).
struct Waiting(Arc<Activity>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting_answers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The client's socket, telling its [`Activity`] whether writes go through,
/// and closing it with a linger (see [`Linger`]).
struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
    linger: Option<Linger>,
}

/// Most bytes a closing connection reads and drops after its half-close.
const LINGER_BYTES: usize = 1 << 20;
/// Longest a closing connection reads and drops after its half-close.
const LINGER_TIME: Duration = Duration::from_secs(2);

/// A closing connection's linger: its answer was sent (a refusal, often,
/// given before the request's body was read) and its write side shut; what
/// the client still sends (the rest of that body) is read and dropped for a
/// while. Closing with unread data would reset the connection, and the
/// reset can reach the client before the answer does: it would see a
/// broken connection instead of its 503 and `Retry-After`.
struct Linger {
    until: Pin<Box<tokio::time::Sleep>>,
    left: usize,
    write_shut: bool,
}

impl Linger {
    fn new() -> Self {
        Self { until: Box::pin(tokio::time::sleep(LINGER_TIME)), left: LINGER_BYTES, write_shut: false }
    }

    /// Shuts `io`'s write side, then drops what it reads until the client
    /// closes, or [`LINGER_BYTES`] or [`LINGER_TIME`] are spent.
    fn poll_close<S: AsyncRead + AsyncWrite + Unpin>(&mut self, io: &mut S, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if !self.write_shut {
            std::task::ready!(Pin::new(&mut *io).poll_shutdown(cx))?;
            self.write_shut = true;
        }
        let mut buf = [0u8; 8192];
        loop {
            if self.left == 0 || self.until.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(()));
            }
            let mut read = tokio::io::ReadBuf::new(&mut buf);
            match Pin::new(&mut *io).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) if read.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => self.left = self.left.saturating_sub(read.filled().len()),
                // Reset by the client, or the like: nothing left to protect.
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl<S> Watched<S> {
    fn note<T>(&self, polled: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        self.activity.wrote(polled.is_pending());
        polled
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut tokio::io::ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.note(polled)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.note(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        this.linger.get_or_insert_with(Linger::new).poll_close(&mut this.inner, cx)
    }
}

/// What the watchdog does next.
enum Step {
    /// Look again then.
    Wait(Instant),
    /// Shut the connection down gracefully: in-flight requests finish
    /// (HTTP/1: `Connection: close`; HTTP/2: GOAWAY).
    Close,
    /// Drop the connection now.
    Drop,
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
    /// Serves HTTP on `io` until the connection ends. Past the head deadline,
    /// or stalled, the connection is dropped; idle, too old, evicted or at
    /// the drain, it is shut down gracefully, and dropped once nothing is in
    /// flight and it has not closed within [`CLOSE_GRACE`], or with what is
    /// in flight past its closing limit.
    async fn run<I>(mut self, app: &Arc<App>, io: I, tls: Option<Tls>)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let service = service(app, self.profile.plane, &self.activity, (self.peer, tls));
        let conn = self.profile.builder.serve_connection_with_upgrades(TokioIo::new(io), service);
        tokio::pin!(conn);
        // Once shutting down: when it is dropped with whatever is in flight.
        let mut cut_at = None;
        // At once: the first check says when the next is due.
        let mut check_at = self.activity.epoch;
        loop {
            let close = tokio::select! {
                ended = conn.as_mut() => {
                    // HTTP/1 closes on the refusal's `Connection: close`, before
                    // the watchdog hears of it: count it here.
                    if cut_at.is_none() && self.activity.refused_in_a_row.load(Ordering::Relaxed) >= REFUSALS_BEFORE_CLOSE {
                        closed(self.metrics, self.peer, CloseReason::Refusing);
                    }
                    if let Err(e) = ended {
                        tracing::debug!(peer = %self.peer, error = %e, "connection ended with an error");
                    }
                    return;
                }
                () = tokio::time::sleep_until(check_at) => match self.step(cut_at, Instant::now()) {
                    Step::Wait(at) => {
                        check_at = at;
                        false
                    }
                    Step::Close => true,
                    Step::Drop => return,
                },
                // A newcomer took this connection's slot (and counted it).
                () = self.activity.eviction.notified(), if cut_at.is_none() => true,
                () = self.activity.refusing.notified(), if cut_at.is_none() => {
                    closed(self.metrics, self.peer, CloseReason::Refusing);
                    true
                }
                () = drained(&mut self.draining), if cut_at.is_none() => true,
            };
            if close {
                conn.as_mut().graceful_shutdown();
                let now = Instant::now();
                cut_at = Some(now + self.profile.closing_limit);
                check_at = now + CLOSE_GRACE;
            }
        }
    }

    /// What to do at `now` (`cut_at`: shutting down, see [`Self::run`]);
    /// counts the closures a limit decides.
    fn step(&self, cut_at: Option<Instant>, now: Instant) -> Step {
        if let Some(cut_at) = cut_at {
            // In-flight requests finish, within bounds; then the connection goes.
            return match self.activity.check_closing(self.profile, cut_at, now) {
                Closing::Wait(at) => Step::Wait(at),
                Closing::Done => Step::Drop,
                Closing::Cut(why) => {
                    tracing::debug!(peer = %self.peer, why, in_flight = self.activity.in_flight(), "closing connection dropped with requests in flight");
                    Step::Drop
                }
            };
        }
        match self.activity.check(self.profile, now) {
            Verdict::CheckAt(at) => Step::Wait(at),
            Verdict::Expired(reason) => {
                closed(self.metrics, self.peer, reason);
                // No request yet, or a client that takes no answer (it would
                // not read a GOAWAY either): nothing to finish.
                if matches!(reason, CloseReason::HeadTimeout | CloseReason::Stalled) { Step::Drop } else { Step::Close }
            }
        }
    }
}

/// The connection's service: `app`'s routes for `plane`, each request
/// (tagged with `peer`'s [`ClientAddr`] and, over TLS, the connection's
/// [`Tls`]) counted in flight until its response body is sent.
fn service(
    app: &Arc<App>,
    plane: Plane,
    activity: &Arc<Activity>,
    (peer, tls): (SocketAddr, Option<Tls>),
) -> impl hyper::service::Service<hyper::Request<Incoming>, Response = hyper::Response<Answer>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    let (app, activity) = (Arc::clone(app), Arc::clone(activity));
    service_fn(move |mut req: hyper::Request<Incoming>| {
        let (app, in_flight) = (Arc::clone(&app), activity.begin());
        req.extensions_mut().insert(ClientAddr(peer));
        if let Some(tls) = &tls {
            req.extensions_mut().insert(tls.clone());
        }
        let http1 = req.version() < hyper::Version::HTTP_2;
        async move {
            let mut response = app.route(req, plane).await;
            // HTTP/1: the closing answer says so (HTTP/2 gets a GOAWAY).
            if in_flight.0.answered(response.status()) && http1 {
                response.headers_mut().insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
            }
            Ok::<_, Infallible>(response.map(|body| Answer::new(body, in_flight)))
        }
    })
}

/// A request that came over TLS, and the server name its client asked for
/// in the handshake (SNI), if any.
#[derive(Debug, Clone)]
pub(super) struct Tls {
    /// The handshake's server name, as rustls validated it.
    pub(super) server_name: Option<Arc<str>>,
}

impl Tls {
    fn of(connection: &tokio_rustls::rustls::ServerConnection) -> Self {
        Self { server_name: connection.server_name().map(Arc::from) }
    }
}

/// A response body that keeps its request in flight until it ends (or is
/// dropped): a long response stream is not an idle connection. It also
/// says whether the client takes it: from when it is made, and after each
/// frame it gives, it waits for the client until hyper asks for the next.
struct Answer {
    body: Body,
    in_flight: Option<InFlight>,
    waiting: Option<Waiting>,
}

impl Answer {
    fn new(body: Body, in_flight: InFlight) -> Self {
        Self { body, waiting: Some(in_flight.0.wait()), in_flight: Some(in_flight) }
    }
}

impl hyper::body::Body for Answer {
    type Data = <Body as hyper::body::Body>::Data;
    type Error = <Body as hyper::body::Body>::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        // Asked for more: what it gave before has gone on.
        this.waiting = None;
        let activity = this.in_flight.as_ref().map(|in_flight| &in_flight.0);
        activity.inspect(|activity| activity.moved());
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(_))) => this.waiting = activity.map(Activity::wait),
            Poll::Ready(None | Some(Err(_))) => this.in_flight = None,
            // The handler is still making it: the client is not the one waited for.
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    const HEAD: Duration = Duration::from_secs(10);
    const IDLE: Duration = Duration::from_secs(30);
    const REQUEST: Duration = Duration::from_secs(10);

    fn profile() -> Profile {
        Profile::new(Plane::Data, HEAD, IDLE, REQUEST)
    }

    #[test]
    fn caps_count_ipv6_by_its_64_and_mapped_ipv4_as_ipv4() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(client_key(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
        assert_eq!(client_key(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
        assert_eq!(client_key(ip("10.0.0.1")), ip("10.0.0.1"));
    }

    /// One host's /64 is one client: addresses it rotates through share
    /// its cap; the next /64 over, and IPv4, have their own.
    #[test]
    fn the_per_ip_cap_counts_an_ipv6_64_as_one_client() {
        let per_ip = PerIp { cap: 2, open: Arc::default() };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let held = [per_ip.take(ip("2001:db8:1:2::1")).unwrap(), per_ip.take(ip("2001:db8:1:2:ffff:ffff:ffff:fffe")).unwrap()];
        assert_eq!(per_ip.take(ip("2001:db8:1:2:1234::9")).err(), Some(CloseReason::PerIpCap), "a third address of the same /64");
        assert!(per_ip.take(ip("2001:db8:1:3::1")).is_ok(), "the next /64 is another client");
        assert!(per_ip.take(ip("::ffff:192.0.2.1")).is_ok(), "a mapped IPv4 address counts as itself");
        drop(held);
        assert!(per_ip.take(ip("2001:db8:1:2::42")).is_ok(), "the /64's shares came back");
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
        let profile = profile();
        let t0 = Instant::now();
        let activity = Arc::new(Activity::new(t0, None));
        assert_eq!(activity.check(&profile, t0), Verdict::CheckAt(t0 + HEAD));
        assert_eq!(activity.check(&profile, t0 + HEAD), Verdict::Expired(CloseReason::HeadTimeout));
        let in_flight = activity.begin();
        let later = t0 + Duration::from_secs(100);
        assert_eq!(activity.check(&profile, later), Verdict::CheckAt(later + IDLE / STALL_CHECKS), "in flight: never idle");
        drop(in_flight);
        let answered = activity.idle_since().unwrap();
        assert!(answered >= t0);
        assert_eq!(activity.check(&profile, answered), Verdict::CheckAt(answered + IDLE));
        assert_eq!(activity.check(&profile, answered + IDLE), Verdict::Expired(CloseReason::Idle));
    }

    #[test]
    fn the_age_limit_closes_even_a_busy_connection() {
        let profile = profile();
        let t0 = Instant::now();
        let age = Duration::from_secs(60);
        let activity = Arc::new(Activity::new(t0, Some(age)));
        let _in_flight = activity.begin();
        let now = t0 + Duration::from_secs(55);
        assert_eq!(activity.check(&profile, now), Verdict::CheckAt(t0 + age), "the next check is due at the age limit");
        assert_eq!(activity.check(&profile, t0 + age), Verdict::Expired(CloseReason::MaxAge));
    }

    #[test]
    fn age_limits_are_spread_below_the_maximum() {
        let max = Duration::from_secs(600);
        let limits: Vec<Duration> =
            [1u16, 999, 40_123, 65_535].iter().map(|&port| age_limit(max, SocketAddr::from(([127, 0, 0, 1], port)))).collect();
        assert!(limits.iter().all(|&l| l <= max && l >= max.mul_f64(1.0 - AGE_SPREAD)), "{limits:?}");
        assert_ne!(limits[0], limits[1], "ports spread the limits");
    }

    #[tokio::test]
    async fn a_response_body_keeps_its_request_in_flight_until_sent() {
        let activity = Arc::new(Activity::new(Instant::now(), None));
        let answer = Answer::new(super::super::response::full("streamed"), activity.begin());
        assert_eq!(activity.idle_since(), None, "the head is answered, the body not yet sent");
        let sent = answer.collect().await.unwrap().to_bytes();
        assert_eq!(&sent[..], b"streamed");
        assert!(activity.idle_since().is_some(), "idle once the body is sent");
    }

    #[test]
    fn an_answer_the_client_does_not_take_stalls_its_connection() {
        let profile = profile();
        let t0 = Instant::now();
        let activity = Arc::new(Activity::new(t0, None));
        let in_flight = activity.begin();
        assert_eq!(activity.stalled_since(), None, "the handler runs: nothing waits for the client");
        // Answered: it waits for the client from then on.
        let waiting = activity.wait();
        let since = activity.stalled_since().unwrap();
        assert_eq!(activity.check(&profile, since), Verdict::CheckAt(since + IDLE));
        assert_eq!(activity.check(&profile, since + IDLE), Verdict::Expired(CloseReason::Stalled));
        drop(waiting);
        assert_eq!(activity.stalled_since(), None, "taken");
        // A socket the client does not read is a stall too, from the first blocked write.
        activity.wrote(true);
        let blocked = activity.stalled_since().unwrap();
        activity.wrote(true);
        assert_eq!(activity.stalled_since(), Some(blocked));
        assert_eq!(activity.check(&profile, blocked + IDLE), Verdict::Expired(CloseReason::Stalled));
        activity.wrote(false);
        assert_eq!(activity.stalled_since(), None, "a write went through");
        drop(in_flight);
        activity.wrote(true);
        let idle = activity.idle_since().unwrap();
        assert_eq!(activity.check(&profile, idle), Verdict::CheckAt(idle + IDLE), "nothing in flight: the idle timeout decides");
        assert_eq!(activity.check(&profile, idle + IDLE), Verdict::Expired(CloseReason::Stalled), "idle, its socket full");
    }

    #[test]
    fn a_closing_connection_goes_when_done_or_at_its_limit_with_what_is_in_flight() {
        let profile = profile();
        let t0 = Instant::now();
        let cut_at = t0 + profile.closing_limit;
        assert_eq!(profile.closing_limit, REQUEST + IDLE);
        let activity = Arc::new(Activity::new(t0, None));
        assert_eq!(activity.check_closing(&profile, cut_at, t0), Closing::Done, "nothing in flight");
        let _in_flight = activity.begin();
        assert_eq!(activity.check_closing(&profile, cut_at, t0), Closing::Wait(t0 + CLOSE_GRACE), "in flight: it finishes");
        let late = cut_at - CLOSE_GRACE / 2;
        assert_eq!(activity.check_closing(&profile, cut_at, late), Closing::Wait(cut_at), "never waits past the limit");
        assert!(matches!(activity.check_closing(&profile, cut_at, cut_at), Closing::Cut(_)), "cut at the limit");
        // A client taking nothing is not waited for to the limit.
        let _waiting = activity.wait();
        let stalled_at = activity.stalled_since().unwrap() + IDLE;
        assert!(stalled_at < cut_at);
        assert!(matches!(activity.check_closing(&profile, cut_at, stalled_at), Closing::Cut(_)));
    }

    #[tokio::test]
    async fn an_answer_waits_for_the_client_between_the_frames_it_gives() {
        let activity = Arc::new(Activity::new(Instant::now(), None));
        let mut answer = Answer::new(super::super::response::full("streamed"), activity.begin());
        assert!(activity.stalled_since().is_some(), "made: waiting to be asked for its body");
        let frame = answer.frame().await.unwrap().unwrap();
        assert!(frame.is_data());
        assert!(activity.stalled_since().is_some(), "a frame given: waiting for the next ask");
        assert!(answer.frame().await.is_none());
        assert_eq!(activity.stalled_since(), None, "sent");
        assert!(activity.idle_since().is_some());
    }

    /// An activity accepted at `epoch` whose one request ended there.
    fn idle_at(epoch: Instant) -> Arc<Activity> {
        let activity = Arc::new(Activity::new(epoch, None));
        drop(activity.begin());
        activity.last_done_ms.store(0, Ordering::Relaxed);
        activity
    }

    #[test]
    fn a_full_listener_evicts_its_longest_idle_connection_never_a_busy_one() {
        let registry = Arc::new(Registry::new(3));
        let t0 = Instant::now();
        let busy = Arc::new(Activity::new(t0, None));
        let _request = busy.begin();
        let (oldest, newer) = (idle_at(t0 + Duration::from_secs(1)), idle_at(t0 + Duration::from_secs(2)));
        let held: Vec<_> = [&busy, &oldest, &newer].into_iter().map(|a| registry.take(a).unwrap()).collect();
        assert!(held.iter().all(|(_, evicted)| !evicted), "free slots first");

        let newcomer = idle_at(t0 + Duration::from_secs(3));
        let (_slot, evicted) = registry.take(&newcomer).unwrap();
        assert!(evicted);
        let open = registry.lock();
        assert!(!open.connections.values().any(|a| Arc::ptr_eq(a, &oldest)), "the longest idle gave its slot");
        assert_eq!((open.connections.len(), open.evicted), (3, 1));
        drop(open);
        // Its watchdog hears it, even though it was not waiting yet.
        let heard = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(async { tokio::time::timeout(Duration::from_millis(10), oldest.eviction.notified()).await.is_ok() });
        assert!(heard, "the evicted connection is told");

        // The evicted one ends: its slot is not given back twice.
        drop(held);
        let open = registry.lock();
        assert_eq!((open.connections.len(), open.evicted), (1, 0), "only the newcomer is left");
    }

    #[test]
    fn a_full_listener_of_busy_connections_evicts_nobody() {
        let registry = Arc::new(Registry::new(1));
        let busy = Arc::new(Activity::new(Instant::now(), None));
        let _request = busy.begin();
        let _slot = registry.take(&busy).unwrap();
        assert!(registry.take(&idle_at(Instant::now())).is_none());
    }

    #[test]
    fn evictions_still_closing_are_bounded() {
        let registry = Arc::new(Registry::new(1));
        let mut slots = vec![registry.take(&idle_at(Instant::now())).unwrap().0];
        for _ in 0..EVICTION_BACKLOG {
            slots.push(registry.take(&idle_at(Instant::now())).unwrap().0);
        }
        assert!(registry.take(&idle_at(Instant::now())).is_none(), "the backlog is full");
        // An evicted connection ends: room for one more eviction.
        slots.remove(0);
        assert!(registry.take(&idle_at(Instant::now())).is_some());
    }
}
