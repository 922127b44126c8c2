//! The PostgreSQL store (`--store postgres://…`), shared by every gateway
//! node of a cluster. Component bytes live in the database with their
//! version rows (`bytea`, one transaction per upload: a node killed during
//! an upload leaves nothing visible). Triggers bump the generation and
//! `NOTIFY facegate_changes` on every change, so other nodes rebuild their
//! snapshots at once; they also poll the generation in case a notification
//! is lost with its connection.
//!
//! The `postgres` client runs a small Tokio runtime of its own; calls made
//! from a thread inside the gateway's runtime run on a scoped thread instead.
//! A lost connection is reopened on the next call; meanwhile calls fail with
//! [`StoreError::Unavailable`] (the admin API answers 503) and the data
//! plane keeps serving its last snapshot.

use std::time::Duration;

use fallible_iterator::FallibleIterator;
use postgres::error::SqlState;
use postgres::{Client, Config};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{
    ActiveHandler, ActiveKeyRow, KeyCommit, KeyRow, Listener, ListenerSource, NewVersion, NodeRow, SharedArtifact, Store, StoreError,
    StoreResult, TenantRow, VersionRow, new_incarnation, now,
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
use crate::control::keys::{Scopes, sha256_hex};
use crate::sandbox::handler::GuestPath;
use crate::telemetry::usage::{Delta, ModelUsage, Usage, UsageKey};

/// The channel changes are announced on.
const CHANNEL: &str = "facegate_changes";

/// Held while migrating, so nodes starting together migrate one at a time.
const MIGRATION_LOCK: i64 = 0x6661_6365_6761_7465;

/// Migrations, in order (the files in `migrations/postgres/`, numbered from 1):
/// entry `i` takes the schema from version `i` to `i + 1`.
pub(super) const MIGRATIONS: &[super::Migration] = super::migrations!("postgres": "0001_first", "0002_nodes_and_generation", "0003_tenant_incarnation", "0004_usage", "0005_key_scopes", "0006_canaries", "0007_usage_and_key_indexes", "0008_routes", "0009_version_source", "0010_settings", "0011_state", "0012_models", "0013_usage_models");

/// The PostgreSQL store (see the module docs).
pub struct PgStore {
    config: Config,
    tls: MakeRustlsConnect,
    described: String,
    client: Option<Client>,
}

impl PgStore {
    /// Connects to `url` (see `pg_connect` for TLS) and applies missing migrations.
    pub fn open(url: &str) -> anyhow::Result<Self> {
        let (config, tls) = client_config(url)?;
        let described = describe(&config);
        let mut store = Self { config, tls, described, client: None };
        store.with(migrate).map_err(|e| anyhow::anyhow!("{}: {e}", store.described))?;
        Ok(store)
    }

    /// Runs `f` with a connected client, off the gateway's runtime; a
    /// connection found closed is dropped, to be reopened by the next call.
    fn with<T: Send>(&mut self, f: impl FnOnce(&mut Client) -> StoreResult<T> + Send) -> StoreResult<T> {
        let Self { config, tls, client, .. } = self;
        off_runtime(move || {
            if client.as_ref().is_none_or(Client::is_closed) {
                *client = Some(config.connect(tls.clone()).map_err(db_error)?);
            }
            let connected = client.as_mut().ok_or_else(|| StoreError::Unavailable("not connected".into()))?;
            let result = f(connected);
            if connected.is_closed() {
                *client = None;
            }
            result
        })
    }

    /// Runs a change in one transaction that first locks the generation row:
    /// changes made through several nodes queue there, in one order, instead
    /// of deadlocking on each other's rows (the triggers bump the row anyway).
    fn write<T: Send>(&mut self, f: impl FnOnce(&mut postgres::Transaction<'_>) -> StoreResult<T> + Send) -> StoreResult<T> {
        self.with(|c| {
            let mut tx = c.transaction().map_err(db_error)?;
            tx.execute("SELECT n FROM generation WHERE id = 1 FOR UPDATE", &[]).map_err(db_error)?;
            let out = f(&mut tx)?;
            tx.commit().map_err(db_error)?;
            Ok(out)
        })
    }

    fn select_tenants(&mut self, filter: Option<&str>) -> StoreResult<Vec<TenantRow>> {
        self.with(|c| {
            let rows = match filter {
                None => c.query("SELECT name, limits, created_at, incarnation FROM tenants ORDER BY name", &[]),
                Some(name) => c.query("SELECT name, limits, created_at, incarnation FROM tenants WHERE name = $1", &[&name]),
            }
            .map_err(db_error)?;
            rows.iter()
                .map(|r| {
                    let name: String = r.get(0);
                    let overrides = serde_json::from_str(r.get(1)).map_err(|e| anyhow::anyhow!("limits of {name}: {e}"))?;
                    Ok(TenantRow { name, overrides, created_at: r.get(2), incarnation: r.get(3) })
                })
                .collect()
        })
    }
}

/// The connection settings of every client of `url` (the store's and the
/// state's, `crate::kv`): TLS as `pg_connect` decides, timeouts, keepalives.
pub fn client_config(url: &str) -> anyhow::Result<(Config, MakeRustlsConnect)> {
    let (mut config, tls) = super::pg_connect::connector(url)?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(3));
    }
    // A database that vanishes without closing the connection is noticed
    // in seconds, not after the kernel's retransmissions (~15 min).
    config.keepalives(true).keepalives_idle(Duration::from_secs(10)).keepalives_interval(Duration::from_secs(2)).keepalives_retries(3);
    config.tcp_user_timeout(Duration::from_secs(15));
    config.options("-c statement_timeout=30000 -c lock_timeout=10000");
    config.application_name("facegate");
    Ok((config, tls))
}

