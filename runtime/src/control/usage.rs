//! The control plane's part for the tenants' usage, for bills ([`UsageRecords`]): the node's [`Meter`] written to the store
//! every flush interval by the sync thread, old buckets pruned, and read
//! back summed over the cluster's nodes and rolled up by the hour or day.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::shared::Shared;
use super::store::{StoreResult, now_ms};
use crate::telemetry::usage::{BUCKET_MS, ByModel, Meter, ModelUsage, Usage, UsageKey};

/// How often old buckets are pruned.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// How usage is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsagePolicy {
    /// How often the node writes what it metered.
    pub flush_every: Duration,
    /// How long buckets are kept.
    pub retention: Duration,
}

impl Default for UsagePolicy {
    fn default() -> Self {
        Self {
            flush_every: Duration::from_millis(crate::config::DEFAULT_USAGE_FLUSH_MS),
            retention: Duration::from_secs(crate::config::DEFAULT_USAGE_RETENTION_DAYS * 86_400),
        }
    }
}

impl UsagePolicy {
    /// How often old buckets are pruned.
    pub fn prune_every(&self) -> Duration {
        PRUNE_EVERY
    }
}

/// Bucket sizes usage is read in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Rollup {
    /// One row per minute (the stored buckets).
    Minute,
    /// One row per hour.
    Hour,
    /// One row per day (UTC).
    Day,
}

impl Rollup {
    /// `minute`, `hour` or `day`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "minute" => Some(Self::Minute),
            "hour" => Some(Self::Hour),
            "day" => Some(Self::Day),
            _ => None,
        }
    }

    fn millis(self) -> i64 {
        match self {
            Self::Minute => BUCKET_MS,
            Self::Hour => 3_600_000,
            Self::Day => 86_400_000,
        }
    }
}

/// One row of a usage report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageRow {
    /// The tenant.
    pub tenant: String,
    /// The handler.
    pub handler: String,
    /// The version.
    pub version: i64,
    /// Start of the row's period, Unix ms.
    pub start_ms: i64,
    /// The figures.
    #[serde(flatten)]
    pub usage: Usage,
    /// Each model's part of `device_us` and `infer_calls`, by model name
    /// (empty when the row's requests called no model).
    #[serde(default)]
    pub models: ByModel,
}

/// Rolls minute buckets up into periods of `by`, keeping tenant, handler
/// and version apart, with each model's part of them (`model_rows`).
pub fn roll_up(rows: Vec<(UsageKey, Usage)>, model_rows: Vec<(UsageKey, String, ModelUsage)>, by: Rollup) -> Vec<UsageRow> {
    let mut out: Vec<UsageRow> = Vec::new();
    let mut index: std::collections::HashMap<(String, String, i64, i64), usize> = std::collections::HashMap::new();
    let slot = |key: &UsageKey| {
        let start_ms = key.bucket_ms.div_euclid(by.millis()) * by.millis();
        (key.tenant.clone(), key.handler.clone(), key.version, start_ms)
    };
    for (key, usage) in rows {
        let slot = slot(&key);
        match index.get(&slot) {
            Some(&i) => out[i].usage.add(&usage),
            None => {
                let start_ms = slot.3;
                index.insert(slot, out.len());
                out.push(UsageRow {
                    tenant: key.tenant,
                    handler: key.handler,
                    version: key.version,
                    start_ms,
                    usage,
                    models: ByModel::new(),
                });
            }
        }
    }
    // A model's part whose bucket row is missing (pruned between the two
    // reads) is left out: the row's figures are what it is a part of.
    for (key, model, usage) in model_rows {
        if let Some(&i) = index.get(&slot(&key)) {
            out[i].models.entry(model).or_default().add(&usage);
        }
    }
    out.sort_by(|a, b| (a.start_ms, &a.tenant, &a.handler, a.version).cmp(&(b.start_ms, &b.tenant, &b.handler, b.version)));
    out
}

/// The control plane's part for usage records (see the module docs).
pub struct UsageRecords {
    shared: Arc<Shared>,
    /// What this node's requests used, until written.
    meter: Arc<Meter>,
}

impl UsageRecords {
    /// Records under `incarnation`: this run of the node, its own name in the store.
    pub(super) fn new(shared: Arc<Shared>, incarnation: String) -> Self {
        Self { shared, meter: Meter::new(incarnation) }
    }

    /// The node's meter.
    pub fn meter(&self) -> &Arc<Meter> {
        &self.meter
    }

    /// Writes what the node metered since the last write (or the delta a
    /// failed write left); returns how many rows went.
    pub fn flush(&self) -> StoreResult<usize> {
        let Some(delta) = self.meter.seal() else { return Ok(0) };
        self.shared.db().write_usage(&delta)?;
        self.meter.written(delta.seq);
        Ok(delta.rows.len())
    }

