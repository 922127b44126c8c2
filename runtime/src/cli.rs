//! The admin client: `facegate tenant|key|deploy|versions|activate|rollback`
//! talk to a running gateway's admin API (`--url` / `FACEGATE_URL`, `http://`
//! or `https://` with `--ca-cert` / `FACEGATE_CA_CERT` for a private CA;
//! token from `FACEGATE_ADMIN_TOKEN`); `facegate check` inspects a store offline.
//! With `--json` each prints the API's JSON answer, for scripts; otherwise a
//! short human summary. A refusal prints its message and exits non-zero.

use std::path::PathBuf;

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode, Uri};
use serde_json::{Value, json};

mod kv;

pub use self::kv::KvCommand;
use crate::admission::limits::LimitOverrides;
use crate::http::LogCursor;
use crate::http::client::send;

/// Where the admin API is and how to print.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// Base URL of the gateway's admin API (`http://` or `https://`; the
    /// API lives under `/admin/v1/`).
    #[arg(long, env = "FACEGATE_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,

    /// CA certificates (PEM) to trust for an `https://` URL, e.g. a private
    /// CA or the gateway's self-signed certificate (default: the system's roots).
    #[arg(long, env = "FACEGATE_CA_CERT")]
    pub ca_cert: Option<PathBuf>,

    /// Print the API's JSON answer instead of a summary.
    #[arg(long)]
    pub json: bool,

    /// A tenant's API key with the `deploy` or `read` scope: the command
    /// goes to that tenant's own API (`/tenant/v1/`) instead of the admin
    /// API, and needs no `--tenant`; a `--tenant` other than the key's is
    /// refused (exit status 2) (default: the admin token in
    /// `FACEGATE_ADMIN_TOKEN`).
    #[arg(long, env = "FACEGATE_KEY", hide_env_values = true)]
    pub key: Option<String>,
}

impl ClientArgs {
    /// The admin path, or the tenant API's when a key is given.
    fn route(&self, admin: String, tenant: impl FnOnce() -> String) -> String {
        if self.key.is_some() { tenant() } else { admin }
    }
}

