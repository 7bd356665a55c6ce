//! Property tests of the algorithms' invariants over random request sequences.
//!
//! Every run drives [`super::apply`] through a simulated store that expires state the way Redis
//! does (millisecond expiry, rounded up) and checks each decision against a small reference
//! model written from DESIGN.md in other units (exact `u128` fractions, full admission history),
//! never by calling the code under test.

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::{Outcome, Record, State, apply, token_bucket};
use crate::{Algorithm, Decision, Policy, Rate, Transition};

/// Redis `TIME` in 2023, so timestamps have realistic magnitude.
const BASE: u64 = 1_700_000_000_000_000;
/// Longest single idle gap, so 200 of them stay far from `u64::MAX`.
const MAX_GAP: u64 = 1 << 55;

type Check = Result<(), TestCaseError>;

// ---------------------------------------------------------------------------------------------
// The simulated store.

/// One key in a Redis-like store: the state and its expiry, set from `ttl_micros` as the
/// scripts' `SET … PXAT` ([`super::expires_at_ms`]); a state is alive while
/// `now_ms <= expires_at_ms`, and an expired state is deleted when next touched.
#[derive(Debug, Clone, Default)]
struct Sim {
    state: Option<Record>,
    expires_at_ms: u64,
}

impl Sim {
    fn alive_at(&self, now: u64) -> Option<Record> {
        if now / 1000 <= self.expires_at_ms {
            self.state.clone()
        } else {
            None
        }
    }

    fn expire(&mut self, now: u64) {
        if now / 1000 > self.expires_at_ms {
            self.state = None;
        }
    }

    fn commit(&mut self, policy: &Policy, now: u64, cost: u64) -> Result<Outcome, TestCaseError> {
        self.expire(now);
        let out = apply(&mut self.state, policy, now, cost, true)
            .map_err(|e| TestCaseError::fail(format!("valid cost {cost} refused: {e}")))?;
        if let Some(ttl) = out.ttl_micros {
            prop_assert!(ttl > 0, "a written state needs a positive ttl");
            self.expires_at_ms = super::expires_at_ms(now, ttl);
        }
        prop_assert!(!(out.keep_expiry && out.ttl_micros.is_some()));
        Ok(out)
    }

    /// What `cost` at `now` would decide, from a clone of the state, without committing.
    fn peek(&self, policy: &Policy, now: u64, cost: u64) -> Result<Decision, TestCaseError> {
        let mut s = self.alive_at(now);
        let before = s.clone();
        let out = apply(&mut s, policy, now, cost, false)
            .map_err(|e| TestCaseError::fail(format!("valid cost {cost} refused: {e}")))?;
        prop_assert_eq!(&s, &before, "a peek changed the state");
        prop_assert_eq!(out.ttl_micros, None, "a peek asked for a write");
        Ok(out.decision)
    }
}

// ---------------------------------------------------------------------------------------------
// Reference models.

/// What a reference model decides.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expected {
    allowed: bool,
    remaining: u64,
    retry_after: Option<u64>,
    reset_after: u64,
    ttl: Option<u64>,
}

trait Reference {
    /// Decides `cost` at `now` (forward-only clock); records it when `commit`.
    fn decide(&mut self, now: u64, cost: u64, commit: bool) -> Expected;
}

/// Token bucket by the book: a token is `period_µs` sub-units and the bucket gains `tokens`
/// sub-units per microsecond (the rate as given, not reduced), so refill is exact.
struct RefBucket {
    cap: u128,
    per_micro: u128,
    per_token: u128,
    max_elapsed: Option<u64>,
    level: u128,
    last: u64,
    expires_at_ms: Option<u64>,
}

impl RefBucket {
    fn new(policy: &Policy) -> Self {
        let Algorithm::TokenBucket(tb) = policy.algorithm() else {
            unreachable!()
        };
        let per_token = tb.refill.period().as_micros();
        Self {
            cap: u128::from(tb.capacity) * per_token,
            per_micro: u128::from(tb.refill.tokens()),
            per_token,
            max_elapsed: tb.max_elapsed_micros,
            level: 0,
            last: 0,
            expires_at_ms: None,
        }
    }
}

impl Reference for RefBucket {
    fn decide(&mut self, now: u64, cost: u64, commit: bool) -> Expected {
        let alive = self.expires_at_ms.is_some_and(|e| now / 1000 <= e);
        let (level, last) = if alive {
            (self.level, self.last)
        } else {
            (self.cap, now)
        };
        let eff = now.max(last);
        let mut elapsed = eff - last;
        if let Some(m) = self.max_elapsed {
            elapsed = elapsed.min(m);
        }
        let level = self.cap.min(level + u128::from(elapsed) * self.per_micro);
        let need = u128::from(cost) * self.per_token;
        let allowed = level >= need;
        let level = if allowed { level - need } else { level };
        let wait = |deficit: u128| (eff - now) + deficit.div_ceil(self.per_micro) as u64;
        let reset_after = wait(self.cap - level);
        // A denial writes only when credit is capped per call (the state it writes is then
        // one a later call reads differently); otherwise it leaves the bucket as it was.
        let ttl = (commit && (allowed || self.max_elapsed.is_some())).then(|| reset_after.max(1));
        if let Some(ttl) = ttl {
            self.level = level;
            self.last = eff;
            self.expires_at_ms = Some(super::expires_at_ms(now, ttl));
        }
        Expected {
            allowed,
            remaining: (level / self.per_token) as u64,
            retry_after: (!allowed).then(|| {
                let deficit = (need - level).div_ceil(self.per_micro) as u64;
                (eff - now) + self.max_elapsed.map_or(deficit, |m| deficit.min(m))
            }),
            reset_after,
            ttl,
        }
    }
}