/// Runs `f` on a scoped thread when the caller is inside a Tokio runtime
/// (the blocking client would refuse to run there).
fn off_runtime<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    if tokio::runtime::Handle::try_current().is_err() {
        return f();
    }
    std::thread::scope(|s| s.spawn(f).join()).unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// `postgres://user@host:port/db`, without the password.
fn describe(config: &Config) -> String {
    let host = config
        .get_hosts()
        .first()
        .map(|h| match h {
            postgres::config::Host::Tcp(name) => name.clone(),
            #[cfg(unix)]
            postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .unwrap_or_default();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!("postgres://{}@{host}:{port}/{}", config.get_user().unwrap_or(""), config.get_dbname().unwrap_or(""))
}

/// A database error as a store error: a lost or refused connection means
/// the database is unavailable; anything else is a failure.
fn db_error(e: postgres::Error) -> StoreError {
    if e.is_closed() || e.as_db_error().is_none() {
        return StoreError::Unavailable(with_causes(&e));
    }
    if e.code() == Some(&SqlState::ADMIN_SHUTDOWN) || e.code() == Some(&SqlState::CANNOT_CONNECT_NOW) {
        return StoreError::Unavailable(with_causes(&e));
    }
    let retryable =
        [&SqlState::T_R_DEADLOCK_DETECTED, &SqlState::T_R_SERIALIZATION_FAILURE, &SqlState::LOCK_NOT_AVAILABLE, &SqlState::QUERY_CANCELED];
    if e.code().is_some_and(|code| retryable.contains(&code)) {
        return StoreError::Busy(format!("the store is busy with another change; retry: {}", with_causes(&e)));
    }
    StoreError::Internal(e.into())
}

/// The error and its causes ("error performing TLS handshake: invalid peer certificate: UnknownIssuer").
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(inner) = cause {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        cause = inner.source();
    }
    text
}

fn migrate(client: &mut Client) -> StoreResult<()> {
    let mut tx = client.transaction().map_err(db_error)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]).map_err(db_error)?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INT PRIMARY KEY, applied_at BIGINT NOT NULL)")
        .map_err(db_error)?;
    let current: i32 = tx.query_one("SELECT COALESCE(MAX(version), 0) FROM schema_migrations", &[]).map_err(db_error)?.get(0);
    let current = usize::try_from(current).unwrap_or(usize::MAX);
    if current > MIGRATIONS.len() {
        return Err(StoreError::Internal(anyhow::anyhow!("schema version {current}; this facegate knows {}", MIGRATIONS.len())));
    }
    for (i, migration) in MIGRATIONS.iter().enumerate().skip(current) {
        tx.batch_execute(migration.sql).map_err(db_error)?;
        tracing::info!(migration = migration.name, "store schema migrated");
        let version = i32::try_from(i + 1).unwrap_or(i32::MAX);
        tx.execute("INSERT INTO schema_migrations (version, applied_at) VALUES ($1, $2)", &[&version, &now()]).map_err(db_error)?;
    }
    add_usage_columns(&mut tx)?;
    tx.commit().map_err(db_error)
}

/// Adds the usage figures declared since the table was made (see [`missing_usage_columns`]).
fn add_usage_columns(tx: &mut postgres::Transaction<'_>) -> StoreResult<()> {
    let rows = tx
        .query(
            "SELECT column_name::TEXT FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = 'usage'",
            &[],
        )
        .map_err(db_error)?;
    let columns: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    for column in missing_usage_columns(&columns) {
        tx.batch_execute(&format!("ALTER TABLE usage ADD COLUMN {column} BIGINT NOT NULL DEFAULT 0")).map_err(db_error)?;
    }
    Ok(())
}

/// Stores an upload's artifact; one already there for the component and engine stays.
fn insert_artifact(c: &mut impl postgres::GenericClient, component_sha256: &str, artifact: &SharedArtifact) -> StoreResult<()> {
    c.execute(
        "INSERT INTO artifacts (component_sha256, engine, bytes, mac, created_at) VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
        &[&component_sha256, &artifact.engine, &artifact.bytes, &artifact.mac, &now()],
    )
    .map_err(db_error)?;
    Ok(())
}

/// The generation as the transaction `c` sees it (after its own changes).
fn generation_in(c: &mut impl postgres::GenericClient) -> StoreResult<i64> {
    Ok(c.query_one("SELECT n FROM generation WHERE id = 1", &[]).map_err(db_error)?.get(0))
}

fn tenant_exists(c: &mut impl postgres::GenericClient, name: &str, lock: &str) -> StoreResult<()> {
    let sql = format!("SELECT 1 FROM tenants WHERE name = $1 {lock}");
    match c.query_opt(sql.as_str(), &[&name]).map_err(db_error)? {
        Some(_) => Ok(()),
        None => Err(StoreError::NotFound(format!("no tenant {name:?}"))),
    }
}

impl Store for PgStore {
    fn describe(&self) -> String {
        self.described.clone()
    }

    fn generation(&mut self) -> StoreResult<i64> {
        self.with(|c| Ok(c.query_one("SELECT n FROM generation WHERE id = 1", &[]).map_err(db_error)?.get(0)))
    }

    fn listener(&self) -> Option<ListenerSource> {
        let (config, tls) = (self.config.clone(), self.tls.clone());
        Some(Box::new(move || {
            off_runtime(move || {
                let mut client = config.connect(tls)?;
                client.batch_execute(&format!("LISTEN {CHANNEL}"))?;
                Ok(Box::new(PgListener { client }) as Box<dyn Listener>)
            })
        }))
    }

    fn meta(&mut self, key: &str) -> StoreResult<Option<String>> {
        self.with(|c| Ok(c.query_opt("SELECT value FROM meta WHERE key = $1", &[&key]).map_err(db_error)?.map(|r| r.get(0))))
    }

    fn set_meta(&mut self, key: &str, value: &str) -> StoreResult<()> {
        self.with(|c| {
            c.execute(
                "INSERT INTO meta (key, value) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                &[&key, &value],
            )
            .map_err(db_error)
            .map(drop)
        })
    }

