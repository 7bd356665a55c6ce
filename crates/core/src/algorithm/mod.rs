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
//!
//! Policy changes ([`transition`]): a bucket is a [`Record`] of the generation and parameters
//! that last wrote it and the algorithm's state. [`apply`] first settles which policy governs
//! (the newest generation), moves the state to it by the caller's [`Transition`] rule when
//! the caller is newer, and only then decides — all in one step, as the scripts do.

pub mod fixed_window;
pub mod sliding_log;
pub mod token_bucket;
pub mod transition;

pub use fixed_window::FixedWindowState;
pub use sliding_log::SlidingLogState;
pub use token_bucket::TokenBucketState;
pub use transition::muldiv;

use std::time::Duration;

use crate::{Algorithm, Decision, MAX_EXACT, Policy, PolicyError, Transition};

/// The stored state of one bucket, per algorithm.
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

/// One stored bucket: the state, and the generation and parameters that last wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Generation of the policy whose parameters govern the bucket.
    pub generation: u64,
    /// Those parameters, in [`Algorithm::normalized`] form.
    pub params: Algorithm,
    /// A newer generation whose rule is [`Transition::DeferUntilExpiry`] and that waits for
    /// this bucket to expire. While set, writes keep the bucket's expiry.
    pub pending: Option<u64>,
    /// The algorithm's state.
    pub state: State,
}

/// What one application of a cost produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The decision.
    pub decision: Decision,
    /// `Some(ttl)` when the record was (re)written and must expire `ttl` microseconds from now;
    /// `None` when it was not written with a new expiry (see `keep_expiry`).
    pub ttl_micros: Option<u64>,
    /// The record was rewritten but keeps the expiry it had (a bucket whose old parameters
    /// govern until it expires: Redis `SET ... KEEPTTL`). Never true with `ttl_micros` set.
    pub keep_expiry: bool,
}

impl Outcome {
    /// Whether the record was written (with a new expiry or keeping its own).
    pub fn wrote(&self) -> bool {
        self.ttl_micros.is_some() || self.keep_expiry
    }
}

/// Which policy governs a call, and the state to decide on.
struct Plan {
    generation: u64,
    params: Algorithm,
    pending: Option<u64>,
    state: Option<State>,
    /// The record's generation, parameters, pending mark or state changed before deciding:
    /// it must be written even if the decision itself writes nothing.
    changed: bool,
    keep_expiry: bool,
}

fn plan(stored: Option<&Record>, policy: &Policy, caller: Algorithm, now: u64) -> Plan {
    let g = policy.generation();
    let Some(r) = stored else {
        return Plan {
            generation: g,
            params: caller,
            pending: None,
            state: None,
            changed: true,
            keep_expiry: false,
        };
    };
    // A newer generation, or the same one with other parameters, takes over; only a strictly
    // newer one applies its transition rule: at an equal generation the caller's parameters
    // take over by `Carry`, so a parameter change without a generation bump never grants a
    // fresh bucket (two instances disagreeing at one generation enforce one bound).
    let newer = g > r.generation || (g == r.generation && r.params != caller);
    let rule = if g > r.generation {
        policy.transition()
    } else {
        Transition::Carry
    };
    let deferred_for_caller = r.pending.is_some_and(|p| p >= g);
    let stored_governs = Plan {
        generation: r.generation,
        params: r.params,
        pending: r.pending,
        state: Some(r.state.clone()),
        changed: false,
        keep_expiry: r.pending.is_some(),
    };
    if !newer || deferred_for_caller {
        return stored_governs;
    }
    match rule {
        Transition::DeferUntilExpiry => Plan {
            pending: Some(g),
            changed: true,
            keep_expiry: true,
            ..stored_governs
        },
        rule => Plan {
            generation: g,
            params: caller,
            pending: None,
            state: Some(transition::convert(rule, &r.params, &r.state, &caller, now)),
            changed: true,
            keep_expiry: false,
        },
    }
}

