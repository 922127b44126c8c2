//! The tenant's state (`wasi:keyvalue`): buckets of keys and values kept
//! by the gateway in its database, so every node, and every request after
//! this one, reads what this one wrote. A bucket is a name (1 to 64 ASCII
//! letters, digits, `.`, `_`, `-`) within the tenant: another tenant's
//! bucket of the same name is another bucket.
//!
//! ```ignore
//! use facegate_guest_sdk::kv::Bucket;
//! let cache = Bucket::open("answers")?;
//! if let Some(hit) = cache.get("key")? { /* … */ }
//! cache.set("key", b"value")?;
//! let visits = Bucket::open("counters")?.increment("visits", 1)?;
//! ```
//!
//! Every write is checked against the tenant's limits (`kv_keys`,
//! `kv_bytes`, `kv_value_bytes`) and every key read or written against
//! the request's (`kv_ops`); past one, the call fails with a
//! [`KvError::Limit`] naming it, which a handler that returns it answers
//! with 507 `state_limit`.

use crate::Error;

mod bindings {
    #![allow(unsafe_code, reason = "wit-bindgen generates the canonical ABI glue")]
    #![allow(missing_docs, reason = "bindgen-generated code")]
    #![allow(clippy::all, reason = "bindgen-generated code")]

    wit_bindgen::generate!({
        world: "state",
        path: "../wit",
        // wasi:keyvalue is not among the interfaces the `wasi` crate binds.
        generate_all,
    });
}

use bindings::wasi::keyvalue::{atomics, batch, store};

/// The names a limit's refusal carries, as the host words it: `(kv_keys)`, …
const LIMITS: [&str; 4] = ["(kv_keys)", "(kv_bytes)", "(kv_value_bytes)", "(kv_ops)"];

/// Times [`Bucket::update`] retries a swap that lost a race.
pub const UPDATE_TRIES: usize = 16;

/// Why a state call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// Past one of the tenant's or the request's limits; the message names it.
    #[error("{0}")]
    Limit(String),
    /// The tenant has no state here (a node that keeps none), or it is gone.
    #[error("the tenant's state cannot be reached: {0}")]
    Unavailable(String),
    /// Anything else: a bad name, a value `increment` cannot add to, the store failing.
    #[error("{0}")]
    Other(String),
}

impl From<store::Error> for KvError {
    fn from(e: store::Error) -> Self {
        match e {
            store::Error::NoSuchStore => Self::Unavailable("no such store".into()),
            store::Error::AccessDenied => Self::Unavailable("access denied (the tenant was deleted)".into()),
            // The host names the limit a refusal is for, as `(kv_keys)` and the like.
            store::Error::Other(why) if LIMITS.iter().any(|name| why.contains(name)) => Self::Limit(why),
            store::Error::Other(why) => Self::Other(why),
        }
    }
}

impl From<KvError> for Error {
    fn from(e: KvError) -> Self {
        match &e {
            KvError::Limit(_) => Error::custom(507, "state_limit", e.to_string()),
            KvError::Unavailable(_) | KvError::Other(_) => Error::custom(500, "state_error", e.to_string()),
        }
    }
}

/// One of the tenant's buckets.
pub struct Bucket(store::Bucket);

impl Bucket {
    /// Opens the bucket `name` (it exists once a key is written to it).
    pub fn open(name: &str) -> Result<Self, KvError> {
        Ok(Self(store::open(name)?))
    }

