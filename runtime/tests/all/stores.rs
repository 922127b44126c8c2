//! The admin API behaves the same on either store: one lifecycle (tenants,
//! keys, refused uploads, versions, rollback, activation, limits, deletion)
//! run against a `facegate serve` process on its own SQLite store and one on
//! a throw-away PostgreSQL server. The store layer's own tests
//! (`control::store::tests`) check each operation on both; this checks
//! what a client of the gateway sees.

use facegate_throwaway_pg::ThrowawayPostgres;
use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{client_with_key, fresh_dir, guest, image};
use crate::process::Server;

/// An admin call's status and JSON answer (`null` when it has none).
fn admin(server: &Server, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
    let mut request = server.admin(method, path);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().unwrap();
    (response.status().as_u16(), response.json().unwrap_or(Value::Null))
}

/// Uploads `bytes` as t/h; the status and JSON answer.
fn upload(server: &Server, bytes: Vec<u8>) -> (u16, Value) {
    let response = server.admin(Method::PUT, "tenants/t/handlers/h").body(bytes).send().unwrap();
    (response.status().as_u16(), response.json().unwrap_or(Value::Null))
}

/// The lifecycle, with what each step must answer; `store` names the store in messages.
fn lifecycle(server: &Server, store: &str) {
    assert_eq!(admin(server, Method::POST, "tenants", Some(json!({ "name": "t" }))).0, 201, "{store}");
    assert_eq!(admin(server, Method::POST, "tenants", Some(json!({ "name": "t" }))).0, 409, "{store}: the name is taken");
    let (status, created) = admin(server, Method::POST, "tenants/t/keys", None);
    assert_eq!(status, 201, "{store}: {created}");
    let (id, key) = (created["id"].as_str().unwrap().to_owned(), created["key"].as_str().unwrap().to_owned());
    assert_eq!(server.probe(&key), (404, None), "{store}: the key works, no handler yet");
    assert_eq!(server.probe("fg_nobody_0000").0, 401, "{store}: a wrong key");

    let (status, body) = upload(server, image("grace_hopper.jpg"));
    assert_eq!((status, body["error"]["code"].as_str()), (400, Some("invalid")), "{store}: {body}");
    assert_eq!(admin(server, Method::GET, "tenants/t/handlers/h/versions", None).0, 404, "{store}: a refused upload creates no handler");

    for (version, name) in [(1, "detect"), (2, "blur")] {
        let (status, body) = upload(server, std::fs::read(guest(name)).unwrap());
        assert_eq!((status, body["version"].as_i64()), (201, Some(version)), "{store}: {body}");
    }
    assert_eq!(server.probe(&key).1, Some(2), "{store}: the newest upload is active");
    assert_eq!(admin(server, Method::POST, "tenants/t/handlers/h/rollback", None).0, 200, "{store}");
    let (status, version, faces) = crate::detect::detect_at(server.addr, "/v1/t/h", &key);
    assert_eq!((status, version), (200, Some(1)), "{store}: rolled back to detect: {faces}");
    crate::detect::assert_body_matches_reference("grace_hopper.jpg", &faces);
    let activate = |version: i64| admin(server, Method::POST, "tenants/t/handlers/h/activate", Some(json!({ "version": version }))).0;
    assert_eq!(activate(2), 200, "{store}");
    assert_eq!(server.probe(&key).1, Some(2), "{store}: activated");
    assert_eq!(activate(9), 404, "{store}: no such version");
    let (_, versions) = admin(server, Method::GET, "tenants/t/handlers/h/versions", None);
    assert_eq!(
        (versions["active_version"].as_i64(), versions["versions"].as_array().map(Vec::len)),
        (Some(2), Some(2)),
        "{store}: {versions}"
    );

    let (status, body) = admin(server, Method::PATCH, "tenants/t", Some(json!({ "max_concurrency": 3, "weight": 2 })));
    assert_eq!(
        (status, body["limits"]["max_concurrency"].as_u64(), body["limits"]["weight"].as_u64()),
        (200, Some(3), Some(2)),
        "{store}: {body}"
    );
    assert_eq!(admin(server, Method::PATCH, "tenants/t", Some(json!({ "max_concurrency": 0 }))).0, 400, "{store}: a limit out of range");
    assert_eq!(admin(server, Method::GET, "tenants/t", None).1["limits"]["max_concurrency"], 3, "{store}: the refused change left it");

    assert_eq!(admin(server, Method::DELETE, &format!("tenants/t/keys/{id}"), None).0, 200, "{store}");
    assert_eq!(server.probe(&key).0, 401, "{store}: a revoked key");
    let (_, second) = admin(server, Method::POST, "tenants/t/keys", None);
    let second = second["key"].as_str().unwrap().to_owned();
    assert_eq!(server.probe(&second).1, Some(2), "{store}: a new key serves");
    assert_eq!(admin(server, Method::DELETE, "tenants/t", None).0, 200, "{store}");
    assert_eq!(admin(server, Method::GET, "tenants/t", None).0, 404, "{store}: deleted");
    let response = client_with_key(&second).get(format!("http://{}/v1/t/h", server.addr)).send().unwrap();
    assert_eq!(response.status(), 401, "{store}: a deleted tenant's keys go with it");
}

#[test]
fn the_admin_api_behaves_alike_on_sqlite_and_postgresql() {
    let sqlite = Server::start(&fresh_dir("stores-sqlite"));
    lifecycle(&sqlite, "SQLite");
    let pg = ThrowawayPostgres::start().unwrap();
    let postgres = Server::start_with(&fresh_dir("stores-postgres"), &["--store", &pg.url()]);
    lifecycle(&postgres, "PostgreSQL");
}
