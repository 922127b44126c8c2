//! The SQLite store, the embedded default: one database file in the data
//! directory (WAL journal, `synchronous=FULL`: a commit is on disk when it
//! returns), component bytes beside it as content-addressed files
//! ([`Blobs`]). Schema migrations are numbered by `PRAGMA user_version`.

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, params};

use super::{
    ActiveHandler, ActiveKeyRow, DB_FILE, KeyCommit, KeyRow, ListenerSource, NewVersion, NodeRow, Store, StoreError, StoreResult,
    TenantRow, VersionRow, new_incarnation, now,
};
use super::{
    ArtifactStore, NodeStore, RegistryLoginRow, RegistryLoginStore, ReleaseStore, RouteRow, RouteStore, SettingRow, SettingStore,
    TenantStore, UsageStore, hostname_taken, no_registry_login, no_setting,
};
use super::{Canary, Pruned, canary_of, too_many_keys, versions_past};
use super::{ModelRow, ModelStore, NewModel, checked_model, no_model, no_model_version};
use super::{SettingQuota, StoredSetting, settings_quota};
use super::{figure, missing_usage_columns, stored, usage_aggregates, usage_columns, usage_from, usage_placeholders, usage_values};
use crate::admission::limits::LimitOverrides;
use crate::control::blobs::Blobs;
use crate::control::keys::Scopes;
use crate::sandbox::handler::GuestPath;
use crate::telemetry::usage::{Delta, ModelUsage, Usage, UsageKey};

/// Migrations, in order (the files in `migrations/sqlite/`, numbered from 1):
/// entry `i` takes the schema from version `i` to `i + 1`.
pub(super) const MIGRATIONS: &[super::Migration] = super::migrations!("sqlite": "0001_first", "0002_nodes_and_generation", "0003_tenant_incarnation", "0004_usage", "0005_key_scopes", "0006_canaries", "0007_usage_and_key_indexes", "0008_routes", "0009_version_source", "0010_settings", "0011_state", "0012_models", "0013_usage_models");

/// Tables whose changes bump the generation.
const WATCHED: [&str; 4] = ["tenants", "api_keys", "handlers", "versions"];

/// The SQLite store (see the module docs).
pub struct SqliteStore {
    conn: Connection,
    blobs: Blobs,
    path: PathBuf,
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Internal(e.into())
    }
}

impl SqliteStore {
    /// Opens (creating) the store in `data_dir`: its database and component files.
    pub fn open(data_dir: &Path) -> anyhow::Result<Self> {
        let blobs = Blobs::open(data_dir)?;
        let path = data_dir.join(DB_FILE);
        let mut conn = Connection::open(&path)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        migrate(&mut conn).map_err(|e| anyhow::anyhow!("{}: {e:#}", path.display()))?;
        Ok(Self { conn, blobs, path })
    }

    fn select_tenants(&self, sql: &str, args: &[&dyn rusqlite::ToSql]) -> StoreResult<Vec<TenantRow>> {
        let mut stmt = self.conn.prepare(sql)?;
        let rows = stmt.query_map(args, |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get(2)?, r.get(3)?)))?;
        rows.map(|row| {
            let (name, limits, created_at, incarnation) = row?;
            let overrides = serde_json::from_str(&limits).map_err(|e| anyhow::anyhow!("limits of {name}: {e}"))?;
            Ok(TenantRow { name, overrides, created_at, incarnation })
        })
        .collect()
    }

    fn active_version(&self, tenant: &str, handler: &str) -> StoreResult<Option<i64>> {
        self.conn
            .query_row("SELECT active_version FROM handlers WHERE tenant = ?1 AND name = ?2", params![tenant, handler], |r| r.get(0))
            .optional()?
            .ok_or_else(|| StoreError::NotFound(format!("tenant {tenant:?} has no handler {handler:?}")))
    }
}

/// Applies the migrations the database lacks, in one transaction.
fn migrate(conn: &mut Connection) -> anyhow::Result<()> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let version: usize = tx.pragma_query_value(None, "user_version", |r| r.get::<_, i64>(0))?.try_into()?;
    anyhow::ensure!(version <= MIGRATIONS.len(), "schema version {version}; this facegate knows {}", MIGRATIONS.len());
    for (i, migration) in MIGRATIONS.iter().enumerate().skip(version) {
        tx.execute_batch(migration.sql)?;
        tracing::info!(migration = migration.name, "store schema migrated");
        if i + 1 == 2 {
            tx.execute_batch(&change_triggers())?;
        }
    }
    tx.pragma_update(None, "user_version", MIGRATIONS.len() as i64)?;
    add_usage_columns(&tx)?;
    tx.commit()?;
    Ok(())
}

