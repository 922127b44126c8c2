//! Tenants serve themselves: scoped keys (`invoke`, `deploy`, `read`) and
//! the tenant API under `/tenant/v1/`, through HTTP and the CLI. A key
//! reaches its own tenant only, and only as far as its scopes say.

use reqwest::Method;
use reqwest::blocking::Response;
use serde_json::{Value, json};

use crate::harness::{ADMIN_TOKEN, anonymous, client_with_key, gateway, guest, image, url};

/// Creates `tenant` and a key of each scope set in `scopes`; their keys, in order.
fn tenant_with_keys(tenant: &str, scopes: &[&[&str]]) -> Vec<(String, String)> {
    let admin = |method: Method, path: String, body: Value| {
        anonymous().request(method, url(&path)).bearer_auth(ADMIN_TOKEN).json(&body).send().unwrap()
    };
    let created = admin(Method::POST, "/admin/v1/tenants".into(), json!({ "name": tenant, "limits": { "rps": 0 } }));
    assert_eq!(created.status(), 201);
    scopes
        .iter()
        .map(|scopes| {
            let key: Value = admin(Method::POST, format!("/admin/v1/tenants/{tenant}/keys"), json!({ "scopes": scopes })).json().unwrap();
            assert_eq!(key["scopes"], json!(scopes), "{key}");
            (key["key"].as_str().unwrap().to_owned(), key["id"].as_str().unwrap().to_owned())
        })
        .collect()
}

/// A tenant API call with `key`.
fn tenant_call(key: &str, method: Method, path: &str, body: Vec<u8>) -> Response {
    client_with_key(key).request(method, url(&format!("/tenant/v1/{path}"))).body(body).send().unwrap()
}

fn status_and_code(response: Response) -> (u16, String) {
    let status = response.status().as_u16();
    let body: Value = response.json().unwrap_or(Value::Null);
    (status, body["error"]["code"].as_str().unwrap_or_default().to_owned())
}

fn detect(key: &str, tenant: &str, handler: &str) -> Response {
    client_with_key(key).post(url(&format!("/v1/{tenant}/{handler}"))).body(image("grace_hopper.jpg")).send().unwrap()
}

