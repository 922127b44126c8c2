//! The secrets key: what the store keeps of tenants' secrets (a registry's
//! password) is sealed with it, ChaCha20-Poly1305 under a random nonce,
//! bound to what it belongs to (the AEAD's associated data), so a sealed
//! value copied to another row does not open. The key is the operator's:
//! `FACEGATE_SECRETS_KEY` (64 hex digits) or `--secrets-key-file`, the
//! same on every node of a cluster; a single node without one keeps a
//! random key in its data directory ([`SECRETS_KEY_FILE`], mode 0600). It
//! is neither the admin token nor the artifact key.

use std::path::Path;

use anyhow::Context;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};

use super::keys;

/// The file a single node keeps its generated secrets key in.
pub const SECRETS_KEY_FILE: &str = "secrets.key";

/// The bytes of a nonce, written before each sealed value.
const NONCE_BYTES: usize = 12;

/// A 256-bit key sealing secrets at rest. Its `Debug` shows its fingerprint only.
#[derive(Clone)]
pub struct SecretsKey([u8; 32]);

impl std::fmt::Debug for SecretsKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretsKey({})", self.fingerprint())
    }
}

/// A sealed value that does not open: another key sealed it, or it was altered.
#[derive(Debug, thiserror::Error)]
#[error("a stored secret cannot be opened with this node's secrets key (another key sealed it, or it was altered)")]
pub struct Unopenable;

impl SecretsKey {
    /// A key from 64 hex digits (`openssl rand -hex 32`); `what` names its
    /// origin in the error.
    pub fn from_hex(text: &str, what: &str) -> anyhow::Result<Self> {
        keys::digest_from_hex(text.trim())
            .map(Self)
            .with_context(|| format!("{what} is not a secrets key: it must be 64 hex digits (openssl rand -hex 32)"))
    }

    /// The key in `path`, which must exist and hold one.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read the secrets key file {}", path.display()))?;
        Self::from_hex(&text, &format!("the secrets key file {}", path.display()))
    }

    /// The key kept in `data_dir` ([`SECRETS_KEY_FILE`]), created at the
    /// first start; a file that does not hold one is an error, never
    /// replaced (the secrets it sealed would be lost).
    pub fn in_data_dir(data_dir: &Path) -> anyhow::Result<Self> {
        let path = data_dir.join(SECRETS_KEY_FILE);
        if path.exists() {
            return Self::from_file(&path);
        }
        let key = keys::random::<32>()?;
        keys::write_secret(&path, &keys::hex(&key))?;
        tracing::info!(path = %path.display(), "generated the secrets key (keep it with the store's backups)");
        Ok(Self(key))
    }

    /// A short name of the key for logs (never the key).
    pub fn fingerprint(&self) -> String {
        use sha2::Digest;
        let digest = sha2::Sha256::new().chain_update(b"facegate secrets key\0").chain_update(self.0).finalize();
        keys::hex(&digest[..4])
    }

    /// `plaintext` sealed for `context` (what it belongs to: opened only with the same).
    pub fn seal(&self, context: &[u8], plaintext: &[u8]) -> anyhow::Result<Vec<u8>> {
        let nonce = keys::random::<NONCE_BYTES>()?;
        let cipher = ChaCha20Poly1305::new(Key::from_slice(&self.0));
        let sealed = cipher
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: plaintext, aad: context })
            .map_err(|_| anyhow::anyhow!("sealing a secret failed"))?;
        Ok([nonce.as_slice(), &sealed].concat())
    }

    /// What [`seal`](Self::seal) sealed for `context`.
    pub fn open(&self, context: &[u8], sealed: &[u8]) -> Result<Vec<u8>, Unopenable> {
        if sealed.len() < NONCE_BYTES {
            return Err(Unopenable);
        }
        let (nonce, ciphertext) = sealed.split_at(NONCE_BYTES);
        let cipher = ChaCha20Poly1305::new(Key::from_slice(&self.0));
        cipher.decrypt(Nonce::from_slice(nonce), Payload { msg: ciphertext, aad: context }).map_err(|_| Unopenable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_secret_opens_with_its_key_and_context_only() {
        let key = SecretsKey::from_hex(&"ab".repeat(32), "test").unwrap();
        let sealed = key.seal(b"acme\0ghcr.io", b"hunter2").unwrap();
        assert!(!sealed.windows(7).any(|w| w == b"hunter2"), "not in clear");
        assert_eq!(key.open(b"acme\0ghcr.io", &sealed).unwrap(), b"hunter2");
        assert!(key.open(b"globex\0ghcr.io", &sealed).is_err(), "another tenant's row does not open it");
        let other = SecretsKey::from_hex(&"cd".repeat(32), "test").unwrap();
        assert!(other.open(b"acme\0ghcr.io", &sealed).is_err(), "another key does not");
        let mut altered = sealed.clone();
        altered[20] ^= 1;
        assert!(key.open(b"acme\0ghcr.io", &altered).is_err());
        assert_ne!(key.seal(b"c", b"x").unwrap(), key.seal(b"c", b"x").unwrap(), "a fresh nonce each time");
        assert!(!format!("{key:?}").contains("abab"));
    }

    #[test]
    fn a_wrong_or_missing_key_is_a_clear_error() {
        let e = SecretsKey::from_hex("short", "FACEGATE_SECRETS_KEY").unwrap_err().to_string();
        assert!(e.contains("FACEGATE_SECRETS_KEY") && e.contains("64 hex digits"), "{e}");
        let dir = std::env::temp_dir().join(format!("facegate-secrets-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let e = SecretsKey::from_file(&dir.join("none.key")).unwrap_err().to_string();
        assert!(e.contains("none.key"), "{e}");
        let made = SecretsKey::in_data_dir(&dir).unwrap();
        assert_eq!(SecretsKey::in_data_dir(&dir).unwrap().fingerprint(), made.fingerprint(), "kept, not made again");
        std::fs::write(dir.join(SECRETS_KEY_FILE), "garbage").unwrap();
        assert!(SecretsKey::in_data_dir(&dir).unwrap_err().to_string().contains("secrets.key"), "never replaced");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