    fn check(&mut self) -> StoreResult<Vec<String>> {
        self.with(|c| {
            let rows = c
                .query(
                    "SELECT h.tenant, h.name, h.active_version FROM handlers h WHERE h.active_version IS NOT NULL AND NOT EXISTS
                     (SELECT 1 FROM versions v WHERE v.tenant = h.tenant AND v.handler = h.name AND v.version = h.active_version)",
                    &[],
                )
                .map_err(db_error)?;
            Ok(rows
                .iter()
                .map(|r| format!("{}/{} is active at missing version {}", r.get::<_, &str>(0), r.get::<_, &str>(1), r.get::<_, i64>(2)))
                .collect())
        })
    }
}

impl TenantStore for PgStore {
    fn tenants(&mut self) -> StoreResult<Vec<TenantRow>> {
        self.select_tenants(None)
    }

    fn tenant(&mut self, name: &str) -> StoreResult<TenantRow> {
        self.select_tenants(Some(name))?.pop().ok_or_else(|| StoreError::NotFound(format!("no tenant {name:?}")))
    }

    fn create_tenant(&mut self, name: &str, overrides: &LimitOverrides) -> StoreResult<()> {
        let limits = serde_json::to_string(overrides).map_err(anyhow::Error::from)?;
        let incarnation = new_incarnation()?;
        let inserted = self.write(|c| {
            c.execute(
                "INSERT INTO tenants (name, limits, created_at, incarnation) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                &[&name, &limits, &now(), &incarnation],
            )
            .map_err(db_error)
        })?;
        if inserted == 0 {
            return Err(StoreError::Conflict(format!("tenant {name:?} exists")));
        }
        Ok(())
    }

    fn set_limits(&mut self, name: &str, overrides: &LimitOverrides) -> StoreResult<()> {
        let limits = serde_json::to_string(overrides).map_err(anyhow::Error::from)?;
        let updated = self.write(|c| c.execute("UPDATE tenants SET limits = $2 WHERE name = $1", &[&name, &limits]).map_err(db_error))?;
        if updated == 0 {
            return Err(StoreError::NotFound(format!("no tenant {name:?}")));
        }
        Ok(())
    }

    fn delete_tenant(&mut self, name: &str) -> StoreResult<()> {
        if self.write(|c| c.execute("DELETE FROM tenants WHERE name = $1", &[&name]).map_err(db_error))? == 0 {
            return Err(StoreError::NotFound(format!("no tenant {name:?}")));
        }
        Ok(())
    }

    fn is_empty(&mut self) -> StoreResult<bool> {
        self.with(|c| Ok(c.query_one("SELECT COUNT(*) FROM tenants", &[]).map_err(db_error)?.get::<_, i64>(0) == 0))
    }

    fn insert_key(&mut self, tenant: &str, id: &str, secret_sha256: &str, scopes: Scopes, max_keys: u32) -> StoreResult<KeyCommit> {
        let created_at = now();
        let scopes = scopes.to_string();
        // Under `write`'s lock of the generation row: every node's key
        // creations queue there, so the count holds until the insert.
        let generation = self.write(|tx| {
            tenant_exists(tx, tenant, "FOR SHARE")?;
            let active: i64 = tx
                .query_one("SELECT COUNT(*) FROM api_keys WHERE tenant = $1 AND revoked_at IS NULL", &[&tenant])
                .map_err(db_error)?
                .get(0);
            if active >= i64::from(max_keys) {
                return Err(too_many_keys(tenant, active));
            }
            tx.execute(
                "INSERT INTO api_keys (id, tenant, secret_sha256, created_at, scopes) VALUES ($1, $2, $3, $4, $5)",
                &[&id, &tenant, &secret_sha256, &created_at, &scopes],
            )
            .map_err(db_error)?;
            generation_in(tx)
        })?;
        Ok(KeyCommit { at: created_at, generation })
    }

    fn keys(&mut self, tenant: &str) -> StoreResult<Vec<KeyRow>> {
        self.tenant(tenant)?;
        self.with(|c| {
            let rows = c
                .query("SELECT id, created_at, revoked_at, scopes FROM api_keys WHERE tenant = $1 ORDER BY created_at DESC, id", &[&tenant])
                .map_err(db_error)?;
            Ok(rows
                .iter()
                .map(|r| KeyRow { id: r.get(0), created_at: r.get(1), revoked_at: r.get(2), scopes: Scopes::from_stored(r.get(3)) })
                .collect())
        })
    }

    fn active_keys(&mut self) -> StoreResult<Vec<ActiveKeyRow>> {
        self.with(|c| {
            let rows = c.query("SELECT id, tenant, secret_sha256, scopes FROM api_keys WHERE revoked_at IS NULL", &[]).map_err(db_error)?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1), r.get(2), Scopes::from_stored(r.get(3)))).collect())
        })
    }

    fn revoke_key(&mut self, tenant: &str, id: &str) -> StoreResult<KeyCommit> {
        let revoked_at = now();
        let generation = self.write(|c| {
            let sql = "UPDATE api_keys SET revoked_at = $3 WHERE tenant = $1 AND id = $2 AND revoked_at IS NULL";
            if c.execute(sql, &[&tenant, &id, &revoked_at]).map_err(db_error)? == 0 {
                return Err(StoreError::NotFound(format!("tenant {tenant:?} has no active key {id:?}")));
            }
            let revoked: i64 = c.query_one(super::COUNT_REVOKED_KEYS, &[&tenant]).map_err(db_error)?.get(0);
            if revoked > super::REVOKED_KEYS_KEPT {
                c.execute(super::PRUNE_REVOKED_KEYS, &[&tenant, &super::REVOKED_KEYS_KEPT]).map_err(db_error)?;
            }
            generation_in(c)
        })?;
        Ok(KeyCommit { at: revoked_at, generation })
    }
}

