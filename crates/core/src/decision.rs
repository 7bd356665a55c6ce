//! The answer to one request: allowed or not, with the numbers a client needs to pace itself,
//! and the enforcement it was made under.

use std::time::Duration;

/// Under which enforcement a [`Decision`] was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Enforcement {
    /// The shared store answered: the fleet-wide quota was enforced.
    Shared,
    /// The shared store was unavailable and a per-process local limiter decided instead.
    /// Approximate: the fleet as a whole may admit more (or less) than the quota.
    Degraded,
    /// The shared store was unavailable and the operation fails open: nothing was enforced.
    Bypassed,
}

impl Enforcement {
    /// A stable lower-case name for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::Degraded => "degraded",
            Self::Bypassed => "bypassed",
        }
    }
}

/// The outcome of applying a cost to a bucket. Every number comes from the same atomic
/// computation that made the decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request was admitted (its cost was consumed).
    pub allowed: bool,
    /// The limit the decision was made under: token-bucket capacity or the per-window limit.
    /// Usually the caller's policy's; a bucket written by a newer generation, or one still
    /// governed by its old parameters while a
    /// [`DeferUntilExpiry`](crate::Transition::DeferUntilExpiry) change waits, is decided
    /// under its stored parameters and gives their limit. Under
    /// [`Enforcement::Degraded`], this instance's share of the quota (the local limit, the
    /// policy's divided by the expected instances); under [`Enforcement::Bypassed`], the
    /// policy's.
    pub limit: u64,
    /// Whole units left after this decision.
    pub remaining: u64,
    /// When denied, the exact wait (rounded up to the microsecond) after which the same request
    /// would be admitted if nothing else consumed. `None` when allowed.
    pub retry_after: Option<Duration>,
    /// Time until the bucket is back to its initial state (full bucket, window end, log empty).
    pub reset_after: Duration,
    /// Under which enforcement the decision was made.
    pub enforcement: Enforcement,
}

impl Decision {
    /// A decision made by the shared store (or the core maths), with times in microseconds.
    pub fn shared(
        allowed: bool,
        limit: u64,
        remaining: u64,
        retry_after_micros: Option<u64>,
        reset_after_micros: u64,
    ) -> Self {
        Self {
            allowed,
            limit,
            remaining,
            retry_after: retry_after_micros.map(Duration::from_micros),
            reset_after: Duration::from_micros(reset_after_micros),
            enforcement: Enforcement::Shared,
        }
    }

    /// The decision relabelled with another enforcement.
    #[must_use]
    pub fn with_enforcement(mut self, enforcement: Enforcement) -> Self {
        self.enforcement = enforcement;
        self
    }

    /// `retry_after` in whole seconds, rounded up (for a `Retry-After` header).
    ///
    /// ```
    /// use tollgate_core::Decision;
    /// let d = Decision::shared(false, 10, 0, Some(1_000_001), 5_000_000);
    /// assert_eq!(d.retry_after_secs(), Some(2));
    /// ```
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after.map(ceil_secs)
    }

    /// `reset_after` in whole seconds, rounded up.
    pub fn reset_after_secs(&self) -> u64 {
        ceil_secs(self.reset_after)
    }
}

/// Whole seconds, rounded up; `u64::MAX` for a duration that does not fit (`Duration::MAX`).
fn ceil_secs(d: Duration) -> u64 {
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_round_up_and_saturate() {
        let mut d = Decision::shared(false, 10, 0, Some(1_000_001), 2_000_000);
        assert_eq!((d.retry_after_secs(), d.reset_after_secs()), (Some(2), 2));
        // A wait too long for whole seconds plus one (a "never" probe interval) saturates.
        d.retry_after = Some(Duration::MAX);
        d.reset_after = Duration::MAX;
        assert_eq!(
            (d.retry_after_secs(), d.reset_after_secs()),
            (Some(u64::MAX), u64::MAX)
        );
    }
}
