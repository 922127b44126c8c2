//! One behaviour, two databases: each test runs on SQLite and on a real
//! (throw-away) PostgreSQL, through the same connections the pool uses.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::admission::limits::LimitOverrides;
use crate::control::store::Store;
use crate::control::store::tests::fresh_database;

const QUOTA: Quota = Quota { keys: 100, bytes: 10_000, value_bytes: 1_000 };

/// A store (for tenants) and how to connect to its state, on each database.
struct Backend {
    store: Box<dyn Store>,
    url: Option<String>,
    dir: std::path::PathBuf,
    /// SQLite connections' turn at writing, as a pool shares it.
    writer: Arc<std::sync::Mutex<()>>,
}

impl Backend {
    fn all(name: &str) -> Vec<Backend> {
        let sqlite = Self::sqlite(name);
        let url = fresh_database(&format!("kv_{name}"));
        let pg = crate::control::store::open(Some(&url), &sqlite.dir).unwrap();
        let dir = sqlite.dir.clone();
        vec![sqlite, Backend { store: pg, url: Some(url), dir, writer: Arc::default() }]
    }

    fn sqlite(name: &str) -> Backend {
        let dir = std::env::temp_dir().join(format!("facegate-kv-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Backend { store: crate::control::store::open(None, &dir).unwrap(), url: None, dir, writer: Arc::default() }
    }

    fn conn(&self) -> Box<dyn Conn> {
        match &self.url {
            Some(url) => Box::new(postgres::PgConn::connect(&crate::control::store::postgres::client_config(url).unwrap()).unwrap()),
            None => Box::new(sqlite::SqliteConn::open(&self.dir.join(crate::control::store::DB_FILE), Arc::clone(&self.writer)).unwrap()),
        }
    }

    fn pool(&self, workers: usize) -> Arc<KvPool> {
        assert!(self.url.is_none(), "SQLite only: the blocking PostgreSQL client would not start inside a test's runtime");
        KvPool::sqlite(self.dir.join(crate::control::store::DB_FILE), workers).unwrap()
    }

    /// Creates `tenant`; its owner.
    fn tenant(&mut self, tenant: &str) -> Owner {
        self.store.create_tenant(tenant, &LimitOverrides::default()).unwrap();
        let row = self.store.tenant(tenant).unwrap();
        Owner { tenant: tenant.into(), incarnation: row.incarnation.into() }
    }
}

fn items(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec())).collect()
}

fn value(conn: &mut dyn Conn, owner: &Owner, bucket: &str, key: &str) -> Option<Vec<u8>> {
    conn.entries(owner, bucket, &[key.to_owned()], u64::MAX).unwrap().pop().flatten().map(|e| e.value)
}

#[test]
fn two_tenants_with_the_same_bucket_and_key_names_see_their_own_values() {
    for mut b in Backend::all("isolation") {
        let (a, z) = (b.tenant("a"), b.tenant("z"));
        let mut conn = b.conn();
        set_many(conn.as_mut(), &a, QUOTA, "cache", &items(&[("k", "from a"), ("j", "1")])).unwrap();
        set_many(conn.as_mut(), &z, QUOTA, "cache", &items(&[("k", "from z")])).unwrap();
        assert_eq!(value(conn.as_mut(), &a, "cache", "k").as_deref(), Some(&b"from a"[..]));
        assert_eq!(value(conn.as_mut(), &z, "cache", "k").as_deref(), Some(&b"from z"[..]));
        assert_eq!(conn.keys(&a, "cache", None, 10).unwrap(), ["j", "k"]);
        assert_eq!(conn.keys(&z, "cache", None, 10).unwrap(), ["k"]);
        assert_eq!(conn.keys(&a, "cache", Some("j"), 10).unwrap(), ["k"], "the cursor");
        assert!(!conn.exists(&z, "cache", "j").unwrap());
        delete_many(conn.as_mut(), &z, "cache", &["k".into(), "j".into()]).unwrap();
        assert_eq!(value(conn.as_mut(), &a, "cache", "k").as_deref(), Some(&b"from a"[..]), "z's delete leaves a's key");
        let totals = conn.totals(&a).unwrap();
        assert_eq!(totals, Totals { keys: 2, bytes: stored_size("cache", "k", 6) + stored_size("cache", "j", 1) });
        assert_eq!(conn.totals(&z).unwrap(), Totals::default());
        assert_eq!(conn.buckets(&a).unwrap(), [BucketRow { name: "cache".into(), keys: 2, bytes: totals.bytes }]);
    }
}

