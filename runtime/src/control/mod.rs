//! The control plane: tenants, API keys, handler versions and per-tenant
//! limits, kept in a [`store`] (SQLite in the data directory, or PostgreSQL
//! shared by a cluster of nodes), and the in-memory snapshot ([`Live`]) the
//! data plane reads. Every change builds a new snapshot and swaps it in:
//! requests in flight keep the `Arc<Handler>` they started with (hot swap),
//! new requests see the new one, and the inference engines are never
//! touched. Changes made through other nodes arrive through [`sync`]: the
//! store's generation moved, so the snapshot is rebuilt. The data plane
//! never waits for the store: without it, a node serves its last snapshot.
//!
//! [`ControlPlane`] is a set of parts, one per concept, each a type of its
//! own with its part of the store's contract ([`store::Store`]'s part
//! traits): [`Tenants`] (tenants and keys), [`Releases`] (handlers,
//! versions, canaries), [`Artifacts`] (compiled components), [`Serving`]
//! (the snapshot), [`Cluster`] (nodes and heartbeats), [`Routes`]
//! (tenants' own hostnames) and [`UsageRecords`] (usage for bills). What they share ([`shared`]) is the store's
//! connections and the node's settings. A new capability (settings and
//! secrets, key-value state, registry sources) is a part of its own: a
//! file here, a part trait in [`store`] implemented by both stores, a field
//! of [`ControlPlane`].

mod api;
mod artifacts;
pub mod blobs;
mod cluster;
pub mod compose;
pub mod keys;
mod live;
pub mod models;
mod opener;
mod rebuild;
mod registries;
mod releases;
mod routes;
mod seal;
pub mod secrets;
mod seed;
mod serving;
mod settings;
mod shared;
pub mod store;
pub mod sync;
mod tenants;
mod upload;
pub mod usage;
pub mod validate;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use self::artifacts::Compile;
use self::blobs::{ArtifactCache, Blobs};
use self::shared::{Connection, Shared};
use self::store::{NodeRow, Store};
use crate::admission::limits::{LimitOverrides, TenantLimits};
use crate::sandbox::Sandbox;
use crate::sandbox::compile::CompilePool;
use crate::telemetry::TenantCounters;
use facegate_host_gpu::Models;

pub use self::api::{Activated, CheckReport, CreatedKey, Deployed, HandlerInfo, SeededKey, TenantInfo, VersionsInfo};
pub use self::artifacts::{Artifacts, engine_id};
pub use self::cluster::{ALIVE_WITHIN, Cluster};
pub use self::live::{CanaryCounts, HostRoute, Live, LiveCanary, Side, TenantEntry};
pub use self::registries::{MAX_REGISTRY_LOGINS, Registries};
pub use self::releases::{Release, Releases, Releasing};
pub use self::routes::{Routes, host_of, valid_hostname};
pub use self::seal::{ArtifactKey, CACHE_KEY_FILE, CacheKey};
pub use self::serving::{Serving, Synced};
pub use self::settings::{SettingInfo, Settings};
pub use self::tenants::Tenants;
pub use self::upload::{Change, ChangePlace, UploadHold};
pub use self::usage::UsageRecords;

