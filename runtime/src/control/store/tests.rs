//! One behaviour, two stores: every test here runs against SQLite and
//! against a real PostgreSQL server (a throw-away one, see
//! [`facegate_throwaway_pg`]).

use std::sync::OnceLock;

use super::pg_connect;
use super::*;
use crate::control::keys::sha256_hex;
use facegate_throwaway_pg::ThrowawayPostgres;

/// One server for the whole test binary; each test gets a database of its own.
pub(crate) fn postgres_server() -> &'static ThrowawayPostgres {
    static SERVER: OnceLock<ThrowawayPostgres> = OnceLock::new();
    SERVER.get_or_init(|| ThrowawayPostgres::start().expect("start a throw-away PostgreSQL (deploy/test.sh installs postgresql-15)"))
}

/// A fresh SQLite store and a fresh PostgreSQL store, named `name`.
fn stores(name: &str) -> Vec<Box<dyn Store>> {
    let dir = std::env::temp_dir().join(format!("facegate-store-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let sqlite = sqlite::SqliteStore::open(&dir).unwrap();
    vec![Box::new(sqlite), Box::new(postgres::PgStore::open(&fresh_database(name)).unwrap())]
}

pub(crate) fn fresh_database(name: &str) -> String {
    let server = postgres_server();
    let db = format!("test_{}", name.replace('-', "_"));
    let mut admin = ::postgres::Client::connect(&server.url(), ::postgres::NoTls).unwrap();
    admin.batch_execute(&format!("DROP DATABASE IF EXISTS {db}")).unwrap();
    admin.batch_execute(&format!("CREATE DATABASE {db}")).unwrap();
    server.url().replace("/postgres", &format!("/{db}"))
}

fn version<'a>(tenant: &'a str, handler: &'a str, component: &'a [u8], sha: &'a str, activate: bool) -> NewVersion<'a> {
    NewVersion {
        tenant,
        handler,
        sha256: sha,
        component,
        activate,
        guest_path: Default::default(),
        source: super::UPLOADED,
        artifact: None,
    }
}

#[test]
fn versions_count_up_and_rollback_goes_to_the_previous_one() {
    for mut store in stores("versions") {
        let s = &mut *store;
        let kind = s.describe();
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        assert!(matches!(s.create_tenant("acme", &LimitOverrides::default()), Err(StoreError::Conflict(_))), "{kind}");
        let (a, b, c) = (b"component a".as_slice(), b"component b".as_slice(), b"component c".as_slice());
        let (sa, sb, sc) = (sha256_hex(a), sha256_hex(b), sha256_hex(c));
        assert_eq!(s.add_version(version("acme", "detect", a, &sa, true)).unwrap(), 1, "{kind}");
        assert_eq!(s.add_version(version("acme", "detect", b, &sb, false)).unwrap(), 2);
        assert_eq!(s.versions("acme", "detect").unwrap().1, Some(1), "{kind}: an upload without activation keeps the active one");
        assert_eq!(s.activate("acme", "detect", 2).unwrap(), Some(1));
        assert_eq!(s.add_version(version("acme", "detect", c, &sc, true)).unwrap(), 3);
        assert_eq!(rollback_target(s, "acme", "detect").unwrap(), 2);
        s.activate("acme", "detect", 1).unwrap();
        assert!(matches!(rollback_target(s, "acme", "detect"), Err(StoreError::Conflict(_))), "{kind}");
        assert!(matches!(s.activate("acme", "detect", 9), Err(StoreError::NotFound(_))), "{kind}");
        assert!(matches!(s.add_version(version("nobody", "detect", a, &sa, true)), Err(StoreError::NotFound(_))), "{kind}");
        assert_eq!(s.component(&sb).unwrap(), b, "{kind}: the bytes come back");
        let active = s.active_handlers().unwrap();
        assert_eq!((active.len(), active[0].version, active[0].sha256.as_str()), (1, 1, sa.as_str()), "{kind}");
        assert_eq!(s.all_versions().unwrap().len(), 3);
        assert!(s.check().unwrap().is_empty(), "{kind}");
    }
}

#[test]
fn revoked_keys_are_inactive_and_deleting_a_tenant_removes_its_rows() {
    for mut store in stores("keys") {
        let s = &mut *store;
        let kind = s.describe();
        assert!(s.is_empty().unwrap());
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        s.insert_key("acme", "k1", "h1", Scopes::default(), 10).unwrap();
        s.insert_key("acme", "k2", "h2", Scopes::DEPLOY.with(Scopes::READ), 10).unwrap();
        assert!(matches!(s.insert_key("nobody", "k3", "h3", Scopes::default(), 10), Err(StoreError::NotFound(_))), "{kind}");
        let sha = sha256_hex(b"x");
        s.add_version(version("acme", "detect", b"x", &sha, true)).unwrap();
        s.revoke_key("acme", "k1").unwrap();
        assert!(matches!(s.revoke_key("acme", "k1"), Err(StoreError::NotFound(_))), "{kind}");
        let active: Vec<_> = s.active_keys().unwrap().into_iter().map(|k| (k.0, k.3)).collect();
        assert_eq!(active, [("k2".to_owned(), Scopes::DEPLOY.with(Scopes::READ))], "{kind}: the scopes are kept");
        let listed: Vec<_> = s.keys("acme").unwrap().into_iter().map(|k| (k.id, k.scopes)).collect();
        assert_eq!(listed.len(), 2);
        assert!(listed.contains(&("k1".to_owned(), Scopes::INVOKE)), "{kind}: {listed:?}");
        s.delete_tenant("acme").unwrap();
        assert!(matches!(s.delete_tenant("acme"), Err(StoreError::NotFound(_))), "{kind}");
        assert!(s.active_keys().unwrap().is_empty() && s.active_handlers().unwrap().is_empty(), "{kind}");
        assert!(s.all_versions().unwrap().is_empty(), "{kind}");
        assert!(s.is_empty().unwrap(), "{kind}");
    }
}

/// A tenant's unrevoked keys stop at `max_keys`; a revoked one frees its
/// place, and another tenant's keys do not count. Each change reports the
/// generation it committed at, one past the one before it.
#[test]
fn keys_stop_at_max_keys_and_each_change_reports_its_generation() {
    for mut store in stores("max_keys") {
        let s = &mut *store;
        let kind = s.describe();
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        s.create_tenant("other", &LimitOverrides::default()).unwrap();
        s.insert_key("other", "o1", "h", Scopes::default(), 2).unwrap();
        for id in ["k1", "k2"] {
            let before = s.generation().unwrap();
            let commit = s.insert_key("acme", id, "h", Scopes::default(), 2).unwrap();
            assert_eq!((commit.generation, s.generation().unwrap()), (before + 1, before + 1), "{kind}");
        }
        let before = s.generation().unwrap();
        let refused = s.insert_key("acme", "k3", "h", Scopes::default(), 2);
        assert!(matches!(&refused, Err(StoreError::Quota(m)) if m.contains("max_keys")), "{kind}: {refused:?}");
        assert_eq!(s.generation().unwrap(), before, "{kind}: a refusal changes nothing");
        let revoked = s.revoke_key("acme", "k1").unwrap();
        assert_eq!(revoked.generation, before + 1, "{kind}");
        s.insert_key("acme", "k3", "h", Scopes::default(), 2).unwrap();
        assert_eq!(s.active_keys().unwrap().len(), 3, "{kind}: k2, k3 and o1");
    }
}

#[test]
fn a_tenant_keeps_its_newest_revoked_keys_only() {
    for mut store in stores("revoked_keys") {
        let s = &mut *store;
        let kind = s.describe();
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        s.create_tenant("other", &LimitOverrides::default()).unwrap();
        s.insert_key("other", "o1", "h", Scopes::default(), 10).unwrap();
        s.revoke_key("other", "o1").unwrap();
        s.insert_key("acme", "live", "h", Scopes::default(), 10).unwrap();
        let churned = REVOKED_KEYS_KEPT + 5;
        for n in 0..churned {
            let id = format!("k{n:04}");
            s.insert_key("acme", &id, "h", Scopes::default(), 10).unwrap();
            s.revoke_key("acme", &id).unwrap();
        }
        let keys = s.keys("acme").unwrap();
        let revoked: Vec<_> = keys.iter().filter(|k| k.revoked_at.is_some()).map(|k| k.id.as_str()).collect();
        assert_eq!(revoked.len() as i64, REVOKED_KEYS_KEPT, "{kind}");
        assert!(!revoked.contains(&"k0000") && revoked.contains(&format!("k{:04}", churned - 1).as_str()), "{kind}: the newest are kept");
        assert!(keys.iter().any(|k| k.id == "live" && k.revoked_at.is_none()), "{kind}: an active key is never pruned");
        assert_eq!(s.keys("other").unwrap().len(), 1, "{kind}: another tenant's revoked key stays");
    }
}

#[test]
fn limits_and_meta_are_kept() {
    for mut store in stores("limits") {
        let s = &mut *store;
        let overrides = LimitOverrides { weight: Some(3), ..LimitOverrides::default() };
        s.create_tenant("acme", &overrides).unwrap();
        assert_eq!(s.tenant("acme").unwrap().overrides.weight, Some(3));
        s.set_limits("acme", &LimitOverrides::default()).unwrap();
        assert_eq!(s.tenants().unwrap()[0].overrides.weight, None);
        assert!(matches!(s.set_limits("nobody", &overrides), Err(StoreError::NotFound(_))));
        assert_eq!(s.meta("seed").unwrap(), None);
        s.set_meta("seed", "started").unwrap();
        s.set_meta("seed", "done").unwrap();
        assert_eq!(s.meta("seed").unwrap().as_deref(), Some("done"));
    }
}

#[test]
fn every_change_bumps_the_generation_and_nothing_else_does() {
    for mut store in stores("generation") {
        let s = &mut *store;
        let kind = s.describe();
        let mut last = s.generation().unwrap();
        let mut bumped = |s: &mut dyn Store, what: &str| {
            let now = s.generation().unwrap();
            assert!(now > last, "{kind}: {what} must bump the generation ({last} -> {now})");
            last = now;
        };
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        bumped(s, "create tenant");
        s.set_limits("acme", &LimitOverrides { weight: Some(2), ..LimitOverrides::default() }).unwrap();
        bumped(s, "set limits");
        s.insert_key("acme", "k1", "h1", Scopes::default(), 10).unwrap();
        bumped(s, "insert key");
        s.revoke_key("acme", "k1").unwrap();
        bumped(s, "revoke key");
        let sha = sha256_hex(b"x");
        s.add_version(version("acme", "detect", b"x", &sha, false)).unwrap();
        bumped(s, "add version");
        s.activate("acme", "detect", 1).unwrap();
        bumped(s, "activate");
        s.delete_tenant("acme").unwrap();
        bumped(s, "delete tenant");
        let before = s.generation().unwrap();
        s.set_meta("k", "v").unwrap();
        s.heartbeat(&node("n1", 1)).unwrap();
        assert_eq!(s.generation().unwrap(), before, "{kind}: heartbeats and meta are not changes to the snapshot");
    }
}

#[test]
fn postgres_shares_artifacts_per_engine_and_sqlite_keeps_none() {
    for mut store in stores("artifacts") {
        let s = &mut *store;
        let shared = s.describe().starts_with("postgres");
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        let (a, b) = (b"component a".as_slice(), b"component b".as_slice());
        let (sa, sb) = (sha256_hex(a), sha256_hex(b));
        let artifact = |engine: &str, code: &[u8]| SharedArtifact { engine: engine.into(), bytes: code.to_vec(), mac: "m".into() };
        let with_upload = artifact("e1", b"code a");
        s.add_version(NewVersion { artifact: Some(&with_upload), ..version("acme", "detect", a, &sa, true) }).unwrap();
        s.add_version(version("acme", "blur", b, &sb, true)).unwrap();
        let before = s.generation().unwrap();
        s.share_artifact(&sb, &artifact("e1", b"code b")).unwrap();
        s.share_artifact(&sb, &artifact("e1", b"a second compile")).unwrap();
        s.share_artifact(&sb, &artifact("e2", b"code b, engine 2")).unwrap();
        if shared {
            assert_eq!(s.shared_artifact(&sa, "e1").unwrap(), Some(with_upload.clone()), "stored with the version");
            assert_eq!(s.shared_artifact(&sb, "e1").unwrap().unwrap().bytes, b"a second compile", "a node shares what it could not load");
            assert_eq!(s.generation().unwrap(), before, "sharing an artifact is not a change to serve");
            let again = artifact("e1", b"the same upload again");
            s.add_version(NewVersion { artifact: Some(&again), ..version("acme", "detect", a, &sa, true) }).unwrap();
            assert_eq!(s.shared_artifact(&sa, "e1").unwrap().unwrap().bytes, b"code a", "an upload keeps the artifact there");
            assert_eq!(s.shared_artifact(&sb, "e2").unwrap().unwrap().bytes, b"code b, engine 2", "one per engine");
            assert_eq!(s.shared_artifact(&sa, "e2").unwrap(), None, "nothing compiled for that engine");
        } else {
            assert_eq!(s.shared_artifact(&sa, "e1").unwrap(), None, "one node: its file cache only");
        }
        s.delete_tenant("acme").unwrap();
    }
}

fn node(id: &str, heartbeat_at: i64) -> NodeRow {
    NodeRow {
        id: id.into(),
        address: "10.0.0.1:8080".into(),
        version: "test".into(),
        devices: vec!["cpu".into()],
        load: NodeLoad { queue_depth: 3, in_flight: 1, handlers: 2, generation: 7 },
        started_at: 1,
        heartbeat_at,
    }
}

#[test]
fn nodes_report_and_are_forgotten() {
    for mut store in stores("nodes") {
        let s = &mut *store;
        s.heartbeat(&node("a", 100)).unwrap();
        s.heartbeat(&node("b", 100)).unwrap();
        s.heartbeat(&node("a", 200)).unwrap();
        let nodes = s.nodes().unwrap();
        assert_eq!(nodes, vec![node("a", 200), node("b", 100)], "{}", s.describe());
        s.remove_nodes("a", 150).unwrap();
        assert!(s.nodes().unwrap().is_empty(), "a removed by id, b as silent since before 150");
    }
}

#[test]
fn postgres_announces_changes_to_listeners() {
    let url = fresh_database("listen");
    let mut store = postgres::PgStore::open(&url).unwrap();
    let mut listener = (store.listener().unwrap())().unwrap();
    assert!(!listener.wait(std::time::Duration::from_millis(50)).unwrap(), "nothing changed yet");
    store.create_tenant("acme", &LimitOverrides::default()).unwrap();
    assert!(listener.wait(std::time::Duration::from_secs(5)).unwrap(), "the change is announced");
    // Reopening migrates nothing twice.
    drop(postgres::PgStore::open(&url).unwrap());
    assert_eq!(store.tenants().unwrap().len(), 1);
}

#[test]
fn a_lost_postgres_is_unavailable_not_a_failure() {
    let url = "postgres://facegate@127.0.0.1:1/none?connect_timeout=1";
    let error = postgres::PgStore::open(url).err().unwrap().to_string();
    assert!(error.contains("unreachable"), "{error}");
}

/// A CA, and a server certificate it signed for `localhost` and 127.0.0.1: (CA PEM, server cert PEM, server key PEM).
fn certificates() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap().signed_by(&key, &ca).unwrap();
    (ca.pem(), cert.pem(), key.serialize_pem())
}

#[test]
fn postgres_over_tls_is_verified_against_the_given_ca() {
    let (ca, cert, key) = certificates();
    let server = ThrowawayPostgres::start_with_tls(Some((&cert, &key))).unwrap();
    let ca_file = std::env::temp_dir().join(format!("facegate-pg-ca-{}.pem", std::process::id()));
    std::fs::write(&ca_file, ca).unwrap();
    let verified = format!("{}?sslmode=verify-full&sslrootcert={}", server.url(), ca_file.display());

    let mut store = postgres::PgStore::open(&verified).unwrap();
    store.create_tenant("acme", &LimitOverrides::default()).unwrap();
    let (config, tls) = pg_connect::connector(&verified).unwrap();
    let mut client = config.connect(tls).unwrap();
    let ssl: bool = client.query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[]).unwrap().get(0);
    assert!(ssl, "the connection is encrypted");

    let unknown_ca = format!("{}?sslmode=require", server.url());
    let error = postgres::PgStore::open(&unknown_ca).err().unwrap().to_string();
    assert!(error.contains("certificate") || error.contains("UnknownIssuer"), "a server the roots do not vouch for is refused: {error}");
    let plain = format!("{}?sslmode=disable", server.url());
    assert_eq!(postgres::PgStore::open(&plain).unwrap().tenants().unwrap().len(), 1, "plain TCP when asked for");
    std::fs::remove_file(ca_file).unwrap();
}

