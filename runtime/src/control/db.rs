//! The SQLite store: tenants, hashed API keys, handlers, versions and
//! precompiled-artifact records. WAL journal, `synchronous=FULL`: a commit
//! is on disk when it returns.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;

use super::limits::LimitOverrides;

/// Schema version written to `PRAGMA user_version`.
const SCHEMA_VERSION: i64 = 1;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    limits TEXT NOT NULL DEFAULT '{}',
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    secret_sha256 TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
);
CREATE TABLE IF NOT EXISTS handlers (
    tenant TEXT NOT NULL REFERENCES tenants(name) ON DELETE CASCADE,
    name TEXT NOT NULL,
    active_version INTEGER,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE IF NOT EXISTS versions (
    tenant TEXT NOT NULL,
    handler TEXT NOT NULL,
    version INTEGER NOT NULL,
    component_sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, handler, version),
    FOREIGN KEY (tenant, handler) REFERENCES handlers(tenant, name) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS artifacts (
    component_sha256 TEXT NOT NULL,
    engine TEXT NOT NULL,
    artifact_sha256 TEXT NOT NULL,
    PRIMARY KEY (component_sha256, engine)
);
";

/// Why a store operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The named thing does not exist.
    #[error("{0}")]
    NotFound(String),
    /// It exists already, or the request conflicts with the current state.
    #[error("{0}")]
    Conflict(String),
    /// The request is malformed or refused by validation.
    #[error("{0}")]
    Invalid(String),
    /// The gateway cannot take this now (uploads compiling); retry later.
    #[error("{0}")]
    Busy(String),
    /// The store itself failed (disk, database).
    #[error("store failure: {0:#}")]
    Internal(#[from] anyhow::Error),
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Internal(e.into())
    }
}

/// Result of store operations.
pub type StoreResult<T> = Result<T, StoreError>;

/// A tenant row.
#[derive(Debug, Clone, Serialize)]
pub struct TenantRow {
    /// Name (also the first path segment of its routes).
    pub name: String,
    /// Limits it overrides.
    pub overrides: LimitOverrides,
    /// Unix seconds.
    pub created_at: i64,
}

/// An API key row (never the key itself).
#[derive(Debug, Clone, Serialize)]
pub struct KeyRow {
    /// Public key id.
    pub id: String,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds, if revoked.
    pub revoked_at: Option<i64>,
}

/// A handler version row.
#[derive(Debug, Clone, Serialize)]
pub struct VersionRow {
    /// 1, 2, ... per handler.
    pub version: i64,
    /// SHA-256 of the component bytes.
    pub sha256: String,
    /// Component size, bytes.
    pub size: i64,
    /// Unix seconds.
    pub created_at: i64,
}

/// An active handler: what the data plane serves.
#[derive(Debug, Clone)]
pub struct ActiveHandler {
    /// Owning tenant.
    pub tenant: String,
    /// Handler name.
    pub handler: String,
    /// Active version.
    pub version: i64,
    /// Its component's SHA-256.
    pub sha256: String,
}

/// The database connection.
pub struct Db {
    conn: Connection,
}

fn now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