/// Whether [`apply`] on `stored` for `policy` decides under a bucket whose old parameters
/// govern until it expires: a [`Transition::DeferUntilExpiry`] pending on it (for this caller
/// or a newer one), or starting with this call. Such a bucket is gone at its expiry and the
/// next call starts a fresh one, so the decision's waits end then at the latest
/// ([`cap_at_expiry`]); [`apply`] itself does not know the expiry. Not a bucket whose
/// deferral has run out at `now` ([`deferral_lapsed`]): that one is decided fresh.
pub fn runs_out_at_expiry(stored: Option<&Record>, policy: &Policy, now: u64) -> bool {
    let Some(r) = stored.filter(|r| !deferral_lapsed(r, now)) else {
        return false;
    };
    let g = policy.generation();
    let newer =
        g > r.generation || (g == r.generation && r.params != policy.algorithm().normalized());
    if !newer || r.pending.is_some_and(|p| p >= g) {
        return r.pending.is_some();
    }
    g > r.generation && policy.transition() == Transition::DeferUntilExpiry
}

/// Whether `r` is a bucket whose deferral has run out at `now`: a
/// [`Transition::DeferUntilExpiry`] pending on it, and nothing of its state left at `now`
/// under its own parameters, its stored time not after `now` — a token bucket full again, a
/// fixed window ended, a sliding log whose newest entry has left the window. Its key outlives
/// that instant by up to a millisecond (Redis expires keys by the millisecond,
/// [`expires_at_ms`]); [`apply`] takes it for the missing bucket it is about to be, decided
/// fresh under the caller's policy. Decided under the old parameters instead, on what is
/// logically a fresh bucket and written keeping the key's expiry, that millisecond admitted
/// the old limit again, then lost it with the key, and the new limit followed: a fixed
/// window of 10 deferring to one of 2 admitted 12 in the new window (found by a review).
#[must_use]
pub fn deferral_lapsed(r: &Record, now: u64) -> bool {
    if r.pending.is_none() {
        return false;
    }
    match (&r.params, &r.state) {
        (Algorithm::TokenBucket(p), State::TokenBucket(s)) => {
            let total = p.capacity_units();
            s.updated <= now
                && u128::from(now - s.updated) * u128::from(p.rate)
                    >= u128::from(total - s.level.min(total))
        }
        (Algorithm::FixedWindow(p), State::FixedWindow(s)) => {
            s.window_start.saturating_add(p.window_micros) <= now
        }
        (Algorithm::SlidingLog(p), State::SlidingLog(s)) => s
            .entries
            .back()
            .is_none_or(|&(t, _)| t.saturating_add(p.window_micros) <= now),
        _ => false,
    }
}

/// The millisecond (since the epoch) through which a bucket written at `now` with a TTL of
/// `ttl` (microseconds) stays alive: the millisecond holding `now + ttl`, and at least the one
/// after `now`'s. Redis drops a key once its expiry is strictly in the past, so the bucket
/// outlives `now + ttl` by at most a millisecond and is never gone before it. The scripts set
/// exactly this with `SET … PXAT` (epilogue.lua); `LocalStore` keeps it for each bucket.
///
/// ```
/// use tollgate_core::algorithm::expires_at_ms;
///
/// // written at 1,000.100 ms, full 1.5 ms later: alive through millisecond 1,001
/// assert_eq!(expires_at_ms(1_000_100, 1_500), 1_001);
/// // a TTL under a millisecond still reaches into the next one
/// assert_eq!(expires_at_ms(1_000_999, 1), 1_001);
/// ```
#[must_use]
pub const fn expires_at_ms(now: u64, ttl: u64) -> u64 {
    now.saturating_add(if ttl > 1000 { ttl } else { 1000 }) / 1000
}

/// The greatest common divisor of `a` and `b` (`gcd(a, 0) == a`): how rates are kept reduced
/// (a policy's refill; a degraded share's).
///
/// ```
/// assert_eq!(tollgate_core::algorithm::gcd(1_000_000, 150), 50);
/// ```
#[must_use]
pub const fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// `at + span - now` without overflow near the end of `u64` (saturating only where the true
/// value does not fit): the time from `now` until `span` after `at`, which is not before
/// `now` (`at` may be before or after it).
pub(crate) const fn until(at: u64, span: u64, now: u64) -> u64 {
    if at >= now {
        (at - now).saturating_add(span)
    } else {
        span.saturating_sub(now - at)
    }
}