/// A `deploy` key uploads, activates and rolls back its own tenant's
/// handler, and manages its `invoke` keys; it does not invoke, and reaches
/// no other tenant's handler (the same 404 as a missing one).
#[test]
fn a_deploy_key_manages_its_own_handlers_and_invoke_keys() {
    let keys = tenant_with_keys("selfserve", &[&["deploy"], &["invoke"]]);
    let ((deploy, deploy_id), (invoke, _)) = (keys[0].clone(), keys[1].clone());
    let _ = gateway();
    let upload = |file: &str| tenant_call(&deploy, Method::PUT, "handlers/faces", std::fs::read(guest(file)).unwrap());
    let first: Value = upload("detect").json().unwrap();
    assert_eq!((first["version"].as_i64(), first["active_version"].as_i64()), (Some(1), Some(1)), "{first}");
    let answer = detect(&invoke, "selfserve", "faces");
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["x-facegate-handler-version"], "1");
    assert_eq!(upload("blur").status(), 201);
    assert_eq!(detect(&invoke, "selfserve", "faces").headers()["content-type"], "image/jpeg", "version 2, the blur, answers");
    let versions: Value = tenant_call(&deploy, Method::GET, "handlers/faces/versions", Vec::new()).json().unwrap();
    assert_eq!(versions["versions"].as_array().map(Vec::len), Some(2), "{versions}");
    let rolled: Value = tenant_call(&deploy, Method::POST, "handlers/faces/rollback", Vec::new()).json().unwrap();
    assert_eq!(rolled["active_version"], 1, "{rolled}");
    let activated = tenant_call(&deploy, Method::POST, "handlers/faces/activate", json!({ "version": 2 }).to_string().into_bytes());
    assert_eq!(activated.json::<Value>().unwrap()["active_version"], 2);
    assert_eq!(detect(&invoke, "selfserve", "faces").headers()["x-facegate-handler-version"], "2");

    assert_eq!(status_and_code(detect(&deploy, "selfserve", "faces")), (403, "forbidden".into()), "a deploy key does not invoke");
    // demo's handler `detect` is not this tenant's: the same answer as a missing handler.
    let other = status_and_code(tenant_call(&deploy, Method::GET, "handlers/detect/versions", Vec::new()));
    let missing = status_and_code(tenant_call(&deploy, Method::GET, "handlers/nosuch/versions", Vec::new()));
    assert_eq!(other, missing);
    assert_eq!(other.0, 404);
    let listed: Value = tenant_call(&deploy, Method::GET, "handlers", Vec::new()).json().unwrap();
    assert_eq!(listed["tenant"], "selfserve");
    assert_eq!(listed["handlers"].as_array().map(Vec::len), Some(1), "its own handler only: {listed}");

    // Its invoke keys: made, used, revoked.
    let made: Value = tenant_call(&deploy, Method::POST, "keys", Vec::new()).json().unwrap();
    assert_eq!(made["scopes"], json!(["invoke"]), "{made}");
    let new_key = made["key"].as_str().unwrap();
    assert_eq!(detect(new_key, "selfserve", "faces").status(), 200);
    let revoked = tenant_call(&deploy, Method::DELETE, &format!("keys/{}", made["id"].as_str().unwrap()), Vec::new());
    assert_eq!(revoked.status(), 200);
    assert_eq!(detect(new_key, "selfserve", "faces").status(), 401, "revoked at once on this node");
    let wider = tenant_call(&deploy, Method::POST, "keys", json!({ "scopes": ["deploy"] }).to_string().into_bytes());
    assert_eq!(status_and_code(wider), (403, "forbidden".into()), "a tenant makes invoke keys only");
    let own = tenant_call(&deploy, Method::DELETE, &format!("keys/{deploy_id}"), Vec::new());
    assert_eq!(status_and_code(own), (403, "forbidden".into()), "nor revokes a deploy key");

    // A canary of its own, promoted.
    let wasm = std::fs::read(guest("detect")).unwrap();
    let canary: Value = tenant_call(&deploy, Method::PUT, "handlers/faces?canary=50", wasm).json().unwrap();
    assert_eq!((canary["version"].as_i64(), canary["active_version"].as_i64()), (Some(3), Some(2)), "{canary}");
    let promoted: Value = tenant_call(&deploy, Method::POST, "handlers/faces/promote", Vec::new()).json().unwrap();
    assert_eq!(promoted["active_version"], 3, "{promoted}");
    let after: Value = tenant_call(&deploy, Method::GET, "handlers/faces/versions", Vec::new()).json().unwrap();
    assert!(after["canary"].is_null(), "promoting ends the canary: {after}");

    // The operator revokes the deploy key: refused from then on.
    let revoke = anonymous().delete(url(&format!("/admin/v1/tenants/selfserve/keys/{deploy_id}"))).bearer_auth(ADMIN_TOKEN).send().unwrap();
    assert_eq!(revoke.status(), 200);
    assert_eq!(status_and_code(upload("detect")), (401, "unauthorized".into()));
}

