//! Connection limits: a connection that never sends a complete first request
//! head (TLS handshake included) is closed; an idle keep-alive connection
//! (HTTP/1.1 and HTTP/2, PINGs or not) is shut down but a slow request is
//! not cut; an old connection is shut down gracefully; the connection caps
//! close the connections over them, and a full listener closes its
//! longest-idle connection to serve a newcomer; the admin API answers on a
//! shared listener whose slots are full of busy connections; request heads
//! are bounded; closures are counted; the open-file limit is raised to fit;
//! a client that takes no answer (HTTP/1: reads nothing; HTTP/2: opens no
//! window) loses its connection after the idle timeout, even at the drain;
//! a connection refused again and again is closed; a refusal given before
//! the body reaches a client still sending it (the close lingers).

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use facegate::config::ServeConfig;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::{ClientConnection, StreamOwned};

use crate::harness::{ADMIN_TOKEN, config, fresh_dir, seed_dir, start, start_split, start_until, tls_config};

/// Head timeout of the quick gateways.
const HEAD_TIMEOUT: Duration = Duration::from_secs(1);
/// Idle timeout of the quick gateway.
const IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// Slack on waits that poll for a state (a scrape, a slot, a drain): the
/// test machine is small and noisy.
const MARGIN: Duration = Duration::from_secs(8);
/// Slack on "closed once its timeout passed": the gateway's own timers
/// close at the timeout, so this is only scheduling delay. Under the head
/// timeout plus the idle timeout (3 s), where hyper's own header timeout
/// would close a connection the gateway's check had missed.
const CLOSE_SLACK: Duration = Duration::from_secs(1);
/// Connection slots of the small gateway.
const SMALL_SLOTS: usize = 8;
/// Connections per address at the small gateway.
const SMALL_PER_IP: usize = 3;
/// Connection age limit of the aged gateway (each connection's own limit is
/// up to a tenth shorter).
const AGE: Duration = Duration::from_secs(3);

struct Gateway {
    addr: SocketAddr,
    /// Where `/metrics` is served: `addr`, or the admin listener's.
    admin: SocketAddr,
    data_dir: PathBuf,
}

impl Gateway {
    fn start(name: &str, tune: impl FnOnce(&mut ServeConfig)) -> Self {
        let data_dir = fresh_dir(name);
        let mut config = config(data_dir.clone(), Some(seed_dir()));
        tune(&mut config);
        let addr = start(config);
        Self { addr, admin: addr, data_dir }
    }

    fn key(&self, tenant: &str) -> String {
        let path = self.data_dir.join(format!("{tenant}.key"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).trim().to_owned()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// Head timeout 1 s, idle timeout 2 s, request deadline 5 s (over twice the idle timeout).
fn quick() -> &'static Gateway {
    static GATEWAY: OnceLock<Gateway> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        Gateway::start("conn-quick", |c| {
            c.request_head_timeout_ms = HEAD_TIMEOUT.as_millis() as u64;
            c.idle_timeout_ms = IDLE_TIMEOUT.as_millis() as u64;
            c.limits.timeout_ms = 5_000;
            c.max_connections = 64;
        })
    })
}

/// Few slots, a per-address cap and long timeouts (silent sockets keep
/// their slots for the whole test). Its tests fill it, so they hold the
/// returned guard: one at a time.
fn small() -> (&'static Gateway, MutexGuard<'static, ()>) {
    static GATEWAY: OnceLock<Gateway> = OnceLock::new();
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let gateway = GATEWAY.get_or_init(|| {
        Gateway::start("conn-small", |c| {
            c.request_head_timeout_ms = 60_000;
            c.idle_timeout_ms = 60_000;
            c.max_connections = SMALL_SLOTS as u32;
            c.max_connections_per_ip = SMALL_PER_IP as u32;
        })
    });
    settle(gateway);
    (gateway, guard)
}

/// Connections live at most [`AGE`]; long idle timeout.
fn aged() -> &'static Gateway {
    static GATEWAY: OnceLock<Gateway> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        Gateway::start("conn-aged", |c| {
            c.idle_timeout_ms = 60_000;
            c.max_connection_age_s = AGE.as_secs();
        })
    })
}

/// An HTTPS gateway with head timeout 1 s, and its certificate.
fn tls() -> &'static (SocketAddr, CertificateDer<'static>) {
    static GATEWAY: OnceLock<(SocketAddr, CertificateDer<'static>)> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        let (mut config, cert) = tls_config(&fresh_dir("conn-tls"));
        config.request_head_timeout_ms = HEAD_TIMEOUT.as_millis() as u64;
        (start(config), cert)
    })
}

/// A TCP connection to `addr` from the loopback address `source` (each
/// address has its own per-address cap).
pub(crate) fn connect_from(source: &str, addr: SocketAddr) -> TcpStream {
    connect_with(addr, |socket| socket.bind(SocketAddr::new(source.parse().unwrap(), 0)).unwrap())
}

/// A TCP connection to `addr` whose socket `set_up` sets up first.
fn connect_with(addr: SocketAddr, set_up: impl FnOnce(&tokio::net::TcpSocket)) -> TcpStream {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_io().build().unwrap();
    runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        set_up(&socket);
        let stream = socket.connect(addr).await.unwrap().into_std().unwrap();
        stream.set_nonblocking(false).unwrap();
        stream
    })
}

