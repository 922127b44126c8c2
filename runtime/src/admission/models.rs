//! Which models a tenant's handlers may call: the tenant limit `models`.
//!
//! A [`ModelAllow`] is `*` (every model the node serves, the default) or a
//! list of model names. Limits are `Copy` (a request carries them by value),
//! so a list is kept once, interned, and the limit is a reference to it:
//! the lists an operator ever sets, each once, for the life of the process
//! (at most [`MAX_LISTS`]: a new list past it is refused).

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use std::sync::{LazyLock, Mutex};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Most names one list may hold.
pub const MAX_ALLOWED_MODELS: usize = 32;
/// Longest model name (the SDKs' bound too).
pub const MAX_MODEL_NAME: usize = 64;
/// Most distinct lists the process keeps; a new one past it is refused.
const MAX_LISTS: usize = 4096;

/// `*` (every model) or the models a tenant may call, comma-separated.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ModelAllow(&'static str);

impl ModelAllow {
    /// Every model the node serves.
    pub const ALL: Self = Self("*");

    /// Whether `model` may be called.
    pub fn allows(&self, model: &str) -> bool {
        self.0 == "*" || self.0.split(',').any(|name| name == model)
    }

    /// The names listed (none for `*`).
    pub fn names(&self) -> impl Iterator<Item = &'static str> {
        let list = if self.0 == "*" { "" } else { self.0 };
        list.split(',').filter(|name| !name.is_empty())
    }
}

impl Default for ModelAllow {
    fn default() -> Self {
        Self::ALL
    }
}

/// Whether `name` is a valid model name: 1 to [`MAX_MODEL_NAME`] bytes of
/// `a-z`, `0-9`, `.`, `_`, `-`, starting with a letter or digit.
pub fn valid_model_name(name: &str) -> bool {
    let valid = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-');
    !name.is_empty() && name.len() <= MAX_MODEL_NAME && name.bytes().all(valid) && name.as_bytes()[0].is_ascii_alphanumeric()
}

impl FromStr for ModelAllow {
    type Err = String;

    /// `*`, or model names separated by commas (spaces around them are
    /// dropped, duplicates kept once, the list sorted).
    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text == "*" {
            return Ok(Self::ALL);
        }
        let mut names: Vec<&str> = text.split(',').map(str::trim).filter(|name| !name.is_empty()).collect();
        names.sort_unstable();
        names.dedup();
        if names.is_empty() {
            return Err("* or at least one model name".to_owned());
        }
        if names.len() > MAX_ALLOWED_MODELS {
            return Err(format!("at most {MAX_ALLOWED_MODELS} model names, or *"));
        }
        if let Some(bad) = names.iter().find(|name| !valid_model_name(name)) {
            return Err(format!("{bad:?} is not a model name (a-z, 0-9, '.', '_', '-'; at most {MAX_MODEL_NAME} bytes)"));
        }
        intern(names.join(",")).map(Self)
    }
}

/// The one copy of `list`, kept for the life of the process; refused once
/// [`MAX_LISTS`] others are kept.
fn intern(list: String) -> Result<&'static str, String> {
    static LISTS: LazyLock<Mutex<HashSet<&'static str>>> = LazyLock::new(Mutex::default);
    let mut lists = LISTS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(kept) = lists.get(list.as_str()) {
        return Ok(kept);
    }
    if lists.len() >= MAX_LISTS {
        return Err(format!("this node keeps at most {MAX_LISTS} distinct model lists; reuse one"));
    }
    let kept: &'static str = Box::leak(list.into_boxed_str());
    lists.insert(kept);
    Ok(kept)
}

impl fmt::Display for ModelAllow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl fmt::Debug for ModelAllow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl Serialize for ModelAllow {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.0)
    }
}

impl<'de> Deserialize<'de> for ModelAllow {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_allows_its_names_and_star_allows_all() {
        let list: ModelAllow = " centerface-int8, centerface ,centerface".parse().unwrap();
        assert_eq!(list.to_string(), "centerface,centerface-int8");
        assert!(list.allows("centerface") && list.allows("centerface-int8"));
        assert!(!list.allows("centerface-int") && !list.allows("") && !list.allows("centerface,centerface-int8"));
        assert!(ModelAllow::ALL.allows("anything"));
        let one: ModelAllow = "centerface".parse().unwrap();
        assert!(one.allows("centerface") && !one.allows("centerface-int8"));
        assert_eq!(one.names().collect::<Vec<_>>(), ["centerface"]);
    }

    #[test]
    fn bad_names_and_long_lists_are_refused() {
        for bad in ["", " , ", "Centerface", "a b", "../m", "-m", &"m".repeat(MAX_MODEL_NAME + 1), "m,*"] {
            assert!(bad.parse::<ModelAllow>().is_err(), "{bad}");
        }
        let many: Vec<String> = (0..=MAX_ALLOWED_MODELS).map(|i| format!("m{i}")).collect();
        assert!(many.join(",").parse::<ModelAllow>().is_err());
    }

    #[test]
    fn equal_lists_share_one_copy_and_round_trip_through_json() {
        let a: ModelAllow = "b,a".parse().unwrap();
        let b: ModelAllow = "a,b".parse().unwrap();
        assert!(std::ptr::eq(a.0, b.0));
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(json, "\"a,b\"");
        assert_eq!(serde_json::from_str::<ModelAllow>(&json).unwrap(), a);
        assert!(serde_json::from_str::<ModelAllow>("\"A\"").is_err());
    }
}