/// How the control plane is set up.
pub struct ControlSettings {
    /// The tenants' default limits.
    pub defaults: TenantLimits,
    /// The gateway's instance slots: no tenant may have more concurrent requests.
    pub max_instances: u32,
    /// Where uploads compile.
    pub compile: CompilePool,
    /// `--tenant-weight`: weights of tenants that have no weight override.
    pub weights: HashMap<String, u32>,
    /// Per-tenant counters outside the batchers, told when a tenant is deleted.
    pub counters: Vec<Arc<dyn TenantCounters>>,
    /// The pipeline component (`--pipeline-component`), linked into handlers that import it.
    pub pipeline: Option<Arc<[u8]>>,
    /// Signs the artifacts this node shares with the other nodes of a
    /// cluster and checks theirs (from `--artifact-key`); `None` shares none.
    pub artifact_key: Option<ArtifactKey>,
    /// Seals this node's artifact cache (derived from `--artifact-key`);
    /// `None`: a random key kept in the data directory ([`CACHE_KEY_FILE`]).
    pub cache_key: Option<CacheKey>,
    /// Seals tenants' secrets in the store (see [`secrets`]); `None`: none are kept.
    pub secrets_key: Option<secrets::SecretsKey>,
    /// A second connection to the same store for the background compiler's
    /// bulk reads and writes (an 18 MB component, a 38 MB artifact), so the
    /// sync never waits behind them for the store; `None` shares the main one.
    pub compile_store: Option<Box<dyn Store>>,
    /// A connection to the same store for the serving snapshot's rebuilds
    /// and the sync's checks, so that neither waits behind a change, a
    /// tenant's read or a compile's store calls (nor they behind a rebuild);
    /// `None` shares the main one.
    pub serving_store: Option<Box<dyn Store>>,
    /// Opens the repository's model files on this node's devices; `None`:
    /// the node serves no repository models (nor takes any).
    pub model_opener: Option<Arc<dyn models::ModelOpener>>,
}

/// The control plane: its parts (see the module docs).
pub struct ControlPlane {
    /// Tenants and their keys.
    pub tenants: Tenants,
    /// Handlers, versions and canaries.
    pub releases: Releases,
    /// Compiled components.
    pub artifacts: Arc<Artifacts>,
    /// The snapshot the data plane serves.
    pub serving: Arc<Serving>,
    /// The cluster's nodes.
    pub cluster: Arc<Cluster>,
    /// Tenants' own hostnames.
    pub routes: Routes,
    /// Tenants' registry credentials.
    pub registries: Registries,
    /// Tenants' settings and secrets, which their handlers read.
    pub settings: Settings,
    /// Usage for bills.
    pub usage: UsageRecords,
    /// The model repository.
    pub repository: models::ModelRepository,
    shared: Arc<Shared>,
}

impl ControlPlane {
    /// The models this node serves.
    pub fn models(&self) -> &Models {
        &self.shared.models
    }

    /// Takes the opened `store` (see [`store::open`]), with `data_dir` for
    /// this node's files (artifact cache, key files), and loads every active handler.
    pub fn open(
        store: Box<dyn Store>,
        data_dir: &Path,
        sandbox: Arc<Sandbox>,
        models: Models,
        settings: ControlSettings,
    ) -> anyhow::Result<Self> {
        blobs::prepare_data_dir(data_dir)?;
        if let Err(e) = validate_defaults(&settings.defaults, settings.max_instances) {
            anyhow::bail!(
                "the tenants' default limits (--memory-limit-mib, --request-timeout-ms, --tenant-max-concurrency, \
                 --tenant-rps, --tenant-burst, --max-body-bytes, --max-response-bytes, --max-infer-calls, \
                 --instance-reuse flags) are invalid: {e}"
            );
        }
        let cache_key = match settings.cache_key {
            Some(key) => key,
            None => CacheKey::in_data_dir(data_dir)?,
        };
        let cache = ArtifactCache::new(Blobs::open(data_dir)?, cache_key);
        let leftovers = cache.blobs().clear_tmp()?;
        if leftovers > 0 {
            tracing::warn!(files = leftovers, "removed files of interrupted uploads");
        }
        // What the node serves now is its flags'.
        let fixed = models.states().into_iter().map(|m| m.name).collect();
        let shared = Arc::new(Shared {
            data_dir: data_dir.to_owned(),
            described: store.describe(),
            engine_id: engine_id(sandbox.engine()),
            db: Connection::new(store),
            compile_db: settings.compile_store.map(Connection::new),
            serving_db: settings.serving_store.map(Connection::new),
            cache,
            sandbox,
            models,
            defaults: settings.defaults,
            max_instances: settings.max_instances,
            compile: settings.compile,
            weights: settings.weights,
            counters: settings.counters,
            pipeline: settings.pipeline,
            artifact_key: settings.artifact_key,
            secrets_key: settings.secrets_key,
            repository: opener::RepositoryServing { opener: settings.model_opener, fixed, served: Default::default() },
        });
        let artifacts = Arc::new(Artifacts::new(Arc::clone(&shared)));
        let cluster = Arc::new(Cluster::new(Arc::clone(&shared)));
        let serving = Arc::new(Serving::new(Arc::clone(&shared), Arc::clone(&artifacts), Arc::clone(&cluster)));
        let control = Self {
            tenants: Tenants::new(Arc::clone(&shared), Arc::clone(&serving)),
            releases: Releases::new(Arc::clone(&shared), Arc::clone(&artifacts), Arc::clone(&serving)),
            routes: Routes::new(Arc::clone(&shared), Arc::clone(&serving)),
            registries: Registries::new(Arc::clone(&shared)),
            settings: Settings::new(Arc::clone(&shared), Arc::clone(&serving)),
            // A restarted node writes under a new name: its numbers start again.
            usage: UsageRecords::new(Arc::clone(&shared), store::new_incarnation()?),
            repository: models::ModelRepository::new(Arc::clone(&shared)),
            artifacts,
            serving,
            cluster,
            shared,
        };
        control.serving.refresh(Vec::new(), Compile::Now)?;
        Ok(control)
    }

