//! The web console in a real headless Chromium, driven over WebDriver
//! (Debian's `chromium` and `chromium-driver`; `deploy/test.sh` installs
//! them). Each test saves a screenshot under `target/screenshots/`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};

use crate::harness::{ADMIN_TOKEN, client, client_with_key, gateway, guest, image, key, url};

/// W3C WebDriver's element reference key.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// Longest wait for the page to reach a state.
const WAIT: Duration = Duration::from_secs(20);

/// A chromedriver process and one browser session in it.
struct Browser {
    driver: Child,
    base: String,
    http: reqwest::blocking::Client,
}

impl Browser {
    /// Starts chromedriver on a free port and a headless Chromium session.
    fn start(width: u32, height: u32) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let program = std::env::var("FACEGATE_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
        let driver = Command::new(&program)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{program}: {e} (deploy/test.sh installs chromium-driver)"));
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        let mut browser = Self { driver, base: format!("http://127.0.0.1:{port}"), http };
        let started = Instant::now();
        while browser.http.get(format!("{}/status", browser.base)).send().is_err() {
            assert!(started.elapsed() < WAIT, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut options = json!({ "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", format!("--window-size={width},{height}")] });
        // Desktop windows are at least 500 px wide: a phone's width is emulated.
        if width < 500 {
            options["mobileEmulation"] = json!({ "deviceMetrics": { "width": width, "height": height, "pixelRatio": 1 } });
        }
        if Path::new("/usr/bin/chromium").exists() {
            options["binary"] = json!("/usr/bin/chromium");
        }
        let capabilities = json!({ "capabilities": { "alwaysMatch": { "browserName": "chrome", "goog:chromeOptions": options } } });
        let session = browser.call(reqwest::Method::POST, "session", Some(capabilities));
        browser.base = format!("{}/session/{}", browser.base, session["sessionId"].as_str().expect("a session id"));
        browser
    }

    /// One WebDriver command; returns its `value`.
    fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let request = self.http.request(method, format!("{}/{path}", self.base));
        let request = if let Some(body) = body { request.json(&body) } else { request };
        let answer: Value = request.send().expect("webdriver answers").json().expect("webdriver JSON");
        assert!(answer["value"]["error"].is_null(), "webdriver {path}: {answer}");
        answer["value"].clone()
    }

    fn open(&self, path: &str) {
        self.call(reqwest::Method::POST, "url", Some(json!({ "url": url(path) })));
    }

    fn find(&self, css: &str) -> String {
        let found = self.call(reqwest::Method::POST, "element", Some(json!({ "using": "css selector", "value": css })));
        found[ELEMENT].as_str().expect("an element").to_owned()
    }

    /// Types into the element (for a file input: the file's path).
    fn type_into(&self, css: &str, text: &str) {
        let id = self.find(css);
        self.call(reqwest::Method::POST, &format!("element/{id}/clear"), Some(json!({})));
        self.call(reqwest::Method::POST, &format!("element/{id}/value"), Some(json!({ "text": text })));
    }

    fn attach(&self, css: &str, file: &Path) {
        let id = self.find(css);
        let file = file.canonicalize().unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        self.call(reqwest::Method::POST, &format!("element/{id}/value"), Some(json!({ "text": file.to_str().unwrap() })));
    }

    fn click(&self, css: &str) {
        let id = self.find(css);
        self.call(reqwest::Method::POST, &format!("element/{id}/click"), Some(json!({})));
    }

    /// Runs `body` (a function body) in the page; returns what it returns.
    fn script(&self, body: &str) -> Value {
        self.call(reqwest::Method::POST, "execute/sync", Some(json!({ "script": body, "args": [] })))
    }