#[test]
fn writes_past_the_tenants_bounds_are_refused_and_a_tenant_over_them_may_still_shrink() {
    for mut b in Backend::all("quota") {
        let owner = b.tenant("t");
        let mut conn = b.conn();
        let tight = Quota { keys: 2, bytes: 80, value_bytes: 40 };
        set_many(conn.as_mut(), &owner, tight, "b", &items(&[("one", "x"), ("two", "y")])).unwrap();
        let refused = set_many(conn.as_mut(), &owner, tight, "b", &items(&[("three", "z")])).unwrap_err();
        assert!(matches!(&refused, KvError::Limit(m) if m.contains("kv_keys")), "{refused}");
        let big = "v".repeat(41);
        let refused = set_many(conn.as_mut(), &owner, tight, "b", &items(&[("one", &big)])).unwrap_err();
        assert!(matches!(&refused, KvError::Limit(m) if m.contains("kv_value_bytes")), "{refused}");
        let refused =
            set_many(conn.as_mut(), &owner, tight, "b", &items(&[("one", &"v".repeat(40)), ("two", &"w".repeat(40))])).unwrap_err();
        assert!(matches!(&refused, KvError::Limit(m) if m.contains("kv_bytes")), "{refused}");
        assert_eq!(value(conn.as_mut(), &owner, "b", "one").as_deref(), Some(&b"x"[..]), "a refused batch writes nothing");
        // A read stops once it passes what its caller could hold, a key asked for twice counting twice.
        let twice = conn.entries(&owner, "b", &["one".into(), "one".into()], 1);
        assert!(matches!(twice, Err(KvError::Limit(_))), "{twice:?}");
        assert!(conn.entries(&owner, "b", &["one".into()], 1).is_ok(), "what was charged may be read");
        // Bounds lowered under what it holds: overwriting smaller and deleting still work.
        let lowered = Quota { keys: 1, bytes: 5, value_bytes: 40 };
        set_many(conn.as_mut(), &owner, lowered, "b", &items(&[("one", "")])).unwrap();
        delete_many(conn.as_mut(), &owner, "b", &["two".into()]).unwrap();
        assert_eq!(conn.totals(&owner).unwrap(), Totals { keys: 1, bytes: stored_size("b", "one", 0) });
        assert!(matches!(check_bucket("no/slash"), Err(KvError::Invalid(_))));
        assert!(matches!(check_key(&"k".repeat(MAX_KEY_BYTES + 1)), Err(KvError::Invalid(_))));
        assert!(matches!(check_key("nul\0"), Err(KvError::Invalid(_))));
    }
}