impl ReleaseStore for PgStore {
    fn add_version(&mut self, new: NewVersion<'_>) -> StoreResult<i64> {
        let NewVersion { tenant, handler, sha256, component, activate, guest_path, source, artifact } = new;
        let size = i64::try_from(component.len()).map_err(anyhow::Error::from)?;
        self.write(|tx| {
            // FOR SHARE: the tenant cannot be deleted under this upload.
            tenant_exists(tx, tenant, "FOR SHARE")?;
            tx.execute(
                "INSERT INTO components (sha256, bytes, created_at) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
                &[&sha256, &component, &now()],
            )
            .map_err(db_error)?;
            // In the same transaction: a node told of the version finds its artifact.
            if let Some(artifact) = artifact {
                insert_artifact(tx, sha256, artifact)?;
            }
            tx.execute("INSERT INTO handlers (tenant, name) VALUES ($1, $2) ON CONFLICT DO NOTHING", &[&tenant, &handler])
                .map_err(db_error)?;
            // FOR UPDATE: uploads of one handler through several nodes number their versions in turn.
            tx.execute("SELECT 1 FROM handlers WHERE tenant = $1 AND name = $2 FOR UPDATE", &[&tenant, &handler]).map_err(db_error)?;
            let version: i64 = tx
                .query_one("SELECT COALESCE(MAX(version), 0) + 1 FROM versions WHERE tenant = $1 AND handler = $2", &[&tenant, &handler])
                .map_err(db_error)?
                .get(0);
            tx.execute(
                "INSERT INTO versions (tenant, handler, version, component_sha256, size, created_at, guest_path, source) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                &[&tenant, &handler, &version, &sha256, &size, &now(), &guest_path.as_str(), &source],
            )
            .map_err(db_error)?;
            if activate {
                tx.execute("UPDATE handlers SET active_version = $3 WHERE tenant = $1 AND name = $2", &[&tenant, &handler, &version])
                    .map_err(db_error)?;
            }
            Ok(version)
        })
    }

    fn prune_versions(&mut self, tenant: &str, handler: &str, keep: usize) -> StoreResult<Pruned> {
        self.write(|tx| {
            let found = tx
                .query_opt(
                    "SELECT active_version, canary_version FROM handlers WHERE tenant = $1 AND name = $2 FOR UPDATE",
                    &[&tenant, &handler],
                )
                .map_err(db_error)?;
            let Some(row) = found else { return Ok(Pruned::default()) };
            let spared: Vec<i64> = [row.get::<_, Option<i64>>(0), row.get::<_, Option<i64>>(1)].into_iter().flatten().collect();
            let rows = tx
                .query("SELECT version FROM versions WHERE tenant = $1 AND handler = $2 ORDER BY version", &[&tenant, &handler])
                .map_err(db_error)?;
            let doomed = versions_past(&rows.iter().map(|r| r.get(0)).collect::<Vec<i64>>(), keep, &spared);
            if doomed.is_empty() {
                return Ok(Pruned::default());
            }
            let deleted = tx
                .query(
                    "DELETE FROM versions WHERE tenant = $1 AND handler = $2 AND version = ANY($3) RETURNING component_sha256",
                    &[&tenant, &handler, &doomed],
                )
                .map_err(db_error)?;
            let shas: Vec<String> = deleted.iter().map(|r| r.get(0)).collect();
            // Their artifacts go with them (ON DELETE CASCADE).
            let freed = tx
                .query(
                    "DELETE FROM components c WHERE c.sha256 = ANY($1)
                     AND NOT EXISTS (SELECT 1 FROM versions v WHERE v.component_sha256 = c.sha256) RETURNING c.sha256",
                    &[&shas],
                )
                .map_err(db_error)?;
            Ok(Pruned { versions: doomed, components: freed.iter().map(|r| r.get(0)).collect() })
        })
    }

    fn handlers(&mut self, tenant: &str) -> StoreResult<Vec<(String, Option<i64>)>> {
        self.with(|c| {
            let rows =
                c.query("SELECT name, active_version FROM handlers WHERE tenant = $1 ORDER BY name", &[&tenant]).map_err(db_error)?;
            Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        })
    }

    fn versions(&mut self, tenant: &str, handler: &str) -> StoreResult<(Vec<VersionRow>, Option<i64>)> {
        self.with(|c| {
            let active: Option<i64> = c
                .query_opt("SELECT active_version FROM handlers WHERE tenant = $1 AND name = $2", &[&tenant, &handler])
                .map_err(db_error)?
                .ok_or_else(|| StoreError::NotFound(format!("tenant {tenant:?} has no handler {handler:?}")))?
                .get(0);
            let rows = c
                .query(
                    "SELECT version, component_sha256, size, created_at, guest_path, source FROM versions WHERE tenant = $1 AND handler = $2 ORDER BY version",
                    &[&tenant, &handler],
                )
                .map_err(db_error)?;
            let versions = rows.iter().map(|r| VersionRow {
                version: r.get(0),
                sha256: r.get(1),
                size: r.get(2),
                created_at: r.get(3),
                guest_path: GuestPath::from_column(r.get(4)),
                source: r.get(5),
            });
            Ok((versions.collect(), active))
        })
    }

    fn activate(&mut self, tenant: &str, handler: &str, version: i64) -> StoreResult<Option<i64>> {
        self.write(|tx| {
            let previous: Option<i64> = tx
                .query_opt("SELECT active_version FROM handlers WHERE tenant = $1 AND name = $2 FOR UPDATE", &[&tenant, &handler])
                .map_err(db_error)?
                .ok_or_else(|| StoreError::NotFound(format!("tenant {tenant:?} has no handler {handler:?}")))?
                .get(0);
            let exists = tx
                .query_opt("SELECT 1 FROM versions WHERE tenant = $1 AND handler = $2 AND version = $3", &[&tenant, &handler, &version])
                .map_err(db_error)?;
            if exists.is_none() {
                return Err(StoreError::NotFound(format!("{tenant}/{handler} has no version {version}")));
            }
            tx.execute("UPDATE handlers SET active_version = $3 WHERE tenant = $1 AND name = $2", &[&tenant, &handler, &version])
                .map_err(db_error)?;
            Ok(previous)
        })
    }