/// Ends `decision`'s `retry_after` and `reset_after` no later than the first microsecond at
/// which a bucket alive through the millisecond `expires_at_ms` is gone (Redis expiry), for a
/// decision made at `now` under a bucket that [`runs_out_at_expiry`]: a fresh bucket admits
/// the caller's cost then (it was checked against the caller's limit).
pub fn cap_at_expiry(decision: &mut Decision, now: u64, expires_at_ms: u64) {
    let gone = Duration::from_micros(
        (expires_at_ms.saturating_add(1).saturating_mul(1000)).saturating_sub(now),
    );
    if let Some(retry) = &mut decision.retry_after {
        *retry = (*retry).min(gone);
    }
    decision.reset_after = decision.reset_after.min(gone);
}

/// Applies `cost` at `now` to the bucket `record` under `policy`, updating `record` in place
/// when `commit` is true. With `commit` false the record is left untouched and the outcome is
/// what a commit would have decided.
///
/// The governing policy is settled first, whatever the algorithms (one record per bucket): a
/// missing bucket starts fresh under `policy`; a bucket written by an older generation moves
/// to `policy` by its [`Transition`] rule (across algorithms too, see [`transition`]), one
/// written by the same generation with other parameters by [`Transition::Carry`] whatever the
/// rule (a fresh bucket needs a generation bump); a bucket written by a newer generation, or
/// deferring to one at least as new as `policy`, is decided under its stored algorithm and
/// parameters. A cost above the governing limit is
/// [`PolicyError::CostAboveCapacity`] and writes nothing, unless those parameters govern only
/// until the bucket expires ([`runs_out_at_expiry`]): then it is denied until the expiry
/// (see `until_expiry`; the store caps the waits with [`cap_at_expiry`]).
pub fn apply(
    record: &mut Option<Record>,
    policy: &Policy,
    now: u64,
    cost: u64,
    commit: bool,
) -> Result<Outcome, PolicyError> {
    policy.check_cost(cost)?;
    let caller = policy.algorithm().normalized();
    if let Some(r) = record.as_mut()
        && stored_governs_as_is(r, policy, &caller)
        && !deferral_lapsed(r, now)
    {
        return apply_in_place(r, now, cost, commit);
    }
    // a bucket whose deferral has run out is the missing bucket it is about to be
    let stored = record.as_ref().filter(|r| !deferral_lapsed(r, now));
    let plan = plan(stored, policy, caller, now);
    let max = plan.params.limit();
    if cost > max {
        if plan.pending.is_some() {
            return Ok(until_expiry(record, plan, now, commit));
        }
        return Err(PolicyError::CostAboveCapacity { cost, max });
    }
    let mut state = plan.state;
    let out = decide_state(&mut state, &plan.params, now, cost, commit);
    if !commit || !(out.ttl_micros.is_some() || plan.changed) {
        return Ok(Outcome {
            ttl_micros: None,
            keep_expiry: false,
            ..out
        });
    }
    *record = Some(Record {
        generation: plan.generation,
        params: plan.params,
        pending: plan.pending,
        state: state.expect("a state to write"),
    });
    let ttl = out
        .ttl_micros
        .unwrap_or_else(|| (out.decision.reset_after.as_micros() as u64).max(1));
    Ok(Outcome {
        ttl_micros: (!plan.keep_expiry).then_some(ttl),
        keep_expiry: plan.keep_expiry,
        decision: out.decision,
    })
}

/// The answer to a cost above the limit of parameters that govern the bucket only until it
/// expires (a [`Transition::DeferUntilExpiry`] pending on it, or starting with this call),
/// but within the caller's own limit: not invalid input, since a fresh bucket under the
/// caller's parameters admits it at the expiry, but a denial until then — `retry_after` and
/// `reset_after` of [`MAX_EXACT`] microseconds, which the store ends at the bucket's expiry
/// ([`cap_at_expiry`]) — with what the governing bucket has left. Nothing is spent; a
/// deferral starting with this call is marked on the record (kept expiry), as on any denial
/// of a newer caller.
fn until_expiry(record: &mut Option<Record>, plan: Plan, now: u64, commit: bool) -> Outcome {
    let max = plan.params.limit();
    let state = plan.state.expect("a deferral governs a stored bucket");
    let left = transition::usage(&plan.params, &state, now).map_or(max, |u| u.remaining());
    let write = commit && plan.changed;
    if write {
        *record = Some(Record {
            generation: plan.generation,
            params: plan.params,
            pending: plan.pending,
            state,
        });
    }
    until_expiry_outcome(max, left, write)
}

