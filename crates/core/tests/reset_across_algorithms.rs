//! A `Reset` into another algorithm after the clock stepped back: the fresh bucket starts at
//! `max(now, the old bucket's time)` (DESIGN, Clock: "the stored timestamp never moves
//! backwards (no double credit when it steps forward again)"), as a `Reset` within one
//! algorithm does.

use std::time::Duration;

use tollgate_core::algorithm::{self, Record};
use tollgate_core::{Policy, Rate, Transition};

const S: u64 = 1_000_000;
/// A Redis TIME in 2023, one second into a 10-second window.
const T: u64 = 1_700_000_000_000_000 + S;

fn acquire(record: &mut Option<Record>, p: &Policy, now: u64, cost: u64) -> bool {
    algorithm::apply(record, p, now, cost, true)
        .unwrap()
        .decision
        .allowed
}

/// Generation 0 (of `old`) spends its allowance at T; the clock steps back 10 s and generation
/// 2 (`new`, rule `Reset`) spends a fresh allowance there; when the clock returns to T, where
/// the bucket already was, nothing more is admitted. Returns (admitted back, admitted again).
fn step_back_and_return(old: &Policy, new: &Policy) -> (usize, usize) {
    let mut record = None;
    assert!(acquire(&mut record, old, T, 5));
    let back = T - 10 * S;
    let admitted_back = (0..5)
        .filter(|_| acquire(&mut record, new, back, 1))
        .count();
    let admitted_again = (0..5).filter(|_| acquire(&mut record, new, T, 1)).count();
    (admitted_back, admitted_again)
}

#[test]
fn reset_into_a_fixed_window_never_moves_the_buckets_time_back() {
    let window = |g| {
        Policy::fixed_window(5, Duration::from_secs(10))
            .unwrap()
            .with_generation(g)
            .with_transition(Transition::Reset)
    };
    let bucket = Policy::token_bucket(5, Rate::per_second(1)).unwrap();
    for (old, name) in [(window(0), "fixed window"), (bucket, "token bucket")] {
        assert_eq!(
            step_back_and_return(&old, &window(2)),
            (5, 0),
            "{name} -> fixed window, reset"
        );
    }
}

#[test]
fn reset_into_a_token_bucket_never_moves_the_buckets_time_back() {
    let bucket = |g| {
        Policy::token_bucket(5, Rate::per_second(1))
            .unwrap()
            .with_generation(g)
            .with_transition(Transition::Reset)
    };
    assert_eq!(
        step_back_and_return(&bucket(0), &bucket(2)),
        (5, 0),
        "token bucket -> token bucket, reset"
    );
    // A fixed window keeps only its window's start (T - 1 s), so the fresh token bucket starts
    // there and has refilled one token (at 1/s) when the clock is back at T: never a second
    // fresh allowance (it started at the stepped-back clock, and admitted 5 more at T).
    let window = Policy::fixed_window(5, Duration::from_secs(10)).unwrap();
    assert_eq!(
        step_back_and_return(&window, &bucket(2)),
        (5, 1),
        "fixed window -> token bucket, reset"
    );
}

/// A sliding log keeps its time in its entries, so the empty log a `Reset` makes had none: its
/// first entries were written at the stepped-back clock, and the clock's return admitted 5
/// more (found by a review: `(5, 5)` from a log and from a token bucket). It holds the old
/// bucket's time now (`transition::convert`). With no policy change a log keeps its time
/// across the same step (its newest entry is its clock).
#[test]
fn reset_into_a_sliding_log_never_moves_the_buckets_time_back() {
    let log = |g| {
        Policy::sliding_log(5, Duration::from_secs(10))
            .unwrap()
            .with_generation(g)
            .with_transition(Transition::Reset)
    };
    assert_eq!(step_back_and_return(&log(0), &log(0)), (0, 0), "no change");
    let bucket = Policy::token_bucket(5, Rate::per_second(1)).unwrap();
    let window = Policy::fixed_window(5, Duration::from_secs(10)).unwrap();
    for (old, name) in [(log(0), "sliding log"), (bucket, "token bucket")] {
        assert_eq!(
            step_back_and_return(&old, &log(2)),
            (5, 0),
            "{name} -> sliding log, reset"
        );
    }
    // a fixed window keeps only its window's start (T - 1 s): the log's first entries are
    // there, live until T + 9 s, so none again at T
    assert_eq!(
        step_back_and_return(&window, &log(2)),
        (5, 0),
        "fixed window -> sliding log, reset"
    );
    // `Carry` and `Proportional` carry the use as one entry at the old bucket's time: written
    // at `later`, converted with the clock 10 s behind it, the entry stays at `later`
    for rule in [Transition::Carry, Transition::Proportional] {
        let mut record = None;
        assert!(acquire(&mut record, &log(0), T, 1));
        let later = T + 10 * S;
        let fresh = Policy::token_bucket(5, Rate::per_second(1)).unwrap();
        assert!(acquire(&mut record, &fresh.with_generation(1), later, 1));
        let to = log(2).with_transition(rule);
        let back = later - 10 * S;
        let admitted_back = (0..5)
            .filter(|_| acquire(&mut record, &to, back, 1))
            .count();
        let admitted_again = (0..5)
            .filter(|_| acquire(&mut record, &to, later, 1))
            .count();
        assert_eq!(
            admitted_back + admitted_again,
            4,
            "{rule:?}: the token bucket's 1 used carried, 4 in all, wherever the clock is"
        );
    }
}
