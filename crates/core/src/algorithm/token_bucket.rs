//! Token bucket: up to `capacity` tokens, refilled continuously at an exact integer rate.
//!
//! Tokens are held in units (`unit` per token, `rate` gained per microsecond), so refill is
//! exact integer arithmetic. A missing bucket is full; the state expires when the bucket would
//! be full again.
//!
//! A denial writes nothing (unless the policy caps the time credited per call): with exact
//! refill, the level a later call at or after the denial's time computes from the stored state
//! is the one it would compute from the state refilled at the denial, and the instant the
//! bucket is full again (its expiry) does not move. So denied traffic, however heavy, costs
//! the store no write — in Redis no `SET`, nothing for replicas or the AOF. A call whose clock
//! reads earlier than the denial's (a step back, or in the local store a racing call that read
//! its time first) is decided on its own clock from the stored state, where a written denial
//! would have credited it the time up to the denial's: it can then be denied where it was
//! admitted before, never the reverse, and its waits are the same instants. With
//! [`max_elapsed`](crate::Policy::with_max_elapsed) each call is credited at most the cap, so
//! a denial there writes the refilled state, as a call that moves the bucket.

use crate::{Decision, TokenBucket};

use super::Outcome;

/// A token bucket's stored state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucketState {
    /// Tokens in units (see [`TokenBucket::unit`]), at time `updated`.
    pub level: u64,
    /// The effective time of the last write, in microseconds. Never moves backwards.
    pub updated: u64,
}

/// Applies `cost` at `now`; see [`super::apply`]. On a commit `state` becomes the state after
/// the decision (refilled to its time), which the caller writes if the outcome says so
/// (`ttl_micros`: not for a denial, see the module's docs) or if it must write the record
/// anyway (a policy change that marks it).
#[inline]
pub fn apply(
    state: &mut Option<TokenBucketState>,
    p: &TokenBucket,
    now: u64,
    cost: u64,
    commit: bool,
) -> Outcome {
    let (stored, updated) = state.map_or((p.capacity_units(), now), |s| (s.level, s.updated));
    let (out, next) = step(p, stored, updated, now, cost, commit);
    if commit {
        *state = Some(next);
    }
    out
}

/// [`apply`] on a stored state that governs as it is, updated in place only when the outcome
/// writes (`ttl_micros`): the same decision as `apply` on `Some(*state)` and the record the
/// store would hold after it, without moving the state in and out of an `Option`.
#[inline]
pub fn apply_in_place(
    state: &mut TokenBucketState,
    p: &TokenBucket,
    now: u64,
    cost: u64,
    commit: bool,
) -> Outcome {
    let (out, next) = step(p, state.level, state.updated, now, cost, commit);
    if out.ttl_micros.is_some() {
        *state = next;
    }
    out
}

/// A token-bucket decision reduced to the numbers it is made of: whether the call was admitted,
/// the units it needed and the state after it. [`apply`] and [`apply_in_place`] are this step
/// and its [`Step::outcome`]; a store may write [`Step::next`] first and build the decision
/// ([`Step::decision`]) after it has released what it holds, from these numbers alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// Whether the call was admitted.
    pub allowed: bool,
    /// The units the call needed (`cost * unit`).
    pub need: u64,
    /// The state after the call: refilled to its effective time (`max(now, updated)`), less
    /// the cost if admitted. A commit writes it when the step [`writes`](Step::writes).
    pub next: TokenBucketState,
}

impl Step {
    /// `cost` at `now` on a bucket holding `state`, decided under `p` (the parameters that
    /// govern it: the caller applies a policy change first).
    #[allow(clippy::inline_always)] // the local store's hot path; the scripts' model
    #[inline(always)]
    pub fn of(state: TokenBucketState, p: &TokenBucket, now: u64, cost: u64) -> Self {
        let eff = now.max(state.updated);
        let level = level_at(p, state.level, state.updated, eff);
        let need = cost * p.unit;
        let allowed = level >= need;
        Self {
            allowed,
            need,
            next: TokenBucketState {
                level: if allowed { level - need } else { level },
                updated: eff,
            },
        }
    }

