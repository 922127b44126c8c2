//! The open-file limit the connection caps need. Every connection is a file
//! descriptor: past the process's limit (`RLIMIT_NOFILE`, often 1024 by
//! default) `accept` fails for everyone, whatever `--max-connections` says.
//! The caps counted are the client connections' (`--max-connections` per
//! listener, with their evictions and reserve) and the handlers' outgoing
//! connections' (`--outgoing-max-connections`). At start the soft limit is
//! raised to fit them, or, where the hard limit is lower, the client
//! connections' cap is lowered to fit it, with a warning.

use crate::config::ServeConfig;

use super::conn::{ADMIN_RESERVE_CONNECTIONS, EVICTION_BACKLOG};

/// Descriptors the process holds besides client and outgoing connections:
/// the store (SQLite's files, PostgreSQL's pool), the model, components and
/// artifacts being read, the listeners, name lookups' sockets, and the
/// runtime's own (epoll, eventfds, the compile threads' pipes, stdio). Some
/// tens at rest; the margin is for bursts of them.
pub const OTHER_DESCRIPTORS: u64 = 1024;

/// How the listeners are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listeners {
    /// One listener serving everything, with the admin reserve.
    Shared,
    /// `--listen` and `--admin-listen`, each with its own cap and no reserve.
    Split,
}

impl Listeners {
    /// The layout `config` asks for.
    pub fn of(config: &ServeConfig) -> Self {
        if config.admin_listen.is_some() { Self::Split } else { Self::Shared }
    }

    fn count(self) -> u64 {
        match self {
            Self::Shared => 1,
            Self::Split => 2,
        }
    }

    /// Descriptors beyond `--max-connections` per listener: evicted
    /// connections still closing, the admin reserve, `outgoing` connections
    /// (`--outgoing-max-connections`), everything else.
    fn fixed(self, outgoing: u32) -> u64 {
        let reserve = if self == Self::Shared { ADMIN_RESERVE_CONNECTIONS as u64 } else { 0 };
        self.count() * EVICTION_BACKLOG as u64 + reserve + u64::from(outgoing) + OTHER_DESCRIPTORS
    }
}

/// Descriptors a gateway with `max_connections` per listener and at most
/// `outgoing` outgoing connections may hold at once.
pub fn descriptors_needed(max_connections: u32, outgoing: u32, listeners: Listeners) -> u64 {
    listeners.count() * u64::from(max_connections) + listeners.fixed(outgoing)
}

/// What to set: the soft limit and the connection cap per listener.
#[derive(Debug, PartialEq, Eq)]
struct Fit {
    soft: u64,
    max_connections: u32,
}

/// The soft limit and cap for `max_connections` (and `outgoing`, never
/// lowered: handlers' requests fail past it, clients' connections are
/// closed) under `current` (soft) and `hard` limits (`None`: unlimited). A
/// soft limit already high enough is kept; an error when the hard limit
/// leaves no room for one connection.
fn fit(max_connections: u32, outgoing: u32, listeners: Listeners, current: Option<u64>, hard: Option<u64>) -> Result<Fit, String> {
    let needed = descriptors_needed(max_connections, outgoing, listeners);
    if current.is_none_or(|soft| soft >= needed) {
        return Ok(Fit { soft: current.unwrap_or(u64::MAX), max_connections });
    }
    match hard {
        Some(hard) if hard < needed => {
            let fitting = hard.saturating_sub(listeners.fixed(outgoing)) / listeners.count();
            if fitting == 0 {
                return Err(format!(
                    "the open-file hard limit ({hard}) leaves no room for client connections: at least {} are needed besides them ({outgoing} for --outgoing-max-connections); raise it (ulimit -Hn, LimitNOFILE=, the container runtime's nofile) or lower --outgoing-max-connections",
                    listeners.fixed(outgoing)
                ));
            }
            Ok(Fit { soft: hard, max_connections: u32::try_from(fitting).unwrap_or(max_connections).min(max_connections) })
        }
        _ => Ok(Fit { soft: needed, max_connections }),
    }
}

/// Raises the soft open-file limit to what `config`'s connection caps,
/// client and outgoing, need (see [`descriptors_needed`]); where the hard
/// limit is lower, raises it to the hard limit and lowers
/// `config.max_connections` to fit, with a warning. Fails only when not even
/// one connection per listener fits.
pub fn fit_connections(config: &mut ServeConfig) -> anyhow::Result<()> {
    let listeners = Listeners::of(config);
    let outgoing = config.outgoing_max_connections;
    let (current, hard) = limits();
    let fit = fit(config.max_connections, outgoing, listeners, current, hard).map_err(anyhow::Error::msg)?;
    if let Some(soft) = current.filter(|&soft| soft < fit.soft) {
        set_soft(fit.soft)?;
        tracing::info!(from = soft, to = fit.soft, "raised the open-file limit for the connection caps");
    }
    if fit.max_connections < config.max_connections {
        tracing::warn!(
            wanted = config.max_connections,
            max_connections = fit.max_connections,
            hard_limit = fit.soft,
            needed = descriptors_needed(config.max_connections, outgoing, listeners),
            outgoing_max_connections = outgoing,
            "the open-file hard limit is too low for --max-connections: lowered to fit (raise the limit: ulimit -Hn, LimitNOFILE=, the container runtime's nofile)"
        );
        config.max_connections = fit.max_connections;
    }
    Ok(())
}