/// An `invoke` key gets 403 on every management call, a `read` key reads
/// but changes nothing, and a wrong key gets 401.
#[test]
fn each_scope_opens_its_own_calls_only() {
    let keys = tenant_with_keys("scoped", &[&["invoke"], &["read"], &["deploy"]]);
    let (invoke, read, deploy) = (&keys[0].0, &keys[1].0, &keys[2].0);
    let wasm = std::fs::read(guest("detect")).unwrap();
    assert_eq!(tenant_call(deploy, Method::PUT, "handlers/faces", wasm.clone()).status(), 201);
    let calls: [(Method, &str, Vec<u8>); 11] = [
        (Method::GET, "handlers", Vec::new()),
        (Method::GET, "handlers/faces/versions", Vec::new()),
        (Method::PUT, "handlers/faces", wasm.clone()),
        (Method::POST, "handlers/faces/rollback", Vec::new()),
        (Method::POST, "handlers/faces/activate", json!({ "version": 1 }).to_string().into_bytes()),
        (Method::GET, "keys", Vec::new()),
        (Method::POST, "keys", Vec::new()),
        (Method::GET, "usage", Vec::new()),
        (Method::POST, "handlers/faces/promote", Vec::new()),
        (Method::POST, "handlers/faces/abort", Vec::new()),
        (Method::DELETE, "keys/0123456789ab", Vec::new()),
    ];
    for (method, path, body) in calls {
        let refused = status_and_code(tenant_call(invoke, method.clone(), path, body.clone()));
        assert_eq!(refused, (403, "forbidden".into()), "invoke key, {method} {path}");
        let reads = matches!((&method, path), (&Method::GET, "handlers" | "handlers/faces/versions" | "usage"));
        let status = tenant_call(read, method.clone(), path, body).status().as_u16();
        if reads {
            assert_eq!(status, 200, "read key, {method} {path}");
        } else {
            assert_eq!(status, 403, "read key, {method} {path}");
        }
    }
    assert_eq!(detect(invoke, "scoped", "faces").status(), 200, "the invoke key invokes");
    assert_eq!(status_and_code(detect(read, "scoped", "faces")), (403, "forbidden".into()));
    // demo has usage in the same period, for the read key not to read.
    let demo = crate::harness::client().post(url("/v1/demo/detect")).body(image("grace_hopper.jpg")).send().unwrap();
    assert_eq!(demo.status(), 200);
    let requests_2xx = |usage: &Value, tenant: &str| -> u64 {
        usage["rows"].as_array().unwrap().iter().filter(|r| r["tenant"] == tenant).map(|r| r["requests_2xx"].as_u64().unwrap()).sum()
    };
    let admin_usage =
        || -> Value { anonymous().get(url("/admin/v1/usage?tenant=demo&by=day")).bearer_auth(ADMIN_TOKEN).send().unwrap().json().unwrap() };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(15);
    // Usage is written every half second: poll until both requests are in.
    let usage = loop {
        let usage: Value = tenant_call(read, Method::GET, "usage?tenant=demo&by=day", Vec::new()).json().unwrap();
        if requests_2xx(&usage, "scoped") >= 1 && requests_2xx(&admin_usage(), "demo") >= 1 {
            break usage;
        }
        assert!(std::time::Instant::now() < until, "the read key reads its tenant's request: {usage}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!(requests_2xx(&usage, "scoped"), 1, "the read key reads its own tenant's one request: {usage}");
    assert!(usage["rows"].as_array().unwrap().iter().all(|r| r["tenant"] == "scoped"), "its own usage only, not demo's: {usage}");
    let last = if invoke.ends_with('0') { '1' } else { '0' };
    let wrong = format!("{}{last}", &invoke[..invoke.len() - 1]);
    assert_eq!(status_and_code(tenant_call(&wrong, Method::GET, "handlers", Vec::new())), (401, "unauthorized".into()));
    assert_eq!(status_and_code(tenant_call(deploy, Method::DELETE, "handlers/faces", Vec::new())).0, 404, "no such route");
}

/// The CLI with a tenant's key (`--key`, `FACEGATE_KEY`) instead of the
/// admin token: deploys, lists versions, rolls back and makes invoke keys
/// of the key's tenant; the admin creates the scoped key (`--scope`).
#[test]
fn the_cli_deploys_with_a_tenants_key() {
    let cli = |args: &[&str], admin: bool| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_facegate"));
        command.args(args).env("FACEGATE_URL", format!("http://{}", gateway().addr)).env_remove("FACEGATE_KEY");
        if admin {
            command.env("FACEGATE_ADMIN_TOKEN", ADMIN_TOKEN);
        } else {
            command.env_remove("FACEGATE_ADMIN_TOKEN");
        }
        let output = command.output().unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
        (output.status.code().unwrap_or(-1), text)
    };
    let json = |args: &[&str], admin: bool| -> Value {
        let (code, out) = cli(args, admin);
        assert_eq!(code, 0, "facegate {args:?}: {out}");
        serde_json::Deserializer::from_str(&out[out.find('{').unwrap_or(0)..]).into_iter::<Value>().next().unwrap().unwrap()
    };
    assert_eq!(cli(&["tenant", "create", "clikey", "--rps", "0"], true).0, 0);
    let deploy = json(&["key", "create", "clikey", "--scope", "deploy,read", "--json"], true);
    assert_eq!(deploy["scopes"], json!(["deploy", "read"]));
    let key = deploy["key"].as_str().unwrap();
    let detect_wasm = guest("detect").display().to_string();
    let blur_wasm = guest("blur").display().to_string();
    assert_eq!(json(&["deploy", "--key", key, "--handler", "faces", &detect_wasm, "--json"], false)["version"], 1);
    assert_eq!(json(&["deploy", "--key", key, "--handler", "faces", &blur_wasm, "--json"], false)["active_version"], 2);
    let versions = json(&["versions", "--key", key, "--handler", "faces", "--json"], false);
    assert_eq!(versions["versions"].as_array().map(Vec::len), Some(2));
    assert_eq!(json(&["rollback", "--key", key, "--handler", "faces", "--json"], false)["active_version"], 1);
    let canary = json(&["deploy", "--key", key, "--handler", "faces", &detect_wasm, "--canary", "20", "--json"], false);
    assert_eq!((canary["version"].as_i64(), canary["active_version"].as_i64()), (Some(3), Some(1)), "{canary}");
    assert_eq!(json(&["abort", "--key", key, "--handler", "faces", "--json"], false)["aborted"]["version"], 3);
    let (code, out) = cli(&["key", "create", "--key", key], false);
    assert_eq!(code, 0, "{out}");
    let invoke = out.lines().next().unwrap().trim();
    assert_eq!(detect(invoke, "clikey", "faces").status(), 200, "the key it made invokes");
    let (code, out) = cli(&["deploy", "--key", invoke, "--handler", "faces", &detect_wasm], false);
    assert_eq!(code, 1, "an invoke key deploys nothing: {out}");
    assert!(out.contains("403") && out.contains("deploy"), "{out}");
    // Naming another tenant beside the key is an error, not a deploy into the key's own.
    let (code, out) = cli(&["deploy", "--key", key, "--tenant", "demo", "--handler", "stray", &detect_wasm], false);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("\"demo\" is not this key's tenant (\"clikey\")"), "{out}");
    let (code, out) = cli(&["versions", "--key", key, "--tenant", "demo", "--handler", "faces"], false);
    assert_eq!(code, 2, "{out}");
    let (code, out) = cli(&["versions", "--key", key, "--handler", "stray"], false);
    assert!(code == 1 && out.contains("404"), "nothing was deployed as stray: {out}");
    // Its own tenant named beside the key is fine.
    assert_eq!(json(&["versions", "--key", key, "--tenant", "clikey", "--handler", "faces", "--json"], false)["active_version"], 1);
}

