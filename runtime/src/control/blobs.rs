//! Files under a data directory: component bytes of the SQLite store,
//! content-addressed by SHA-256, and every node's own cache of precompiled
//! artifacts ([`ArtifactCache`]), each with a `.mac` file beside it that
//! seals it under the node's [`CacheKey`]. Every file is written to `tmp/`,
//! fsynced and renamed into place, so a reader never sees a partial file;
//! `tmp/` is emptied at start (leftovers of a write that was interrupted).
//! The directory itself is checked at start ([`prepare_data_dir`]): this
//! user's own, and closed to everyone else.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use super::keys::{hex, random, sha256_hex};
use super::seal::CacheKey;

/// The data directory's mode: the artifacts in it become native code, and
/// key files live there.
const DATA_DIR_MODE: u32 = 0o700;

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

/// This node's cache of precompiled artifacts,
/// `compiled/<component sha256>-<engine id>.cwasm`, each sealed by a `.mac`
/// file beside it (hex HMAC-SHA256 under the node's [`CacheKey`]). An
/// artifact is native code the node loads through `unsafe`
/// deserialisation, so one is used only if its MAC holds: whoever can
/// write the directory but lacks the key cannot make the node run code.
#[derive(Debug, Clone)]
pub struct ArtifactCache {
    blobs: Blobs,
    key: CacheKey,
}

/// A cached artifact that is there but whose MAC does not hold: changed
/// on disk, or sealed under another key.
#[derive(Debug, thiserror::Error)]
#[error("the cached artifact {path} is not sealed by this node's cache key (changed on disk, or written under another key)")]
pub struct Unsealed {
    /// The artifact's file.
    pub path: PathBuf,
}

impl ArtifactCache {
    /// The cache under `blobs`' data directory, sealed with `key`.
    pub fn new(blobs: Blobs, key: CacheKey) -> Self {
        Self { blobs, key }
    }

    /// The data directory's files.
    pub fn blobs(&self) -> &Blobs {
        &self.blobs
    }

    /// Caches a precompiled artifact: its old MAC goes first, then the
    /// artifact, then its new MAC, so an interrupted write leaves an
    /// artifact without a MAC (not used) rather than one with a stale MAC.
    pub fn put(&self, component_sha: &str, engine: &str, bytes: &[u8]) -> anyhow::Result<()> {
        let path = self.path(component_sha, engine);
        let mac = mac_path(&path);
        match fs::remove_file(&mac) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("cannot remove {}", mac.display()));
            }
            _ => {}
        }
        self.blobs.write_atomic(&path, bytes)?;
        self.blobs.write_atomic(&mac, self.key.tag(engine, component_sha, bytes).as_bytes())?;
        // The hash file an earlier version's cache kept beside it, which nothing trusts now.
        let _ = fs::remove_file(path.with_extension("sha256"));
        Ok(())
    }

    /// A cached artifact whose MAC holds; `Ok(None)` when there is none
    /// (or no MAC beside it: an interrupted write, or a cache of an older
    /// version). An [`Unsealed`] error (in the chain) when the MAC does not hold.
    pub fn get(&self, component_sha: &str, engine: &str) -> anyhow::Result<Option<Vec<u8>>> {
        let path = self.path(component_sha, engine);
        let mac = match fs::read_to_string(mac_path(&path)) {
            Ok(mac) => mac,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", mac_path(&path).display())),
        };
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        if !self.key.verify(engine, component_sha, &bytes, mac.trim()) {
            return Err(Unsealed { path }.into());
        }
        Ok(Some(bytes))
    }

    /// Removes a cached artifact and its MAC (best effort: a later
    /// [`Self::put`] replaces them anyway).
    pub fn discard(&self, component_sha: &str, engine: &str) {
        let path = self.path(component_sha, engine);
        for file in [mac_path(&path), path] {
            if let Err(e) = fs::remove_file(&file)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %file.display(), error = %e, "cannot remove a refused artifact");
            }
        }
    }

    /// Where the artifact of a component, compiled by an engine with this identity, lives.
    pub fn path(&self, component_sha: &str, engine: &str) -> PathBuf {
        self.blobs.artifact_path(component_sha, engine)
    }
}

fn mac_path(artifact: &Path) -> PathBuf {
    artifact.with_extension("mac")
}

/// Makes `dir` fit to be a data directory, before anything is read from it:
/// created with mode 0700 when missing; refused when another user owns it
/// (they could change the artifacts this node loads as native code); its
/// group and other permission bits cleared, with a warning, when any is set
/// (an `emptyDir` volume is 0777, a directory made under the usual umask 0755).
pub fn prepare_data_dir(dir: &Path) -> anyhow::Result<()> {
    let meta = match fs::metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return create_private_dir(dir),
        Err(e) => return Err(e).with_context(|| format!("cannot read the data directory {}", dir.display())),
    };
    anyhow::ensure!(meta.is_dir(), "the data directory {} is not a directory", dir.display());
    check_owner(dir, &meta)?;
    tighten_mode(dir, &meta)
}

fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    use std::os::unix::fs::DirBuilderExt;
    let mut builder = fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    builder.mode(DATA_DIR_MODE);
    builder.create(dir).with_context(|| format!("cannot create the data directory {}", dir.display()))
}

