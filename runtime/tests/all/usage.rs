//! Usage metering: requests of known statuses and sizes are metered
//! exactly, device time as `/metrics` charges it, every node's usage sums
//! in a PostgreSQL cluster, and a node killed with SIGKILL loses at most
//! its last flush interval and never counts a request twice.

use std::time::{Duration, Instant};

use facegate_throwaway_pg::ThrowawayPostgres;
use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{self, ADMIN_TOKEN, anonymous, client_with_key, guest, image, metric};
use crate::process::Server;

/// The nodes' flush interval in these tests, ms.
const FLUSH_MS: &str = "200";

/// The usage report's rows summed (all periods, handlers and versions).
pub(crate) fn total(report: &Value) -> Value {
    let mut sum = serde_json::Map::new();
    for row in report["rows"].as_array().unwrap() {
        for (field, value) in row.as_object().unwrap() {
            if let Some(n) = value.as_u64().filter(|_| !matches!(field.as_str(), "version" | "start_ms")) {
                let entry = sum.entry(field.clone()).or_insert(json!(0));
                *entry = json!(if field == "peak_memory_bytes" { entry.as_u64().unwrap().max(n) } else { entry.as_u64().unwrap() + n });
            }
        }
    }
    Value::Object(sum)
}

/// All of a field of [`total`] (0 when no row has it).
pub(crate) fn field(total: &Value, name: &str) -> u64 {
    total[name].as_u64().unwrap_or(0)
}

