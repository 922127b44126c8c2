//! `facegate kv …`: a tenant's state (what its handlers keep through
//! `wasi:keyvalue`), through the admin API or, with a key, the tenant API.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Subcommand;
use hyper::Method;
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use serde_json::Value;

use super::{TenantClient, exchange, own_tenant_refused};

/// `facegate kv ...`
#[derive(Debug, Subcommand)]
pub enum KvCommand {
    /// List a tenant's buckets (keys and bytes each), or one bucket's keys.
    List {
        /// The bucket whose keys to list; none: the buckets.
        bucket: Option<String>,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        of: TenantClient,
    },
    /// Print a key's value to stdout, its bytes as stored.
    Get {
        /// The bucket.
        bucket: String,
        /// The key.
        key: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        of: TenantClient,
    },
    /// Set a key's value: VALUE, or stdin's bytes (`--from-stdin`), or a file's (`--from-file`).
    Put {
        /// The bucket.
        bucket: String,
        /// The key.
        key: String,
        /// The value, as text.
        #[arg(required_unless_present_any = ["from_file", "from_stdin"], conflicts_with_all = ["from_file", "from_stdin"])]
        value: Option<String>,
        /// Read the value from this file.
        #[arg(long, conflicts_with = "from_stdin")]
        from_file: Option<PathBuf>,
        /// Read the value from stdin.
        #[arg(long)]
        from_stdin: bool,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        of: TenantClient,
    },
    /// Delete a key, or with `--all` every key of the bucket.
    Delete {
        /// The bucket.
        bucket: String,
        /// The key (none: give `--all`).
        key: Option<String>,
        /// Delete every key of the bucket (not with a key).
        #[arg(long, conflicts_with = "key")]
        all: bool,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        of: TenantClient,
    },
}

impl KvCommand {
    fn of(&self) -> &TenantClient {
        match self {
            Self::List { of, .. } | Self::Get { of, .. } | Self::Put { of, .. } | Self::Delete { of, .. } => of,
        }
    }
}

/// `bucket/key` as a path below `kv/`, the key percent-encoded.
fn key_path(bucket: &str, key: &str) -> String {
    format!("kv/{}/{}", utf8_percent_encode(bucket, NON_ALPHANUMERIC), utf8_percent_encode(key, NON_ALPHANUMERIC))
}

/// Runs a `kv` command; the process's exit code.
pub(super) async fn run(command: &KvCommand) -> anyhow::Result<i32> {
    let of = command.of();
    if let Some(code) = own_tenant_refused(&of.client, of.tenant.as_deref()).await? {
        return Ok(code);
    }
    match command {
        KvCommand::List { bucket: None, of } => {
            let listed = json_call(of, Method::GET, "kv", Bytes::new()).await?;
            let Ok(value) = listed else { return Ok(1) };
            if of.client.json {
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                for b in value["buckets"].as_array().into_iter().flatten() {
                    println!("{}\t{} keys\t{} bytes", b["name"].as_str().unwrap_or("?"), b["keys"], b["bytes"]);
                }
            }
            Ok(0)
        }
        KvCommand::List { bucket: Some(bucket), of } => list_keys(of, bucket).await,
        KvCommand::Get { bucket, key, of } => {
            let (status, bytes) =
                exchange(&of.client, &token(of)?, Method::GET, &of.path(&key_path(bucket, key)), Bytes::new(), "application/json").await?;
            if !status.is_success() {
                return Ok(refusal(status.as_u16(), &bytes));
            }
            std::io::stdout().write_all(&bytes)?;
            Ok(0)
        }
        KvCommand::Put { bucket, key, value, from_file, from_stdin, of } => {
            let body = match (value, from_file, from_stdin) {
                (Some(text), ..) => Bytes::from(text.clone()),
                (None, Some(path), _) => std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?.into(),
                (None, None, _) => {
                    let mut bytes = Vec::new();
                    std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes).context("reading the value from stdin")?;
                    bytes.into()
                }
            };
            done(json_call(of, Method::PUT, &key_path(bucket, key), body).await?, &format!("{bucket}/{key} set"))
        }
        KvCommand::Delete { bucket, key: Some(key), of, .. } => {
            done(json_call(of, Method::DELETE, &key_path(bucket, key), Bytes::new()).await?, &format!("{bucket}/{key} deleted"))
        }
        KvCommand::Delete { bucket, key: None, all, of } => {
            if !all {
                bail!("name a key, or give --all to delete every key of {bucket}");
            }
            let path = format!("kv/{}", utf8_percent_encode(bucket, NON_ALPHANUMERIC));
            done(json_call(of, Method::DELETE, &path, Bytes::new()).await?, &format!("every key of {bucket} deleted"))
        }
    }
}

/// Every key of `bucket`, page by page, one per line (or one JSON list).
async fn list_keys(of: &TenantClient, bucket: &str) -> anyhow::Result<i32> {
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let query = after.as_ref().map_or_else(String::new, |a| format!("?limit=1000&after={}", utf8_percent_encode(a, NON_ALPHANUMERIC)));
        let path = format!("kv/{}{query}", utf8_percent_encode(bucket, NON_ALPHANUMERIC));
        let Ok(page) = json_call(of, Method::GET, &path, Bytes::new()).await? else { return Ok(1) };
        all.extend(page["keys"].as_array().into_iter().flatten().filter_map(Value::as_str).map(str::to_owned));
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    if of.client.json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else {
        all.iter().for_each(|key| println!("{key}"));
    }
    Ok(0)
}

/// The admin token, or the tenant's key.
fn token(of: &TenantClient) -> anyhow::Result<String> {
    match &of.client.key {
        Some(key) => Ok(key.clone()),
        None => std::env::var("FACEGATE_ADMIN_TOKEN")
            .context("set FACEGATE_ADMIN_TOKEN to the gateway's admin token, or give a tenant's key (--key)"),
    }
}

/// A call answered with JSON: `Ok` its value, `Err` once the refusal is printed.
async fn json_call(of: &TenantClient, method: Method, rest: &str, body: Bytes) -> anyhow::Result<Result<Value, ()>> {
    let content_type = if body.is_empty() { "application/json" } else { "application/octet-stream" };
    let (status, bytes) = exchange(&of.client, &token(of)?, method, &of.path(rest), body, content_type).await?;
    if !status.is_success() {
        refusal(status.as_u16(), &bytes);
        return Ok(Err(()));
    }
    Ok(Ok(serde_json::from_slice(&bytes).unwrap_or_default()))
}

/// Prints a refusal's message; the exit code 1.
fn refusal(status: u16, bytes: &[u8]) -> i32 {
    let value: Value = serde_json::from_slice(bytes).unwrap_or_default();
    let code = value["error"]["code"].as_str().unwrap_or("error");
    let message = value["error"]["message"].as_str().map_or_else(|| String::from_utf8_lossy(bytes).into_owned(), str::to_owned);
    eprintln!("error ({status} {code}): {message}");
    1
}

/// Prints `message` once `outcome` succeeded.
fn done(outcome: Result<Value, ()>, message: &str) -> anyhow::Result<i32> {
    match outcome {
        Ok(_) => {
            println!("{message}");
            Ok(0)
        }
        Err(()) => Ok(1),
    }
}
