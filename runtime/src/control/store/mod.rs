//! Where the control plane's state lives: tenants, hashed API keys, handler
//! versions and component bytes, plus the gateway nodes' heartbeats.
//!
//! Two implementations of one [`Store`] trait: [`sqlite::SqliteStore`], the
//! embedded default (one node, a file in the data directory), and
//! [`postgres::PgStore`] (`--store postgres://…`), shared by every node of a
//! cluster. Both keep a *generation* counter that every change to tenants,
//! keys, handlers or versions bumps (database triggers, so no writer can
//! forget it): a node whose snapshot was built at an older generation
//! rebuilds it. PostgreSQL also announces each change with `NOTIFY`
//! ([`Store::listener`]). Schemas are versioned; each store applies its
//! missing migrations when opened.

/// One schema migration: its file's name (`NNNN_what`) and its SQL.
pub(crate) struct Migration {
    /// The file's name without `.sql`; its number is its place in the list.
    pub name: &'static str,
    /// What it runs.
    pub sql: &'static str,
}

/// A dialect's migrations, from `migrations/<dialect>/<name>.sql`, in the order given.
macro_rules! migrations {
    ($dialect:literal: $($name:literal),+ $(,)?) => {
        &[$($crate::control::store::Migration { name: $name, sql: include_str!(concat!("migrations/", $dialect, "/", $name, ".sql")) }),+]
    };
}
use migrations;

mod pg_connect;
pub mod postgres;
pub mod sqlite;

use crate::telemetry::usage::{Delta, ModelUsage, Usage, UsageKey};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::admission::limits::LimitOverrides;
use crate::control::keys::Scopes;
pub use crate::control::seal::SharedArtifact;
use crate::sandbox::handler::GuestPath;

/// File name of the SQLite database inside the data directory.
pub const DB_FILE: &str = "facegate.db";

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
    /// The caller may not do this (a tenant's key past its scope).
    #[error("{0}")]
    Forbidden(String),
    /// A tenant's quota (its handlers) is used up.
    #[error("{0}")]
    Quota(String),
    /// Too many of the caller's own at once (its uploads, its changes);
    /// retry shortly. `code` is the answer's error code.
    #[error("{message}")]
    TooMany {
        /// The error code the API answers (`upload_in_progress`, `change_in_progress`).
        code: &'static str,
        /// What is in progress.
        message: String,
    },
    /// The node's memory budget cannot hold what the call needs now; retry shortly.
    #[error("{0}")]
    NoMemory(String),
    /// The gateway cannot take this now (uploads compiling); retry later.
    #[error("{0}")]
    Busy(String),
    /// The database cannot be reached; the node serves its last snapshot.
    #[error("the control-plane database is unreachable: {0}")]
    Unavailable(String),
    /// The store itself failed (disk, database).
    #[error("store failure: {0:#}")]
    Internal(#[from] anyhow::Error),
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
    /// Set anew each time a tenant of this name is created (see `new_incarnation`).
    #[serde(skip)]
    pub incarnation: String,
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
    /// What it may do.
    pub scopes: Scopes,
}

/// A key that authenticates: `(id, tenant, secret_sha256 hex, scopes)`.
pub type ActiveKeyRow = (String, String, String, Scopes);

/// A canary release: `version` serves `percent` of a handler's requests,
/// the active version the rest.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Canary {
    /// The version on trial.
    pub version: i64,
    /// Its share of the requests, 1 to 99.
    pub percent: u8,
    /// When a node aborts it by itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub abort: Option<AbortRule>,
}

/// Abort a canary once it has served `after` requests on a node and its
/// share of 5xx answers exceeds the active version's by more than `margin`
/// (0.05: five points).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct AbortRule {
    /// Points of 5xx share over the active version's, as a fraction.
    pub margin: f64,
    /// Requests the canary serves on a node before the rule applies.
    pub after: u64,
}

