//! The writes, once for both databases: each in one transaction that
//! locks the tenant's totals first ([`Tx::lock`]), checks the tenant's
//! [`Quota`] against what it leaves, and records the new totals.

use super::{Conn, Entry, KvError, KvResult, Owner, Quota, Totals, Tx, check_bucket, check_key, stored_size};

/// What a compare-and-swap compares with: the key as it was read (`None`:
/// it did not exist).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cas {
    /// The bucket.
    pub bucket: String,
    /// The key.
    pub key: String,
    /// The entry as it was read.
    pub current: Option<Entry>,
}

/// Totals after one key went from `old` stored bytes to `new` (`None`: absent).
fn moved(totals: Totals, (old, new): (Option<u64>, Option<u64>)) -> Totals {
    let keys = (totals.keys + u64::from(new.is_some())).saturating_sub(u64::from(old.is_some()));
    let bytes = (totals.bytes + new.unwrap_or(0)).saturating_sub(old.unwrap_or(0));
    Totals { keys, bytes }
}

/// Refuses totals past `quota` where they grew: a tenant over a bound
/// (lowered since) may still shrink its state.
fn within(tenant: &str, quota: Quota, before: Totals, after: Totals) -> KvResult<()> {
    if after.keys > quota.keys && after.keys > before.keys {
        return Err(KvError::Limit(format!(
            "tenant {tenant:?} may keep {} keys (kv_keys); this write would make {}",
            quota.keys, after.keys
        )));
    }
    if after.bytes > quota.bytes && after.bytes > before.bytes {
        return Err(KvError::Limit(format!(
            "tenant {tenant:?} may keep {} bytes of state (kv_bytes); this write would make {}",
            quota.bytes, after.bytes
        )));
    }
    Ok(())
}

/// Refuses a value past `quota.value_bytes`.
fn check_value(quota: Quota, value: &[u8]) -> KvResult<()> {
    if value.len() as u64 > quota.value_bytes {
        return Err(KvError::Limit(format!("a value is at most {} bytes (kv_value_bytes), not {}", quota.value_bytes, value.len())));
    }
    Ok(())
}

/// Runs `change` in a transaction with `owner`'s totals locked, then checks
/// and records the totals it leaves.
fn write<T>(
    conn: &mut dyn Conn,
    owner: &Owner,
    quota: Option<Quota>,
    change: impl FnOnce(&mut dyn Tx, Totals) -> KvResult<(T, Totals)>,
) -> KvResult<(T, Totals)> {
    let mut tx = conn.begin()?;
    let before = tx.lock(owner)?;
    let (out, after) = change(tx.as_mut(), before)?;
    if let Some(quota) = quota {
        within(&owner.tenant, quota, before, after)?;
    }
    if after != before {
        tx.set_totals(&owner.tenant, after)?;
    }
    tx.commit()?;
    Ok((out, after))
}

/// Writes one key in `tx`, from `totals`; the new totals.
fn put_one(tx: &mut dyn Tx, (tenant, bucket): (&str, &str), key: &str, value: &[u8], totals: Totals) -> KvResult<Totals> {
    let old = tx.size(tenant, bucket, key)?;
    tx.put(tenant, bucket, key, value, old.map_or(1, |(_, version)| version + 1))?;
    Ok(moved(totals, (old.map(|(size, _)| size), Some(stored_size(bucket, key, value.len())))))
}

/// Sets each key of `items` in `owner`'s `bucket`, all or none; the tenant's totals after.
pub fn set_many(conn: &mut dyn Conn, owner: &Owner, quota: Quota, bucket: &str, items: &[(String, Vec<u8>)]) -> KvResult<Totals> {
    check_bucket(bucket)?;
    for (key, value) in items {
        check_key(key)?;
        check_value(quota, value)?;
    }
    let tenant = &*owner.tenant;
    let ((), totals) = write(conn, owner, Some(quota), |tx, mut totals| {
        for (key, value) in items {
            totals = put_one(tx, (tenant, bucket), key, value, totals)?;
        }
        Ok(((), totals))
    })?;
    Ok(totals)
}