/// Reads until the server closes `stream`; panics if it is still open after
/// `within`. Returns how long that took.
fn expect_closed(stream: &mut impl Read, set_timeout: impl FnOnce(Duration), within: Duration) -> Duration {
    let started = Instant::now();
    set_timeout(within);
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return started.elapsed(),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("still open after {:?}", started.elapsed())
            }
            // Reset, or a TLS stream cut without close_notify: closed.
            Err(_) => return started.elapsed(),
        }
    }
}

/// A connection from `source` with a request in flight: an admin request
/// whose body never comes (the admin API waits 30 s for it).
fn busy_from(source: &str, addr: SocketAddr) -> TcpStream {
    let mut stream = connect_from(source, addr);
    let head = format!(
        "POST /admin/v1/tenants HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: 1000000\r\n\r\nsome"
    );
    // A connection over a cap may already be closed: its write may fail.
    let _ = stream.write_all(head.as_bytes());
    stream
}

fn expect_tcp_closed(stream: &mut TcpStream, within: Duration) -> Duration {
    let clone = stream.try_clone().unwrap();
    expect_closed(stream, |t| clone.set_read_timeout(Some(t)).unwrap(), within)
}

/// Whether `stream` is still open (nothing to read, no EOF) after a short wait.
fn still_open(stream: &mut TcpStream) -> bool {
    stream.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    matches!(stream.read(&mut [0u8; 64]), Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut))
}

/// Sends one keep-alive HTTP/1.1 request and reads its response (by
/// `Content-Length`); returns the status and body.
fn exchange(stream: &mut (impl Read + Write), method: &str, path: &str, bearer: Option<&str>) -> (u16, String) {
    let (status, _, body) = exchange_with_head(stream, method, path, bearer);
    (status, body)
}

/// [`exchange`], with the response head too.
fn exchange_with_head(stream: &mut (impl Read + Write), method: &str, path: &str, bearer: Option<&str>) -> (u16, String, String) {
    let auth = bearer.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(stream, "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Length: 0\r\n\r\n").unwrap();
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "closed mid-response: {}", String::from_utf8_lossy(&response));
        response.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&response);
        let Some((head, body)) = text.split_once("\r\n\r\n") else { continue };
        let length: usize = head
            .lines()
            .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
            .expect("a content-length");
        if body.len() >= length {
            let status = head.split(' ').nth(1).unwrap().parse().unwrap();
            return (status, head.to_owned(), body.to_owned());
        }
    }
}

/// A client with no connection pool (the server closes idle connections).
fn fresh_client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).pool_max_idle_per_host(0).build().unwrap()
}

