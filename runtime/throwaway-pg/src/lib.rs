//! A throw-away PostgreSQL server for tests: `initdb` in a
//! temporary directory, `pg_ctl start` on a free port, removed on drop. Uses
//! the server binaries Debian's `postgresql-15` installs (or any found by
//! `pg_config --bindir`). As root, the server runs as the `postgres` user
//! (PostgreSQL refuses to run as root).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, bail};

/// A running throw-away server (see the module docs).
pub struct ThrowawayPostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    run_as: Option<String>,
    /// Server settings beyond the port and socket (TLS).
    settings: String,
}

impl ThrowawayPostgres {
    /// Creates a cluster in a new temporary directory and starts it.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with_tls(None)
    }

    /// As [`start`](Self::start), also accepting TLS with this certificate
    /// chain and key (PEM) when given (plain connections stay allowed).
    pub fn start_with_tls(tls: Option<(&str, &str)>) -> anyhow::Result<Self> {
        let bin = find_bin_dir()?;
        let dir = std::env::temp_dir().join(format!("facegate-pg-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir)?;
        let run_as = if rustix::process::geteuid().is_root() { Some("postgres".to_owned()) } else { None };
        if run_as.is_some() {
            let status = Command::new("chown").args(["-R", "postgres:postgres"]).arg(&dir).status()?;
            anyhow::ensure!(status.success(), "cannot give {} to the postgres user", dir.display());
        }
        let port = free_port()?;
        let mut server = Self { bin, dir, port, run_as, settings: String::new() };
        server.run("initdb", &["-D", &server.data(), "-U", "facegate", "--auth=trust", "-E", "UTF8", "--no-sync"])?;
        if let Some((cert, key)) = tls {
            server.install_tls(cert, key)?;
        }
        server.start_again()?;
        server.reap_with_this_process()?;
        Ok(server)
    }

    /// A watcher that stops the server and removes its directory once this
    /// process is gone, however it ends (a server in a `static` is never
    /// dropped; a test binary may abort).
    fn reap_with_this_process(&self) -> anyhow::Result<()> {
        let pg_ctl = self.bin.join("pg_ctl");
        let stop = match &self.run_as {
            Some(user) => format!("runuser -u {user} -- '{}' -D '{}' -m immediate stop", pg_ctl.display(), self.data()),
            None => format!("'{}' -D '{}' -m immediate stop", pg_ctl.display(), self.data()),
        };
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 1; done; {stop} >/dev/null 2>&1; rm -rf '{dir}'",
            pid = std::process::id(),
            dir = self.dir.display()
        );
        Command::new("sh")
            .args(["-c", &script])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("cannot start the server's watcher")?;
        Ok(())
    }

    /// The URL the gateway takes as `--store`.
    pub fn url(&self) -> String {
        format!("postgres://facegate@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server (fast shutdown: sessions are closed).
    pub fn stop(&self) -> anyhow::Result<()> {
        self.run("pg_ctl", &["-D", &self.data(), "-m", "fast", "-w", "stop"]).map(drop)
    }

    /// Starts it (again) on the same port, waiting until it accepts connections.
    pub fn start_again(&self) -> anyhow::Result<()> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200{}",
            self.port,
            self.dir.display(),
            self.settings
        );
        let log = self.dir.join("server.log").display().to_string();
        self.run("pg_ctl", &["-D", &self.data(), "-o", &options, "-l", &log, "-w", "-t", "30", "start"]).map(drop)
    }

    /// Writes the certificate and key into the data directory (the key
    /// private to the server's user, as PostgreSQL insists) and turns TLS on.
    fn install_tls(&mut self, cert: &str, key: &str) -> anyhow::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let data = self.dir.join("data");
        std::fs::write(data.join("server.crt"), cert)?;
        std::fs::write(data.join("server.key"), key)?;
        std::fs::set_permissions(data.join("server.key"), std::fs::Permissions::from_mode(0o600))?;
        if self.run_as.is_some() {
            let status = Command::new("chown").args(["postgres:postgres", "server.crt", "server.key"]).current_dir(&data).status()?;
            anyhow::ensure!(status.success(), "cannot give the TLS files to the postgres user");
        }
        self.settings = " -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key".to_owned();
        Ok(())
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    fn run(&self, program: &str, args: &[&str]) -> anyhow::Result<Output> {
        let program = self.bin.join(program);
        let mut command = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        let output = command.args(args).current_dir(&self.dir).output().with_context(|| format!("cannot run {}", program.display()))?;
        if !output.status.success() {
            let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
            bail!("{} {args:?} failed: {}\n{}", program.display(), String::from_utf8_lossy(&output.stderr), log);
        }
        Ok(output)
    }
}

impl Drop for ThrowawayPostgres {
    fn drop(&mut self) {
        let _ = self.run("pg_ctl", &["-D", &self.data(), "-m", "immediate", "-w", "stop"]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The server binaries: `pg_config --bindir`, else the newest /usr/lib/postgresql/*/bin.
fn find_bin_dir() -> anyhow::Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|dir| dir.filter_map(Result::ok).map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    candidates.sort_by_key(|p| p.parent().and_then(Path::file_name).and_then(|v| v.to_str()).and_then(|v| v.parse::<u32>().ok()));
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        candidates.insert(0, PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    }
    candidates
        .into_iter()
        .rev()
        .find(|dir| dir.join("initdb").exists() && dir.join("pg_ctl").exists())
        .context("no PostgreSQL server binaries (initdb, pg_ctl): install Debian's postgresql-15 (deploy/test.sh does)")
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
