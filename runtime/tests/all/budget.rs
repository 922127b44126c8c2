//! The node's memory budget under aggregate attack: many requests of one
//! tenant at once, then of two tenants at once, each inside its own
//! per-request limit (240 MiB of 256) but together far past the node's.
//! A gateway of its own (a child process, so its RSS is its alone) runs
//! with a 1 GiB budget: its peak RSS stays within the budget over its
//! baseline, what is refused is refused with 503 `overloaded`, a neighbour
//! tenant's detections all succeed and `/healthz` answers throughout.
//! Idle warm instances are a cache: a tenant's kept instances are dropped
//! before a neighbour is refused.

use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::harness::{self, anonymous, client_with_key, image};
use crate::process::Server;

/// The test gateway's memory budget.
const BUDGET_MIB: u64 = 1024;
/// What each hostile request holds: inside the tenants' 256 MiB limit.
const HOLD_MIB: u64 = 240;
/// Slowest `/healthz` answer tolerated (2 cores, a model running).
const HEALTH_BOUND: Duration = Duration::from_secs(2);

/// The resident memory of process `pid`, MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

/// A gateway with a 1 GiB budget serving `demo/detect` and the hostile
/// handler as `evil/attack` and `evil2/attack`.
fn budgeted_gateway(data: &Path) -> Server {
    let seed = harness::fresh_dir("budget-seed");
    harness::install(&seed, "demo", "detect", &harness::guest("detect"));
    harness::install(&seed, "evil", "attack", &harness::guest("hostile"));
    harness::install(&seed, "evil2", "attack", &harness::guest("hostile"));
    let budget = BUDGET_MIB.to_string();
    Server::start_with(data, &["--seed-dir", seed.to_str().unwrap(), "--memory-budget-mib", &budget, "--request-timeout-ms", "15000"])
}

fn key(data: &Path, tenant: &str) -> String {
    std::fs::read_to_string(data.join(format!("{tenant}.key"))).unwrap().trim().to_owned()
}

/// What the gateway did while the attackers ran.
struct Outcome {
    /// (status, error code) of each hostile request.
    attacks: Vec<(u16, String)>,
    /// The tenant of each hostile request (as `attacks`).
    attackers: Vec<String>,
    neighbour: Vec<u16>,
    slowest_health: Duration,
    peak_rss_mib: u64,
}