/// What a tenant stores through its deploy key stays bounded: past its
/// `max_versions` an upload deletes the oldest versions (never the active
/// one), and past its `max_handlers` a new handler is refused.
#[test]
fn a_tenants_versions_and_handlers_stay_within_its_quota() {
    let keys = tenant_with_keys("quota", &[&["deploy"]]);
    let deploy = keys[0].0.clone();
    let _ = gateway();
    let limits = json!({ "max_versions": 2, "max_handlers": 1 });
    let patched = anonymous().patch(url("/admin/v1/tenants/quota")).bearer_auth(ADMIN_TOKEN).json(&limits).send().unwrap();
    assert_eq!(patched.status(), 200);
    let upload =
        |handler: &str, file: &str| tenant_call(&deploy, Method::PUT, &format!("handlers/{handler}"), std::fs::read(guest(file)).unwrap());
    for file in ["detect", "blur", "detect", "blur"] {
        assert_eq!(upload("faces", file).status(), 201);
    }
    let versions: Value = tenant_call(&deploy, Method::GET, "handlers/faces/versions", Vec::new()).json().unwrap();
    let kept: Vec<i64> = versions["versions"].as_array().unwrap().iter().map(|v| v["version"].as_i64().unwrap()).collect();
    assert_eq!((kept, versions["active_version"].as_i64()), (vec![3, 4], Some(4)), "{versions}");
    let rolled: Value = tenant_call(&deploy, Method::POST, "handlers/faces/rollback", Vec::new()).json().unwrap();
    assert_eq!(rolled["active_version"], 3, "rollback reaches the versions kept: {rolled}");
    // The active version is never pruned: 3 stays, 4 goes.
    assert_eq!(upload("faces?activate=false", "detect").status(), 201);
    let versions: Value = tenant_call(&deploy, Method::GET, "handlers/faces/versions", Vec::new()).json().unwrap();
    let kept: Vec<i64> = versions["versions"].as_array().unwrap().iter().map(|v| v["version"].as_i64().unwrap()).collect();
    assert_eq!(kept, [3, 5], "{versions}");
    assert_eq!(status_and_code(upload("second", "detect")), (403, "quota_exceeded".into()), "one handler at most");
}