    /// Waits until `expression` is truthy in the page; returns its value.
    fn wait_for(&self, expression: &str) -> Value {
        let started = Instant::now();
        loop {
            let value = self.script(&format!("return ({expression}) || null;"));
            if !value.is_null() && value != json!(false) {
                return value;
            }
            assert!(
                started.elapsed() < WAIT,
                "timed out waiting for {expression}; status: {}",
                self.script("return document.querySelector('[role=status]:not(:empty)')?.textContent ?? '';")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Saves a PNG screenshot as `target/screenshots/<name>.png`.
    fn screenshot(&self, name: &str) -> PathBuf {
        let png = base64::engine::general_purpose::STANDARD
            .decode(self.call(reqwest::Method::GET, "screenshot", None).as_str().unwrap())
            .unwrap();
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap().join("screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        path
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.http.delete(&self.base).send();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images").join(name)
}

/// A tenant's view: the demo key lists its handlers, a photo's faces are
/// drawn (as many as the API finds), and a wrong key and a non-image are
/// explained.
#[test]
fn try_it_draws_the_faces_and_explains_errors() {
    gateway();
    let browser = Browser::start(1280, 1100);
    browser.open("/");
    let headers = client().get(url("/")).send().unwrap().headers().clone();
    assert!(headers["content-security-policy"].to_str().unwrap().contains("script-src 'self'"));

    browser.type_into("#key", &key("demo"));
    browser.click("#load-handlers");
    browser.wait_for("[...document.getElementById('handler').options].some(o => o.value === 'detect')");
    browser.script("document.getElementById('handler').value = 'detect';");
    browser.attach("#image", &fixture("city.jpg"));
    browser.click("#run");
    let drawn = browser.wait_for("window.facegateConsole.runs >= 1 && document.getElementById('canvas').dataset.faces");
    let expected = client().post(url("/v1/demo/detect")).body(image("city.jpg")).send().unwrap().json::<Value>().unwrap()["faces"]
        .as_array()
        .unwrap()
        .len();
    assert!(expected > 1);
    assert_eq!(drawn, json!(expected.to_string()), "boxes drawn on the canvas");
    assert_eq!(browser.script("return document.querySelectorAll('#faces li').length;"), json!(expected));
    assert!(browser.script("return document.getElementById('timings').textContent;").as_str().unwrap().contains("infer"));
    browser.screenshot("console-try-it");

    // A non-image: the handler's refusal, as the user would read it.
    browser.attach("#image", &guest("detect"));
    browser.click("#run");
    browser.wait_for("window.facegateConsole.lastError === 'unsupported_image'");
    assert!(
        browser.script("return document.getElementById('try-status').textContent;").as_str().unwrap().starts_with("415 unsupported_image")
    );

    // A wrong key.
    browser.type_into("#key", "fg_wrong");
    browser.click("#load-handlers");
    browser.wait_for("window.facegateConsole.lastError === 'unauthorized'");
    let status = browser.script("return document.getElementById('try-status').textContent;");
    assert!(status.as_str().unwrap().contains("401 unauthorized"), "{status}");
}

/// A tenant's own view with its deploy key: it deploys a handler, starts a
/// canary beside it, sees each version's requests and 5xx share and the
/// log tail of requests sent from elsewhere, and promotes the canary.
#[test]
fn a_tenant_deploys_starts_a_canary_and_reads_its_log_tail() {
    gateway();
    let admin = |method: reqwest::Method, path: &str| crate::harness::anonymous().request(method, url(path)).bearer_auth(ADMIN_TOKEN);
    assert_eq!(
        admin(reqwest::Method::POST, "/admin/v1/tenants")
            .json(&json!({ "name": "console-self", "limits": { "rps": 0 } }))
            .send()
            .unwrap()
            .status(),
        201
    );
    let deploy: Value = admin(reqwest::Method::POST, "/admin/v1/tenants/console-self/keys")
        .json(&json!({ "scopes": ["deploy", "read"] }))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let invoke: Value = admin(reqwest::Method::POST, "/admin/v1/tenants/console-self/keys").send().unwrap().json().unwrap();
    // A setting and a secret, which the tenant's view lists (the secret by name only).
    const SECRET: &str = "console-secret-value-91af";
    let set = |name: &str, value: &str, secret: bool| {
        let path = format!("/admin/v1/tenants/console-self/config/{name}");
        assert_eq!(admin(reqwest::Method::PUT, &path).json(&json!({ "value": value, "secret": secret })).send().unwrap().status(), 200);
    };
    set("min_score", "0.7", false);
    set("webhook_token", SECRET, true);
    let browser = Browser::start(1280, 1600);
    browser.open("/");
    browser.click("#tab-mine");
    browser.type_into("#mine-key", deploy["key"].as_str().unwrap());
    browser.click("#mine-form button");
    browser.wait_for("!document.getElementById('mine-body').hidden && window.facegateConsole.mine.scopes.includes('deploy')");
    browser.wait_for("document.querySelectorAll('#mine-settings tbody tr').length === 2");
    let settings = browser.script("return [...document.querySelectorAll('#mine-settings tbody tr')].map(r => r.textContent);");
    let shown = settings.to_string();
    assert!(shown.contains("min_score") && shown.contains("0.7") && shown.contains("webhook_token"), "{shown}");
    let page = browser.script("return document.documentElement.outerHTML;").to_string();
    assert!(!page.contains(SECRET), "the console page never holds a secret's value");

    browser.type_into("#mine-name", "faces");
    browser.attach("#mine-file", &guest("detect"));
    browser.click("#mine-upload button");
    browser.wait_for("window.facegateConsole.mine.handlers.faces?.active_version === 1");
    browser.type_into("#mine-canary", "50");
    browser.attach("#mine-file", &guest("blur"));
    browser.click("#mine-upload button");
    browser.wait_for("window.facegateConsole.mine.handlers.faces?.canary?.version === 2");

    let key = invoke["key"].as_str().unwrap();
    let mut ids = Vec::new();
    for _ in 0..12 {
        let response = client_with_key(key).post(url("/v1/console-self/faces")).body(image("grace_hopper.jpg")).send().unwrap();
        assert_eq!(response.status(), 200);
        ids.push(response.headers()["x-request-id"].to_str().unwrap().to_owned());
    }
    // The log tail shows the requests, and the table each version's share of them.
    let last = ids.last().unwrap();
    browser.wait_for(&format!("[...document.querySelectorAll('#mine-log td')].some(td => td.textContent === '{last}')"));
    let counted = browser.wait_for(
        "(() => { const rows = [...document.querySelectorAll('.mine-handler[data-handler=faces] tbody tr')];
           const n = rows.map(r => Number(r.children[2].textContent)); return n.length === 2 && n[0] + n[1] === 12 ? n : null; })()",
    );
    assert_eq!(counted.as_array().map(Vec::len), Some(2), "the active version and the canary: {counted}");
    let roles =
        browser.script("return [...document.querySelectorAll('.mine-handler[data-handler=faces] tbody tr')].map(r => r.dataset.role);");
    assert_eq!(roles, json!(["active", "canary"]));
    let sources = browser
        .script("return [...document.querySelectorAll('.mine-handler[data-handler=faces] tbody tr')].map(r => r.lastChild.textContent);");
    assert_eq!(sources, json!(["upload", "upload"]), "each version says where it came from");
    // The plots: the hour's requests by status, device time, and the handler's mean latency.
    let plotted = browser.wait_for(
        "(() => { const n = [...document.querySelectorAll('#mine-usage rect[data-status=ok]')].reduce((n, r) => n + Number(r.dataset.requests), 0);
           return n === 12 ? n : null; })()",
    );
    assert_eq!(plotted, json!(12), "every request in the requests plot");
    let device =
        browser.script("return [...document.querySelectorAll('#mine-device rect')].reduce((n, r) => n + Number(r.dataset.deviceMs), 0);");
    assert!(device.as_f64().unwrap() > 0.0, "device time plotted: {device}");
    let latency =
        browser.script("return [...document.querySelectorAll('#mine-latency circle[data-handler=faces]')].map(c => Number(c.dataset.ms));");
    let latency: Vec<f64> = serde_json::from_value(latency).unwrap();
    assert!(!latency.is_empty() && latency.iter().all(|&ms| ms > 0.0 && ms < 60_000.0), "the handler's latency: {latency:?}");
    let legend = browser.script("return [...document.querySelectorAll('#mine-latency-legend li')].map(l => l.dataset.handler);");
    assert_eq!(legend, json!(["faces"]));
    browser.screenshot("console-tenant-canary");

    browser.script("[...document.querySelectorAll('.mine-handler button')].find(b => b.textContent === 'Promote canary').click();");
    browser
        .wait_for("window.facegateConsole.mine.handlers.faces?.active_version === 2 && !window.facegateConsole.mine.handlers.faces.canary");
    let versions: Value =
        client_with_key(deploy["key"].as_str().unwrap()).get(url("/tenant/v1/handlers/faces/versions")).send().unwrap().json().unwrap();
    assert_eq!((versions["active_version"].as_i64(), versions["canary"].is_null()), (Some(2), true));
}

/// An operator's view: create a tenant and a key, deploy a handler twice,
/// roll back, and see a non-wasm upload refused inline.
#[test]
fn operate_creates_a_tenant_deploys_and_rolls_back() {
    let browser = operator();
    browser.wait_for("!document.getElementById('op-body').hidden && window.facegateConsole.tenants.includes('demo')");

    browser.type_into("#new-tenant", "console-web");
    browser.click("#create-tenant button");
    browser.wait_for("window.facegateConsole.detail === 'console-web' && !document.getElementById('detail').hidden");
    browser.click("#create-key");
    let new_key = browser.wait_for("document.getElementById('new-key-value').textContent");
    let me: Value = client_with_key(new_key.as_str().unwrap()).get(url("/v1/me")).send().unwrap().json().unwrap();
    assert_eq!(me["tenant"], "console-web", "the key shown works");

    for version in [1, 2] {
        browser.type_into("#upload-name", "detect");
        browser.attach("#upload-file", &guest("detect"));
        browser.click("#upload-form button");
        browser.wait_for(&format!("window.facegateConsole.versions.detect?.active === {version}"));
    }
    browser.script("[...document.querySelectorAll('#handlers button')].find(b => b.textContent === 'Roll back detect').click();");
    browser
        .wait_for("window.facegateConsole.versions.detect?.active === 1 && window.facegateConsole.versions.detect.versions.length === 2");
    let versions: Value = client_with_key(new_key.as_str().unwrap()).get(url("/v1/me")).send().unwrap().json().unwrap();
    assert_eq!(versions["handlers"], json!([{ "name": "detect", "version": 1 }]));

    browser.attach("#upload-file", &fixture("grace_hopper.jpg"));
    browser.click("#upload-form button");
    browser.wait_for("document.getElementById('upload-status').className === 'error'");
    let refusal = browser.script("return document.getElementById('upload-status').textContent;");
    assert!(refusal.as_str().unwrap().starts_with("400 invalid: not a WebAssembly binary"), "{refusal}");
    // The live view refreshes by itself: requests sent from elsewhere show
    // in the open tenant's count, with no click.
    let shown =
        "Number([...document.querySelectorAll('#live dt')].find(d => d.textContent === 'requests')?.nextElementSibling.textContent ?? 0)";
    let before = browser.script(&format!("return {shown};")).as_u64().unwrap();
    for _ in 0..2 {
        let response = client_with_key(new_key.as_str().unwrap()).post(url("/v1/console-web/detect")).body(image("grace_hopper.jpg"));
        assert_eq!(response.send().unwrap().status(), 200);
    }
    browser.wait_for(&format!("{shown} >= {}", before + 2));
    // The usage section catches up with what the gateway wrote since (it
    // looks again every 10 s): the two requests, and their device time.
    browser.wait_for("window.facegateConsole.usage?.requests >= 2 && window.facegateConsole.usage.device > 0");
    browser.screenshot("console-operate");
}

/// A browser on the shared gateway's console, connected to Operate with the admin token.
fn operator() -> Browser {
    gateway();
    let browser = Browser::start(1280, 1400);
    browser.open("/");
    browser.click("#tab-operate");
    browser.type_into("#admin-token", ADMIN_TOKEN);
    browser.click("#admin-form button");
    browser
}

/// The operate view lists the node's models (`centerface` pinned), adds
/// one to the repository through its form (the accuracy gate runs; a file
/// that is no model is refused with the gate's words) and removes it.
#[test]
fn operate_lists_adds_and_removes_models() {
    let browser = operator();
    browser.wait_for("window.facegateConsole.models.includes('centerface')");
    let pinned = browser.script("return [...document.querySelectorAll('#models tbody tr')].find(r => r.cells[0].textContent === 'centerface').cells[2].textContent;");
    assert_eq!(pinned, "yes, pinned");

    browser.type_into("#model-name", "junk-web");
    browser.attach("#model-file", &fixture("grace_hopper.jpg"));
    browser.click("#add-model button");
    browser.wait_for("document.getElementById('model-status').className === 'error'");
    let refusal = browser.script("return document.getElementById('model-status').textContent;");
    assert!(refusal.as_str().unwrap().contains("does not load as an ONNX model"), "{refusal}");

    browser.type_into("#model-name", "int8-web");
    browser.attach("#model-file", &crate::harness::facegate_home().join("models/centerface-int8.onnx"));
    browser.click("#add-model button");
    browser.wait_for("window.facegateConsole.models.includes('int8-web')");
    let version = browser.script(
        "return [...document.querySelectorAll('#models tbody tr')].find(r => r.cells[0].textContent === 'int8-web').cells[5].textContent;",
    );
    let version = version.as_str().unwrap();
    assert!(version.starts_with("v1, found ") && version.ends_with(" of 16"), "{version}");
    browser.script("window.confirm = () => true; document.querySelector('#models button[aria-label=\"Remove model int8-web\"]').click();");
    browser.wait_for("!window.facegateConsole.models.includes('int8-web')");
}

/// At a phone's 375 px nothing needs horizontal scrolling, and every
/// control has a label.
#[test]
fn the_console_fits_a_phone_and_labels_its_controls() {
    gateway();
    let browser = Browser::start(375, 800);
    browser.open("/");
    assert_eq!(browser.script("return window.innerWidth;"), json!(375));
    let overflow = browser.script("return document.documentElement.scrollWidth - document.documentElement.clientWidth;");
    assert!(overflow.as_i64().unwrap() <= 0, "scrolls sideways by {overflow} px");
    let unlabelled = browser.script(
        "return [...document.querySelectorAll('input, select')].filter(e => !e.closest('label') && !e.getAttribute('aria-label')).map(e => e.id);",
    );
    assert_eq!(unlabelled, json!([]), "controls without a label");
    browser.screenshot("console-phone");
}