/// Fixed window by the book: the admitted cost per epoch-aligned window, from the full history.
struct RefWindow {
    limit: u64,
    window: u64,
    admitted: Vec<(u64, u64)>,
}

impl Reference for RefWindow {
    fn decide(&mut self, now: u64, cost: u64, commit: bool) -> Expected {
        let index = now / self.window;
        let used: u64 = self
            .admitted
            .iter()
            .filter(|a| a.0 == index)
            .map(|a| a.1)
            .sum();
        let allowed = used + cost <= self.limit;
        let used = if allowed { used + cost } else { used };
        let until_end = (index + 1) * self.window - now;
        let ttl = (commit && allowed).then_some(until_end);
        if ttl.is_some() {
            self.admitted.push((index, cost));
        }
        Expected {
            allowed,
            remaining: self.limit - used,
            retry_after: (!allowed).then_some(until_end),
            reset_after: until_end,
            ttl,
        }
    }
}

/// Sliding log by the book: the admitted cost in `(now - window, now]`, from the full history.
struct RefLog {
    limit: u64,
    window: u64,
    admitted: Vec<(u64, u64)>,
}

impl RefLog {
    fn sum_at(&self, at: u64) -> u64 {
        self.admitted
            .iter()
            .filter(|a| a.0 + self.window > at && a.0 <= at)
            .map(|a| a.1)
            .sum()
    }
}

impl Reference for RefLog {
    fn decide(&mut self, now: u64, cost: u64, commit: bool) -> Expected {
        let used = self.sum_at(now);
        let allowed = used + cost <= self.limit;
        // The earliest instant after now at which the request fits: one of the moments an
        // entry leaves the window.
        let retry_after = (!allowed).then(|| {
            self.admitted
                .iter()
                .map(|a| a.0 + self.window)
                .filter(|&leave| leave > now && self.sum_at(leave) + cost <= self.limit)
                .min()
                .expect("everything leaves eventually")
                - now
        });
        let newest = if allowed {
            Some(now)
        } else {
            self.admitted.last().map(|a| a.0)
        };
        let reset_after = newest.map_or(0, |t| (t + self.window).saturating_sub(now));
        let ttl = (commit && allowed).then_some(reset_after);
        if ttl.is_some() {
            self.admitted.push((now, cost));
        }
        Expected {
            allowed,
            remaining: self.limit - used - if allowed { cost } else { 0 },
            retry_after,
            reset_after,
            ttl,
        }
    }
}