#[test]
fn a_tenant_created_again_under_its_name_is_a_new_incarnation() {
    for mut store in stores("incarnation") {
        let s = &mut *store;
        let kind = s.describe();
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        let first = s.tenant("acme").unwrap().incarnation;
        assert_eq!(first.len(), 16, "{kind}: 64 random bits, hex");
        assert_eq!(s.tenants().unwrap()[0].incarnation, first, "{kind}: listed as read");
        s.delete_tenant("acme").unwrap();
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        assert_ne!(s.tenant("acme").unwrap().incarnation, first, "{kind}");
    }
}

#[test]
fn a_version_2_postgres_store_is_migrated_and_its_tenants_get_incarnations_of_their_own() {
    let url = fresh_database("pg-migrate");
    let mut client = ::postgres::Client::connect(&url, ::postgres::NoTls).unwrap();
    for migration in &postgres::MIGRATIONS[..2] {
        client.batch_execute(migration.sql).unwrap();
    }
    client
        .batch_execute(
            "CREATE TABLE schema_migrations (version INT PRIMARY KEY, applied_at BIGINT NOT NULL);
             INSERT INTO schema_migrations VALUES (1, 0), (2, 0);
             INSERT INTO tenants (name, created_at) VALUES ('acme', 1), ('beta', 1);",
        )
        .unwrap();
    drop(client);
    let mut store = postgres::PgStore::open(&url).unwrap();
    let incarnations: Vec<String> = store.tenants().unwrap().into_iter().map(|t| t.incarnation).collect();
    assert_eq!(incarnations.iter().map(String::len).collect::<Vec<_>>(), [16, 16], "{incarnations:?}");
    assert_ne!(incarnations[0], incarnations[1], "one each");
}