/// Raises the soft open-file limit to `wanted`, or to the hard limit if
/// that is lower; never lowers it. Returns the soft limit now in force
/// (`None`: unlimited).
pub fn raise_soft_limit(wanted: u64) -> anyhow::Result<Option<u64>> {
    let (current, hard) = limits();
    let target = hard.map_or(wanted, |hard| wanted.min(hard));
    match current {
        Some(soft) if soft < target => {
            set_soft(target)?;
            Ok(Some(target))
        }
        other => Ok(other),
    }
}

/// The soft and hard open-file limits (`None`: unlimited).
#[cfg(target_os = "linux")]
fn limits() -> (Option<u64>, Option<u64>) {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    (limit.current, limit.maximum)
}

#[cfg(target_os = "linux")]
fn set_soft(soft: u64) -> anyhow::Result<()> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let maximum = getrlimit(Resource::Nofile).maximum;
    setrlimit(Resource::Nofile, Rlimit { current: Some(soft), maximum })
        .map_err(|e| anyhow::anyhow!("cannot raise the open-file limit to {soft}: {e}"))
}

/// Elsewhere the limits are left as they are (reported as unlimited).
#[cfg(not(target_os = "linux"))]
fn limits() -> (Option<u64>, Option<u64>) {
    (None, None)
}

#[cfg(not(target_os = "linux"))]
fn set_soft(_soft: u64) -> anyhow::Result<()> {
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]
mod tests {
    use super::*;

    /// Outgoing connections: the default cap.
    const OUT: u32 = crate::sandbox::outgoing::DEFAULT_MAX_CONNECTIONS;
    const FIXED_SHARED: u64 = EVICTION_BACKLOG as u64 + ADMIN_RESERVE_CONNECTIONS as u64 + OUT as u64 + OTHER_DESCRIPTORS;

    #[test]
    fn each_listener_counts_its_cap_and_evictions_and_the_shared_one_its_reserve() {
        assert_eq!(descriptors_needed(4096, OUT, Listeners::Shared), 4096 + FIXED_SHARED);
        assert_eq!(
            descriptors_needed(4096, OUT, Listeners::Split),
            2 * (4096 + EVICTION_BACKLOG as u64) + u64::from(OUT) + OTHER_DESCRIPTORS
        );
    }

    #[test]
    fn outgoing_connections_count_once_whatever_the_listeners() {
        for listeners in [Listeners::Shared, Listeners::Split] {
            assert_eq!(descriptors_needed(4096, 1000, listeners) - descriptors_needed(4096, 0, listeners), 1000);
        }
    }

    #[test]
    fn the_soft_limit_is_raised_to_what_is_needed() {
        let needed = descriptors_needed(4096, OUT, Listeners::Shared);
        assert_eq!(fit(4096, OUT, Listeners::Shared, Some(1024), Some(1 << 20)), Ok(Fit { soft: needed, max_connections: 4096 }));
        assert_eq!(fit(4096, OUT, Listeners::Shared, Some(1024), None), Ok(Fit { soft: needed, max_connections: 4096 }), "no hard limit");
    }

    #[test]
    fn a_soft_limit_high_enough_is_kept() {
        assert_eq!(fit(4096, OUT, Listeners::Shared, Some(1 << 20), Some(1 << 20)), Ok(Fit { soft: 1 << 20, max_connections: 4096 }));
        assert_eq!(fit(4096, OUT, Listeners::Shared, None, None), Ok(Fit { soft: u64::MAX, max_connections: 4096 }));
    }

    #[test]
    fn a_low_hard_limit_lowers_the_cap_to_fit() {
        let hard = 4096;
        let fitted = fit(4096, OUT, Listeners::Shared, Some(1024), Some(hard)).unwrap();
        assert_eq!(fitted, Fit { soft: hard, max_connections: (hard - FIXED_SHARED) as u32 });
        assert_eq!(descriptors_needed(fitted.max_connections, OUT, Listeners::Shared), hard, "the lowered cap fills the limit exactly");
        let split = fit(4096, OUT, Listeners::Split, Some(1024), Some(hard)).unwrap();
        assert!(descriptors_needed(split.max_connections, OUT, Listeners::Split) <= hard, "{split:?}");
        assert!(descriptors_needed(split.max_connections + 1, OUT, Listeners::Split) > hard, "{split:?}");
        let more_outgoing = fit(4096, 2 * OUT, Listeners::Shared, Some(1024), Some(hard)).unwrap();
        assert_eq!(more_outgoing.max_connections, fitted.max_connections - OUT, "outgoing connections take their room first");
    }

    #[test]
    fn a_hard_limit_with_no_room_for_connections_is_an_error() {
        let err = fit(4096, OUT, Listeners::Shared, Some(256), Some(FIXED_SHARED)).unwrap_err();
        assert!(err.contains("ulimit -Hn") && err.contains("--outgoing-max-connections"), "{err}");
    }
}
