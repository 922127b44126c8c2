//! Devices as operators name them (`cpu`, `cuda:N`, `tensorrt:N`), and the
//! engines opened on them.
//!
//! Every device kind is declared once, as a row of the `device_kinds!`
//! table below: its spelling in `--devices`, whether it takes an ordinal,
//! whether it computes on the host's CPU, the cargo feature it needs and
//! how its ONNX Runtime execution provider is registered. Parsing and
//! printing a [`DeviceSpec`], opening it ([`open`]), the gateway's help
//! text and its checks all read that table; nothing else matches on kinds.
//!
//! Adding a kind: its provider registration in a file of its own under
//! `device/` (`#![cfg(feature = "…")]`, a `pub(super) fn register`), its
//! `mod` line below, and its row in the table (plus its cargo feature in
//! `Cargo.toml`). See docs/architecture.md, "Adding a device kind".

mod cuda;
mod tensorrt;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use ort::session::builder::SessionBuilder;

use crate::backend::onnx::{ImageModelConfig, OnnxBackend};
use crate::backend::{Backend, BackendError};

/// Declares [`DeviceKind`], one variant per row, and [`DeviceKind::info`],
/// the row itself: the compiler then holds every kind to a complete row.
macro_rules! device_kinds {
    ($( $(#[doc = $doc:literal])+ $variant:ident => $row:expr; )+) => {
        /// A kind of device a model can run on; [`DeviceKind::info`] says
        /// what it needs.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum DeviceKind {
            $( $(#[doc = $doc])+ $variant, )+
        }

        impl DeviceKind {
            /// Every kind, in the table's order (the order help and errors list them in).
            pub const ALL: &'static [DeviceKind] = &[$(Self::$variant),+];

            /// This kind's row of the table.
            pub const fn info(self) -> &'static Kind {
                match self {
                    $( Self::$variant => {
                        const ROW: Kind = $row;
                        &ROW
                    } )+
                }
            }
        }
    };
}

/// A provider registered by `$register` (a [`Register`]), compiled only
/// with cargo feature `$feature`; without it, opening the kind fails
/// saying which feature to build with.
macro_rules! gated {
    ($feature:literal, $register:path) => {
        Provider::Gated {
            feature: $feature,
            register: {
                #[cfg(feature = $feature)]
                let register: Option<Register> = Some($register);
                #[cfg(not(feature = $feature))]
                let register: Option<Register> = None;
                register
            },
        }
    };
}

device_kinds! {
    /// The host's CPU, as [`OpenOptions::cpu_workers`] sessions of ONNX
    /// Runtime's built-in provider.
    Cpu => Kind { name: "cpu", title: "CPU", ordinal: false, host_cpu: true, provider: Provider::Builtin };
    /// NVIDIA GPU N through ONNX Runtime's CUDA execution provider.
    Cuda => Kind { name: "cuda", title: "CUDA", ordinal: true, host_cpu: false, provider: gated!("cuda", cuda::register) };
    /// NVIDIA GPU N through TensorRT (CUDA for what TensorRT cannot run).
    TensorRt => Kind { name: "tensorrt", title: "TensorRT", ordinal: true, host_cpu: false, provider: gated!("tensorrt", tensorrt::register) };
}

/// A row of the device table: what one [`DeviceKind`] needs.
#[derive(Debug)]
pub struct Kind {
    /// Its name in `--devices` specs, before any `:N`.
    pub name: &'static str,
    /// Its name in prose and errors ("support for CUDA was disabled…").
    pub title: &'static str,
    /// Whether a spec names one device of the kind by ordinal (`cuda:N`);
    /// without one it is the single device there is (`cpu`).
    pub ordinal: bool,
    /// Whether it computes on the host's CPU: it then opens
    /// [`OpenOptions::cpu_workers`] sessions (else one per spec) with
    /// [`OpenOptions::cpu_threads`] intra-op threads pinned to
    /// [`OpenOptions::cpu_cores`], and adaptive sizing starts its batches at
    /// one sample and times them by CPU time
    /// ([`Backend::runs_on_cpu`]); else at `max_batch`, by wall time.
    pub host_cpu: bool,
    /// How its execution provider joins a session.
    pub(crate) provider: Provider,
}

/// How a kind's execution provider is added to an ONNX Runtime session.
#[derive(Debug)]
pub(crate) enum Provider {
    /// ONNX Runtime's built-in CPU provider: nothing to register.
    Builtin,
    /// Registered by `register`, compiled only with cargo feature `feature`
    /// (`None` when it is off).
    Gated {
        /// The host-gpu cargo feature that compiles the provider in.
        feature: &'static str,
        /// The registration; `None` in a build without `feature`.
        register: Option<Register>,
    },
}

/// Adds a kind's execution provider to a session about to open `target`.
pub(crate) type Register = fn(SessionBuilder, &Target<'_>) -> ort::Result<SessionBuilder>;

/// What a provider's registration is told of the session it joins.
#[allow(dead_code, reason = "read by the providers compiled in: none in a build without GPU features")]
pub(crate) struct Target<'a> {
    /// The device's ordinal (0 for kinds without one).
    pub ordinal: i32,
    /// The model the session will run (TensorRT sizes its profile by it).
    pub model: &'a ImageModelConfig,
    /// Where an engine may cache what it builds ([`OpenOptions::cache_dir`]).
    pub cache_dir: Option<&'a Path>,
}

impl Kind {
    /// The cargo feature of host-gpu this kind needs, if any.
    pub fn feature(&self) -> Option<&'static str> {
        match self.provider {
            Provider::Builtin => None,
            Provider::Gated { feature, .. } => Some(feature),
        }
    }

    /// How a spec of this kind is written: `cpu`, `cuda:N`.
    pub fn usage(&self) -> String {
        if self.ordinal { format!("{}:N", self.name) } else { self.name.to_owned() }
    }

    /// Adds this kind's execution provider to `builder`, or says which
    /// feature this build lacks for it.
    pub(crate) fn register(&self, builder: SessionBuilder, target: &Target<'_>) -> ort::Result<SessionBuilder> {
        match self.provider {
            Provider::Builtin => Ok(builder),
            Provider::Gated { register: Some(register), .. } => register(builder, target),
            Provider::Gated { feature, register: None } => {
                Err(ort::Error::new(format!("support for {} was disabled at compile time (build with --features {feature})", self.title)))
            }
        }
    }
}

/// One device of `--devices`: where a model's batches may run.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceSpec {
    kind: DeviceKind,
    /// 0 for kinds without ordinals, so that equal devices compare equal.
    ordinal: i32,
}

