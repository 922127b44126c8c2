//! What a caller may learn of the batches its calls ran in, without the
//! batcher knowing what it is for: a caller attaches an opaque [`CallTag`]
//! to a call (facegate attaches the call's trace context), and a
//! [`BatchObserver`] installed on the batcher ([`crate::Batcher::observe`])
//! is told of every batch that ran a tagged call, with the tags of its
//! members (facegate makes the batch's span, linked to each member's).
//!
//! Batches without a tagged call are not reported: an observer costs
//! nothing while no caller tags its calls.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An opaque value attached to a call and handed back in the
/// [`BatchReport`] of the batch it ran in.
#[derive(Clone)]
pub struct CallTag(Arc<dyn Any + Send + Sync>);

impl CallTag {
    /// Tags a call with `value`.
    pub fn new(value: impl Any + Send + Sync) -> Self {
        Self(Arc::new(value))
    }

    /// The value, if it is a `T`.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }
}

impl std::fmt::Debug for CallTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallTag(..)")
    }
}

/// A tagged call of a batch.
#[derive(Debug)]
pub struct BatchMember<'a> {
    /// The caller's tag.
    pub tag: &'a CallTag,
    /// When the call entered the queue.
    pub enqueued: Instant,
}

/// A batch a device ran that held at least one tagged call.
#[derive(Debug)]
pub struct BatchReport<'a> {
    /// The model's name.
    pub model: &'a str,
    /// The device's index in the batcher's pool (the order its backends were given).
    pub device: usize,
    /// The device's name ([`crate::backend::Backend::device`]).
    pub device_name: &'a str,
    /// Calls in the batch, tagged or not.
    pub size: usize,
    /// When the device started the batch.
    pub started: Instant,
    /// How long the device took.
    pub took: Duration,
    /// Whether the batch succeeded.
    pub ok: bool,
    /// The batch's tagged calls.
    pub members: Vec<BatchMember<'a>>,
}

/// Told of each batch that ran a tagged call, on the device's worker
/// thread after the batch's calls were answered: it must be quick and
/// must not block.
pub trait BatchObserver: Send + Sync {
    /// A batch ran.
    fn ran(&self, report: &BatchReport<'_>);
}