#[test]
fn usage_deltas_are_written_once_summed_over_nodes_and_pruned() {
    use crate::telemetry::usage::{BUCKET_MS, ByModel, Delta, ModelUsage, Usage, UsageKey};
    for mut store in stores("usage") {
        let s = &mut *store;
        let kind = s.describe();
        let key = |tenant: &str, minute: i64| UsageKey::new(tenant, "detect", 1, minute * BUCKET_MS);
        let usage = |requests: u64, peak: u64| Usage {
            requests_2xx: requests,
            device_us: 10 * requests,
            peak_memory_bytes: peak,
            ..Usage::default()
        };
        let part = |device_us, infer_calls| ModelUsage { device_us, infer_calls };
        let by = |parts: &[(&str, ModelUsage)]| parts.iter().map(|(m, u)| (m.to_string(), *u)).collect::<ByModel>();
        let first = Delta {
            node: "n1".into(),
            seq: 1,
            rows: vec![(key("a", 5), usage(2, 100)), (key("b", 5), usage(1, 10))],
            models: vec![(key("a", 5), by(&[("fp32", part(15, 1)), ("int8", part(5, 1))]))],
        };
        s.write_usage(&first).unwrap();
        s.write_usage(&first).unwrap();
        let second = Delta {
            node: "n1".into(),
            seq: 2,
            rows: vec![(key("a", 5), usage(3, 50))],
            models: vec![(key("a", 5), by(&[("fp32", part(30, 3))]))],
        };
        s.write_usage(&second).unwrap();
        s.write_usage(&Delta {
            node: "n2".into(),
            seq: 1,
            rows: vec![(key("a", 5), usage(4, 400)), (key("a", 9), usage(1, 1))],
            ..Delta::default()
        })
        .unwrap();
        let rows = s.usage(Some("a"), 0, 10 * BUCKET_MS).unwrap();
        assert_eq!(
            rows,
            vec![(key("a", 5), usage(9, 400)), (key("a", 9), usage(1, 1))],
            "{kind}: a retried delta counts once; nodes sum; peaks are the largest"
        );
        assert_eq!(s.usage(None, 0, 10 * BUCKET_MS).unwrap().len(), 3, "{kind}");
        assert_eq!(
            s.usage_by_model(Some("a"), 0, 10 * BUCKET_MS).unwrap(),
            vec![(key("a", 5), "fp32".to_owned(), part(45, 4)), (key("a", 5), "int8".to_owned(), part(5, 1))],
            "{kind}: each model's part, a retried delta once, summed over deltas"
        );
        assert!(s.usage_by_model(Some("b"), 0, 10 * BUCKET_MS).unwrap().is_empty(), "{kind}");
        assert_eq!(s.usage(Some("a"), 6 * BUCKET_MS, 10 * BUCKET_MS).unwrap(), vec![(key("a", 9), usage(1, 1))], "{kind}");
        s.prune_usage(6 * BUCKET_MS).unwrap();
        assert_eq!(s.usage(None, 0, 10 * BUCKET_MS).unwrap(), vec![(key("a", 9), usage(1, 1))], "{kind}: older buckets pruned");
        assert!(s.usage_by_model(None, 0, 10 * BUCKET_MS).unwrap().is_empty(), "{kind}: and their models' parts");
    }
}

