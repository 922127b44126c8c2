//! Handlers in Python and JavaScript: the examples in guests/python and
//! guests/js are built from source with the project's build commands
//! (deploy/scripts/build-python.sh, build-js.sh), deployed through the admin
//! API — the gateway links the pipeline component into them — and called.
//! They find the faces the Rust `detect` finds, refuse bad input with the
//! Rust example's statuses and JSON, and are stopped like Rust handlers when
//! they loop or grow memory without bound (on a gateway of their own,
//! isolation.rs's `Attacked`), and get no network.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};

use crate::bad_input::{jpeg_claiming, png_claiming};
use crate::harness::{REQUEST_TIMEOUT_MS, admin, admin_json, client_with_key, fresh_dir, guest, image, install, root, url};
use crate::isolation::{Attacked, one_instance_bound, prepare};

const LANGUAGES: [(&str, &str); 2] = [("python", "py"), ("js", "js")];

/// Builds `guests/<language>/<example>` once per test run; returns the component and how long the build took.
pub(crate) fn built(language: &str, example: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let key = format!("{language}-{example}");
    let mut built = BUILT.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(path) = built.get(&key) {
        return path.clone();
    }
    let out = crate::harness::scratch_dir("scripts").join(format!("{key}.wasm"));
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let script = root().join(format!("deploy/scripts/build-{language}.sh"));
    let started = Instant::now();
    let output = Command::new(&script).arg(root().join("guests").join(language).join(example)).arg(&out).output().unwrap();
    assert!(
        output.status.success(),
        "{} failed:\n{}\n{}",
        script.display(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!("built {key}: {} KiB in {:?}", std::fs::metadata(&out).unwrap().len() >> 10, started.elapsed());
    built.insert(key, out.clone());
    out
}

/// Tenant `scripts` (created once, with a key), serving the built examples as `<example>-<suffix>`.
fn deployed(language: &str, suffix: &str, example: &str) -> String {
    static KEY: OnceLock<String> = OnceLock::new();
    let key = KEY.get_or_init(|| {
        let (status, body) = admin_json(admin(Method::POST, "tenants").json(&json!({ "name": "scripts" })));
        assert!(status == 201 || status == 409, "{status} {body}");
        let (status, body) = admin_json(admin(Method::POST, "tenants/scripts/keys"));
        assert_eq!(status, 201, "{body}");
        body["key"].as_str().unwrap().to_owned()
    });
    static DEPLOYED: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    let handler = format!("{example}-{suffix}");
    let mut deployed = DEPLOYED.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if !deployed.contains(&handler) {
        let bytes = std::fs::read(built(language, example)).unwrap();
        let started = Instant::now();
        let (status, body) = admin_json(admin(Method::PUT, &format!("tenants/scripts/handlers/{handler}")).body(bytes));
        assert_eq!(status, 201, "deploying {handler}: {body}");
        eprintln!("deployed {handler} ({} KiB linked) in {:?}", body["size"].as_u64().unwrap_or(0) >> 10, started.elapsed());
        deployed.push(handler);
    }
    key.clone()
}

fn call(key: &str, handler: &str, method: Method, query: &str, body: Vec<u8>) -> (u16, Vec<(String, String)>, Vec<u8>) {
    call_as(key, handler, method, query, body, None)
}

/// [`call`] with a `Content-Type`.
fn call_as(
    key: &str,
    handler: &str,
    method: Method,
    query: &str,
    body: Vec<u8>,
    content_type: Option<&str>,
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut request = client_with_key(key).request(method, url(&format!("/v1/{handler}?{query}"))).body(body);
    if let Some(content_type) = content_type {
        request = request.header("content-type", content_type);
    }
    let response = request.send().unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().iter().map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap_or_default().to_owned())).collect();
    (status, headers, response.bytes().unwrap().to_vec())
}

