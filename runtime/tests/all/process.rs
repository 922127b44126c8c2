//! `facegate serve` as a child process, for tests that kill it (SIGKILL),
//! restart it, or run several nodes at once.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::Value;

use crate::harness::{ADMIN_TOKEN, ARTIFACT_KEY, anonymous, client_with_key, engine_config, facegate_home, image};

/// A `facegate serve` process.
pub struct Server {
    child: Child,
    /// Where it listens (data plane and admin API).
    pub addr: SocketAddr,
}

impl Server {
    /// A node with its own SQLite store in `data`.
    pub fn start(data: &Path) -> Self {
        Self::start_with(data, &[])
    }

    /// A node with `data` as its data directory and `extra` arguments
    /// (`--store`, `--node-id`). Every such node is given the same artifact
    /// key, as a cluster's nodes are, so they share what they compile.
    pub fn start_with(data: &Path, extra: &[&str]) -> Self {
        Self::spawn(Command::new(env!("CARGO_BIN_EXE_facegate")), data, &[&["--artifact-key", ARTIFACT_KEY], extra].concat())
    }

    /// [`Self::start_with`] without an artifact key: the node shares no
    /// compiled handler through a cluster's store, nor loads one.
    pub fn start_without_artifact_key(data: &Path, extra: &[&str]) -> Self {
        Self::spawn(Command::new(env!("CARGO_BIN_EXE_facegate")), data, extra)
    }

    /// A node `sh` starts after running `shell` (`ulimit -Sn 1024`, say).
    pub fn start_after(shell: &str, data: &Path, extra: &[&str]) -> Self {
        let mut sh = Command::new("sh");
        sh.arg("-c").arg(format!("{shell} && exec \"$0\" \"$@\"")).arg(env!("CARGO_BIN_EXE_facegate"));
        Self::spawn(sh, data, extra)
    }

    fn spawn(mut command: Command, data: &Path, extra: &[&str]) -> Self {
        let engine = engine_config(&facegate_home());
        let mut child = command
            .args(["serve", "--listen", "127.0.0.1:0", "--admin-token", ADMIN_TOKEN, "--max-batch", "1", "--cpu-threads", "1"])
            .arg("--data-dir")
            .arg(data)
            .arg("--model")
            .arg(&engine.model)
            .arg("--onnxruntime")
            .arg(&engine.onnxruntime)
            .arg("--pipeline-component")
            .arg(crate::harness::guest("pipeline"))
            .args(extra)
            .env_remove("FACEGATE_SEED")
            .env_remove("FACEGATE_STORE")
            .env_remove("FACEGATE_ARTIFACT_KEY")
            .stdout(Stdio::piped())
            .env("FACEGATE_LOG", std::env::var("FACEGATE_TEST_NODE_LOG").unwrap_or_else(|_| "error".into()))
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = loop {
            let line = lines.next().expect("facegate exited before listening").unwrap();
            // `https://` for a node serving TLS.
            if let Some(addr) =
                line.strip_prefix("facegate listening on http://").or_else(|| line.strip_prefix("facegate listening on https://"))
            {
                break addr.parse().unwrap();
            }
        };
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Self { child, addr }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and wait for it.
    pub fn kill(mut self) {
        self.child.kill().unwrap(); // SIGKILL on Unix
        self.child.wait().unwrap();
    }

    /// SIGTERM, as Kubernetes sends a pod it stops; does not wait.
    pub fn terminate(&self) {
        let status = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill -TERM failed");
    }

    /// SIGSTOP: the process stands still (its sync thread included) until [`Self::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`Self::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill").args([signal, &self.child.id().to_string()]).status().unwrap();
        assert!(status.success(), "kill {signal} failed");
    }

    /// Waits up to `limit` for the process to exit; its status, or `None` if it still runs.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// An admin API request to this node.
    pub fn admin(&self, method: Method, path: &str) -> reqwest::blocking::RequestBuilder {
        anonymous().request(method, format!("http://{}/admin/v1/{path}", self.addr)).bearer_auth(ADMIN_TOKEN)
    }

    /// Sends an admin request that must succeed; its JSON answer.
    pub fn json(&self, request: reqwest::blocking::RequestBuilder) -> Value {
        let response = request.send().unwrap();
        let status = response.status();
        let body = response.text().unwrap();
        assert!(status.is_success(), "{status}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    /// Calls t/h; returns the status and the version that answered.
    pub fn call(&self, key: &str) -> (u16, Option<i64>) {
        answered(client_with_key(key).post(format!("http://{}/v1/t/h", self.addr)).body(image("grace_hopper.jpg")))
    }

    /// What t/h answers to a GET (no image, so no inference: a quick look at
    /// which version this node serves, even on a loaded machine): the status
    /// and the version that answered.
    pub fn probe(&self, key: &str) -> (u16, Option<i64>) {
        answered(client_with_key(key).get(format!("http://{}/v1/t/h", self.addr)))
    }

    /// Starts an upload of t/h over a raw socket: the head and `sent` bytes of `body`.
    pub fn start_upload(&self, body: &[u8], sent: usize) -> TcpStream {
        let mut stream = TcpStream::connect(self.addr).unwrap();
        let head = format!(
            "PUT /admin/v1/tenants/t/handlers/h HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).unwrap();
        stream.write_all(&body[..sent]).unwrap();
        stream
    }
}

/// Sends `request` and reads its whole answer (the guest streams the body
/// after the head and holds its tenant's slot until it is done, so the
/// next call does not overlap it): the status and the version that
/// answered.
fn answered(request: reqwest::blocking::RequestBuilder) -> (u16, Option<i64>) {
    let response = request.send().unwrap();
    let version = response.headers().get("x-facegate-handler-version").map(|v| v.to_str().unwrap().parse().unwrap());
    let status = response.status().as_u16();
    let _ = response.bytes();
    (status, version)
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