    /// Whether a commit writes [`Step::next`]: an admission, or any call under a cap on
    /// credited time (see the module's docs).
    #[allow(clippy::inline_always)] // see `Step::of`
    #[inline(always)]
    pub fn writes(&self, p: &TokenBucket) -> bool {
        self.allowed || p.max_elapsed_micros.is_some()
    }

    /// The TTL (µs) a commit that [`writes`](Step::writes) sets: the time the bucket takes to
    /// be full again, at least 1.
    #[allow(clippy::inline_always)] // see `Step::of`
    #[inline(always)]
    pub fn ttl_micros(&self, p: &TokenBucket, now: u64) -> u64 {
        self.reset_after(p, now).max(1)
    }

    /// Microseconds from `now` until the bucket is full again.
    #[allow(clippy::inline_always)] // see `Step::of`
    #[inline(always)]
    fn reset_after(&self, p: &TokenBucket, now: u64) -> u64 {
        // eff >= now: differences first, so no instant near the end of u64 overflows
        let s = self.next;
        (s.updated - now).saturating_add(div_ceil(p.capacity_units() - s.level, p.rate))
    }

    /// The decision, as [`apply`] returns it.
    #[allow(clippy::inline_always)] // see `Step::of`
    #[inline(always)]
    pub fn decision(&self, p: &TokenBucket, now: u64) -> Decision {
        self.outcome(p, now, false).decision
    }

    /// The outcome, as [`apply`] returns it; `commit`: whether the state is written when the
    /// step [`writes`](Step::writes).
    #[allow(clippy::inline_always)] // see `Step::of`
    #[inline(always)]
    pub fn outcome(&self, p: &TokenBucket, now: u64, commit: bool) -> Outcome {
        let TokenBucketState {
            level,
            updated: eff,
        } = self.next;
        // With a cap on credited time, one call after a longer wait is credited only the cap:
        // the retry then points at the next call that moves the bucket, and following
        // retry_after call after call is admitted at the earliest possible instant.
        let retry_after = (!self.allowed).then(|| {
            let wait = div_ceil(self.need - level, p.rate);
            (eff - now).saturating_add(p.max_elapsed_micros.map_or(wait, |max| wait.min(max)))
        });
        let reset_after = self.reset_after(p, now);
        Outcome {
            decision: Decision::shared(
                self.allowed,
                p.capacity,
                div_floor(level, p.unit),
                retry_after,
                reset_after,
            ),
            // A denial writes nothing unless credit is capped per call (the module's docs say
            // what a later call sees then).
            ttl_micros: (commit && self.writes(p)).then_some(reset_after.max(1)),
            keep_expiry: false,
        }
    }
}

/// One decision on a bucket that held `stored` units at `updated`: the outcome and the state a
/// commit writes. Always inlined: returned through memory, the pair costs a store-forwarding
/// stall per call on the hot path.
#[allow(clippy::inline_always)]
#[inline(always)]
fn step(
    p: &TokenBucket,
    stored: u64,
    updated: u64,
    now: u64,
    cost: u64,
    commit: bool,
) -> (Outcome, TokenBucketState) {
    let step = Step::of(
        TokenBucketState {
            level: stored,
            updated,
        },
        p,
        now,
        cost,
    );
    (step.outcome(p, now, commit), step.next)
}

/// `x.div_ceil(d)` for `d >= 1`, without a hardware division in the common cases (a quotient
/// of 0 or 1, a divisor of 1).
#[inline]
fn div_ceil(x: u64, d: u64) -> u64 {
    if x <= d {
        u64::from(x != 0)
    } else if d == 1 {
        x
    } else {
        x.div_ceil(d)
    }
}

/// `x / d` for `d >= 1`, without a hardware division in the common cases (a quotient of 0, a
/// divisor of 1).
#[inline]
fn div_floor(x: u64, d: u64) -> u64 {
    if x < d {
        0
    } else if d == 1 {
        x
    } else {
        x / d
    }
}