/// The gateway's `/metrics` text.
fn metrics(gateway: &Gateway) -> String {
    // While the gateway is full a connection may be refused: try again.
    let deadline = Instant::now() + MARGIN;
    loop {
        match fresh_client().get(format!("http://{}/metrics", gateway.admin)).bearer_auth(ADMIN_TOKEN).send() {
            Ok(response) => {
                assert_eq!(response.status(), 200);
                return response.text().unwrap();
            }
            Err(e) => assert!(Instant::now() < deadline, "{e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The value of the sample `series` (name and labels) in `metrics`.
fn sample(metrics: &str, series: &str) -> i64 {
    crate::harness::metric(metrics, series).unwrap_or_else(|| panic!("no {series}")) as i64
}

fn closed_total(metrics: &str, reason: &str) -> i64 {
    sample(metrics, &format!("facegate_connections_closed_total{{reason=\"{reason}\"}}"))
}

/// Waits until only the metrics request's own connection is open.
fn settle(gateway: &Gateway) {
    let deadline = Instant::now() + MARGIN;
    while sample(&metrics(gateway), "facegate_connections_open") != 1 {
        assert!(Instant::now() < deadline, "connections stay open: {}", metrics(gateway));
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn silent_connections_are_closed_after_the_head_timeout_and_slots_come_back() {
    let gateway = quick();
    let started = Instant::now();
    let mut silent: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(gateway.addr).unwrap()).collect();
    // A head that never completes is no better than none.
    let mut slow = TcpStream::connect(gateway.addr).unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: loc").unwrap();
    silent.push(slow);
    for stream in &mut silent {
        expect_tcp_closed(stream, HEAD_TIMEOUT + CLOSE_SLACK);
    }
    assert!(started.elapsed() >= HEAD_TIMEOUT, "closed before the head timeout: {:?}", started.elapsed());
    let response = fresh_client().get(gateway.url("/healthz")).send().unwrap();
    assert_eq!(response.status(), 200);
}

#[test]
fn silent_tls_connections_are_closed_during_and_after_the_handshake() {
    let (addr, cert) = tls();
    let before = tls_metrics();
    // Nothing sent.
    let started = Instant::now();
    let mut silent = TcpStream::connect(addr).unwrap();
    expect_tcp_closed(&mut silent, HEAD_TIMEOUT + CLOSE_SLACK);
    assert!(started.elapsed() >= HEAD_TIMEOUT, "{:?}", started.elapsed());
    // Half a ClientHello.
    let mut client = tls_client(cert);
    let mut hello = Vec::new();
    client.write_tls(&mut hello).unwrap();
    let mut half = TcpStream::connect(addr).unwrap();
    half.write_all(&hello[..hello.len() / 2]).unwrap();
    expect_tcp_closed(&mut half, HEAD_TIMEOUT + CLOSE_SLACK);
    // A whole handshake, then nothing.
    let started = Instant::now();
    let mut tcp = TcpStream::connect(addr).unwrap();
    let mut client = tls_client(cert);
    while client.is_handshaking() {
        client.complete_io(&mut tcp).unwrap();
    }
    let mut tls = StreamOwned::new(client, tcp);
    let socket = tls.sock.try_clone().unwrap();
    expect_closed(&mut tls, |t| socket.set_read_timeout(Some(t)).unwrap(), HEAD_TIMEOUT + CLOSE_SLACK);
    assert!(started.elapsed() >= HEAD_TIMEOUT, "{:?}", started.elapsed());
    // Not TLS at all: the handshake fails at once.
    let mut clear = TcpStream::connect(addr).unwrap();
    clear.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    expect_tcp_closed(&mut clear, MARGIN);

    // The failed handshake's socket closes as its TLS acceptor is dropped,
    // just before the gateway counts it: wait a moment for the count.
    let deadline = Instant::now() + MARGIN;
    let after = loop {
        let after = tls_metrics();
        if closed_total(&after, "tls_handshake") > closed_total(&before, "tls_handshake") || Instant::now() > deadline {
            break after;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(closed_total(&after, "head_timeout") >= closed_total(&before, "head_timeout") + 3, "{after}");
    assert!(closed_total(&after, "tls_handshake") > closed_total(&before, "tls_handshake"), "{after}");
    // Connections closed by a deadline do not stay counted as open.
    assert!(sample(&after, "facegate_connections_open") < 4, "{after}");
}

fn tls_client(cert: &CertificateDer<'static>) -> ClientConnection {
    crate::harness::tls_client(cert, "localhost")
}

/// `/metrics` of the TLS gateway.
fn tls_metrics() -> String {
    let (addr, cert) = tls();
    let mut tls = StreamOwned::new(tls_client(cert), TcpStream::connect(addr).unwrap());
    let (status, body) = exchange(&mut tls, "GET", "/metrics", Some(ADMIN_TOKEN));
    assert_eq!(status, 200, "{body}");
    body
}

#[test]
fn idle_http1_keep_alive_is_closed_after_the_idle_timeout_but_not_while_used() {
    let gateway = quick();
    let mut stream = TcpStream::connect(gateway.addr).unwrap();
    stream.set_read_timeout(Some(MARGIN)).unwrap();
    // Requests closer together than the idle timeout keep the connection,
    // longer than the idle timeout in all.
    let used_since = Instant::now();
    while used_since.elapsed() < IDLE_TIMEOUT + IDLE_TIMEOUT / 2 {
        assert_eq!(exchange(&mut stream, "GET", "/healthz", None).0, 200);
        std::thread::sleep(IDLE_TIMEOUT / 4);
    }
    assert_eq!(exchange(&mut stream, "GET", "/healthz", None).0, 200);
    let idle = expect_tcp_closed(&mut stream, IDLE_TIMEOUT + CLOSE_SLACK);
    assert!(idle >= IDLE_TIMEOUT / 2, "closed after {idle:?} idle");
}

#[test]
fn a_request_longer_than_the_idle_timeout_is_not_cut() {
    let gateway = quick();
    let mut stream = TcpStream::connect(gateway.addr).unwrap();
    stream.set_read_timeout(Some(MARGIN + MARGIN)).unwrap();
    let started = Instant::now();
    // The hostile handler loops until the request deadline (5 s).
    let (status, body) = exchange(&mut stream, "GET", "/v1/evil/attack?attack=loop", Some(&gateway.key("evil")));
    assert!(status == 504 && body.contains("handler_timeout"), "{status}: {body}");
    assert!(started.elapsed() > IDLE_TIMEOUT * 2, "{:?}", started.elapsed());
    // Not even shut down gracefully: the connection is still good for more.
    assert_eq!(exchange(&mut stream, "GET", "/healthz", None).0, 200);
}

/// HTTP/2 frame types used below.
const DATA: u8 = 0;
const HEADERS: u8 = 1;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const WINDOW_UPDATE: u8 = 8;

fn write_frame(stream: &mut TcpStream, kind: u8, flags: u8, stream_id: u32, payload: &[u8]) {
    try_write_frame(stream, kind, flags, stream_id, payload).unwrap();
}

fn try_write_frame(stream: &mut TcpStream, kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> std::io::Result<()> {
    let mut frame = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    frame.extend_from_slice(&[kind, flags]);
    frame.extend_from_slice(&stream_id.to_be_bytes());
    frame.extend_from_slice(payload);
    stream.write_all(&frame)
}

/// h2c with prior knowledge: the preface, a SETTINGS frame with `settings`
/// (its payload), one GET /healthz on stream 1 (HPACK: GET, http, literal
/// :authority and :path).
fn h2_get_healthz(stream: &mut TcpStream, settings: &[u8]) {
    stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
    write_frame(stream, SETTINGS, 0, 0, settings);
    let mut block = vec![0x82, 0x86, 0x01, 9];
    block.extend_from_slice(b"localhost");
    block.extend_from_slice(&[0x04, 8]);
    block.extend_from_slice(b"/healthz");
    write_frame(stream, HEADERS, 0x5, 1, &block); // END_STREAM | END_HEADERS
}

/// An HTTP/2 frame: type, flags, stream, payload.
type Frame = (u8, u8, u32, Vec<u8>);

/// The next frame, or `None` once the server closed.
fn read_frame(stream: &mut TcpStream) -> Option<Frame> {
    let mut head = [0u8; 9];
    match stream.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => panic!("no frame and no close in time"),
        Err(_) => return None,
    }
    let length = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; length];
    stream.read_exact(&mut payload).ok()?;
    Some((head[3], head[4], u32::from_be_bytes(head[5..9].try_into().unwrap()) & 0x7fff_ffff, payload))
}

#[test]
fn idle_http2_connection_gets_goaway_and_is_closed() {
    let gateway = quick();
    let mut stream = TcpStream::connect(gateway.addr).unwrap();
    stream.set_read_timeout(Some(IDLE_TIMEOUT + CLOSE_SLACK)).unwrap();
    h2_get_healthz(&mut stream, &[]);
    let (mut answered, mut goaway_after) = (false, None);
    let mut answered_at = Instant::now();
    while let Some((kind, flags, id, payload)) = read_frame(&mut stream) {
        match kind {
            SETTINGS if flags & 1 == 0 => write_frame(&mut stream, SETTINGS, 1, 0, &[]),
            PING if flags & 1 == 0 => write_frame(&mut stream, PING, 1, 0, &payload),
            HEADERS | DATA if id == 1 && flags & 1 == 1 => {
                answered = true;
                answered_at = Instant::now();
            }
            GOAWAY => {
                assert!(answered, "GOAWAY before the answer");
                goaway_after.get_or_insert(answered_at.elapsed());
            }
            _ => {}
        }
    }
    let idle = goaway_after.expect("the server closed without GOAWAY");
    assert!(idle >= IDLE_TIMEOUT / 2 && idle <= IDLE_TIMEOUT + CLOSE_SLACK, "GOAWAY after {idle:?} idle");
}

#[test]
fn closures_by_a_limit_are_counted() {
    // quick()'s timeouts on a gateway of its own: its connections are this test's alone.
    let gateway = &Gateway::start("conn-closures", |c| {
        c.request_head_timeout_ms = HEAD_TIMEOUT.as_millis() as u64;
        c.idle_timeout_ms = IDLE_TIMEOUT.as_millis() as u64;
    });
    let before = metrics(gateway);
    let mut silent = TcpStream::connect(gateway.addr).unwrap();
    let mut idle = TcpStream::connect(gateway.addr).unwrap();
    assert_eq!(exchange(&mut idle, "GET", "/healthz", None).0, 200);
    let during = metrics(gateway);
    assert!(sample(&during, "facegate_connections_open") >= 3, "both counted open, with the scrape's own: {during}");
    expect_tcp_closed(&mut silent, HEAD_TIMEOUT + CLOSE_SLACK);
    expect_tcp_closed(&mut idle, IDLE_TIMEOUT + CLOSE_SLACK);
    let after = metrics(gateway);
    for reason in ["head_timeout", "idle"] {
        assert_eq!(closed_total(&after, reason), closed_total(&before, reason) + 1, "{reason}: {after}");
    }
    // Closed, they are no longer counted: only the scrape's own stays open.
    settle(gateway);
}

#[test]
fn admin_api_answers_on_a_full_shared_listener_and_tenants_get_503() {
    let (gateway, _one_at_a_time) = small();
    let before = metrics(gateway);
    // Every main slot held by a connection with a request in flight (none
    // idle, so none is evicted), each from its own address.
    let mut fillers: Vec<TcpStream> = (1..=SMALL_SLOTS).map(|i| busy_from(&format!("127.0.1.{i}"), gateway.addr)).collect();
    // A filler whose head the gateway has not read yet (a loaded machine)
    // is idle, and a newcomer (a scrape, the tenant's request) may take its
    // slot. A tenant served means a main slot was still free or idle:
    // another filler takes it, until a tenant's request is refused.
    let deadline = Instant::now() + MARGIN;
    let response = loop {
        std::thread::sleep(Duration::from_millis(200));
        let response = fresh_client().get(gateway.url("/v1/models")).send().unwrap();
        if response.status() == 503 || Instant::now() >= deadline {
            break response;
        }
        fillers.push(busy_from(&format!("127.0.1.{}", fillers.len() + 1), gateway.addr));
    };
    assert_eq!(response.status(), 503, "tenants wait for a main slot");
    assert_eq!(response.headers().get("retry-after").unwrap(), "1");
    let response = fresh_client().get(gateway.url("/healthz")).send().unwrap();
    assert_eq!(response.status(), 200);
    let response = fresh_client().get(gateway.url("/admin/v1/tenants")).bearer_auth(ADMIN_TOKEN).send().unwrap();
    assert_eq!(response.status(), 200, "the admin API answers");
    let response = fresh_client().post(gateway.url("/v1/demo/detect")).bearer_auth(gateway.key("demo")).body(Vec::new()).send().unwrap();
    assert_eq!(response.status(), 503);
    let body: serde_json::Value = response.json().unwrap();
    assert_eq!(body["error"]["code"], "overloaded", "{body}");

    // The reserve full too: the next connection is closed at once.
    let reserve: Vec<TcpStream> =
        (1..=facegate::http::ADMIN_RESERVE_CONNECTIONS).map(|i| connect_from(&format!("127.0.2.{i}"), gateway.addr)).collect();
    let mut over = connect_from("127.0.3.1", gateway.addr);
    expect_tcp_closed(&mut over, MARGIN);
    // Reserve connections have a short head timeout: the reserve frees up.
    drop(reserve);
    let after = metrics(gateway);
    assert!(closed_total(&after, "over_capacity") > closed_total(&before, "over_capacity"), "{after}");

    // The fillers leave: tenants are served again.
    drop(fillers);
    settle(gateway);
    let response = fresh_client().get(gateway.url("/v1/models")).send().unwrap();
    assert_eq!(response.status(), 200);
}

#[test]
fn connections_over_the_per_address_cap_are_closed() {
    let (gateway, _one_at_a_time) = small();
    let before = metrics(gateway);
    let mut held: Vec<TcpStream> = (0..SMALL_PER_IP).map(|_| connect_from("127.0.4.1", gateway.addr)).collect();
    let mut over = connect_from("127.0.4.1", gateway.addr);
    let took = expect_tcp_closed(&mut over, MARGIN);
    assert!(took < MARGIN, "{took:?}");
    assert!(held.iter_mut().all(still_open), "the first connections are kept");
    // Another address is served.
    let mut other = connect_from("127.0.4.2", gateway.addr);
    assert_eq!(exchange(&mut other, "GET", "/healthz", None).0, 200);
    // One leaves: the address may connect again.
    held.pop();
    let deadline = Instant::now() + MARGIN;
    loop {
        let mut again = connect_from("127.0.4.1", gateway.addr);
        if still_open(&mut again) {
            assert_eq!(exchange(&mut again, "GET", "/healthz", None).0, 200);
            break;
        }
        assert!(Instant::now() < deadline, "the address's share did not come back");
    }
    let after = metrics(gateway);
    assert!(closed_total(&after, "per_ip_cap") > closed_total(&before, "per_ip_cap"), "{after}");
}

#[test]
fn shutdown_finishes_requests_in_flight_and_closes_idle_connections() {
    let data_dir = fresh_dir("conn-drain");
    let mut config = config(data_dir.clone(), Some(seed_dir()));
    config.limits.timeout_ms = 3_000;
    config.idle_timeout_ms = 60_000;
    let (signal, signalled) = tokio::sync::oneshot::channel::<()>();
    let (addr, returned) = start_until(config, async move {
        let _ = signalled.await;
    });
    let gateway = Gateway { addr, admin: addr, data_dir };
    let mut idle = TcpStream::connect(addr).unwrap();
    assert_eq!(exchange(&mut idle, "GET", "/healthz", None).0, 200);
    let key = gateway.key("evil");
    let url = gateway.url("/v1/evil/attack?attack=loop");
    let slow = std::thread::spawn(move || {
        let response = fresh_client().get(url).bearer_auth(key).send().unwrap();
        (response.status().as_u16(), response.text().unwrap())
    });
    let deadline = Instant::now() + MARGIN;
    while sample(&metrics(&gateway), "facegate_instances_in_use") < 1 {
        assert!(Instant::now() < deadline, "the slow request never started");
        std::thread::sleep(Duration::from_millis(50));
    }

    let signalled_at = Instant::now();
    signal.send(()).unwrap();
    // At once, not after its 60 s idle timeout.
    expect_tcp_closed(&mut idle, MARGIN);
    let (status, body) = slow.join().unwrap();
    assert_eq!(status, 504, "the request in flight is answered: {body}");
    returned.recv_timeout(facegate::http::SHUTDOWN_GRACE + MARGIN).expect("serve returns once drained");
    assert!(signalled_at.elapsed() < facegate::http::SHUTDOWN_GRACE, "drained before the grace period ended");
    assert!(TcpStream::connect(addr).is_err(), "no longer listening");
}

#[test]
fn one_address_keeping_more_connections_than_its_cap_busy_leaves_room_for_a_newcomer() {
    let (gateway, _one_at_a_time) = small();
    let before = metrics(gateway);
    // More connections than the listener has slots, all from one address,
    // each with a request in flight.
    let mut hoard: Vec<TcpStream> = (0..SMALL_SLOTS + 2).map(|_| busy_from("127.0.5.1", gateway.addr)).collect();
    let kept = hoard.iter_mut().map(still_open).filter(|&open| open).count();
    assert_eq!(kept, SMALL_PER_IP, "the address keeps its cap's worth");
    // A newcomer from another address gets a main slot: a tenant is served.
    let started = Instant::now();
    let mut newcomer = connect_from("127.0.0.2", gateway.addr);
    assert_eq!(exchange(&mut newcomer, "GET", "/v1/models", None).0, 200);
    assert!(started.elapsed() < MARGIN, "{:?}", started.elapsed());
    let after = metrics(gateway);
    let refused = closed_total(&after, "per_ip_cap") - closed_total(&before, "per_ip_cap");
    assert!(refused >= (SMALL_SLOTS + 2 - SMALL_PER_IP) as i64, "{refused} refused: {after}");
}

#[test]
fn a_full_listener_of_idle_keep_alives_closes_its_longest_idle_to_serve_a_newcomer() {
    let (gateway, _one_at_a_time) = small();
    let before = metrics(gateway);
    // Every slot taken by a keep-alive connection that made one request, in
    // turn: the first is idle the longest.
    let mut idle: Vec<TcpStream> = (1..=SMALL_SLOTS)
        .map(|i| {
            let mut stream = connect_from(&format!("127.0.6.{i}"), gateway.addr);
            assert_eq!(exchange(&mut stream, "GET", "/healthz", None).0, 200);
            std::thread::sleep(Duration::from_millis(20));
            stream
        })
        .collect();
    let started = Instant::now();
    let mut newcomer = connect_from("127.0.0.2", gateway.addr);
    assert_eq!(exchange(&mut newcomer, "GET", "/v1/models", None).0, 200, "a tenant is served: a main slot");
    assert!(started.elapsed() < MARGIN, "{:?}", started.elapsed());
    expect_tcp_closed(&mut idle[0], MARGIN);
    assert!(idle[1..].iter_mut().all(still_open), "only the longest idle is closed");
    let after = metrics(gateway);
    assert!(closed_total(&after, "evicted") > closed_total(&before, "evicted"), "{after}");
}

#[test]
fn http2_pings_and_window_updates_do_not_keep_an_idle_connection_open() {
    let gateway = quick();
    let mut stream = TcpStream::connect(gateway.addr).unwrap();
    h2_get_healthz(&mut stream, &[]);
    stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let (mut frames, mut answered_at, mut goaway_after) = (Frames::default(), None, None);
    let deadline = Instant::now() + IDLE_TIMEOUT + CLOSE_SLACK;
    // Traffic that is no request, every 200 ms, until the server closes.
    while let Some(received) = frames.next(&mut stream) {
        for (kind, flags, id, payload) in received {
            match kind {
                SETTINGS if flags & 1 == 0 => write_frame(&mut stream, SETTINGS, 1, 0, &[]),
                // The server's own (the graceful shutdown's) is answered, as a client does.
                PING if flags & 1 == 0 => write_frame(&mut stream, PING, 1, 0, &payload),
                HEADERS | DATA if id == 1 && flags & 1 == 1 => answered_at = Some(Instant::now()),
                GOAWAY => goaway_after = goaway_after.or(answered_at.map(|at| at.elapsed())),
                _ => {}
            }
        }
        assert!(Instant::now() < deadline, "still open after {:?} of PINGs", IDLE_TIMEOUT + CLOSE_SLACK);
        let sent = try_write_frame(&mut stream, PING, 0, 0, &[7; 8])
            .and_then(|()| try_write_frame(&mut stream, WINDOW_UPDATE, 0, 0, &1u32.to_be_bytes()));
        if sent.is_err() {
            break; // closed
        }
    }
    assert!(answered_at.is_some(), "the request was answered");
    let idle = goaway_after.expect("GOAWAY before the close");
    assert!(idle >= IDLE_TIMEOUT / 2, "GOAWAY after {idle:?} idle");
}

/// HTTP/2 frames read as they come, without blocking past the read timeout.
#[derive(Default)]
struct Frames {
    buf: Vec<u8>,
}

impl Frames {
    /// The frames complete so far; `None` once the server closed.
    fn next(&mut self, stream: &mut TcpStream) -> Option<Vec<Frame>> {
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk) {
            Ok(0) => return None,
            Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return None,
        }
        let mut frames = Vec::new();
        while self.buf.len() >= 9 {
            let length = u32::from_be_bytes([0, self.buf[0], self.buf[1], self.buf[2]]) as usize;
            if self.buf.len() < 9 + length {
                break;
            }
            let frame: Vec<u8> = self.buf.drain(..9 + length).collect();
            let id = u32::from_be_bytes(frame[5..9].try_into().unwrap()) & 0x7fff_ffff;
            frames.push((frame[3], frame[4], id, frame[9..].to_vec()));
        }
        Some(frames)
    }
}

#[test]
fn an_old_busy_connection_is_closed_gracefully_its_request_answered() {
    let gateway = aged();
    let before = metrics(gateway);
    let started = Instant::now();
    let mut stream = TcpStream::connect(gateway.addr).unwrap();
    stream.set_read_timeout(Some(MARGIN)).unwrap();
    // Busy: a request every 100 ms, for a third of the age limit.
    while started.elapsed() < AGE / 3 {
        let (status, head, _) = exchange_with_head(&mut stream, "GET", "/healthz", None);
        assert_eq!(status, 200);
        assert!(!head.to_ascii_lowercase().contains("connection: close"), "closed early: {head}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // In flight across the age limit: answered, and told the connection closes.
    let (status, head, body) = exchange_with_head(&mut stream, "GET", "/v1/evil/attack?attack=nap&ms=3000", Some(&gateway.key("evil")));
    assert_eq!(status, 200, "{body}");
    assert!(head.to_ascii_lowercase().contains("connection: close"), "{head}");
    expect_tcp_closed(&mut stream, MARGIN);
    assert!(started.elapsed() >= AGE.mul_f64(0.9), "closed after {:?}", started.elapsed());
    let after = metrics(gateway);
    assert!(closed_total(&after, "max_age") > closed_total(&before, "max_age"), "{after}");
}

#[test]
fn request_heads_are_bounded() {
    let gateway = quick();
    let head_with = |filler: usize| format!("GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Filler: {}\r\n\r\n", "a".repeat(filler));
    // Within the bound: served.
    let mut stream = TcpStream::connect(gateway.addr).unwrap();
    stream.set_read_timeout(Some(MARGIN)).unwrap();
    stream.write_all(head_with(facegate::http::MAX_HEAD_BYTES / 2).as_bytes()).unwrap();
    let mut response = [0u8; 12];
    stream.read_exact(&mut response).unwrap();
    assert_eq!(&response, b"HTTP/1.1 200");
    // Past it: 431, or the connection cut before the answer is read.
    let mut stream = TcpStream::connect(gateway.addr).unwrap();
    stream.set_read_timeout(Some(MARGIN)).unwrap();
    let _ = stream.write_all(head_with(facegate::http::MAX_HEAD_BYTES * 2).as_bytes());
    let mut response = [0u8; 12];
    match stream.read(&mut response) {
        Ok(n) if n > 0 => assert!(response.starts_with(b"HTTP/1.1 431"), "{}", String::from_utf8_lossy(&response[..n])),
        Ok(_) => {}
        Err(e) => assert!(!matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut), "no answer: {e}"),
    }
}

#[test]
fn the_open_file_limit_is_raised_to_fit_the_connection_caps() {
    let hard = open_files_limits(std::process::id()).1;
    let needed = facegate::http::open_files::descriptors_needed(
        facegate::config::DEFAULT_MAX_CONNECTIONS,
        facegate::sandbox::outgoing::DEFAULT_MAX_CONNECTIONS,
        facegate::http::open_files::Listeners::Shared,
    );
    // Started with the common default soft limit, far below what is needed.
    let server = crate::process::Server::start_after("ulimit -Sn 1024", &fresh_dir("conn-nofile"), &[]);
    let (soft, _) = open_files_limits(server.pid());
    assert!(soft >= needed.min(hard), "soft limit {soft}, {needed} needed (hard {hard})");
    drop(server);
    // A hard limit below what is needed: raised to it, the caps lowered to fit.
    let low = 2048.min(hard);
    let server = crate::process::Server::start_after(&format!("ulimit -Sn 1024 && ulimit -Hn {low}"), &fresh_dir("conn-nofile-low"), &[]);
    assert_eq!(open_files_limits(server.pid()), (low, low));
    let response = fresh_client().get(format!("http://{}/healthz", server.addr)).send().unwrap();
    assert_eq!(response.status(), 200, "serves with the lowered cap");
}

/// The soft and hard open-file limits of process `pid` (unlimited: `u64::MAX`).
fn open_files_limits(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let value = |v: &str| if v == "unlimited" { u64::MAX } else { v.parse().unwrap() };
    let fields: Vec<&str> = line.split_whitespace().collect();
    (value(fields[3]), value(fields[4]))
}

/// Requests pipelined by the client that reads no answer: far more answer
/// (each a 19 KB script) than the socket buffers between them hold.
const PIPELINED: usize = 1000;

/// SETTINGS_INITIAL_WINDOW_SIZE = 0: the server may send no DATA on any
/// stream until a WINDOW_UPDATE opens it.
const NO_WINDOW: [u8; 6] = [0, 4, 0, 0, 0, 0];

/// A gateway whose tenants' listener has one slot, with quick()'s
/// timeouts: a client that stalls holds the only slot. `/metrics` is on an
/// admin listener of its own, so scrapes never evict that client.
fn one_slot(name: &str) -> Gateway {
    let data_dir = fresh_dir(name);
    let mut config = config(data_dir.clone(), Some(seed_dir()));
    config.request_head_timeout_ms = HEAD_TIMEOUT.as_millis() as u64;
    config.idle_timeout_ms = IDLE_TIMEOUT.as_millis() as u64;
    config.limits.timeout_ms = 5_000;
    config.max_connections = 1;
    config.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    let (addr, admin) = start_split(config);
    Gateway { addr, admin, data_dir }
}

/// Waits until `gateway` drops a stalled connection (counted since
/// `before`), within the idle timeout and the watchdog's lateness; then a
/// tenant is served: the main slot came back.
fn expect_stalled_and_slot_back(gateway: &Gateway, before: &str) {
    let deadline = Instant::now() + IDLE_TIMEOUT * 2 + MARGIN;
    loop {
        let now = metrics(gateway);
        if closed_total(&now, "stalled") > closed_total(before, "stalled") {
            break;
        }
        assert!(Instant::now() < deadline, "the stalled connection is still open: {now}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let response = fresh_client().get(gateway.url("/v1/models")).send().unwrap();
    assert_eq!(response.status(), 200, "a tenant is served: the main slot came back");
}

#[test]
fn an_http1_client_that_reads_no_answer_is_dropped_and_its_slot_comes_back() {
    let gateway = one_slot("conn-stall-h1");
    let before = metrics(&gateway);
    // A small receive buffer, never read: the answers pile up at the gateway.
    let mut stream = connect_with(gateway.addr, |socket| socket.set_recv_buffer_size(4096).unwrap());
    stream.set_write_timeout(Some(MARGIN)).unwrap();
    let request = "GET /console/console.js HTTP/1.1\r\nHost: localhost\r\n\r\n";
    let _ = stream.write_all(request.repeat(PIPELINED).as_bytes());
    expect_stalled_and_slot_back(&gateway, &before);
    // What the client sees: the answers cut short, then the close.
    let received = read_until_closed(&mut stream);
    let asked = PIPELINED * console_script_len(&gateway);
    assert!(received < asked / 2, "{received} of {asked} bytes sent to a client that read none");
}

/// The length of the console's script.
fn console_script_len(gateway: &Gateway) -> usize {
    fresh_client().get(gateway.url("/console/console.js")).send().unwrap().bytes().unwrap().len()
}

/// Reads all `stream` holds until the server's close; returns how much.
/// Panics if it stays open past [`MARGIN`].
fn read_until_closed(stream: &mut TcpStream) -> usize {
    stream.set_read_timeout(Some(MARGIN)).unwrap();
    let (mut received, mut buf) = (0, [0u8; 65536]);
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return received,
            Ok(n) => received += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => panic!("still open: {e}"),
            // Reset: closed.
            Err(_) => return received,
        }
    }
}

/// Sends a GET /healthz over h2c with no window for the answer's body;
/// returns once the answer's head has come.
fn h2_without_window(addr: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    h2_get_healthz(&mut stream, &NO_WINDOW);
    stream.set_read_timeout(Some(MARGIN)).unwrap();
    while let Some((kind, flags, id, _)) = read_frame(&mut stream) {
        match kind {
            SETTINGS if flags & 1 == 0 => write_frame(&mut stream, SETTINGS, 1, 0, &[]),
            HEADERS if id == 1 => return stream,
            _ => {}
        }
    }
    panic!("closed before the answer's head");
}

#[test]
fn an_http2_client_that_opens_no_window_is_dropped_and_its_slot_comes_back() {
    let gateway = one_slot("conn-stall-h2");
    let before = metrics(&gateway);
    let mut stream = h2_without_window(gateway.addr);
    // Read on (the socket is not full), until the close: no DATA can come.
    stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let (mut frames, mut data) = (Frames::default(), false);
    let deadline = Instant::now() + IDLE_TIMEOUT * 2 + MARGIN;
    while let Some(received) = frames.next(&mut stream) {
        data |= received.iter().any(|&(kind, _, id, _)| kind == DATA && id == 1);
        assert!(Instant::now() < deadline, "still open after {:?}", IDLE_TIMEOUT * 2 + MARGIN);
    }
    assert!(!data, "no window, no DATA");
    expect_stalled_and_slot_back(&gateway, &before);
}

#[test]
fn the_drain_does_not_wait_for_a_client_that_takes_no_answer() {
    let mut config = config(fresh_dir("conn-drain-stalled"), Some(seed_dir()));
    config.idle_timeout_ms = IDLE_TIMEOUT.as_millis() as u64;
    // Its closing limit (the request deadline and the idle timeout) is
    // longer than the grace period: only its stall ends it sooner.
    config.limits.timeout_ms = facegate::http::SHUTDOWN_GRACE.as_millis() as u64;
    let (signal, signalled) = tokio::sync::oneshot::channel::<()>();
    let (addr, returned) = start_until(config, async move {
        let _ = signalled.await;
    });
    let _stalled = h2_without_window(addr);
    let signalled_at = Instant::now();
    signal.send(()).unwrap();
    returned.recv_timeout(facegate::http::SHUTDOWN_GRACE + MARGIN).expect("serve returns once drained");
    // Its request in flight is not waited for to the end of the grace period.
    assert!(signalled_at.elapsed() < facegate::http::SHUTDOWN_GRACE, "drained after {:?}", signalled_at.elapsed());
}

/// A client that is refused (429 here) request after request on one
/// connection, ignoring `Retry-After`, has the connection shut down after
/// `REFUSALS_BEFORE_CLOSE` refusals in a row: the last refusal says
/// `Connection: close`, the socket closes, and the closure is counted. An
/// answer that is not a refusal starts the count again.
#[test]
fn a_connection_refused_again_and_again_is_closed() {
    let gateway = Gateway::start("conn-refusing", |c| {
        c.limits.rps = 0.01;
        c.limits.burst = 1;
    });
    let key = gateway.key("demo");
    let before = metrics(&gateway);
    let mut stream = TcpStream::connect(gateway.addr).unwrap();
    let refusals = facegate::http::REFUSALS_BEFORE_CLOSE as usize;
    // The burst's one request reaches the handler (which refuses an empty body).
    assert_eq!(exchange(&mut stream, "POST", "/v1/demo/detect", Some(&key)).0, 400);
    // Refusals in a row, then one answer that is not: the count starts again.
    for _ in 0..refusals - 1 {
        assert_eq!(exchange(&mut stream, "POST", "/v1/demo/detect", Some(&key)).0, 429);
    }
    assert_eq!(exchange(&mut stream, "GET", "/healthz", None).0, 200);
    for n in 1..=refusals {
        let (status, head, _) = exchange_with_head(&mut stream, "POST", "/v1/demo/detect", Some(&key));
        assert_eq!(status, 429);
        let closing = head.to_ascii_lowercase().contains("connection: close");
        assert_eq!(closing, n == refusals, "refusal {n} of {refusals}: {head}");
    }
    expect_tcp_closed(&mut stream, MARGIN);
    assert_eq!(closed_total(&metrics(&gateway), "refusing") - closed_total(&before, "refusing"), 1);
}

/// A request refused before its body is read (a wrong key here) gets its
/// answer even while the client is still sending a large body: the
/// connection is half-closed and what follows is read and dropped (up to
/// 1 MiB, for 2 s) before it closes, so no reset reaches the client ahead
/// of the answer.
#[test]
fn a_refusal_before_the_body_reaches_a_client_still_sending_it() {
    let gateway = quick();
    let body = vec![b'x'; 768 << 10];
    let mut stream = TcpStream::connect(gateway.addr).unwrap();
    write!(
        stream,
        "POST /v1/demo/detect HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer wrong\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    // The answer comes at once; the client keeps sending meanwhile.
    std::thread::sleep(Duration::from_millis(200));
    for chunk in body.chunks(64 << 10) {
        stream.write_all(chunk).unwrap_or_else(|e| panic!("the gateway reset the connection while the body was sent: {e}"));
    }
    stream.set_read_timeout(Some(MARGIN)).unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).unwrap_or_else(|e| panic!("the answer was lost: {e}"));
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("connection: close"), "{answer}");
}
