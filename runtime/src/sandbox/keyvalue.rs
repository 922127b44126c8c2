//! `wasi:keyvalue` (store, atomics, batch; 0.2.0-draft2) for handlers:
//! their tenant's state in the gateway's database ([`crate::kv`]), within
//! the tenant's limits (`kv_keys`, `kv_bytes`, `kv_value_bytes`, and
//! `kv_ops` per request), each call bounded by the request's deadline.
//!
//! A bucket is a name (see [`crate::kv::check_bucket`]), opened by any
//! handler of the tenant; every refusal is an `error` the guest sees:
//! `access-denied` for a tenant deleted since the request started,
//! `other` with the reason for the rest (a limit names itself). What a
//! read brings back is charged to the node's memory budget before it is
//! read (the largest value the tenant may keep, per key), and lands in the
//! guest's memory under its own limit.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};

use crate::admission::limits::TenantLimits;
use crate::admission::memory::Charge;
use crate::kv::{self, Cas, Conn, KvError, KvPool, KvResult, LIST_PAGE, Owner, Quota, Totals};
use crate::telemetry::usage::{Meter, Usage, UsageKey};

mod wit {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "facegate:face-detect/state",
        imports: { default: async | trappable },
        with: {
            "wasi:keyvalue/store.bucket": super::Bucket,
            "wasi:keyvalue/atomics.cas": super::CasHandle,
        },
    });
}

use self::wit::wasi::keyvalue::store::{Error, KeyResponse};
use self::wit::wasi::keyvalue::{atomics, batch, store};

/// An open bucket: its name (the tenant is the request's).
pub struct Bucket(String);

/// A compare-and-swap in progress: the key as it was read, its value
/// charged to the node's memory budget while the handle lives.
pub struct CasHandle(Cas, Option<Charge>);

/// What a request may do with its tenant's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLimits {
    /// The tenant's bounds on what it keeps.
    pub quota: Quota,
    /// Keys the request may read or write (each key of a batch counts).
    pub ops: u32,
}

impl KvLimits {
    /// The state limits among a tenant's.
    pub fn of(limits: &TenantLimits) -> Self {
        let quota = Quota { keys: limits.kv_keys, bytes: limits.kv_bytes, value_bytes: limits.kv_value_bytes };
        Self { quota, ops: limits.kv_ops }
    }
}

/// Per-request state of `wasi:keyvalue`.
pub struct KvCtx {
    /// The state's connections and whose state this is; `None`: this
    /// request has no state (a node without one, a tenant not in the
    /// snapshot): every `open` is `no-such-store`.
    at: Option<(Arc<KvPool>, Owner)>,
    limits: KvLimits,
    ops_left: u32,
    deadline: Instant,
    /// What the last read brought back, in the node's memory budget.
    memory: Option<Charge>,
    used: Usage,
    meter: Option<(Arc<Meter>, UsageKey)>,
}

impl Default for KvCtx {
    /// No state: what an idle instance holds.
    fn default() -> Self {
        let limits = KvLimits { quota: Quota { keys: 0, bytes: 0, value_bytes: 0 }, ops: 0 };
        Self { at: None, limits, ops_left: 0, deadline: Instant::now(), memory: None, used: Usage::default(), meter: None }
    }
}

impl KvCtx {
    /// A request of `owner` on `pool`, within `limits`, until `deadline`;
    /// what it reads is charged to `memory` (a charge of the tenant's).
    pub fn new(at: Option<(Arc<KvPool>, Owner)>, limits: KvLimits, deadline: Instant, memory: Charge) -> Self {
        Self { at, limits, ops_left: limits.ops, deadline, memory: Some(memory), used: Usage::default(), meter: None }
    }

    /// Meters this request as `key` in `meter` (see [`KvCtx::settle`]).
    pub fn meter_as(&mut self, meter: Arc<Meter>, key: UsageKey) {
        self.meter = Some((meter, key));
    }

    /// Adds the request's reads, writes and the state's size after its
    /// writes to its meter, once (a request stopped early, when dropped).
    pub fn settle(&mut self) {
        let Some((meter, key)) = self.meter.take() else { return };
        if self.used != Usage::default() {
            meter.add(&key, &self.used);
        }
    }

    /// Spends `n` of the request's operations (at least one: every call
    /// costs the database something).
    fn spend(&mut self, n: usize) -> Result<(), Error> {
        let n = u32::try_from(n.max(1)).unwrap_or(u32::MAX);
        if n > self.ops_left {
            return Err(Error::Other(format!(
                "this request may read or write {} keys (kv_ops); it has {} left and asked for {n}",
                self.limits.ops, self.ops_left
            )));
        }
        self.ops_left -= n;
        Ok(())
    }

