//! The control plane under aggregate attack: a tenant's `deploy` key opens
//! 100 uploads of 64 MiB at once (then four tenants do it together), each
//! stalling before its last byte. The node charges an upload to its memory
//! budget before it reads the body, and takes the tenant's one change
//! place first: every upload past the first of each tenant is answered
//! before its body (429 `upload_in_progress` + `Retry-After`), one that
//! does not fit the budget too (503 `overloaded` + `Retry-After`); the
//! gateway's RSS (a child process, so its own) stays within the budget
//! over its baseline, a neighbour's detections all succeed, and another
//! tenant's valid upload deploys meanwhile.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::connections::connect_from;
use crate::harness::{self, ADMIN_TOKEN, anonymous, client_with_key, image};
use crate::process::Server;

/// The gateway's memory budget.
const BUDGET_MIB: u64 = 1024;
/// RSS growth tolerated over the budget (allocator slack, the model's scratch).
const MARGIN_MIB: u64 = 200;
/// Uploads each attacking tenant opens at once.
const UPLOADS: usize = 100;
/// What each declares: the default largest component.
const DECLARED: usize = 64 << 20;
/// How long the answers before the body may take to arrive, all together.
const ANSWERS_WITHIN: Duration = Duration::from_secs(2);

/// The resident memory of process `pid`, MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

/// A `deploy` key of `tenant`, made through the admin API.
fn deploy_key(addr: SocketAddr, tenant: &str) -> String {
    let response = anonymous()
        .post(format!("http://{addr}/admin/v1/tenants/{tenant}/keys"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&serde_json::json!({ "scopes": ["deploy"] }))
        .send()
        .unwrap();
    assert_eq!(response.status(), 201);
    response.json::<serde_json::Value>().unwrap()["key"].as_str().unwrap().to_owned()
}

/// Opens an upload of `declared` bytes from `source` and sends its head only.
fn open_upload(addr: SocketAddr, source: &str, key: &str, declared: usize) -> TcpStream {
    let mut stream = connect_from(source, addr);
    let head =
        format!("PUT /tenant/v1/handlers/big HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\nContent-Length: {declared}\r\n\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    stream
}

/// The answer's status, error code and whether it has `Retry-After`, if one
/// has arrived (the head and a small JSON body; `within` for the rest of it).
fn answer(stream: &mut TcpStream, within: Duration) -> Option<(u16, String, bool)> {
    stream.set_read_timeout(Some(within)).unwrap();
    let mut seen = Vec::new();
    let mut chunk = [0u8; 4096];
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") || !seen.ends_with(b"}") {
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => seen.extend_from_slice(&chunk[..n]),
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&seen).to_lowercase();
    let status = text.strip_prefix("http/1.1 ")?.get(..3)?.parse().ok()?;
    let code = text.split("\"code\":\"").nth(1).and_then(|rest| rest.split('"').next()).unwrap_or("").to_owned();
    Some((status, code, text.contains("\r\nretry-after: ")))
}

/// What one tenant's uploads got: the refusals before the body, and the
/// ones left waiting for it.
struct Opened {
    refused: Vec<(u16, String, bool)>,
    waiting: Vec<TcpStream>,
}

/// Opens [`UPLOADS`] uploads of `key`'s tenant from `source` at once, then reads what each was answered.
fn flood(addr: SocketAddr, source: &str, key: &str) -> Opened {
    let mut streams: Vec<_> = (0..UPLOADS).map(|_| open_upload(addr, source, key, DECLARED)).collect();
    std::thread::sleep(ANSWERS_WITHIN);
    let answers: Vec<_> = streams.iter_mut().map(|s| answer(s, Duration::from_millis(50))).collect();
    let mut opened = Opened { refused: Vec::new(), waiting: Vec::new() };
    for (stream, answer) in streams.into_iter().zip(answers) {
        match answer {
            Some(refusal) => opened.refused.push(refusal),
            None => opened.waiting.push(stream),
        }
    }
    opened
}

/// Sends all but the last byte of each waiting upload's body.
fn stall_before_the_last_byte(waiting: &mut [TcpStream]) {
    let chunk = vec![0u8; 1 << 20];
    for stream in waiting {
        let mut left = DECLARED - 1;
        while left > 0 {
            let n = left.min(chunk.len());
            stream.write_all(&chunk[..n]).unwrap();
            left -= n;
        }
    }
}

/// Runs `attack` while the neighbour detects faces and the gateway's RSS is
/// sampled; the neighbour's statuses and the peak RSS (MiB).
fn under_attack<T: Send>(server: &Server, neighbour: &str, attack: impl FnOnce() -> T + Send) -> (T, Vec<u16>, u64) {
    let (addr, pid) = (server.addr, server.pid());
    let (stop, peak) = (AtomicBool::new(false), AtomicU64::new(0));
    /// Stops the helpers even when the attack panics (a failed assertion).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                peak.fetch_max(rss_mib(pid), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let served = s.spawn(|| {
            let (client, photo) = (client_with_key(neighbour), image("grace_hopper.jpg"));
            let mut seen = Vec::new();
            while !stop.load(Ordering::SeqCst) || seen.len() < 3 {
                seen.push(client.post(format!("http://{addr}/v1/demo/detect")).body(photo.clone()).send().unwrap().status().as_u16());
            }
            seen
        });
        let stopping = StopOnDrop(&stop);
        let outcome = attack();
        drop(stopping);
        (outcome, served.join().unwrap(), peak.load(Ordering::SeqCst))
    })
}