/// A canary from its columns (none without a version or a share).
pub(super) fn canary_of(version: Option<i64>, percent: i64, margin: Option<f64>, after: Option<i64>) -> Option<Canary> {
    let percent = u8::try_from(percent).ok().filter(|p| (1..=99).contains(p))?;
    let abort = margin.zip(after).map(|(margin, after)| AbortRule { margin, after: u64::try_from(after).unwrap_or(0) });
    Some(Canary { version: version?, percent, abort })
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
    /// The path its guest sees.
    pub guest_path: GuestPath,
    /// Where its bytes came from: [`UPLOADED`], or `oci://…@sha256:…`.
    pub source: String,
}

/// The source of a version whose bytes came in the deploy's body.
pub const UPLOADED: &str = "upload";

/// Revoked keys a tenant's list keeps (the newest by revocation); older
/// ones are deleted as another is revoked, so a tenant that creates and
/// revokes keys without end does not grow the store without end.
pub const REVOKED_KEYS_KEPT: i64 = 100;

/// How many revoked keys a tenant (`$1`) has.
pub(super) const COUNT_REVOKED_KEYS: &str = "SELECT COUNT(*) FROM api_keys WHERE tenant = $1 AND revoked_at IS NOT NULL";

/// Deletes a tenant's (`$1`) revoked keys past the newest [`REVOKED_KEYS_KEPT`] (`$2`).
/// Run only when there are more (see [`COUNT_REVOKED_KEYS`]): on
/// PostgreSQL any statement on the table bumps the generation.
pub(super) const PRUNE_REVOKED_KEYS: &str = "DELETE FROM api_keys WHERE tenant = $1 AND revoked_at IS NOT NULL AND id NOT IN \
     (SELECT id FROM api_keys WHERE tenant = $1 AND revoked_at IS NOT NULL ORDER BY revoked_at DESC, id DESC LIMIT $2)";

/// A key change as committed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeyCommit {
    /// Unix seconds: when the key was created, or revoked.
    pub at: i64,
    /// The store's generation right after the change, read in its
    /// transaction. A key change bumps the generation exactly once, so the
    /// store was at `generation - 1` just before it: a snapshot of that
    /// generation with this change applied is the store at `generation`.
    pub generation: i64,
}

/// The quota refusal of a key past `max_keys`.
pub(crate) fn too_many_keys(tenant: &str, active: i64) -> StoreError {
    StoreError::Quota(format!("tenant {tenant:?} has {active} keys, its most (max_keys); revoke one first"))
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
    /// The path its guest sees.
    pub guest_path: GuestPath,
}

/// A new handler version: its component is stored with the row, in one
/// transaction where the store allows (nothing partial is ever visible).
pub struct NewVersion<'a> {
    /// Owning tenant.
    pub tenant: &'a str,
    /// Handler name (created on its first version).
    pub handler: &'a str,
    /// SHA-256 (hex) of `component`, computed by the caller.
    pub sha256: &'a str,
    /// The component's bytes.
    pub component: &'a [u8],
    /// Whether the new version becomes the active one.
    pub activate: bool,
    /// The path its guest sees.
    pub guest_path: GuestPath,
    /// Where its bytes came from (see [`VersionRow::source`]).
    pub source: &'a str,
    /// The component precompiled by the uploading node, for the other
    /// nodes of a cluster (stores that serve one node keep none).
    pub artifact: Option<&'a SharedArtifact>,
}

/// A gateway node as it last reported itself.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct NodeRow {
    /// `--node-id` (default: the host name).
    pub id: String,
    /// Where its data plane listens, as others reach it (`--advertise`).
    pub address: String,
    /// facegate version.
    pub version: String,
    /// Inference devices, e.g. `["cpu"]`.
    pub devices: Vec<String>,
    /// Load at the last heartbeat.
    pub load: NodeLoad,
    /// Unix milliseconds.
    pub started_at: i64,
    /// Unix milliseconds of the last heartbeat.
    pub heartbeat_at: i64,
}

/// What a node reports about its load.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct NodeLoad {
    /// Inference calls waiting for a device.
    pub queue_depth: u64,
    /// Handler instances running now.
    pub in_flight: u64,
    /// Handlers in its snapshot.
    pub handlers: u64,
    /// Store generation of its snapshot.
    pub generation: i64,
}

