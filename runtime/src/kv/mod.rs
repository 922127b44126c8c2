//! Handlers' state (`wasi:keyvalue`): buckets of a tenant's keys and
//! values, kept in the gateway's database (the SQLite file of a single
//! node, the PostgreSQL of a cluster), so every node reads what any node
//! wrote.
//!
//! - **Scope.** Every row carries its tenant; a bucket is a name within a
//!   tenant, so two tenants' buckets of one name are two buckets. A
//!   tenant's state belongs to one creation of it ([`Owner`]): deleting the
//!   tenant deletes its state (the database cascades), and a request of a
//!   tenant deleted and created again reads and writes nothing of the new
//!   one's.
//! - **Exactness.** Every write runs in one transaction that first locks
//!   the tenant's totals row (SQLite: the database's write lock), so a
//!   tenant's writes queue in one order across all nodes: `increment` and
//!   compare-and-swap are exact however many requests race, and the
//!   tenant's bounds ([`Quota`]) are checked against the totals the write
//!   leaves. The price: one tenant's writes never run in parallel.
//! - **Freshness.** No cache: a read sees every write committed before it
//!   (read-your-writes, and more).
//! - **Isolation.** Calls run on a small pool of database connections
//!   ([`KvPool`]); one tenant holds at most a quarter of them, so another
//!   tenant's calls always find a connection.
//!
//! [`ops`] holds the writes, once for both databases; [`sqlite`] and
//! [`postgres`] the statements.

mod ops;
mod pool;
mod postgres;
mod sqlite;

use std::sync::Arc;

use serde::Serialize;

pub use self::ops::{Cas, clear_bucket, compare_and_swap, delete_many, increment, set_many};
pub use self::pool::KvPool;

/// Longest bucket name, bytes.
pub const MAX_BUCKET_BYTES: usize = 64;
/// Longest key, bytes.
pub const MAX_KEY_BYTES: usize = 256;
/// Keys one `list-keys` call returns at most (the cursor gives the rest).
pub const LIST_PAGE: usize = 100;

/// Whose state: a tenant, as this creation of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The tenant.
    pub tenant: Arc<str>,
    /// Which creation of it (see `control::store::new_incarnation`).
    pub incarnation: Arc<str>,
}

/// A tenant's bounds on its state (its limits `kv_keys`, `kv_bytes` and
/// `kv_value_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Keys, all buckets together.
    pub keys: u64,
    /// Bytes: bucket names, keys and values together.
    pub bytes: u64,
    /// Largest value, bytes.
    pub value_bytes: u64,
}

/// What a tenant's state holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    /// Keys, all buckets together.
    pub keys: u64,
    /// Bytes: bucket names, keys and values together.
    pub bytes: u64,
}

/// One of a tenant's buckets, as the API lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BucketRow {
    /// Its name.
    pub name: String,
    /// Keys in it.
    pub keys: u64,
    /// Bytes in it (its name with each key, keys and values).
    pub bytes: u64,
}

/// A stored value and its version (bumped by every write of its key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The value.
    pub value: Vec<u8>,
    /// Its version.
    pub version: i64,
}

/// Why a state operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// Past one of the tenant's bounds (keys, bytes, value size, operations per request).
    #[error("{0}")]
    Limit(String),
    /// A bad bucket name or key, or a value `increment` cannot add to.
    #[error("{0}")]
    Invalid(String),
    /// The tenant was deleted (and perhaps created again) since the call started.
    #[error("the tenant's state is gone: the tenant was deleted")]
    Gone,
    /// No connection to the database freed up in time (the request's deadline).
    #[error("{0}")]
    Busy(String),
    /// The connection failed or the database cannot be reached (the
    /// connection is dropped, the next call opens another).
    #[error("the state store failed: {0}")]
    Store(String),
    /// The database refused one statement (the connection stays).
    #[error("the state store refused a statement: {0}")]
    Failed(String),
}

/// Result of state operations.
pub type KvResult<T> = Result<T, KvError>;

/// Bytes an entry counts against the tenant's `kv_bytes`: its bucket's
/// name, its key and its value.
pub fn stored_size(bucket: &str, key: &str, value_len: usize) -> u64 {
    (bucket.len() + key.len() + value_len) as u64
}

/// Checks a bucket's name: 1 to [`MAX_BUCKET_BYTES`] bytes of ASCII
/// letters, digits, `.`, `_` and `-`.
pub fn check_bucket(name: &str) -> KvResult<()> {
    let ok = (1..=MAX_BUCKET_BYTES).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        return Ok(());
    }
    Err(KvError::Invalid(format!(
        "a bucket's name is 1 to {MAX_BUCKET_BYTES} ASCII letters, digits, '.', '_' or '-', not {:?}",
        truncated(name)
    )))
}

