//! The node's memory budget under aggregate attack: many requests of one
//! tenant at once, then of two tenants at once, each inside its own
//! per-request limit (240 MiB of 256) but together far past the node's.
//! A gateway of its own (a child process, so its RSS is its alone) runs
//! with a 1 GiB budget: its peak RSS stays within the budget over its
//! baseline, what is refused is refused with 503 `overloaded`, a neighbour
//! tenant's detections all succeed and `/healthz` answers throughout.

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
                    (status, code)
                })
            })
            .collect();
        let attacks = hostile.into_iter().map(|h| h.join().unwrap()).collect();
        stop.store(true, Ordering::SeqCst);
        Outcome {
            attacks,
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
    let refused = |o: &Outcome| o.attacks.iter().filter(|(s, _)| *s == 503).count() as f64;
    assert!(hits("evil").unwrap_or(0.0) + hits("evil2").unwrap_or(0.0) >= refused(&one) + refused(&two), "{metrics}");
    assert_eq!(hits("demo"), None, "the neighbour hit no budget");
    assert!(harness::metric(&metrics, "facegate_memory_budget_bytes").is_some_and(|b| b > 0.0), "{metrics}");
}