    /// Runs `op` on a connection for `keys` keys (spent first), counted as
    /// reads or writes; its refusal as the guest's error.
    async fn call<T: Send + 'static>(
        &mut self,
        (keys, writes): (usize, bool),
        op: impl FnOnce(&mut dyn Conn, &Owner, Quota) -> KvResult<T> + Send + 'static,
    ) -> Result<T, Error> {
        let Some((pool, owner)) = self.at.clone() else { return Err(Error::NoSuchStore) };
        self.spend(keys)?;
        let (quota, tenant) = (self.limits.quota, Arc::clone(&owner.tenant));
        let result = pool.run(&tenant, self.deadline, move |conn| op(conn, &owner, quota)).await;
        let counted = keys.max(1) as u64;
        if writes {
            self.used.kv_writes += counted
        } else {
            self.used.kv_reads += counted
        }
        result.map_err(|e| guest_error(&self.at, e))
    }

    /// Notes the state's size after a write.
    fn stored(&mut self, totals: Totals) {
        self.used.kv_bytes = self.used.kv_bytes.max(totals.bytes);
    }

    /// Charges the node's memory budget for `keys` values at their
    /// largest (never more than the tenant may keep in all), before they
    /// are read; the bytes charged, which the read may not pass (the
    /// worker stops there: a key asked for twice counts twice).
    fn charge_reads(&mut self, keys: usize) -> Result<u64, Error> {
        let quota = self.limits.quota;
        let most = quota.value_bytes.saturating_mul(keys as u64).min(quota.bytes);
        let Some(memory) = &mut self.memory else { return Ok(most) };
        memory
            .resize(usize::try_from(most).unwrap_or(usize::MAX))
            .map_err(|refusal| Error::Other(format!("the node cannot hold what this read may bring now ({refusal}); retry")))?;
        Ok(most)
    }

    /// A charge of its own for `bytes` a resource keeps (a compare-and-swap's value).
    fn hold(&self, bytes: usize) -> Result<Option<Charge>, Error> {
        let Some(memory) = &self.memory else { return Ok(None) };
        memory.another(bytes).map(Some).map_err(|refusal| Error::Other(format!("the node cannot hold this value now ({refusal}); retry")))
    }

    /// Charges what a read brought back (no more than charged before it).
    fn charge_read<'a>(&mut self, values: impl Iterator<Item = &'a [u8]>) {
        if let Some(memory) = &mut self.memory {
            // Shrinking never fails.
            let _ = memory.resize(values.map(<[u8]>::len).sum());
        }
    }
}

impl Drop for KvCtx {
    fn drop(&mut self) {
        self.settle();
    }
}

/// A state refusal as the guest sees it; a database failure is logged
/// here (the guest sees that the store failed, not the database's words).
fn guest_error(at: &Option<(Arc<KvPool>, Owner)>, e: KvError) -> Error {
    match e {
        KvError::Gone => Error::AccessDenied,
        KvError::Store(why) => {
            // At most one line a second: a database away fails every call.
            static LOGGED_AT: AtomicU64 = AtomicU64::new(0);
            let second = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            if LOGGED_AT.swap(second, Ordering::Relaxed) != second {
                let tenant = at.as_ref().map(|(_, owner)| &*owner.tenant).unwrap_or_default();
                tracing::warn!(tenant, error = %why, "a handler's state call failed (at most one such line a second)");
            }
            Error::Other("the state store failed; retry".into())
        }
        KvError::Failed(why) => {
            let tenant = at.as_ref().map(|(_, owner)| &*owner.tenant).unwrap_or_default();
            tracing::debug!(tenant, error = %why, "the database refused a handler's state call");
            Error::Other("the state store failed; retry".into())
        }
        KvError::Limit(why) | KvError::Invalid(why) | KvError::Busy(why) => Error::Other(why),
    }
}

/// A request's view of its state (see [`add_to_linker`]).
pub struct KvView<'a> {
    /// The request's state context.
    pub ctx: &'a mut KvCtx,
    /// The request's resource table (buckets and CAS handles live there).
    pub table: &'a mut ResourceTable,
}

impl KvView<'_> {
    fn bucket(&self, bucket: &Resource<Bucket>) -> wasmtime::Result<String> {
        Ok(self.table.get(bucket)?.0.clone())
    }
}

impl store::Host for KvView<'_> {
    async fn open(&mut self, identifier: String) -> wasmtime::Result<Result<Resource<Bucket>, Error>> {
        if self.ctx.at.is_none() {
            return Ok(Err(Error::NoSuchStore));
        }
        if let Err(e) = kv::check_bucket(&identifier) {
            return Ok(Err(Error::Other(e.to_string())));
        }
        Ok(Ok(self.table.push(Bucket(identifier))?))
    }
}