fn boxes(body: &[u8]) -> Vec<[f64; 4]> {
    let json: Value = serde_json::from_slice(body).unwrap();
    json["faces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let v: Vec<f64> = f["box"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            [v[0], v[1], v[2], v[3]]
        })
        .collect()
}

fn iou(a: &[f64; 4], b: &[f64; 4]) -> f64 {
    let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let area = |r: &[f64; 4]| (r[2] - r[0]) * (r[3] - r[1]);
    w * h / (area(a) + area(b) - w * h)
}

/// A `multipart/form-data` body with one file field: `(content type, body)`.
fn multipart(field: &str, bytes: &[u8]) -> (String, Vec<u8>) {
    const BOUNDARY: &str = "facegate-test-boundary";
    let mut body =
        format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"a.jpg\"\r\nContent-Type: image/jpeg\r\n\r\n")
            .into_bytes();
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={BOUNDARY}"), body)
}

fn rust_key() -> String {
    crate::harness::key("demo")
}

#[test]
fn python_and_javascript_detect_find_the_faces_the_rust_detect_finds() {
    for (language, suffix) in LANGUAGES {
        let key = deployed(language, suffix, "detect");
        for name in ["grace_hopper.jpg", "city.jpg", "astronaut.png"] {
            let (status, _, rust) = call(&rust_key(), "demo/detect", Method::POST, "", image(name));
            assert_eq!(status, 200);
            let (status, headers, script) = call(&key, &format!("scripts/detect-{suffix}"), Method::POST, "", image(name));
            assert_eq!(status, 200, "{language} {name}: {}", String::from_utf8_lossy(&script));
            assert!(headers.iter().any(|(n, v)| n == "content-type" && v == "application/json"), "{headers:?}");
            let (want, got) = (boxes(&rust), boxes(&script));
            assert_eq!(got.len(), want.len(), "{language} {name}: same count");
            for b in &want {
                let best = got.iter().map(|g| iou(b, g)).fold(0.0, f64::max);
                assert!(best >= 0.9, "{language} {name}: {b:?} best IoU {best}");
            }
        }
        // The same photo as a form's `image` field.
        let (content_type, form) = multipart("image", &image("grace_hopper.jpg"));
        let (status, _, rust) = call_as(&rust_key(), "demo/detect", Method::POST, "", form.clone(), Some(&content_type));
        let (script_status, _, script) = call_as(&key, &format!("scripts/detect-{suffix}"), Method::POST, "", form, Some(&content_type));
        assert_eq!((status, script_status), (200, 200), "{language} multipart: {}", String::from_utf8_lossy(&script));
        assert_eq!(boxes(&script).len(), boxes(&rust).len(), "{language} multipart: same count");
    }
}

#[test]
fn python_and_javascript_blur_answer_as_the_rust_blur() {
    for (language, suffix) in LANGUAGES {
        let key = deployed(language, suffix, "blur");
        let (status, rust_headers, rust_body) = call(&rust_key(), "demo/blur", Method::POST, "", image("city.jpg"));
        assert_eq!(status, 200);
        let (status, headers, body) = call(&key, &format!("scripts/blur-{suffix}"), Method::POST, "", image("city.jpg"));
        assert_eq!(status, 200, "{language}: {}", String::from_utf8_lossy(&body));
        let header = |h: &[(String, String)], name: &str| h.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        assert_eq!(header(&headers, "content-type").as_deref(), Some("image/jpeg"));
        assert_eq!(header(&headers, "x-faces"), header(&rust_headers, "x-faces"), "{language}: as many faces blurred");
        // The same picture as Rust's: the faces blurred in the same places.
        let (rust, script) = (rgb(&rust_body), rgb(&body));
        assert_eq!(script.dimensions(), rust.dimensions(), "{language}: the size of Rust's");
        let differs = mean_abs_diff(&rust, &script);
        assert!(differs < 0.5, "{language}'s blurred picture differs from Rust's by {differs:.3} levels a byte");
    }
}