/// Runs `per_tenant` concurrent `hold` requests for each key in `attackers`
/// while the neighbour detects faces, `/healthz` is polled and the
/// gateway's RSS sampled.
fn attack(server: &Server, attackers: &[(&str, String)], neighbour_key: &str, per_tenant: usize) -> Outcome {
    let (addr, pid) = (server.addr, server.pid());
    let (stop, peak, slowest) = (AtomicBool::new(false), AtomicU64::new(0), Mutex::new(Duration::ZERO));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                peak.fetch_max(rss_mib(pid), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        s.spawn(|| {
            let client = anonymous();
            while !stop.load(Ordering::SeqCst) {
                let start = Instant::now();
                let ok = client.get(format!("http://{addr}/healthz")).send().is_ok_and(|r| r.status().is_success());
                let took = if ok { start.elapsed() } else { Duration::MAX };
                let mut slowest = slowest.lock().unwrap();
                *slowest = (*slowest).max(took);
                drop(slowest);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let neighbour = s.spawn(|| {
            let (client, photo) = (client_with_key(neighbour_key), image("grace_hopper.jpg"));
            let mut seen = Vec::new();
            while !stop.load(Ordering::SeqCst) || seen.is_empty() {
                seen.push(client.post(format!("http://{addr}/v1/demo/detect")).body(photo.clone()).send().unwrap().status().as_u16());
            }
            seen
        });
        let hostile: Vec<_> = attackers
            .iter()
            .flat_map(|(tenant, key)| std::iter::repeat_n((*tenant, key.clone()), per_tenant))
            .map(|(tenant, key)| {
                s.spawn(move || {
                    let url = format!("http://{addr}/v1/{tenant}/attack?attack=hold&mib={HOLD_MIB}&ms=3000");
                    let response = client_with_key(&key).get(url).send().unwrap();
                    let status = response.status().as_u16();
                    let retry_after = response.headers().contains_key("retry-after");
                    let body: serde_json::Value = response.json().unwrap_or_default();
                    let code = body["error"]["code"].as_str().unwrap_or("").to_owned();
                    assert!(status != 503 || retry_after, "a 503 without Retry-After: {body}");
                    (tenant.to_owned(), (status, code))
                })
            })
            .collect();
        let (attackers, attacks) = hostile.into_iter().map(|h| h.join().unwrap()).unzip();
        stop.store(true, Ordering::SeqCst);
        Outcome {
            attacks,
            attackers,
            neighbour: neighbour.join().unwrap(),
            slowest_health: *slowest.lock().unwrap(),
            peak_rss_mib: peak.load(Ordering::SeqCst),
        }
    })
}

impl Outcome {
    /// The node held: RSS within the budget, refusals as 503 `overloaded`,
    /// the neighbour and `/healthz` served; some attackers were served too
    /// (the budget is shared, not shut).
    fn assert_held(&self, baseline_mib: u64) {
        let growth = self.peak_rss_mib.saturating_sub(baseline_mib);
        assert!(growth <= BUDGET_MIB, "RSS grew {growth} MiB over its baseline of {baseline_mib}, past the {BUDGET_MIB} MiB budget");
        let served = self.attacks.iter().filter(|(status, _)| *status == 200).count();
        let refused: Vec<_> = self.attacks.iter().filter(|(status, _)| *status != 200).collect();
        eprintln!(
            "budget: {served} hostile requests served, {} refused; the neighbour's {} all 200; RSS peaked {growth} MiB over its baseline",
            refused.len(),
            self.neighbour.len()
        );
        assert!(served >= 1, "the budget admits some of the hostile requests: {:?}", self.attacks);
        assert!(!refused.is_empty(), "all {} held at once: the budget let them all in", self.attacks.len());
        assert!(refused.iter().all(|(status, code)| *status == 503 && code == "overloaded"), "refusals: {refused:?}");
        assert!(self.neighbour.iter().all(|&s| s == 200), "the neighbour got {:?}", self.neighbour);
        assert!(self.slowest_health < HEALTH_BOUND, "/healthz took {:?}", self.slowest_health);
    }
}

#[test]
fn one_or_two_tenants_holding_memory_at_once_stay_within_the_node_budget() {
    let data = harness::fresh_dir("budget");
    let server = budgeted_gateway(&data);
    let (evil, evil2, demo) = (key(&data, "evil"), key(&data, "evil2"), key(&data, "demo"));
    // The baseline: the model has run and the handlers have been instantiated.
    let detect = client_with_key(&demo).post(format!("http://{}/v1/demo/detect", server.addr)).body(image("grace_hopper.jpg"));
    assert_eq!(detect.send().unwrap().status(), 200);
    let small = format!("http://{}/v1/evil/attack?attack=hold&mib=1&ms=0", server.addr);
    assert_eq!(client_with_key(&evil).get(small).send().unwrap().status(), 200);
    let baseline = rss_mib(server.pid());

    let one = attack(&server, &[("evil", evil.clone())], &demo, 32);
    one.assert_held(baseline);
    let two = attack(&server, &[("evil", evil), ("evil2", evil2)], &demo, 16);
    two.assert_held(baseline);

    // Every refusal was counted against its tenant.
    let metrics =
        anonymous().get(format!("http://{}/metrics", server.addr)).bearer_auth(harness::ADMIN_TOKEN).send().unwrap().text().unwrap();
    let hits =
        |tenant: &str| harness::metric(&metrics, &format!("facegate_limit_hits_total{{tenant=\"{tenant}\",limit=\"memory_budget\"}}"));
    let refused = |o: &Outcome, tenant: &str| o.attackers.iter().zip(&o.attacks).filter(|(t, (s, _))| *t == tenant && *s == 503).count();
    for tenant in ["evil", "evil2"] {
        // Each attacker's own: not the other's refusals counted against it, nor its own missed.
        let counted = hits(tenant).unwrap_or(0.0);
        let refusals = refused(&one, tenant) + refused(&two, tenant);
        assert_eq!(counted, refusals as f64, "{tenant}: {refusals} refusals, {counted} memory_budget hits counted:\n{metrics}");
    }
    assert_eq!(hits("demo"), None, "the neighbour hit no budget");
    assert!(harness::metric(&metrics, "facegate_memory_budget_bytes").is_some_and(|b| b > 0.0), "{metrics}");
}

/// A `/metrics` gauge of `server`.
fn gauge(server: &Server, name: &str) -> f64 {
    let text = anonymous().get(format!("http://{}/metrics", server.addr)).bearer_auth(harness::ADMIN_TOKEN).send().unwrap().text().unwrap();
    harness::metric(&text, name).unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// Calls `tenant`'s hostile handler to hold `mib` MiB for `ms`; its status.
fn hold(server: &Server, key: &str, tenant: &str, mib: u64, ms: u64) -> u16 {
    let url = format!("http://{}/v1/{tenant}/attack?attack=hold&mib={mib}&ms={ms}", server.addr);
    client_with_key(key).get(url).send().unwrap().status().as_u16()
}

#[test]
fn idle_warm_instances_are_dropped_before_a_neighbour_is_refused() {
    const WARM: usize = 3;
    const WARM_HOLD_MIB: u64 = 40;
    const MIB: f64 = (1 << 20) as f64;
    let data = harness::fresh_dir("budget-warm");
    let seed = harness::fresh_dir("budget-warm-seed");
    harness::install(&seed, "keeper", "attack", &harness::guest("hostile"));
    harness::install(&seed, "neighbour", "attack", &harness::guest("hostile"));
    let args = ["--seed-dir", seed.to_str().unwrap(), "--memory-budget-mib", "512", "--instance-reuse", "100"];
    let server = Server::start_with(&data, &args);
    let (keeper, neighbour) = (key(&data, "keeper"), key(&data, "neighbour"));

    // The keeper's requests at once leave WARM instances of 40 MiB each idle.
    std::thread::scope(|s| {
        let calls: Vec<_> = (0..WARM).map(|_| s.spawn(|| hold(&server, &keeper, "keeper", WARM_HOLD_MIB, 1500))).collect();
        calls.into_iter().for_each(|call| assert_eq!(call.join().unwrap(), 200));
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while gauge(&server, "facegate_instances_warm") < WARM as f64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(gauge(&server, "facegate_instances_warm"), WARM as f64, "the keeper's instances are kept warm");
    let (budget, idle) = (gauge(&server, "facegate_memory_budget_bytes") / MIB, gauge(&server, "facegate_memory_charged_bytes") / MIB);
    assert!(idle >= (WARM as u64 * WARM_HOLD_MIB) as f64, "idle instances keep their charge: {idle} MiB");

    // The neighbour asks for more than the idle instances leave, but for
    // less than the budget keeps out of its reserve: served once they go.
    let wanted = (budget - idle) as u64 + 16;
    assert!((wanted + 8) as f64 <= budget * 7.0 / 8.0, "the neighbour's {wanted} MiB fit an empty node of {budget} MiB");
    assert_eq!(hold(&server, &neighbour, "neighbour", wanted, 0), 200, "the neighbour is served, not refused for idle memory");
    assert!(gauge(&server, "facegate_instances_warm") < WARM as f64, "idle instances were dropped to make room");
}

/// Opens a chunked upload to `tenant`'s hostile handler and sends its first
/// chunk of `sent` bytes; the connection, left waiting for the rest.
fn start_chunked_upload(server: &Server, key: &str, tenant: &str, sent: usize) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(server.addr).unwrap();
    let head = format!(
        "POST /v1/{tenant}/attack?attack=count HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(format!("{sent:x}\r\n").as_bytes()).unwrap();
    stream.write_all(&vec![b'x'; sent]).unwrap();
    stream.write_all(b"\r\n").unwrap();
    stream
}

#[test]
fn a_slow_chunked_upload_is_charged_what_it_sent_not_the_largest_body() {
    const UPLOADS: usize = 4;
    const SENT: usize = 1024;
    const BASE_MIB: f64 = 2.0;
    let data = harness::fresh_dir("budget-chunked");
    let seed = harness::fresh_dir("budget-chunked-seed");
    harness::install(&seed, "uploader", "attack", &harness::guest("hostile"));
    let server = Server::start_with(&data, &["--seed-dir", seed.to_str().unwrap(), "--memory-budget-mib", "512"]);
    let uploader = key(&data, "uploader");
    let charged_mib = || gauge(&server, "facegate_memory_charged_bytes") / f64::from(1 << 20);

    let mut uploads: Vec<_> = (0..UPLOADS).map(|_| start_chunked_upload(&server, &uploader, "uploader", SENT)).collect();
    // Admitted: each holds at least its base.
    let deadline = Instant::now() + Duration::from_secs(10);
    while charged_mib() < UPLOADS as f64 * BASE_MIB && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let charged = charged_mib();
    assert!(charged >= UPLOADS as f64 * BASE_MIB, "the uploads were admitted: {charged} MiB charged");
    // The largest body (16 MiB) each would be 72 MiB in all.
    assert!(charged < UPLOADS as f64 * (BASE_MIB + 1.0), "{UPLOADS} uploads of {SENT} bytes so far hold {charged} MiB of the budget");

    // An upload that finishes is served.
    use std::io::{Read, Write};
    let mut last = uploads.pop().unwrap();
    last.write_all(b"0\r\n\r\n").unwrap();
    let mut head = [0u8; 12];
    last.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200", "{}", String::from_utf8_lossy(&head));
}

/// `FACEGATE_MEMORY_BUDGET_MIB` sets the node's budget as
/// `--memory-budget-mib` does: `/metrics` reports the same budget for
/// either (less what the instance pool keeps resident), and not the one
/// the node takes by default from the machine's memory.
#[test]
fn the_memory_budget_is_set_from_the_environment() {
    let from_env = Server::start_after("export FACEGATE_MEMORY_BUDGET_MIB=384", &harness::fresh_dir("budget-env"), &[]);
    let from_flag = Server::start_with(&harness::fresh_dir("budget-flag"), &["--memory-budget-mib", "384"]);
    let by_default = Server::start(&harness::fresh_dir("budget-default"));
    let [env, flag, default] = [&from_env, &from_flag, &by_default].map(|s| gauge(s, "facegate_memory_budget_bytes"));
    assert_eq!(env, flag, "FACEGATE_MEMORY_BUDGET_MIB=384 and --memory-budget-mib 384 give the same budget");
    assert_ne!(env, default, "the variable changed nothing: the default budget is {default} bytes too");
}

/// A request whose memory grows past what the node's budget can give, but
/// within its own limit (512 MiB), fails cleanly while it runs: 503
/// `overloaded` with `Retry-After`, counted as its tenant's
/// `memory_budget` hit, its charge given back; a request running beside
/// it is served, and so is the tenant's next request of a size that fits.
#[test]
fn a_growth_past_the_node_budget_is_refused_inside_its_request() {
    const MIB: f64 = (1 << 20) as f64;
    let data = harness::fresh_dir("budget-growth");
    let seed = harness::fresh_dir("budget-growth-seed");
    harness::install(&seed, "grower", "attack", &harness::guest("hostile"));
    harness::install(&seed, "neighbour", "attack", &harness::guest("hostile"));
    let args = ["--seed-dir", seed.to_str().unwrap(), "--memory-budget-mib", "512", "--memory-limit-mib", "512"];
    let server = Server::start_with(&data, &args);
    let (grower, neighbour) = (key(&data, "grower"), key(&data, "neighbour"));
    // Past what requests may hold (the budget less the pool's resident pages), within the request's own limit.
    let budget = gauge(&server, "facegate_memory_budget_bytes") / MIB;
    let wanted = budget as u64 + 16;
    assert!(wanted + 8 < 512, "the budget for requests is {budget} MiB");

    let (grown, beside) = std::thread::scope(|s| {
        let beside = s.spawn(|| hold(&server, &neighbour, "neighbour", 32, 2000));
        std::thread::sleep(Duration::from_millis(300));
        let url = format!("http://{}/v1/grower/attack?attack=hold&mib={wanted}&ms=0", server.addr);
        let response = client_with_key(&grower).get(url).send().unwrap();
        let (status, retry) = (response.status().as_u16(), response.headers().contains_key("retry-after"));
        let body: serde_json::Value = response.json().unwrap_or_default();
        ((status, retry, body), beside.join().unwrap())
    });
    let (status, retry, body) = grown;
    assert_eq!((status, body["error"]["code"].as_str(), retry), (503, Some("overloaded"), true), "{body}");
    assert_eq!(beside, 200, "the request beside it was served");
    assert_eq!(hold(&server, &grower, "grower", 64, 0), 200, "the grower's next request, of a size that fits, is served");
    let metrics =
        anonymous().get(format!("http://{}/metrics", server.addr)).bearer_auth(harness::ADMIN_TOKEN).send().unwrap().text().unwrap();
    let hits =
        |tenant: &str| harness::metric(&metrics, &format!("facegate_limit_hits_total{{tenant=\"{tenant}\",limit=\"memory_budget\"}}"));
    assert_eq!((hits("grower"), hits("neighbour")), (Some(1.0), None), "{metrics}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while gauge(&server, "facegate_memory_charged_bytes") / MIB > 8.0 {
        assert!(
            Instant::now() < deadline,
            "the charges were not given back: {} MiB",
            gauge(&server, "facegate_memory_charged_bytes") / MIB
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