    fn active_handlers(&mut self) -> StoreResult<Vec<ActiveHandler>> {
        self.with(|c| {
            let rows = c
                .query(
                    "SELECT h.tenant, h.name, h.active_version, v.component_sha256, v.guest_path FROM handlers h
                     JOIN versions v ON v.tenant = h.tenant AND v.handler = h.name AND v.version = h.active_version",
                    &[],
                )
                .map_err(db_error)?;
            Ok(rows.iter().map(active_of).collect())
        })
    }

    fn set_canary(&mut self, tenant: &str, handler: &str, canary: Option<Canary>) -> StoreResult<()> {
        let (margin, after) = canary.and_then(|c| c.abort).map_or((None, None), |a| (Some(a.margin), Some(a.after as i64)));
        let (version, percent) = (canary.map(|c| c.version), canary.map_or(0, |c| i64::from(c.percent)));
        self.write(|tx| {
            let found = tx
                .query_opt("SELECT 1 FROM handlers WHERE tenant = $1 AND name = $2 FOR UPDATE", &[&tenant, &handler])
                .map_err(db_error)?;
            if found.is_none() {
                return Err(StoreError::NotFound(format!("tenant {tenant:?} has no handler {handler:?}")));
            }
            if let Some(version) = version {
                let exists = tx
                    .query_opt("SELECT 1 FROM versions WHERE tenant = $1 AND handler = $2 AND version = $3", &[&tenant, &handler, &version])
                    .map_err(db_error)?;
                if exists.is_none() {
                    return Err(StoreError::NotFound(format!("{tenant}/{handler} has no version {version}")));
                }
            }
            tx.execute(
                "UPDATE handlers SET canary_version = $3, canary_percent = $4, canary_abort_margin = $5, canary_abort_after = $6
                 WHERE tenant = $1 AND name = $2",
                &[&tenant, &handler, &version, &percent, &margin, &after],
            )
            .map_err(db_error)?;
            Ok(())
        })
    }

    fn canary(&mut self, tenant: &str, handler: &str) -> StoreResult<Option<Canary>> {
        self.with(|c| {
            let row = c
                .query_opt(
                    "SELECT canary_version, canary_percent, canary_abort_margin, canary_abort_after FROM handlers WHERE tenant = $1 AND name = $2",
                    &[&tenant, &handler],
                )
                .map_err(db_error)?
                .ok_or_else(|| StoreError::NotFound(format!("tenant {tenant:?} has no handler {handler:?}")))?;
            Ok(canary_of(row.get(0), row.get(1), row.get(2), row.get(3)))
        })
    }

    fn canaries(&mut self) -> StoreResult<Vec<(ActiveHandler, Canary)>> {
        self.with(|c| {
            let rows = c
                .query(
                    "SELECT h.tenant, h.name, h.canary_version, v.component_sha256, v.guest_path, h.canary_percent, h.canary_abort_margin, h.canary_abort_after
                     FROM handlers h JOIN versions v ON v.tenant = h.tenant AND v.handler = h.name AND v.version = h.canary_version",
                    &[],
                )
                .map_err(db_error)?;
            Ok(rows
                .iter()
                .filter_map(|r| {
                    let active = active_of(r);
                    let canary = canary_of(Some(active.version), r.get(5), r.get(6), r.get(7))?;
                    Some((active, canary))
                })
                .collect())
        })
    }

    fn all_versions(&mut self) -> StoreResult<Vec<(String, String)>> {
        self.with(|c| {
            let rows = c.query("SELECT tenant, handler, version, component_sha256 FROM versions", &[]).map_err(db_error)?;
            Ok(rows.iter().map(|r| (format!("{}/{}@{}", r.get::<_, &str>(0), r.get::<_, &str>(1), r.get::<_, i64>(2)), r.get(3))).collect())
        })
    }
}

/// A version to serve from its row's first five columns (tenant, handler,
/// version, component, guest path).
fn active_of(r: &postgres::Row) -> ActiveHandler {
    ActiveHandler { tenant: r.get(0), handler: r.get(1), version: r.get(2), sha256: r.get(3), guest_path: GuestPath::from_column(r.get(4)) }
}

impl RouteStore for PgStore {
    fn add_route(&mut self, route: &RouteRow) -> StoreResult<()> {
        let changed = self.write(|tx| {
            // FOR SHARE: the tenant cannot be deleted under this change.
            tenant_exists(tx, &route.tenant, "FOR SHARE")?;
            // Moves a hostname among its own tenant's handlers only.
            tx.execute(
                "INSERT INTO routes (hostname, tenant, handler, created_at) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (hostname) DO UPDATE SET handler = excluded.handler WHERE routes.tenant = excluded.tenant",
                &[&route.hostname, &route.tenant, &route.handler, &route.created_at],
            )
            .map_err(db_error)
        })?;
        if changed == 0 {
            return Err(hostname_taken(&route.hostname));
        }
        Ok(())
    }

    fn routes(&mut self) -> StoreResult<Vec<RouteRow>> {
        self.with(|c| {
            let rows = c.query("SELECT hostname, tenant, handler, created_at FROM routes ORDER BY hostname", &[]).map_err(db_error)?;
            Ok(rows.iter().map(|r| RouteRow { hostname: r.get(0), tenant: r.get(1), handler: r.get(2), created_at: r.get(3) }).collect())
        })
    }

