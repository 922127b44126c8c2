//! Outgoing HTTP: denied without the tenant's grant; with it, public
//! addresses only unless the operator allows private ones
//! (`--outgoing-allow-private`), listed ports only (`--outgoing-ports`),
//! never a denied range (`--outgoing-deny`), and at most so many
//! connections of one tenant open at once. The hostile handler's `fetch`
//! (and `fetch-many`) makes the requests through
//! `wasi:http/outgoing-handler` and answers their outcome.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{self, ADMIN_TOKEN, anonymous, client_as, client_with_key, guest};
use crate::warm::{call, hostile_tenant};

/// `fetch` of `target` by `tenant`'s hostile handler: its outcome.
fn fetch(key: &str, tenant: &str, target: &str) -> String {
    let (status, body) = call(key, tenant, &format!("fetch&url={target}"));
    assert_eq!(status, 200, "{body}");
    body["outcome"].as_str().unwrap().to_owned()
}

#[test]
fn a_handler_without_the_grant_sends_nothing() {
    let port = harness::gateway().addr.port();
    let response =
        client_as("evil").get(harness::url(&format!("/v1/evil/attack?attack=fetch&url=http://127.0.0.1:{port}/healthz"))).send().unwrap();
    let body: Value = response.json().unwrap();
    assert!(body["outcome"].as_str().unwrap().contains("HttpRequestDenied"), "{body}");
}

/// The gateway's host (by address and by name, IPv4 and IPv6, IPv4 inside
/// IPv6), the cloud metadata service and a private network are refused
/// before any connection, on an allowed port: nothing listens at the last
/// two here, so only the check can answer at once. The gateway's own port
/// is refused before that, as a port not listed.
#[test]
fn a_granted_handler_reaches_no_loopback_private_or_link_local_address() {
    let key = hostile_tenant("egress", json!({ "outgoing_http": true }));
    for target in [
        "http://127.0.0.1/healthz",
        "http://localhost/healthz",
        "http://[::1]/healthz",
        "http://[::ffff:127.0.0.1]/healthz",
        "https://127.0.0.1/healthz",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/",
    ] {
        let outcome = fetch(&key, "egress", target);
        assert!(outcome.contains("DestinationIpProhibited"), "{target}: {outcome}");
    }
    let own_port = format!("http://127.0.0.1:{}/healthz", harness::gateway().addr.port());
    let outcome = fetch(&key, "egress", &own_port);
    assert!(outcome.contains("HttpRequestDenied"), "{own_port}: {outcome}");
}

/// The egress gateway's tenants, one per test, so that no test's
/// connections count against another's.
const EGRESS_TENANTS: [&str; 3] = ["ports", "ranges", "capped"];
/// The egress gateway's `--outgoing-max-connections-per-tenant`.
const TENANT_CONNECTIONS: usize = 4;
/// How long the slow server holds each response body: long enough that
/// every one of a `fetch-many`'s requests is sent while the first ones
/// are still open (sending one takes about a millisecond).
const SLOW_BODY: Duration = Duration::from_secs(1);

/// A gateway with private addresses allowed, only the ports of its three
/// test servers listed, 127.0.0.2 denied and a low connection cap.
struct EgressGateway {
    addr: SocketAddr,
    data: PathBuf,
    /// Answers at once, on 127.0.0.1.
    open: TestServer,
    /// Answers at once, on 127.0.0.2 (a denied range).
    denied: TestServer,
    /// Holds each response body for [`SLOW_BODY`], on 127.0.0.1.
    slow: TestServer,
}

fn egress_gateway() -> &'static EgressGateway {
    static GATEWAY: OnceLock<EgressGateway> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        let (open, denied, slow) = (
            TestServer::start("127.0.0.1", Duration::ZERO),
            TestServer::start("127.0.0.2", Duration::ZERO),
            TestServer::start("127.0.0.1", SLOW_BODY),
        );
        let seed = harness::fresh_dir("egress-rules-seed");
        for tenant in EGRESS_TENANTS {
            harness::install(&seed, tenant, "attack", &guest("hostile"));
        }
        let data = harness::fresh_dir("egress-rules-data");
        let mut config = harness::config(data.clone(), Some(seed));
        config.outgoing_allow_private = true;
        config.outgoing_ports = vec![open.addr.port(), denied.addr.port(), slow.addr.port()];
        config.outgoing_deny = vec![facegate::sandbox::outgoing::parse_cidr("127.0.0.2/32").unwrap()];
        config.outgoing_max_connections_per_tenant = TENANT_CONNECTIONS as u32;
        let addr = harness::start(config);
        for tenant in EGRESS_TENANTS {
            let grant = anonymous()
                .request(Method::PATCH, format!("http://{addr}/admin/v1/tenants/{tenant}"))
                .bearer_auth(ADMIN_TOKEN)
                .json(&json!({ "outgoing_http": true }))
                .send()
                .unwrap();
            assert_eq!(grant.status(), 200);
        }
        EgressGateway { addr, data, open, denied, slow }
    })
}