/// Polls `report` until its rows add up to `requests` answers; returns the total.
pub(crate) fn until_requests(requests: u64, mut report: impl FnMut() -> Value) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let sum = total(&report());
        let seen: u64 = ["requests_2xx", "requests_3xx", "requests_4xx", "requests_5xx"].iter().map(|f| field(&sum, f)).sum();
        if seen >= requests || Instant::now() > deadline {
            return sum;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn each_request_is_metered_once_with_its_status_class_bytes_and_device_time() {
    let data = harness::fresh_dir("usage-data");
    let mut config = harness::config(data.clone(), Some(harness::seed_dir()));
    config.usage_flush_ms = 200;
    let addr = harness::start(config);
    let key = |tenant: &str| std::fs::read_to_string(data.join(format!("{tenant}.key"))).unwrap().trim().to_owned();
    let (demo, evil) = (client_with_key(&key("demo")), client_with_key(&key("evil")));
    let photo = image("grace_hopper.jpg");
    let mut bytes_out = 0;
    let mut post = |query: &str, body: Vec<u8>, status: u16| {
        let response = demo.post(format!("http://{addr}/v1/demo/detect{query}")).body(body).send().unwrap();
        assert_eq!(response.status(), status);
        bytes_out += response.bytes().unwrap().len() as u64;
    };
    // Two calls of `centerface` (the default) and one of `centerface-int8`.
    for query in ["", "?model=centerface-int8", ""] {
        post(query, photo.clone(), 200);
    }
    for _ in 0..2 {
        post("", Vec::new(), 400);
    }
    // Another tenant's request: in the report of all tenants only.
    assert_eq!(evil.get(format!("http://{addr}/v1/evil/attack?attack=count")).send().unwrap().status(), 200);

    let report = |query: &str| {
        let url = format!("http://{addr}/admin/v1/usage?{query}");
        anonymous().get(url).bearer_auth(ADMIN_TOKEN).send().unwrap().json::<Value>().unwrap()
    };
    let demo_usage = until_requests(5, || report("tenant=demo&by=minute"));
    assert_eq!((field(&demo_usage, "requests_2xx"), field(&demo_usage, "requests_4xx")), (3, 2), "{demo_usage}");
    assert_eq!(field(&demo_usage, "requests_5xx"), 0);
    assert_eq!(field(&demo_usage, "bytes_in"), 3 * photo.len() as u64, "{demo_usage}");
    assert_eq!(field(&demo_usage, "bytes_out"), bytes_out, "{demo_usage}");
    assert_eq!(field(&demo_usage, "infer_calls"), 3);
    assert!(field(&demo_usage, "guest_us") > 0 && field(&demo_usage, "peak_memory_bytes") > 0, "{demo_usage}");

    // Each model's part: its calls, and its device time as `/metrics` has it.
    let metrics = anonymous().get(format!("http://{addr}/metrics")).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap();
    let parts = model_parts(&report("tenant=demo&by=minute"));
    let names: Vec<&str> = parts.keys().map(String::as_str).collect();
    assert_eq!(names, ["centerface", "centerface-int8"], "{parts:?}");
    assert_eq!((parts["centerface"].1, parts["centerface-int8"].1), (2, 1), "calls per model: {parts:?}");
    assert_eq!(parts.values().map(|p| p.0).sum::<u64>(), field(&demo_usage, "device_us"), "the parts add up to the row: {parts:?}");
    for (model, (device_us, _)) in &parts {
        let series = format!("facegate_tenant_device_seconds_total{{model=\"{model}\",tenant=\"demo\"}}");
        let device = metric(&metrics, &series).unwrap();
        let metered = *device_us as f64 / 1e6;
        assert!(
            device > 0.0 && (metered - device).abs() <= device * 0.01,
            "{model}: usage {metered} s of device time, /metrics {device} s"
        );
    }

    let everyone = until_requests(6, || report("by=day"));
    assert_eq!(field(&everyone, "requests_2xx"), 4, "the other tenant's request is in the report of all: {everyone}");
    let csv = anonymous().get(format!("http://{addr}/admin/v1/usage?tenant=demo&format=csv")).bearer_auth(ADMIN_TOKEN).send().unwrap();
    assert_eq!(csv.headers()["content-type"], "text/csv; charset=utf-8");
    let csv = csv.text().unwrap();
    assert!(csv.starts_with("tenant,handler,version,start_ms,requests_2xx,"), "{csv}");
    let rows = csv_rows(&csv);
    assert!(!rows.is_empty(), "a row per period with requests: {csv}");
    assert!(rows.iter().all(|r| (r["tenant"].as_str(), r["handler"].as_str()) == (Some("demo"), Some("detect"))), "{csv}");
    assert_eq!((csv_sum(&rows, "requests_2xx"), csv_sum(&rows, "requests_4xx")), (3, 2), "{csv}");
    assert_eq!(csv_sum(&rows, "bytes_in"), 3 * photo.len() as u64, "{csv}");
    let int8_calls: u64 = rows
        .iter()
        .flat_map(|r| r["models"].as_str().unwrap().split(';').map(str::to_owned).collect::<Vec<_>>())
        .filter_map(|part| part.strip_prefix("centerface-int8:").and_then(|rest| rest.split(':').nth(1)?.parse::<u64>().ok()))
        .sum();
    assert_eq!(int8_calls, 1, "the models column, name:device_us:calls: {csv}");

    // The CLI: `--by` picks the period, `--csv` prints the same rows.
    let cli = |args: &[&str]| -> String {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_facegate"))
            .args(["usage", "--tenant", "demo"])
            .args(args)
            .env("FACEGATE_URL", format!("http://{addr}"))
            .env("FACEGATE_ADMIN_TOKEN", ADMIN_TOKEN)
            .env_remove("FACEGATE_KEY")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(output.status.success(), "facegate usage {args:?}: {stdout}{}", String::from_utf8_lossy(&output.stderr));
        stdout
    };
    let by_day = csv_rows(&cli(&["--by", "day", "--csv"]));
    assert!(!by_day.is_empty() && by_day.iter().all(|r| r["start_ms"].as_str().unwrap().parse::<i64>().unwrap() % 86_400_000 == 0));
    assert_eq!((csv_sum(&by_day, "requests_2xx"), csv_sum(&by_day, "requests_4xx")), (3, 2), "{by_day:?}");
    for by in ["minute", "hour", "day"] {
        let report: Value = serde_json::from_str(&cli(&["--by", by, "--json"])).unwrap();
        assert_eq!(report["by"], by, "{report}");
        let period = match by {
            "minute" => 60_000,
            "hour" => 3_600_000,
            _ => 86_400_000,
        };
        assert!(report["rows"].as_array().unwrap().iter().all(|r| r["start_ms"].as_i64().unwrap() % period == 0), "{report}");
        assert_eq!(field(&total(&report), "requests_2xx"), 3, "{report}");
    }
    let table = cli(&["--by", "day"]);
    assert!(table.lines().any(|l| l.contains("demo/detect@1")), "a table row of demo/detect: {table}");
    assert!(table.lines().any(|l| l.contains("on centerface-int8:") && l.ends_with(" 1 calls")), "each model's part: {table}");
    let refused = anonymous().get(format!("http://{addr}/admin/v1/usage?by=week")).bearer_auth(ADMIN_TOKEN).send().unwrap();
    assert_eq!(refused.status(), 400);
    assert_eq!(anonymous().get(format!("http://{addr}/admin/v1/usage")).send().unwrap().status(), 401);
}

/// Each model's part of a usage report, summed over its rows: device µs and calls.
fn model_parts(report: &Value) -> std::collections::BTreeMap<String, (u64, u64)> {
    let mut parts = std::collections::BTreeMap::new();
    for row in report["rows"].as_array().unwrap() {
        for (model, part) in row["models"].as_object().unwrap() {
            let sum: &mut (u64, u64) = parts.entry(model.clone()).or_default();
            sum.0 += part["device_us"].as_u64().unwrap();
            sum.1 += part["infer_calls"].as_u64().unwrap();
        }
    }
    parts
}

/// A usage CSV's rows, each by its header's names.
fn csv_rows(csv: &str) -> Vec<serde_json::Map<String, Value>> {
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("a header").split(',').collect();
    let row = |line: &str| header.iter().zip(line.split(',')).map(|(name, value)| ((*name).to_owned(), json!(value))).collect();
    lines.map(row).collect()
}

/// A column of [`csv_rows`] summed.
fn csv_sum(rows: &[serde_json::Map<String, Value>], column: &str) -> u64 {
    rows.iter().map(|r| r[column].as_str().unwrap().parse::<u64>().unwrap()).sum()
}

/// Creates tenant `t` with the detect handler as `h` through `node`; its key.
fn tenant_t(node: &Server) -> String {
    node.json(node.admin(Method::POST, "tenants").json(&json!({ "name": "t" })));
    let key = node.json(node.admin(Method::POST, "tenants/t/keys"))["key"].as_str().unwrap().to_owned();
    node.json(node.admin(Method::PUT, "tenants/t/handlers/h").body(std::fs::read(guest("detect")).unwrap()));
    key
}

/// `n` requests of t/h on `node`, each answered 200 by a version.
fn calls(node: &Server, key: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut done = 0;
    while done < n {
        // A node that has not yet loaded the handler answers 404.
        match node.call(key) {
            (200, Some(_)) => done += 1,
            (404, _) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            other => panic!("t/h answered {other:?}"),
        }
    }
}

#[test]
fn nodes_sum_on_postgres_and_a_killed_node_never_counts_twice() {
    let pg = ThrowawayPostgres::start().unwrap();
    let url = pg.url();
    let args = ["--store", url.as_str(), "--usage-flush-ms", FLUSH_MS];
    let (a_data, b_data) = (harness::fresh_dir("usage-node-a"), harness::fresh_dir("usage-node-b"));
    let a = Server::start_with(&a_data, &[&args[..], &["--node-id", "a"]].concat());
    let b = Server::start_with(&b_data, &[&args[..], &["--node-id", "b"]].concat());
    let key = tenant_t(&a);
    calls(&a, &key, 3);
    calls(&b, &key, 2);
    let report = |node: &Server| node.json(node.admin(Method::GET, "usage?tenant=t&by=day"));
    let both = until_requests(5, || report(&a));
    assert_eq!(field(&both, "requests_2xx"), 5, "both nodes' requests, summed: {both}");
    assert_eq!(total(&report(&b)), both, "every node reads the same sum");

    // Two more on b, surely written (ten flush intervals), then one that
    // b may not have written when it is killed.
    calls(&b, &key, 2);
    assert_eq!(field(&until_requests(7, || report(&a)), "requests_2xx"), 7);
    calls(&b, &key, 1);
    b.kill();
    let b = Server::start_with(&b_data, &[&args[..], &["--node-id", "b"]].concat());
    calls(&b, &key, 2);
    std::thread::sleep(Duration::from_millis(10 * FLUSH_MS.parse::<u64>().unwrap()));
    let after = field(&until_requests(9, || report(&a)), "requests_2xx");
    assert!((9..=10).contains(&after), "10 requests answered, at most the last before the kill lost, none counted twice: {after}");
}