/// `facegate tenant ...`
#[derive(Debug, Subcommand)]
pub enum TenantCommand {
    /// Create a tenant (limits not given follow the server's defaults).
    Create(TenantLimitsArgs),
    /// Change some limits of a tenant.
    Limits(TenantLimitsArgs),
    /// List tenants.
    List {
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
    /// Delete a tenant with its keys and handlers.
    Delete {
        /// Tenant name.
        name: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
}

/// A tenant and limits to override.
#[derive(Debug, Clone, Args)]
pub struct TenantLimitsArgs {
    /// Tenant name: 1-63 characters of a-z, 0-9 and '-'.
    pub name: String,
    /// Limits to override.
    #[command(flatten)]
    pub limits: LimitOverrides,
    #[command(flatten)]
    #[allow(missing_docs, reason = "flattened")]
    pub client: ClientArgs,
}

/// `facegate key ...`
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Create an API key; it is printed once (with --json, in field `key`).
    /// With `--key` (a deploy key), an `invoke` key of that key's tenant.
    Create {
        /// Tenant name (not with `--key`).
        #[arg(required_unless_present = "key")]
        tenant: Option<String>,
        /// What the key may do, comma-separated: `invoke` (call the
        /// tenant's handlers), `deploy` (manage its handlers and invoke
        /// keys), `read` (its versions and usage).
        #[arg(long, default_value = "invoke")]
        scope: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
    /// List a tenant's keys (ids and scopes).
    List {
        /// Tenant name (not with `--key`).
        #[arg(required_unless_present = "key")]
        tenant: Option<String>,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
    /// Revoke a key by id.
    Revoke {
        /// Tenant name (not with `--key`).
        #[arg(required_unless_present = "key")]
        tenant: Option<String>,
        /// Key id (the part after `fg_`, before the next `_`).
        key_id: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
}

/// A tenant (`--tenant`; not with `--key`: the key's own) and where its API is.
#[derive(Debug, Clone, Args)]
pub struct TenantClient {
    /// The tenant (not with `--key`: the key's own).
    #[arg(long, required_unless_present = "key")]
    pub tenant: Option<String>,
    #[command(flatten)]
    #[allow(missing_docs, reason = "flattened")]
    pub client: ClientArgs,
}

impl TenantClient {
    /// `rest` under the tenant's path in the admin API, or in the tenant API with a key.
    fn path(&self, rest: &str) -> String {
        self.client.route(format!("tenants/{}/{rest}", named(&self.tenant)), || rest.to_owned())
    }
}

/// Whose setting: a tenant and perhaps one of its handlers.
#[derive(Debug, Clone, Args)]
pub struct SettingTarget {
    /// Only this handler (its value wins over the tenant's); default: every handler of the tenant.
    #[arg(long)]
    pub handler: Option<String>,
    #[command(flatten)]
    #[allow(missing_docs, reason = "flattened")]
    pub of: TenantClient,
}

impl SettingTarget {
    /// The settings' path (then `rest` and the handler's query).
    fn path(&self, rest: &str) -> String {
        let query = self.handler.as_ref().map_or_else(String::new, |h| format!("?handler={h}"));
        self.of.path(&format!("config{rest}{query}"))
    }
}

/// `facegate config ...`
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Set a setting its handlers read (`wasi:config/store`), without a redeploy.
    Set {
        /// Its name.
        name: String,
        /// Its value.
        value: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        target: SettingTarget,
    },
    /// Remove a setting (or a secret).
    Unset {
        /// Its name.
        name: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        target: SettingTarget,
    },
    /// List a tenant's settings (secrets by name and fingerprint only).
    List {
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        of: TenantClient,
    },
}

/// `facegate secret ...`
#[derive(Debug, Subcommand)]
pub enum SecretCommand {
    /// Set a secret its handlers read like a setting, sealed in the store
    /// and never shown again: the value from stdin (or `--from-file`),
    /// never from the command line.
    Set {
        /// Its name.
        name: String,
        /// Read the value from this file instead of stdin.
        #[arg(long)]
        from_file: Option<PathBuf>,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        target: SettingTarget,
    },
}

/// `facegate registry ...`
#[derive(Debug, Subcommand)]
pub enum RegistryCommand {
    /// Keep a tenant's credentials for a registry, for its deploys by
    /// reference that carry none: the password is read from stdin (or the
    /// Docker config's, without `--registry-username`) and sealed in the
    /// store; no command shows it again.
    Login {
        /// The registry, `HOST[:PORT]` as references name it.
        registry: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        credentials: RegistryArgs,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        of: TenantClient,
    },
    /// List the registries a tenant keeps credentials for (user names, never passwords).
    List {
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        of: TenantClient,
    },
    /// Forget a tenant's credentials for a registry.
    Logout {
        /// The registry.
        registry: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        of: TenantClient,
    },
}

/// A tenant's handler.
#[derive(Debug, Clone, Args)]
pub struct HandlerArgs {
    /// Tenant name (not with `--key`).
    #[arg(long, required_unless_present = "key")]
    pub tenant: Option<String>,
    /// Handler name.
    #[arg(long)]
    pub handler: String,
    #[command(flatten)]
    #[allow(missing_docs, reason = "flattened")]
    pub client: ClientArgs,
}

/// A registry's credentials on the command line: flags, else the Docker
/// config file (`$DOCKER_CONFIG/config.json` or `~/.docker/config.json`,
/// with its credential helpers), as `docker`, `oras` and `wkg` read them.
#[derive(Debug, Clone, Args)]
pub struct RegistryArgs {
    /// The registry's user name (with `--registry-password-stdin`).
    #[arg(long, requires = "registry_password_stdin")]
    pub registry_username: Option<String>,
    /// Read the registry's password or token from standard input (never
    /// from the command line, where other users of the machine see it).
    #[arg(long, requires = "registry_username")]
    pub registry_password_stdin: bool,
}

impl RegistryArgs {
    /// The credentials for `registry`: the flags', else (if `docker`) the
    /// Docker config's, else none.
    fn credentials(&self, registry: &str, docker: bool) -> anyhow::Result<Option<crate::http::oci::Credentials>> {
        let Some(username) = &self.registry_username else {
            return if docker { crate::http::oci::auth::from_docker_config(registry) } else { Ok(None) };
        };
        let mut password = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut password).context("reading the registry password from stdin")?;
        let password = password.trim_end_matches(['\r', '\n']).to_owned();
        Ok(Some(crate::http::oci::Credentials { username: username.clone(), password }))
    }
}

/// `facegate push`
#[derive(Debug, Clone, Args)]
pub struct PushArgs {
    /// The handler component (wasm32-wasip2).
    pub file: PathBuf,
    /// Where to push it: `oci://REGISTRY/REPOSITORY:TAG`.
    pub reference: String,
    /// Talk to the registry over plain HTTP (a local registry without TLS).
    #[arg(long)]
    pub plain_http: bool,
    #[command(flatten)]
    #[allow(missing_docs, reason = "flattened")]
    pub registry: RegistryArgs,
}

/// `facegate deploy`
#[derive(Debug, Clone, Args)]
pub struct DeployArgs {
    /// The handler component (wasm32-wasip2): a file, or
    /// `oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]` for the gateway to
    /// pull (from a registry its operator allows, `--oci-registry`); the
    /// version records the digest a tag resolved to.
    pub component: String,
    /// With an `oci://` component: the registry's credentials go with the
    /// deploy, for that one pull (else the node uses those the tenant keeps,
    /// `facegate registry login`).
    #[command(flatten)]
    #[allow(missing_docs, reason = "flattened")]
    pub registry: RegistryArgs,
    /// With an `oci://` component and no `--registry-username`: send the
    /// Docker config's credentials for the registry with the deploy. Off by
    /// default: they are the user's own and would leave for the gateway.
    #[arg(long)]
    pub send_docker_credentials: bool,
    /// Store the version without activating it.
    #[arg(long, conflicts_with = "canary")]
    pub no_activate: bool,
    /// Release it as a canary: this percent (1 to 99) of the handler's
    /// requests go to it, the rest to the active version, until `promote`
    /// or `abort`.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=99))]
    pub canary: Option<u8>,
    /// With `--canary`: a node aborts it once its share of 5xx answers
    /// exceeds the active version's by this much (0.05: five points)...
    #[arg(long, requires = "canary", requires = "abort_after")]
    pub abort_margin: Option<f64>,
    /// ...over at least this many of its requests on that node.
    #[arg(long, requires = "abort_margin")]
    pub abort_after: Option<u64>,
    /// Give the guest the whole path the client asked for
    /// (`/v1/TENANT/HANDLER/rest?query`), not the path below the handler's
    /// mount (`/rest?query`, the default: what a component written for
    /// `wasmtime serve` expects).
    #[arg(long)]
    pub full_path: bool,
    #[command(flatten)]
    #[allow(missing_docs, reason = "flattened")]
    pub target: HandlerArgs,
}

/// `facegate activate`
#[derive(Debug, Clone, Args)]
pub struct ActivateArgs {
    /// Version to activate.
    pub version: i64,
    #[command(flatten)]
    #[allow(missing_docs, reason = "flattened")]
    pub target: HandlerArgs,
}

/// `facegate model ...`
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Add an ONNX model of CenterFace's contract to the repository as
    /// NAME's next version, served at once by every node sharing the
    /// store. Refused when it finds fewer than 65 % of the reference
    /// model's faces on the test photos (the accuracy gate), unless --force.
    Add {
        /// The model's name, as handlers call it (`?model=NAME`).
        name: String,
        /// The `.onnx` file.
        file: PathBuf,
        /// Add it though it fails the accuracy gate.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
    /// List the models the node `--url` reaches serves (where each comes
    /// from, whether it is loaded or pinned, what it counts against the
    /// model-memory bound, its loads on demand and evictions, its input)
    /// and the repository's versions with their accuracy.
    List {
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
    /// Serve another version of a repository model.
    Activate {
        /// The model's name.
        name: String,
        /// The version to serve.
        version: i64,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
    /// Remove a model from the repository, every version: handlers that
    /// call it get `unknown_model` (404) from then on.
    Remove {
        /// The model's name.
        name: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
}

/// `facegate route ...`
#[derive(Debug, Subcommand)]
pub enum RouteCommand {
    /// Route a hostname to a tenant's handler: a request whose `Host` (or
    /// TLS server name) is HOSTNAME runs that handler, the whole path its
    /// guest's. A hostname routed already to another handler of the same
    /// tenant moves; one of another tenant is refused.
    Add {
        /// The hostname, e.g. `faces.acme.example` (no port, no scheme).
        hostname: String,
        /// The tenant it belongs to.
        #[arg(long)]
        tenant: String,
        /// The tenant's handler it runs.
        #[arg(long)]
        handler: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
    /// List the routed hostnames.
    List {
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
    /// Remove a hostname's route.
    Remove {
        /// The hostname.
        hostname: String,
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
}

/// `facegate usage`
#[derive(Debug, Clone, Args)]
pub struct UsageArgs {
    /// Only this tenant (default: all).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Start, Unix seconds (default: a day before `--to`).
    #[arg(long)]
    pub from: Option<i64>,
    /// End, Unix seconds, excluded (default: now).
    #[arg(long)]
    pub to: Option<i64>,
    /// Period of each row: minute, hour or day.
    #[arg(long, default_value = "hour", value_parser = ["minute", "hour", "day"])]
    pub by: String,
    /// Print CSV (a header, then a row per tenant, handler, version and
    /// period; its last column each model's part, `name:device_us:calls;…`).
    #[arg(long)]
    pub csv: bool,
    #[command(flatten)]
    #[allow(missing_docs, reason = "flattened")]
    pub client: ClientArgs,
}

impl DeployArgs {
    /// The upload's body and its type: the component's bytes, or the
    /// reference (and credentials) the gateway pulls it by.
    fn body(&self) -> anyhow::Result<(Bytes, &'static str)> {
        if !self.component.starts_with("oci://") {
            let bytes = std::fs::read(&self.component).with_context(|| format!("cannot read {}", self.component))?;
            return Ok((bytes.into(), "application/wasm"));
        }
        let reference: crate::http::oci::Reference = self.component.parse().map_err(anyhow::Error::msg)?;
        let mut body = json!({ "source": self.component });
        if let Some(credentials) = self.registry.credentials(&reference.registry, self.send_docker_credentials)? {
            body["username"] = credentials.username.into();
            body["password"] = credentials.password.into();
        }
        Ok((body.to_string().into(), "application/json"))
    }

    /// The upload's query: how it is released.
    fn query(&self) -> String {
        let mut query = Vec::new();
        if self.no_activate {
            query.push("activate=false".to_owned());
        }
        query.extend(self.canary.map(|p| format!("canary={p}")));
        query.extend(self.abort_margin.map(|m| format!("abort_margin={m}")));
        query.extend(self.abort_after.map(|n| format!("abort_after={n}")));
        if self.full_path {
            query.push("path=full".to_owned());
        }
        if query.is_empty() { String::new() } else { format!("?{}", query.join("&")) }
    }
}

impl HandlerArgs {
    /// The handler's path (then `rest`) in the admin API, or in the tenant
    /// API with a key.
    fn path(&self, rest: &str) -> String {
        let admin = || format!("tenants/{}/handlers/{}{rest}", named(&self.tenant), self.handler);
        self.client.route(admin(), || format!("handlers/{}{rest}", self.handler))
    }
}

/// A tenant clap made sure is there (it is required without `--key`).
fn named(tenant: &Option<String>) -> &str {
    tenant.as_deref().unwrap_or_default()
}

impl UsageArgs {
    /// The admin API path with the query.
    fn path(&self) -> String {
        let mut query = vec![format!("by={}", self.by)];
        query.extend(self.tenant.as_ref().map(|t| format!("tenant={t}")));
        query.extend(self.from.map(|s| format!("from={s}")));
        query.extend(self.to.map(|s| format!("to={s}")));
        format!("usage?{}", query.join("&"))
    }
}

/// `facegate logs`
#[derive(Debug, Clone, Args)]
pub struct LogsArgs {
    /// Only this handler's records.
    #[arg(long)]
    pub handler: Option<String>,
    /// Only records after this cursor: `node:seq` pairs joined by commas
    /// (each node's last record read; the gateway's
    /// `x-facegate-logs-cursor`), or one record's `seq` on the node asked.
    #[arg(long)]
    pub since: Option<String>,
    /// Keep printing records as they come.
    #[arg(long, short = 'f')]
    pub follow: bool,
    #[command(flatten)]
    #[allow(missing_docs, reason = "flattened")]
    pub client: ClientArgs,
}

/// `facegate check`
#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// The SQLite store to check (without `--store`).
    #[arg(long, env = "FACEGATE_DATA", default_value = ".facegate/data")]
    pub data_dir: PathBuf,
    /// A PostgreSQL store to check instead: `postgres://…`.
    #[arg(long, env = "FACEGATE_STORE", hide_env_values = true)]
    pub store: Option<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// facegate: a serverless gateway for face detection.
#[derive(Debug, Parser)]
#[command(name = "facegate", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant, reason = "parsed once at start and moved once; boxing buys nothing")]
pub enum Command {
    /// Serve tenants' handlers over HTTP.
    Serve(crate::config::ServeConfig),
    /// Measure throughput and latency (the gateway over HTTP vs the raw
    /// engine, and more): runs `facegate-bench`, built beside this binary,
    /// with these arguments (`facegate bench --help` lists them).
    #[command(disable_help_flag = true)]
    Bench {
        /// Arguments for facegate-bench.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
    /// Manage tenants (admin API).
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Manage a tenant's API keys (admin API).
    #[command(subcommand)]
    Key(KeyCommand),
    /// Upload a handler component as a new version and activate it, or
    /// have the gateway pull it from a registry (admin API).
    Deploy(DeployArgs),
    /// A tenant's settings, which its handlers read without a redeploy (admin API).
    #[command(subcommand)]
    Config(ConfigCommand),
    /// A tenant's secrets: settings sealed in the store, never shown again (admin API).
    #[command(subcommand)]
    Secret(SecretCommand),
    /// A tenant's state, which its handlers keep (`wasi:keyvalue`): list,
    /// read, write and delete keys (admin API, or the tenant API with a key).
    #[command(subcommand)]
    Kv(KvCommand),
    /// Keep a tenant's registry credentials for its deploys by reference (admin API).
    #[command(subcommand)]
    Registry(RegistryCommand),
    /// Push a handler component to an OCI registry as the wasm artifact
    /// (`wkg`, `oras` and `spin` pull it); prints its manifest's digest.
    Push(PushArgs),
    /// List a handler's versions (admin API).
    Versions(HandlerArgs),
    /// Activate one version of a handler (admin API).
    Activate(ActivateArgs),
    /// Activate the version before the active one (admin API).
    Rollback(HandlerArgs),
    /// Make a handler's canary its active version (admin API).
    Promote(HandlerArgs),
    /// End a handler's canary: all its requests go to the active version (admin API).
    Abort(HandlerArgs),
    /// Check a store's integrity offline (database, references, component hashes).
    Check(CheckArgs),
    /// The tenants' usage, summed over the cluster's nodes, per minute, hour
    /// or day: requests by status class, guest and device time, inference
    /// calls, bytes, peak memory (admin API).
    Usage(UsageArgs),
    /// A tenant's log on the node `--url` reaches: each request's outcome
    /// and its handlers' output (tenant API, a key with the `read` scope).
    Logs(LogsArgs),
    /// Route tenants' own hostnames to their handlers (admin API).
    #[command(subcommand)]
    Route(RouteCommand),
    /// The models a node serves (admin API).
    #[command(subcommand)]
    Model(ModelCommand),
    /// List the gateway nodes sharing the store, with their last heartbeat (admin API).
    Nodes {
        #[command(flatten)]
        #[allow(missing_docs, reason = "flattened")]
        client: ClientArgs,
    },
}

/// Logs to stderr, filtered by `FACEGATE_LOG` (`tracing`'s `EnvFilter`
/// syntax; by default `info`, with wasmtime's and ONNX Runtime's own
/// messages from `warn` up).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FACEGATE_LOG").unwrap_or_else(|_| "info,wasmtime=warn,ort=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// `facegate model list`'s tables: the node's models, then the repository's versions.
fn print_models(v: &Value) {
    println!("MODEL\tSOURCE\tLOADED\tPINNED\tMIB\tLOADS\tEVICTIONS\tLAST LOAD\tINPUT");
    for model in v["models"].as_array().into_iter().flatten() {
        let yes = |field: &str| if model[field] == true { "yes" } else { "no" };
        let last_load = model["last_load_ms"].as_u64().map_or_else(|| "-".to_owned(), |ms| format!("{ms} ms"));
        println!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{last_load}\t{} {}",
            model["name"].as_str().unwrap_or("?"),
            model["source"].as_str().unwrap_or("?"),
            yes("loaded"),
            yes("pinned"),
            model["memory_bytes"].as_u64().unwrap_or(0).div_ceil(1 << 20),
            model["loads"],
            model["evictions"],
            model["input"]["element"].as_str().unwrap_or("?"),
            model["input"]["shape"],
        );
    }
    let bound = v["memory"]["bound_bytes"].as_u64().map_or_else(|| "no bound".to_owned(), |b| format!("{} MiB", b >> 20));
    println!("loaded: {} MiB of {bound}", v["memory"]["loaded_bytes"].as_u64().unwrap_or(0).div_ceil(1 << 20));
    let versions = v["repository"].as_array().into_iter().flatten();
    for (i, row) in versions.enumerate() {
        if i == 0 {
            println!("\nREPOSITORY\tVERSION\tACTIVE\tBYTES\tFOUND\tSHA256");
        }
        let accuracy = &row["accuracy"]["accuracy"];
        let forced = if row["accuracy"]["forced"] == true { " (forced)" } else { "" };
        println!(
            "{}\t{}\t{}\t{}\t{}/{}{forced}\t{}",
            row["name"].as_str().unwrap_or("?"),
            row["version"],
            if row["active"] == true { "yes" } else { "no" },
            row["size"],
            accuracy["matched"],
            accuracy["reference"],
            row["sha256"].as_str().unwrap_or("?"),
        );
    }
}

/// Runs one client command; returns the process exit code.
pub async fn run(command: Command) -> anyhow::Result<i32> {
    use Command as C;
    let (client, method, path, body, content_type) = match &command {
        C::Tenant(TenantCommand::Create(TenantLimitsArgs { name, limits, client })) => {
            let body = json!({ "name": name, "limits": limits });
            (client, Method::POST, "tenants".to_owned(), body.to_string().into(), "application/json")
        }
        C::Tenant(TenantCommand::Limits(TenantLimitsArgs { name, limits, client })) => {
            let body = serde_json::to_string(limits)?;
            (client, Method::PATCH, format!("tenants/{name}"), body.into(), "application/json")
        }
        C::Tenant(TenantCommand::List { client }) => (client, Method::GET, "tenants".to_owned(), Bytes::new(), "application/json"),
        C::Nodes { client } => (client, Method::GET, "nodes".to_owned(), Bytes::new(), "application/json"),
        C::Model(ModelCommand::List { client }) => (client, Method::GET, "models".to_owned(), Bytes::new(), "application/json"),
        C::Model(ModelCommand::Add { name, file, force, client }) => {
            let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
            let path = if *force { format!("models/{name}?force=true") } else { format!("models/{name}") };
            (client, Method::PUT, path, bytes.into(), "application/octet-stream")
        }
        C::Model(ModelCommand::Activate { name, version, client }) => {
            (client, Method::POST, format!("models/{name}/activate"), json!({ "version": version }).to_string().into(), "application/json")
        }
        C::Model(ModelCommand::Remove { name, client }) => {
            (client, Method::DELETE, format!("models/{name}"), Bytes::new(), "application/json")
        }
        C::Route(RouteCommand::Add { hostname, tenant, handler, client }) => {
            let body = json!({ "tenant": tenant, "handler": handler }).to_string();
            (client, Method::PUT, format!("routes/{hostname}"), body.into(), "application/json")
        }
        C::Route(RouteCommand::List { client }) => (client, Method::GET, "routes".to_owned(), Bytes::new(), "application/json"),
        C::Route(RouteCommand::Remove { hostname, client }) => {
            (client, Method::DELETE, format!("routes/{hostname}"), Bytes::new(), "application/json")
        }
        C::Tenant(TenantCommand::Delete { name, client }) => {
            (client, Method::DELETE, format!("tenants/{name}"), Bytes::new(), "application/json")
        }
        C::Key(KeyCommand::Create { tenant, scope, client }) => {
            let scopes: Vec<&str> = scope.split(',').map(str::trim).collect();
            let body = json!({ "scopes": scopes }).to_string();
            let path = client.route(format!("tenants/{}/keys", named(tenant)), || "keys".to_owned());
            (client, Method::POST, path, body.into(), "application/json")
        }
        C::Key(KeyCommand::List { tenant, client }) => {
            let path = client.route(format!("tenants/{}/keys", named(tenant)), || "keys".to_owned());
            (client, Method::GET, path, Bytes::new(), "application/json")
        }
        C::Key(KeyCommand::Revoke { tenant, key_id, client }) => {
            let path = client.route(format!("tenants/{}/keys/{key_id}", named(tenant)), || format!("keys/{key_id}"));
            (client, Method::DELETE, path, Bytes::new(), "application/json")
        }
        C::Deploy(args) => {
            let (body, content_type) = args.body()?;
            (&args.target.client, Method::PUT, args.target.path(&args.query()), body, content_type)
        }
        C::Push(args) => return push(args).await,
        C::Registry(RegistryCommand::Login { registry, credentials, of }) => {
            let Some(given) = credentials.credentials(registry, true)? else {
                bail!("no credentials for {registry}: give --registry-username and --registry-password-stdin, or log in with docker first");
            };
            let body = json!({ "username": given.username, "password": given.password }).to_string();
            (&of.client, Method::PUT, of.path(&format!("registries/{registry}")), body.into(), "application/json")
        }
        C::Config(ConfigCommand::Set { name, value, target }) => {
            let body = json!({ "value": value }).to_string();
            (&target.of.client, Method::PUT, target.path(&format!("/{name}")), body.into(), "application/json")
        }
        C::Config(ConfigCommand::Unset { name, target }) => {
            (&target.of.client, Method::DELETE, target.path(&format!("/{name}")), Bytes::new(), "application/json")
        }
        C::Config(ConfigCommand::List { of }) => (&of.client, Method::GET, of.path("config"), Bytes::new(), "application/json"),
        C::Secret(SecretCommand::Set { name, from_file, target }) => {
            let value = secret_value(from_file.as_deref())?;
            let body = json!({ "value": value, "secret": true }).to_string();
            (&target.of.client, Method::PUT, target.path(&format!("/{name}")), body.into(), "application/json")
        }
        C::Registry(RegistryCommand::List { of }) => (&of.client, Method::GET, of.path("registries"), Bytes::new(), "application/json"),
        C::Registry(RegistryCommand::Logout { registry, of }) => {
            (&of.client, Method::DELETE, of.path(&format!("registries/{registry}")), Bytes::new(), "application/json")
        }
        C::Promote(t) => (&t.client, Method::POST, t.path("/promote"), Bytes::new(), "application/json"),
        C::Abort(t) => (&t.client, Method::POST, t.path("/abort"), Bytes::new(), "application/json"),
        C::Versions(t) => (&t.client, Method::GET, t.path("/versions"), Bytes::new(), "application/json"),
        C::Activate(ActivateArgs { version, target: t }) => {
            let body = json!({ "version": version }).to_string();
            (&t.client, Method::POST, t.path("/activate"), body.into(), "application/json")
        }
        C::Rollback(t) => (&t.client, Method::POST, t.path("/rollback"), Bytes::new(), "application/json"),
        C::Usage(args) => (&args.client, Method::GET, args.path(), Bytes::new(), "application/json"),
        C::Check(args) => return check(args),
        C::Logs(args) => return logs(args).await,
        C::Kv(command) => return kv::run(command).await,
        C::Serve(_) | C::Bench { .. } => bail!("not a client command"),
    };
    if let Some(code) = own_tenant_refused(client, explicit_tenant(&command)).await? {
        return Ok(code);
    }
    let token = match &client.key {
        Some(key) => key.clone(),
        None => std::env::var("FACEGATE_ADMIN_TOKEN")
            .context("set FACEGATE_ADMIN_TOKEN to the gateway's admin token, or give a tenant's key (--key)")?,
    };
    let (status, bytes) = exchange(client, &token, method, &path, body, content_type).await?;
    let value: Value =
        serde_json::from_slice(&bytes).unwrap_or_else(|_| json!({ "error": { "message": String::from_utf8_lossy(&bytes) } }));
    if !status.is_success() {
        let message = value["error"]["message"].as_str().map_or_else(|| value.to_string(), str::to_owned);
        if client.json {
            println!("{value}");
        }
        eprintln!("error ({}): {message}", status.as_u16());
        return Ok(1);
    }
    if client.json {
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print_summary(&command, &value);
    }
    Ok(0)
}

/// With a tenant's key, a `--tenant` that is not the key's own: the
/// refusal is printed, and its exit code returned.
async fn own_tenant_refused(client: &ClientArgs, named: Option<&str>) -> anyhow::Result<Option<i32>> {
    let (Some(key), Some(named)) = (&client.key, named) else { return Ok(None) };
    let own = key_tenant(client, key).await?;
    if own == named {
        return Ok(None);
    }
    eprintln!(
        "error: --tenant {named:?} is not this key's tenant ({own:?}): a tenant's key acts for its own tenant only; \
         drop --tenant, or use {named:?}'s key or the admin token"
    );
    Ok(Some(2))
}

/// A secret's value: `file`'s contents, else stdin's, without one final newline.
fn secret_value(file: Option<&std::path::Path>) -> anyhow::Result<String> {
    let text = match file {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?,
        None => {
            // Typed at a terminal, the secret would show as it is typed.
            if std::io::IsTerminal::is_terminal(&std::io::stdin()) {
                bail!("pipe the secret into this command (printf %s \"$SECRET\" | facegate secret set ...) or give --from-file");
            }
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text).context("reading the secret from stdin")?;
            text
        }
    };
    let value = text.strip_suffix('\n').map(|t| t.strip_suffix('\r').unwrap_or(t)).unwrap_or(&text);
    if value.is_empty() {
        bail!("the secret is empty (an unset variable piped in?): nothing was set");
    }
    Ok(value.to_owned())
}

/// `facegate push`: the component packed as the wasm artifact and pushed;
/// prints the manifest's digest (`sha256:…`), and the pinned reference to stderr.
async fn push(args: &PushArgs) -> anyhow::Result<i32> {
    use crate::http::oci::{Reference, Registry};
    let reference: Reference = args.reference.parse().map_err(anyhow::Error::msg)?;
    let (Some(tag), None) = (&reference.tag, &reference.digest) else {
        bail!("push to a tag (oci://REGISTRY/REPOSITORY:TAG); the digest is the registry's to give");
    };
    let component = std::fs::read(&args.file).with_context(|| format!("cannot read {}", args.file.display()))?;
    crate::control::validate::check_header(&component).map_err(|e| anyhow::anyhow!("{}: {e}", args.file.display()))?;
    let title = args.file.file_name().map_or_else(|| "component.wasm".to_owned(), |n| n.to_string_lossy().into_owned());
    let credentials = args.registry.credentials(&reference.registry, true)?;
    let mut registry = Registry::new(&reference, args.plain_http, credentials, None, true);
    let digest = registry.push(tag, component.into(), &title).await.with_context(|| format!("cannot push to {reference}"))?;
    println!("{digest}");
    eprintln!("pushed {}", reference.pinned(&digest));
    Ok(0)
}

/// The tenant a command names with `--tenant`, if it does.
fn explicit_tenant(command: &Command) -> Option<&str> {
    use Command as C;
    match command {
        C::Key(KeyCommand::Create { tenant, .. } | KeyCommand::List { tenant, .. } | KeyCommand::Revoke { tenant, .. }) => {
            tenant.as_deref()
        }
        C::Deploy(args) => args.target.tenant.as_deref(),
        C::Config(ConfigCommand::Set { target, .. } | ConfigCommand::Unset { target, .. })
        | C::Secret(SecretCommand::Set { target, .. }) => target.of.tenant.as_deref(),
        C::Config(ConfigCommand::List { of })
        | C::Registry(RegistryCommand::Login { of, .. } | RegistryCommand::List { of } | RegistryCommand::Logout { of, .. }) => {
            of.tenant.as_deref()
        }
        C::Promote(t) | C::Abort(t) | C::Versions(t) | C::Rollback(t) => t.tenant.as_deref(),
        C::Activate(ActivateArgs { target, .. }) => target.tenant.as_deref(),
        C::Usage(args) => args.tenant.as_deref(),
        _ => None,
    }
}

/// A `GET` of `url` with a tenant's `key`, and the URL parsed.
fn get_with_key(url: &str, key: &str) -> anyhow::Result<(Uri, Request<Full<Bytes>>)> {
    let uri: Uri = url.parse().with_context(|| format!("bad URL {url}"))?;
    let authority = uri.authority().with_context(|| format!("bad URL {url}: no host"))?.as_str().to_owned();
    let request = Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header(hyper::header::HOST, authority)
        .header(hyper::header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Full::new(Bytes::new()))?;
    Ok((uri, request))
}

/// The tenant `key` belongs to, as the gateway says (`GET /v1/me`).
async fn key_tenant(client: &ClientArgs, key: &str) -> anyhow::Result<String> {
    let url = format!("{}/v1/me", client.url.trim_end_matches('/'));
    let (uri, request) = get_with_key(&url, key)?;
    let response = send(&uri, request, client.ca_cert.as_deref()).await.with_context(|| format!("cannot reach {url}"))?;
    let status = response.status();
    let bytes = response.into_body().collect().await.context("reading the answer")?.to_bytes();
    let value: Value = serde_json::from_slice(&bytes).unwrap_or_default();
    match value["tenant"].as_str() {
        Some(tenant) if status.is_success() => Ok(tenant.to_owned()),
        _ => bail!("the gateway does not know this key ({}): {}", status.as_u16(), String::from_utf8_lossy(&bytes)),
    }
}

/// One request to the admin API (the tenant API with a key); returns the
/// status and the answer's bytes.
async fn exchange(
    client: &ClientArgs,
    token: &str,
    method: Method,
    path: &str,
    body: Bytes,
    content_type: &str,
) -> anyhow::Result<(StatusCode, Bytes)> {
    let api = if client.key.is_some() { "tenant" } else { "admin" };
    let url = format!("{}/{api}/v1/{path}", client.url.trim_end_matches('/'));
    let uri: Uri = url.parse().with_context(|| format!("bad URL {url}"))?;
    let authority = uri.authority().with_context(|| format!("bad URL {url}: no host"))?.as_str().to_owned();
    let request = Request::builder()
        .method(method)
        .uri(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header(hyper::header::HOST, authority)
        .header(hyper::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(hyper::header::CONTENT_TYPE, content_type)
        .body(Full::new(body))
        .with_context(|| format!("bad URL {url}"))?;
    let response = send(&uri, request, client.ca_cert.as_deref()).await.with_context(|| format!("cannot reach {url}"))?;
    let status = response.status();
    let bytes = response.into_body().collect().await.context("reading the answer")?.to_bytes();
    Ok((status, bytes))
}

fn print_summary(command: &Command, v: &Value) {
    use Command as C;
    match command {
        C::Usage(args) => print_usage(v, args.csv),
        C::Tenant(TenantCommand::List { .. }) => {
            for t in v["tenants"].as_array().into_iter().flatten() {
                let handlers: Vec<String> = t["handlers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|h| format!("{}@{}", h["name"].as_str().unwrap_or("?"), h["active_version"]))
                    .collect();
                println!("{}\t{}", t["name"].as_str().unwrap_or("?"), handlers.join(" "));
            }
        }
        C::Tenant(TenantCommand::Create(_) | TenantCommand::Limits(_)) => {
            println!("tenant {}: {}", v["name"].as_str().unwrap_or("?"), v["limits"]);
        }
        C::Tenant(TenantCommand::Delete { name, .. }) => println!("deleted tenant {name}"),
        C::Key(KeyCommand::Create { .. }) => {
            println!("{}", v["key"].as_str().unwrap_or_default());
            eprintln!("key id {} (the key is shown only now)", v["id"].as_str().unwrap_or("?"));
        }
        C::Key(KeyCommand::List { .. }) => {
            for k in v["keys"].as_array().into_iter().flatten() {
                let state = if k["revoked_at"].is_null() { "active" } else { "revoked" };
                let scopes: Vec<&str> = k["scopes"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
                println!("{}\t{state}\t{}", k["id"].as_str().unwrap_or("?"), scopes.join(","));
            }
        }
        C::Key(KeyCommand::Revoke { key_id, .. }) => println!("revoked key {key_id}"),
        C::Deploy(_) => println!(
            "{}/{} version {} ({} bytes, sha256 {}, from {}); active version {}",
            v["tenant"].as_str().unwrap_or("?"),
            v["handler"].as_str().unwrap_or("?"),
            v["version"],
            v["size"],
            v["sha256"].as_str().unwrap_or("?"),
            v["source"].as_str().unwrap_or("?"),
            v["active_version"]
        ),
        C::Nodes { .. } => {
            println!("NODE\tADDRESS\tVERSION\tDEVICES\tALIVE\tLAST SEEN\tQUEUE\tIN FLIGHT\tGENERATION");
            for node in v["nodes"].as_array().into_iter().flatten() {
                let devices: Vec<&str> = node["devices"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
                println!(
                    "{}\t{}\t{}\t{}\t{}\t{:.1}s ago\t{}\t{}\t{}",
                    node["id"].as_str().unwrap_or("?"),
                    node["address"].as_str().unwrap_or("?"),
                    node["version"].as_str().unwrap_or("?"),
                    devices.join(","),
                    if node["alive"] == true { "yes" } else { "no" },
                    node["seen_ms_ago"].as_f64().unwrap_or(f64::NAN) / 1000.0,
                    node["load"]["queue_depth"],
                    node["load"]["in_flight"],
                    node["load"]["generation"],
                );
            }
        }
        C::Versions(_) => {
            for version in v["versions"].as_array().into_iter().flatten() {
                let active = if version["version"] == v["active_version"] { "\tactive" } else { "" };
                let field = |name: &str| version[name].as_str().unwrap_or("?").to_owned();
                let (sha256, path, source) = (field("sha256"), field("guest_path"), field("source"));
                println!("{}\t{sha256}\t{}\tpath={path}\t{source}{active}", version["version"], version["size"]);
            }
        }
        C::Config(ConfigCommand::List { .. }) => {
            for s in v["settings"].as_array().into_iter().flatten() {
                let scope = s["handler"].as_str().map_or_else(|| "*".to_owned(), str::to_owned);
                let shown = match s["value"].as_str() {
                    Some(value) => value.to_owned(),
                    None => format!("(secret {})", s["fingerprint"].as_str().unwrap_or("?")),
                };
                println!("{scope}\t{}\t{shown}", s["name"].as_str().unwrap_or("?"));
            }
        }
        C::Config(ConfigCommand::Set { name, .. }) => println!("{name} set"),
        C::Secret(SecretCommand::Set { name, .. }) => {
            println!("secret {name} set (fingerprint {})", v["fingerprint"].as_str().unwrap_or("?"))
        }
        C::Config(ConfigCommand::Unset { name, .. }) => println!("{name} unset"),
        C::Registry(RegistryCommand::List { .. }) => {
            for login in v["registries"].as_array().into_iter().flatten() {
                let field = |name: &str| login[name].as_str().unwrap_or("?").to_owned();
                println!("{}\t{}\t{}", field("registry"), field("username"), utc(login["updated_at"].as_i64().unwrap_or(0) * 1000));
            }
        }
        C::Registry(RegistryCommand::Login { registry, .. }) => println!("credentials for {registry} kept"),
        C::Registry(RegistryCommand::Logout { registry, .. }) => println!("credentials for {registry} forgotten"),
        C::Model(ModelCommand::List { .. }) => print_models(v),
        C::Model(ModelCommand::Add { .. }) => println!(
            "model {} version {} ({} bytes, sha256 {}): found {} of the reference's {} faces{}; active",
            v["name"].as_str().unwrap_or("?"),
            v["version"],
            v["size"],
            v["sha256"].as_str().unwrap_or("?"),
            v["accuracy"]["matched"],
            v["accuracy"]["reference"],
            if v["forced"] == true { " (below the gate, forced)" } else { "" },
        ),
        C::Model(ModelCommand::Activate { name, version, .. }) => println!("model {name}: version {version} active"),
        C::Model(ModelCommand::Remove { name, .. }) => println!("removed model {name}"),
        C::Route(RouteCommand::List { .. }) => {
            for route in v["routes"].as_array().into_iter().flatten() {
                let field = |name: &str| route[name].as_str().unwrap_or("?").to_owned();
                println!("{}\t{}/{}", field("hostname"), field("tenant"), field("handler"));
            }
        }
        C::Route(RouteCommand::Add { .. }) => {
            let field = |name: &str| v[name].as_str().unwrap_or("?").to_owned();
            println!("{} -> {}/{}", field("hostname"), field("tenant"), field("handler"));
        }
        C::Route(RouteCommand::Remove { hostname, .. }) => println!("removed the route of {hostname}"),
        C::Activate(_) | C::Rollback(_) | C::Promote(_) => println!(
            "{}/{}: active version {} (was {})",
            v["tenant"].as_str().unwrap_or("?"),
            v["handler"].as_str().unwrap_or("?"),
            v["active_version"],
            v["previous_version"]
        ),
        _ => println!("{v}"),
    }
}

/// Prints a tenant's log (see [`LogsArgs`]); following, asks again after
/// each stream ends (the gateway closes one after a minute).
async fn logs(args: &LogsArgs) -> anyhow::Result<i32> {
    let Some(key) = args.client.key.as_deref() else {
        bail!("logs are read with a tenant's key that has the read scope: give --key or FACEGATE_KEY")
    };
    let parsed = args.since.as_deref().map(LogCursor::parse).transpose();
    let mut cursor = parsed.map_err(|e| anyhow::anyhow!("--since: {e}"))?.unwrap_or_default();
    loop {
        let mut query: Vec<String> = args.handler.iter().map(|h| format!("handler={h}")).collect();
        query.extend(cursor.query());
        if args.follow {
            query.push("follow=true".into());
        }
        let url = format!("{}/tenant/v1/logs?{}", args.client.url.trim_end_matches('/'), query.join("&"));
        let (uri, request) = get_with_key(&url, key)?;
        let response = send(&uri, request, args.client.ca_cert.as_deref()).await.with_context(|| format!("cannot reach {url}"))?;
        if args.follow && response.status() == hyper::StatusCode::TOO_MANY_REQUESTS {
            // Past the tenant's API rate: a follower waits its turn, as told.
            let seconds = response.headers().get(hyper::header::RETRY_AFTER).and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(1u64);
            tokio::time::sleep(std::time::Duration::from_secs(seconds.clamp(1, 60))).await;
            continue;
        }
        if !response.status().is_success() {
            let status = response.status().as_u16();
            let bytes = response.into_body().collect().await?.to_bytes();
            let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            eprintln!("error ({status}): {}", value["error"]["message"].as_str().unwrap_or("the gateway refused"));
            return Ok(1);
        }
        if let Some(given) = response.headers().get("x-facegate-logs-cursor").and_then(|v| v.to_str().ok()) {
            cursor.absorb(&LogCursor::parse(given).map_err(|e| anyhow::anyhow!("the gateway's cursor: {e}"))?);
        }
        let mut body = response.into_body();
        let mut pending = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame?.into_data() else { continue };
            pending.extend_from_slice(&data);
            while let Some(end) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                if let Ok(record) = serde_json::from_slice::<Value>(&line) {
                    if let (Some(node), Some(seq)) = (record["node"].as_str(), record["seq"].as_u64()) {
                        cursor.advance(node, seq);
                    }
                    print_record(&record, args.client.json);
                }
            }
        }
        if !args.follow {
            return Ok(0);
        }
    }
}

fn print_record(r: &Value, json: bool) {
    if json {
        println!("{r}");
        return;
    }
    let when = utc(r["time_ms"].as_i64().unwrap_or_default());
    let node = r["node"].as_str().unwrap_or("?");
    let who = format!("{node} {}@{} {}", r["handler"].as_str().unwrap_or("?"), r["version"], r["request_id"].as_str().unwrap_or("?"));
    match r["kind"].as_str() {
        Some("request") => {
            let limit = r["limit"].as_str().map(|l| format!(" limit={l}")).unwrap_or_default();
            let path = r["path"].as_str().unwrap_or("/");
            println!("{when} {who} {path} {} {:.0} ms{limit}", r["status"], r["duration_ms"].as_f64().unwrap_or_default());
        }
        _ => println!("{when} {who} | {}", r["line"].as_str().unwrap_or_default()),
    }
}

fn check(args: &CheckArgs) -> anyhow::Result<i32> {
    let report = crate::control::check_store(args.store.as_deref(), &args.data_dir)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for problem in &report.problems {
            println!("problem: {problem}");
        }
        println!(
            "{}: {} versions checked, {} temp files of interrupted writes",
            if report.ok { "ok" } else { "FAILED" },
            report.versions,
            report.temp_files
        );
    }
    Ok(if report.ok { 0 } else { 1 })
}

/// A usage report: CSV, or a table with each period's start in UTC.
fn print_usage(v: &Value, csv: bool) {
    let rows: Vec<crate::control::usage::UsageRow> = serde_json::from_value(v["rows"].clone()).unwrap_or_default();
    if csv {
        print!("{}", crate::control::usage::to_csv(&rows));
        return;
    }
    use crate::telemetry::usage::Usage;
    let headings: Vec<String> = Usage::COLUMNS.iter().map(|(heading, _)| format!("{heading:>10}")).collect();
    println!("start (UTC)       {:<28}{}", "tenant/handler@version", headings.join(""));
    for r in &rows {
        let figures = r.usage.figures();
        let cells: Vec<String> = Usage::COLUMNS
            .iter()
            .zip(figures)
            .map(|((_, scale), v)| if *scale == 1.0 { format!("{v:>10}") } else { format!("{:>10.2}", v as f64 / scale) })
            .collect();
        println!("{}  {:<28}{}", utc(r.start_ms), format!("{}/{}@{}", r.tenant, r.handler, r.version), cells.join(""));
        for (model, part) in &r.models {
            println!("{:18}  on {model}: {:.2} device s, {} calls", "", part.device_us as f64 / 1e6, part.infer_calls);
        }
    }
}

/// `ms` after the Unix epoch as `YYYY-MM-DD HH:MM` UTC (the civil-from-days
/// algorithm of Howard Hinnant's date library).
fn utc(ms: i64) -> String {
    let (days, minutes) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000) / 60_000);
    let (year, month, day) = crate::telemetry::dates::civil_from_days(days);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}", minutes / 60, minutes % 60)
}

#[cfg(test)]
mod usage_tests {
    use super::utc;

    #[test]
    fn periods_print_in_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00");
        assert_eq!(utc(1_796_356_800_000 + 3_660_000), "2026-12-04 05:01");
    }
}