/// A tenant's keys flooding the tenant API are refused past its `api_rps`
/// (429 `api_rate_limited` + `Retry-After`, counted), log reads included;
/// its invocations (another bucket) and another tenant's API calls go on.
#[test]
fn a_flood_of_tenant_api_calls_is_refused_past_its_rate_and_costs_no_one_else() {
    let keys = tenant_with_keys("apiflood", &[&["deploy", "read"], &["invoke"]]);
    let ((manage, _), (invoke, _)) = (keys[0].clone(), keys[1].clone());
    let calm = tenant_with_keys("apicalm", &[&["deploy", "read"]]).remove(0).0;
    let admin = |method: Method, path: &str| anonymous().request(method, url(&format!("/admin/v1/{path}"))).bearer_auth(ADMIN_TOKEN);
    assert_eq!(admin(Method::PATCH, "tenants/apiflood").json(&json!({ "api_rps": 1 })).send().unwrap().status(), 200);
    assert_eq!(
        admin(Method::PUT, "tenants/apiflood/handlers/faces").body(std::fs::read(guest("detect")).unwrap()).send().unwrap().status(),
        201
    );

    // api_rps 1: a bucket of five, then one a second.
    let started = std::time::Instant::now();
    let answers: Vec<Response> =
        (0..24).map(|i| tenant_call(&manage, Method::GET, if i % 2 == 0 { "handlers" } else { "logs" }, Vec::new())).collect();
    let elapsed = started.elapsed().as_secs_f64();
    let served = answers.iter().filter(|r| r.status() == 200).count();
    assert!((5..=5 + elapsed.ceil() as usize).contains(&served), "{served} served in {elapsed:.1} s");
    let refused = answers.into_iter().find(|r| r.status() == 429).expect("the flood is refused");
    let wait: u32 = refused.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(wait >= 1, "Retry-After {wait}");
    assert_eq!(status_and_code(refused), (429, "api_rate_limited".into()));

    // Its handler still answers (requests have a bucket of their own), and
    // another tenant's API calls are served.
    assert_eq!(detect(&invoke, "apiflood", "faces").status(), 200);
    for _ in 0..10 {
        assert_eq!(tenant_call(&calm, Method::GET, "handlers", Vec::new()).status(), 200);
    }
    let metrics = anonymous().get(url("/metrics")).bearer_auth(ADMIN_TOKEN).send().unwrap().text().unwrap();
    let hits = crate::harness::metric(&metrics, "facegate_limit_hits_total{tenant=\"apiflood\",limit=\"api_rate\"}");
    assert!(hits.is_some_and(|n| n >= 1.0), "{hits:?}");
    // The bucket fills again: a call a second later is served.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(tenant_call(&manage, Method::GET, "handlers", Vec::new()).status(), 200);
}