#[test]
fn increments_from_many_connections_at_once_are_exact() {
    for mut b in Backend::all("increment") {
        let owner = b.tenant("t");
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (mut conn, owner) = (b.conn(), owner.clone());
                std::thread::spawn(move || {
                    for _ in 0..25 {
                        increment(conn.as_mut(), &owner, QUOTA, "counters", "hits", 1).unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let mut conn = b.conn();
        assert_eq!(value(conn.as_mut(), &owner, "counters", "hits").as_deref(), Some(&b"200"[..]));
        assert_eq!(increment(conn.as_mut(), &owner, QUOTA, "counters", "hits", -201).unwrap().0, -1);
        set_many(conn.as_mut(), &owner, QUOTA, "counters", &items(&[("text", "not a number")])).unwrap();
        assert!(matches!(increment(conn.as_mut(), &owner, QUOTA, "counters", "text", 1), Err(KvError::Invalid(_))));
        set_many(conn.as_mut(), &owner, QUOTA, "counters", &items(&[("max", &i64::MAX.to_string())])).unwrap();
        assert!(
            matches!(increment(conn.as_mut(), &owner, QUOTA, "counters", "max", 1), Err(KvError::Invalid(m)) if m.contains("overflow"))
        );
    }
}

#[test]
fn a_swap_on_a_stale_read_fails_with_the_fresh_value_and_succeeds_on_it() {
    for mut b in Backend::all("cas") {
        let owner = b.tenant("t");
        let mut conn = b.conn();
        let read = |conn: &mut dyn Conn| Cas {
            bucket: "b".into(),
            key: "k".into(),
            current: conn.entries(&owner, "b", &["k".into()], u64::MAX).unwrap().pop().flatten(),
        };
        let absent = read(conn.as_mut());
        assert!(compare_and_swap(conn.as_mut(), &owner, QUOTA, &absent, b"first").unwrap().is_ok(), "absent, as read");
        let fresh = match compare_and_swap(conn.as_mut(), &owner, QUOTA, &absent, b"second").unwrap() {
            Err(fresh) => fresh,
            Ok(_) => panic!("a swap on a stale read succeeded"),
        };
        assert_eq!(fresh.current.as_ref().map(|e| e.value.as_slice()), Some(&b"first"[..]));
        assert!(compare_and_swap(conn.as_mut(), &owner, QUOTA, &fresh, b"second").unwrap().is_ok());
        // Deleted and written again: its version restarts, its value differs.
        let stale = read(conn.as_mut());
        delete_many(conn.as_mut(), &owner, "b", &["k".into()]).unwrap();
        set_many(conn.as_mut(), &owner, QUOTA, "b", &items(&[("k", "other")])).unwrap();
        assert!(compare_and_swap(conn.as_mut(), &owner, QUOTA, &stale, b"lost").unwrap().is_err());
        assert_eq!(value(conn.as_mut(), &owner, "b", "k").as_deref(), Some(&b"other"[..]));
    }
}

#[test]
fn deleting_a_tenant_deletes_its_state_and_its_old_requests_cannot_write_into_the_new_one() {
    for mut b in Backend::all("gone") {
        let old = b.tenant("t");
        let mut conn = b.conn();
        set_many(conn.as_mut(), &old, QUOTA, "b", &items(&[("k", "v")])).unwrap();
        b.store.delete_tenant("t").unwrap();
        assert!(matches!(set_many(conn.as_mut(), &old, QUOTA, "b", &items(&[("k", "v")])), Err(KvError::Gone)));
        let new = b.tenant("t");
        assert_eq!(value(conn.as_mut(), &new, "b", "k"), None, "created again: empty");
        assert_eq!(conn.totals(&new).unwrap(), Totals::default());
        assert!(matches!(increment(conn.as_mut(), &old, QUOTA, "b", "k", 1), Err(KvError::Gone)), "the old creation's request");
        assert_eq!(value(conn.as_mut(), &old, "b", "k"), None);
        set_many(conn.as_mut(), &new, QUOTA, "b", &items(&[("k", "new")])).unwrap();
        assert_eq!(value(conn.as_mut(), &old, "b", "k"), None, "the old creation reads nothing of the new one's");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_holding_its_share_of_the_pool_leaves_the_rest_to_others() {
    // SQLite: the blocking PostgreSQL client would not start inside the test's runtime.
    let b = &mut Backend::sqlite("pool");
    let (a, z) = (b.tenant("a"), b.tenant("z"));
    let pool = b.pool(2);
    assert_eq!(pool.per_tenant(), 1, "a quarter of the workers, at least one");
    let deadline = Instant::now() + Duration::from_secs(10);
    let (hold, held) = std::sync::mpsc::channel::<()>();
    let slow = {
        let (pool, tenant) = (Arc::clone(&pool), Arc::clone(&a.tenant));
        tokio::spawn(async move { pool.run(&tenant, deadline, move |_| held.recv().map_err(|_| KvError::Store("dropped".into()))).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // a's second call waits for a's place; z's call goes through.
    let soon = Instant::now() + Duration::from_millis(300);
    let waited = pool.run(&a.tenant, soon, |_| Ok(())).await;
    assert!(matches!(waited, Err(KvError::Busy(_))), "{waited:?}");
    let owner = z.clone();
    let totals = pool.run(&z.tenant, deadline, move |conn| set_many(conn, &owner, QUOTA, "b", &items(&[("k", "v")]))).await.unwrap();
    assert_eq!(totals.keys, 1);
    hold.send(()).unwrap();
    slow.await.unwrap().unwrap();
}