/// [`until_expiry`]'s outcome: denied, `left` of `limit`, waits to be ended at the expiry.
fn until_expiry_outcome(limit: u64, left: u64, wrote: bool) -> Outcome {
    Outcome {
        decision: Decision::shared(false, limit, left, Some(MAX_EXACT), MAX_EXACT),
        ttl_micros: None,
        keep_expiry: wrote,
    }
}

/// Whether [`plan`] would decide on `r` under its own generation, parameters and pending mark,
/// changing none of them: a bucket whose state matches its parameters, written by the
/// caller's policy or a newer one (of any algorithm), or deferring to one at least as new as
/// the caller's.
#[inline]
fn stored_governs_as_is(r: &Record, policy: &Policy, caller: &Algorithm) -> bool {
    let g = policy.generation();
    let consistent = matches!(
        (&r.params, &r.state),
        (Algorithm::TokenBucket(_), State::TokenBucket(_))
            | (Algorithm::FixedWindow(_), State::FixedWindow(_))
            | (Algorithm::SlidingLog(_), State::SlidingLog(_))
    );
    let newer = g > r.generation || (g == r.generation && r.params != *caller);
    consistent && (!newer || r.pending.is_some_and(|p| p >= g))
}

/// [`apply`] when the stored record governs as it is ([`stored_governs_as_is`]): the same
/// outcome and the same record as the general path, deciding on the stored state in place
/// instead of copying it out and back.
#[inline]
fn apply_in_place(
    r: &mut Record,
    now: u64,
    cost: u64,
    commit: bool,
) -> Result<Outcome, PolicyError> {
    let max = r.params.limit();
    if cost > max {
        if r.pending.is_some() {
            let left = transition::usage(&r.params, &r.state, now).map_or(max, |u| u.remaining());
            return Ok(until_expiry_outcome(max, left, false));
        }
        return Err(PolicyError::CostAboveCapacity { cost, max });
    }
    // Each algorithm changes its state only when it returns a TTL (a commit that writes).
    let out = match (&r.params, &mut r.state) {
        (Algorithm::TokenBucket(p), State::TokenBucket(s)) => {
            token_bucket::apply_in_place(s, p, now, cost, commit)
        }
        (Algorithm::FixedWindow(p), State::FixedWindow(s)) => {
            let mut held = Some(*s);
            let out = fixed_window::apply(&mut held, p, now, cost, commit);
            if let Some(held) = held {
                *s = held;
            }
            out
        }
        (Algorithm::SlidingLog(p), State::SlidingLog(s)) => {
            sliding_log::apply(s, p, now, cost, commit)
        }
        _ => unreachable!("stored_governs_as_is checked the state's kind"),
    };
    let keep_expiry = r.pending.is_some();
    Ok(match out.ttl_micros {
        Some(ttl) if commit => Outcome {
            ttl_micros: (!keep_expiry).then_some(ttl),
            keep_expiry,
            decision: out.decision,
        },
        _ => Outcome {
            ttl_micros: None,
            keep_expiry: false,
            decision: out.decision,
        },
    })
}