impl EgressGateway {
    /// `attack` (with its parameters) by `tenant`'s hostile handler: its JSON answer.
    fn attack(&self, tenant: &str, attack: &str) -> Value {
        let key = std::fs::read_to_string(self.data.join(format!("{tenant}.key"))).unwrap();
        let response = client_with_key(key.trim()).get(format!("http://{}/v1/{tenant}/attack?attack={attack}", self.addr)).send().unwrap();
        assert_eq!(response.status(), 200);
        response.json().unwrap()
    }

    fn fetch(&self, tenant: &str, target: &str) -> String {
        let body = self.attack(tenant, &format!("fetch&url={target}"));
        body["outcome"].as_str().unwrap().to_owned()
    }

    /// `tenant`'s hits of `limit`, waiting up to a few seconds for the first
    /// (a request's hits are counted once its guest has finished, just
    /// after its response).
    fn limit_hits(&self, tenant: &str, limit: &str) -> f64 {
        let series = format!("facegate_limit_hits_total{{tenant=\"{tenant}\",limit=\"{limit}\"}}");
        let metrics = || anonymous().get(format!("http://{}/metrics", self.addr)).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap();
        for _ in 0..50 {
            if let Some(hits) = harness::metric(&metrics(), &series) {
                return hits;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        0.0
    }
}

/// With private addresses allowed, a loopback server on a listed port is
/// reached; an unlisted port (the gateway's own, by address or by name)
/// is refused before any lookup or connection.
#[test]
fn only_listed_ports_are_reached() {
    let gateway = egress_gateway();
    let open = format!("http://127.0.0.1:{}/", gateway.open.addr.port());
    assert_eq!(gateway.fetch("ports", &open), "ok: 200");
    for unlisted in [format!("http://127.0.0.1:{}/healthz", gateway.addr.port()), format!("http://localhost:{}/", gateway.addr.port())] {
        let outcome = gateway.fetch("ports", &unlisted);
        assert!(outcome.contains("HttpRequestDenied"), "{unlisted}: {outcome}");
    }
    assert_eq!(gateway.open.accepted(), 1, "only the listed port was connected to");
}

/// A server in a denied range is refused, though private addresses are
/// allowed, its port is listed and it answers (the test reaches it
/// itself), by IPv4 and by IPv4-mapped IPv6, before any connection.
#[test]
fn a_denied_range_is_refused_even_with_private_addresses_allowed() {
    let gateway = egress_gateway();
    let port = gateway.denied.addr.port();
    let direct = anonymous().get(format!("http://127.0.0.2:{port}/")).send().unwrap();
    assert_eq!((direct.status().as_u16(), direct.text().unwrap()), (200, "ok".to_owned()), "the server answers");
    for target in [format!("http://127.0.0.2:{port}/"), format!("http://[::ffff:127.0.0.2]:{port}/")] {
        let outcome = gateway.fetch("ranges", &target);
        assert!(outcome.contains("DestinationIpProhibited"), "{target}: {outcome}");
    }
    assert_eq!(gateway.denied.accepted(), 1, "only the test's own request reached the server");
}

/// A handler that opens ever more connections to a slow server, keeping
/// each open (its body unread): at most the tenant's cap are open at the
/// server at any moment, since each holds its place until it closes, not
/// just until its response head; the others fail at once with
/// `connection-limit-reached` (no hang), counted as a limit hit.
#[test]
fn one_tenants_outgoing_connections_are_capped() {
    const REQUESTS: usize = 3 * TENANT_CONNECTIONS;
    let gateway = egress_gateway();
    let target = format!("http://127.0.0.1:{}/", gateway.slow.addr.port());
    let body = gateway.attack("capped", &format!("fetch-many&n={REQUESTS}&url={target}"));
    let outcomes: BTreeMap<String, usize> = serde_json::from_value(body["outcomes"].clone()).unwrap();
    let count = |outcome: &str| outcomes.iter().filter(|(key, _)| key.ends_with(outcome)).map(|(_, n)| n).sum::<usize>();
    let (ok, refused) = (count("ok: 200"), count("ConnectionLimitReached"));
    assert_eq!(ok + refused, REQUESTS, "each request either read its body or was refused: {outcomes:?}");
    assert!(refused > 0 && ok >= TENANT_CONNECTIONS, "{outcomes:?}");
    assert_eq!(gateway.slow.most_open(), TENANT_CONNECTIONS, "connections open at the server at once");
    assert!(gateway.limit_hits("capped", "outgoing_connections") >= 1.0, "the refusals are a limit hit");
}

/// A local HTTP server that answers `ok` to every request on a connection
/// of its own, holding the body's second byte for `hold`; it counts the
/// connections it accepted and the most open at once.
struct TestServer {
    addr: SocketAddr,
    counts: Arc<Mutex<Counts>>,
}

#[derive(Default)]
struct Counts {
    accepted: usize,
    open: usize,
    most_open: usize,
}

impl TestServer {
    fn start(ip: &str, hold: Duration) -> Self {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Mutex::new(Counts::default()));
        let shared = Arc::clone(&counts);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let counts = Arc::clone(&shared);
                std::thread::spawn(move || serve_one(stream.unwrap(), &counts, hold));
            }
        });
        Self { addr, counts }
    }

    fn accepted(&self) -> usize {
        self.counts.lock().unwrap().accepted
    }

    fn most_open(&self) -> usize {
        self.counts.lock().unwrap().most_open
    }
}