/// Refuses a directory another user owns (Linux: the effective user).
fn check_owner(dir: &Path, meta: &fs::Metadata) -> anyhow::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        let me = rustix::process::geteuid().as_raw();
        if meta.uid() != me {
            bail!(
                "the data directory {} belongs to uid {}, but facegate runs as uid {me}: another user could change \
                 the compiled handlers it loads. Give it a directory of its own (it creates a missing one, mode 0700; \
                 on Kubernetes a subdirectory of the volume), or chown this one to uid {me}",
                dir.display(),
                meta.uid()
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (dir, meta);
    Ok(())
}

/// Clears the group and other bits of the directory's mode, with a warning.
fn tighten_mode(dir: &Path, meta: &fs::Metadata) -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            fs::set_permissions(dir, fs::Permissions::from_mode(DATA_DIR_MODE))
                .with_context(|| format!("cannot restrict the data directory {} to its owner (mode 0700)", dir.display()))?;
            tracing::warn!(dir = %dir.display(), was = %format!("{mode:04o}"), "the data directory was open to other users; its mode is now 0700");
        }
    }
    #[cfg(not(unix))]
    let _ = (dir, meta);
    Ok(())
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

    fn cache(dir: &Path) -> ArtifactCache {
        fs::create_dir_all(dir).unwrap();
        ArtifactCache::new(Blobs::open(dir).unwrap(), CacheKey::in_data_dir(dir).unwrap())
    }

    fn refused(cache: &ArtifactCache, component: &str, engine: &str) -> bool {
        cache.get(component, engine).is_err_and(|e| e.downcast_ref::<Unsealed>().is_some())
    }

    #[test]
    fn cached_artifacts_load_only_under_their_mac() {
        let dir = temp_dir("artifact");
        let cache = cache(&dir);
        assert!(cache.get("aa", "e1").unwrap().is_none(), "nothing cached yet");
        cache.put("aa", "e1", b"native code").unwrap();
        cache.put("bb", "e1", b"other code").unwrap();
        assert_eq!(cache.get("aa", "e1").unwrap().unwrap(), b"native code");
        assert!(cache.get("aa", "0ee").unwrap().is_none(), "keyed by the engine");
        assert!(cache.path("../../etc/passwd", "e1").starts_with(dir.join("compiled")), "no path escapes the cache");

        fs::write(cache.path("aa", "e1"), b"native cod3").unwrap();
        assert!(refused(&cache, "aa", "e1"), "a changed artifact");
        // Another component's artifact with its MAC, both copied over: the MAC names its component.
        fs::copy(cache.path("bb", "e1"), cache.path("aa", "e1")).unwrap();
        fs::copy(mac_path(&cache.path("bb", "e1")), mac_path(&cache.path("aa", "e1"))).unwrap();
        assert!(refused(&cache, "aa", "e1"), "another component's sealed artifact");
        // What the cache of an earlier version trusted: a hash beside it, which anyone can write.
        fs::remove_file(mac_path(&cache.path("aa", "e1"))).unwrap();
        fs::write(cache.path("aa", "e1").with_extension("sha256"), sha256_hex(b"other code")).unwrap();
        assert!(cache.get("aa", "e1").unwrap().is_none(), "no MAC: not cached");

        cache.put("aa", "e1", b"native code").unwrap();
        let other_node = ArtifactCache::new(Blobs::open(&dir).unwrap(), crate::control::ArtifactKey::derive(&"k".repeat(32)).cache_key());
        assert!(refused(&other_node, "aa", "e1"), "sealed under another key");
        cache.discard("aa", "e1");
        assert!(cache.get("aa", "e1").unwrap().is_none(), "discarded");
        assert!(!cache.path("aa", "e1").exists() && !mac_path(&cache.path("aa", "e1")).exists());
        fs::remove_dir_all(dir).unwrap();
    }

    #[cfg(unix)]
    fn mode(dir: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        fs::metadata(dir).unwrap().permissions().mode() & 0o7777
    }

    #[cfg(unix)]
    #[test]
    fn the_data_dir_is_created_private_and_an_open_one_is_tightened() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("mode");
        prepare_data_dir(&dir.join("data")).unwrap();
        assert_eq!(mode(&dir.join("data")), 0o700, "created 0700");
        for open in [0o777, 0o755, 0o2770, 0o701] {
            fs::set_permissions(dir.join("data"), fs::Permissions::from_mode(open)).unwrap();
            prepare_data_dir(&dir.join("data")).unwrap();
            assert_eq!(mode(&dir.join("data")), 0o700, "{open:o} tightened");
        }
        fs::write(dir.join("file"), b"").unwrap();
        assert!(prepare_data_dir(&dir.join("file")).unwrap_err().to_string().contains("not a directory"));
        fs::remove_dir_all(dir).unwrap();
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_data_dir_of_another_user_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("owner");
        fs::create_dir_all(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
        let me = rustix::process::geteuid().as_raw();
        // Root can give it away; anyone else finds one of root's.
        let foreign = if me == 0 {
            std::os::unix::fs::chown(&dir, Some(65_534), None).unwrap();
            dir.clone()
        } else {
            PathBuf::from("/")
        };
        let error = prepare_data_dir(&foreign).unwrap_err().to_string();
        assert!(error.contains("belongs to uid") && error.contains(&format!("runs as uid {me}")), "{error}");
        if me == 0 {
            assert_eq!(mode(&dir), 0o777, "refused before anything is changed");
        }
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
