//! Files under a data directory: component bytes of the SQLite store,
//! content-addressed by SHA-256, and every node's own cache of precompiled
//! artifacts, each with a `.sha256` file beside it that names its hash.
//! Every file is written to `tmp/`, fsynced and renamed into place, so a
//! reader never sees a partial file; `tmp/` is emptied at start (leftovers
//! of a write that was interrupted).

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use super::keys::{hex, random, sha256_hex};

/// The blob directories under a data directory.
#[derive(Debug, Clone)]
pub struct Blobs {
    root: PathBuf,
}

impl Blobs {
    /// Opens (creating) the blob directories under `data_dir`, without touching `tmp/`.
    pub fn open(data_dir: &Path) -> anyhow::Result<Self> {
        let blobs = Self { root: data_dir.to_owned() };
        for dir in [blobs.components_dir(), blobs.compiled_dir(), blobs.tmp_dir()] {
            fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        Ok(blobs)
    }

    /// Removes what interrupted writes left in `tmp/`; returns how many files.
    pub fn clear_tmp(&self) -> anyhow::Result<usize> {
        let leftovers = self.tmp_files()?;
        for path in &leftovers {
            fs::remove_file(path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
        Ok(leftovers.len())
    }

    /// Files in `tmp/` (interrupted writes; never served).
    pub fn tmp_files(&self) -> anyhow::Result<Vec<PathBuf>> {
        Ok(fs::read_dir(self.tmp_dir())?.filter_map(|e| e.ok().map(|e| e.path())).collect())
    }

    /// Stores component bytes whose SHA-256 (hex) the caller computed.
    pub fn put_component(&self, sha: &str, bytes: &[u8]) -> anyhow::Result<()> {
        let path = self.component_path(sha);
        if self.read_verified(&path, sha).is_err() {
            self.write_atomic(&path, bytes)?;
        }
        Ok(())
    }

    /// Caches a precompiled artifact: the artifact, then the file naming its hash.
    pub fn put_artifact(&self, component_sha: &str, engine: &str, bytes: &[u8]) -> anyhow::Result<()> {
        let path = self.artifact_path(component_sha, engine);
        self.write_atomic(&path, bytes)?;
        self.write_atomic(&path.with_extension("sha256"), sha256_hex(bytes).as_bytes())
    }

    /// A cached artifact, if present and intact.
    pub fn artifact(&self, component_sha: &str, engine: &str) -> anyhow::Result<Option<Vec<u8>>> {
        let path = self.artifact_path(component_sha, engine);
        let Ok(sha) = fs::read_to_string(path.with_extension("sha256")) else { return Ok(None) };
        self.read_verified(&path, sha.trim()).map(Some)
    }

    /// Reads a file and checks it hashes to `sha`.
    pub fn read_verified(&self, path: &Path, sha: &str) -> anyhow::Result<Vec<u8>> {
        let bytes = fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let actual = sha256_hex(&bytes);
        if actual != sha {
            bail!("{} is corrupt: sha256 {actual}, expected {sha}", path.display());
        }
        Ok(bytes)
    }

    /// Where a component with this hash lives. A name that is not a SHA-256
    /// in hex (from a damaged or hostile database row) maps to a path that
    /// never exists, never outside the directory.
    pub fn component_path(&self, sha: &str) -> PathBuf {
        self.components_dir().join(format!("{}.wasm", hex_name(sha)))
    }

    /// Where the artifact of a component, compiled by an engine with this identity, lives.
    pub fn artifact_path(&self, component_sha: &str, engine: &str) -> PathBuf {
        self.compiled_dir().join(format!("{}-{}.cwasm", hex_name(component_sha), hex_name(engine)))
    }

    fn components_dir(&self) -> PathBuf {
        self.root.join("components")
    }

    fn compiled_dir(&self) -> PathBuf {
        self.root.join("compiled")
    }

    fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// temp file → write → fsync → rename → fsync the directory.
    fn write_atomic(&self, dest: &Path, bytes: &[u8]) -> anyhow::Result<()> {
        let tmp = self.tmp_dir().join(hex(&random::<8>()?));
        let result = (|| {
            let mut file = File::create(&tmp)?;
            file.write_all(bytes)?;
            file.sync_all()?;
            fs::rename(&tmp, dest)?;
            sync_dir(dest.parent().unwrap_or(Path::new(".")))
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result.with_context(|| format!("cannot write {}", dest.display()))
    }
}

/// `name` if it is lower-case hex (a hash, an engine id), else a name no file has.
fn hex_name(name: &str) -> &str {
    if !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        name
    } else {
        "invalid-name"
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("facegate-blobs-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn components_are_content_addressed_and_verified() {
        let dir = temp_dir("ca");
        let blobs = Blobs::open(&dir).unwrap();
        let sha = sha256_hex(b"bytes");
        blobs.put_component(&sha, b"bytes").unwrap();
        blobs.put_component(&sha, b"bytes").unwrap();
        let path = blobs.component_path(&sha);
        assert_eq!(blobs.read_verified(&path, &sha).unwrap(), b"bytes");
        fs::write(&path, b"bytez").unwrap();
        assert!(blobs.read_verified(&path, &sha).unwrap_err().to_string().contains("corrupt"));
        blobs.put_component(&sha, b"bytes").unwrap();
        assert_eq!(blobs.read_verified(&path, &sha).unwrap(), b"bytes", "a corrupt blob is rewritten");
        assert!(blobs.tmp_files().unwrap().is_empty(), "no temp file left behind");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn cached_artifacts_are_checked_against_their_recorded_hash() {
        let dir = temp_dir("artifact");
        let blobs = Blobs::open(&dir).unwrap();
        assert!(blobs.artifact("aa", "e1").unwrap().is_none(), "nothing cached yet");
        blobs.put_artifact("aa", "e1", b"native code").unwrap();
        assert_eq!(blobs.artifact("aa", "e1").unwrap().unwrap(), b"native code");
        assert!(blobs.artifact("aa", "0ee").unwrap().is_none(), "keyed by the engine");
        assert!(blobs.artifact_path("../../etc/passwd", "e1").starts_with(dir.join("compiled")), "no path escapes the cache");
        fs::write(blobs.artifact_path("aa", "e1"), b"native cod3").unwrap();
        assert!(blobs.artifact("aa", "e1").is_err(), "a changed artifact is refused");
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn leftovers_of_interrupted_writes_are_cleared() {
        let dir = temp_dir("tmp");
        let blobs = Blobs::open(&dir).unwrap();
        fs::write(dir.join("tmp/partial"), b"half").unwrap();
        assert_eq!(blobs.clear_tmp().unwrap(), 1);
        assert!(blobs.tmp_files().unwrap().is_empty());
        fs::remove_dir_all(dir).unwrap();
    }
}