/// A JPEG or PNG decoded to RGB.
fn rgb(bytes: &[u8]) -> image::RgbImage {
    image::load_from_memory(bytes).expect("an image").to_rgb8()
}

/// Mean absolute difference of two images of one size, in levels a byte.
fn mean_abs_diff(a: &image::RgbImage, b: &image::RgbImage) -> f64 {
    let total: u64 = a.as_raw().iter().zip(b.as_raw()).map(|(x, y)| u64::from(x.abs_diff(*y))).sum();
    total as f64 / a.as_raw().len() as f64
}

#[test]
fn bad_input_gets_the_rust_statuses_and_json() {
    let truncated = image("grace_hopper.jpg")[..2000].to_vec();
    let cases: Vec<(&str, Method, &str, Vec<u8>)> = vec![
        ("empty body", Method::POST, "", Vec::new()),
        ("not an image", Method::POST, "", b"hello, this is text".to_vec()),
        ("truncated JPEG", Method::POST, "", truncated),
        ("bad threshold", Method::POST, "threshold=7", image("grace_hopper.jpg")),
        ("bad size", Method::POST, "size=100", image("grace_hopper.jpg")),
        ("bad max_faces", Method::POST, "max_faces=0", image("grace_hopper.jpg")),
        ("PNG header claiming 30000×30000", Method::POST, "", png_claiming(30_000, 30_000)),
        ("JPEG header claiming 30000×30000", Method::POST, "", jpeg_claiming(30_000, 30_000)),
        ("multipart without an image field", Method::POST, "", multipart("photo", &image("grace_hopper.jpg")).1),
        ("GET", Method::GET, "", Vec::new()),
    ];
    for (language, suffix) in LANGUAGES {
        let key = deployed(language, suffix, "detect");
        for (what, method, query, body) in &cases {
            let content_type = what.starts_with("multipart").then(|| multipart("photo", &[]).0);
            let rust_call = || call_as(&rust_key(), "demo/detect", method.clone(), query, body.clone(), content_type.as_deref());
            let (rust_status, rust_headers, rust_body) = rust_call();
            let script = format!("scripts/detect-{suffix}");
            let (status, headers, script_body) = call_as(&key, &script, method.clone(), query, body.clone(), content_type.as_deref());
            assert!(rust_status >= 400, "{what}: {rust_status}");
            assert_eq!(status, rust_status, "{language} {what}: {}", String::from_utf8_lossy(&script_body));
            assert_eq!(
                serde_json::from_slice::<Value>(&script_body).unwrap()["error"],
                serde_json::from_slice::<Value>(&rust_body).unwrap()["error"],
                "{language} {what}: the same code and message"
            );
            let allow = |h: &[(String, String)]| h.iter().find(|(n, _)| n == "allow").map(|(_, v)| v.clone());
            assert_eq!(allow(&headers), allow(&rust_headers), "{language} {what}");
        }
    }
}

/// A prepared data directory (isolation.rs's [`prepare`]) where tenant
/// `scripts` serves the Python and JavaScript hostile programs as
/// `hostile-py` and `hostile-js`, beside the neighbour `demo/detect`; and
/// `scripts`'s key. Built and compiled once, for the attacked gateways.
fn hostile_prepared() -> &'static (PathBuf, String) {
    static PREPARED: OnceLock<(PathBuf, String)> = OnceLock::new();
    PREPARED.get_or_init(|| {
        let seed = fresh_dir("scripts-hostile-seed");
        install(&seed, "demo", "detect", &guest("detect"));
        install(&seed, "evil", "attack", &guest("hostile"));
        let mut key = String::new();
        let prepared = prepare("scripts-hostile-prepared", &seed, |server| {
            server.json(server.admin(Method::POST, "tenants").json(&json!({ "name": "scripts" })));
            key = server.json(server.admin(Method::POST, "tenants/scripts/keys"))["key"].as_str().unwrap().to_owned();
            for (language, suffix) in LANGUAGES {
                let bytes = std::fs::read(built(language, "hostile")).unwrap();
                server.json(server.admin(Method::PUT, &format!("tenants/scripts/handlers/hostile-{suffix}")).body(bytes));
            }
        });
        (prepared, key)
    })
}

