//! State in the single node's SQLite file (the tables of migration 0011):
//! each connection of the pool opens the file. SQLite has one writer: the
//! pool's connections take their turns at writing through one lock of
//! their own (`writer`), so at most one of them waits in SQLite's busy
//! handler beside the control plane's store, and a write transaction
//! begins `IMMEDIATE`, taking the database's write lock at once.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rusqlite::{Connection, ErrorCode, OptionalExtension, Transaction, TransactionBehavior, params};

use super::{BucketRow, Conn, Entry, KvError, KvResult, Owner, Totals, Tx, as_i64, as_u64, read_within};

/// A connection to the store's SQLite file.
pub struct SqliteConn {
    conn: Connection,
    /// Shared by the pool's connections: one writes at a time.
    writer: Arc<Mutex<()>>,
}

impl SqliteConn {
    /// Opens the database at `path` (the control-plane store made it and
    /// its tables); `writer` is the pool's lock for writing.
    pub fn open(path: &Path, writer: Arc<Mutex<()>>) -> anyhow::Result<Self> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        Ok(Self { conn, writer })
    }
}

/// A database error as a state error: a foreign key refused means the
/// tenant is not this creation of it; a lock not had in time, busy; a
/// failing file, the connection's end; the rest, one statement's.
fn db_error(e: rusqlite::Error) -> KvError {
    match e.sqlite_error() {
        Some(f) if f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_FOREIGNKEY => KvError::Gone,
        Some(f) if matches!(f.code, ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => {
            KvError::Busy("the state store is busy; retry".into())
        }
        Some(f)
            if matches!(
                f.code,
                ErrorCode::SystemIoFailure | ErrorCode::CannotOpen | ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt
            ) =>
        {
            KvError::Store(e.to_string())
        }
        _ => KvError::Failed(e.to_string()),
    }
}

const OWNED: &str = "JOIN kv_tenants t ON t.tenant = kv.tenant WHERE kv.tenant = ?1 AND t.incarnation = ?2";

impl Conn for SqliteConn {
    fn begin(&mut self) -> KvResult<Box<dyn Tx + '_>> {
        let Self { conn, writer } = self;
        let turn = writer.lock().unwrap_or_else(PoisonError::into_inner);
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(db_error)?;
        Ok(Box::new(SqliteTx { tx, _turn: turn }))
    }

    fn entries(&mut self, owner: &Owner, bucket: &str, keys: &[String], most_bytes: u64) -> KvResult<Vec<Option<Entry>>> {
        let sql = format!("SELECT kv.value, kv.version FROM kv {OWNED} AND kv.bucket = ?3 AND kv.key = ?4");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(db_error)?;
        read_within(keys, most_bytes, |key| {
            stmt.query_row(params![&*owner.tenant, &*owner.incarnation, bucket, key], |r| {
                Ok(Entry { value: r.get(0)?, version: r.get(1)? })
            })
            .optional()
            .map_err(db_error)
        })
    }

    fn exists(&mut self, owner: &Owner, bucket: &str, key: &str) -> KvResult<bool> {
        let sql = format!("SELECT 1 FROM kv {OWNED} AND kv.bucket = ?3 AND kv.key = ?4");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(db_error)?;
        stmt.exists(params![&*owner.tenant, &*owner.incarnation, bucket, key]).map_err(db_error)
    }

    fn keys(&mut self, owner: &Owner, bucket: &str, after: Option<&str>, limit: usize) -> KvResult<Vec<String>> {
        let sql = format!("SELECT kv.key FROM kv {OWNED} AND kv.bucket = ?3 AND kv.key > ?4 ORDER BY kv.key LIMIT ?5");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(db_error)?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = stmt
            .query_map(params![&*owner.tenant, &*owner.incarnation, bucket, after.unwrap_or(""), limit], |r| r.get(0))
            .map_err(db_error)?;
        rows.collect::<Result<_, _>>().map_err(db_error)
    }

    fn buckets(&mut self, owner: &Owner) -> KvResult<Vec<BucketRow>> {
        let sql = format!(
            "SELECT kv.bucket, COUNT(*), SUM(LENGTH(kv.bucket) + LENGTH(CAST(kv.key AS BLOB)) + LENGTH(kv.value)) FROM kv {OWNED} \
             GROUP BY kv.bucket ORDER BY kv.bucket"
        );
        let mut stmt = self.conn.prepare_cached(&sql).map_err(db_error)?;
        let rows = stmt
            .query_map(params![&*owner.tenant, &*owner.incarnation], |r| {
                Ok(BucketRow { name: r.get(0)?, keys: as_u64(r.get(1)?), bytes: as_u64(r.get(2)?) })
            })
            .map_err(db_error)?;
        rows.collect::<Result<_, _>>().map_err(db_error)
    }

    fn totals(&mut self, owner: &Owner) -> KvResult<Totals> {
        let mut stmt =
            self.conn.prepare_cached("SELECT keys, bytes FROM kv_tenants WHERE tenant = ?1 AND incarnation = ?2").map_err(db_error)?;
        let row = stmt
            .query_row(params![&*owner.tenant, &*owner.incarnation], |r| Ok(Totals { keys: as_u64(r.get(0)?), bytes: as_u64(r.get(1)?) }))
            .optional()
            .map_err(db_error)?;
        Ok(row.unwrap_or_default())
    }
}