impl Db {
    /// Opens (creating) the database at `path`.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            anyhow::bail!("{} has schema version {version}; this facegate knows {SCHEMA_VERSION}", path.display());
        }
        conn.execute_batch(SCHEMA)?;
        conn.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        Ok(Self { conn })
    }

    /// All tenants, by name.
    pub fn tenants(&self) -> StoreResult<Vec<TenantRow>> {
        self.select_tenants("SELECT name, limits, created_at FROM tenants ORDER BY name", &[])
    }

    /// One tenant.
    pub fn tenant(&self, name: &str) -> StoreResult<TenantRow> {
        self.select_tenants("SELECT name, limits, created_at FROM tenants WHERE name = ?1", &[&name])?
            .pop()
            .ok_or_else(|| StoreError::NotFound(format!("no tenant {name:?}")))
    }

    fn select_tenants(&self, sql: &str, args: &[&dyn rusqlite::ToSql]) -> StoreResult<Vec<TenantRow>> {
        let mut stmt = self.conn.prepare(sql)?;
        let rows = stmt.query_map(args, |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get(2)?)))?;
        rows.map(|row| {
            let (name, limits, created_at) = row?;
            let overrides = serde_json::from_str(&limits).map_err(|e| anyhow::anyhow!("limits of {name}: {e}"))?;
            Ok(TenantRow { name, overrides, created_at })
        })
        .collect()
    }

    /// Creates a tenant.
    pub fn create_tenant(&self, name: &str, overrides: &LimitOverrides) -> StoreResult<()> {
        let limits = serde_json::to_string(overrides).map_err(anyhow::Error::from)?;
        let inserted = self.conn.execute(
            "INSERT INTO tenants (name, limits, created_at) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
            params![name, limits, now()],
        )?;
        if inserted == 0 {
            return Err(StoreError::Conflict(format!("tenant {name:?} exists")));
        }
        Ok(())
    }

    /// Replaces a tenant's overrides.
    pub fn set_limits(&self, name: &str, overrides: &LimitOverrides) -> StoreResult<()> {
        let limits = serde_json::to_string(overrides).map_err(anyhow::Error::from)?;
        let updated = self.conn.execute("UPDATE tenants SET limits = ?2 WHERE name = ?1", params![name, limits])?;
        if updated == 0 {
            return Err(StoreError::NotFound(format!("no tenant {name:?}")));
        }
        Ok(())
    }

    /// Deletes a tenant with its keys, handlers and versions (component
    /// blobs stay: they are content-addressed and may be shared).
    pub fn delete_tenant(&self, name: &str) -> StoreResult<()> {
        if self.conn.execute("DELETE FROM tenants WHERE name = ?1", [name])? == 0 {
            return Err(StoreError::NotFound(format!("no tenant {name:?}")));
        }
        Ok(())
    }

    /// Whether no tenant exists yet (a fresh store).
    pub fn is_empty(&self) -> StoreResult<bool> {
        Ok(self.conn.query_row("SELECT COUNT(*) FROM tenants", [], |r| r.get::<_, i64>(0))? == 0)
    }

    /// A store-wide setting.
    pub fn meta(&self, key: &str) -> StoreResult<Option<String>> {
        Ok(self.conn.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0)).optional()?)
    }

    /// Sets a store-wide setting.
    pub fn set_meta(&self, key: &str, value: &str) -> StoreResult<()> {
        self.conn.execute(
            "INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            params![key, value],
        )?;
        Ok(())
    }

    /// Records a key for `tenant`.
    pub fn insert_key(&self, tenant: &str, id: &str, secret_sha256: &str) -> StoreResult<i64> {
        self.tenant(tenant)?;
        let created_at = now();
        self.conn.execute(
            "INSERT INTO api_keys (id, tenant, secret_sha256, created_at) VALUES (?1, ?2, ?3, ?4)",
            params![id, tenant, secret_sha256, created_at],
        )?;
        Ok(created_at)
    }

    /// A tenant's keys, newest first.
    pub fn keys(&self, tenant: &str) -> StoreResult<Vec<KeyRow>> {
        self.tenant(tenant)?;
        let mut stmt =
            self.conn.prepare("SELECT id, created_at, revoked_at FROM api_keys WHERE tenant = ?1 ORDER BY created_at DESC, id")?;
        let rows = stmt.query_map([tenant], |r| Ok(KeyRow { id: r.get(0)?, created_at: r.get(1)?, revoked_at: r.get(2)? }))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Every key not revoked: `(id, tenant, secret_sha256)`.
    pub fn active_keys(&self) -> StoreResult<Vec<(String, String, String)>> {
        let mut stmt = self.conn.prepare("SELECT id, tenant, secret_sha256 FROM api_keys WHERE revoked_at IS NULL")?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Revokes a key of `tenant`.
    pub fn revoke_key(&self, tenant: &str, id: &str) -> StoreResult<()> {
        let updated = self.conn.execute(
            "UPDATE api_keys SET revoked_at = ?3 WHERE tenant = ?1 AND id = ?2 AND revoked_at IS NULL",
            params![tenant, id, now()],
        )?;
        if updated == 0 {
            return Err(StoreError::NotFound(format!("tenant {tenant:?} has no active key {id:?}")));
        }
        Ok(())
    }

    /// Adds the next version of a handler (creating the handler), optionally
    /// activating it, in one transaction. Returns the new version number.
    pub fn add_version(&mut self, tenant: &str, handler: &str, sha256: &str, size: usize, activate: bool) -> StoreResult<i64> {
        self.tenant(tenant)?;
        let tx = self.conn.transaction()?;
        tx.execute("INSERT INTO handlers (tenant, name) VALUES (?1, ?2) ON CONFLICT DO NOTHING", params![tenant, handler])?;
        let version: i64 = tx.query_row(
            "SELECT COALESCE(MAX(version), 0) + 1 FROM versions WHERE tenant = ?1 AND handler = ?2",
            params![tenant, handler],
            |r| r.get(0),
        )?;
        tx.execute(
            "INSERT INTO versions (tenant, handler, version, component_sha256, size, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![tenant, handler, version, sha256, size as i64, now()],
        )?;
        if activate {
            tx.execute("UPDATE handlers SET active_version = ?3 WHERE tenant = ?1 AND name = ?2", params![tenant, handler, version])?;
        }
        tx.commit()?;
        Ok(version)
    }

    /// A tenant's handlers with their active versions.
    pub fn handlers(&self, tenant: &str) -> StoreResult<Vec<(String, Option<i64>)>> {
        let mut stmt = self.conn.prepare("SELECT name, active_version FROM handlers WHERE tenant = ?1 ORDER BY name")?;
        let rows = stmt.query_map([tenant], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// A handler's versions (oldest first) and its active version.
    pub fn versions(&self, tenant: &str, handler: &str) -> StoreResult<(Vec<VersionRow>, Option<i64>)> {
        let active = self.active_version(tenant, handler)?;
        let mut stmt = self.conn.prepare(
            "SELECT version, component_sha256, size, created_at FROM versions WHERE tenant = ?1 AND handler = ?2 ORDER BY version",
        )?;
        let rows = stmt.query_map(params![tenant, handler], |r| {
            Ok(VersionRow { version: r.get(0)?, sha256: r.get(1)?, size: r.get(2)?, created_at: r.get(3)? })
        })?;
        Ok((rows.collect::<Result<_, _>>()?, active))
    }

    fn active_version(&self, tenant: &str, handler: &str) -> StoreResult<Option<i64>> {
        self.conn
            .query_row("SELECT active_version FROM handlers WHERE tenant = ?1 AND name = ?2", params![tenant, handler], |r| r.get(0))
            .optional()?
            .ok_or_else(|| StoreError::NotFound(format!("tenant {tenant:?} has no handler {handler:?}")))
    }

    /// Makes `version` the active one; returns the previously active version.
    pub fn activate(&self, tenant: &str, handler: &str, version: i64) -> StoreResult<Option<i64>> {
        let (versions, previous) = self.versions(tenant, handler)?;
        if !versions.iter().any(|v| v.version == version) {
            return Err(StoreError::NotFound(format!("{tenant}/{handler} has no version {version}")));
        }
        self.conn.execute("UPDATE handlers SET active_version = ?3 WHERE tenant = ?1 AND name = ?2", params![tenant, handler, version])?;
        Ok(previous)
    }

    /// The version a rollback goes to: the newest one older than the active one.
    pub fn rollback_target(&self, tenant: &str, handler: &str) -> StoreResult<i64> {
        let (versions, active) = self.versions(tenant, handler)?;
        let active = active.ok_or_else(|| StoreError::Conflict(format!("{tenant}/{handler} has no active version")))?;
        versions
            .iter()
            .rev()
            .map(|v| v.version)
            .find(|&v| v < active)
            .ok_or_else(|| StoreError::Conflict(format!("{tenant}/{handler} has no version older than {active}")))
    }

    /// Every active handler of every tenant.
    pub fn active_handlers(&self) -> StoreResult<Vec<ActiveHandler>> {
        let mut stmt = self.conn.prepare(
            "SELECT h.tenant, h.name, h.active_version, v.component_sha256 FROM handlers h
             JOIN versions v ON v.tenant = h.tenant AND v.handler = h.name AND v.version = h.active_version",
        )?;
        let rows =
            stmt.query_map([], |r| Ok(ActiveHandler { tenant: r.get(0)?, handler: r.get(1)?, version: r.get(2)?, sha256: r.get(3)? }))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The recorded hash of a precompiled artifact.
    pub fn artifact(&self, component_sha: &str, engine: &str) -> StoreResult<Option<String>> {
        Ok(self
            .conn
            .query_row(
                "SELECT artifact_sha256 FROM artifacts WHERE component_sha256 = ?1 AND engine = ?2",
                params![component_sha, engine],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// Records a precompiled artifact (after its file is on disk).
    pub fn put_artifact(&self, component_sha: &str, engine: &str, artifact_sha: &str) -> StoreResult<()> {
        self.conn.execute(
            "INSERT INTO artifacts (component_sha256, engine, artifact_sha256) VALUES (?1, ?2, ?3)
             ON CONFLICT (component_sha256, engine) DO UPDATE SET artifact_sha256 = excluded.artifact_sha256",
            params![component_sha, engine, artifact_sha],
        )?;
        Ok(())
    }

    /// Every component hash a version refers to: `(tenant/handler@version, sha256)`.
    pub fn all_versions(&self) -> StoreResult<Vec<(String, String)>> {
        let mut stmt = self.conn.prepare("SELECT tenant, handler, version, component_sha256 FROM versions")?;
        let rows = stmt
            .query_map([], |r| Ok((format!("{}/{}@{}", r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?), r.get(3)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// SQLite's own checks plus the store's invariants; each problem as text.
    pub fn check(&self) -> StoreResult<Vec<String>> {
        let mut problems = Vec::new();
        let integrity: String = self.conn.query_row("PRAGMA integrity_check", [], |r| r.get(0))?;
        if integrity != "ok" {
            problems.push(format!("sqlite integrity_check: {integrity}"));
        }
        let mut stmt = self.conn.prepare("PRAGMA foreign_key_check")?;
        let dangling = stmt.query_map([], |r| r.get::<_, String>(0))?.collect::<Result<Vec<_>, _>>()?;
        problems.extend(dangling.into_iter().map(|table| format!("dangling reference in {table}")));
        let mut stmt = self.conn.prepare(
            "SELECT h.tenant, h.name, h.active_version FROM handlers h WHERE h.active_version IS NOT NULL AND NOT EXISTS
             (SELECT 1 FROM versions v WHERE v.tenant = h.tenant AND v.handler = h.name AND v.version = h.active_version)",
        )?;
        let missing = stmt.query_map([], |r| {
            Ok(format!("{}/{} is active at missing version {}", r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?))
        })?;
        for problem in missing {
            problems.push(problem?);
        }
        Ok(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db(name: &str) -> (Db, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!("facegate-db-{name}-{}.sqlite", std::process::id()));
        let _ = std::fs::remove_file(&path);
        (Db::open(&path).unwrap(), path)
    }

    #[test]
    fn versions_count_up_and_rollback_goes_to_the_previous_one() {
        let (mut db, path) = db("versions");
        db.create_tenant("acme", &LimitOverrides::default()).unwrap();
        assert!(matches!(db.create_tenant("acme", &LimitOverrides::default()), Err(StoreError::Conflict(_))));
        assert_eq!(db.add_version("acme", "detect", "aa", 1, true).unwrap(), 1);
        assert_eq!(db.add_version("acme", "detect", "bb", 1, false).unwrap(), 2);
        assert_eq!(db.versions("acme", "detect").unwrap().1, Some(1), "an upload without activation keeps the active one");
        assert_eq!(db.activate("acme", "detect", 2).unwrap(), Some(1));
        assert_eq!(db.add_version("acme", "detect", "cc", 1, true).unwrap(), 3);
        assert_eq!(db.rollback_target("acme", "detect").unwrap(), 2);
        db.activate("acme", "detect", 1).unwrap();
        assert!(matches!(db.rollback_target("acme", "detect"), Err(StoreError::Conflict(_))));
        assert!(matches!(db.activate("acme", "detect", 9), Err(StoreError::NotFound(_))));
        assert!(matches!(db.add_version("nobody", "detect", "aa", 1, true), Err(StoreError::NotFound(_))));
        assert!(db.check().unwrap().is_empty());
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn revoked_keys_are_inactive_and_deleting_a_tenant_removes_its_rows() {
        let (mut db, path) = db("keys");
        db.create_tenant("acme", &LimitOverrides::default()).unwrap();
        db.insert_key("acme", "k1", "h1").unwrap();
        db.insert_key("acme", "k2", "h2").unwrap();
        db.add_version("acme", "detect", "aa", 1, true).unwrap();
        db.revoke_key("acme", "k1").unwrap();
        assert!(matches!(db.revoke_key("acme", "k1"), Err(StoreError::NotFound(_))));
        let active: Vec<_> = db.active_keys().unwrap().into_iter().map(|k| k.0).collect();
        assert_eq!(active, ["k2"]);
        db.delete_tenant("acme").unwrap();
        assert!(db.active_keys().unwrap().is_empty() && db.active_handlers().unwrap().is_empty() && db.all_versions().unwrap().is_empty());
        assert!(db.is_empty().unwrap());
        std::fs::remove_file(path).unwrap();
    }
}
