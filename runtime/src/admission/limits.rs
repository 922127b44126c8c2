//! A tenant's limits, each declared once, in the `tenant_limits!` table
//! below: its doc (the `--help` of its flags and the API reference), its
//! name (the admin API's field and the tenant commands' `--<name>`; flags
//! spell with hyphens what field names spell with underscores), its
//! type, its built-in default, the `facegate serve` flag that sets every
//! tenant's default, and its rule. A tenant stores only what it overrides;
//! the server's defaults are, for memory and body size, also the ceilings
//! (the engine's instance slots are sized by them). [`Limit`] names what a
//! request can run into, as `facegate_limit_hits_total` counts it.
//!
//! A new limit is a row here, the code that enforces it, and its test.

use std::fmt::Display;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::admission::models::ModelAllow;

/// Slowest sustained rate a tenant may be given (one request in 1000 s).
pub const MIN_RPS: f64 = 0.001;
/// Most requests one instance may serve: past it a fresh one starts, so a
/// handler's slow leaks (memory, state) are bounded in time too.
pub const MAX_INSTANCE_REUSE: u32 = 100_000;
/// Default per-request deadline, milliseconds.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 10_000;
/// Default largest request body, bytes (16 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;
/// Default linear-memory limit of one handler instance, MiB.
pub const DEFAULT_MEMORY_LIMIT_MIB: usize = 256;
/// Default most `face-detect.infer` calls per request.
pub const DEFAULT_MAX_INFER_CALLS: u32 = 16;
/// Default most requests of one tenant in flight.
pub const DEFAULT_TENANT_MAX_CONCURRENCY: u32 = 32;
/// Default sustained requests per second of one tenant.
pub const DEFAULT_TENANT_RPS: f64 = 100.0;
/// Default token-bucket size of one tenant.
pub const DEFAULT_TENANT_BURST: u32 = 200;
/// Default calls per second of one tenant to the tenant API, on each node.
pub const DEFAULT_TENANT_API_RPS: f64 = 20.0;
/// Seconds of a tenant's API rate its bucket holds (the burst).
const API_BURST_SECONDS: f64 = 5.0;
/// Default largest response body a handler may send, bytes (64 MiB: a
/// blurred 50-megapixel JPEG, several times over).
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 64 << 20;
/// Default versions kept of each handler (rollback reaches back this far).
pub const DEFAULT_MAX_VERSIONS: u32 = 20;
/// Default handlers one tenant may have.
pub const DEFAULT_MAX_HANDLERS: u32 = 32;
/// Default unrevoked API keys one tenant may have.
pub const DEFAULT_MAX_KEYS: u32 = 100;
/// Default most keys a tenant's state holds (`wasi:keyvalue`).
pub const DEFAULT_KV_KEYS: u64 = 100_000;
/// Default most bytes a tenant's state holds (64 MiB).
pub const DEFAULT_KV_BYTES: u64 = 64 << 20;
/// Default largest value in a tenant's state (1 MiB).
pub const DEFAULT_KV_VALUE_BYTES: u64 = 1 << 20;
/// Default most keys one request reads or writes.
pub const DEFAULT_KV_OPS: u32 = 1000;
/// Most versions, handlers or keys a tenant may be given.
const MAX_STORED: u32 = 10_000;

