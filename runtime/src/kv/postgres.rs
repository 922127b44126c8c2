//! State in the cluster's PostgreSQL (the tables of migration 0011): a
//! write transaction locks the tenant's `kv_tenants` row (`FOR UPDATE`),
//! so a tenant's writes from every node queue there.

use postgres::error::SqlState;
use postgres::{Client, Config, Transaction};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{BucketRow, Conn, Entry, KvError, KvResult, Owner, Totals, Tx, as_i64, as_u64, read_within};

/// A connection to the cluster's database.
pub struct PgConn(Client);

impl PgConn {
    /// Connects with the store's settings (see `control::store::postgres::client_config`).
    pub fn connect((config, tls): &(Config, MakeRustlsConnect)) -> anyhow::Result<Self> {
        Ok(Self(config.connect(tls.clone())?))
    }
}

/// A database error as a state error: a foreign key refused means the
/// tenant is not this creation of it; a lock or statement past its
/// timeout, busy; bad data (class 22), the caller's; another error of the
/// server's, one statement's (the connection stays); a connection gone or
/// failing, the connection's end.
fn db_error(e: postgres::Error) -> KvError {
    let busy = [SqlState::LOCK_NOT_AVAILABLE, SqlState::QUERY_CANCELED, SqlState::T_R_DEADLOCK_DETECTED];
    let ending = [SqlState::ADMIN_SHUTDOWN, SqlState::CANNOT_CONNECT_NOW];
    match e.code() {
        _ if e.is_closed() || e.as_db_error().is_none() => KvError::Store(e.to_string()),
        Some(code) if *code == SqlState::FOREIGN_KEY_VIOLATION => KvError::Gone,
        Some(code) if busy.contains(code) => KvError::Busy("the state store is busy; retry".into()),
        Some(code) if code.code().starts_with("22") => KvError::Invalid("the state store refused the data of this call".into()),
        Some(code) if ending.contains(code) => KvError::Store(e.to_string()),
        _ => KvError::Failed(e.to_string()),
    }
}

const OWNED: &str = "JOIN kv_tenants t ON t.tenant = kv.tenant WHERE kv.tenant = $1 AND t.incarnation = $2";

impl Conn for PgConn {
    fn begin(&mut self) -> KvResult<Box<dyn Tx + '_>> {
        Ok(Box::new(PgTx(self.0.transaction().map_err(db_error)?)))
    }

    fn entries(&mut self, owner: &Owner, bucket: &str, keys: &[String], most_bytes: u64) -> KvResult<Vec<Option<Entry>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!("SELECT kv.value, kv.version FROM kv {OWNED} AND kv.bucket = $3 AND kv.key = $4");
        let stmt = self.0.prepare(&sql).map_err(db_error)?;
        read_within(keys, most_bytes, |key| {
            let row = self.0.query_opt(&stmt, &[&&*owner.tenant, &&*owner.incarnation, &bucket, &key]).map_err(db_error)?;
            Ok(row.map(|r| Entry { value: r.get(0), version: r.get(1) }))
        })
    }

    fn exists(&mut self, owner: &Owner, bucket: &str, key: &str) -> KvResult<bool> {
        let sql = format!("SELECT 1 FROM kv {OWNED} AND kv.bucket = $3 AND kv.key = $4");
        Ok(self.0.query_opt(&sql, &[&&*owner.tenant, &&*owner.incarnation, &bucket, &key]).map_err(db_error)?.is_some())
    }

    fn keys(&mut self, owner: &Owner, bucket: &str, after: Option<&str>, limit: usize) -> KvResult<Vec<String>> {
        let sql = format!("SELECT kv.key FROM kv {OWNED} AND kv.bucket = $3 AND kv.key > $4 ORDER BY kv.key LIMIT $5");
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.0.query(&sql, &[&&*owner.tenant, &&*owner.incarnation, &bucket, &after.unwrap_or(""), &limit]).map_err(db_error)?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    fn buckets(&mut self, owner: &Owner) -> KvResult<Vec<BucketRow>> {
        let sql = format!(
            "SELECT kv.bucket, COUNT(*), SUM(OCTET_LENGTH(kv.bucket) + OCTET_LENGTH(kv.key) + OCTET_LENGTH(kv.value))::BIGINT FROM kv {OWNED} \
             GROUP BY kv.bucket ORDER BY kv.bucket"
        );
        let rows = self.0.query(&sql, &[&&*owner.tenant, &&*owner.incarnation]).map_err(db_error)?;
        Ok(rows.iter().map(|r| BucketRow { name: r.get(0), keys: as_u64(r.get(1)), bytes: as_u64(r.get(2)) }).collect())
    }

    fn totals(&mut self, owner: &Owner) -> KvResult<Totals> {
        let row = self
            .0
            .query_opt(
                "SELECT keys, bytes FROM kv_tenants WHERE tenant = $1 AND incarnation = $2",
                &[&&*owner.tenant, &&*owner.incarnation],
            )
            .map_err(db_error)?;
        Ok(row.map(|r| Totals { keys: as_u64(r.get(0)), bytes: as_u64(r.get(1)) }).unwrap_or_default())
    }
}