#[test]
fn runaway_python_and_javascript_handlers_are_stopped() {
    let (prepared, key) = hostile_prepared();
    let gateway = Attacked::start_from(prepared, "scripts-runaway");
    let deadline = Duration::from_millis(REQUEST_TIMEOUT_MS);
    for (language, suffix) in LANGUAGES {
        let url = |query: &str| gateway.url(&format!("/v1/scripts/hostile-{suffix}?{query}"));
        let response = client_with_key(key).post(url("")).send().unwrap();
        let (status, body) = (response.status(), response.text().unwrap());
        assert_eq!(status, 200, "{language}: the hostile program answers when not attacking: {body}");
        for (attack, want_status, want_code) in [("loop", 504, "handler_timeout"), ("memory", 500, "handler_trapped")] {
            let observed = gateway.under_attack(1, || {
                let started = Instant::now();
                let response = client_with_key(key).post(url(&format!("attack={attack}"))).send().unwrap();
                (response.status().as_u16(), response.json::<Value>().unwrap_or(Value::Null), started.elapsed())
            });
            observed.assert_isolated(one_instance_bound());
            let (status, body, elapsed) = observed.attack.into_iter().next().unwrap();
            assert_eq!((status, body["error"]["code"].as_str()), (want_status, Some(want_code)), "{language} {attack}: {body}");
            let message = body["error"]["message"].as_str().unwrap_or_default();
            let why = if attack == "loop" { "did not answer within" } else { "memory limit" };
            assert!(message.contains(why), "{language} {attack}: stopped for the reason a Rust handler is: {body}");
            assert!(elapsed < deadline + Duration::from_secs(2), "{language} {attack}: {elapsed:?}");
            if attack == "loop" {
                assert!(elapsed >= deadline, "{language}: stopped after {elapsed:?}, before the deadline");
            }
        }
    }
}

/// Script handlers get no network. JavaScript's `fetch` (no outgoing-HTTP
/// grant) of the gateway's own port, which is listening, is refused. The
/// Python program calls `wasi:sockets` through its bindings (its
/// `world.wit` imports them): creating a TCP or a UDP socket is denied,
/// and so is a name lookup.
#[test]
fn python_and_javascript_handlers_get_no_network() {
    let (prepared, key) = hostile_prepared();
    let gateway = Attacked::start_from(prepared, "scripts-network");
    let query = format!("attack=network&port={}", gateway.addr().port());
    for (language, suffix) in LANGUAGES {
        let response = client_with_key(key).post(gateway.url(&format!("/v1/scripts/hostile-{suffix}?{query}"))).send().unwrap();
        assert_eq!(response.status(), 200, "{language}");
        let answer: Value = response.json().unwrap();
        eprintln!("{language}: {answer}");
        let outcomes = &answer["outcomes"];
        if language == "python" {
            assert_eq!((&outcomes["tcp"], &outcomes["udp"]), (&json!("access-denied"), &json!("access-denied")), "{answer}");
            let lookup = outcomes["lookup"].as_str().unwrap_or_default();
            assert!(!lookup.is_empty() && lookup != "ok", "the name lookup failed: {answer}");
        } else {
            let fetch = outcomes["fetch"].as_str().unwrap_or_default();
            assert!(
                fetch.starts_with("refused") && fetch.contains("NetworkError"),
                "the fetch was tried and failed on the network: {answer}"
            );
        }
    }
}