impl store::HostBucket for KvView<'_> {
    async fn get(&mut self, bucket: Resource<Bucket>, key: String) -> wasmtime::Result<Result<Option<Vec<u8>>, Error>> {
        let bucket = self.bucket(&bucket)?;
        Ok(get_many(self.ctx, bucket, vec![key]).await.map(|mut found| found.pop().flatten().map(|(_, value)| value)))
    }

    async fn set(&mut self, bucket: Resource<Bucket>, key: String, value: Vec<u8>) -> wasmtime::Result<Result<(), Error>> {
        let bucket = self.bucket(&bucket)?;
        Ok(set_many(self.ctx, bucket, vec![(key, value)]).await)
    }

    async fn delete(&mut self, bucket: Resource<Bucket>, key: String) -> wasmtime::Result<Result<(), Error>> {
        let bucket = self.bucket(&bucket)?;
        Ok(delete_many(self.ctx, bucket, vec![key]).await)
    }

    async fn exists(&mut self, bucket: Resource<Bucket>, key: String) -> wasmtime::Result<Result<bool, Error>> {
        let bucket = self.bucket(&bucket)?;
        if let Err(e) = kv::check_key(&key) {
            return Ok(Err(Error::Other(e.to_string())));
        }
        Ok(self.ctx.call((1, false), move |conn, owner, _| conn.exists(owner, &bucket, &key)).await)
    }

    async fn list_keys(&mut self, bucket: Resource<Bucket>, cursor: Option<String>) -> wasmtime::Result<Result<KeyResponse, Error>> {
        let bucket = self.bucket(&bucket)?;
        if let Some(Err(e)) = cursor.as_deref().map(kv::check_key) {
            return Ok(Err(Error::Other(format!("the cursor is a key: {e}"))));
        }
        let listed = self.ctx.call((1, false), move |conn, owner, _| conn.keys(owner, &bucket, cursor.as_deref(), LIST_PAGE)).await;
        Ok(listed.map(|keys| {
            let cursor = (keys.len() == LIST_PAGE).then(|| keys.last().cloned()).flatten();
            KeyResponse { keys, cursor }
        }))
    }

    async fn drop(&mut self, bucket: Resource<Bucket>) -> wasmtime::Result<()> {
        self.table.delete(bucket)?;
        Ok(())
    }
}

/// The values of `keys` in `bucket`, with their keys (`None`: absent).
async fn get_many(ctx: &mut KvCtx, bucket: String, keys: Vec<String>) -> Result<Vec<Option<(String, Vec<u8>)>>, Error> {
    if let Some(e) = keys.iter().find_map(|key| kv::check_key(key).err()) {
        return Err(Error::Other(e.to_string()));
    }
    let most = ctx.charge_reads(keys.len())?;
    let found = ctx
        .call((keys.len(), false), move |conn, owner, _| {
            let entries = conn.entries(owner, &bucket, &keys, most)?;
            Ok(keys.into_iter().zip(entries).map(|(key, entry)| entry.map(|e| (key, e.value))).collect::<Vec<_>>())
        })
        .await?;
    ctx.charge_read(found.iter().flatten().map(|(_, value)| value.as_slice()));
    Ok(found)
}

/// Sets each of `items` in `bucket`, all or none.
async fn set_many(ctx: &mut KvCtx, bucket: String, items: Vec<(String, Vec<u8>)>) -> Result<(), Error> {
    if items.is_empty() {
        return ctx.spend(1);
    }
    let totals = ctx.call((items.len(), true), move |conn, owner, quota| kv::set_many(conn, owner, quota, &bucket, &items)).await?;
    ctx.stored(totals);
    Ok(())
}

/// Deletes each of `keys` from `bucket`.
async fn delete_many(ctx: &mut KvCtx, bucket: String, keys: Vec<String>) -> Result<(), Error> {
    if keys.is_empty() {
        return ctx.spend(1);
    }
    let totals = ctx.call((keys.len(), true), move |conn, owner, _| kv::delete_many(conn, owner, &bucket, &keys)).await?;
    ctx.stored(totals);
    Ok(())
}