    /// Forgets buckets older than `retention`.
    pub fn prune(&self, retention: Duration) -> StoreResult<()> {
        let before = now_ms().saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
        self.shared.db().prune_usage(before)
    }

    /// Usage from `from_ms` to `to_ms`, of one tenant or all, summed over the
    /// cluster's nodes, in periods of `by`.
    pub fn read(&self, tenant: Option<&str>, (from_ms, to_ms): (i64, i64), by: Rollup) -> StoreResult<Vec<UsageRow>> {
        let mut db = self.shared.db();
        let rows = db.usage(tenant, from_ms, to_ms)?;
        let model_rows = db.usage_by_model(tenant, from_ms, to_ms)?;
        Ok(roll_up(rows, model_rows, by))
    }
}

/// A usage report as CSV, one header line then one line per row; the last
/// column, `models`, lists each model's part as `name:device_us:infer_calls`
/// separated by `;`.
pub fn to_csv(rows: &[UsageRow]) -> String {
    use std::fmt::Write;
    let mut out = format!("tenant,handler,version,start_ms,{},models\n", Usage::FIELDS.join(","));
    for r in rows {
        let figures: Vec<String> = r.usage.figures().iter().map(u64::to_string).collect();
        let models: Vec<String> = r.models.iter().map(|(m, u)| format!("{m}:{}:{}", u.device_us, u.infer_calls)).collect();
        // Names are [a-z0-9-]: nothing to quote.
        let _ = writeln!(out, "{},{},{},{},{},{}", r.tenant, r.handler, r.version, r.start_ms, figures.join(","), models.join(";"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tenant: &str, minute: i64, requests: u64) -> (UsageKey, Usage) {
        let key = UsageKey::new(tenant, "detect", 1, minute * BUCKET_MS);
        (key, Usage { requests_2xx: requests, peak_memory_bytes: requests, ..Usage::default() })
    }

    #[test]
    fn minutes_roll_up_into_hours_per_tenant_handler_and_version() {
        let rows = vec![row("a", 0, 1), row("a", 59, 2), row("a", 60, 4), row("b", 1, 8)];
        let hours = roll_up(rows.clone(), Vec::new(), Rollup::Hour);
        let figures: Vec<(&str, i64, u64, u64)> =
            hours.iter().map(|r| (r.tenant.as_str(), r.start_ms, r.usage.requests_2xx, r.usage.peak_memory_bytes)).collect();
        assert_eq!(figures, [("a", 0, 3, 2), ("b", 0, 8, 8), ("a", 3_600_000, 4, 4)]);
        assert_eq!(roll_up(rows, Vec::new(), Rollup::Minute).len(), 4);
    }

    #[test]
    fn csv_has_a_header_and_a_line_per_row() {
        let part = ModelUsage { device_us: 7, infer_calls: 2 };
        let models = vec![(row("a", 0, 3).0, "fp32".to_owned(), part), (row("a", 0, 3).0, "int8".to_owned(), part)];
        let csv = to_csv(&roll_up(vec![row("a", 0, 3)], models, Rollup::Day));
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("tenant,handler,version,start_ms,requests_2xx"));
        let cells: Vec<&str> = lines[1].split(',').collect();
        assert_eq!(cells[..4], ["a", "detect", "1", "0"]);
        assert_eq!(cells.len(), 4 + Usage::COUNT + 1, "a cell per figure, then the models");
        let figure = |name: &str| cells[4 + Usage::FIELDS.iter().position(|f| *f == name).unwrap()];
        assert_eq!((figure("requests_2xx"), figure("peak_memory_bytes"), figure("bytes_out")), ("3", "3", "0"));
        assert!(lines[0].ends_with(",models"));
        assert_eq!(cells[4 + Usage::COUNT], "fp32:7:2;int8:7:2");
    }

    /// Each model's part rolls up with its bucket's row, summed per model.
    #[test]
    fn models_parts_roll_up_with_their_rows() {
        let part = |device_us| ModelUsage { device_us, infer_calls: 1 };
        let rows = vec![row("a", 0, 1), row("a", 59, 1), row("a", 60, 1)];
        let models = vec![
            (row("a", 0, 1).0, "fp32".to_owned(), part(10)),
            (row("a", 59, 1).0, "fp32".to_owned(), part(20)),
            (row("a", 59, 1).0, "int8".to_owned(), part(5)),
            (row("a", 60, 1).0, "int8".to_owned(), part(1)),
            (row("gone", 0, 1).0, "fp32".to_owned(), part(99)),
        ];
        let hours = roll_up(rows, models, Rollup::Hour);
        assert_eq!(hours.len(), 2);
        assert_eq!(
            hours[0].models,
            ByModel::from([("fp32".into(), ModelUsage { device_us: 30, infer_calls: 2 }), ("int8".into(), part(5))])
        );
        assert_eq!(hours[1].models, ByModel::from([("int8".into(), part(1))]));
    }
}