/// With warm instances (`instance_reuse` above 1) a Python or JavaScript
/// handler's instance, interpreter state and all, serves request after
/// request and answers each as the first. A gateway of its own, so that
/// its reuse counter counts only these requests.
#[test]
fn warm_python_and_javascript_instances_answer_as_fresh_ones() {
    let data = crate::harness::fresh_dir("scripts-warm");
    let mut config = crate::harness::config(data, None);
    config.limits.instance_reuse = 100;
    let addr = crate::harness::start(config);
    let admin_call = |method: Method, path: &str| {
        crate::harness::anonymous().request(method, format!("http://{addr}/admin/v1/{path}")).bearer_auth(crate::harness::ADMIN_TOKEN)
    };
    let (status, body) = admin_json(admin_call(Method::POST, "tenants").json(&json!({ "name": "warm" })));
    assert_eq!(status, 201, "{body}");
    let (status, body) = admin_json(admin_call(Method::POST, "tenants/warm/keys"));
    assert_eq!(status, 201, "{body}");
    let client = client_with_key(body["key"].as_str().unwrap());
    let reused = || {
        let text = admin_call(Method::GET, "../../metrics").send().unwrap().text().unwrap();
        crate::harness::metric(&text, "facegate_instances_reused_total").unwrap()
    };
    for (language, suffix) in LANGUAGES {
        let handler = format!("detect-{suffix}");
        let bytes = std::fs::read(built(language, "detect")).unwrap();
        let (status, body) = admin_json(admin_call(Method::PUT, &format!("tenants/warm/handlers/{handler}")).body(bytes));
        assert_eq!(status, 201, "{body}");
        let detect = || {
            // The instance goes back just after the response is sent.
            std::thread::sleep(std::time::Duration::from_millis(150));
            let response = client.post(format!("http://{addr}/v1/warm/{handler}")).body(image("grace_hopper.jpg")).send().unwrap();
            assert_eq!(response.status(), 200, "{handler}");
            boxes(&response.bytes().unwrap())
        };
        let before = reused();
        let first = detect();
        assert_eq!(first.len(), 1, "{handler}: {first:?}");
        for _ in 0..3 {
            assert_eq!(detect(), first, "{handler}: a warm instance answers as the first");
        }
        assert_eq!(reused() - before, 3.0, "{handler}: one instance served all four requests");
    }
}

/// The `faces` examples serve `GET /health`, `POST /detect` and `POST /blur`
/// from one component, in each language, under `/v1/{tenant}/{handler}/…`
/// (the guest routes on the path below its mount): the same answers as the
/// one-route examples, a 405 for a wrong method on a route and a 404 JSON
/// error for any other path, the mount itself included.
#[test]
fn one_component_serves_three_routes_in_each_language() {
    let key = deployed("python", "py", "faces");
    deployed("js", "js", "faces");
    let rust = std::fs::read(guest("faces")).unwrap();
    let (status, body) = admin_json(admin(Method::PUT, "tenants/scripts/handlers/faces-rs").body(rust));
    assert!(status == 201, "{body}");
    let (_, _, detected) = call(&rust_key(), "demo/detect", Method::POST, "", image("grace_hopper.jpg"));
    let (_, blur_headers, _) = call(&rust_key(), "demo/blur", Method::POST, "", image("grace_hopper.jpg"));
    let content_type = |headers: &[(String, String)]| headers.iter().find(|(n, _)| n == "content-type").map(|(_, v)| v.clone());
    for handler in ["faces-rs", "faces-py", "faces-js"] {
        let at = |route: &str| format!("scripts/{handler}{route}");
        let (status, _, health) = call(&key, &at("/health"), Method::GET, "", Vec::new());
        assert_eq!((status, serde_json::from_slice::<Value>(&health).unwrap()), (200, json!({ "status": "ok" })), "{handler}");
        let (status, _, faces) = call(&key, &at("/detect"), Method::POST, "", image("grace_hopper.jpg"));
        assert_eq!(status, 200, "{handler}: {}", String::from_utf8_lossy(&faces));
        assert_eq!(boxes(&faces).len(), boxes(&detected).len(), "{handler}: the faces `detect` finds");
        let (status, headers, _) = call(&key, &at("/blur"), Method::POST, "", image("grace_hopper.jpg"));
        assert_eq!((status, content_type(&headers)), (200, content_type(&blur_headers)), "{handler}: `blur`'s answer");
        let (status, headers, _) = call(&key, &at("/detect"), Method::GET, "", Vec::new());
        assert_eq!(status, 405, "{handler}");
        assert!(headers.iter().any(|(n, v)| n == "allow" && v.contains("POST")), "{handler}: {headers:?}");
        for other in ["", "/", "/nope", "/health/"] {
            let (status, _, body) = call(&key, &at(other), Method::GET, "", Vec::new());
            let error: Value = serde_json::from_slice(&body).unwrap_or_default();
            assert_eq!((status, error["error"]["code"].as_str()), (404, Some("not_found")), "{handler} {other:?}: {error}");
        }
    }
}