/// Wakes a node when another node changed the store (PostgreSQL `LISTEN`).
pub trait Listener: Send {
    /// Waits up to `timeout` for a change; `Ok(true)` if one was announced.
    /// An error means the listening connection is gone: the caller polls and
    /// asks for a new listener later.
    fn wait(&mut self, timeout: Duration) -> anyhow::Result<bool>;
}

/// Opens a [`Listener`].
pub type ListenerSource = Box<dyn FnOnce() -> anyhow::Result<Box<dyn Listener>> + Send>;

/// The control plane's persistent state (see the module docs): one
/// part of the contract per concept, each implemented by both stores.
/// Methods take `&mut self`: each part of the control plane holds its
/// connection behind a lock of its own.
pub trait Store:
    TenantStore + ReleaseStore + ArtifactStore + NodeStore + UsageStore + RouteStore + RegistryLoginStore + SettingStore + ModelStore + Send
{
    /// What this store is, for logs: `sqlite:<path>` or `postgres://host/db` (no password).
    fn describe(&self) -> String;

    /// The change counter (see the module docs).
    fn generation(&mut self) -> StoreResult<i64>;

    /// How to open a listener for change announcements, if this store has
    /// them (it connects when called: the caller does so without the store's lock).
    fn listener(&self) -> Option<ListenerSource>;

    /// A store-wide setting.
    fn meta(&mut self, key: &str) -> StoreResult<Option<String>>;

    /// Sets a store-wide setting.
    fn set_meta(&mut self, key: &str, value: &str) -> StoreResult<()>;

    /// The database's own checks plus the store's invariants; each problem as text.
    fn check(&mut self) -> StoreResult<Vec<String>>;
}

/// The store's part for tenants and their API keys.
pub trait TenantStore {
    /// All tenants, by name.
    fn tenants(&mut self) -> StoreResult<Vec<TenantRow>>;

    /// One tenant.
    fn tenant(&mut self, name: &str) -> StoreResult<TenantRow>;

    /// Creates a tenant.
    fn create_tenant(&mut self, name: &str, overrides: &LimitOverrides) -> StoreResult<()>;

    /// Replaces a tenant's overrides.
    fn set_limits(&mut self, name: &str, overrides: &LimitOverrides) -> StoreResult<()>;

    /// Deletes a tenant with its keys, handlers and versions (component
    /// bytes stay: they are content-addressed and may be shared).
    fn delete_tenant(&mut self, name: &str) -> StoreResult<()>;

    /// Whether no tenant exists yet (a fresh store).
    fn is_empty(&mut self) -> StoreResult<bool>;

    /// Records a key of `scopes` for `tenant`, unless the tenant has
    /// `max_keys` unrevoked keys already ([`StoreError::Quota`]): counted
    /// and inserted in one transaction, so concurrent creations, through
    /// any node, never pass the limit together.
    fn insert_key(&mut self, tenant: &str, id: &str, secret_sha256: &str, scopes: Scopes, max_keys: u32) -> StoreResult<KeyCommit>;

    /// A tenant's keys, newest first.
    fn keys(&mut self, tenant: &str) -> StoreResult<Vec<KeyRow>>;

    /// Every key not revoked.
    fn active_keys(&mut self) -> StoreResult<Vec<ActiveKeyRow>>;

    /// Revokes a key of `tenant`.
    fn revoke_key(&mut self, tenant: &str, id: &str) -> StoreResult<KeyCommit>;
}

