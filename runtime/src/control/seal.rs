//! The keys that seal precompiled artifacts, which nodes load as native
//! code through `unsafe` deserialisation, so only a key holder can make
//! one that loads:
//!
//! - [`ArtifactKey`], from `--artifact-key` (a secret of its own, never the
//!   admin token): seals the artifacts the nodes of a cluster share through
//!   the store. Every node given the same secret derives the same key, so
//!   whoever can write the database but lacks the secret cannot make the
//!   nodes run code, and neither can whoever holds the admin token.
//! - [`CacheKey`]: seals each node's own artifact cache in its data
//!   directory. Derived from the artifact key when there is one, else a
//!   random key created once in the data directory (mode 0600).
//!
//! Both MACs are HMAC-SHA256 over the engine's identity, the component's
//! SHA-256 (each prefixed by its length, so no two pairs read alike) and
//! the artifact's bytes: an artifact sealed for one component or engine
//! does not pass for another's.

use std::path::Path;

use anyhow::Context;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::keys;

/// A component precompiled by one node, stored for the other nodes whose
/// engine has the same settings, so that a deploy reaches every node
/// without each compiling it again. Native code: a node loads it only when
/// `mac` proves that a node holding the cluster's secret made it (see
/// `components::ArtifactKey`).
#[derive(Debug, Clone, PartialEq)]
pub struct SharedArtifact {
    /// The engine's identity (`components::engine_id`): nodes with another engine compile for themselves.
    pub engine: String,
    /// `Component::serialize`'s output.
    pub bytes: Vec<u8>,
    /// HMAC-SHA256 (hex) over the engine, the component's SHA-256 and `bytes`.
    pub mac: String,
}

/// What the shared key is derived under; a new label makes every artifact
/// sealed under an old derivation (the admin token's, before v2) unusable.
const SHARED_KEY_LABEL: &[u8] = b"facegate shared artifact key v2 (--artifact-key)";
/// What a node's cache key is derived under from the artifact key: the two
/// keys differ, so a MAC of one is never a MAC of the other.
const CACHE_KEY_LABEL: &[u8] = b"facegate artifact cache key v1";
/// The random cache key of a node without an artifact key, in its data directory.
pub const CACHE_KEY_FILE: &str = "artifact-cache.key";

/// Seals and checks the artifacts nodes share through the store.
#[derive(Clone)]
pub struct ArtifactKey([u8; 32]);

impl std::fmt::Debug for ArtifactKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ArtifactKey(..)")
    }
}

impl ArtifactKey {
    /// The key for `secret` (`--artifact-key`); the secret itself is never what signs.
    pub fn derive(secret: &str) -> Self {
        Self(derive(secret.as_bytes(), SHARED_KEY_LABEL))
    }

    /// An artifact of `component_sha256` for `engine`, sealed with this key.
    pub fn seal(&self, engine: &str, component_sha256: &str, bytes: Vec<u8>) -> SharedArtifact {
        let mac = keys::hex(&tag(&self.0, engine, component_sha256, &bytes).finalize().into_bytes());
        SharedArtifact { engine: engine.to_owned(), bytes, mac }
    }

    /// Whether `artifact` was sealed with this key for this component (constant time).
    pub fn verify(&self, component_sha256: &str, artifact: &SharedArtifact) -> bool {
        verify(&self.0, &artifact.engine, component_sha256, &artifact.bytes, &artifact.mac)
    }

    /// The key that seals this node's artifact cache.
    pub fn cache_key(&self) -> CacheKey {
        CacheKey(derive(&self.0, CACHE_KEY_LABEL))
    }
}

/// Seals and checks the artifacts in a node's own cache (its data directory).
#[derive(Clone)]
pub struct CacheKey([u8; 32]);

impl std::fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheKey(..)")
    }
}