/// The Python and JavaScript `detect` read the handler's setting
/// `min_score` (through the pipeline component linked into them), as the
/// Rust one does: the next request answers only faces above it.
#[test]
fn python_and_javascript_detect_take_min_score_from_the_handlers_settings() {
    for (language, suffix) in LANGUAGES {
        let key = deployed(language, suffix, "detect");
        let handler = format!("configured-{suffix}");
        let bytes = std::fs::read(built(language, "detect")).unwrap();
        let (status, body) = admin_json(admin(Method::PUT, &format!("tenants/scripts/handlers/{handler}")).body(bytes));
        assert_eq!(status, 201, "{body}");
        let scores = || -> Vec<f64> {
            let (status, _, body) = call(&key, &format!("scripts/{handler}"), Method::POST, "", image("city.jpg"));
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            let body: Value = serde_json::from_slice(&body).unwrap();
            body["faces"].as_array().unwrap().iter().map(|f| f["score"].as_f64().unwrap()).collect()
        };
        let before = scores();
        let setting = admin(Method::PUT, &format!("tenants/scripts/config/min_score?handler={handler}")).json(&json!({ "value": "0.8" }));
        assert_eq!(admin_json(setting).0, 200);
        let after = scores();
        assert_eq!(after.len(), before.iter().filter(|&&s| s > 0.8).count(), "{language}: {before:?} then {after:?}");
        assert!(after.len() < before.len(), "{language}: city.jpg has faces under 0.8: {before:?}");
    }
}

/// The caching examples in Python and JavaScript: the first image is a
/// miss answered as `detect` answers it, the same image again a hit with
/// the same body and no inference; another image is another key.
#[test]
fn python_and_javascript_detect_cached_answer_a_repeated_image_from_state() {
    for (language, suffix) in LANGUAGES {
        let key = deployed(language, suffix, "detect-cached");
        let handler = format!("scripts/detect-cached-{suffix}");
        // The bucket is the tenant's, shared by both languages' handlers (and
        // their keys alike): another size for each, not to find the other's answer.
        let query = if suffix == "py" { "size=320" } else { "size=384" };
        let post = || call(&key, &handler, Method::POST, query, image("city.jpg"));
        let (status, headers, first) = post();
        assert_eq!(status, 200, "{language}: {}", String::from_utf8_lossy(&first));
        let cache = |headers: &[(String, String)]| headers.iter().find(|(n, _)| n == "x-facegate-cache").map(|(_, v)| v.clone());
        assert_eq!(cache(&headers).as_deref(), Some("miss"), "{language}");
        let (status, headers, second) = post();
        assert_eq!((status, cache(&headers).as_deref()), (200, Some("hit")), "{language}");
        assert_eq!(second, first, "{language}: the same answer");
        let plain = call(&rust_key(), "demo/detect", Method::POST, query, image("city.jpg"));
        assert_eq!(boxes(&first).len(), boxes(&plain.2).len(), "{language}: detect's faces");
        // Another image, another key.
        let (_, headers, _) = call(&key, &handler, Method::POST, query, image("grace_hopper.jpg"));
        assert_eq!(cache(&headers).as_deref(), Some("miss"), "{language}");
    }
}