    /// The store, for logs (no password).
    pub fn store_name(&self) -> &str {
        &self.shared.described
    }

    /// A listener for change announcements, if the store has them; it
    /// connects after the store's lock is released.
    pub fn store_listener(&self) -> Option<anyhow::Result<Box<dyn store::Listener>>> {
        let source = self.shared.db().listener()?;
        Some(source())
    }

    /// Counts the live nodes among `nodes` (see [`Cluster`]) and gives every
    /// tenant's gate this node's share of its rate and concurrency among
    /// them; every time, not only on a change: a snapshot built meanwhile
    /// may have made gates with the old count.
    pub fn share_tenant_limits(&self, nodes: &[NodeRow]) {
        let live = self.cluster.count_alive(nodes);
        self.serving.live().share_among(live);
    }
}

/// The server's defaults must themselves be a valid tenant's limits.
fn validate_defaults(defaults: &TenantLimits, max_instances: u32) -> Result<(), String> {
    defaults.validate(&LimitOverrides::default())?;
    if defaults.max_concurrency > max_instances {
        return Err(format!("--tenant-max-concurrency ({}) exceeds --max-instances ({max_instances})", defaults.max_concurrency));
    }
    Ok(())
}

/// Checks a store without running it: the database's integrity and
/// references, and that every stored version's component, and every
/// model version's file, is there and hashes to its name. `url` as `--store`; SQLite in `data_dir` without one.
pub fn check_store(url: Option<&str>, data_dir: &Path) -> anyhow::Result<CheckReport> {
    if url.is_none() {
        let db_path = data_dir.join(store::DB_FILE);
        anyhow::ensure!(db_path.exists(), "no store at {}", data_dir.display());
    }
    let mut db = store::open(url, data_dir)?;
    let mut problems = db.check().map_err(|e| anyhow::anyhow!("{e}"))?;
    let versions = db.all_versions().map_err(|e| anyhow::anyhow!("{e}"))?;
    for (label, sha) in &versions {
        if let Err(e) = db.component(sha) {
            problems.push(format!("{label}: {e:#}"));
        }
    }
    for model in db.models().map_err(|e| anyhow::anyhow!("{e}"))? {
        if let Err(e) = db.model_bytes(&model.sha256) {
            problems.push(format!("model {}@{}: {e:#}", model.name, model.version));
        }
    }
    let temp_files = if url.is_none() { Blobs::open(data_dir)?.tmp_files()?.len() } else { 0 };
    Ok(CheckReport { ok: problems.is_empty(), problems, versions: versions.len(), temp_files })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_defaults_that_no_tenant_could_have_are_refused() {
        let config = crate::config::ServeConfig::with_data_dir("unused".into()).unwrap();
        assert!(validate_defaults(&config.limits, config.max_instances).is_ok());
        let error = validate_defaults(&config.limits, 16).unwrap_err();
        assert!(error.contains("--tenant-max-concurrency"), "{error}");
        let slow = TenantLimits { rps: 0.0001, ..config.limits };
        assert!(validate_defaults(&slow, config.max_instances).unwrap_err().contains("rps"));
    }
}