impl DeviceSpec {
    /// Device `ordinal` of `kind`; the ordinal is ignored for kinds without one.
    pub const fn new(kind: DeviceKind, ordinal: i32) -> Self {
        Self { kind, ordinal: if kind.info().ordinal { ordinal } else { 0 } }
    }

    /// Its kind.
    pub const fn kind(self) -> DeviceKind {
        self.kind
    }

    /// Its ordinal, for kinds that take one.
    pub const fn ordinal(self) -> Option<i32> {
        if self.kind.info().ordinal { Some(self.ordinal) } else { None }
    }
}

impl From<DeviceKind> for DeviceSpec {
    /// The kind's device 0 (or its only device).
    fn from(kind: DeviceKind) -> Self {
        Self::new(kind, 0)
    }
}

/// Every spelling, for errors: `cpu, cuda:N or tensorrt:N`.
fn spellings() -> String {
    or_list(&DeviceKind::ALL.iter().map(|kind| kind.info().usage()).collect::<Vec<_>>())
}

/// `a, b or c`.
fn or_list(items: &[String]) -> String {
    match items.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => items.concat(),
    }
}

impl FromStr for DeviceSpec {
    type Err = String;

    /// Parses a kind's name, with `:N` (N a non-negative ordinal) for kinds
    /// that take one: `cpu`, `cuda:N` or `tensorrt:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, ordinal) = match s.split_once(':') {
            Some((name, n)) => (name, Some(n)),
            None => (s, None),
        };
        let kind = DeviceKind::ALL
            .iter()
            .copied()
            .find(|kind| kind.info().name == name && kind.info().ordinal == ordinal.is_some())
            .ok_or_else(|| format!("unknown device {s:?}: use {}", spellings()))?;
        let ordinal = match ordinal {
            Some(n) => n.parse::<i32>().ok().filter(|n| *n >= 0).ok_or_else(|| format!("bad device ordinal in {s:?}"))?,
            None => 0,
        };
        Ok(Self::new(kind, ordinal))
    }
}