/// Adds the usage figures declared since the table was made (see [`missing_usage_columns`]).
fn add_usage_columns(tx: &rusqlite::Transaction<'_>) -> anyhow::Result<()> {
    let mut stmt = tx.prepare("SELECT name FROM pragma_table_info('usage')")?;
    let columns = stmt.query_map([], |r| r.get::<_, String>(0))?.collect::<Result<Vec<_>, _>>()?;
    for column in missing_usage_columns(&columns) {
        tx.execute_batch(&format!("ALTER TABLE usage ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0"))?;
    }
    Ok(())
}

/// One trigger per watched table and statement kind (SQLite has row triggers only).
fn change_triggers() -> String {
    let mut sql = String::new();
    for table in WATCHED {
        for event in ["INSERT", "UPDATE", "DELETE"] {
            sql.push_str(&format!(
                "CREATE TRIGGER {table}_{event}_changed AFTER {event} ON {table} BEGIN UPDATE generation SET n = n + 1 WHERE id = 1; END;\n",
                event = event
            ));
        }
    }
    sql
}

impl Store for SqliteStore {
    fn describe(&self) -> String {
        format!("sqlite:{}", self.path.display())
    }

    fn generation(&mut self) -> StoreResult<i64> {
        Ok(self.conn.query_row("SELECT n FROM generation WHERE id = 1", [], |r| r.get(0))?)
    }

    fn listener(&self) -> Option<ListenerSource> {
        None
    }

    fn meta(&mut self, key: &str) -> StoreResult<Option<String>> {
        Ok(self.conn.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0)).optional()?)
    }

    fn set_meta(&mut self, key: &str, value: &str) -> StoreResult<()> {
        self.conn.execute(
            "INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            params![key, value],
        )?;
        Ok(())
    }

    fn check(&mut self) -> StoreResult<Vec<String>> {
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
        let temp_files = self.blobs.tmp_files()?.len();
        if temp_files > 0 {
            tracing::info!(temp_files, "files of interrupted writes (removed at the next start)");
        }
        Ok(problems)
    }
}

impl TenantStore for SqliteStore {
    fn tenants(&mut self) -> StoreResult<Vec<TenantRow>> {
        self.select_tenants("SELECT name, limits, created_at, incarnation FROM tenants ORDER BY name", &[])
    }

    fn tenant(&mut self, name: &str) -> StoreResult<TenantRow> {
        self.select_tenants("SELECT name, limits, created_at, incarnation FROM tenants WHERE name = ?1", &[&name])?
            .pop()
            .ok_or_else(|| StoreError::NotFound(format!("no tenant {name:?}")))
    }

    fn create_tenant(&mut self, name: &str, overrides: &LimitOverrides) -> StoreResult<()> {
        let limits = serde_json::to_string(overrides).map_err(anyhow::Error::from)?;
        let inserted = self.conn.execute(
            "INSERT INTO tenants (name, limits, created_at, incarnation) VALUES (?1, ?2, ?3, ?4) ON CONFLICT DO NOTHING",
            params![name, limits, now(), new_incarnation()?],
        )?;
        if inserted == 0 {
            return Err(StoreError::Conflict(format!("tenant {name:?} exists")));
        }
        Ok(())
    }

    fn set_limits(&mut self, name: &str, overrides: &LimitOverrides) -> StoreResult<()> {
        let limits = serde_json::to_string(overrides).map_err(anyhow::Error::from)?;
        let updated = self.conn.execute("UPDATE tenants SET limits = ?2 WHERE name = ?1", params![name, limits])?;
        if updated == 0 {
            return Err(StoreError::NotFound(format!("no tenant {name:?}")));
        }
        Ok(())
    }

    fn delete_tenant(&mut self, name: &str) -> StoreResult<()> {
        if self.conn.execute("DELETE FROM tenants WHERE name = ?1", [name])? == 0 {
            return Err(StoreError::NotFound(format!("no tenant {name:?}")));
        }
        Ok(())
    }

    fn is_empty(&mut self) -> StoreResult<bool> {
        Ok(self.conn.query_row("SELECT COUNT(*) FROM tenants", [], |r| r.get::<_, i64>(0))? == 0)
    }

