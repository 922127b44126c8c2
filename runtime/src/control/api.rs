//! What the control plane's operations return: the admin API's and the
//! CLI's JSON shapes.

use std::path::PathBuf;

use serde::Serialize;

use super::keys::Scopes;
use super::store::{Canary, VersionRow};
use crate::admission::limits::{LimitOverrides, TenantLimits};

/// A key created by `ControlPlane::seed`.
#[derive(Debug, Clone)]
pub struct SeededKey {
    /// Its tenant.
    pub tenant: String,
    /// The key (also in `path`).
    pub key: String,
    /// The file it was written to (mode 0600).
    pub path: PathBuf,
}

/// A tenant as the admin API shows it.
#[derive(Debug, Serialize)]
pub struct TenantInfo {
    /// Name.
    pub name: String,
    /// Effective limits.
    pub limits: TenantLimits,
    /// What it overrides.
    pub overrides: LimitOverrides,
    /// Handlers and their active versions.
    pub handlers: Vec<HandlerInfo>,
    /// Unix seconds.
    pub created_at: i64,
}

/// A handler and its active version.
#[derive(Debug, Serialize)]
pub struct HandlerInfo {
    /// Name.
    pub name: String,
    /// Active version, if any.
    pub active_version: Option<i64>,
}

/// A handler's versions.
#[derive(Debug, Serialize)]
pub struct VersionsInfo {
    /// Tenant.
    pub tenant: String,
    /// Handler.
    pub handler: String,
    /// Active version.
    pub active_version: Option<i64>,
    /// All versions, oldest first.
    pub versions: Vec<VersionRow>,
    /// The version on trial beside the active one, if any.
    pub canary: Option<Canary>,
}

/// Result of an upload.
#[derive(Debug, Serialize)]
pub struct Deployed {
    /// Tenant.
    pub tenant: String,
    /// Handler.
    pub handler: String,
    /// The new version.
    pub version: i64,
    /// SHA-256 of the component.
    pub sha256: String,
    /// Bytes.
    pub size: usize,
    /// Active version after the upload.
    pub active_version: Option<i64>,
    /// Where its bytes came from: `upload`, or `oci://…@sha256:…`.
    pub source: String,
}

/// Result of an activation or rollback.
#[derive(Debug, Serialize)]
pub struct Activated {
    /// Tenant.
    pub tenant: String,
    /// Handler.
    pub handler: String,
    /// Now active.
    pub active_version: i64,
    /// Active before.
    pub previous_version: Option<i64>,
}

/// A new API key, shown once.
#[derive(Debug, Serialize)]
pub struct CreatedKey {
    /// Tenant.
    pub tenant: String,
    /// Public id (to list and revoke).
    pub id: String,
    /// The key itself; not stored, not shown again.
    pub key: String,
    /// Unix seconds.
    pub created_at: i64,
    /// What it may do.
    pub scopes: Scopes,
}

/// Outcome of `check_store`.
#[derive(Debug, Serialize)]
pub struct CheckReport {
    /// No problem found.
    pub ok: bool,
    /// Each problem found.
    pub problems: Vec<String>,
    /// Handler versions checked.
    pub versions: usize,
    /// Files of interrupted writes in `tmp/` (never served; removed at start).
    pub temp_files: usize,
}
