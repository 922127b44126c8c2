//! Who is asking: the bearer token of a request, the client's address,
//! and what a wrong admin or metrics token costs the guesser (a delay, and
//! a rate-limited log line naming the addresses).

use std::collections::HashMap;
use std::net::IpAddr;
use std::net::SocketAddr;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};

use super::response::Body;

/// The bearer token of a request, if any.
pub(super) fn bearer(req: &Request<Incoming>) -> Option<&str> {
    let value = req.headers().get(hyper::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token.trim())
}

/// The client's address, in each request's extensions.
#[derive(Debug, Clone, Copy)]
pub(super) struct ClientAddr(pub(super) SocketAddr);

/// How long a request with a missing or wrong admin or metrics token waits
/// for its 401: guessing gets slow, the right token never waits. (The
/// connection caps bound how many such requests wait at once.)
pub const TOKEN_FAILURE_DELAY: Duration = Duration::from_millis(250);
/// At most one log line about refused tokens per this interval, with how
/// many were refused since the last one: a guesser cannot flood the log.
const TOKEN_FAILURE_LOG_EVERY: Duration = Duration::from_secs(1);
/// Client addresses whose refusals are counted apart between two log
/// lines; refusals from more addresses count in the total only. Bounds
/// the memory a guesser spreading over many addresses can make us hold.
const TOKEN_FAILURE_ADDRESSES: usize = 64;
/// Refused admin and metrics tokens: logged (at most once a
/// [`TOKEN_FAILURE_LOG_EVERY`], naming the client and the address refused
/// most since the last line) and slowed.
#[derive(Debug, Default)]
pub(super) struct TokenFailures {
    state: Mutex<Refusals>,
}
/// Refusals since the last log line.
#[derive(Debug, Default)]
struct Refusals {
    /// When the last line was logged.
    logged_at: Option<Instant>,
    total: u64,
    /// Per client address: the first [`TOKEN_FAILURE_ADDRESSES`] refused.
    by_address: HashMap<IpAddr, u64>,
}
impl Refusals {
    /// Counts a refusal from `ip` (if known).
    fn count(&mut self, ip: Option<IpAddr>) {
        self.total += 1;
        let Some(ip) = ip else { return };
        let known = self.by_address.len();
        match self.by_address.get_mut(&ip) {
            Some(count) => *count += 1,
            None if known < TOKEN_FAILURE_ADDRESSES => {
                self.by_address.insert(ip, 1);
            }
            None => {}
        }
    }

    /// The address refused most (and how often), if any was counted apart.
    fn most_refused(&self) -> Option<(IpAddr, u64)> {
        self.by_address.iter().map(|(ip, count)| (*ip, *count)).max_by_key(|&(_, count)| count)
    }

    /// Starts over after a log line at `now`.
    fn logged(&mut self, now: Instant) {
        *self = Self { logged_at: Some(now), ..Self::default() };
    }
}
impl TokenFailures {
    /// `refusal` after [`TOKEN_FAILURE_DELAY`] if it refuses a token (401),
    /// logged; any other refusal (the API off) at once.
    pub(super) async fn slowed(&self, scope: &str, req: &Request<Incoming>, refusal: Response<Body>) -> Response<Body> {
        if refusal.status() == StatusCode::UNAUTHORIZED {
            self.log(scope, req);
            tokio::time::sleep(TOKEN_FAILURE_DELAY).await;
        }
        refusal
    }

    fn log(&self, scope: &str, req: &Request<Incoming>) {
        let peer = req.extensions().get::<ClientAddr>().map(|addr| addr.0);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.count(peer.map(|peer| peer.ip()));
        if state.logged_at.is_none_or(|last| last.elapsed() >= TOKEN_FAILURE_LOG_EVERY) {
            let given = if bearer(req).is_some() { "wrong" } else { "missing" };
            let (most_refused, most_refused_times) = state.most_refused().unzip();
            tracing::warn!(
                scope,
                peer = peer.map(tracing::field::display),
                method = %req.method(),
                path = %req.uri().path().escape_debug(),
                token = given,
                refused_since_last_line = state.total,
                addresses_since_last_line = state.by_address.len(),
                most_refused = most_refused.map(tracing::field::display),
                most_refused_times,
                "token refused"
            );
            state.logged(Instant::now());
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_the_address_refused_most_and_stay_bounded() {
        let mut refusals = Refusals::default();
        let ip = |i: u32| IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i));
        for _ in 0..3 {
            refusals.count(Some(ip(7)));
        }
        refusals.count(Some(ip(8)));
        refusals.count(None);
        assert_eq!(refusals.most_refused(), Some((ip(7), 3)));
        // A guesser spread over many addresses: counted, not remembered.
        for i in 100..10_100 {
            refusals.count(Some(ip(i)));
        }
        assert_eq!(refusals.by_address.len(), TOKEN_FAILURE_ADDRESSES);
        assert_eq!(refusals.total, 10_005);
        refusals.count(Some(ip(7)));
        assert_eq!(refusals.most_refused(), Some((ip(7), 4)), "addresses already counted keep counting");
        refusals.logged(Instant::now());
        assert_eq!((refusals.total, refusals.by_address.len(), refusals.most_refused()), (0, 0, None));
    }
}