#[test]
fn a_canary_is_kept_with_its_rule_and_ended() {
    for mut store in stores("canary") {
        let s = &mut *store;
        let kind = s.describe();
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        let (a, b) = (b"a".as_slice(), b"b".as_slice());
        let (sa, sb) = (sha256_hex(a), sha256_hex(b));
        s.add_version(version("acme", "h", a, &sa, true)).unwrap();
        s.add_version(version("acme", "h", b, &sb, false)).unwrap();
        assert_eq!(s.canary("acme", "h").unwrap(), None, "{kind}");
        let canary = Canary { version: 2, percent: 10, abort: Some(AbortRule { margin: 0.05, after: 50 }) };
        s.set_canary("acme", "h", Some(canary)).unwrap();
        assert_eq!(s.canary("acme", "h").unwrap(), Some(canary), "{kind}");
        let listed = s.canaries().unwrap();
        assert_eq!(listed.len(), 1, "{kind}");
        assert_eq!((listed[0].0.version, listed[0].0.sha256.as_str(), listed[0].1), (2, sb.as_str(), canary), "{kind}");
        let missing = Canary { version: 9, ..canary };
        assert!(matches!(s.set_canary("acme", "h", Some(missing)), Err(StoreError::NotFound(_))), "{kind}");
        assert!(matches!(s.canary("acme", "nosuch"), Err(StoreError::NotFound(_))), "{kind}");
        s.set_canary("acme", "h", None).unwrap();
        assert!(s.canaries().unwrap().is_empty(), "{kind}");
    }
}