    fn remove_route(&mut self, hostname: &str) -> StoreResult<()> {
        if self.write(|c| c.execute("DELETE FROM routes WHERE hostname = $1", &[&hostname]).map_err(db_error))? == 0 {
            return Err(StoreError::NotFound(format!("no route for hostname {hostname:?}")));
        }
        Ok(())
    }
}

impl ModelStore for PgStore {
    fn add_model(&mut self, new: NewModel<'_>) -> StoreResult<i64> {
        let NewModel { name, sha256, bytes, spec, accuracy } = new;
        let size = i64::try_from(bytes.len()).map_err(anyhow::Error::from)?;
        self.write(|tx| {
            tx.execute(
                "INSERT INTO model_blobs (sha256, bytes, created_at) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
                &[&sha256, &bytes, &now()],
            )
            .map_err(db_error)?;
            tx.execute("INSERT INTO models (name) VALUES ($1) ON CONFLICT DO NOTHING", &[&name]).map_err(db_error)?;
            // FOR UPDATE: adds of one model through several nodes number their versions in turn.
            tx.execute("SELECT 1 FROM models WHERE name = $1 FOR UPDATE", &[&name]).map_err(db_error)?;
            let version: i64 = tx
                .query_one("SELECT COALESCE(MAX(version), 0) + 1 FROM model_versions WHERE name = $1", &[&name])
                .map_err(db_error)?
                .get(0);
            tx.execute(
                "INSERT INTO model_versions (name, version, sha256, size, spec, accuracy, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
                &[&name, &version, &sha256, &size, &spec, &accuracy, &now()],
            )
            .map_err(db_error)?;
            tx.execute("UPDATE models SET active_version = $2 WHERE name = $1", &[&name, &version]).map_err(db_error)?;
            Ok(version)
        })
    }

    fn models(&mut self) -> StoreResult<Vec<ModelRow>> {
        self.with(|c| {
            let rows = c
                .query(
                    "SELECT v.name, v.version, v.sha256, v.size, v.spec, v.accuracy, m.active_version = v.version, v.created_at
                     FROM model_versions v JOIN models m ON m.name = v.name ORDER BY v.name, v.version",
                    &[],
                )
                .map_err(db_error)?;
            Ok(rows
                .iter()
                .map(|r| ModelRow {
                    name: r.get(0),
                    version: r.get(1),
                    sha256: r.get(2),
                    size: r.get(3),
                    spec: r.get(4),
                    accuracy: r.get(5),
                    active: r.get::<_, Option<bool>>(6).unwrap_or(false),
                    created_at: r.get(7),
                })
                .collect())
        })
    }

    fn activate_model(&mut self, name: &str, version: i64) -> StoreResult<()> {
        self.write(|tx| {
            let exists =
                tx.query_opt("SELECT 1 FROM model_versions WHERE name = $1 AND version = $2", &[&name, &version]).map_err(db_error)?;
            if exists.is_none() {
                let model = tx.query_opt("SELECT 1 FROM models WHERE name = $1", &[&name]).map_err(db_error)?;
                return Err(if model.is_some() { no_model_version(name, version) } else { no_model(name) });
            }
            tx.execute("UPDATE models SET active_version = $2 WHERE name = $1", &[&name, &version]).map_err(db_error)?;
            Ok(())
        })
    }

    fn remove_model(&mut self, name: &str) -> StoreResult<()> {
        self.write(|tx| {
            if tx.execute("DELETE FROM models WHERE name = $1", &[&name]).map_err(db_error)? == 0 {
                return Err(no_model(name));
            }
            tx.execute("DELETE FROM model_blobs WHERE sha256 NOT IN (SELECT sha256 FROM model_versions)", &[]).map_err(db_error)?;
            Ok(())
        })
    }

    fn model_bytes(&mut self, sha256: &str) -> StoreResult<Vec<u8>> {
        let bytes = self.with(|c| {
            Ok(c.query_opt("SELECT bytes FROM model_blobs WHERE sha256 = $1", &[&sha256]).map_err(db_error)?.map(|r| r.get(0)))
        })?;
        checked_model(sha256, bytes)
    }
}

impl RegistryLoginStore for PgStore {
    fn put_registry_login(&mut self, tenant: &str, row: &RegistryLoginRow, sealed: &[u8]) -> StoreResult<()> {
        self.write(|tx| {
            tenant_exists(tx, tenant, "FOR SHARE")?;
            tx.execute(
                "INSERT INTO registry_logins (tenant, registry, username, sealed, updated_at) VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (tenant, registry) DO UPDATE SET username = excluded.username, sealed = excluded.sealed, updated_at = excluded.updated_at",
                &[&tenant, &row.registry, &row.username, &sealed, &row.updated_at],
            )
            .map_err(db_error)
        })?;
        Ok(())
    }

    fn registry_logins(&mut self, tenant: &str) -> StoreResult<Vec<RegistryLoginRow>> {
        self.with(|c| {
            let rows = c
                .query("SELECT registry, username, updated_at FROM registry_logins WHERE tenant = $1 ORDER BY registry", &[&tenant])
                .map_err(db_error)?;
            Ok(rows.iter().map(|r| RegistryLoginRow { registry: r.get(0), username: r.get(1), updated_at: r.get(2) }).collect())
        })
    }

    fn registry_login(&mut self, tenant: &str, registry: &str) -> StoreResult<Option<(RegistryLoginRow, Vec<u8>)>> {
        self.with(|c| {
            let row = c
                .query_opt(
                    "SELECT registry, username, updated_at, sealed FROM registry_logins WHERE tenant = $1 AND registry = $2",
                    &[&tenant, &registry],
                )
                .map_err(db_error)?;
            Ok(row.map(|r| (RegistryLoginRow { registry: r.get(0), username: r.get(1), updated_at: r.get(2) }, r.get(3))))
        })
    }