/// A write transaction on SQLite, during the connection's turn at writing.
struct SqliteTx<'c> {
    tx: Transaction<'c>,
    _turn: MutexGuard<'c, ()>,
}

impl Tx for SqliteTx<'_> {
    fn lock(&mut self, owner: &Owner) -> KvResult<Totals> {
        self.tx
            .prepare_cached(
                "INSERT INTO kv_tenants (tenant, incarnation, keys, bytes) VALUES (?1, ?2, 0, 0) ON CONFLICT (tenant) DO NOTHING",
            )
            .and_then(|mut s| s.execute(params![&*owner.tenant, &*owner.incarnation]))
            .map_err(db_error)?;
        let mut stmt = self.tx.prepare_cached("SELECT incarnation, keys, bytes FROM kv_tenants WHERE tenant = ?1").map_err(db_error)?;
        let row: Option<(String, i64, i64)> =
            stmt.query_row([&*owner.tenant], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).optional().map_err(db_error)?;
        // None: the tenant's deletion took its row in between.
        let Some((_, keys, bytes)) = row.filter(|(incarnation, ..)| *incarnation == *owner.incarnation) else {
            return Err(KvError::Gone);
        };
        Ok(Totals { keys: as_u64(keys), bytes: as_u64(bytes) })
    }

    fn size(&mut self, tenant: &str, bucket: &str, key: &str) -> KvResult<Option<(u64, i64)>> {
        let mut stmt = self
            .tx
            .prepare_cached("SELECT LENGTH(CAST(key AS BLOB)) + LENGTH(bucket) + LENGTH(value), version FROM kv WHERE tenant = ?1 AND bucket = ?2 AND key = ?3")
            .map_err(db_error)?;
        let row = stmt.query_row(params![tenant, bucket, key], |r| Ok((r.get::<_, i64>(0)?, r.get(1)?))).optional().map_err(db_error)?;
        Ok(row.map(|(size, version)| (as_u64(size), version)))
    }

    fn entry(&mut self, tenant: &str, bucket: &str, key: &str) -> KvResult<Option<Entry>> {
        let mut stmt =
            self.tx.prepare_cached("SELECT value, version FROM kv WHERE tenant = ?1 AND bucket = ?2 AND key = ?3").map_err(db_error)?;
        stmt.query_row(params![tenant, bucket, key], |r| Ok(Entry { value: r.get(0)?, version: r.get(1)? })).optional().map_err(db_error)
    }

    fn put(&mut self, tenant: &str, bucket: &str, key: &str, value: &[u8], version: i64) -> KvResult<()> {
        let mut stmt = self
            .tx
            .prepare_cached(
                "INSERT INTO kv (tenant, bucket, key, value, version, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, unixepoch()) \
                 ON CONFLICT (tenant, bucket, key) DO UPDATE SET value = excluded.value, version = excluded.version, updated_at = excluded.updated_at",
            )
            .map_err(db_error)?;
        stmt.execute(params![tenant, bucket, key, value, version]).map_err(db_error)?;
        Ok(())
    }

    fn remove(&mut self, tenant: &str, bucket: &str, key: &str) -> KvResult<()> {
        let mut stmt = self.tx.prepare_cached("DELETE FROM kv WHERE tenant = ?1 AND bucket = ?2 AND key = ?3").map_err(db_error)?;
        stmt.execute(params![tenant, bucket, key]).map_err(db_error)?;
        Ok(())
    }

    fn remove_bucket(&mut self, tenant: &str, bucket: &str) -> KvResult<Totals> {
        let (keys, bytes): (i64, Option<i64>) = self
            .tx
            .query_row(
                "SELECT COUNT(*), SUM(LENGTH(CAST(key AS BLOB)) + LENGTH(bucket) + LENGTH(value)) FROM kv WHERE tenant = ?1 AND bucket = ?2",
                params![tenant, bucket],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(db_error)?;
        self.tx.execute("DELETE FROM kv WHERE tenant = ?1 AND bucket = ?2", params![tenant, bucket]).map_err(db_error)?;
        Ok(Totals { keys: as_u64(keys), bytes: as_u64(bytes.unwrap_or(0)) })
    }

    fn set_totals(&mut self, tenant: &str, totals: Totals) -> KvResult<()> {
        let mut stmt = self.tx.prepare_cached("UPDATE kv_tenants SET keys = ?2, bytes = ?3 WHERE tenant = ?1").map_err(db_error)?;
        stmt.execute(params![tenant, as_i64(totals.keys), as_i64(totals.bytes)]).map_err(db_error)?;
        Ok(())
    }

    fn commit(self: Box<Self>) -> KvResult<()> {
        self.tx.commit().map_err(db_error)
    }
}
