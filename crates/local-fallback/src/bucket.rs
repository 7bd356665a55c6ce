//! One stored bucket and its expiry, kept in Redis's millisecond terms so the local store
//! expires keys exactly when a Redis server on the same clock would.

use tollgate_core::algorithm::{self, Record};
use tollgate_core::{Decision, Policy, StoreError};

/// A bucket's state and the instant it expires.
#[derive(Debug)]
pub(crate) struct Bucket {
    /// `None` once the bucket is known to be expired (equivalent to a missing key).
    pub(crate) state: Option<Record>,
    /// Last millisecond (since the epoch) at which the bucket is alive, as Redis `PEXPIRE`.
    pub(crate) expires_at_ms: u64,
}

/// Millisecond expiry of a state written at `now_us` with a TTL of `ttl_us`: the TTL is
/// rounded up to whole milliseconds, as a script passing `ceil(ttl / 1000)` to `PEXPIRE`.
pub(crate) const fn expires_at_ms(now_us: u64, ttl_us: u64) -> u64 {
    now_us / 1000 + ttl_us.div_ceil(1000)
}

impl Bucket {
    /// A new bucket holding `state`, written at `now_us` with a TTL of `ttl_us`.
    pub(crate) fn new(state: Option<Record>, now_us: u64, ttl_us: u64) -> Self {
        Self {
            state,
            expires_at_ms: expires_at_ms(now_us, ttl_us),
        }
    }

    /// Whether the bucket is alive at `now_ms`. Redis treats a key as expired once its
    /// expiry is strictly in the past.
    pub(crate) fn is_alive(&self, now_ms: u64) -> bool {
        self.state.is_some() && now_ms <= self.expires_at_ms
    }

    /// Applies `cost` at `now_us` in place. An expired bucket counts as missing and stays
    /// expired unless the outcome writes a state; an unchanged state keeps its expiry, and so
    /// does one rewritten with `keep_expiry` (Redis `SET ... KEEPTTL`).
    pub(crate) fn apply(
        &mut self,
        policy: &Policy,
        now_us: u64,
        cost: u64,
    ) -> Result<Decision, StoreError> {
        let was_alive = self.is_alive(now_us / 1000);
        if !was_alive {
            // Like Redis's lazy expiry: once seen expired, a bucket never comes back, even if
            // the clock steps back before its expiry.
            self.state = None;
        }
        let out = algorithm::apply(&mut self.state, policy, now_us, cost, true)?;
        match out.ttl_micros {
            Some(ttl) => self.expires_at_ms = expires_at_ms(now_us, ttl),
            None if !was_alive && !out.keep_expiry => self.state = None,
            None => {}
        }
        Ok(out.decision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tollgate_core::Rate;
    use tollgate_core::algorithm::{State, TokenBucketState};

    fn policy_for_test() -> Policy {
        Policy::token_bucket(2, Rate::per_second(1)).unwrap()
    }

    #[test]
    fn expiry_rounds_the_ttl_up_to_whole_milliseconds() {
        assert_eq!(expires_at_ms(1_000_999, 1), 1_001);
        assert_eq!(expires_at_ms(1_000_999, 1_000), 1_001);
        assert_eq!(expires_at_ms(1_000_999, 1_001), 1_002);
        assert_eq!(expires_at_ms(5_000_000, 3_500_000), 8_500);
    }

    #[test]
    fn alive_through_the_expiry_millisecond_then_missing() {
        let state = Record {
            generation: 0,
            params: *policy_for_test().algorithm(),
            pending: None,
            state: State::TokenBucket(TokenBucketState {
                level: 0,
                updated: 0,
            }),
        };
        let b = Bucket::new(Some(state), 1_000_000, 1_500);
        assert_eq!(b.expires_at_ms, 1_002);
        assert!(b.is_alive(1_002));
        assert!(!b.is_alive(1_003));
    }

    #[test]
    fn an_expired_bucket_counts_as_missing() {
        let policy = Policy::token_bucket(2, Rate::per_second(1)).unwrap();
        let mut b = Bucket {
            state: None,
            expires_at_ms: 0,
        };
        assert!(b.apply(&policy, 0, 2).unwrap().allowed);
        assert_eq!(b.expires_at_ms, 2_000);
        assert!(!b.apply(&policy, 500_000, 2).unwrap().allowed);
        // the same empty state, expired, is a full bucket
        b.expires_at_ms = 499;
        let d = b.apply(&policy, 500_000, 2).unwrap();
        assert!(d.allowed);
        assert_eq!(d.reset_after, Duration::from_secs(2));
        assert_eq!(b.expires_at_ms, 2_500);
    }
}