    fn remove_registry_login(&mut self, tenant: &str, registry: &str) -> StoreResult<()> {
        let removed = self.write(|c| {
            c.execute("DELETE FROM registry_logins WHERE tenant = $1 AND registry = $2", &[&tenant, &registry]).map_err(db_error)
        })?;
        if removed == 0 {
            return Err(no_registry_login(tenant, registry));
        }
        Ok(())
    }
}

impl SettingStore for PgStore {
    fn put_setting(&mut self, row: &SettingRow, value: &[u8], quota: SettingQuota) -> StoreResult<()> {
        self.write(|tx| {
            // FOR UPDATE: one node's change of this tenant's settings at a time, so the quota holds.
            tenant_exists(tx, &row.tenant, "FOR UPDATE")?;
            let used = tx
                .query_one(
                    "SELECT COUNT(*), COALESCE(SUM(LENGTH(value)), 0)::BIGINT FROM settings WHERE tenant = $1 AND NOT (handler = $2 AND name = $3)",
                    &[&row.tenant, &row.handler, &row.name],
                )
                .map_err(db_error)?;
            let (count, bytes): (i64, i64) = (used.get(0), used.get(1));
            if let Some(refusal) = settings_quota(&row.tenant, quota, (count as usize + 1, bytes as usize + value.len())) {
                return Err(refusal);
            }
            tx.execute(
                "INSERT INTO settings (tenant, handler, name, secret, value, updated_at) VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (tenant, handler, name) DO UPDATE SET secret = excluded.secret, value = excluded.value, updated_at = excluded.updated_at",
                &[&row.tenant, &row.handler, &row.name, &row.secret, &value, &row.updated_at],
            )
            .map_err(db_error)
        })?;
        Ok(())
    }

    fn remove_setting(&mut self, tenant: &str, handler: &str, name: &str) -> StoreResult<()> {
        let removed = self.write(|c| {
            c.execute("DELETE FROM settings WHERE tenant = $1 AND handler = $2 AND name = $3", &[&tenant, &handler, &name])
                .map_err(db_error)
        })?;
        if removed == 0 {
            return Err(no_setting(tenant, handler, name));
        }
        Ok(())
    }

    fn settings(&mut self, tenant: Option<&str>) -> StoreResult<Vec<StoredSetting>> {
        self.with(|c| {
            let rows = c
                .query(
                    "SELECT s.tenant, s.handler, s.name, s.secret, s.updated_at, s.value, t.incarnation FROM settings s JOIN tenants t ON t.name = s.tenant
                     WHERE $1::TEXT IS NULL OR s.tenant = $1 ORDER BY s.tenant, s.handler, s.name",
                    &[&tenant],
                )
                .map_err(db_error)?;
            let stored = |r: &postgres::Row| {
                let row = SettingRow { tenant: r.get(0), handler: r.get(1), name: r.get(2), secret: r.get(3), updated_at: r.get(4) };
                StoredSetting { row, value: r.get(5), incarnation: r.get(6) }
            };
            Ok(rows.iter().map(stored).collect())
        })
    }
}

impl ArtifactStore for PgStore {
    fn component(&mut self, sha256: &str) -> StoreResult<Vec<u8>> {
        let bytes: Vec<u8> = self
            .with(|c| Ok(c.query_opt("SELECT bytes FROM components WHERE sha256 = $1", &[&sha256]).map_err(db_error)?.map(|r| r.get(0))))?
            .ok_or_else(|| StoreError::Internal(anyhow::anyhow!("component {sha256} is missing from the store")))?;
        let actual = sha256_hex(&bytes);
        if actual != sha256 {
            return Err(StoreError::Internal(anyhow::anyhow!("component {sha256} is corrupt: sha256 {actual}")));
        }
        Ok(bytes)
    }

    fn shared_artifact(&mut self, component_sha256: &str, engine: &str) -> StoreResult<Option<SharedArtifact>> {
        self.with(|c| {
            let row = c
                .query_opt("SELECT bytes, mac FROM artifacts WHERE component_sha256 = $1 AND engine = $2", &[&component_sha256, &engine])
                .map_err(db_error)?;
            Ok(row.map(|r| SharedArtifact { engine: engine.to_owned(), bytes: r.get(0), mac: r.get(1) }))
        })
    }

    fn share_artifact(&mut self, component_sha256: &str, artifact: &SharedArtifact) -> StoreResult<()> {
        // No generation lock: an artifact changes nothing that is served.
        // It replaces the row: a node shares only after it found none it could use.
        self.with(|c| {
            c.execute(
                "INSERT INTO artifacts (component_sha256, engine, bytes, mac, created_at) VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (component_sha256, engine) DO UPDATE SET bytes = EXCLUDED.bytes, mac = EXCLUDED.mac, created_at = EXCLUDED.created_at",
                &[&component_sha256, &artifact.engine, &artifact.bytes, &artifact.mac, &now()],
            )
            .map_err(db_error)?;
            Ok(())
        })
    }
}

impl NodeStore for PgStore {
    fn heartbeat(&mut self, node: &NodeRow) -> StoreResult<()> {
        let info = serde_json::to_string(node).map_err(anyhow::Error::from)?;
        self.with(|c| {
            c.execute(
                "INSERT INTO nodes (id, info, heartbeat_at) VALUES ($1, $2, $3)
                 ON CONFLICT (id) DO UPDATE SET info = excluded.info, heartbeat_at = excluded.heartbeat_at",
                &[&node.id, &info, &node.heartbeat_at],
            )
            .map_err(db_error)
            .map(drop)
        })
    }

    fn remove_nodes(&mut self, id: &str, older_than_ms: i64) -> StoreResult<()> {
        self.with(|c| c.execute("DELETE FROM nodes WHERE id = $1 OR heartbeat_at < $2", &[&id, &older_than_ms]).map_err(db_error).map(drop))
    }