/// Deletes each key of `keys` from `owner`'s `bucket` (a missing one is no error); the tenant's totals after.
pub fn delete_many(conn: &mut dyn Conn, owner: &Owner, bucket: &str, keys: &[String]) -> KvResult<Totals> {
    check_bucket(bucket)?;
    keys.iter().try_for_each(|key| check_key(key))?;
    let tenant = &*owner.tenant;
    let ((), totals) = write(conn, owner, None, |tx, mut totals| {
        for key in keys {
            if let Some((size, _)) = tx.size(tenant, bucket, key)? {
                tx.remove(tenant, bucket, key)?;
                totals = moved(totals, (Some(size), None));
            }
        }
        Ok(((), totals))
    })?;
    Ok(totals)
}

/// Deletes every key of `owner`'s `bucket`; the tenant's totals after.
pub fn clear_bucket(conn: &mut dyn Conn, owner: &Owner, bucket: &str) -> KvResult<Totals> {
    check_bucket(bucket)?;
    let tenant = &*owner.tenant;
    let ((), totals) = write(conn, owner, None, |tx, totals| {
        let gone = tx.remove_bucket(tenant, bucket)?;
        Ok(((), Totals { keys: totals.keys.saturating_sub(gone.keys), bytes: totals.bytes.saturating_sub(gone.bytes) }))
    })?;
    Ok(totals)
}

/// A counter's value: its decimal text (a missing key is 0).
fn counter(entry: Option<&Entry>, key: &str) -> KvResult<i64> {
    let Some(entry) = entry else { return Ok(0) };
    std::str::from_utf8(&entry.value)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .ok_or_else(|| KvError::Invalid(format!("the value of {key:?} is not a decimal integer: increment cannot add to it")))
}

/// Adds `delta` to the counter `key` of `owner`'s `bucket` (its value, as
/// decimal text; a missing key counts from 0), exactly, however many race;
/// the new value and the tenant's totals after.
pub fn increment(conn: &mut dyn Conn, owner: &Owner, quota: Quota, bucket: &str, key: &str, delta: i64) -> KvResult<(i64, Totals)> {
    check_bucket(bucket)?;
    check_key(key)?;
    let tenant = &*owner.tenant;
    write(conn, owner, Some(quota), |tx, totals| {
        let entry = tx.entry(tenant, bucket, key)?;
        let value = counter(entry.as_ref(), key)?
            .checked_add(delta)
            .ok_or_else(|| KvError::Invalid(format!("incrementing {key:?} by {delta} overflows a 64-bit integer")))?;
        let text = value.to_string();
        tx.put(tenant, bucket, key, text.as_bytes(), entry.as_ref().map_or(1, |e| e.version + 1))?;
        let old = entry.map(|e| stored_size(bucket, key, e.value.len()));
        Ok((value, moved(totals, (old, Some(stored_size(bucket, key, text.len()))))))
    })
}

/// Writes `value` to `cas`'s key if it is still as `cas` read it:
/// `Ok(Ok(totals))`, or `Ok(Err(fresh))` with the key as it is now.
pub fn compare_and_swap(conn: &mut dyn Conn, owner: &Owner, quota: Quota, cas: &Cas, value: &[u8]) -> KvResult<Result<Totals, Cas>> {
    let (bucket, key) = (cas.bucket.as_str(), cas.key.as_str());
    check_bucket(bucket)?;
    check_key(key)?;
    check_value(quota, value)?;
    let tenant = &*owner.tenant;
    let outcome = write(conn, owner, Some(quota), |tx, totals| {
        let now = tx.entry(tenant, bucket, key)?;
        // Value and version: a key deleted and written again restarts its
        // versions, and only an equal value then means nothing changed.
        if now != cas.current {
            return Ok((Some(now), totals));
        }
        Ok((None, put_one(tx, (tenant, bucket), key, value, totals)?))
    });
    match outcome? {
        (None, totals) => Ok(Ok(totals)),
        (Some(now), _) => Ok(Err(Cas { bucket: bucket.to_owned(), key: key.to_owned(), current: now })),
    }
}
