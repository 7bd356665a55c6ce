//! The maths of every algorithm, one file each, as pure functions of
//! (stored state, policy, now in microseconds, cost). Backends store the state; the Redis
//! scripts implement exactly these functions and a differential test holds them equal.
//!
//! Shared rules:
//! - the effective time is `max(now, last time stored in the bucket)`: a clock that steps back
//!   never refills, reopens a window or forgets a log entry, and the stored time never moves
//!   backwards;
//! - `retry_after` and `reset_after` are absolute instants minus `now`, so they stay exact on
//!   the caller's clock even while it reads behind the bucket;
//! - a state is written with a TTL after which it is equivalent to a missing bucket.

pub mod fixed_window;
pub mod sliding_log;
pub mod token_bucket;

pub use fixed_window::FixedWindowState;
pub use sliding_log::SlidingLogState;
pub use token_bucket::TokenBucketState;

use crate::{Algorithm, Decision, Policy, PolicyError};

/// The stored state of one bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum State {
    /// Token bucket state.
    TokenBucket(TokenBucketState),
    /// Fixed window state.
    FixedWindow(FixedWindowState),
    /// Sliding log state.
    SlidingLog(SlidingLogState),
}

/// What one application of a cost produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The decision.
    pub decision: Decision,
    /// `Some(ttl)` when the state was (re)written and must expire `ttl` microseconds from now;
    /// `None` when the stored state is unchanged (a denial, or a peek).
    pub ttl_micros: Option<u64>,
}

/// Applies `cost` at `now` to `state` under `policy`, updating `state` in place when `commit`
/// is true. With `commit` false the state is left untouched and the outcome is what a commit
/// would have decided. A state of another algorithm (the policy changed) counts as missing.
pub fn apply(
    state: &mut Option<State>,
    policy: &Policy,
    now: u64,
    cost: u64,
    commit: bool,
) -> Result<Outcome, PolicyError> {
    policy.check_cost(cost)?;
    Ok(match policy.algorithm() {
        Algorithm::TokenBucket(p) => {
            let mut s = match state {
                Some(State::TokenBucket(s)) => Some(*s),
                _ => None,
            };
            let out = token_bucket::apply(&mut s, p, now, cost, commit);
            if commit && let Some(s) = s {
                *state = Some(State::TokenBucket(s));
            }
            out
        }
        Algorithm::FixedWindow(p) => {
            let mut s = match state {
                Some(State::FixedWindow(s)) => Some(*s),
                _ => None,
            };
            let out = fixed_window::apply(&mut s, p, now, cost, commit);
            if commit && let Some(s) = s {
                *state = Some(State::FixedWindow(s));
            }
            out
        }
        Algorithm::SlidingLog(p) => {
            if !matches!(state, Some(State::SlidingLog(_))) {
                if commit {
                    *state = Some(State::SlidingLog(SlidingLogState::default()));
                } else {
                    return Ok(sliding_log::apply(
                        &mut SlidingLogState::default(),
                        p,
                        now,
                        cost,
                        false,
                    ));
                }
            }
            let Some(State::SlidingLog(s)) = state else {
                unreachable!()
            };
            sliding_log::apply(s, p, now, cost, commit)
        }
    })
}

/// The pure form of [`apply`]: (stored state, policy, now, cost) → (outcome, new state).
pub fn decide(
    state: Option<&State>,
    policy: &Policy,
    now: u64,
    cost: u64,
) -> Result<(Outcome, Option<State>), PolicyError> {
    let mut s = state.cloned();
    let out = apply(&mut s, policy, now, cost, true)?;
    Ok((out, s))
}

#[cfg(test)]
mod proptests;