/// Reads one request head, answers with the head and `o`, waits `hold`,
/// sends `k` and closes; counted open until then.
fn serve_one(mut stream: TcpStream, counts: &Mutex<Counts>, hold: Duration) {
    {
        let mut counts = counts.lock().unwrap();
        counts.accepted += 1;
        counts.open += 1;
        counts.most_open = counts.most_open.max(counts.open);
    }
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut head = Vec::new();
    let mut byte = [0];
    while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
        head.push(byte[0]);
    }
    let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\no");
    std::thread::sleep(hold);
    let _ = stream.write_all(b"k");
    // Counted closed before the socket is: the server never counts more than the client holds.
    counts.lock().unwrap().open -= 1;
}

/// The node's cap on outgoing connections holds across tenants: with a
/// total of 4 and a share of 3, a tenant that holds its 3 leaves a second
/// tenant one place (its other tries fail at once with
/// `connection-limit-reached`, counted as its limit hit), though neither
/// is past its own share, and no more than 4 are ever open at the server.
#[test]
fn all_tenants_outgoing_connections_are_capped_together() {
    const TOTAL: usize = 4;
    const SHARE: usize = 3;
    const REQUESTS: usize = 6;
    let slow = TestServer::start("127.0.0.1", Duration::from_secs(3));
    let seed = harness::fresh_dir("egress-total-seed");
    for tenant in ["first", "second"] {
        harness::install(&seed, tenant, "attack", &guest("hostile"));
    }
    let data = harness::fresh_dir("egress-total-data");
    let mut config = harness::config(data.clone(), Some(seed));
    config.outgoing_allow_private = true;
    config.outgoing_ports = vec![slow.addr.port()];
    config.outgoing_max_connections_per_tenant = SHARE as u32;
    config.outgoing_max_connections = TOTAL as u32;
    let addr = harness::start(config);
    let key = |tenant: &str| std::fs::read_to_string(data.join(format!("{tenant}.key"))).unwrap().trim().to_owned();
    let grant = |tenant: &str| {
        let request = anonymous().request(Method::PATCH, format!("http://{addr}/admin/v1/tenants/{tenant}")).bearer_auth(ADMIN_TOKEN);
        assert_eq!(request.json(&json!({ "outgoing_http": true })).send().unwrap().status(), 200);
    };
    grant("first");
    grant("second");
    let fetch_many = |tenant: &str| {
        let url = format!("http://{addr}/v1/{tenant}/attack?attack=fetch-many&n={REQUESTS}&url=http://127.0.0.1:{}/", slow.addr.port());
        let response = client_with_key(&key(tenant)).get(url).send().unwrap();
        assert_eq!(response.status(), 200);
        let body: Value = response.json().unwrap();
        let outcomes: BTreeMap<String, usize> = serde_json::from_value(body["outcomes"].clone()).unwrap();
        let count = |outcome: &str| outcomes.iter().filter(|(key, _)| key.ends_with(outcome)).map(|(_, n)| n).sum::<usize>();
        assert_eq!(count("ok: 200") + count("ConnectionLimitReached"), REQUESTS, "{tenant}: {outcomes:?}");
        count("ok: 200")
    };
    let (first, second) = std::thread::scope(|s| {
        let first = s.spawn(|| fetch_many("first"));
        // The first tenant holds its share (for 3 s) before the second asks.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while slow.counts.lock().unwrap().open < SHARE {
            assert!(std::time::Instant::now() < deadline, "the first tenant never held its {SHARE} connections");
            std::thread::sleep(Duration::from_millis(5));
        }
        let second = fetch_many("second");
        (first.join().unwrap(), second)
    });
    assert_eq!((first, second), (SHARE, TOTAL - SHARE), "connections each tenant got: its share, then what the total left");
    assert_eq!(slow.most_open(), TOTAL, "connections open at the server at once");
    // A request's hits are counted once its guest has finished, just after its response.
    let hits = (0..50).find_map(|_| {
        let metrics = anonymous().get(format!("http://{addr}/metrics")).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap();
        let hits = harness::metric(&metrics, "facegate_limit_hits_total{tenant=\"second\",limit=\"outgoing_connections\"}");
        hits.or_else(|| {
            std::thread::sleep(Duration::from_millis(100));
            None
        })
    });
    assert!(hits.is_some_and(|h| h >= 1.0), "the second tenant's refusals are its limit hit: {hits:?}");
}