#[test]
fn the_oldest_versions_past_the_quota_are_pruned_never_the_active_one_or_a_canary() {
    assert_eq!(versions_past(&[1, 2, 3, 4, 5], 3, &[1]), [2, 3], "the active one stays, the next oldest go");
    assert_eq!(versions_past(&[1, 2, 3], 3, &[]), Vec::<i64>::new());
    assert_eq!(versions_past(&[1, 2, 3], 1, &[1, 3]), [2], "spared ones stay even past the quota");
    for mut store in stores("prune") {
        let s = &mut *store;
        let kind = s.describe();
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        let parts: Vec<Vec<u8>> = (0..5).map(|i| format!("component {i}").into_bytes()).collect();
        let shas: Vec<String> = parts.iter().map(|p| sha256_hex(p)).collect();
        // Versions 1 to 5 of `h` (1 active, 2 a canary); version 3's component is `other`'s too.
        s.add_version(version("acme", "other", &parts[1], &shas[1], true)).unwrap();
        for (i, part) in [0, 4, 1, 2, 3].into_iter().enumerate() {
            s.add_version(version("acme", "h", &parts[part], &shas[part], i == 0)).unwrap();
        }
        s.set_canary("acme", "h", Some(Canary { version: 2, percent: 10, abort: None })).unwrap();
        let pruned = s.prune_versions("acme", "h", 3).unwrap();
        assert_eq!(pruned.versions, [3, 4], "{kind}: the oldest beside the active one (1) and the canary (2)");
        assert_eq!(pruned.components, [shas[2].clone()], "{kind}: version 4's component; version 3's is still used");
        let left: Vec<i64> = s.versions("acme", "h").unwrap().0.iter().map(|v| v.version).collect();
        assert_eq!(left, [1, 2, 5], "{kind}");
        assert_eq!(s.component(&shas[1]).unwrap(), parts[1], "{kind}: a component still in use stays");
        assert!(s.component(&shas[2]).is_err(), "{kind}: a component no version uses is gone");
        assert!(s.check().unwrap().is_empty(), "{kind}");
        assert_eq!(s.prune_versions("acme", "nosuch", 1).unwrap(), Pruned::default(), "{kind}");
    }
}