/// The store's part for handlers, their versions and canaries.
pub trait ReleaseStore {
    /// Stores the component and adds the next version of a handler
    /// (creating the handler), activating it if asked. Returns the version.
    fn add_version(&mut self, new: NewVersion<'_>) -> StoreResult<i64>;

    /// Deletes `tenant`/`handler`'s oldest versions so that at most `keep`
    /// remain, never the active one or the canary's (see
    /// [`versions_past`]), and the components no version uses any more
    /// (a shared store's artifacts with them).
    fn prune_versions(&mut self, tenant: &str, handler: &str, keep: usize) -> StoreResult<Pruned>;

    /// A tenant's handlers with their active versions.
    fn handlers(&mut self, tenant: &str) -> StoreResult<Vec<(String, Option<i64>)>>;

    /// A handler's versions (oldest first) and its active version.
    fn versions(&mut self, tenant: &str, handler: &str) -> StoreResult<(Vec<VersionRow>, Option<i64>)>;

    /// Makes `version` the active one; returns the previously active version.
    fn activate(&mut self, tenant: &str, handler: &str, version: i64) -> StoreResult<Option<i64>>;

    /// Every active handler of every tenant.
    fn active_handlers(&mut self) -> StoreResult<Vec<ActiveHandler>>;

    /// Sets (or, `None`, ends) a handler's canary; its version must exist.
    fn set_canary(&mut self, tenant: &str, handler: &str, canary: Option<Canary>) -> StoreResult<()>;

    /// A handler's canary.
    fn canary(&mut self, tenant: &str, handler: &str) -> StoreResult<Option<Canary>>;

    /// Every canary, with its version's component.
    fn canaries(&mut self) -> StoreResult<Vec<(ActiveHandler, Canary)>>;

    /// Every version: `(tenant/handler@version, component sha256)`.
    fn all_versions(&mut self) -> StoreResult<Vec<(String, String)>>;
}

/// The store's part for component bytes and the artifacts nodes share.
pub trait ArtifactStore {
    /// A component's bytes, checked against their hash.
    fn component(&mut self, sha256: &str) -> StoreResult<Vec<u8>>;

    /// The artifact another node precompiled for `engine`, if this store
    /// shares them (a single node's store does not: its file cache suffices).
    fn shared_artifact(&mut self, _component_sha256: &str, _engine: &str) -> StoreResult<Option<SharedArtifact>> {
        Ok(None)
    }

    /// Offers an artifact this node compiled for the component to the other
    /// nodes, in place of one there for the same engine (which this node
    /// could not use); a no-op where none are shared.
    fn share_artifact(&mut self, _component_sha256: &str, _artifact: &SharedArtifact) -> StoreResult<()> {
        Ok(())
    }
}

/// The store's part for the cluster's nodes and their heartbeats.
pub trait NodeStore {
    /// Records a node's heartbeat (insert or update).
    fn heartbeat(&mut self, node: &NodeRow) -> StoreResult<()>;

    /// Removes a node (it stopped cleanly), and nodes silent since before `older_than_ms`.
    fn remove_nodes(&mut self, id: &str, older_than_ms: i64) -> StoreResult<()>;

    /// Every node that reported, by id.
    fn nodes(&mut self) -> StoreResult<Vec<NodeRow>>;
}

/// A hostname the operator routed to a tenant's handler (see `control::routes`).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RouteRow {
    /// The hostname, lowercase, without a port.
    pub hostname: String,
    /// The tenant it belongs to.
    pub tenant: String,
    /// The tenant's handler it runs (which need not be deployed yet).
    pub handler: String,
    /// Unix seconds.
    pub created_at: i64,
}

/// The refusal of a hostname routed to another tenant already.
pub(super) fn hostname_taken(hostname: &str) -> StoreError {
    StoreError::Conflict(format!("hostname {hostname:?} belongs to another tenant; remove its route first"))
}

/// The store's part for the operator's hostnames.
pub trait RouteStore {
    /// Routes `route.hostname` to its tenant's handler, or moves it to
    /// another handler of the same tenant. A hostname belongs to one
    /// tenant: routed to another already, it is a [`StoreError::Conflict`].
    fn add_route(&mut self, route: &RouteRow) -> StoreResult<()>;

    /// Every route, by hostname.
    fn routes(&mut self) -> StoreResult<Vec<RouteRow>>;

    /// Removes a hostname's route.
    fn remove_route(&mut self, hostname: &str) -> StoreResult<()>;
}

/// One version of a model in the repository (see `control::models`).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ModelRow {
    /// The model's name, as handlers call it.
    pub name: String,
    /// Numbered from 1 per name.
    pub version: i64,
    /// SHA-256 of the ONNX file, hex.
    pub sha256: String,
    /// Bytes of the ONNX file.
    pub size: i64,
    /// Its input and outputs as its engine read them (JSON).
    pub spec: String,
    /// Its accuracy against the reference when it was added (JSON).
    pub accuracy: String,
    /// Whether this is the version served.
    pub active: bool,
    /// Unix seconds.
    pub created_at: i64,
}