/// Checks a key: 1 to [`MAX_KEY_BYTES`] bytes, no NUL (PostgreSQL's text cannot hold one).
pub fn check_key(key: &str) -> KvResult<()> {
    if (1..=MAX_KEY_BYTES).contains(&key.len()) && !key.contains('\0') {
        return Ok(());
    }
    Err(KvError::Invalid(format!("a key is 1 to {MAX_KEY_BYTES} bytes without NUL, not {:?} ({} bytes)", truncated(key), key.len())))
}

/// The entries `read` gives for `keys`, in order; a [`KvError::Limit`] as
/// soon as their values pass `most_bytes` (a key asked for twice counts twice).
fn read_within(keys: &[String], most_bytes: u64, mut read: impl FnMut(&str) -> KvResult<Option<Entry>>) -> KvResult<Vec<Option<Entry>>> {
    let mut bytes = 0_u64;
    let mut found = Vec::with_capacity(keys.len());
    for key in keys {
        let entry = read(key)?;
        bytes += entry.as_ref().map_or(0, |e| e.value.len() as u64);
        if bytes > most_bytes {
            return Err(KvError::Limit(format!(
                "this read would bring back more than the {most_bytes} bytes it was charged for (kv_value_bytes a key)"
            )));
        }
        found.push(entry);
    }
    Ok(found)
}

/// A count from the database (never negative there).
fn as_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// A count for the database.
fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// At most 40 characters of `text`, for an error message.
fn truncated(text: &str) -> String {
    text.chars().take(40).collect()
}

/// One database connection's statements (see [`sqlite`] and [`postgres`]).
/// Reads check the owner's incarnation; writes go through [`Conn::begin`].
pub trait Conn: Send {
    /// A write transaction (see [`Tx`]).
    fn begin(&mut self) -> KvResult<Box<dyn Tx + '_>>;
    /// The entries of `keys` in `owner`'s `bucket`, in order; a
    /// [`KvError::Limit`] as soon as their values pass `most_bytes` (what
    /// the caller could hold).
    fn entries(&mut self, owner: &Owner, bucket: &str, keys: &[String], most_bytes: u64) -> KvResult<Vec<Option<Entry>>>;
    /// Whether `key` is in `owner`'s `bucket`.
    fn exists(&mut self, owner: &Owner, bucket: &str, key: &str) -> KvResult<bool>;
    /// Up to `limit` keys of `owner`'s `bucket` after `after`, in order.
    fn keys(&mut self, owner: &Owner, bucket: &str, after: Option<&str>, limit: usize) -> KvResult<Vec<String>>;
    /// `owner`'s buckets.
    fn buckets(&mut self, owner: &Owner) -> KvResult<Vec<BucketRow>>;
    /// What `owner`'s state holds.
    fn totals(&mut self, owner: &Owner) -> KvResult<Totals>;
}

/// A write transaction; dropped without [`Tx::commit`], it rolls back.
pub trait Tx {
    /// Locks `owner`'s totals (creating them, empty, at its first write):
    /// every write of the tenant's waits here for the one before it.
    /// [`KvError::Gone`] if the tenant is not this creation of it.
    fn lock(&mut self, owner: &Owner) -> KvResult<Totals>;
    /// The stored size (see [`stored_size`]) and version of `key`.
    fn size(&mut self, tenant: &str, bucket: &str, key: &str) -> KvResult<Option<(u64, i64)>>;
    /// The entry of `key`.
    fn entry(&mut self, tenant: &str, bucket: &str, key: &str) -> KvResult<Option<Entry>>;
    /// Writes `key`'s value as `version`.
    fn put(&mut self, tenant: &str, bucket: &str, key: &str, value: &[u8], version: i64) -> KvResult<()>;
    /// Removes `key`.
    fn remove(&mut self, tenant: &str, bucket: &str, key: &str) -> KvResult<()>;
    /// Removes every key of `bucket`; what they held.
    fn remove_bucket(&mut self, tenant: &str, bucket: &str) -> KvResult<Totals>;
    /// Records what the tenant's state holds now.
    fn set_totals(&mut self, tenant: &str, totals: Totals) -> KvResult<()>;
    /// Commits.
    fn commit(self: Box<Self>) -> KvResult<()>;
}

#[cfg(test)]
mod tests;