impl fmt::Display for DeviceSpec {
    /// The spelling [`DeviceSpec::from_str`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.info().name)?;
        match self.ordinal() {
            Some(n) => write!(f, ":{n}"),
            None => Ok(()),
        }
    }
}

impl fmt::Debug for DeviceSpec {
    /// `Cpu`, `Cuda(0)`: as logs and the bench printed it when each kind
    /// was a variant of its own.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.kind)?;
        match self.ordinal() {
            Some(n) => write!(f, "({n})"),
            None => Ok(()),
        }
    }
}

/// How devices are set up when opened: the CPU's share of sessions and
/// threads, and where engines cache what they build.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Sessions (device workers) on the CPU, each pulling its own batches.
    pub cpu_workers: usize,
    /// Intra-op threads per CPU session.
    pub cpu_threads: usize,
    /// Cores the CPU sessions are pinned to; empty: not pinned.
    pub cpu_cores: Vec<usize>,
    /// TensorRT's engine and timing cache, so restarts skip the build.
    pub cache_dir: Option<PathBuf>,
}

/// Opens `model` on `spec`: one backend per device worker (one per GPU,
/// [`OpenOptions::cpu_workers`] on the CPU). ONNX Runtime must have been
/// loaded ([`crate::backend::onnx::init_onnx_runtime`]).
pub fn open(spec: DeviceSpec, model: &ImageModelConfig, options: &OpenOptions) -> Result<Vec<Box<dyn Backend>>, BackendError> {
    let sessions = if spec.kind().info().host_cpu { options.cpu_workers.max(1) } else { 1 };
    (0..sessions)
        .map(|_| {
            let backend = OnnxBackend::new(model.clone(), spec, options)
                .map_err(|e| BackendError(format!("cannot start the model on {spec}: {e}")))?;
            Ok(Box::new(backend) as Box<dyn Backend>)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_device_reads_back_as_it_is_written() {
        for &kind in DeviceKind::ALL {
            let spec = DeviceSpec::new(kind, 3);
            assert_eq!(spec.to_string().parse::<DeviceSpec>(), Ok(spec));
        }
        assert_eq!("cuda:1".parse::<DeviceSpec>(), Ok(DeviceSpec::new(DeviceKind::Cuda, 1)));
        assert_eq!(DeviceSpec::from(DeviceKind::Cpu).to_string(), "cpu");
        assert_eq!(format!("{:?}", ["cpu", "tensorrt:2"].map(|s| s.parse::<DeviceSpec>().unwrap())), "[Cpu, TensorRt(2)]");
    }

    #[test]
    fn unknown_devices_and_bad_ordinals_are_refused_with_the_spelling() {
        for bad in ["gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "tensorrt:1.5", ""] {
            let err = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{bad}: {err}");
        }
        let err = "gpu".parse::<DeviceSpec>().unwrap_err();
        assert_eq!(err, format!("unknown device \"gpu\": use {}", spellings()));
        assert!(spellings().starts_with("cpu, cuda:N"), "{err}");
        let list = |items: &[&str]| or_list(&items.iter().map(|item| (*item).to_owned()).collect::<Vec<_>>());
        assert_eq!(list(&["cpu", "cuda:N", "tensorrt:N"]), "cpu, cuda:N or tensorrt:N");
        assert_eq!((list(&["cpu"]), list(&[])), ("cpu".to_owned(), String::new()));
    }

    /// Every name is spelled once, and a kind needing a feature that this
    /// build lacks says which.
    #[test]
    fn the_table_names_each_kind_once_and_its_feature() {
        let names: std::collections::BTreeSet<_> = DeviceKind::ALL.iter().map(|kind| kind.info().name).collect();
        assert_eq!(names.len(), DeviceKind::ALL.len());
        assert_eq!(DeviceKind::Cuda.info().feature(), Some("cuda"));
        assert_eq!(DeviceKind::Cpu.info().feature(), None);
    }
}