/// Each tenant's flood: all but one refused before its body, 429
/// `upload_in_progress` with `Retry-After`; one left waiting for its body.
fn assert_one_each(tenant: &str, opened: &Opened) {
    assert_eq!(opened.waiting.len(), 1, "{tenant}: {} uploads admitted at once; refusals: {:?}", opened.waiting.len(), opened.refused);
    let wrong: Vec<_> =
        opened.refused.iter().filter(|(status, code, retry)| !(*status == 429 && code == "upload_in_progress" && *retry)).collect();
    assert!(wrong.is_empty(), "{tenant}: refusals other than 429 upload_in_progress with Retry-After: {wrong:?}");
}

fn gateway(data: &Path) -> Server {
    let seed = harness::fresh_dir("uploads-seed");
    harness::install(&seed, "demo", "detect", &harness::guest("detect"));
    for tenant in ["up0", "up1", "up2", "up3", "up4", "builder"] {
        harness::install(&seed, tenant, "attack", &harness::guest("hostile"));
    }
    let budget = BUDGET_MIB.to_string();
    // Uploads may declare up to 1 GiB: the budget, not the size limit, refuses the largest.
    let largest = (1usize << 30).to_string();
    Server::start_with(data, &["--seed-dir", seed.to_str().unwrap(), "--memory-budget-mib", &budget, "--max-component-bytes", &largest])
}

#[test]
fn concurrent_stalled_uploads_of_one_and_of_four_tenants_stay_within_the_node_budget() {
    let data = harness::fresh_dir("uploads");
    let server = gateway(&data);
    let addr = server.addr;
    let demo = std::fs::read_to_string(data.join("demo.key")).unwrap().trim().to_owned();
    // up0 attacks alone, up1 to up4 together (each with a full tenant-API bucket).
    let keys: Vec<String> = ["up0", "up1", "up2", "up3", "up4"].iter().map(|t| deploy_key(addr, t)).collect();
    let builder = deploy_key(addr, "builder");
    let detect = client_with_key(&demo).post(format!("http://{addr}/v1/demo/detect")).body(image("grace_hopper.jpg"));
    assert_eq!(detect.send().unwrap().status(), 200);
    let baseline = rss_mib(server.pid());

    // One tenant, 100 uploads at once.
    let (mut one, neighbour, peak) = under_attack(&server, &demo, || {
        let mut opened = flood(addr, "127.0.0.2", &keys[0]);
        assert_one_each("up0", &opened);
        stall_before_the_last_byte(&mut opened.waiting);
        std::thread::sleep(Duration::from_secs(2));
        opened
    });
    assert!(neighbour.iter().all(|&s| s == 200), "the neighbour got {neighbour:?}");
    let growth = peak.saturating_sub(baseline);
    eprintln!("uploads: one tenant, {} refused before their bodies; RSS peaked {growth} MiB over {baseline}", one.refused.len());
    assert!(growth <= BUDGET_MIB + MARGIN_MIB, "RSS grew {growth} MiB over its baseline of {baseline}");
    one.waiting.clear();

    // Four tenants at once; meanwhile another tenant's upload that does not
    // fit is refused before its body, and a valid one deploys.
    let ((floods, too_large, deployed), neighbour, peak) = under_attack(&server, &demo, || {
        std::thread::scope(|s| {
            let floods: Vec<_> = keys[1..]
                .iter()
                .enumerate()
                .map(|(i, key)| {
                    s.spawn(move || {
                        let mut opened = flood(addr, &format!("127.0.0.{}", 3 + i), key);
                        assert_one_each(&format!("up{}", i + 1), &opened);
                        stall_before_the_last_byte(&mut opened.waiting);
                        opened
                    })
                })
                .collect();
            let floods: Vec<_> = floods.into_iter().map(|f| f.join().unwrap()).collect();
            let mut huge = open_upload(addr, "127.0.0.8", &builder, 900 << 20);
            let too_large = answer(&mut huge, ANSWERS_WITHIN);
            let started = Instant::now();
            let component = std::fs::read(harness::guest("detect")).unwrap();
            let response = client_with_key(&builder).put(format!("http://{addr}/tenant/v1/handlers/faces")).body(component).send().unwrap();
            (floods, too_large, (response.status().as_u16(), started.elapsed()))
        })
    });
    let growth = peak.saturating_sub(baseline);
    eprintln!("uploads: four tenants; RSS peaked {growth} MiB over {baseline}; the valid upload took {:?}", deployed.1);
    assert!(growth <= BUDGET_MIB + MARGIN_MIB, "RSS grew {growth} MiB over its baseline of {baseline}");
    assert!(neighbour.iter().all(|&s| s == 200), "the neighbour got {neighbour:?}");
    let (status, code, retry) = too_large.expect("an upload the budget cannot hold is answered before its body");
    assert_eq!((status, code.as_str(), retry), (503, "overloaded", true));
    assert_eq!(deployed.0, 201, "another tenant's valid upload deploys meanwhile");
    drop(floods);

    // The stalled uploads given up, their charges go back.
    let charged = || {
        let text = anonymous().get(format!("http://{addr}/metrics")).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap();
        harness::metric(&text, "facegate_memory_charged_bytes").unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(40);
    while charged() > f64::from(16u32 << 20) {
        assert!(Instant::now() < deadline, "{} bytes still charged after the uploads ended", charged());
        std::thread::sleep(Duration::from_millis(200));
    }
}