fn reference(policy: &Policy) -> Box<dyn Reference> {
    match *policy.algorithm() {
        Algorithm::TokenBucket(_) => Box::new(RefBucket::new(policy)),
        Algorithm::FixedWindow(f) => Box::new(RefWindow {
            limit: f.limit,
            window: f.window_micros,
            admitted: Vec::new(),
        }),
        Algorithm::SlidingLog(s) => Box::new(RefLog {
            limit: s.limit,
            window: s.window_micros,
            admitted: Vec::new(),
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Upper bounds over an admission history (time, cost), times non-decreasing.

fn check_bounds(policy: &Policy, admitted: &[(u64, u64)]) -> Check {
    let mut prefix = vec![0u128];
    for &(_, c) in admitted {
        prefix.push(prefix.last().unwrap() + u128::from(c));
    }
    let between = |i: usize, j: usize| prefix[j + 1] - prefix[i];
    match *policy.algorithm() {
        Algorithm::TokenBucket(tb) => {
            // cost over [a, b] <= capacity + tokens * (b - a) / period, cross-multiplied.
            let period = tb.refill.period().as_micros();
            let tokens = u128::from(tb.refill.tokens());
            for i in 0..admitted.len() {
                for j in i..admitted.len() {
                    let span = u128::from(admitted[j].0 - admitted[i].0);
                    prop_assert!(
                        between(i, j) * period <= u128::from(tb.capacity) * period + tokens * span,
                        "token bucket admitted {} in [{}, {}]: above capacity {} + refill",
                        between(i, j),
                        admitted[i].0,
                        admitted[j].0,
                        tb.capacity
                    );
                }
            }
        }
        Algorithm::FixedWindow(fw) => {
            let mut i = 0;
            while i < admitted.len() {
                let index = admitted[i].0 / fw.window_micros;
                let mut j = i;
                while j + 1 < admitted.len() && admitted[j + 1].0 / fw.window_micros == index {
                    j += 1;
                }
                prop_assert!(
                    between(i, j) <= u128::from(fw.limit),
                    "fixed window admitted {} in window {index}, limit {}",
                    between(i, j),
                    fw.limit
                );
                i = j + 1;
            }
        }
        Algorithm::SlidingLog(sl) => {
            let mut i = 0;
            for j in 0..admitted.len() {
                while admitted[i].0 + sl.window_micros <= admitted[j].0 {
                    i += 1;
                }
                prop_assert!(
                    between(i, j) <= u128::from(sl.limit),
                    "sliding log admitted {} in ({}, {}], limit {}",
                    between(i, j),
                    admitted[j].0.saturating_sub(sl.window_micros),
                    admitted[j].0,
                    sl.limit
                );
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Request sequences.

/// How the clock moves before a request, resolved against the policy's time scale.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// Same instant: a burst.
    Same,
    /// A few microseconds.
    Tiny(u16),
    /// About `n` times the time one unit of limit takes (scale / limit).
    PerUnit(u8),
    /// A fraction of up to twice the scale (`x / 2^32 * 2 * scale`).
    Scaled(u32),
    /// An idle gap of several scales: far beyond any expiry.
    Idle(u8),
    /// The clock steps back by a fraction of up to twice the scale (never before `BASE`).
    Back(u32),
}

/// A request's cost, resolved against the policy's limit.
#[derive(Debug, Clone, Copy)]
enum Cost {
    Small(u8),
    Frac(u32),
    Full,
}

#[derive(Debug, Clone, Copy)]
struct Op {
    step: Step,
    cost: Cost,
    /// A read-only probe instead of a request.
    peek: bool,
}

fn frac(x: u32, of: u64) -> u64 {
    ((u128::from(x) * u128::from(of)) >> 32) as u64
}

/// The time scale of a policy: the refill time of a token bucket, the window of the others.
fn scale(policy: &Policy) -> u64 {
    match *policy.algorithm() {
        Algorithm::TokenBucket(tb) => tb.fill_micros(),
        Algorithm::FixedWindow(f) => f.window_micros,
        Algorithm::SlidingLog(s) => s.window_micros,
    }
}

fn next_time(now: u64, step: Step, policy: &Policy) -> u64 {
    let scale = scale(policy);
    let advance = match step {
        Step::Same => 0,
        Step::Tiny(n) => u64::from(n % 1000),
        Step::PerUnit(n) => (scale / policy.limit()).max(1) * u64::from(n % 4 + 1),
        Step::Scaled(x) => frac(x, scale.saturating_mul(2)),
        Step::Idle(k) => scale.saturating_mul(u64::from(k % 20) + 2).min(MAX_GAP),
        Step::Back(x) => return now - frac(x, scale.saturating_mul(2)).min(now - BASE),
    };
    now + advance
}

fn cost_of(c: Cost, limit: u64) -> u64 {
    match c {
        Cost::Small(n) => (u64::from(n % 3) + 1).min(limit),
        Cost::Frac(x) => frac(x, limit) + 1,
        Cost::Full => limit,
    }
}

fn cost() -> impl Strategy<Value = Cost> {
    prop_oneof![
        4 => any::<u8>().prop_map(Cost::Small),
        3 => any::<u32>().prop_map(Cost::Frac),
        1 => Just(Cost::Full),
    ]
}

fn forward_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => Just(Step::Same),
        2 => any::<u16>().prop_map(Step::Tiny),
        4 => any::<u8>().prop_map(Step::PerUnit),
        3 => any::<u32>().prop_map(Step::Scaled),
        1 => any::<u8>().prop_map(Step::Idle),
    ]
}

fn any_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => forward_step(),
        1 => any::<u32>().prop_map(Step::Back),
        1 => any::<u16>().prop_map(|n| Step::Back(u32::from(n))),
    ]
}

fn ops(step: impl Strategy<Value = Step>) -> impl Strategy<Value = Vec<Op>> {
    let op = (step, cost(), prop::bool::weighted(0.1)).prop_map(|(step, cost, peek)| Op {
        step,
        cost,
        peek,
    });
    prop::collection::vec(op, 1..200)
}

// ---------------------------------------------------------------------------------------------
// Policies: small and large parameters, odd rates, windows from 1 ms to hours.

fn count() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..=10, 1u64..=1_000, 1u64..=1_000_000_000, Just(1 << 40)]
}

fn micros() -> impl Strategy<Value = u64> {
    prop_oneof![
        1_000u64..=10_000,
        10_000u64..=10_000_000,
        10_000_000u64..=10_800_000_000,
        Just(3_000_000),
        Just(3_600_000_000),
    ]
}

fn token_bucket() -> impl Strategy<Value = Policy> {
    let rate = prop_oneof![
        Just((7u64, 3_000_000u64)),
        Just((1_000_000, 1_000_000)),
        Just((3, 7)),
        (count(), 1u64..=1_000),
        (count(), micros()),
    ];
    (
        count(),
        rate,
        prop::option::weighted(0.15, 1u64..=100_000_000),
    )
        .prop_map(|(capacity, (tokens, period), max_elapsed)| {
            let rate = Rate::new(tokens, Duration::from_micros(period));
            // Parameters whose units overflow 2^52 are refused; keep the case with a smaller
            // capacity rather than throw it away.
            let policy = Policy::token_bucket(capacity, rate)
                .or_else(|_| Policy::token_bucket(capacity % 1000 + 1, rate))
                .expect("capacity <= 1000 always fits");
            match max_elapsed {
                Some(m) => policy.with_max_elapsed(Duration::from_micros(m)).unwrap(),
                None => policy,
            }
        })
}

fn fixed_window() -> impl Strategy<Value = Policy> {
    (count(), micros())
        .prop_map(|(l, w)| Policy::fixed_window(l, Duration::from_micros(w)).unwrap())
}

fn sliding_log() -> impl Strategy<Value = Policy> {
    (prop_oneof![1u64..=10, 1u64..=1_000, Just(1_000)], micros())
        .prop_map(|(l, w)| Policy::sliding_log(l, Duration::from_micros(w)).unwrap())
}

// ---------------------------------------------------------------------------------------------
// Checks after each decision.

fn micros_of(d: Duration) -> u64 {
    d.as_micros() as u64
}

fn check_agrees(got: &Decision, want: &Expected, now: u64, cost: u64) -> Check {
    prop_assert!(
        !want.allowed || got.allowed,
        "spurious denial of cost {cost} at {now}: the reference admits it ({want:?}, got {got:?})"
    );
    prop_assert!(
        want.allowed || !got.allowed,
        "over-admission of cost {cost} at {now}: the reference denies it ({want:?}, got {got:?})"
    );
    prop_assert_eq!(got.remaining, want.remaining, "remaining at {}", now);
    prop_assert_eq!(
        got.retry_after.map(micros_of),
        want.retry_after,
        "retry_after at {}",
        now
    );
    prop_assert_eq!(
        micros_of(got.reset_after),
        want.reset_after,
        "reset_after at {}",
        now
    );
    Ok(())
}

/// `remaining` is what the stored state says is left (for a token bucket, its level refilled
/// to the decision's time: a denial leaves the stored state as it was).
fn check_remaining(sim: &Sim, policy: &Policy, d: &Decision, now: u64) -> Check {
    let stored = match (sim.state.as_ref().map(|r| &r.state), policy.algorithm()) {
        (Some(State::TokenBucket(s)), Algorithm::TokenBucket(tb)) => {
            token_bucket::level_at(tb, s.level, s.updated, now.max(s.updated)) / tb.unit
        }
        (Some(State::FixedWindow(s)), Algorithm::FixedWindow(fw)) => fw.limit - s.count,
        (Some(State::SlidingLog(s)), Algorithm::SlidingLog(sl)) => {
            let eff = s.entries.back().map_or(now, |e| e.0.max(now));
            let live: u64 = s
                .entries
                .iter()
                .filter(|e| e.0 + sl.window_micros > eff)
                .map(|e| e.1)
                .sum();
            sl.limit - live
        }
        (state, _) => {
            return Err(TestCaseError::fail(format!(
                "no state after a commit: {state:?}"
            )));
        }
    };
    prop_assert_eq!(d.remaining, stored, "remaining disagrees with the state");
    Ok(())
}

/// On a denial, the same request at `now + retry_after` is admitted and one microsecond
/// earlier it is not, with nothing else consuming.
fn check_retry(sim: &Sim, policy: &Policy, d: &Decision, now: u64, cost: u64) -> Check {
    prop_assert_eq!(d.allowed, d.retry_after.is_none(), "retry_after iff denied");
    let Some(wait) = d.retry_after.map(micros_of) else {
        return Ok(());
    };
    prop_assert!(wait > 0, "a denial with a zero retry_after");
    prop_assert!(
        sim.peek(policy, now + wait, cost)?.allowed,
        "denied again at retry_after {wait}"
    );
    prop_assert!(
        !sim.peek(policy, now + wait - 1, cost)?.allowed,
        "retry_after {wait} is not the earliest admission"
    );
    Ok(())
}

/// At `now + reset_after` the bucket is back to its initial state (a request of the whole
/// limit passes); one microsecond earlier it is not.
fn check_reset(sim: &Sim, policy: &Policy, d: &Decision, now: u64) -> Check {
    let wait = micros_of(d.reset_after);
    let full = policy.limit();
    prop_assert!(
        sim.peek(policy, now + wait, full)?.allowed,
        "not reset at reset_after {wait}"
    );
    if wait > 0 {
        prop_assert!(
            !sim.peek(policy, now + wait - 1, full)?.allowed,
            "already reset before reset_after {wait}"
        );
    }
    Ok(())
}

/// Under the token-bucket cap on credited elapsed time, a wait longer than the cap is reported
/// as the cap (the next call that moves the bucket; see
/// `following_retry_after_under_max_elapsed_admits_at_the_earliest_instant`), which one call
/// cannot satisfy; exactness is checked for waits below the cap.
fn within_elapsed_cap(policy: &Policy, wait: Option<Duration>) -> bool {
    match (policy.algorithm(), wait) {
        (Algorithm::TokenBucket(tb), Some(w)) => {
            tb.max_elapsed_micros.is_none_or(|m| micros_of(w) < m)
        }
        _ => true,
    }
}

/// Runs `ops` on a forward-only clock and checks every decision.
fn run_forward(policy: &Policy, start: u64, ops: &[Op]) -> Check {
    let mut reference = reference(policy);
    let mut sim = Sim::default();
    let mut admitted = Vec::new();
    let mut now = BASE + start;
    for op in ops {
        now = next_time(now, op.step, policy);
        let cost = cost_of(op.cost, policy.limit());
        if op.peek {
            let got = sim.peek(policy, now, cost)?;
            check_agrees(&got, &reference.decide(now, cost, false), now, cost)?;
            continue;
        }
        let out = sim.commit(policy, now, cost)?;
        let want = reference.decide(now, cost, true);
        check_agrees(&out.decision, &want, now, cost)?;
        prop_assert_eq!(out.ttl_micros, want.ttl, "ttl at {}", now);
        if out.decision.allowed {
            admitted.push((now, cost));
        }
        check_remaining(&sim, policy, &out.decision, now)?;
        if within_elapsed_cap(policy, out.decision.retry_after) {
            check_retry(&sim, policy, &out.decision, now, cost)?;
        }
        if within_elapsed_cap(policy, Some(out.decision.reset_after)) {
            check_reset(&sim, policy, &out.decision, now)?;
        }
    }
    check_bounds(policy, &admitted)
}

/// The bucket's stored clock: the newest time it has recorded.
fn stored_time(state: &State) -> Option<u64> {
    match state {
        State::TokenBucket(s) => Some(s.updated),
        State::FixedWindow(s) => Some(s.window_start),
        State::SlidingLog(s) => s.entries.back().map(|e| e.0),
    }
}

/// Runs `ops` on a clock that sometimes steps back, and checks the policy's bounds on the
/// forward-only history: each admission is placed at the high-water mark of the clock readings
/// the bucket has recorded, which is every request for a fixed window (it stores the window)
/// and a token bucket with a cap on credited time (its denials write), and every admission
/// for a sliding log and an uncapped token bucket (a denial writes nothing). A step back onto
/// a bucket the store has already expired starts a new history: no store can remember a
/// bucket it has forgotten.
fn run_with_steps_back(policy: &Policy, start: u64, ops: &[Op]) -> Check {
    let denial_recorded = match policy.algorithm() {
        Algorithm::TokenBucket(tb) => tb.max_elapsed_micros.is_some(),
        Algorithm::FixedWindow(_) => true,
        Algorithm::SlidingLog(_) => false,
    };
    let mut sim = Sim::default();
    let mut admitted = Vec::new();
    let mut now = BASE + start;
    // Every reading of the store's clock, and the readings the bucket recorded.
    let (mut seen, mut recorded) = (now, now);
    for op in ops {
        now = next_time(now, op.step, policy);
        let cost = cost_of(op.cost, policy.limit());
        sim.expire(now);
        if now < seen && sim.state.is_none() {
            check_bounds(policy, &admitted)?;
            admitted.clear();
            (seen, recorded) = (now, now);
        }
        seen = seen.max(now);
        if let Some(record) = &sim.state {
            check_clamped(&sim, &record.state, policy, now, cost)?;
        }
        if op.peek {
            sim.peek(policy, now, cost)?;
            continue;
        }
        let before = sim.state.as_ref().and_then(|r| stored_time(&r.state));
        let out = sim.commit(policy, now, cost)?;
        let after = sim.state.as_ref().and_then(|r| stored_time(&r.state));
        if let (Some(b), Some(a)) = (before, after) {
            prop_assert!(a >= b, "stored time moved back from {b} to {a} (now {now})");
        }
        if out.decision.allowed || denial_recorded {
            recorded = recorded.max(now);
        }
        if out.decision.allowed {
            admitted.push((recorded, cost));
        }
        check_remaining(&sim, policy, &out.decision, now)?;
        if within_elapsed_cap(policy, out.decision.retry_after) {
            check_retry(&sim, policy, &out.decision, now, cost)?;
        }
    }
    check_bounds(policy, &admitted)
}

/// A clock behind the bucket's stored time decides exactly as at the stored time: elapsed
/// time clamps at zero, and the waits are the same instants seen from the earlier clock.
fn check_clamped(sim: &Sim, state: &State, policy: &Policy, now: u64, cost: u64) -> Check {
    let Some(stored) = stored_time(state) else {
        return Ok(());
    };
    // A fixed window is stored by its start; any time inside it decides alike.
    let at = stored;
    if now >= at {
        return Ok(());
    }
    let decide = |t| apply(&mut sim.state.clone(), policy, t, cost, false).map(|o| o.decision);
    let (behind, there) = (decide(now).unwrap(), decide(at).unwrap());
    let shift = Duration::from_micros(at - now);
    prop_assert_eq!(
        behind.allowed,
        there.allowed,
        "a step back changed the decision"
    );
    prop_assert_eq!(behind.remaining, there.remaining);
    prop_assert_eq!(behind.retry_after, there.retry_after.map(|r| r + shift));
    prop_assert_eq!(behind.reset_after, there.reset_after + shift);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn token_bucket_matches_reference_and_bounds(
        policy in token_bucket(), start in 0u64..1 << 40, ops in ops(forward_step()),
    ) {
        run_forward(&policy, start, &ops)?;
    }

    #[test]
    fn fixed_window_matches_reference_and_bounds(
        policy in fixed_window(), start in 0u64..1 << 40, ops in ops(forward_step()),
    ) {
        run_forward(&policy, start, &ops)?;
    }

    #[test]
    fn sliding_log_matches_reference_and_bounds(
        policy in sliding_log(), start in 0u64..1 << 40, ops in ops(forward_step()),
    ) {
        run_forward(&policy, start, &ops)?;
    }

    #[test]
    fn token_bucket_clock_steps_back_admit_nothing_beyond_the_forward_history(
        policy in token_bucket(), start in 0u64..1 << 40, ops in ops(any_step()),
    ) {
        run_with_steps_back(&policy, start, &ops)?;
    }

    #[test]
    fn fixed_window_clock_steps_back_admit_nothing_beyond_the_forward_history(
        policy in fixed_window(), start in 0u64..1 << 40, ops in ops(any_step()),
    ) {
        run_with_steps_back(&policy, start, &ops)?;
    }

    #[test]
    fn sliding_log_clock_steps_back_admit_nothing_beyond_the_forward_history(
        policy in sliding_log(), start in 0u64..1 << 40, ops in ops(any_step()),
    ) {
        run_with_steps_back(&policy, start, &ops)?;
    }
}

/// Minimal case the step-back property found. A denial at 10 ms prunes the entry at 0 but
/// records nothing, so after the clock steps back to 9 ms the log has forgotten an entry that
/// is still in (−1, 9] ms: 3 admitted in one window of limit 2. Fix: prune only when admitting
/// (a denial leaves the state unchanged, as [`super::Outcome`] documents), in the Lua twin too.
#[test]
fn sliding_log_denial_behind_a_step_back_keeps_live_entries() {
    let policy = Policy::sliding_log(2, Duration::from_millis(10)).unwrap();
    let mut s = None;
    let mut at = |ms: u64, cost| {
        apply(&mut s, &policy, ms * 1000, cost, true)
            .unwrap()
            .decision
            .allowed
    };
    assert!(at(0, 1));
    assert!(at(5, 1));
    assert!(!at(10, 2));
    assert!(!at(9, 1), "entries at 0 and 5 ms are both live at 9 ms");
}

/// With a cap on credited elapsed time shorter than the wait, one call after the whole wait is
/// credited only the cap. `retry_after` then points at the next call that moves the bucket, so a
/// client that follows it call after call is admitted at the earliest instant the rate allows.
#[test]
fn following_retry_after_under_max_elapsed_admits_at_the_earliest_instant() {
    let policy = Policy::token_bucket(10, Rate::per_second(1))
        .unwrap()
        .with_max_elapsed(Duration::from_secs(2))
        .unwrap();
    let mut s = None;
    assert!(
        apply(&mut s, &policy, 0, 10, true)
            .unwrap()
            .decision
            .allowed
    );
    let mut now = 0;
    let mut calls = 0;
    loop {
        let d = apply(&mut s, &policy, now, 5, true).unwrap().decision;
        calls += 1;
        if d.allowed {
            break;
        }
        let retry = d.retry_after.unwrap();
        assert!(
            retry <= Duration::from_secs(2),
            "retry {retry:?} beyond the cap"
        );
        now += retry.as_micros() as u64;
        assert!(calls < 10);
    }
    // 5 tokens at 1/s: the earliest instant is 5 s, reached through retries at 2 s and 4 s.
    assert_eq!((now, calls), (5_000_000, 4));
}

#[test]
fn reference_sliding_log_is_sane() {
    let mut r = RefLog {
        limit: 3,
        window: 10,
        admitted: Vec::new(),
    };
    assert!(r.decide(0, 2, true).allowed);
    assert!(r.decide(5, 1, true).allowed);
    let d = r.decide(6, 2, true);
    assert_eq!(
        (d.allowed, d.retry_after, d.reset_after),
        (false, Some(4), 9)
    );
}

// ---------------------------------------------------------------------------------------------
// Policy changes: callers of generation 1 (old) and 2 (new, with a transition rule) on one
// bucket, on a forward clock.

fn policy_pair() -> impl Strategy<Value = (Policy, Policy)> {
    prop_oneof![
        (token_bucket(), token_bucket()),
        (fixed_window(), fixed_window()),
        (sliding_log(), sliding_log()),
    ]
}

/// A pair of policies of different algorithms: an algorithm change between generations.
/// (Boxed: six tuples of these strategies inline overflow a test thread's stack.)
fn algorithm_change() -> impl Strategy<Value = (Policy, Policy)> {
    let (tb, fw, sl) = (
        token_bucket().boxed(),
        fixed_window().boxed(),
        sliding_log().boxed(),
    );
    prop_oneof![
        (tb.clone(), fw.clone()),
        (tb.clone(), sl.clone()),
        (fw.clone(), tb.clone()),
        (fw, sl.clone()),
        (sl.clone(), tb),
        (sl, fixed_window().boxed()),
    ]
    .boxed()
}

fn mixed_ops() -> impl Strategy<Value = Vec<(Op, bool)>> {
    let op = (forward_step(), cost(), any::<bool>()).prop_map(|(step, cost, new)| {
        (
            Op {
                step,
                cost,
                peek: false,
            },
            new,
        )
    });
    prop::collection::vec(op, 1..150)
}

/// Every decision once generation 2 has written the bucket is the one a generation-2 caller
/// would get (newest governs), a deferring bucket is decided under generation 1 and keeps its
/// expiry, and the admissions from generation 2's takeover obey generation 2's bounds.
fn run_mixed(old: Policy, new: Policy, rule: Transition, start: u64, ops: &[(Op, bool)]) -> Check {
    let old = old.with_generation(1);
    let new = new.with_generation(2).with_transition(rule);
    let mut sim = Sim::default();
    let mut now = BASE + start;
    let mut admitted: Vec<(u64, u64)> = Vec::new();
    for &(op, use_new) in ops {
        let caller = if use_new { &new } else { &old };
        now = next_time(now, op.step, caller);
        let cost = cost_of(op.cost, caller.limit());
        sim.expire(now);
        let stored = sim.state.clone();
        // a bucket whose deferral has run out is the missing one it is about to be
        let before = stored.clone().filter(|r| !super::deferral_lapsed(r, now));
        let expires_before = sim.expires_at_ms;
        let new_governs = before.as_ref().is_some_and(|r| r.generation == 2);
        let as_new = apply(&mut before.clone(), &new, now, cost, false).ok();
        let as_old = apply(&mut before.clone(), &old, now, cost, false).ok();
        let result = apply(&mut sim.state, caller, now, cost, true);
        let governing_limit = if new_governs {
            new.limit()
        } else {
            before.as_ref().map_or(caller.limit(), |r| r.params.limit())
        };
        let out = match result {
            Err(crate::PolicyError::CostAboveCapacity { cost: c, max }) => {
                prop_assert!(c > governing_limit && max == governing_limit);
                prop_assert_eq!(&sim.state, &stored, "a refused cost wrote");
                continue;
            }
            Err(e) => return Err(TestCaseError::fail(e.to_string())),
            Ok(out) => out,
        };
        if let Some(ttl) = out.ttl_micros {
            sim.expires_at_ms = super::expires_at_ms(now, ttl);
        }
        let after = sim.state.as_ref().expect("a bucket after a commit");
        if new_governs {
            prop_assert_eq!(
                Some(&out.decision),
                as_new.as_ref().map(|o| &o.decision),
                "generation 2 governs"
            );
            prop_assert_eq!(after.generation, 2);
        }
        let met_old = before.as_ref().is_some_and(|r| r.generation == 1);
        if met_old && rule == Transition::DeferUntilExpiry && cost > governing_limit {
            // only generation 2's limit admits it: denied until the bucket expires
            prop_assert!(!out.decision.allowed, "{:?}", out.decision);
            prop_assert_eq!(out.decision.limit, governing_limit);
            prop_assert_eq!(
                out.decision.retry_after,
                Some(Duration::from_micros(crate::MAX_EXACT)),
                "waits for the expiry (the store caps it there)"
            );
            prop_assert_eq!(after.generation, 1);
            prop_assert!(
                out.ttl_micros.is_none(),
                "a deferring write moved the expiry"
            );
            prop_assert_eq!(sim.expires_at_ms, expires_before);
        } else if met_old && rule == Transition::DeferUntilExpiry {
            prop_assert_eq!(
                Some(&out.decision),
                as_old.as_ref().map(|o| &o.decision),
                "deferred to generation 1"
            );
            prop_assert_eq!(after.generation, 1);
            if use_new || before.as_ref().is_some_and(|r| r.pending.is_some()) {
                prop_assert!(
                    out.ttl_micros.is_none(),
                    "a deferring write moved the expiry"
                );
                prop_assert_eq!(sim.expires_at_ms, expires_before);
            }
        } else if met_old && use_new {
            prop_assert_eq!(after.generation, 2, "generation 2 took the bucket");
            prop_assert!(out.wrote(), "a transition is written even on a denial");
        }
        if after.generation == 2 {
            if out.decision.allowed {
                admitted.push((now, cost));
            }
        } else {
            check_bounds(&new, &admitted)?;
            admitted.clear();
        }
    }
    check_bounds(&new, &admitted)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mixed_generations_obey_the_newest_policy_under_every_rule(
        (old, new) in policy_pair(),
        rule in prop::sample::select(Transition::ALL.to_vec()),
        start in 0u64..1 << 40,
        ops in mixed_ops(),
    ) {
        run_mixed(old, new, rule, start, &ops)?;
    }

    /// The same across algorithms: one record per bucket, so generation 1's algorithm is
    /// decided under generation 2's once it has written the bucket, and generation 2's
    /// admissions from its takeover (converted by each rule) obey generation 2's bounds.
    #[test]
    fn algorithm_changes_obey_the_newest_policy_under_every_rule(
        (old, new) in algorithm_change(),
        rule in prop::sample::select(Transition::ALL.to_vec()),
        start in 0u64..1 << 40,
        ops in mixed_ops(),
    ) {
        run_mixed(old, new, rule, start, &ops)?;
    }

    #[test]
    fn muldiv_agrees_with_exact_arithmetic(
        a in 0u64..=1 << 52, b in 0u64..=1 << 52, c in 1u64..=1 << 52, max in any::<u64>(),
    ) {
        let exact = u128::from(a) * u128::from(b) / u128::from(c);
        prop_assert_eq!(u128::from(super::muldiv(a, b, c, max)), exact.min(u128::from(max)));
    }
}

// ---------------------------------------------------------------------------------------------
// Equivalence with the pre-optimisation maths: the in-place path of `apply` and the
// division-free token bucket must decide and write exactly what the general path did (the Redis
// scripts mirror that path). `frozen` is a copy of it, kept only for this test: verbatim but
// for two later changes of semantics made in both (a token-bucket denial writes nothing, and a
// bucket whose deferral has run out is a missing one; noted in place).

mod frozen {
    use super::super::{
        FixedWindowState, Outcome, Record, SlidingLogState, State, TokenBucketState, fixed_window,
        sliding_log, transition,
    };
    use crate::{Algorithm, Decision, Policy, PolicyError, TokenBucket, Transition};

    pub(super) fn level_at(p: &TokenBucket, stored: u64, updated: u64, eff: u64) -> u64 {
        let cap = p.capacity_units();
        let stored = stored.min(cap);
        let mut elapsed = eff - updated;
        if let Some(max) = p.max_elapsed_micros {
            elapsed = elapsed.min(max);
        }
        let to_full = (cap - stored).div_ceil(p.rate);
        if elapsed >= to_full {
            cap
        } else {
            stored + elapsed * p.rate
        }
    }

    fn token_bucket(
        state: &mut Option<TokenBucketState>,
        p: &TokenBucket,
        now: u64,
        cost: u64,
        commit: bool,
    ) -> Outcome {
        let cap = p.capacity_units();
        let (stored, updated) = state.map_or((cap, now), |s| (s.level, s.updated));
        let eff = now.max(updated);
        let level = level_at(p, stored, updated, eff);
        let need = cost * p.unit;
        let allowed = level >= need;
        let level = if allowed { level - need } else { level };
        let retry_after = (!allowed).then(|| {
            let wait = (need - level).div_ceil(p.rate);
            eff + p.max_elapsed_micros.map_or(wait, |max| wait.min(max)) - now
        });
        let reset_after = eff + (cap - level).div_ceil(p.rate) - now;
        // (Changed since the copy in one point: a denial writes only under a cap on credited
        // time, see the token bucket's module docs.)
        if commit {
            *state = Some(TokenBucketState {
                level,
                updated: eff,
            });
        }
        let ttl_micros =
            (commit && (allowed || p.max_elapsed_micros.is_some())).then_some(reset_after.max(1));
        Outcome {
            decision: Decision::shared(
                allowed,
                p.capacity,
                level / p.unit,
                retry_after,
                reset_after,
            ),
            ttl_micros,
            keep_expiry: false,
        }
    }

    struct Plan {
        generation: u64,
        params: Algorithm,
        pending: Option<u64>,
        state: Option<State>,
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
        let newer = g > r.generation || (g == r.generation && r.params != caller);
        // (Changed since the copy, in both: the same generation with other parameters takes
        // over by `Carry` whatever the rule.)
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

    pub(super) fn apply(
        record: &mut Option<Record>,
        policy: &Policy,
        now: u64,
        cost: u64,
        commit: bool,
    ) -> Result<Outcome, PolicyError> {
        policy.check_cost(cost)?;
        let caller = policy.algorithm().normalized();
        // (Changed since the copy, in both: a record of another algorithm is not missing; the
        // newest generation governs whatever the algorithm.)
        // (a later change of semantics, made in both: a bucket whose deferral has run out is
        // a missing one)
        let stored = record
            .as_ref()
            .filter(|r| !super::super::deferral_lapsed(r, now));
        let plan = plan(stored, policy, caller, now);
        let max = plan.params.limit();
        if cost > max {
            // (Changed since the copy, in both: a cost above the limit of a bucket that
            // governs until its expiry, within the caller's own, is denied until then.)
            if plan.pending.is_some() {
                let state = plan.state.expect("a deferral governs a stored bucket");
                let left =
                    transition::usage(&plan.params, &state, now).map_or(max, |u| u.remaining());
                let write = commit && plan.changed;
                if write {
                    *record = Some(Record {
                        generation: plan.generation,
                        params: plan.params,
                        pending: plan.pending,
                        state,
                    });
                }
                return Ok(Outcome {
                    decision: Decision::shared(
                        false,
                        max,
                        left,
                        Some(crate::MAX_EXACT),
                        crate::MAX_EXACT,
                    ),
                    ttl_micros: None,
                    keep_expiry: write,
                });
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
                let out = token_bucket(&mut s, p, now, cost, commit);
                if let Some(s) = s {
                    *state = Some(State::TokenBucket(s));
                }
                out
            }
            Algorithm::FixedWindow(p) => {
                let mut s: Option<FixedWindowState> = match state {
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
}

/// A bucket visited by several policies (generations 0–3, every rule, sometimes another
/// algorithm), on a clock that also steps back, with commits and peeks, and Redis-like expiry.
fn run_equivalence(policies: &[Policy], start: u64, ops: &[(Op, usize, bool)]) -> Check {
    let mut sim = Sim::default();
    let mut now = BASE + start;
    for &(op, which, fresh_expiry) in ops {
        let policy = &policies[which % policies.len()];
        now = next_time(now, op.step, policy);
        let cost = cost_of(op.cost, policy.limit()).max(1);
        if fresh_expiry {
            sim.expire(now);
        }
        let mut want_state = sim.state.clone();
        let want = frozen::apply(&mut want_state, policy, now, cost, !op.peek);
        let got = apply(&mut sim.state, policy, now, cost, !op.peek);
        prop_assert_eq!(
            &got,
            &want,
            "outcome of cost {} at {} under {}",
            cost,
            now,
            policy
        );
        prop_assert_eq!(
            &sim.state,
            &want_state,
            "record after cost {} at {}",
            cost,
            now
        );
        if let Ok(Outcome {
            ttl_micros: Some(ttl),
            ..
        }) = got
        {
            sim.expires_at_ms = super::expires_at_ms(now, ttl);
        }
    }
    Ok(())
}

fn policy_family() -> impl Strategy<Value = Vec<Policy>> {
    let one = prop_oneof![
        6 => token_bucket(),
        2 => fixed_window(),
        2 => sliding_log(),
    ];
    let versioned = (one, 0u64..4, prop::sample::select(Transition::ALL.to_vec()))
        .prop_map(|(p, g, rule)| p.with_generation(g).with_transition(rule));
    prop::collection::vec(versioned, 1..4)
}

fn equivalence_ops() -> impl Strategy<Value = Vec<(Op, usize, bool)>> {
    (
        ops(any_step()),
        prop::collection::vec((0usize..4, any::<bool>()), 200),
    )
        .prop_map(|(ops, picks)| {
            ops.into_iter()
                .zip(picks)
                .map(|(op, (which, expire))| (op, which, expire))
                .collect()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn apply_decides_and_writes_exactly_as_the_frozen_general_path(
        policies in policy_family(),
        start in 0u64..1 << 40,
        ops in equivalence_ops(),
    ) {
        run_equivalence(&policies, start, &ops)?;
    }

    #[test]
    fn level_at_without_division_agrees_with_the_frozen_one(
        policy in token_bucket(),
        stored in prop_oneof![Just(0u64), 0u64..=1 << 52, any::<u64>().prop_map(|x| x >> 11)],
        updated in any::<u64>(),
        elapsed in prop_oneof![0u64..=10, 0u64..=1 << 20, any::<u64>()],
    ) {
        let Algorithm::TokenBucket(p) = policy.algorithm().normalized() else { unreachable!() };
        let eff = updated.saturating_add(elapsed);
        prop_assert_eq!(
            super::token_bucket::level_at(&p, stored, updated, eff),
            frozen::level_at(&p, stored, updated, eff)
        );
    }
}