impl atomics::Host for KvView<'_> {
    async fn increment(&mut self, bucket: Resource<Bucket>, key: String, delta: i64) -> wasmtime::Result<Result<i64, Error>> {
        let bucket = self.bucket(&bucket)?;
        let done = self.ctx.call((1, true), move |conn, owner, quota| kv::increment(conn, owner, quota, &bucket, &key, delta)).await;
        Ok(done.map(|(value, totals)| {
            self.ctx.stored(totals);
            value
        }))
    }

    async fn swap(&mut self, cas: Resource<CasHandle>, value: Vec<u8>) -> wasmtime::Result<Result<(), atomics::CasError>> {
        let CasHandle(cas, held) = self.table.delete(cas)?;
        drop(held);
        // A failed swap reads the key's fresh value: charged before, as a read.
        if let Err(e) = self.ctx.charge_reads(1) {
            return Ok(Err(atomics::CasError::StoreError(e)));
        }
        let done = self.ctx.call((1, true), move |conn, owner, quota| kv::compare_and_swap(conn, owner, quota, &cas, &value)).await;
        self.ctx.charge_read(std::iter::empty());
        match done {
            Ok(Ok(totals)) => {
                self.ctx.stored(totals);
                Ok(Ok(()))
            }
            Ok(Err(fresh)) => {
                let size = fresh.current.as_ref().map_or(0, |e| e.value.len());
                match self.ctx.hold(size) {
                    Ok(held) => Ok(Err(atomics::CasError::CasFailed(self.table.push(CasHandle(fresh, held))?))),
                    Err(e) => Ok(Err(atomics::CasError::StoreError(e))),
                }
            }
            Err(e) => Ok(Err(atomics::CasError::StoreError(e))),
        }
    }
}

impl atomics::HostCas for KvView<'_> {
    async fn new(&mut self, bucket: Resource<Bucket>, key: String) -> wasmtime::Result<Result<Resource<CasHandle>, Error>> {
        let name = self.bucket(&bucket)?;
        let read = get_entry(self.ctx, name.clone(), key.clone()).await;
        let held = read.and_then(|current| {
            let held = self.ctx.hold(current.as_ref().map_or(0, |e| e.value.len()))?;
            Ok((current, held))
        });
        // The read's own charge is the handle's now.
        self.ctx.charge_read(std::iter::empty());
        Ok(match held {
            Ok((current, held)) => Ok(self.table.push(CasHandle(Cas { bucket: name, key, current }, held))?),
            Err(e) => Err(e),
        })
    }

    async fn current(&mut self, cas: Resource<CasHandle>) -> wasmtime::Result<Result<Option<Vec<u8>>, Error>> {
        Ok(Ok(self.table.get(&cas)?.0.current.as_ref().map(|e| e.value.clone())))
    }

    async fn drop(&mut self, cas: Resource<CasHandle>) -> wasmtime::Result<()> {
        self.table.delete(cas)?;
        Ok(())
    }
}

/// The entry of `key` in `bucket`, for a compare-and-swap.
async fn get_entry(ctx: &mut KvCtx, bucket: String, key: String) -> Result<Option<kv::Entry>, Error> {
    if let Err(e) = kv::check_key(&key) {
        return Err(Error::Other(e.to_string()));
    }
    let most = ctx.charge_reads(1)?;
    let entry = ctx.call((1, false), move |conn, owner, _| Ok(conn.entries(owner, &bucket, &[key], most)?.pop().flatten())).await?;
    ctx.charge_read(entry.iter().map(|e| e.value.as_slice()));
    Ok(entry)
}

impl batch::Host for KvView<'_> {
    async fn get_many(
        &mut self,
        bucket: Resource<Bucket>,
        keys: Vec<String>,
    ) -> wasmtime::Result<Result<Vec<Option<(String, Vec<u8>)>>, Error>> {
        let bucket = self.bucket(&bucket)?;
        Ok(get_many(self.ctx, bucket, keys).await)
    }

    async fn set_many(&mut self, bucket: Resource<Bucket>, items: Vec<(String, Vec<u8>)>) -> wasmtime::Result<Result<(), Error>> {
        let bucket = self.bucket(&bucket)?;
        Ok(set_many(self.ctx, bucket, items).await)
    }

    async fn delete_many(&mut self, bucket: Resource<Bucket>, keys: Vec<String>) -> wasmtime::Result<Result<(), Error>> {
        let bucket = self.bucket(&bucket)?;
        Ok(delete_many(self.ctx, bucket, keys).await)
    }
}

struct HasKv;

impl HasData for HasKv {
    type Data<'a> = KvView<'a>;
}

/// Adds `wasi:keyvalue` (store, atomics, batch) to `linker`, on what `get` projects.
pub fn add_to_linker<T: Send + 'static>(linker: &mut Linker<T>, get: fn(&mut T) -> KvView<'_>) -> wasmtime::Result<()> {
    store::add_to_linker::<T, HasKv>(linker, get)?;
    atomics::add_to_linker::<T, HasKv>(linker, get)?;
    batch::add_to_linker::<T, HasKv>(linker, get)
}