/// A model version to store (see [`ModelStore::add_model`]).
pub struct NewModel<'a> {
    /// The model's name.
    pub name: &'a str,
    /// SHA-256 of `bytes`, hex.
    pub sha256: &'a str,
    /// The ONNX file.
    pub bytes: &'a [u8],
    /// Its input and outputs (JSON).
    pub spec: &'a str,
    /// Its accuracy against the reference (JSON).
    pub accuracy: &'a str,
}

/// The store's part for the model repository.
pub trait ModelStore {
    /// Stores the file and adds the next version of a model (creating the
    /// model), active at once. Returns the version.
    fn add_model(&mut self, new: NewModel<'_>) -> StoreResult<i64>;

    /// Every version of every model, by name and version.
    fn models(&mut self) -> StoreResult<Vec<ModelRow>>;

    /// Makes `version` of `name` the one served.
    fn activate_model(&mut self, name: &str, version: i64) -> StoreResult<()>;

    /// Removes a model, every version, and the files no version uses.
    fn remove_model(&mut self, name: &str) -> StoreResult<()>;

    /// A model file's bytes, checked against their hash.
    fn model_bytes(&mut self, sha256: &str) -> StoreResult<Vec<u8>>;
}

/// The refusal of a model name the repository does not hold.
pub(super) fn no_model(name: &str) -> StoreError {
    StoreError::NotFound(format!("no model {name:?} in the repository"))
}

/// The refusal of a version a model does not have.
pub(super) fn no_model_version(name: &str, version: i64) -> StoreError {
    StoreError::NotFound(format!("model {name:?} has no version {version}"))
}

/// A model file's bytes if they match `sha256`.
pub(super) fn checked_model(sha256: &str, bytes: Option<Vec<u8>>) -> StoreResult<Vec<u8>> {
    let bytes = bytes.ok_or_else(|| StoreError::Internal(anyhow::anyhow!("model file {sha256} is missing from the store")))?;
    let actual = crate::control::keys::sha256_hex(&bytes);
    if actual != sha256 {
        return Err(StoreError::Internal(anyhow::anyhow!("model file {sha256} is corrupt: sha256 {actual}")));
    }
    Ok(bytes)
}

/// A tenant's credentials for one registry, as listed (never the password).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RegistryLoginRow {
    /// `HOST[:PORT]`, as references name it.
    pub registry: String,
    /// The user name.
    pub username: String,
    /// Unix seconds of the last change.
    pub updated_at: i64,
}

/// The store's part for tenants' registry credentials (see `control::registries`).
pub trait RegistryLoginStore {
    /// Sets `tenant`'s credentials for `row.registry`: the user name and
    /// the password `sealed` with the secrets key.
    fn put_registry_login(&mut self, tenant: &str, row: &RegistryLoginRow, sealed: &[u8]) -> StoreResult<()>;

    /// `tenant`'s registries with credentials, by name.
    fn registry_logins(&mut self, tenant: &str) -> StoreResult<Vec<RegistryLoginRow>>;

    /// `tenant`'s credentials for `registry`, the password still sealed.
    fn registry_login(&mut self, tenant: &str, registry: &str) -> StoreResult<Option<(RegistryLoginRow, Vec<u8>)>>;

    /// Forgets `tenant`'s credentials for `registry`.
    fn remove_registry_login(&mut self, tenant: &str, registry: &str) -> StoreResult<()>;
}

/// A tenant's setting or secret, as stored beside its value.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct SettingRow {
    /// The tenant.
    pub tenant: String,
    /// The handler it is for; empty: every handler of the tenant.
    pub handler: String,
    /// Its name, as handlers ask for it.
    pub name: String,
    /// Whether its value is a secret (sealed with the secrets key).
    pub secret: bool,
    /// Unix seconds of its last change.
    pub updated_at: i64,
}

/// A stored setting: its row, its value (a secret's sealed) and the
/// incarnation of the tenant it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSetting {
    /// The row.
    pub row: SettingRow,
    /// Its value as stored.
    pub value: Vec<u8>,
    /// Which creation of the tenant it belongs to.
    pub incarnation: String,
}