/// A canary's abort rule compares it with the version active now:
/// activating another version during the canary counts both sides afresh,
/// so a stable version's old failures do not hide the canary's.
#[test]
fn a_canarys_abort_rule_counts_afresh_when_the_active_version_changes() {
    let (invoke, _) = tenant_with_keys("recount", &[&["invoke"]]).remove(0);
    let admin = |method: Method, path: &str| {
        anonymous().request(method, url(&format!("/admin/v1/tenants/recount/{path}"))).bearer_auth(ADMIN_TOKEN)
    };
    let upload = |query: &str, file: &str| {
        let response = admin(Method::PUT, &format!("handlers/h{query}")).body(std::fs::read(guest(file)).unwrap()).send().unwrap();
        assert_eq!(response.status(), 201, "{:?}", response.text());
    };
    upload("", "hostile");
    upload("?canary=50&abort_margin=0.2&abort_after=10", "hostile");
    upload("?activate=false", "detect");
    let canary = || admin(Method::GET, "handlers/h/versions").send().unwrap().json::<Value>().unwrap()["canary"].clone();
    let calls = |n: usize| -> Vec<u16> {
        let url = url("/v1/recount/h?attack=panic");
        (0..n).map(|_| client_with_key(&invoke).get(&url).send().unwrap().status().as_u16()).collect()
    };
    // Versions 1 and 2 (both hostile) fail alike: no abort.
    assert!(calls(300).iter().all(|&s| s == 500));
    assert_eq!(canary()["version"], 2, "both sides fail alike");
    // Version 3 (detect: a GET is a 4xx) active: the stable side is
    // healthy from now on; the canary fails on. Counted with version 1's
    // ~150 failures, the stable side would still fail 80 % after 40 more
    // calls, and the canary would run on.
    let activated = admin(Method::POST, "handlers/h/activate").json(&json!({ "version": 3 })).send().unwrap();
    assert_eq!(activated.status(), 200);
    assert_eq!(canary()["version"], 2, "activating another version keeps the canary");
    let statuses = calls(40);
    assert!(statuses.iter().all(|&s| s == 500 || (400..500).contains(&s)), "{statuses:?}");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !canary().is_null() {
        assert!(std::time::Instant::now() < until, "the canary is aborted on its own failures: {statuses:?}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A handler's answer is sandboxed (it shares the console's origin), and a
/// usage query whose bounds would overflow the span check is refused,
/// naming the parameter.
#[test]
fn handler_answers_are_sandboxed_and_usage_bounds_are_checked() {
    let keys = tenant_with_keys("hardened", &[&["deploy", "read"], &["invoke"]]);
    let ((manage, _), (invoke, _)) = (keys[0].clone(), keys[1].clone());
    assert_eq!(tenant_call(&manage, Method::PUT, "handlers/faces", std::fs::read(guest("detect")).unwrap()).status(), 201);
    let answered = detect(&invoke, "hardened", "faces");
    assert_eq!(answered.status(), 200);
    assert_eq!(answered.headers()["content-security-policy"], "sandbox");
    let failed = client_with_key(&invoke).get(url("/v1/hardened/faces")).send().unwrap();
    assert!(failed.status().is_client_error(), "{}", failed.status());
    assert_eq!(failed.headers()["content-security-policy"], "sandbox", "a failed call's answer too");

    for (query, names) in [("from=-9223372036854775&to=9223372036854775", "from"), ("from=0&to=9223372036854775", "to")] {
        let answer = tenant_call(&manage, Method::GET, &format!("usage?{query}"), Vec::new());
        let status = answer.status().as_u16();
        let body: Value = answer.json().unwrap();
        assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid_parameter")), "{query}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(&format!("{names} ")), "{query}: {message}");
    }
}