    fn nodes(&mut self) -> StoreResult<Vec<NodeRow>> {
        self.with(|c| {
            let rows = c.query("SELECT info FROM nodes ORDER BY id", &[]).map_err(db_error)?;
            rows.iter().map(|r| Ok(serde_json::from_str(r.get(0)).map_err(anyhow::Error::from)?)).collect()
        })
    }
}

impl UsageStore for PgStore {
    fn write_usage(&mut self, delta: &Delta) -> StoreResult<()> {
        self.with(|c| {
            let mut tx = c.transaction().map_err(db_error)?;
            let insert = tx
                .prepare(&format!(
                    "INSERT INTO usage (node, seq, tenant, handler, version, bucket_ms, {}) VALUES ($1, $2, $3, $4, $5, $6, {}) ON CONFLICT DO NOTHING",
                    usage_columns(),
                    usage_placeholders('$', 7)
                ))
                .map_err(db_error)?;
            let seq = i64::try_from(delta.seq).unwrap_or(i64::MAX);
            for (key, usage) in &delta.rows {
                let figures = usage_values(usage);
                let mut args: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    vec![&delta.node, &seq, &key.tenant, &key.handler, &key.version, &key.bucket_ms];
                args.extend(figures.iter().map(|v| v as &(dyn postgres::types::ToSql + Sync)));
                tx.execute(&insert, &args).map_err(db_error)?;
            }
            let insert = tx
                .prepare(
                    "INSERT INTO usage_models (node, seq, tenant, handler, version, bucket_ms, model, device_us, infer_calls)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING",
                )
                .map_err(db_error)?;
            for (key, models) in &delta.models {
                for (model, usage) in models {
                    let (device_us, calls) = (stored(usage.device_us), stored(usage.infer_calls));
                    let args: [&(dyn postgres::types::ToSql + Sync); 9] =
                        [&delta.node, &seq, &key.tenant, &key.handler, &key.version, &key.bucket_ms, model, &device_us, &calls];
                    tx.execute(&insert, &args).map_err(db_error)?;
                }
            }
            tx.commit().map_err(db_error)
        })
    }

    fn usage(&mut self, tenant: Option<&str>, from_ms: i64, to_ms: i64) -> StoreResult<Vec<(UsageKey, Usage)>> {
        let tenant = tenant.map(str::to_owned);
        // One tenant's rows by the (tenant, bucket) index, whatever plan a
        // `$3 IS NULL OR tenant = $3` would get.
        let of_tenant = if tenant.is_some() { "tenant = $3" } else { "$3::TEXT IS NULL" };
        let sql = format!(
            "SELECT tenant, handler, version, bucket_ms, {} FROM usage WHERE {of_tenant} AND bucket_ms >= $1 AND bucket_ms < $2
             GROUP BY tenant, handler, version, bucket_ms ORDER BY bucket_ms, tenant, handler, version",
            usage_aggregates("::BIGINT")
        );
        self.with(move |c| {
            let rows = c.query(sql.as_str(), &[&from_ms, &to_ms, &tenant]).map_err(db_error)?;
            Ok(rows
                .iter()
                .map(|r| {
                    let v: [i64; Usage::COUNT] = std::array::from_fn(|i| r.get(4 + i));
                    (usage_key(r), usage_from(v))
                })
                .collect())
        })
    }

    fn usage_by_model(&mut self, tenant: Option<&str>, from_ms: i64, to_ms: i64) -> StoreResult<Vec<(UsageKey, String, ModelUsage)>> {
        let tenant = tenant.map(str::to_owned);
        let of_tenant = if tenant.is_some() { "tenant = $3" } else { "$3::TEXT IS NULL" };
        let sql = format!(
            "SELECT tenant, handler, version, bucket_ms, model, SUM(device_us)::BIGINT, SUM(infer_calls)::BIGINT FROM usage_models
             WHERE {of_tenant} AND bucket_ms >= $1 AND bucket_ms < $2
             GROUP BY tenant, handler, version, bucket_ms, model ORDER BY bucket_ms, tenant, handler, version, model"
        );
        self.with(move |c| {
            let rows = c.query(sql.as_str(), &[&from_ms, &to_ms, &tenant]).map_err(db_error)?;
            Ok(rows
                .iter()
                .map(|r| (usage_key(r), r.get(4), ModelUsage { device_us: figure(r.get(5)), infer_calls: figure(r.get(6)) }))
                .collect())
        })
    }

    fn prune_usage(&mut self, before_ms: i64) -> StoreResult<()> {
        self.with(|c| {
            let mut tx = c.transaction().map_err(db_error)?;
            tx.execute("DELETE FROM usage WHERE bucket_ms < $1", &[&before_ms]).map_err(db_error)?;
            tx.execute("DELETE FROM usage_models WHERE bucket_ms < $1", &[&before_ms]).map_err(db_error)?;
            tx.commit().map_err(db_error)
        })
    }
}

/// The bucket a usage row's first four columns name (tenant, handler, version, bucket_ms).
fn usage_key(r: &postgres::Row) -> UsageKey {
    UsageKey { tenant: r.get(0), handler: r.get(1), version: r.get(2), bucket_ms: r.get(3) }
}

impl Drop for PgStore {
    /// Closes the connection off the gateway's runtime: the blocking client
    /// runs a runtime of its own to close, which panics inside another (a
    /// node stopping on SIGTERM drops its store on the async main thread).
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            off_runtime(move || drop(client));
        }
    }
}

/// A connection that `LISTEN`s on the change channel.
struct PgListener {
    client: Client,
}

impl Listener for PgListener {
    fn wait(&mut self, timeout: Duration) -> anyhow::Result<bool> {
        let announced = {
            let mut notifications = self.client.notifications();
            let announced = notifications.timeout_iter(timeout).next()?.is_some();
            // Several changes may have queued up: one refresh covers them all.
            while notifications.iter().next()?.is_some() {}
            announced
        };
        if self.client.is_closed() {
            anyhow::bail!("the listening connection closed");
        }
        Ok(announced)
    }
}
