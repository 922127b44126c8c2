//! API keys and the admin token. A key reads `fg_<id>_<secret>`: the id is
//! public (listed, used to revoke), the secret is 256 random bits of which
//! only the SHA-256 is stored. Comparisons run in constant time.

use anyhow::anyhow;
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

#[cfg(test)]
mod tests {
    use super::*;

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