#[test]
fn migrations_are_their_dialects_files_numbered_in_order() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/control/store/migrations");
    for (dialect, listed) in [("sqlite", sqlite::MIGRATIONS), ("postgres", postgres::MIGRATIONS)] {
        let mut files: Vec<String> = std::fs::read_dir(dir.join(dialect))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .map(|name| name.strip_suffix(".sql").unwrap_or_else(|| panic!("{dialect}: {name} is not a .sql file")).to_owned())
            .collect();
        files.sort();
        let names: Vec<&str> = listed.iter().map(|m| m.name).collect();
        assert_eq!(names, files, "{dialect}: every migration file is listed, in file order");
        for (i, name) in names.iter().enumerate() {
            assert!(name.starts_with(&format!("{:04}_", i + 1)), "{dialect}: migration {} is {name}, numbered out of order", i + 1);
        }
    }
}

#[test]
fn a_usage_figure_missing_from_the_table_is_added_when_the_store_opens() {
    use crate::telemetry::usage::{BUCKET_MS, Delta, Usage, UsageKey};
    let dir = std::env::temp_dir().join(format!("facegate-store-usage-columns-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    drop(sqlite::SqliteStore::open(&dir).unwrap());
    let conn = rusqlite::Connection::open(dir.join(DB_FILE)).unwrap();
    conn.execute_batch("ALTER TABLE usage DROP COLUMN bytes_out").unwrap();
    drop(conn);
    let url = fresh_database("usage-columns");
    drop(postgres::PgStore::open(&url).unwrap());
    let mut client = ::postgres::Client::connect(&url, ::postgres::NoTls).unwrap();
    client.batch_execute("ALTER TABLE usage DROP COLUMN bytes_out").unwrap();
    let reopened: Vec<Box<dyn Store>> =
        vec![Box::new(sqlite::SqliteStore::open(&dir).unwrap()), Box::new(postgres::PgStore::open(&url).unwrap())];
    for mut store in reopened {
        let kind = store.describe();
        let key = UsageKey::new("a", "detect", 1, 0);
        let usage = Usage { requests_2xx: 1, bytes_out: 123, ..Usage::default() };
        store.write_usage(&Delta { node: "n".into(), seq: 1, rows: vec![(key.clone(), usage)], ..Delta::default() }).unwrap();
        assert_eq!(store.usage(Some("a"), 0, BUCKET_MS).unwrap(), vec![(key, usage)], "{kind}: the figure's column is back");
    }
}

fn route(hostname: &str, tenant: &str, handler: &str) -> RouteRow {
    RouteRow { hostname: hostname.to_owned(), tenant: tenant.to_owned(), handler: handler.to_owned(), created_at: 1 }
}

#[test]
fn a_hostname_belongs_to_one_tenant_moves_among_its_handlers_and_goes_with_it() {
    for mut store in stores("routes") {
        let s = &mut *store;
        let kind = s.describe();
        for tenant in ["acme", "umbrella"] {
            s.create_tenant(tenant, &LimitOverrides::default()).unwrap();
        }
        let before = s.generation().unwrap();
        s.add_route(&route("faces.acme.test", "acme", "faces")).unwrap();
        assert!(s.generation().unwrap() > before, "{kind}: a route is a change every node must see");
        s.add_route(&route("faces.acme.test", "acme", "blur")).unwrap();
        assert_eq!(s.routes().unwrap(), vec![route("faces.acme.test", "acme", "blur")], "{kind}: moved to the tenant's other handler");
        let taken = s.add_route(&route("faces.acme.test", "umbrella", "faces"));
        assert!(matches!(taken, Err(StoreError::Conflict(_))), "{kind}: {taken:?}");
        assert!(matches!(s.add_route(&route("x.nobody.test", "nobody", "h")), Err(StoreError::NotFound(_))), "{kind}");
        s.add_route(&route("api.umbrella.test", "umbrella", "faces")).unwrap();
        assert!(matches!(s.remove_route("nothing.test"), Err(StoreError::NotFound(_))), "{kind}");
        s.delete_tenant("acme").unwrap();
        assert_eq!(s.routes().unwrap(), vec![route("api.umbrella.test", "umbrella", "faces")], "{kind}: deleted with its tenant");
        s.remove_route("api.umbrella.test").unwrap();
        assert!(s.routes().unwrap().is_empty(), "{kind}");
        assert!(s.check().unwrap().is_empty(), "{kind}");
    }
}

#[test]
fn a_version_keeps_the_guest_path_and_the_source_it_was_deployed_with() {
    for mut store in stores("guest-path") {
        let s = &mut *store;
        let kind = s.describe();
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        let (a, b) = (b"component a".as_slice(), b"component b".as_slice());
        let (sa, sb) = (sha256_hex(a), sha256_hex(b));
        s.add_version(NewVersion { guest_path: GuestPath::Full, ..version("acme", "api", a, &sa, true) }).unwrap();
        let pulled = format!("oci://registry.example/acme/api@sha256:{sb}");
        s.add_version(NewVersion { source: &pulled, ..version("acme", "api", b, &sb, false) }).unwrap();
        s.set_canary("acme", "api", Some(Canary { version: 2, percent: 10, abort: None })).unwrap();
        let sources: Vec<String> = s.versions("acme", "api").unwrap().0.into_iter().map(|v| v.source).collect();
        assert_eq!(sources, [super::UPLOADED, pulled.as_str()], "{kind}");
        let paths: Vec<GuestPath> = s.versions("acme", "api").unwrap().0.iter().map(|v| v.guest_path).collect();
        assert_eq!(paths, [GuestPath::Full, GuestPath::Relative], "{kind}");
        assert_eq!(s.active_handlers().unwrap()[0].guest_path, GuestPath::Full, "{kind}");
        assert_eq!(s.canaries().unwrap()[0].0.guest_path, GuestPath::Relative, "{kind}");
    }
}

#[test]
fn registry_credentials_are_kept_per_tenant_replaced_forgotten_and_go_with_it() {
    for mut store in stores("registry-logins") {
        let s = &mut *store;
        let kind = s.describe();
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        s.create_tenant("globex", &LimitOverrides::default()).unwrap();
        let row = |user: &str| super::RegistryLoginRow { registry: "ghcr.io".into(), username: user.into(), updated_at: 1 };
        s.put_registry_login("acme", &row("ci"), b"sealed-1").unwrap();
        s.put_registry_login("acme", &row("bot"), b"sealed-2").unwrap();
        s.put_registry_login("globex", &row("other"), b"sealed-3").unwrap();
        assert_eq!(s.registry_logins("acme").unwrap(), [row("bot")], "{kind}: replaced, one per registry");
        assert_eq!(s.registry_login("acme", "ghcr.io").unwrap(), Some((row("bot"), b"sealed-2".to_vec())), "{kind}");
        assert_eq!(s.registry_login("acme", "quay.io").unwrap(), None, "{kind}");
        assert!(s.put_registry_login("nobody", &row("x"), b"s").is_err(), "{kind}: no tenant, no credentials");
        s.remove_registry_login("acme", "ghcr.io").unwrap();
        assert!(matches!(s.remove_registry_login("acme", "ghcr.io"), Err(StoreError::NotFound(_))), "{kind}");
        assert_eq!(s.registry_logins("globex").unwrap(), [row("other")], "{kind}: another tenant's stay");
        s.delete_tenant("globex").unwrap();
        s.create_tenant("globex", &LimitOverrides::default()).unwrap();
        assert!(s.registry_logins("globex").unwrap().is_empty(), "{kind}: deleted with the tenant");
    }
}

#[test]
fn settings_are_kept_per_tenant_and_handler_within_the_quota_and_go_with_the_tenant() {
    use super::{SettingQuota, SettingRow};
    for mut store in stores("settings") {
        let s = &mut *store;
        let kind = s.describe();
        s.create_tenant("acme", &LimitOverrides::default()).unwrap();
        s.create_tenant("globex", &LimitOverrides::default()).unwrap();
        let row = |tenant: &str, handler: &str, name: &str| SettingRow {
            tenant: tenant.into(),
            handler: handler.into(),
            name: name.into(),
            secret: false,
            updated_at: 1,
        };
        let quota = SettingQuota { count: 2, bytes: 10 };
        s.put_setting(&row("acme", "", "min_score"), b"0.5", quota).unwrap();
        s.put_setting(&row("acme", "detect", "min_score"), b"0.8", quota).unwrap();
        s.put_setting(&row("acme", "detect", "min_score"), b"0.9", quota).expect("a replacement is not a new setting");
        assert!(matches!(s.put_setting(&row("acme", "", "third"), b"x", quota), Err(StoreError::Quota(_))), "{kind}: past the count");
        assert!(
            matches!(s.put_setting(&row("acme", "", "min_score"), b"0123456789", quota), Err(StoreError::Quota(_))),
            "{kind}: past the bytes"
        );
        s.put_setting(&row("globex", "", "min_score"), b"0.1", quota).unwrap();
        let acme = s.settings(Some("acme")).unwrap();
        let values: Vec<(&str, &[u8])> = acme.iter().map(|s| (s.row.handler.as_str(), s.value.as_slice())).collect();
        assert_eq!(values, [("", b"0.5".as_slice()), ("detect", b"0.9".as_slice())], "{kind}");
        assert_eq!(acme[0].incarnation, s.tenant("acme").unwrap().incarnation, "{kind}: tied to this creation of the tenant");
        assert_eq!(s.settings(None).unwrap().len(), 3, "{kind}");
        s.remove_setting("acme", "detect", "min_score").unwrap();
        assert!(matches!(s.remove_setting("acme", "detect", "min_score"), Err(StoreError::NotFound(_))), "{kind}");
        s.delete_tenant("globex").unwrap();
        assert_eq!(s.settings(None).unwrap().len(), 1, "{kind}: deleted with the tenant");
    }
}

#[test]
fn models_keep_versions_one_active_and_their_files_until_removed() {
    for mut store in stores("models") {
        let s = &mut *store;
        let kind = s.describe();
        let (a, b) = (b"onnx a".as_slice(), b"onnx b".as_slice());
        let (sa, sb) = (sha256_hex(a), sha256_hex(b));
        let g0 = s.generation().unwrap();
        assert_eq!(s.add_model(small_model(&sa, a)).unwrap(), 1, "{kind}");
        assert_eq!(s.add_model(small_model(&sb, b)).unwrap(), 2, "{kind}");
        assert!(s.generation().unwrap() > g0, "{kind}: a model added is a change every node sees");
        let active: Vec<(i64, bool)> = s.models().unwrap().iter().map(|m| (m.version, m.active)).collect();
        assert_eq!(active, [(1, false), (2, true)], "{kind}: the newest is served");
        s.activate_model("small", 1).unwrap();
        let active: Vec<(i64, bool)> = s.models().unwrap().iter().map(|m| (m.version, m.active)).collect();
        assert_eq!(active, [(1, true), (2, false)], "{kind}");
        assert_eq!(s.model_bytes(&sb).unwrap(), b, "{kind}");
        assert!(matches!(s.activate_model("small", 3), Err(StoreError::NotFound(m)) if m.contains("no version 3")), "{kind}");
        assert!(matches!(s.activate_model("large", 1), Err(StoreError::NotFound(_))), "{kind}");
        s.remove_model("small").unwrap();
        assert!(s.models().unwrap().is_empty(), "{kind}");
        assert!(matches!(s.model_bytes(&sa), Err(StoreError::Internal(_))), "{kind}: the file goes with its last version");
        assert!(matches!(s.remove_model("small"), Err(StoreError::NotFound(_))), "{kind}");
    }
}

fn small_model<'a>(sha256: &'a str, bytes: &'a [u8]) -> NewModel<'a> {
    NewModel { name: "small", sha256, bytes, spec: "{}", accuracy: "{}" }
}
