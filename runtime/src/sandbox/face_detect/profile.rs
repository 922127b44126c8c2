//! What a handler's requests usually do around `infer`: the model and input
//! cost of their last call, and how long the guest works before its first
//! call and after its last. Admission reads it to tell, before reading a
//! request's body, whether the request could finish in time (see
//! [`facegate_host_gpu::Batcher::admit`]); each `infer` call reads it to
//! keep time for the work after the call.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// A handler's habits, as its requests taught them (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Habits {
    /// The model and the input's cost ([`facegate_host_gpu::queue::sample_cost`])
    /// of the last call; `None` before any.
    pub call: Option<(String, u64)>,
    /// The guest's time from the request's start to its first call (decoding,
    /// preprocessing), averaged.
    pub before: Duration,
    /// The guest's time from its last call's answer to its end
    /// (post-processing, encoding), averaged.
    pub after: Duration,
}

impl Habits {
    /// The guest's own time around its calls.
    pub fn guest_time(&self) -> Duration {
        self.before + self.after
    }
}

/// A handler's [`Habits`], shared by its requests.
#[derive(Debug, Default)]
pub struct CallProfile(Mutex<Habits>);

impl CallProfile {
    /// What the handler's requests taught so far.
    pub fn get(&self) -> Habits {
        self.lock().clone()
    }

    /// The guest's usual time after its last call (no copy of the model name).
    pub fn after(&self) -> Duration {
        self.lock().after
    }

    /// A call of `model` with an input of `cost`.
    pub fn called(&self, model: &str, cost: u64) {
        let mut habits = self.lock();
        if habits.call.as_ref().is_none_or(|(m, c)| m != model || *c != cost) {
            habits.call = Some((model.to_owned(), cost));
        }
    }

    /// A request that ended took `before` until its first call and `after`
    /// from its last call's answer. Averaged over about eight requests, so
    /// the profile follows a machine that grows busy.
    pub fn timed(&self, before: Duration, after: Duration) {
        let mut habits = self.lock();
        let first = habits.before.is_zero() && habits.after.is_zero();
        habits.before = if first { before } else { (habits.before * 7 + before) / 8 };
        habits.after = if first { after } else { (habits.after * 7 + after) / 8 };
    }

    fn lock(&self) -> MutexGuard<'_, Habits> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_profile_keeps_the_last_call_and_averages_the_guests_time() {
        let profile = CallProfile::default();
        assert_eq!(profile.get(), Habits::default());
        profile.called("centerface", 1024);
        profile.timed(80 * MS, 16 * MS);
        assert_eq!(profile.get().call, Some(("centerface".into(), 1024)));
        assert_eq!(profile.get().guest_time(), 96 * MS, "the first request sets it");
        profile.timed(160 * MS, 16 * MS);
        assert_eq!((profile.get().before, profile.get().after), (90 * MS, 16 * MS), "later ones move it by an eighth");
    }
}