    /// The value of `key`, `None` if it has none.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        Ok(self.0.get(key)?)
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), KvError> {
        Ok(self.0.set(key, value)?)
    }

    /// Deletes `key` (a missing key is no error).
    pub fn delete(&self, key: &str) -> Result<(), KvError> {
        Ok(self.0.delete(key)?)
    }

    /// Whether `key` has a value.
    pub fn exists(&self, key: &str) -> Result<bool, KvError> {
        Ok(self.0.exists(key)?)
    }

    /// One page of keys (at most 100) after `cursor`, in byte order, and
    /// the cursor of the next page, if there may be one.
    pub fn keys_after(&self, cursor: Option<&str>) -> Result<(Vec<String>, Option<String>), KvError> {
        let page = self.0.list_keys(cursor)?;
        Ok((page.keys, page.cursor))
    }

    /// Every key, page by page (each page a read of the request's `kv_ops`).
    pub fn keys(&self) -> Result<Vec<String>, KvError> {
        let (mut all, mut cursor) = self.keys_after(None)?;
        while let Some(after) = cursor {
            let (page, next) = self.keys_after(Some(&after))?;
            all.extend(page);
            cursor = next;
        }
        Ok(all)
    }

    /// Adds `delta` to the counter `key` (decimal text; a missing key
    /// counts from 0), atomically across every request on every node; the
    /// new value.
    pub fn increment(&self, key: &str, delta: i64) -> Result<i64, KvError> {
        Ok(atomics::increment(&self.0, key, delta)?)
    }

    /// Replaces `key`'s value with `change(current)` atomically: read,
    /// change, then swap only if no one wrote it in between, retrying with
    /// the fresh value up to [`UPDATE_TRIES`] times. The value written.
    pub fn update(&self, key: &str, mut change: impl FnMut(Option<&[u8]>) -> Vec<u8>) -> Result<Vec<u8>, KvError> {
        let mut cas = atomics::Cas::new(&self.0, key)?;
        for _ in 0..UPDATE_TRIES {
            let value = change(cas.current()?.as_deref());
            match atomics::swap(cas, &value) {
                Ok(()) => return Ok(value),
                Err(atomics::CasError::CasFailed(fresh)) => cas = fresh,
                Err(atomics::CasError::StoreError(e)) => return Err(e.into()),
            }
        }
        Err(KvError::Other(format!("{key:?} changed under {UPDATE_TRIES} tries to update it")))
    }

    /// The values of `keys`, in order (`None`: no value).
    pub fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, KvError> {
        Ok(batch::get_many(&self.0, keys)?.into_iter().map(|found| found.map(|(_, value)| value)).collect())
    }

    /// Sets every key of `items`, all or none.
    pub fn set_many(&self, items: &[(String, Vec<u8>)]) -> Result<(), KvError> {
        Ok(batch::set_many(&self.0, items)?)
    }

    /// Deletes every key of `keys`.
    pub fn delete_many(&self, keys: &[String]) -> Result<(), KvError> {
        Ok(batch::delete_many(&self.0, keys)?)
    }

    /// The value of `key` as JSON, `None` if it has none.
    pub fn get_json<T: serde::de::DeserializeOwned>(&self, key: &str) -> Result<Option<T>, KvError> {
        let Some(bytes) = self.get(key)? else { return Ok(None) };
        serde_json::from_slice(&bytes).map(Some).map_err(|e| KvError::Other(format!("the value of {key:?} is not the JSON expected: {e}")))
    }

    /// Sets `key` to `value` as JSON.
    pub fn set_json<T: serde::Serialize + ?Sized>(&self, key: &str, value: &T) -> Result<(), KvError> {
        let bytes = serde_json::to_vec(value).map_err(|e| KvError::Other(format!("cannot serialise the value of {key:?}: {e}")))?;
        self.set(key, &bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_answers_507_naming_it_and_other_failures_500() {
        let limit: KvError = store::Error::Other("tenant \"t\" may keep 10 keys (kv_keys); this write would make 11".into()).into();
        assert!(matches!(limit, KvError::Limit(_)));
        let answer = Error::from(limit);
        assert_eq!((answer.status(), answer.code()), (507, "state_limit"));
        assert!(answer.to_string().contains("kv_keys"));
        let quoted = KvError::from(store::Error::Other("the value of \"a(kv_x\" is not a decimal integer".into()));
        assert!(matches!(quoted, KvError::Other(_)), "a key that looks like a limit's name is not one");
        let other = Error::from(KvError::from(store::Error::Other("the state store failed; retry".into())));
        assert_eq!((other.status(), other.code()), (500, "state_error"));
        let gone = Error::from(KvError::from(store::Error::AccessDenied));
        assert_eq!(gone.code(), "state_error");
    }
}