/// How many settings, and how many bytes of values, a tenant may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SettingQuota {
    /// Settings, all its handlers together.
    pub count: usize,
    /// Bytes of values as stored.
    pub bytes: usize,
}

/// The store's part for tenants' settings and secrets (see `control::settings`).
pub trait SettingStore {
    /// Sets `row`'s setting to `value` (a secret's sealed already), in one
    /// transaction with the check that the tenant stays within `quota`
    /// ([`StoreError::Quota`] otherwise), the tenant's row locked, so two
    /// nodes at once cannot both pass it.
    fn put_setting(&mut self, row: &SettingRow, value: &[u8], quota: SettingQuota) -> StoreResult<()>;

    /// Removes `tenant`'s setting `name` of `handler` (empty: the tenant's own).
    fn remove_setting(&mut self, tenant: &str, handler: &str, name: &str) -> StoreResult<()>;

    /// Every setting, of `tenant` or (`None`) of all tenants.
    fn settings(&mut self, tenant: Option<&str>) -> StoreResult<Vec<StoredSetting>>;
}

/// The refusal of a setting past `quota`: the tenant would have `count`
/// settings of `bytes` bytes with it.
pub(super) fn settings_quota(tenant: &str, quota: SettingQuota, (count, bytes): (usize, usize)) -> Option<StoreError> {
    (count > quota.count || bytes > quota.bytes).then(|| {
        StoreError::Quota(format!(
            "tenant {tenant:?} may have {} settings (settings) of {} bytes in all (settings_bytes); with this one it would have {count} of {bytes} bytes",
            quota.count, quota.bytes
        ))
    })
}

/// The refusal of a setting a tenant does not have.
pub(super) fn no_setting(tenant: &str, handler: &str, name: &str) -> StoreError {
    let of = if handler.is_empty() { String::new() } else { format!(" of handler {handler:?}") };
    StoreError::NotFound(format!("tenant {tenant:?} has no setting {name:?}{of}"))
}

/// The refusal of credentials a tenant does not have.
pub(super) fn no_registry_login(tenant: &str, registry: &str) -> StoreError {
    StoreError::NotFound(format!("tenant {tenant:?} has no credentials for the registry {registry}"))
}

/// The store's part for the tenants' usage records, for bills.
pub trait UsageStore {
    /// Writes a node's usage delta, once: a delta already written (the same
    /// node and number) is left as it is, so a retried write never counts twice.
    fn write_usage(&mut self, delta: &Delta) -> StoreResult<()>;

    /// Usage in buckets from `from_ms` (included) to `to_ms` (excluded), of
    /// one tenant or all, summed over the nodes, by tenant, handler, version
    /// and bucket, in bucket order.
    fn usage(&mut self, tenant: Option<&str>, from_ms: i64, to_ms: i64) -> StoreResult<Vec<(UsageKey, Usage)>>;

    /// Each model's part of the same buckets as [`UsageStore::usage`]
    /// (those whose requests called a model), summed over the nodes, by
    /// tenant, handler, version, bucket and model, in bucket order.
    fn usage_by_model(&mut self, tenant: Option<&str>, from_ms: i64, to_ms: i64) -> StoreResult<Vec<(UsageKey, String, ModelUsage)>>;

    /// Forgets usage in buckets before `before_ms`.
    fn prune_usage(&mut self, before_ms: i64) -> StoreResult<()>;
}

/// What [`Store::prune_versions`] deleted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pruned {
    /// The versions, oldest first.
    pub versions: Vec<i64>,
    /// The components (SHA-256, hex) no version uses any more.
    pub components: Vec<String>,
}

/// Of `versions` (oldest first), those to delete so that at most `keep`
/// remain, oldest first, never one of `spared` (the active version, a
/// canary's): these stay even past `keep`.
pub fn versions_past(versions: &[i64], keep: usize, spared: &[i64]) -> Vec<i64> {
    let excess = versions.len().saturating_sub(keep);
    versions.iter().copied().filter(|v| !spared.contains(v)).take(excess).collect()
}

