//! API keys and the admin token. A key reads `fg_<id>_<secret>`: the id is
//! public (listed, used to revoke), the secret is 256 random bits of which
//! only the SHA-256 is stored. Comparisons run in constant time. Secrets
//! this node writes (key files, the cache key) are readable by their owner only.

use std::path::Path;

use anyhow::{Context, anyhow};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Hex characters of a key id (6 random bytes).
const ID_HEX: usize = 12;
/// Hex characters of a key secret (32 random bytes).
const SECRET_HEX: usize = 64;

/// A freshly generated key: shown to its owner once, stored only as `secret_sha256`.
#[derive(Debug, Clone)]
pub struct NewKey {
    /// Public identifier.
    pub id: String,
    /// The full key the client sends as `Authorization: Bearer <key>`.
    pub key: String,
    /// SHA-256 of the secret part, hex.
    pub secret_sha256: String,
}

/// What a key may do: `invoke` its tenant's handlers (every key before
/// scopes existed, and the default), `deploy` them (upload, list, activate,
/// roll back; create and revoke the tenant's `invoke` keys) and `read` its
/// tenant's versions and usage. Stored as the names, comma-separated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Scopes(u8);

impl Scopes {
    /// Calls the tenant's handlers.
    pub const INVOKE: Self = Self(1);
    /// Manages the tenant's handlers and its `invoke` keys.
    pub const DEPLOY: Self = Self(2);
    /// Reads the tenant's handlers, versions and usage.
    pub const READ: Self = Self(4);
    const NAMES: [(Self, &'static str); 3] = [(Self::INVOKE, "invoke"), (Self::DEPLOY, "deploy"), (Self::READ, "read")];

    /// Whether every scope of `other` is in these.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether any scope of `other` is in these.
    pub fn any(self, other: Self) -> bool {
        self.0 & other.0 != 0
    }

    /// Both sets.
    pub fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// Parses `invoke,deploy,read` (any of them, any order, at least one);
    /// an unknown name is an error naming it.
    pub fn parse(names: &str) -> Result<Self, String> {
        let mut scopes = Self(0);
        for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let Some((scope, _)) = Self::NAMES.iter().find(|(_, n)| *n == name) else {
                return Err(format!("unknown scope {name:?}: the scopes are invoke, deploy and read"));
            };
            scopes = scopes.with(*scope);
        }
        if scopes.0 == 0 {
            return Err("a key needs at least one scope (invoke, deploy, read)".into());
        }
        Ok(scopes)
    }

    /// The scopes a stored value names; names this build does not know
    /// grant nothing.
    pub fn from_stored(names: &str) -> Self {
        let known = names.split(',').filter_map(|n| Self::NAMES.iter().find(|(_, name)| *name == n.trim()).map(|(s, _)| *s));
        known.fold(Self(0), Self::with)
    }

    /// The names, in a fixed order.
    pub fn names(self) -> Vec<&'static str> {
        Self::NAMES.iter().filter(|(s, _)| self.contains(*s)).map(|(_, n)| *n).collect()
    }
}

impl Default for Scopes {
    /// `invoke`, what every key could do before scopes.
    fn default() -> Self {
        Self::INVOKE
    }
}

impl std::fmt::Display for Scopes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.names().join(","))
    }
}

impl serde::Serialize for Scopes {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.names())
    }
}

/// Generates a new key from the operating system's randomness.
pub fn generate() -> anyhow::Result<NewKey> {
    let id = hex(&random::<{ ID_HEX / 2 }>()?);
    let secret = hex(&random::<{ SECRET_HEX / 2 }>()?);
    Ok(NewKey { key: format!("fg_{id}_{secret}"), secret_sha256: sha256_hex(secret.as_bytes()), id })
}

/// Splits a key into `(id, secret)`; `None` when it is not shaped like one.
pub fn parse(key: &str) -> Option<(&str, &str)> {
    let (id, secret) = key.strip_prefix("fg_")?.split_once('_')?;
    let hex_of = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hex_of(id, ID_HEX) && hex_of(secret, SECRET_HEX)).then_some((id, secret))
}

/// Whether `secret` hashes to `stored` (hex SHA-256), in constant time.
pub fn secret_matches(secret: &str, stored: &[u8; 32]) -> bool {
    Sha256::digest(secret.as_bytes()).as_slice().ct_eq(stored).into()
}

/// Whether `given` equals `expected`, without leaking where they differ.
pub fn token_matches(given: &str, expected: &str) -> bool {
    Sha256::digest(given.as_bytes()).as_slice().ct_eq(Sha256::digest(expected.as_bytes()).as_slice()).into()
}

/// Decodes a 64-character hex digest.
pub fn digest_from_hex(hex: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    if hex.len() != 64 {
        return None;
    }
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// `N` bytes from the operating system's randomness.
pub fn random<const N: usize>() -> anyhow::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| anyhow!("no system randomness: {e}"))?;
    Ok(bytes)
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of `bytes`, lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Writes a secret to a new file readable by its owner only.
pub fn write_secret(path: &Path, secret: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let _ = std::fs::remove_file(path);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path).with_context(|| format!("cannot write {}", path.display()))?;
    writeln!(file, "{secret}")?;
    file.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_parse_print_and_store() {
        let both = Scopes::parse("read, deploy").unwrap();
        assert!(both.contains(Scopes::DEPLOY) && both.contains(Scopes::READ) && !both.contains(Scopes::INVOKE));
        assert_eq!(both.to_string(), "deploy,read");
        assert_eq!(Scopes::from_stored(&both.to_string()), both);
        assert_eq!(Scopes::default().to_string(), "invoke", "old keys invoke");
        assert!(Scopes::parse("admin").unwrap_err().contains("\"admin\""));
        assert!(Scopes::parse(" , ").is_err());
        assert_eq!(Scopes::from_stored("invoke,future"), Scopes::INVOKE, "an unknown stored scope grants nothing");
        assert!(both.any(Scopes::READ.with(Scopes::INVOKE)) && !both.any(Scopes::INVOKE));
    }

    #[test]
    fn generated_keys_parse_and_only_their_secret_matches() {
        let a = generate().unwrap();
        let b = generate().unwrap();
        assert_ne!(a.key, b.key);
        let (id, secret) = parse(&a.key).unwrap();
        assert_eq!(id, a.id);
        let stored = digest_from_hex(&a.secret_sha256).unwrap();
        assert!(secret_matches(secret, &stored));
        let (_, other) = parse(&b.key).unwrap();
        assert!(!secret_matches(other, &stored));
        assert!(!a.key.contains(&a.secret_sha256), "the stored hash is not the secret");
    }

    #[test]
    fn malformed_keys_do_not_parse() {
        for bad in ["", "fg_", "Bearer x", "fg_0123456789ab", "fg_0123456789ab_short", &format!("fg_zz23456789ab_{}", "0".repeat(64))] {
            assert!(parse(bad).is_none(), "{bad:?}");
        }
        assert!(parse(&format!("fg_0123456789ab_{}", "a".repeat(64))).is_some());
    }

    #[test]
    fn tokens_compare_by_value() {
        assert!(token_matches("secret-token", "secret-token"));
        assert!(!token_matches("secret-token", "secret-tokeN"));
        assert!(!token_matches("", "secret-token"));
    }
}