/// Declares the tenant limits: `flags` have a `facegate serve` flag (and
/// environment variable) for every tenant's default; `fixed` ones have a
/// built-in default only. Generates [`TenantLimits`] (as flags, flattened
/// into `ServeConfig`), [`LimitOverrides`] (the API's `limits` JSON and the
/// tenant commands' flags), the defaults, `with`, `validate` and `merge`.
macro_rules! tenant_limits {
    (
        flags { $(
            $(#[doc = $doc:literal])+
            $name:ident: $ty:ty = $default:expr, flag $long:literal, env $env:literal $(, parser $parser:expr)?, rule $rule:expr;
        )+ }
        fixed { $(
            $(#[doc = $fixed_doc:literal])+
            $fixed:ident: $fixed_ty:ty = $fixed_default:expr, rule $fixed_rule:expr;
        )* }
    ) => {
        /// A tenant's effective limits. As `facegate serve` flags, every
        /// tenant's defaults; for `memory_mib` and `max_body_bytes` also the
        /// ceilings.
        #[derive(Debug, Clone, Copy, PartialEq, Serialize, clap::Args)]
        pub struct TenantLimits {
            $(
                $(#[doc = $doc])+
                #[arg(long = $long, env = $env, default_value_t = $default $(, value_parser = $parser)?)]
                pub $name: $ty,
            )+
            $(
                $(#[doc = $fixed_doc])+
                #[arg(skip = { let default: $fixed_ty = $fixed_default; default })]
                pub $fixed: $fixed_ty,
            )*
        }

        /// What a tenant overrides; absent fields follow the server's
        /// defaults. The admin API's `limits` JSON and the tenant commands'
        /// flags.
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, clap::Args)]
        #[serde(deny_unknown_fields)]
        pub struct LimitOverrides {
            $(
                $(#[doc = $doc])+
                #[arg(long)]
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $name: Option<$ty>,
            )+
            $(
                $(#[doc = $fixed_doc])+
                #[arg(long)]
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $fixed: Option<$fixed_ty>,
            )*
        }

        impl Default for TenantLimits {
            /// The built-in defaults: `facegate serve` with no flags and no environment.
            fn default() -> Self {
                Self { $($name: $default,)+ $($fixed: $fixed_default,)* }
            }
        }

        impl TenantLimits {
            /// Every limit's name, as the API, the tenant flags and the docs spell it.
            pub const NAMES: &'static [&'static str] = &[$(stringify!($name),)+ $(stringify!($fixed),)*];

            /// Every limit as a form shows it (the console's limits form), in table order.
            pub const FIELDS: &'static [LimitField] = &[
                $( LimitField { name: stringify!($name), help: concat!($($doc),+), kind: <$ty as LimitValue>::KIND }, )+
                $( LimitField { name: stringify!($fixed), help: concat!($($fixed_doc),+), kind: <$fixed_ty as LimitValue>::KIND }, )*
            ];

            /// These defaults with `o` applied.
            pub fn with(&self, o: &LimitOverrides) -> Self {
                Self { $($name: o.$name.unwrap_or(self.$name),)+ $($fixed: o.$fixed.unwrap_or(self.$fixed),)* }
            }

            /// Checks `o` against these defaults, each limit by its rule, in
            /// table order; the first broken one is named.
            pub fn validate(&self, o: &LimitOverrides) -> Result<(), String> {
                let l = self.with(o);
                $( check::<$ty>(stringify!($name), $rule, l.$name, self.$name)?; )+
                $( check::<$fixed_ty>(stringify!($fixed), $fixed_rule, l.$fixed, self.$fixed)?; )*
                Ok(())
            }
        }

        impl LimitOverrides {
            /// Fields set in `other` replace those here.
            pub fn merge(&mut self, other: &Self) {
                $( if other.$name.is_some() { self.$name = other.$name; } )+
                $( if other.$fixed.is_some() { self.$fixed = other.$fixed; } )*
            }
        }
    };
}

tenant_limits! {
    flags {
        /// Memory of one handler instance (all its linear memories and
        /// tables), MiB; past it the guest traps (500). The server's value is
        /// also every tenant's ceiling.
        memory_mib: usize = DEFAULT_MEMORY_LIMIT_MIB, flag "memory-limit-mib", env "FACEGATE_MEMORY_LIMIT_MIB", rule up_to_default(1);
        /// Deadline of one request (guest CPU, queueing and inference
        /// together), ms; past it 504.
        timeout_ms: u64 = DEFAULT_REQUEST_TIMEOUT_MS, flag "request-timeout-ms", env "FACEGATE_REQUEST_TIMEOUT_MS", rule within(1, 600_000);
        /// Requests of one tenant in flight at once; more get 429.
        max_concurrency: u32 = DEFAULT_TENANT_MAX_CONCURRENCY, flag "tenant-max-concurrency", env "FACEGATE_TENANT_MAX_CONCURRENCY", rule at_least(1);
        /// Sustained requests per second of one tenant (0: unlimited); more get 429.
        rps: f64 = DEFAULT_TENANT_RPS, flag "tenant-rps", env "FACEGATE_TENANT_RPS", rule rate;
        /// Requests that may arrive at once above the sustained rate (the
        /// token bucket's size).
        burst: u32 = DEFAULT_TENANT_BURST, flag "tenant-burst", env "FACEGATE_TENANT_BURST", rule at_least(1);
        /// Calls per second the tenant's keys may make to the tenant API
        /// (`/tenant/v1/`: deploys, listings, usage, logs) on each node,
        /// with five seconds' worth at once (0: unlimited); more get 429
        /// `api_rate_limited`. Each node counts its own, unlike `rps`: a
        /// log read asks every live node, and each one counts it.
        api_rps: f64 = DEFAULT_TENANT_API_RPS, flag "tenant-api-rps", env "FACEGATE_TENANT_API_RPS", rule rate;
        /// Largest request body, bytes; larger bodies get 413. The server's
        /// value is also every tenant's ceiling.
        max_body_bytes: usize = DEFAULT_MAX_BODY_BYTES, flag "max-body-bytes", env "FACEGATE_MAX_BODY_BYTES", rule up_to_default(1);
        /// Largest response body a handler may send, bytes: a declared
        /// length past it ends the request with 502 `response_too_large`; a
        /// body streamed past it is cut there.
        max_response_bytes: usize = DEFAULT_MAX_RESPONSE_BYTES, flag "max-response-bytes", env "FACEGATE_MAX_RESPONSE_BYTES", rule at_least(1);
        /// `face-detect.infer` calls one request may make.
        max_infer_calls: u32 = DEFAULT_MAX_INFER_CALLS, flag "max-infer-calls", env "FACEGATE_MAX_INFER_CALLS", rule at_most(1024);
        /// Requests one handler instance may serve, one after another (1: a
        /// fresh instance for every request, nothing of one request is left
        /// for the next). Above 1, an instance whose request ended cleanly
        /// is kept for the next request to the same handler version: no
        /// instantiation or memory reset, but the handler's globals persist
        /// between its requests (see `crate::sandbox::warm`).
        instance_reuse: u32 = 1, flag "instance-reuse", env "FACEGATE_INSTANCE_REUSE",
            parser clap::value_parser!(u32).range(1..=i64::from(MAX_INSTANCE_REUSE)), rule within(1, MAX_INSTANCE_REUSE);
        /// Versions kept of each of the tenant's handlers: an upload past it
        /// deletes the oldest ones that are neither active nor a canary
        /// (and the stored components no version uses any more), so what a
        /// tenant stores stays bounded however often it deploys.
        max_versions: u32 = DEFAULT_MAX_VERSIONS, flag "max-versions", env "FACEGATE_MAX_VERSIONS",
            parser clap::value_parser!(u32).range(1..=i64::from(MAX_STORED)), rule within(1, MAX_STORED);
        /// Handlers the tenant may have; the upload of one more is refused
        /// (403 `quota_exceeded`).
        max_handlers: u32 = DEFAULT_MAX_HANDLERS, flag "max-handlers", env "FACEGATE_MAX_HANDLERS",
            parser clap::value_parser!(u32).range(1..=i64::from(MAX_STORED)), rule within(1, MAX_STORED);
        /// API keys the tenant may have that are not revoked (its invoke,
        /// deploy and read keys together); creating one more is refused
        /// (403 `quota_exceeded`) until one is revoked.
        max_keys: u32 = DEFAULT_MAX_KEYS, flag "max-keys", env "FACEGATE_MAX_KEYS",
            parser clap::value_parser!(u32).range(1..=i64::from(MAX_STORED)), rule within(1, MAX_STORED);
        /// Settings and secrets the tenant may have (`facegate config set`,
        /// `secret set`), all its handlers together; one more: 403 `quota_exceeded`.
        settings: u32 = 64, flag "max-settings", env "FACEGATE_MAX_SETTINGS", rule within(0, 10_000);
        /// Longest value of one setting or secret, bytes; longer: 403 `quota_exceeded`.
        setting_bytes: u64 = 8 << 10, flag "max-setting-bytes", env "FACEGATE_MAX_SETTING_BYTES", rule within(1, 1 << 20);
        /// Bytes all the tenant's settings may take (values as stored, a
        /// secret's sealed); past it: 403 `quota_exceeded`. Every node's
        /// snapshot holds them.
        settings_bytes: u64 = 64 << 10, flag "max-settings-bytes", env "FACEGATE_MAX_SETTINGS_BYTES", rule within(0, 16 << 20);
        /// Keys the tenant's handlers may keep in their state
        /// (`wasi:keyvalue`), all buckets together; a write of one more
        /// fails with an error naming this limit.
        kv_keys: u64 = DEFAULT_KV_KEYS, flag "kv-max-keys", env "FACEGATE_KV_MAX_KEYS", rule any;
        /// Bytes the tenant's state may hold (bucket names, keys and values
        /// together); a write that would grow it past this fails.
        kv_bytes: u64 = DEFAULT_KV_BYTES, flag "kv-max-bytes", env "FACEGATE_KV_MAX_BYTES", rule any;
        /// Largest value the tenant's state may hold, bytes; also what a
        /// read of one key is charged to the node's memory before it is
        /// made. The server's value is also every tenant's ceiling.
        kv_value_bytes: u64 = DEFAULT_KV_VALUE_BYTES, flag "kv-max-value-bytes", env "FACEGATE_KV_MAX_VALUE_BYTES", rule up_to_default(0);
        /// Keys one request may read or write in its tenant's state (each
        /// key of a batch counts, a listing counts one); past it, an error.
        kv_ops: u32 = DEFAULT_KV_OPS, flag "kv-max-ops", env "FACEGATE_KV_MAX_OPS", rule any;
    }
    fixed {
        /// Share of device time when tenants compete (the fair queue's
        /// weight; `--tenant-weight` sets it per tenant at start).
        weight: u32 = 1, rule within(1, 1000);
        /// Whether handlers may import `wasi:http/outgoing-handler` and
        /// send requests: true or false.
        outgoing_http: bool = false, rule any;
        /// Models the tenant's handlers may call: `*` (every model the node
        /// serves) or names, comma-separated. Another model is, to the
        /// handler, a model the host does not serve (`unknown-model`), and
        /// `models()` lists only these.
        models: ModelAllow = ModelAllow::ALL, rule any;
    }
}

impl TenantLimits {
    /// The request deadline as a duration.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// The tenant API's token-bucket size: five seconds of `api_rps`, at
    /// least one call.
    pub fn api_burst(&self) -> u32 {
        // `as` saturates: a huge rate is a bucket of u32::MAX, never a panic.
        (self.api_rps * API_BURST_SECONDS).ceil().max(1.0) as u32
    }
}

/// Applies `rule` to a limit's `value`, given the server's `default` (some
/// rules take it as a ceiling); the refusal names the limit.
/// What kind of value a limit takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    /// A whole number.
    Integer,
    /// A number with a fraction (a rate).
    Number,
    /// On or off.
    Flag,
    /// Words (a list of names).
    Text,
}

/// A limit as a form shows it (see [`TenantLimits::FIELDS`]).
#[derive(Debug, Clone, Copy)]
pub struct LimitField {
    /// Its name (the API's, the flags').
    pub name: &'static str,
    /// Its doc comment.
    pub help: &'static str,
    /// Its kind of value.
    pub kind: LimitKind,
}

/// The kind of value of a limit's type.
trait LimitValue {
    const KIND: LimitKind;
}

impl LimitValue for usize {
    const KIND: LimitKind = LimitKind::Integer;
}

impl LimitValue for u32 {
    const KIND: LimitKind = LimitKind::Integer;
}

impl LimitValue for u64 {
    const KIND: LimitKind = LimitKind::Integer;
}

impl LimitValue for f64 {
    const KIND: LimitKind = LimitKind::Number;
}

impl LimitValue for bool {
    const KIND: LimitKind = LimitKind::Flag;
}

impl LimitValue for ModelAllow {
    const KIND: LimitKind = LimitKind::Text;
}

fn check<T>(name: &str, rule: impl Fn(T, T) -> Result<(), String>, value: T, default: T) -> Result<(), String> {
    rule(value, default).map_err(|must| format!("{name} must be {must}"))
}

/// Between `lo` and `hi`, both included.
fn within<T: PartialOrd + Display + Copy>(lo: T, hi: T) -> impl Fn(T, T) -> Result<(), String> {
    move |v, _| if lo <= v && v <= hi { Ok(()) } else { Err(format!("{lo}..={hi}")) }
}

/// At least `lo`.
fn at_least<T: PartialOrd + Display + Copy>(lo: T) -> impl Fn(T, T) -> Result<(), String> {
    move |v, _| if v >= lo { Ok(()) } else { Err(format!("at least {lo}")) }
}

/// At most `hi`.
fn at_most<T: PartialOrd + Display + Copy>(hi: T) -> impl Fn(T, T) -> Result<(), String> {
    move |v, _| if v <= hi { Ok(()) } else { Err(format!("at most {hi}")) }
}

/// At least `lo`, and at most the server's default.
fn up_to_default<T: PartialOrd + Display + Copy>(lo: T) -> impl Fn(T, T) -> Result<(), String> {
    move |v, d| if lo <= v && v <= d { Ok(()) } else { Err(format!("{lo}..={d}")) }
}

/// Anything.
fn any<T>(_: T, _: T) -> Result<(), String> {
    Ok(())
}

/// 0 (unlimited), or a finite rate of at least [`MIN_RPS`].
fn rate(v: f64, _: f64) -> Result<(), String> {
    if v == 0.0 || (v.is_finite() && v >= MIN_RPS) { Ok(()) } else { Err(format!("0 (unlimited) or at least {MIN_RPS}")) }
}

/// Which limit a request hit (the `limit` label of `facegate_limit_hits_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Limit {
    /// The tenant's token bucket (429).
    Rate,
    /// The tenant's tenant-API token bucket on this node (429).
    ApiRate,
    /// The tenant's requests in flight (429).
    Concurrency,
    /// No instance slot free for the tenant: pool full, or its fair share taken (503).
    Instances,
    /// Request body over the size limit (413).
    BodySize,
    /// Request body not received in time (408).
    BodyTimeout,
    /// The request deadline (504).
    Deadline,
    /// Linear memories and tables over the tenant's memory limit (500).
    Memory,
    /// The node's memory budget spent, or the tenant's fair share of it
    /// taken while memory is scarce (503).
    NodeMemory,
    /// Host resources (table entries, random bytes) over their limits (500).
    HostResources,
    /// Guest stdout/stderr past the capture cap (output dropped, request unaffected).
    Output,
    /// `face-detect.infer` calls past the per-request budget (`quota-exceeded` to the guest).
    InferCalls,
    /// Inference queue full, globally or for the tenant (`overloaded` to the guest).
    Queue,
    /// Outgoing connections at the tenant's or the node's cap (`connection-limit-reached` to the guest).
    OutgoingConnections,
    /// A response body over the tenant's `max_response_bytes` (502, or the body cut).
    ResponseSize,
    /// The inference work ahead would not end before the request's deadline:
    /// refused at admission (503) or at its `infer` call (`overloaded` to the guest).
    Backlog,
}