/// Runs the governing algorithm on `state` (`None`: a fresh bucket).
fn decide_state(
    state: &mut Option<State>,
    params: &Algorithm,
    now: u64,
    cost: u64,
    commit: bool,
) -> Outcome {
    match params {
        Algorithm::TokenBucket(p) => {
            let mut s = match state {
                Some(State::TokenBucket(s)) => Some(*s),
                _ => None,
            };
            let out = token_bucket::apply(&mut s, p, now, cost, commit);
            if let Some(s) = s {
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
            if let Some(s) = s {
                *state = Some(State::FixedWindow(s));
            }
            out
        }
        Algorithm::SlidingLog(p) => {
            if !matches!(state, Some(State::SlidingLog(_))) {
                *state = Some(State::SlidingLog(SlidingLogState::default()));
            }
            let Some(State::SlidingLog(s)) = state else {
                unreachable!()
            };
            sliding_log::apply(s, p, now, cost, commit)
        }
    }
}

/// The pure form of [`apply`]: (stored record, policy, now, cost) → (outcome, new record).
pub fn decide(
    record: Option<&Record>,
    policy: &Policy,
    now: u64,
    cost: u64,
) -> Result<(Outcome, Option<Record>), PolicyError> {
    let mut r = record.cloned();
    let out = apply(&mut r, policy, now, cost, true)?;
    Ok((out, r))
}

#[cfg(test)]
mod proptests;

#[cfg(test)]
mod edge_times {
    use std::time::Duration;

    use super::*;
    use crate::Rate;

    /// A clock reading within a TTL of `u64::MAX` (a broken or hostile `Clock`): every
    /// algorithm decides without overflowing (it panicked in debug builds and wrapped in
    /// release ones, giving a reset of a few µs), and the expiry saturates.
    #[test]
    fn times_near_the_end_of_u64_decide_without_overflow() {
        let policies = [
            Policy::token_bucket(10, Rate::per_second(1)).unwrap(),
            Policy::token_bucket(10, Rate::per_second(1))
                .unwrap()
                .with_max_elapsed(Duration::from_secs(1))
                .unwrap(),
            Policy::fixed_window(10, Duration::from_secs(60)).unwrap(),
            Policy::sliding_log(3, Duration::from_secs(60)).unwrap(),
        ];
        for policy in &policies {
            for now in [u64::MAX - 1_000_000, u64::MAX - 1, u64::MAX] {
                let mut record = None;
                let mut spent = 0;
                for cost in [1, 2, 10, 1] {
                    let cost = cost.min(policy.limit());
                    let out = apply(&mut record, policy, now, cost, true).unwrap();
                    let mut d = out.decision;
                    if d.allowed {
                        spent += cost;
                    }
                    // exact, as at any other instant: a token bucket refills 1 token a second,
                    // a window resets at its end (aligned to the epoch), a log a minute on
                    let want = match policy.algorithm() {
                        Algorithm::TokenBucket(_) => Duration::from_secs(spent),
                        Algorithm::FixedWindow(_) => {
                            Duration::from_micros(60_000_000 - now % 60_000_000)
                        }
                        _ => Duration::from_secs(60),
                    };
                    assert_eq!(d.reset_after, want, "{policy} at {now}, cost {cost}");
                    if let Some(ttl) = out.ttl_micros {
                        cap_at_expiry(&mut d, now, expires_at_ms(now, ttl));
                    }
                }
                apply(&mut record, policy, now, 1, false).unwrap();
            }
        }
    }

    /// The same for a policy change on a sliding log (its conversions summed `t + window`):
    /// a panic in debug builds; in release the live entries wrapped out and `Carry` admitted
    /// past a full log.
    #[test]
    fn sliding_log_policy_changes_near_the_end_of_u64_keep_the_log() {
        let now = u64::MAX - 1_000_000;
        let old = Policy::sliding_log(3, Duration::from_secs(60)).unwrap();
        let carry = old.with_generation(1).with_transition(Transition::Carry);
        let wider = Policy::sliding_log(5, Duration::from_secs(60))
            .unwrap()
            .with_generation(1)
            .with_transition(Transition::Carry);
        let window = Policy::fixed_window(5, Duration::from_secs(60))
            .unwrap()
            .with_generation(1)
            .with_transition(Transition::Proportional);
        for (next, cost, allowed, remaining) in [
            (&carry, 1, false, 0),
            (&wider, 2, true, 0),
            (&window, 1, false, 0),
        ] {
            let mut record = None;
            assert!(
                apply(&mut record, &old, now, 3, true)
                    .unwrap()
                    .decision
                    .allowed
            );
            let d = apply(&mut record, next, now, cost, true).unwrap().decision;
            assert_eq!(
                (d.allowed, d.remaining),
                (allowed, remaining),
                "{next}: {d:?}"
            );
        }
    }
}