    fn insert_key(&mut self, tenant: &str, id: &str, secret_sha256: &str, scopes: Scopes, max_keys: u32) -> StoreResult<KeyCommit> {
        self.tenant(tenant)?;
        let created_at = now();
        // Immediate: the count and the insert see no other writer between them.
        let tx = self.conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let active: i64 = tx.query_row("SELECT COUNT(*) FROM api_keys WHERE tenant = ?1 AND revoked_at IS NULL", [tenant], |r| r.get(0))?;
        if active >= i64::from(max_keys) {
            return Err(too_many_keys(tenant, active));
        }
        tx.execute(
            "INSERT INTO api_keys (id, tenant, secret_sha256, created_at, scopes) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![id, tenant, secret_sha256, created_at, scopes.to_string()],
        )?;
        let generation = tx.query_row("SELECT n FROM generation WHERE id = 1", [], |r| r.get(0))?;
        tx.commit()?;
        Ok(KeyCommit { at: created_at, generation })
    }

    fn keys(&mut self, tenant: &str) -> StoreResult<Vec<KeyRow>> {
        self.tenant(tenant)?;
        let mut stmt =
            self.conn.prepare("SELECT id, created_at, revoked_at, scopes FROM api_keys WHERE tenant = ?1 ORDER BY created_at DESC, id")?;
        let rows = stmt.query_map([tenant], |r| {
            let scopes: String = r.get(3)?;
            Ok(KeyRow { id: r.get(0)?, created_at: r.get(1)?, revoked_at: r.get(2)?, scopes: Scopes::from_stored(&scopes) })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn active_keys(&mut self) -> StoreResult<Vec<ActiveKeyRow>> {
        let mut stmt = self.conn.prepare("SELECT id, tenant, secret_sha256, scopes FROM api_keys WHERE revoked_at IS NULL")?;
        let rows = stmt.query_map([], |r| {
            let scopes: String = r.get(3)?;
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, Scopes::from_stored(&scopes)))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn revoke_key(&mut self, tenant: &str, id: &str) -> StoreResult<KeyCommit> {
        let revoked_at = now();
        let tx = self.conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let updated = tx.execute(
            "UPDATE api_keys SET revoked_at = ?3 WHERE tenant = ?1 AND id = ?2 AND revoked_at IS NULL",
            params![tenant, id, revoked_at],
        )?;
        if updated == 0 {
            return Err(StoreError::NotFound(format!("tenant {tenant:?} has no active key {id:?}")));
        }
        // SQLite reads `$N` as the N-th parameter, as PostgreSQL does.
        let revoked: i64 = tx.query_row(super::COUNT_REVOKED_KEYS, [tenant], |r| r.get(0))?;
        if revoked > super::REVOKED_KEYS_KEPT {
            tx.execute(super::PRUNE_REVOKED_KEYS, params![tenant, super::REVOKED_KEYS_KEPT])?;
        }
        let generation = tx.query_row("SELECT n FROM generation WHERE id = 1", [], |r| r.get(0))?;
        tx.commit()?;
        Ok(KeyCommit { at: revoked_at, generation })
    }
}

impl ReleaseStore for SqliteStore {
    fn add_version(&mut self, new: NewVersion<'_>) -> StoreResult<i64> {
        // One node: its own file cache holds the artifact (no sharing).
        let NewVersion { tenant, handler, sha256, component, activate, guest_path, source, artifact: _ } = new;
        self.tenant(tenant)?;
        // The file first (atomic, fsynced): nothing refers to it until the row commits.
        self.blobs.put_component(sha256, component)?;
        let tx = self.conn.transaction()?;
        tx.execute("INSERT INTO handlers (tenant, name) VALUES (?1, ?2) ON CONFLICT DO NOTHING", params![tenant, handler])?;
        let version: i64 = tx.query_row(
            "SELECT COALESCE(MAX(version), 0) + 1 FROM versions WHERE tenant = ?1 AND handler = ?2",
            params![tenant, handler],
            |r| r.get(0),
        )?;
        tx.execute(
            "INSERT INTO versions (tenant, handler, version, component_sha256, size, created_at, guest_path, source) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            params![tenant, handler, version, sha256, component.len() as i64, now(), guest_path.as_str(), source],
        )?;
        if activate {
            tx.execute("UPDATE handlers SET active_version = ?3 WHERE tenant = ?1 AND name = ?2", params![tenant, handler, version])?;
        }
        tx.commit()?;
        Ok(version)
    }

    fn prune_versions(&mut self, tenant: &str, handler: &str, keep: usize) -> StoreResult<Pruned> {
        let tx = self.conn.transaction()?;
        let spared: Option<(Option<i64>, Option<i64>)> = tx
            .query_row(
                "SELECT active_version, canary_version FROM handlers WHERE tenant = ?1 AND name = ?2",
                params![tenant, handler],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        let Some((active, canary)) = spared else { return Ok(Pruned::default()) };
        let versions: Vec<i64> = {
            let mut stmt = tx.prepare("SELECT version FROM versions WHERE tenant = ?1 AND handler = ?2 ORDER BY version")?;
            stmt.query_map(params![tenant, handler], |r| r.get(0))?.collect::<Result<_, _>>()?
        };
        let doomed = versions_past(&versions, keep, &[active, canary].into_iter().flatten().collect::<Vec<_>>());
        let mut shas = Vec::new();
        for version in &doomed {
            let sha: String = tx.query_row(
                "DELETE FROM versions WHERE tenant = ?1 AND handler = ?2 AND version = ?3 RETURNING component_sha256",
                params![tenant, handler, version],
                |r| r.get(0),
            )?;
            shas.push(sha);
        }
        tx.commit()?;
        let mut components = Vec::new();
        for sha in shas {
            let used: Option<i64> =
                self.conn.query_row("SELECT 1 FROM versions WHERE component_sha256 = ?1 LIMIT 1", [&sha], |r| r.get(0)).optional()?;
            if used.is_none() && !components.contains(&sha) {
                // Best effort: the rows are gone; a file left behind is only space.
                if let Err(e) = std::fs::remove_file(self.blobs.component_path(&sha))
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    tracing::warn!(sha256 = %sha, error = %e, "cannot remove a component no version uses");
                }
                components.push(sha);
            }
        }
        Ok(Pruned { versions: doomed, components })
    }

    fn handlers(&mut self, tenant: &str) -> StoreResult<Vec<(String, Option<i64>)>> {
        let mut stmt = self.conn.prepare("SELECT name, active_version FROM handlers WHERE tenant = ?1 ORDER BY name")?;
        let rows = stmt.query_map([tenant], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn versions(&mut self, tenant: &str, handler: &str) -> StoreResult<(Vec<VersionRow>, Option<i64>)> {
        let active = self.active_version(tenant, handler)?;
        let mut stmt = self.conn.prepare(
            "SELECT version, component_sha256, size, created_at, guest_path, source FROM versions WHERE tenant = ?1 AND handler = ?2 ORDER BY version",
        )?;
        let rows = stmt.query_map(params![tenant, handler], |r| {
            let guest_path = GuestPath::from_column(&r.get::<_, String>(4)?);
            Ok(VersionRow { version: r.get(0)?, sha256: r.get(1)?, size: r.get(2)?, created_at: r.get(3)?, guest_path, source: r.get(5)? })
        })?;
        Ok((rows.collect::<Result<_, _>>()?, active))
    }

    fn activate(&mut self, tenant: &str, handler: &str, version: i64) -> StoreResult<Option<i64>> {
        let (versions, previous) = self.versions(tenant, handler)?;
        if !versions.iter().any(|v| v.version == version) {
            return Err(StoreError::NotFound(format!("{tenant}/{handler} has no version {version}")));
        }
        self.conn.execute("UPDATE handlers SET active_version = ?3 WHERE tenant = ?1 AND name = ?2", params![tenant, handler, version])?;
        Ok(previous)
    }

    fn active_handlers(&mut self) -> StoreResult<Vec<ActiveHandler>> {
        let mut stmt = self.conn.prepare(
            "SELECT h.tenant, h.name, h.active_version, v.component_sha256, v.guest_path FROM handlers h
             JOIN versions v ON v.tenant = h.tenant AND v.handler = h.name AND v.version = h.active_version",
        )?;
        let rows = stmt.query_map([], active_of)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn set_canary(&mut self, tenant: &str, handler: &str, canary: Option<Canary>) -> StoreResult<()> {
        let (versions, _) = self.versions(tenant, handler)?;
        if let Some(c) = canary
            && !versions.iter().any(|v| v.version == c.version)
        {
            return Err(StoreError::NotFound(format!("{tenant}/{handler} has no version {}", c.version)));
        }
        let (margin, after) = canary.and_then(|c| c.abort).map_or((None, None), |a| (Some(a.margin), Some(a.after as i64)));
        self.conn.execute(
            "UPDATE handlers SET canary_version = ?3, canary_percent = ?4, canary_abort_margin = ?5, canary_abort_after = ?6
             WHERE tenant = ?1 AND name = ?2",
            params![tenant, handler, canary.map(|c| c.version), canary.map_or(0, |c| c.percent), margin, after],
        )?;
        Ok(())
    }

    fn canary(&mut self, tenant: &str, handler: &str) -> StoreResult<Option<Canary>> {
        let row = self
            .conn
            .query_row(
                "SELECT canary_version, canary_percent, canary_abort_margin, canary_abort_after FROM handlers WHERE tenant = ?1 AND name = ?2",
                params![tenant, handler],
                |r| Ok(canary_of(r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .optional()?;
        row.ok_or_else(|| StoreError::NotFound(format!("tenant {tenant:?} has no handler {handler:?}")))
    }

    fn canaries(&mut self) -> StoreResult<Vec<(ActiveHandler, Canary)>> {
        let mut stmt = self.conn.prepare(
            "SELECT h.tenant, h.name, h.canary_version, v.component_sha256, v.guest_path, h.canary_percent, h.canary_abort_margin, h.canary_abort_after
             FROM handlers h JOIN versions v ON v.tenant = h.tenant AND v.handler = h.name AND v.version = h.canary_version",
        )?;
        let rows = stmt.query_map([], |r| {
            let active = active_of(r)?;
            Ok((active.clone(), canary_of(Some(active.version), r.get(5)?, r.get(6)?, r.get(7)?)))
        })?;
        let rows: Vec<_> = rows.collect::<Result<_, _>>()?;
        Ok(rows.into_iter().filter_map(|(a, c)| Some((a, c?))).collect())
    }

    fn all_versions(&mut self) -> StoreResult<Vec<(String, String)>> {
        let mut stmt = self.conn.prepare("SELECT tenant, handler, version, component_sha256 FROM versions")?;
        let rows = stmt
            .query_map([], |r| Ok((format!("{}/{}@{}", r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?), r.get(3)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

/// A version to serve from its row's first five columns (tenant, handler,
/// version, component, guest path).
fn active_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<ActiveHandler> {
    let guest_path = GuestPath::from_column(&r.get::<_, String>(4)?);
    Ok(ActiveHandler { tenant: r.get(0)?, handler: r.get(1)?, version: r.get(2)?, sha256: r.get(3)?, guest_path })
}

impl RouteStore for SqliteStore {
    fn add_route(&mut self, route: &RouteRow) -> StoreResult<()> {
        self.tenant(&route.tenant)?;
        // Moves a hostname among its own tenant's handlers only.
        let changed = self.conn.execute(
            "INSERT INTO routes (hostname, tenant, handler, created_at) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (hostname) DO UPDATE SET handler = excluded.handler WHERE routes.tenant = excluded.tenant",
            params![route.hostname, route.tenant, route.handler, route.created_at],
        )?;
        if changed == 0 {
            return Err(hostname_taken(&route.hostname));
        }
        Ok(())
    }

    fn routes(&mut self) -> StoreResult<Vec<RouteRow>> {
        let mut stmt = self.conn.prepare("SELECT hostname, tenant, handler, created_at FROM routes ORDER BY hostname")?;
        let rows =
            stmt.query_map([], |r| Ok(RouteRow { hostname: r.get(0)?, tenant: r.get(1)?, handler: r.get(2)?, created_at: r.get(3)? }))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn remove_route(&mut self, hostname: &str) -> StoreResult<()> {
        if self.conn.execute("DELETE FROM routes WHERE hostname = ?1", [hostname])? == 0 {
            return Err(StoreError::NotFound(format!("no route for hostname {hostname:?}")));
        }
        Ok(())
    }
}

impl ModelStore for SqliteStore {
    fn add_model(&mut self, new: NewModel<'_>) -> StoreResult<i64> {
        let NewModel { name, sha256, bytes, spec, accuracy } = new;
        let tx = self.conn.transaction()?;
        tx.execute(
            "INSERT INTO model_blobs (sha256, bytes, created_at) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
            params![sha256, bytes, now()],
        )?;
        tx.execute("INSERT INTO models (name) VALUES (?1) ON CONFLICT DO NOTHING", [name])?;
        let version: i64 =
            tx.query_row("SELECT COALESCE(MAX(version), 0) + 1 FROM model_versions WHERE name = ?1", [name], |r| r.get(0))?;
        tx.execute(
            "INSERT INTO model_versions (name, version, sha256, size, spec, accuracy, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![name, version, sha256, bytes.len() as i64, spec, accuracy, now()],
        )?;
        tx.execute("UPDATE models SET active_version = ?2 WHERE name = ?1", params![name, version])?;
        tx.commit()?;
        Ok(version)
    }

    fn models(&mut self) -> StoreResult<Vec<ModelRow>> {
        let mut stmt = self.conn.prepare(
            "SELECT v.name, v.version, v.sha256, v.size, v.spec, v.accuracy, m.active_version = v.version, v.created_at
             FROM model_versions v JOIN models m ON m.name = v.name ORDER BY v.name, v.version",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok(ModelRow {
                name: r.get(0)?,
                version: r.get(1)?,
                sha256: r.get(2)?,
                size: r.get(3)?,
                spec: r.get(4)?,
                accuracy: r.get(5)?,
                active: r.get::<_, Option<bool>>(6)?.unwrap_or(false),
                created_at: r.get(7)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn activate_model(&mut self, name: &str, version: i64) -> StoreResult<()> {
        let tx = self.conn.transaction()?;
        let exists: Option<i64> = tx
            .query_row("SELECT version FROM model_versions WHERE name = ?1 AND version = ?2", params![name, version], |r| r.get(0))
            .optional()?;
        if exists.is_none() {
            return Err(if tx.query_row("SELECT 1 FROM models WHERE name = ?1", [name], |_| Ok(())).optional()?.is_some() {
                no_model_version(name, version)
            } else {
                no_model(name)
            });
        }
        tx.execute("UPDATE models SET active_version = ?2 WHERE name = ?1", params![name, version])?;
        tx.commit()?;
        Ok(())
    }

    fn remove_model(&mut self, name: &str) -> StoreResult<()> {
        let tx = self.conn.transaction()?;
        if tx.execute("DELETE FROM models WHERE name = ?1", [name])? == 0 {
            return Err(no_model(name));
        }
        tx.execute("DELETE FROM model_blobs WHERE sha256 NOT IN (SELECT sha256 FROM model_versions)", [])?;
        tx.commit()?;
        Ok(())
    }

    fn model_bytes(&mut self, sha256: &str) -> StoreResult<Vec<u8>> {
        let bytes = self.conn.query_row("SELECT bytes FROM model_blobs WHERE sha256 = ?1", [sha256], |r| r.get(0)).optional()?;
        checked_model(sha256, bytes)
    }
}

impl RegistryLoginStore for SqliteStore {
    fn put_registry_login(&mut self, tenant: &str, row: &RegistryLoginRow, sealed: &[u8]) -> StoreResult<()> {
        self.tenant(tenant)?;
        self.conn.execute(
            "INSERT INTO registry_logins (tenant, registry, username, sealed, updated_at) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (tenant, registry) DO UPDATE SET username = excluded.username, sealed = excluded.sealed, updated_at = excluded.updated_at",
            params![tenant, row.registry, row.username, sealed, row.updated_at],
        )?;
        Ok(())
    }

    fn registry_logins(&mut self, tenant: &str) -> StoreResult<Vec<RegistryLoginRow>> {
        let mut stmt =
            self.conn.prepare("SELECT registry, username, updated_at FROM registry_logins WHERE tenant = ?1 ORDER BY registry")?;
        let rows =
            stmt.query_map([tenant], |r| Ok(RegistryLoginRow { registry: r.get(0)?, username: r.get(1)?, updated_at: r.get(2)? }))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn registry_login(&mut self, tenant: &str, registry: &str) -> StoreResult<Option<(RegistryLoginRow, Vec<u8>)>> {
        let found = self
            .conn
            .query_row(
                "SELECT registry, username, updated_at, sealed FROM registry_logins WHERE tenant = ?1 AND registry = ?2",
                [tenant, registry],
                |r| Ok((RegistryLoginRow { registry: r.get(0)?, username: r.get(1)?, updated_at: r.get(2)? }, r.get(3)?)),
            )
            .optional()?;
        Ok(found)
    }

    fn remove_registry_login(&mut self, tenant: &str, registry: &str) -> StoreResult<()> {
        if self.conn.execute("DELETE FROM registry_logins WHERE tenant = ?1 AND registry = ?2", [tenant, registry])? == 0 {
            return Err(no_registry_login(tenant, registry));
        }
        Ok(())
    }
}

impl SettingStore for SqliteStore {
    fn put_setting(&mut self, row: &SettingRow, value: &[u8], quota: SettingQuota) -> StoreResult<()> {
        self.tenant(&row.tenant)?;
        let tx = self.conn.transaction()?;
        let (count, bytes): (i64, i64) = tx.query_row(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(value)), 0) FROM settings WHERE tenant = ?1 AND NOT (handler = ?2 AND name = ?3)",
            [&row.tenant, &row.handler, &row.name],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        let with = (count as usize + 1, bytes as usize + value.len());
        if let Some(refusal) = settings_quota(&row.tenant, quota, with) {
            return Err(refusal);
        }
        tx.execute(
            "INSERT INTO settings (tenant, handler, name, secret, value, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT (tenant, handler, name) DO UPDATE SET secret = excluded.secret, value = excluded.value, updated_at = excluded.updated_at",
            params![row.tenant, row.handler, row.name, row.secret, value, row.updated_at],
        )?;
        tx.commit()?;
        Ok(())
    }

    fn remove_setting(&mut self, tenant: &str, handler: &str, name: &str) -> StoreResult<()> {
        if self.conn.execute("DELETE FROM settings WHERE tenant = ?1 AND handler = ?2 AND name = ?3", [tenant, handler, name])? == 0 {
            return Err(no_setting(tenant, handler, name));
        }
        Ok(())
    }

    fn settings(&mut self, tenant: Option<&str>) -> StoreResult<Vec<StoredSetting>> {
        let mut stmt = self.conn.prepare(
            "SELECT s.tenant, s.handler, s.name, s.secret, s.updated_at, s.value, t.incarnation FROM settings s JOIN tenants t ON t.name = s.tenant
             WHERE ?1 IS NULL OR s.tenant = ?1 ORDER BY s.tenant, s.handler, s.name",
        )?;
        let rows = stmt.query_map([tenant], |r| {
            let row = SettingRow { tenant: r.get(0)?, handler: r.get(1)?, name: r.get(2)?, secret: r.get(3)?, updated_at: r.get(4)? };
            Ok(StoredSetting { row, value: r.get(5)?, incarnation: r.get(6)? })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

impl ArtifactStore for SqliteStore {
    fn component(&mut self, sha256: &str) -> StoreResult<Vec<u8>> {
        Ok(self.blobs.read_verified(&self.blobs.component_path(sha256), sha256)?)
    }
}

impl NodeStore for SqliteStore {
    fn heartbeat(&mut self, node: &NodeRow) -> StoreResult<()> {
        let info = serde_json::to_string(node).map_err(anyhow::Error::from)?;
        self.conn.execute(
            "INSERT INTO nodes (id, info, heartbeat_at) VALUES (?1, ?2, ?3)
             ON CONFLICT (id) DO UPDATE SET info = excluded.info, heartbeat_at = excluded.heartbeat_at",
            params![node.id, info, node.heartbeat_at],
        )?;
        Ok(())
    }

    fn remove_nodes(&mut self, id: &str, older_than_ms: i64) -> StoreResult<()> {
        self.conn.execute("DELETE FROM nodes WHERE id = ?1 OR heartbeat_at < ?2", params![id, older_than_ms])?;
        Ok(())
    }

    fn nodes(&mut self) -> StoreResult<Vec<NodeRow>> {
        let mut stmt = self.conn.prepare("SELECT info FROM nodes ORDER BY id")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        rows.map(|info| Ok(serde_json::from_str(&info?).map_err(anyhow::Error::from)?)).collect()
    }
}

impl UsageStore for SqliteStore {
    fn write_usage(&mut self, delta: &Delta) -> StoreResult<()> {
        let tx = self.conn.transaction()?;
        {
            let mut insert = tx.prepare(&format!(
                "INSERT INTO usage (node, seq, tenant, handler, version, bucket_ms, {}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, {}) ON CONFLICT DO NOTHING",
                usage_columns(),
                usage_placeholders('?', 7)
            ))?;
            let seq = i64::try_from(delta.seq).unwrap_or(i64::MAX);
            for (key, usage) in &delta.rows {
                let figures = usage_values(usage);
                let mut args: Vec<&dyn rusqlite::ToSql> = vec![&delta.node, &seq, &key.tenant, &key.handler, &key.version, &key.bucket_ms];
                args.extend(figures.iter().map(|v| v as &dyn rusqlite::ToSql));
                insert.execute(args.as_slice())?;
            }
            let mut insert = tx.prepare(
                "INSERT INTO usage_models (node, seq, tenant, handler, version, bucket_ms, model, device_us, infer_calls)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) ON CONFLICT DO NOTHING",
            )?;
            for (key, models) in &delta.models {
                for (model, usage) in models {
                    let (device_us, calls) = (stored(usage.device_us), stored(usage.infer_calls));
                    insert.execute(params![
                        delta.node,
                        seq,
                        key.tenant,
                        key.handler,
                        key.version,
                        key.bucket_ms,
                        model,
                        device_us,
                        calls
                    ])?;
                }
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn usage(&mut self, tenant: Option<&str>, from_ms: i64, to_ms: i64) -> StoreResult<Vec<(UsageKey, Usage)>> {
        // One tenant's rows by the (tenant, bucket) index: `?3 IS NULL OR
        // tenant = ?3` would keep SQLite from using it.
        let of_tenant = if tenant.is_some() { "tenant = ?3" } else { "?3 IS NULL" };
        let mut stmt = self.conn.prepare(&format!(
            "SELECT tenant, handler, version, bucket_ms, {} FROM usage WHERE {of_tenant} AND bucket_ms >= ?1 AND bucket_ms < ?2
             GROUP BY tenant, handler, version, bucket_ms ORDER BY bucket_ms, tenant, handler, version",
            usage_aggregates("")
        ))?;
        let rows = stmt.query_map(params![from_ms, to_ms, tenant], |r| {
            let key = UsageKey { tenant: r.get(0)?, handler: r.get(1)?, version: r.get(2)?, bucket_ms: r.get(3)? };
            let mut v = [0i64; Usage::COUNT];
            for (i, slot) in v.iter_mut().enumerate() {
                *slot = r.get(4 + i)?;
            }
            Ok((key, usage_from(v)))
        })?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    fn usage_by_model(&mut self, tenant: Option<&str>, from_ms: i64, to_ms: i64) -> StoreResult<Vec<(UsageKey, String, ModelUsage)>> {
        let of_tenant = if tenant.is_some() { "tenant = ?3" } else { "?3 IS NULL" };
        let mut stmt = self.conn.prepare(&format!(
            "SELECT tenant, handler, version, bucket_ms, model, SUM(device_us), SUM(infer_calls) FROM usage_models
             WHERE {of_tenant} AND bucket_ms >= ?1 AND bucket_ms < ?2
             GROUP BY tenant, handler, version, bucket_ms, model ORDER BY bucket_ms, tenant, handler, version, model"
        ))?;
        let rows = stmt.query_map(params![from_ms, to_ms, tenant], |r| {
            let key = UsageKey { tenant: r.get(0)?, handler: r.get(1)?, version: r.get(2)?, bucket_ms: r.get(3)? };
            let usage = ModelUsage { device_us: figure(r.get(5)?), infer_calls: figure(r.get(6)?) };
            Ok((key, r.get(4)?, usage))
        })?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }

    fn prune_usage(&mut self, before_ms: i64) -> StoreResult<()> {
        self.conn.execute("DELETE FROM usage WHERE bucket_ms < ?1", params![before_ms])?;
        self.conn.execute("DELETE FROM usage_models WHERE bucket_ms < ?1", params![before_ms])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_1_store_is_migrated_and_keeps_its_rows() {
        let dir = std::env::temp_dir().join(format!("facegate-sqlite-migrate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        {
            let conn = Connection::open(dir.join(DB_FILE)).unwrap();
            conn.execute_batch(MIGRATIONS[0].sql).unwrap();
            conn.execute("INSERT INTO tenants (name, created_at) VALUES ('acme', 1)", []).unwrap();
            conn.pragma_update(None, "user_version", 1).unwrap();
        }
        let mut store = SqliteStore::open(&dir).unwrap();
        assert_eq!(store.tenants().unwrap()[0].name, "acme");
        assert_eq!(store.tenants().unwrap()[0].incarnation.len(), 16, "rows from before the column get an incarnation too");
        let before = store.generation().unwrap();
        store.create_tenant("beta", &LimitOverrides::default()).unwrap();
        assert!(store.generation().unwrap() > before, "a change bumps the generation");
        drop(store);
        let conn = Connection::open(dir.join(DB_FILE)).unwrap();
        conn.pragma_update(None, "user_version", 99).unwrap();
        drop(conn);
        let error = SqliteStore::open(&dir).err().unwrap().to_string();
        assert!(error.contains("schema version 99"), "{error}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