/// The level in units at `eff >= updated` of a bucket that held `stored` units at `updated`:
/// refilled at the policy's rate, elapsed time capped by `max_elapsed`, at most capacity (a
/// stored level above capacity, from a larger policy, is clamped first).
///
/// "Full after `elapsed`" is `elapsed >= ceil((cap - stored) / rate)`, decided here as
/// `elapsed · rate >= cap - stored` in 128 bits (the same for integers, without a division);
/// below that, `elapsed · rate < cap - stored <= 2^52` cannot overflow. Always inlined: left
/// out of line, its call costs the local store's paths ~14 instructions.
#[allow(clippy::inline_always)]
#[inline(always)]
pub(crate) fn level_at(p: &TokenBucket, stored: u64, updated: u64, eff: u64) -> u64 {
    let cap = p.capacity_units();
    let stored = stored.min(cap);
    let mut elapsed = eff - updated;
    if let Some(max) = p.max_elapsed_micros {
        elapsed = elapsed.min(max);
    }
    if u128::from(elapsed) * u128::from(p.rate) >= u128::from(cap - stored) {
        cap
    } else {
        stored + elapsed * p.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Policy, Rate};
    use std::time::Duration;

    fn tb(capacity: u64, rate: Rate) -> TokenBucket {
        match *Policy::token_bucket(capacity, rate).unwrap().algorithm() {
            Algorithm::TokenBucket(t) => t,
            _ => unreachable!(),
        }
    }

    proptest::proptest! {
        /// A store that writes a step's state and builds its decision later gets what `apply`
        /// returns: the same decision, a write exactly when `apply`'s commit writes, with the
        /// same TTL and state.
        #[test]
        fn a_step_is_what_apply_decides_and_writes(
            capacity in 1u64..1_000,
            tokens in 1u64..1_000_000,
            period_ms in 1u64..10_000_000,
            capped in proptest::option::of(1u64..10_000_000),
            level_frac in 0u64..=1_000,
            updated_off in 0u64..20_000_000,
            back in proptest::bool::ANY,
            cost_frac in 0u64..1_000,
        ) {
            let mut policy = Policy::token_bucket(
                capacity,
                Rate::new(tokens, Duration::from_millis(period_ms)),
            )
            .unwrap();
            if let Some(us) = capped {
                policy = policy.with_max_elapsed(Duration::from_micros(us)).unwrap();
            }
            let Algorithm::TokenBucket(p) = *policy.algorithm() else { unreachable!() };
            let now = 1_700_000_000_000_000u64;
            let state = TokenBucketState {
                level: p.capacity_units() / 1_000 * level_frac,
                // a clock behind the bucket as well as ahead of it
                updated: if back { now + updated_off } else { now - updated_off },
            };
            let cost = 1 + capacity * cost_frac / 1_000 % capacity;

            let step = Step::of(state, &p, now, cost);
            let mut stored = Some(state);
            let out = apply(&mut stored, &p, now, cost, true);
            proptest::prop_assert_eq!(step.decision(&p, now), out.decision.clone());
            proptest::prop_assert_eq!(step.outcome(&p, now, true), out.clone());
            proptest::prop_assert_eq!(step.writes(&p), out.ttl_micros.is_some());
            if let Some(ttl) = out.ttl_micros {
                proptest::prop_assert_eq!(step.ttl_micros(&p, now), ttl);
            }
            proptest::prop_assert_eq!(stored, Some(step.next));
        }
    }

    #[test]
    fn missing_bucket_is_full_and_drains_by_cost() {
        let p = tb(10, Rate::per_second(2));
        let mut s = None;
        let out = apply(&mut s, &p, 1_000_000, 7, true);
        assert!(out.decision.allowed);
        assert_eq!(out.decision.remaining, 3);
        assert_eq!(out.decision.reset_after, Duration::from_millis(3500));
        assert_eq!(out.ttl_micros, Some(3_500_000));
    }

    #[test]
    fn denies_when_cost_exceeds_remaining_with_exact_retry() {
        let p = tb(10, Rate::per_second(2));
        let mut s = None;
        apply(&mut s, &p, 0, 10, true);
        let out = apply(&mut s, &p, 100_000, 3, true);
        assert!(!out.decision.allowed);
        // 0.2 tokens refilled after 100ms; 2.8 tokens more need 1.4 s.
        assert_eq!(out.decision.retry_after, Some(Duration::from_millis(1400)));
        assert!(!apply(&mut s, &p, 1_499_999, 3, false).decision.allowed);
        assert!(apply(&mut s, &p, 1_500_000, 3, false).decision.allowed);
    }

    #[test]
    fn a_denial_writes_nothing_unless_credit_is_capped_and_later_calls_see_no_difference() {
        let plain = tb(3, Rate::per_second(2));
        let mut capped = plain;
        capped.max_elapsed_micros = Some(10_000_000);
        for p in [plain, capped] {
            let mut s = TokenBucketState {
                level: 0,
                updated: 1_000_000,
            };
            let before = s;
            let out = apply_in_place(&mut s, &p, 1_100_000, 1, true);
            assert!(!out.decision.allowed);
            // 0.2 tokens after 100 ms: 0.8 more need 400 ms; full (3 tokens) 1.4 s away
            assert_eq!(out.decision.retry_after, Some(Duration::from_millis(400)));
            assert_eq!(out.decision.reset_after, Duration::from_millis(1400));
            if p.max_elapsed_micros.is_none() {
                assert_eq!((out.ttl_micros, s), (None, before), "nothing written");
            } else {
                assert_eq!(out.ttl_micros, Some(1_400_000));
                assert_eq!(s.updated, 1_100_000, "the refilled state is written");
            }
            // a later call decides the same on either state
            let mut refilled = Some(TokenBucketState {
                level: 100_000 * p.rate,
                updated: 1_100_000,
            });
            for (t, cost) in [
                (1_300_000, 1),
                (1_499_999, 1),
                (1_500_000, 1),
                (9_000_000, 3),
            ] {
                let a = apply_in_place(&mut s, &p, t, cost, true);
                let b = apply(&mut refilled, &p, t, cost, true);
                assert_eq!(a.decision, b.decision, "at {t}");
            }
        }

        // A clock earlier than an unwritten denial's is decided on its own time: never more
        // permissive than after a written denial, with the same wait instants (docs/clock.md,
        // rule 6). Capacity 10, 1 token/s, empty at 0; a denial of cost 2 at 1.5 s; a call of
        // cost 1 at 0.8 s.
        let p = tb(10, Rate::per_second(1));
        let empty = TokenBucketState {
            level: 0,
            updated: 0,
        };
        let (mut unwritten, mut written) = (empty, empty);
        assert!(
            !apply_in_place(&mut unwritten, &p, 1_500_000, 2, true)
                .decision
                .allowed
        );
        assert_eq!(unwritten, empty);
        written.level = 1_500_000 * p.rate;
        written.updated = 1_500_000;
        let own = apply_in_place(&mut unwritten, &p, 800_000, 1, true).decision;
        let credited = apply_in_place(&mut written, &p, 800_000, 1, true).decision;
        assert!(!own.allowed && credited.allowed);
        assert_eq!(own.retry_after, Some(Duration::from_millis(200)));
    }

    #[test]
    fn clock_step_back_credits_nothing_and_keeps_timestamp() {
        let p = tb(10, Rate::per_second(1));
        let mut s = None;
        apply(&mut s, &p, 10_000_000, 10, true);
        let out = apply(&mut s, &p, 5_000_000, 1, true);
        assert!(!out.decision.allowed);
        assert_eq!(out.decision.retry_after, Some(Duration::from_secs(6)));
        assert_eq!(s.unwrap().updated, 10_000_000);
        // stepping forward again to the original time gives no double credit
        assert!(!apply(&mut s, &p, 10_500_000, 1, true).decision.allowed);
        assert!(apply(&mut s, &p, 11_000_000, 1, true).decision.allowed);
    }

    #[test]
    fn max_elapsed_limits_what_one_jump_buys() {
        let mut p = tb(10, Rate::per_second(1));
        p.max_elapsed_micros = Some(2_000_000);
        let mut s = None;
        apply(&mut s, &p, 0, 10, true);
        let out = apply(&mut s, &p, 3_600_000_000, 1, true);
        assert!(out.decision.allowed);
        assert_eq!(out.decision.remaining, 1);
    }
}
