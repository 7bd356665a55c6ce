//! `tollgate_core::algorithm::apply` on arbitrary policies and sequences of requests under a
//! clock that jumps forward and back. Never panics, and never admits beyond the bound:
//! - token bucket: admitted units ≤ capacity + rate × (latest − first committed time);
//! - fixed window: admitted cost per epoch-aligned window ≤ limit;
//! - sliding log: admitted cost in any window ending at an admission ≤ limit.
//!
//! Also: a refused cost is a typed error that leaves the state alone; a peek never changes the
//! state; `retry_after` is present exactly on denials and is enough (without a cap on credited
//! time, the same request `retry_after` later is admitted); `remaining` ≤ limit.
//!
//! Time is Redis `TIME` in µs, kept below 2^53 (the year 2255), as in production.
#![no_main]

use std::collections::HashMap;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tollgate_core::algorithm::{self, Record, State};
use tollgate_core::{Algorithm, Policy, PolicyError, Rate};

const BASE: u64 = 1_700_000_000_000_000;
const MAX_NOW: u64 = 1 << 53;

#[derive(Arbitrary, Debug)]
enum Params {
    TokenBucket {
        capacity: u64,
        tokens: u64,
        period_us: u64,
        max_elapsed_us: Option<u64>,
    },
    FixedWindow {
        limit: u64,
        window_us: u64,
    },
    SlidingLog {
        limit: u64,
        window_us: u64,
    },
}

#[derive(Arbitrary, Debug)]
struct Op {
    /// Clock step: `step × 10^(scale % 7)` µs, forward or back.
    step: i32,
    scale: u8,
    cost: u64,
    /// Use `cost` as given (mostly invalid) instead of folding it into `1..=limit`.
    raw_cost: bool,
    commit: bool,
}

#[derive(Arbitrary, Debug)]
struct Input {
    params: Params,
    /// Fold the parameters into small ranges (most raw u64s make invalid policies).
    small: bool,
    start: u32,
    ops: Vec<Op>,
}

fn policy(params: &Params, small: bool) -> Result<Policy, PolicyError> {
    let fold = |v: u64, max: u64| if small { 1 + v % max } else { v };
    match *params {
        Params::TokenBucket {
            capacity,
            tokens,
            period_us,
            max_elapsed_us,
        } => {
            let p = Policy::token_bucket(
                fold(capacity, 50),
                Rate::new(
                    fold(tokens, 20),
                    Duration::from_micros(fold(period_us, 20_000_000)),
                ),
            )?;
            match max_elapsed_us {
                Some(m) => p.with_max_elapsed(Duration::from_micros(fold(m, 60_000_000))),
                None => Ok(p),
            }
        }
        Params::FixedWindow { limit, window_us } => Policy::fixed_window(
            fold(limit, 50),
            Duration::from_micros(fold(window_us, 20_000_000)),
        ),
        Params::SlidingLog { limit, window_us } => Policy::sliding_log(
            fold(limit, 50),
            Duration::from_micros(fold(window_us, 20_000_000)),
        ),
    }
}

/// What has been admitted so far, for the bound of each algorithm.
#[derive(Default)]
struct Ledger {
    /// Token bucket: first and latest committed time, admitted units.
    first: Option<u64>,
    latest: u64,
    units: u128,
    /// Fixed window: admitted cost per window start.
    windows: HashMap<u64, u64>,
    /// Sliding log: (effective time, cost) of every admission.
    log: Vec<(u64, u64)>,
}

fuzz_target!(|input: Input| {
    let Ok(policy) = policy(&input.params, input.small) else {
        return;
    };
    let limit = policy.limit();
    let mut now = BASE + u64::from(input.start);
    let mut state: Option<Record> = None;
    let mut ledger = Ledger::default();
    for op in input.ops.iter().take(512) {
        let delta = i128::from(op.step) * 10_i128.pow(u32::from(op.scale % 7));
        now = (i128::from(now) + delta).clamp(0, i128::from(MAX_NOW)) as u64;
        let cost = if op.raw_cost {
            op.cost
        } else {
            1 + op.cost % limit
        };
        let before = state.clone();
        let out = match algorithm::apply(&mut state, &policy, now, cost, op.commit) {
            Err(e) => {
                assert!(cost == 0 || cost > limit, "valid cost {cost} refused: {e}");
                assert_eq!(state, before, "a refused request changed the state");
                continue;
            }
            Ok(out) => out,
        };
        assert!(cost >= 1 && cost <= limit);
        let d = &out.decision;
        assert_eq!(d.limit, limit);
        assert!(d.remaining <= limit, "{d:?}");
        assert_eq!(d.allowed, d.retry_after.is_none(), "{d:?}");
        if !op.commit {
            assert_eq!(state, before, "a peek changed the state");
            assert_eq!(out.ttl_micros, None);
        } else if d.allowed {
            // One policy throughout: no transition ever keeps an old expiry.
            assert!(out.ttl_micros.is_some_and(|t| t > 0), "{out:?}");
            assert!(!out.keep_expiry);
        }
        // Enough: the same request `retry_after` later is admitted (a cap on credited time
        // makes the retry point at the next call that moves the bucket instead).
        let capped = matches!(policy.algorithm(), Algorithm::TokenBucket(tb) if tb.max_elapsed_micros.is_some());
        if let Some(retry) = d.retry_after
            && !capped
        {
            let at = now + u64::try_from(retry.as_micros()).unwrap();
            let mut probe = state.clone();
            let later = algorithm::apply(&mut probe, &policy, at, cost, false).unwrap();
            assert!(
                later.decision.allowed,
                "retry {retry:?} from {now} not enough: {later:?}"
            );
        }
        if !(op.commit && d.allowed) {
            if op.commit
                && let Algorithm::TokenBucket(_) = policy.algorithm()
            {
                ledger.first.get_or_insert(now);
                ledger.latest = ledger.latest.max(now);
            }
            continue;
        }
        match (policy.algorithm(), state.as_ref().map(|r| &r.state)) {
            (Algorithm::TokenBucket(tb), _) => {
                let first = *ledger.first.get_or_insert(now);
                ledger.latest = ledger.latest.max(now);
                ledger.units += u128::from(cost) * u128::from(tb.unit);
                let bound = u128::from(tb.capacity_units())
                    + u128::from(tb.rate) * u128::from(ledger.latest - first);
                assert!(
                    ledger.units <= bound,
                    "token bucket admitted {} units > {bound}",
                    ledger.units
                );
            }
            (Algorithm::FixedWindow(_), Some(State::FixedWindow(s))) => {
                let admitted = ledger.windows.entry(s.window_start).or_default();
                *admitted += cost;
                assert!(
                    *admitted <= limit,
                    "window {} admitted {admitted}",
                    s.window_start
                );
            }
            (Algorithm::SlidingLog(sl), Some(State::SlidingLog(s))) => {
                let t = s.entries.back().expect("an admission is logged").0;
                ledger.log.push((t, cost));
                let in_window: u64 = ledger
                    .log
                    .iter()
                    .filter(|&&(at, _)| at + sl.window_micros > t)
                    .map(|&(_, c)| c)
                    .sum();
                assert!(
                    in_window <= limit,
                    "sliding log admitted {in_window} in the window ending {t}"
                );
            }
            (alg, s) => panic!("state {s:?} after an admission under {alg:?}"),
        }
    }
});