/// A write transaction on PostgreSQL.
struct PgTx<'c>(Transaction<'c>);

impl Tx for PgTx<'_> {
    fn lock(&mut self, owner: &Owner) -> KvResult<Totals> {
        let (tenant, incarnation) = (&*owner.tenant, &*owner.incarnation);
        self.0
            .execute(
                "INSERT INTO kv_tenants (tenant, incarnation, keys, bytes) VALUES ($1, $2, 0, 0) ON CONFLICT (tenant) DO NOTHING",
                &[&tenant, &incarnation],
            )
            .map_err(db_error)?;
        let row = self
            .0
            .query_opt("SELECT incarnation, keys, bytes FROM kv_tenants WHERE tenant = $1 FOR UPDATE", &[&tenant])
            .map_err(db_error)?;
        // None: the tenant's deletion took its row in between.
        let Some(row) = row.filter(|row| row.get::<_, &str>(0) == incarnation) else {
            return Err(KvError::Gone);
        };
        Ok(Totals { keys: as_u64(row.get(1)), bytes: as_u64(row.get(2)) })
    }

    fn size(&mut self, tenant: &str, bucket: &str, key: &str) -> KvResult<Option<(u64, i64)>> {
        let row = self
            .0
            .query_opt(
                "SELECT (OCTET_LENGTH(bucket) + OCTET_LENGTH(key) + OCTET_LENGTH(value))::BIGINT, version FROM kv \
                 WHERE tenant = $1 AND bucket = $2 AND key = $3",
                &[&tenant, &bucket, &key],
            )
            .map_err(db_error)?;
        Ok(row.map(|r| (as_u64(r.get(0)), r.get(1))))
    }

    fn entry(&mut self, tenant: &str, bucket: &str, key: &str) -> KvResult<Option<Entry>> {
        let row = self
            .0
            .query_opt("SELECT value, version FROM kv WHERE tenant = $1 AND bucket = $2 AND key = $3", &[&tenant, &bucket, &key])
            .map_err(db_error)?;
        Ok(row.map(|r| Entry { value: r.get(0), version: r.get(1) }))
    }

    fn put(&mut self, tenant: &str, bucket: &str, key: &str, value: &[u8], version: i64) -> KvResult<()> {
        self.0
            .execute(
                "INSERT INTO kv (tenant, bucket, key, value, version, updated_at) \
                 VALUES ($1, $2, $3, $4, $5, EXTRACT(EPOCH FROM now())::BIGINT) \
                 ON CONFLICT (tenant, bucket, key) DO UPDATE SET value = excluded.value, version = excluded.version, updated_at = excluded.updated_at",
                &[&tenant, &bucket, &key, &value, &version],
            )
            .map_err(db_error)?;
        Ok(())
    }

    fn remove(&mut self, tenant: &str, bucket: &str, key: &str) -> KvResult<()> {
        self.0.execute("DELETE FROM kv WHERE tenant = $1 AND bucket = $2 AND key = $3", &[&tenant, &bucket, &key]).map_err(db_error)?;
        Ok(())
    }

    fn remove_bucket(&mut self, tenant: &str, bucket: &str) -> KvResult<Totals> {
        let row = self
            .0
            .query_one(
                "WITH gone AS (DELETE FROM kv WHERE tenant = $1 AND bucket = $2 \
                 RETURNING OCTET_LENGTH(bucket) + OCTET_LENGTH(key) + OCTET_LENGTH(value) AS size) \
                 SELECT COUNT(*), COALESCE(SUM(size), 0)::BIGINT FROM gone",
                &[&tenant, &bucket],
            )
            .map_err(db_error)?;
        Ok(Totals { keys: as_u64(row.get(0)), bytes: as_u64(row.get(1)) })
    }

    fn set_totals(&mut self, tenant: &str, totals: Totals) -> KvResult<()> {
        self.0
            .execute(
                "UPDATE kv_tenants SET keys = $2, bytes = $3 WHERE tenant = $1",
                &[&tenant, &as_i64(totals.keys), &as_i64(totals.bytes)],
            )
            .map_err(db_error)?;
        Ok(())
    }

    fn commit(self: Box<Self>) -> KvResult<()> {
        self.0.commit().map_err(db_error)
    }
}