/// The version a rollback goes to: the newest one older than the active one.
pub fn rollback_target(store: &mut dyn Store, tenant: &str, handler: &str) -> StoreResult<i64> {
    let (versions, active) = store.versions(tenant, handler)?;
    let active = active.ok_or_else(|| StoreError::Conflict(format!("{tenant}/{handler} has no active version")))?;
    versions
        .iter()
        .rev()
        .map(|v| v.version)
        .find(|&v| v < active)
        .ok_or_else(|| StoreError::Conflict(format!("{tenant}/{handler} has no version older than {active}")))
}

/// Whether the store `url` names is shared by several nodes (PostgreSQL),
/// so that they share compiled artifacts through it.
pub fn is_shared(url: Option<&str>) -> bool {
    url.is_some_and(|url| url.starts_with("postgres://") || url.starts_with("postgresql://"))
}

/// Opens the store `url` names (`postgres://…` or `postgresql://…`), or the
/// SQLite store in `data_dir` when there is none.
pub fn open(url: Option<&str>, data_dir: &Path) -> anyhow::Result<Box<dyn Store>> {
    match url {
        None => Ok(Box::new(sqlite::SqliteStore::open(data_dir)?)),
        Some(url) if is_shared(Some(url)) => Ok(Box::new(postgres::PgStore::open(url)?)),
        Some(url) if url.starts_with("sqlite:") => Ok(Box::new(sqlite::SqliteStore::open(Path::new(&url["sqlite:".len()..]))?)),
        Some(other) => anyhow::bail!(
            "unsupported store {:?}: use postgres://user@host/db, sqlite:<data directory>, or no --store for SQLite in --data-dir",
            other.split('@').next_back().unwrap_or_default()
        ),
    }
}

/// Unix seconds now.
pub(crate) fn now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// A new tenant incarnation: 64 random bits, hex. It tells a tenant apart
/// from an earlier, deleted tenant of the same name, so nothing of the
/// earlier one (handlers, warm instances, admission state) is served to it.
pub(crate) fn new_incarnation() -> StoreResult<String> {
    Ok(super::keys::hex(&super::keys::random::<8>()?))
}

/// Unix milliseconds now.
pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
pub(crate) mod tests;

/// The usage table's figure columns, in [`Usage::FIELDS`]' order.
pub(crate) fn usage_columns() -> String {
    Usage::FIELDS.join(", ")
}

/// The figure columns folded over a group, each as [`Usage::FOLDS`] says
/// (`cast` after each: PostgreSQL's `SUM` of a BIGINT is a NUMERIC).
pub(crate) fn usage_aggregates(cast: &str) -> String {
    let folded: Vec<String> = Usage::FIELDS.iter().zip(Usage::FOLDS).map(|(f, fold)| format!("{}({f}){cast}", fold.sql())).collect();
    folded.join(", ")
}

/// Placeholders for the figures, numbered from `first` (`?7`, or `$7` with `sign` `$`).
pub(crate) fn usage_placeholders(sign: char, first: usize) -> String {
    let marks: Vec<String> = (first..first + Usage::COUNT).map(|i| format!("{sign}{i}")).collect();
    marks.join(", ")
}

/// The figure columns a usage table of `columns` lacks: each store adds
/// them when it opens (a figure declared in [`Usage`] is a column at once).
pub(crate) fn missing_usage_columns(columns: &[String]) -> Vec<&'static str> {
    Usage::FIELDS.into_iter().filter(|f| !columns.iter().any(|c| c == f)).collect()
}

/// A [`Usage`]'s figures as signed integers (SQL has no u64), saturating.
pub(crate) fn usage_values(u: &Usage) -> [i64; Usage::COUNT] {
    u.figures().map(|v| i64::try_from(v).unwrap_or(i64::MAX))
}

/// A figure as a signed integer (SQL has no u64), saturating.
pub(crate) fn stored(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A figure read back ([`stored`]'s inverse; a negative one is 0).
pub(crate) fn figure(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// A [`Usage`] from its figures as [`usage_values`] gives them.
pub(crate) fn usage_from(v: [i64; Usage::COUNT]) -> Usage {
    Usage::from_figures(v.map(|v| u64::try_from(v).unwrap_or(0)))
}