impl CacheKey {
    /// The random key kept in `data_dir` ([`CACHE_KEY_FILE`], mode 0600),
    /// created at the first start. A file that does not hold a key is
    /// replaced (the cache it sealed is then refused and recompiled).
    pub fn in_data_dir(data_dir: &Path) -> anyhow::Result<Self> {
        let path = data_dir.join(CACHE_KEY_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => match keys::digest_from_hex(text.trim()) {
                Some(key) => return Ok(Self(key)),
                None => {
                    tracing::warn!(path = %path.display(), "the artifact cache key file holds no key; replacing it (cached artifacts are compiled again)")
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
        let key = keys::random::<32>()?;
        super::keys::write_secret(&path, &keys::hex(&key))?;
        Ok(Self(key))
    }

    /// The MAC (hex) of a cached artifact of `component_sha256` for `engine`.
    pub fn tag(&self, engine: &str, component_sha256: &str, bytes: &[u8]) -> String {
        keys::hex(&tag(&self.0, engine, component_sha256, bytes).finalize().into_bytes())
    }

    /// Whether `mac` is this key's MAC of the artifact (constant time).
    pub fn verify(&self, engine: &str, component_sha256: &str, bytes: &[u8], mac: &str) -> bool {
        verify(&self.0, engine, component_sha256, bytes, mac)
    }
}

fn derive(secret: &[u8], label: &[u8]) -> [u8; 32] {
    let mut mac = hmac(secret);
    mac.update(label);
    mac.finalize().into_bytes().into()
}

fn tag(key: &[u8; 32], engine: &str, component_sha256: &str, bytes: &[u8]) -> Hmac<Sha256> {
    let mut mac = hmac(key);
    for part in [engine.as_bytes(), component_sha256.as_bytes()] {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac.update(bytes);
    mac
}

fn verify(key: &[u8; 32], engine: &str, component_sha256: &str, bytes: &[u8], mac: &str) -> bool {
    let Some(expected) = keys::digest_from_hex(mac) else { return false };
    tag(key, engine, component_sha256, bytes).verify_slice(&expected).is_ok()
}

fn hmac(key: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length.
    <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC accepts every key length"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "the cluster's artifact key, 32 characters or more";

    #[test]
    fn a_shared_artifact_is_trusted_only_as_sealed_by_the_same_secret() {
        let key = ArtifactKey::derive(SECRET);
        let sealed = key.seal("engine-a", "c0ffee", b"native code".to_vec());
        assert!(key.verify("c0ffee", &sealed));
        assert!(ArtifactKey::derive(SECRET).verify("c0ffee", &sealed), "every node derives the same key");
        assert!(!ArtifactKey::derive("another secret, also 32 characters").verify("c0ffee", &sealed), "another secret");
        assert!(!key.verify("c0ffef", &sealed), "the artifact of another component");
        let tampered = |change: &dyn Fn(&mut SharedArtifact)| {
            let mut copy = sealed.clone();
            change(&mut copy);
            key.verify("c0ffee", &copy)
        };
        assert!(!tampered(&|a| a.bytes[0] ^= 1), "changed code");
        assert!(!tampered(&|a| a.bytes.push(0)), "code appended");
        assert!(!tampered(&|a| a.engine = "engine-b".into()), "relabelled for another engine");
        assert!(!tampered(&|a| a.mac = "00".repeat(32)), "a made-up MAC");
        assert!(!tampered(&|a| a.mac = "not hex".into()), "not a MAC at all");
    }

    /// What the gateway sealed before `--artifact-key` existed: a key
    /// derived from the admin token under the v1 label. Whoever holds the
    /// admin token can compute it.
    fn sealed_with_the_admin_token(admin_token: &str, engine: &str, component: &str, bytes: &[u8]) -> SharedArtifact {
        let v1 = derive(admin_token.as_bytes(), b"facegate shared artifact key v1");
        SharedArtifact {
            engine: engine.into(),
            bytes: bytes.to_vec(),
            mac: keys::hex(&tag(&v1, engine, component, bytes).finalize().into_bytes()),
        }
    }

    #[test]
    fn what_the_admin_token_seals_is_refused() {
        let admin_token = "test-admin-token-0123456789";
        let forged = sealed_with_the_admin_token(admin_token, "engine-a", "c0ffee", b"attacker's code");
        assert!(!ArtifactKey::derive(SECRET).verify("c0ffee", &forged), "the old derivation");
        let today = ArtifactKey::derive(admin_token).seal("engine-a", "c0ffee", b"attacker's code".to_vec());
        assert_ne!(today.mac, forged.mac, "a new label: even a key equal to the old token derives another key");
        assert!(!ArtifactKey::derive(SECRET).verify("c0ffee", &today), "the admin token as if it were the artifact key");
    }

    #[test]
    fn the_cache_key_is_its_own_and_kept_in_the_data_directory() {
        let dir = std::env::temp_dir().join(format!("facegate-seal-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let key = CacheKey::in_data_dir(&dir).unwrap();
        let path = dir.join(CACHE_KEY_FILE);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600, "only the owner reads it");
        }
        let mac = key.tag("e1", "aa", b"code");
        assert!(CacheKey::in_data_dir(&dir).unwrap().verify("e1", "aa", b"code", &mac), "created once, then reused");
        assert!(!key.verify("e1", "ab", b"code", &mac), "another component");
        std::fs::write(&path, "garbage").unwrap();
        assert!(!CacheKey::in_data_dir(&dir).unwrap().verify("e1", "aa", b"code", &mac), "a broken key file is replaced");
        let derived = ArtifactKey::derive(SECRET);
        let shared = derived.seal("e1", "aa", b"code".to_vec());
        assert!(!derived.cache_key().verify("e1", "aa", b"code", &shared.mac), "a shared MAC is not a cache MAC");
        assert!(ArtifactKey::derive(SECRET).cache_key().verify("e1", "aa", b"code", &derived.cache_key().tag("e1", "aa", b"code")));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