impl Limit {
    /// The limit's label in `facegate_limit_hits_total`.
    pub fn label(self) -> &'static str {
        match self {
            Limit::Rate => "rate",
            Limit::ApiRate => "api_rate",
            Limit::Concurrency => "concurrency",
            Limit::Instances => "instances",
            Limit::BodySize => "body_size",
            Limit::BodyTimeout => "body_timeout",
            Limit::Deadline => "deadline",
            Limit::Memory => "memory",
            Limit::NodeMemory => "memory_budget",
            Limit::HostResources => "host_resources",
            Limit::Output => "output",
            Limit::InferCalls => "infer_calls",
            Limit::Queue => "queue",
            Limit::OutgoingConnections => "outgoing_connections",
            Limit::ResponseSize => "response_size",
            Limit::Backlog => "backlog",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> TenantLimits {
        TenantLimits { burst: 100, ..TenantLimits::default() }
    }

    #[test]
    fn overrides_apply_and_ceilings_hold() {
        let o = LimitOverrides { memory_mib: Some(64), rps: Some(2.0), ..Default::default() };
        let l = defaults().with(&o);
        assert_eq!((l.memory_mib, l.rps, l.timeout_ms), (64, 2.0, 10_000));
        assert!(defaults().validate(&o).is_ok());
        let too_big = LimitOverrides { memory_mib: Some(512), ..Default::default() };
        assert!(defaults().validate(&too_big).unwrap_err().contains("memory_mib"));
        let zero = LimitOverrides { weight: Some(0), ..Default::default() };
        assert!(defaults().validate(&zero).unwrap_err().contains("weight"));
        for reuse in [0, MAX_INSTANCE_REUSE + 1] {
            let o = LimitOverrides { instance_reuse: Some(reuse), ..Default::default() };
            assert!(defaults().validate(&o).unwrap_err().contains("instance_reuse"), "{reuse}");
        }
        let warm = LimitOverrides { instance_reuse: Some(1000), ..Default::default() };
        assert_eq!(defaults().with(&warm).instance_reuse, 1000);
        for rps in [1e-30, -1.0, f64::NAN, f64::INFINITY] {
            let o = LimitOverrides { rps: Some(rps), ..Default::default() };
            assert!(defaults().validate(&o).unwrap_err().contains("rps"), "{rps}");
        }
    }

    #[test]
    fn unknown_limit_names_are_refused() {
        assert!(serde_json::from_str::<LimitOverrides>(r#"{"memroy_mib": 1}"#).is_err());
        let o: LimitOverrides = serde_json::from_str(r#"{"rps": 5}"#).unwrap();
        assert_eq!(o.rps, Some(5.0));
    }

    #[test]
    fn the_built_in_defaults_are_a_valid_tenants_limits() {
        let defaults = TenantLimits::default();
        assert_eq!(defaults.validate(&LimitOverrides::default()), Ok(()));
        assert_eq!((defaults.memory_mib, defaults.timeout_ms, defaults.instance_reuse), (256, 10_000, 1));
    }

    #[test]
    fn the_api_burst_is_five_seconds_of_the_rate_and_never_overflows() {
        let with = |api_rps| TenantLimits { api_rps, ..TenantLimits::default() }.api_burst();
        assert_eq!((with(20.0), with(0.5), with(0.001), with(1e300)), (100, 3, 1, u32::MAX));
    }

    #[test]
    fn every_limit_is_documented_in_the_operations_guide() {
        let guide = include_str!("../../../docs/operations.md");
        for name in TenantLimits::NAMES {
            assert!(guide.contains(&format!("`{name}`")), "docs/operations.md does not name the limit `{name}`");
        }
    }

    #[test]
    fn an_override_names_only_what_it_sets() {
        let o = LimitOverrides { rps: Some(5.0), ..Default::default() };
        assert_eq!(serde_json::to_value(&o).unwrap(), serde_json::json!({ "rps": 5.0 }));
        let mut merged = LimitOverrides { memory_mib: Some(64), rps: Some(1.0), ..Default::default() };
        merged.merge(&o);
        assert_eq!((merged.memory_mib, merged.rps), (Some(64), Some(5.0)));
    }
}
