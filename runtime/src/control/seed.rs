//! Seeding an empty store from a directory of components: tenants, their
//! handlers, and a key file each.

use std::path::Path;

use anyhow::Context;

use super::keys::{Scopes, write_secret};
use super::{ControlPlane, SeededKey};
use crate::admission::limits::LimitOverrides;
use crate::sandbox::handler::valid_name;

/// `meta` key recording the seeding: `started`, then `done`.
const SEED_MARK: &str = "seed";
const SEED_DONE: &str = "done";

impl ControlPlane {
    /// Seeds an empty store from `<dir>/<tenant>/<handler>.wasm`: each tenant
    /// gets default limits, version 1 of each handler, and one API key
    /// written to `<data-dir>/<tenant>.key` (mode 0600). Seeding resumes
    /// where it stopped if it was interrupted; a store that was seeded, or
    /// that had tenants before, is left alone. Returns the keys created.
    pub fn seed(&self, dir: &Path) -> anyhow::Result<Vec<SeededKey>> {
        {
            let mut db = self.shared.db();
            match db.meta(SEED_MARK)?.as_deref() {
                Some(SEED_DONE) => return Ok(Vec::new()),
                Some(_) => {}
                None if !db.is_empty()? => return Ok(Vec::new()),
                None => db.set_meta(SEED_MARK, "started")?,
            }
        }
        let mut tenants: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("cannot read seed directory {}", dir.display()))?
            .filter_map(Result::ok)
            .filter(|e| e.path().is_dir())
            .map(|e| e.path())
            .collect();
        tenants.sort();
        let mut created = Vec::new();
        for tenant_dir in tenants {
            let name = tenant_dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let Ok(tenant) = valid_name(name) else {
                tracing::warn!(dir = %tenant_dir.display(), "not a tenant name; not seeded");
                continue;
            };
            created.extend(self.seed_tenant(&tenant, &tenant_dir)?);
        }
        self.shared.db().set_meta(SEED_MARK, SEED_DONE)?;
        Ok(created)
    }

    fn seed_tenant(&self, tenant: &str, dir: &Path) -> anyhow::Result<Option<SeededKey>> {
        if !self.serving.live().tenants.contains_key(tenant) {
            self.tenants.create(tenant, &LimitOverrides::default())?;
        }
        let mut files: Vec<_> = std::fs::read_dir(dir)?.filter_map(Result::ok).map(|e| e.path()).collect();
        files.sort();
        for file in files.iter().filter(|p| p.extension().is_some_and(|e| e == "wasm")) {
            let handler = file.file_stem().and_then(|n| n.to_str()).unwrap_or_default();
            if valid_name(handler).is_err() {
                tracing::warn!(file = %file.display(), "not a handler name; not seeded");
                continue;
            }
            if self.serving.live().handler(tenant, handler).is_some() {
                continue;
            }
            let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
            self.releases.deploy(tenant, handler, bytes.into(), true).with_context(|| format!("seeding {}", file.display()))?;
        }
        let path = self.shared.data_dir.join(format!("{tenant}.key"));
        let saved = std::fs::read_to_string(&path).unwrap_or_default();
        if self.serving.live().authenticate(Some(saved.trim())).is_some_and(|(owner, _)| owner == tenant) {
            return Ok(None);
        }
        // A key whose file was never written (a crash in between) is useless: revoke it.
        for stale in self.tenants.keys(tenant)?.into_iter().filter(|k| k.revoked_at.is_none()) {
            self.tenants.revoke_key(tenant, &stale.id)?;
        }
        let key = self.tenants.create_key(tenant, Scopes::default())?;
        write_secret(&path, &key.key)?;
        tracing::info!(tenant, key_id = %key.id, path = %path.display(), "seeded tenant; API key written");
        Ok(Some(SeededKey { tenant: tenant.to_owned(), key: key.key, path }))
    }
}
