//! The conformance suite: one set of tests, generic over any [`Store`], that pins the
//! semantics of DESIGN.md for every algorithm. Every backend runs it through a [`Harness`] that
//! gives the store and moves the store's clock.
//!
//! Each case is a `pub async fn case<H: Harness>(h: &H)` that panics with a message naming the
//! step that failed. Each case uses its own key namespace (`conf-<case>`), so cases may share
//! one store or server; each starts by setting the clock to a fixed instant and moves time only
//! through [`Harness::set_time`], so cases sharing one *clock* must not run at the same time.
//! No case sleeps.
//!
//! From any crate's `tests/` directory (with `tokio` as a dev-dependency):
//!
//! ```ignore
//! tollgate_testkit::conformance_tests!(MyHarness::start()); // an `async fn start() -> MyHarness`
//! ```
//!
//! expands to one `#[tokio::test]` per case, each building its own harness from the
//! expression (awaited). [`run_all`] runs every case in turn on one harness.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use async_trait::async_trait;
use tollgate_core::{
    Acquire, Decision, Key, Policy, PolicyError, Rate, Store, StoreError, Transition,
};

/// A store under test and a way to move its clock.
#[async_trait]
pub trait Harness: Send + Sync {
    /// The store under test.
    type Store: Store + 'static;

    /// The store under test.
    fn store(&self) -> &Self::Store;

    /// Freeze the store's clock at `micros` since the epoch (absolute). Later calls move it
    /// forward or back. The clock must not move between calls.
    async fn set_time(&self, micros: u64);
}

/// The instant every case starts from (2023-11-14T22:13:20Z), in microseconds. A multiple of
/// 10 s, so a 10-second fixed window starts exactly here.
pub const T0: u64 = 1_700_000_000_000_000;

const SEC: u64 = 1_000_000;
const MS: u64 = 1_000;

/// Expands to one `#[tokio::test]` per conformance case, each running the case on the harness
/// that `$harness` (an expression of a future) resolves to. The list of cases lives here
/// only; [`CASES`] and [`run_all`] are built from it.
///
/// ```ignore
/// tollgate_testkit::conformance_tests!(async { LocalHarness::new() });
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (@cases $callback:ident $args:tt) => {
        $crate::conformance_tests! {@$callback $args
            token_bucket_missing_bucket_is_full,
            token_bucket_weighted_costs_drain_exactly,
            token_bucket_denies_when_cost_exceeds_remaining,
            token_bucket_refills_at_the_exact_rate,
            token_bucket_retry_after_rounds_up_to_the_microsecond,
            token_bucket_idle_bucket_is_fresh_after_expiry,
            token_bucket_clock_step_back_gives_no_credit,
            token_bucket_forward_jump_refills_at_most_to_capacity,
            token_bucket_max_elapsed_caps_what_a_jump_buys,
            token_bucket_max_elapsed_holds_only_while_the_key_lives,
            fixed_window_missing_window_is_empty,
            fixed_window_resets_at_the_epoch_aligned_boundary,
            fixed_window_denies_when_cost_exceeds_remaining,
            fixed_window_clock_step_back_does_not_reopen_a_window,
            fixed_window_idle_window_is_fresh_after_expiry,
            sliding_log_missing_log_is_empty,
            sliding_log_counts_exactly_the_last_window,
            sliding_log_clock_step_back_forgets_nothing,
            sliding_log_idle_log_is_fresh_after_expiry,
            zero_cost_is_invalid_and_writes_nothing,
            cost_above_capacity_is_invalid_and_writes_nothing,
            peek_does_not_consume,
            reset_forgets_the_bucket,
            keys_are_independent,
            acquire_many_returns_one_decision_per_request_in_order,
            acquire_many_with_an_invalid_request_writes_nothing,
            concurrent_acquires_never_admit_more_than_capacity,
            decisions_are_exact_at_the_edges_of_a_compact_reply,
            newer_generation_carries_and_then_governs_older_callers,
            equal_generations_with_other_parameters_enforce_one_bound,
            newest_generation_governs_across_algorithms,
            a_deferrals_waits_end_when_its_bucket_expires,
            a_deferred_raise_denies_what_only_the_new_limit_admits_until_the_expiry,
        }
    };
    (@names () $($case:ident,)*) => {
        &[$(stringify!($case)),*]
    };
    (@tests ($harness:expr) $($case:ident,)*) => {
        $(
            #[::tokio::test]
            async fn $case() {
                let harness = $harness.await;
                $crate::conformance::$case(&harness).await;
            }
        )*
    };
    (@run ($harness:expr) $($case:ident,)*) => {
        $( $crate::conformance::$case($harness).await; )*
    };
    ($harness:expr) => {
        $crate::conformance_tests!(@cases tests ($harness));
    };
}

/// Every case's name, in the order [`run_all`] runs them.
pub const CASES: &[&str] = conformance_tests!(@cases names ());

/// Runs every case in turn on one harness (see [`CASES`]).
pub async fn run_all<H: Harness>(h: &H) {
    conformance_tests!(@cases run (h));
}

// ---------------------------------------------------------------------------------------------
// Helpers

fn key(case: &str, part: &str) -> Key {
    Key::new(&format!("conf-{case}"), [part]).expect("valid conformance key")
}

fn tb(capacity: u64, refill: Rate) -> Policy {
    Policy::token_bucket(capacity, refill).expect("valid token bucket")
}

fn fw(limit: u64, window_secs: u64) -> Policy {
    Policy::fixed_window(limit, Duration::from_secs(window_secs)).expect("valid fixed window")
}

fn sl(limit: u64, window_secs: u64) -> Policy {
    Policy::sliding_log(limit, Duration::from_secs(window_secs)).expect("valid sliding log")
}

/// One policy of each algorithm with a limit of 5 (token bucket: 5 per 5 s; windows: 10 s).
fn all_algorithms() -> [(&'static str, Policy); 3] {
    [
        ("tb", tb(5, Rate::new(5, Duration::from_secs(5)))),
        ("fw", fw(5, 10)),
        ("sl", sl(5, 10)),
    ]
}

async fn acquire<H: Harness>(h: &H, key: &Key, policy: &Policy, cost: u64) -> Decision {
    h.store()
        .acquire(key, policy, cost)
        .await
        .unwrap_or_else(|e| panic!("acquire({key}, {policy}, cost {cost}) failed: {e}"))
}

async fn peek<H: Harness>(h: &H, key: &Key, policy: &Policy, cost: u64) -> Decision {
    h.store()
        .peek(key, policy, cost)
        .await
        .unwrap_or_else(|e| panic!("peek({key}, {policy}, cost {cost}) failed: {e}"))
}

/// Expected decision: allowed, remaining, retry_after and reset_after in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Want {
    allowed: bool,
    remaining: u64,
    retry_after: Option<u64>,
    reset_after: u64,
}

const fn allowed(remaining: u64, reset_after: u64) -> Want {
    Want {
        allowed: true,
        remaining,
        retry_after: None,
        reset_after,
    }
}

const fn denied(remaining: u64, retry_after: u64, reset_after: u64) -> Want {
    Want {
        allowed: false,
        remaining,
        retry_after: Some(retry_after),
        reset_after,
    }
}

#[track_caller]
fn check(step: &str, policy: &Policy, got: &Decision, want: Want) {
    let got_want = Want {
        allowed: got.allowed,
        remaining: got.remaining,
        retry_after: got.retry_after.map(|d| d.as_micros() as u64),
        reset_after: got.reset_after.as_micros() as u64,
    };
    assert!(
        got_want == want && got.limit == policy.limit(),
        "{step}: under {policy}\n  expected {want:?} with limit {}\n       got {got_want:?} with limit {} ({got:?})",
        policy.limit(),
        got.limit,
    );
}

/// Acquires `cost` on `key` under `policy` and checks the decision against `want` (`step`
/// names the step in a failure).
async fn expect<H: Harness>(h: &H, step: &str, key: &Key, policy: &Policy, cost: u64, want: Want) {
    check(step, policy, &acquire(h, key, policy, cost).await, want);
}

/// Asserts that `key` holds a fresh bucket: the whole limit can be taken at once.
async fn assert_fresh<H: Harness>(step: &str, h: &H, key: &Key, policy: &Policy) {
    let d = peek(h, key, policy, policy.limit()).await;
    assert!(
        d.allowed && d.remaining == 0,
        "{step}: {key} should be a fresh bucket under {policy}, but a peek at its whole limit gave {d:?}"
    );
}

#[track_caller]
fn assert_invalid(step: &str, got: Result<Decision, StoreError>, want: &PolicyError) {
    match got {
        Err(StoreError::InvalidPolicy(e)) if &e == want => {}
        other => panic!("{step}: expected StoreError::InvalidPolicy({want:?}), got {other:?}"),
    }
}

/// Polls every future to completion concurrently on the current task, outputs in order.
async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, out) in futures.iter_mut().zip(outputs.iter_mut()) {
            if out.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *out = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs
        .into_iter()
        .map(|o| o.expect("every future completed"))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Token bucket

/// A missing token bucket is full: the first request drains from capacity, and `reset_after` is
/// the time to refill what it took.
pub async fn token_bucket_missing_bucket_is_full<H: Harness>(h: &H) {
    let t = T0 + 1_000 * SEC;
    h.set_time(t).await;
    let k = key("tb-missing", "a");
    let p = tb(10, Rate::per_second(2));
    check(
        "peek on a missing bucket",
        &p,
        &peek(h, &k, &p, 10).await,
        allowed(0, 5 * SEC),
    );
    expect(h, "first request, cost 1", &k, &p, 1, allowed(9, 500 * MS)).await;
    let k2 = key("tb-missing", "b");
    expect(
        h,
        "first request, whole capacity",
        &k2,
        &p,
        10,
        allowed(0, 5 * SEC),
    )
    .await;
}

/// Weighted costs take exactly their cost, and the next unit is denied with the exact wait.
pub async fn token_bucket_weighted_costs_drain_exactly<H: Harness>(h: &H) {
    let t = T0 + 2_000 * SEC;
    h.set_time(t).await;
    let k = key("tb-weighted", "a");
    let p = tb(10, Rate::per_second(2));
    expect(h, "cost 3", &k, &p, 3, allowed(7, 1_500 * MS)).await;
    expect(h, "cost 4", &k, &p, 4, allowed(3, 3_500 * MS)).await;
    expect(h, "cost 3", &k, &p, 3, allowed(0, 5 * SEC)).await;
    expect(
        h,
        "cost 1 on an empty bucket",
        &k,
        &p,
        1,
        denied(0, 500 * MS, 5 * SEC),
    )
    .await;
}

/// A request costing more than what is left is denied with the exact `retry_after`: admitted
/// at `now + retry_after`, still denied one microsecond before. A denial consumes nothing.
pub async fn token_bucket_denies_when_cost_exceeds_remaining<H: Harness>(h: &H) {
    let t = T0 + 3_000 * SEC;
    h.set_time(t).await;
    let k = key("tb-deny", "a");
    let p = tb(10, Rate::per_second(2));
    expect(h, "drain", &k, &p, 10, allowed(0, 5 * SEC)).await;
    h.set_time(t + 100 * MS).await;
    // 0.2 tokens refilled; 2.8 more take 1.4 s; the bucket is full 4.9 s from now
    expect(
        h,
        "cost 3 after 100 ms",
        &k,
        &p,
        3,
        denied(0, 1_400 * MS, 4_900 * MS),
    )
    .await;
    h.set_time(t + 1_500 * MS - 1).await;
    expect(
        h,
        "1 µs before retry_after",
        &k,
        &p,
        3,
        denied(2, 1, 3_500 * MS + 1),
    )
    .await;
    h.set_time(t + 1_500 * MS).await;
    expect(h, "at retry_after", &k, &p, 3, allowed(0, 5 * SEC)).await;
}

/// Tokens come back at exactly the refill rate, and `remaining` counts whole tokens.
pub async fn token_bucket_refills_at_the_exact_rate<H: Harness>(h: &H) {
    let t = T0 + 4_000 * SEC;
    h.set_time(t).await;
    let k = key("tb-refill", "a");
    let p = tb(10, Rate::per_second(2));
    acquire(h, &k, &p, 10).await;
    h.set_time(t + 2_500 * MS).await;
    // 5 tokens back: take 1, 4 left, 3 s to full
    expect(h, "after 2.5 s", &k, &p, 1, allowed(4, 3 * SEC)).await;
    h.set_time(t + 2_750 * MS).await;
    // 4.5 tokens: 4 whole ones; taking 4 leaves half a token
    expect(h, "after 250 ms more", &k, &p, 4, allowed(0, 4_750 * MS)).await;
    expect(
        h,
        "half a token left",
        &k,
        &p,
        1,
        denied(0, 250 * MS, 4_750 * MS),
    )
    .await;
}

/// A wait that is not a whole number of microseconds is rounded up: 1 token at 3 per 7 s takes
/// 2_333_333.3 µs, so `retry_after` is 2_333_334 µs and holds exactly.
pub async fn token_bucket_retry_after_rounds_up_to_the_microsecond<H: Harness>(h: &H) {
    let t = T0 + 5_000 * SEC;
    h.set_time(t).await;
    let k = key("tb-round", "a");
    let p = tb(5, Rate::new(3, Duration::from_secs(7)));
    // 5 tokens refill in 35/3 s = 11_666_666.7 µs, rounded up
    expect(h, "drain", &k, &p, 5, allowed(0, 11_666_667)).await;
    expect(h, "cost 1", &k, &p, 1, denied(0, 2_333_334, 11_666_667)).await;
    h.set_time(t + 2_333_333).await;
    expect(h, "1 µs early", &k, &p, 1, denied(0, 1, 9_333_334)).await;
    h.set_time(t + 2_333_334).await;
    // 2 units over: (35_000_000 - 2) / 3 µs to full, exactly
    expect(h, "at retry_after", &k, &p, 1, allowed(0, 11_666_666)).await;
}

/// An idle bucket expires once it would be full again, and then behaves as a fresh one.
pub async fn token_bucket_idle_bucket_is_fresh_after_expiry<H: Harness>(h: &H) {
    let t = T0 + 6_000 * SEC;
    h.set_time(t).await;
    let k = key("tb-idle", "a");
    let p = tb(10, Rate::per_second(2));
    let drained = acquire(h, &k, &p, 10).await;
    check("drain", &p, &drained, allowed(0, 5 * SEC));
    let reset_at = t + drained.reset_after.as_micros() as u64;
    h.set_time(reset_at).await;
    assert_fresh("at reset_after", h, &k, &p).await;
    h.set_time(reset_at + 5 * MS).await;
    assert_fresh("past expiry", h, &k, &p).await;
    expect(h, "past expiry", &k, &p, 10, allowed(0, 5 * SEC)).await;
}

/// A clock stepping back credits nothing and never moves the bucket's time back; stepping
/// forward again to where it was gives no second credit.
pub async fn token_bucket_clock_step_back_gives_no_credit<H: Harness>(h: &H) {
    let t = T0 + 7_000 * SEC;
    h.set_time(t + 10 * SEC).await;
    let k = key("tb-back", "a");
    let p = tb(10, Rate::per_second(1));
    acquire(h, &k, &p, 10).await;
    h.set_time(t + 5 * SEC).await;
    // the bucket's time stays at t+10 s: 1 token is 1 s after that, 6 s from now
    expect(h, "5 s back", &k, &p, 1, denied(0, 6 * SEC, 15 * SEC)).await;
    h.set_time(t + 10_500 * MS).await;
    expect(
        h,
        "forward to +0.5 s",
        &k,
        &p,
        1,
        denied(0, 500 * MS, 9_500 * MS),
    )
    .await;
    h.set_time(t + 11 * SEC).await;
    expect(h, "forward to +1 s", &k, &p, 1, allowed(0, 10 * SEC)).await;
}

/// A forward jump refills to capacity and no further, whether the bucket is still stored or
/// has expired meanwhile (hours).
pub async fn token_bucket_forward_jump_refills_at_most_to_capacity<H: Harness>(h: &H) {
    let t = T0 + 8_000 * SEC;
    h.set_time(t).await;
    let k = key("tb-jump", "a");
    let p = tb(10, Rate::per_second(1));
    expect(h, "cost 1", &k, &p, 1, allowed(9, SEC)).await;
    // still stored (its expiry is the millisecond t + 1 s), with 1.0005 s of refill due
    h.set_time(t + SEC + 500).await;
    expect(h, "1.0005 s later", &k, &p, 10, allowed(0, 10 * SEC)).await;
    expect(h, "beyond capacity", &k, &p, 1, denied(0, SEC, 10 * SEC)).await;
    h.set_time(t + 5 * 3600 * SEC).await;
    expect(h, "5 h later", &k, &p, 4, allowed(6, 4 * SEC)).await;
    expect(h, "rest of capacity", &k, &p, 6, allowed(0, 10 * SEC)).await;
    expect(h, "beyond capacity", &k, &p, 1, denied(0, SEC, 10 * SEC)).await;
}

/// With a cap on credited elapsed time, one forward jump buys at most that much refill.
pub async fn token_bucket_max_elapsed_caps_what_a_jump_buys<H: Harness>(h: &H) {
    let t = T0 + 9_000 * SEC;
    h.set_time(t).await;
    let k = key("tb-maxelapsed", "a");
    let p = tb(10, Rate::per_second(1))
        .with_max_elapsed(Duration::from_secs(2))
        .expect("valid cap");
    acquire(h, &k, &p, 10).await;
    // within the bucket's 10 s lifetime: 5 s elapsed, 2 s credited
    h.set_time(t + 5 * SEC).await;
    expect(h, "5 s later, 2 s credited", &k, &p, 1, allowed(1, 9 * SEC)).await;
    expect(h, "nothing more", &k, &p, 2, denied(1, SEC, 9 * SEC)).await;
}

/// The cap on credited time bounds a jump only while the key lives. An emptied bucket's key
/// expires when the bucket would be full again at the full rate (capacity 10 at 1/s: 10 s), in
/// the store's own clock; a jump past that finds no bucket, and a missing bucket is full —
/// what the full refill would have given without the cap. Just before the expiry the jump
/// buys 2 s worth (the cap); just after it, the whole capacity.
pub async fn token_bucket_max_elapsed_holds_only_while_the_key_lives<H: Harness>(h: &H) {
    let t = T0 + 9_500 * SEC;
    h.set_time(t).await;
    let (lives, expired) = (key("tb-maxelapsed-ttl", "a"), key("tb-maxelapsed-ttl", "b"));
    let p = tb(10, Rate::per_second(1))
        .with_max_elapsed(Duration::from_secs(2))
        .expect("valid cap");
    expect(h, "empty a", &lives, &p, 10, allowed(0, 10 * SEC)).await;
    expect(h, "empty b", &expired, &p, 10, allowed(0, 10 * SEC)).await;
    h.set_time(t + 10 * SEC - MS).await;
    let step = "1 ms before the expiry: 2 s credited, not 9.999 s";
    expect(h, step, &lives, &p, 3, denied(2, SEC, 8 * SEC)).await;
    h.set_time(t + 10 * SEC + MS).await;
    let step = "1 ms after the expiry: a fresh, full bucket";
    expect(h, step, &expired, &p, 10, allowed(0, 10 * SEC)).await;
}

// ---------------------------------------------------------------------------------------------
// Fixed window

/// A missing window is empty; `reset_after` is the time to the window's end.
pub async fn fixed_window_missing_window_is_empty<H: Harness>(h: &H) {
    let t = T0 + 10_000 * SEC;
    h.set_time(t + 2 * SEC).await;
    let k = key("fw-missing", "a");
    let p = fw(3, 10);
    check("peek", &p, &peek(h, &k, &p, 3).await, allowed(0, 8 * SEC));
    expect(h, "cost 1", &k, &p, 1, allowed(2, 8 * SEC)).await;
}

/// Windows are aligned to the epoch (`floor(now / window)`): a window filled 2 s into it
/// reopens at its boundary, not 10 s after the first request.
pub async fn fixed_window_resets_at_the_epoch_aligned_boundary<H: Harness>(h: &H) {
    let t = T0 + 11_000 * SEC;
    h.set_time(t + 2 * SEC).await;
    let k = key("fw-boundary", "a");
    let p = fw(3, 10);
    expect(h, "fill", &k, &p, 3, allowed(0, 8 * SEC)).await;
    h.set_time(t + 10 * SEC - 1).await;
    expect(h, "last µs of the window", &k, &p, 1, denied(0, 1, 1)).await;
    h.set_time(t + 10 * SEC).await;
    expect(h, "next window", &k, &p, 1, allowed(2, 10 * SEC)).await;
    h.set_time(t + 12 * SEC).await;
    expect(h, "later in it", &k, &p, 2, allowed(0, 8 * SEC)).await;
}

/// A cost above what the window has left is denied until the window's end; the denial
/// consumes nothing, so a smaller cost still fits.
pub async fn fixed_window_denies_when_cost_exceeds_remaining<H: Harness>(h: &H) {
    let t = T0 + 12_000 * SEC;
    h.set_time(t + 4 * SEC).await;
    let k = key("fw-deny", "a");
    let p = fw(3, 10);
    expect(h, "cost 2", &k, &p, 2, allowed(1, 6 * SEC)).await;
    expect(h, "cost 2 more", &k, &p, 2, denied(1, 6 * SEC, 6 * SEC)).await;
    expect(h, "cost 1 fits", &k, &p, 1, allowed(0, 6 * SEC)).await;
}

/// A clock stepping back does not reopen the window already used, nor a closed earlier one;
/// stepping forward again gives no second window.
pub async fn fixed_window_clock_step_back_does_not_reopen_a_window<H: Harness>(h: &H) {
    let t = T0 + 13_000 * SEC;
    h.set_time(t + 25 * SEC).await;
    let k = key("fw-back", "a");
    let p = fw(2, 10);
    expect(h, "fill window [20, 30)", &k, &p, 2, allowed(0, 5 * SEC)).await;
    h.set_time(t + 15 * SEC).await;
    expect(
        h,
        "back in window [10, 20)",
        &k,
        &p,
        1,
        denied(0, 15 * SEC, 15 * SEC),
    )
    .await;
    h.set_time(t + 25_500 * MS).await;
    expect(
        h,
        "forward again",
        &k,
        &p,
        1,
        denied(0, 4_500 * MS, 4_500 * MS),
    )
    .await;
    h.set_time(t + 30 * SEC).await;
    expect(h, "next window", &k, &p, 1, allowed(1, 10 * SEC)).await;
}

/// A window's state expires at the window's end and a later request sees an empty window.
pub async fn fixed_window_idle_window_is_fresh_after_expiry<H: Harness>(h: &H) {
    let t = T0 + 14_000 * SEC;
    h.set_time(t + 3 * SEC).await;
    let k = key("fw-idle", "a");
    let p = fw(3, 10);
    acquire(h, &k, &p, 3).await;
    h.set_time(t + 35 * SEC).await;
    assert_fresh("three windows later", h, &k, &p).await;
    expect(h, "three windows later", &k, &p, 3, allowed(0, 5 * SEC)).await;
}

// ---------------------------------------------------------------------------------------------
// Sliding log

/// A missing log is empty; `reset_after` is one window after the request just recorded.
pub async fn sliding_log_missing_log_is_empty<H: Harness>(h: &H) {
    let t = T0 + 20_000 * SEC + 1_234_567;
    h.set_time(t).await;
    let k = key("sl-missing", "a");
    let p = sl(5, 10);
    check("peek", &p, &peek(h, &k, &p, 5).await, allowed(0, 10 * SEC));
    expect(h, "cost 2", &k, &p, 2, allowed(3, 10 * SEC)).await;
}

/// The log counts exactly the costs recorded in the last window: a request waits until enough
/// older cost leaves it, to the microsecond.
pub async fn sliding_log_counts_exactly_the_last_window<H: Harness>(h: &H) {
    let t = T0 + 21_000 * SEC + 777;
    h.set_time(t).await;
    let k = key("sl-exact", "a");
    let p = sl(5, 10);
    expect(h, "cost 2 at 0 s", &k, &p, 2, allowed(3, 10 * SEC)).await;
    h.set_time(t + 4 * SEC).await;
    expect(h, "cost 3 at 4 s", &k, &p, 3, allowed(0, 10 * SEC)).await;
    h.set_time(t + 6 * SEC).await;
    // the cost-2 entry at 0 s leaves the window at 10 s; the log empties at 14 s
    expect(h, "cost 2 at 6 s", &k, &p, 2, denied(0, 4 * SEC, 8 * SEC)).await;
    expect(h, "cost 1 at 6 s", &k, &p, 1, denied(0, 4 * SEC, 8 * SEC)).await;
    h.set_time(t + 10 * SEC - 1).await;
    expect(h, "1 µs early", &k, &p, 2, denied(0, 1, 4 * SEC + 1)).await;
    h.set_time(t + 10 * SEC).await;
    expect(h, "at 10 s", &k, &p, 2, allowed(0, 10 * SEC)).await;
    h.set_time(t + 14 * SEC).await;
    expect(h, "at 14 s", &k, &p, 3, allowed(0, 10 * SEC)).await;
}

/// A clock stepping back forgets no entry and lets nothing in early.
pub async fn sliding_log_clock_step_back_forgets_nothing<H: Harness>(h: &H) {
    let t = T0 + 22_000 * SEC;
    h.set_time(t + 10 * SEC).await;
    let k = key("sl-back", "a");
    let p = sl(5, 10);
    acquire(h, &k, &p, 5).await;
    h.set_time(t + 5 * SEC).await;
    expect(h, "5 s back", &k, &p, 1, denied(0, 15 * SEC, 15 * SEC)).await;
    h.set_time(t + 20 * SEC - 1).await;
    expect(
        h,
        "1 µs before the entry leaves",
        &k,
        &p,
        1,
        denied(0, 1, 1),
    )
    .await;
    h.set_time(t + 20 * SEC).await;
    expect(h, "when it leaves", &k, &p, 5, allowed(0, 10 * SEC)).await;
}

/// A log expires one window after its newest entry and then behaves as an empty one.
pub async fn sliding_log_idle_log_is_fresh_after_expiry<H: Harness>(h: &H) {
    let t = T0 + 23_000 * SEC;
    h.set_time(t).await;
    let k = key("sl-idle", "a");
    let p = sl(5, 10);
    acquire(h, &k, &p, 2).await;
    h.set_time(t + 3 * SEC).await;
    expect(h, "fill", &k, &p, 3, allowed(0, 10 * SEC)).await;
    h.set_time(t + 13 * SEC).await;
    assert_fresh("one window after the newest entry", h, &k, &p).await;
    h.set_time(t + 13 * SEC + 5 * MS).await;
    assert_fresh("past expiry", h, &k, &p).await;
    expect(h, "past expiry", &k, &p, 5, allowed(0, 10 * SEC)).await;
}

// ---------------------------------------------------------------------------------------------
// Every algorithm

/// Cost 0 is invalid input, not a denial, and writes nothing.
pub async fn zero_cost_is_invalid_and_writes_nothing<H: Harness>(h: &H) {
    h.set_time(T0 + 30_000 * SEC).await;
    for (name, p) in all_algorithms() {
        let k = key("zero-cost", name);
        assert_invalid(
            name,
            h.store().acquire(&k, &p, 0).await,
            &PolicyError::ZeroCost,
        );
        assert_invalid(
            name,
            h.store().peek(&k, &p, 0).await,
            &PolicyError::ZeroCost,
        );
        assert_fresh(&format!("{name} after cost 0"), h, &k, &p).await;
    }
}

/// A cost above the capacity or limit is invalid input (it could never pass), not a denial: no
/// `retry_after`, and nothing is written, even on a bucket in use.
pub async fn cost_above_capacity_is_invalid_and_writes_nothing<H: Harness>(h: &H) {
    h.set_time(T0 + 31_000 * SEC).await;
    for (name, p) in all_algorithms() {
        let want = PolicyError::CostAboveCapacity { cost: 6, max: 5 };
        let k = key("above-cap", name);
        assert_invalid(name, h.store().acquire(&k, &p, 6).await, &want);
        assert_invalid(name, h.store().peek(&k, &p, 6).await, &want);
        assert_fresh(&format!("{name} after cost 6"), h, &k, &p).await;
        acquire(h, &k, &p, 2).await;
        assert_invalid(name, h.store().acquire(&k, &p, 6).await, &want);
        let d = peek(h, &k, &p, 3).await;
        assert!(
            d.allowed && d.remaining == 0,
            "{name}: the invalid request consumed something: {d:?}"
        );
    }
}

/// Peek says what an acquire would decide, with the same numbers, and consumes nothing.
pub async fn peek_does_not_consume<H: Harness>(h: &H) {
    let t = T0 + 32_000 * SEC;
    h.set_time(t).await;
    for (name, p) in all_algorithms() {
        let k = key("peek", name);
        for _ in 0..10 {
            peek(h, &k, &p, 5).await;
        }
        assert_fresh(&format!("{name} after ten peeks"), h, &k, &p).await;
        acquire(h, &k, &p, 3).await;
        for cost in [2, 3] {
            let peeked = peek(h, &k, &p, cost).await;
            let again = peek(h, &k, &p, cost).await;
            assert_eq!(peeked, again, "{name}: two peeks at cost {cost} disagree");
            if cost == 3 {
                assert!(
                    !peeked.allowed,
                    "{name}: peek at cost 3 on an empty bucket was allowed: {peeked:?}"
                );
            }
            let acquired = acquire(h, &k, &p, cost).await;
            assert_eq!(
                peeked, acquired,
                "{name}: peek at cost {cost} differs from the acquire after it"
            );
        }
    }
}

/// Reset forgets the bucket: the next request sees a fresh one. Resetting a missing key is fine.
pub async fn reset_forgets_the_bucket<H: Harness>(h: &H) {
    h.set_time(T0 + 33_000 * SEC).await;
    for (name, p) in all_algorithms() {
        let k = key("reset", name);
        acquire(h, &k, &p, 5).await;
        assert!(
            !peek(h, &k, &p, 1).await.allowed,
            "{name}: bucket should be exhausted"
        );
        h.store()
            .reset(&k, &p)
            .await
            .unwrap_or_else(|e| panic!("{name}: reset failed: {e}"));
        assert_fresh(&format!("{name} after reset"), h, &k, &p).await;
        h.store()
            .reset(&key("reset", &format!("{name}-missing")), &p)
            .await
            .unwrap_or_else(|e| panic!("{name}: reset of a missing key failed: {e}"));
    }
}

/// Buckets of different keys never share an allowance.
pub async fn keys_are_independent<H: Harness>(h: &H) {
    h.set_time(T0 + 34_000 * SEC).await;
    for (name, p) in all_algorithms() {
        let a = key("independent", &format!("{name}-a"));
        let b = key("independent", &format!("{name}-b"));
        acquire(h, &a, &p, 5).await;
        assert!(
            !peek(h, &a, &p, 1).await.allowed,
            "{name}: a should be exhausted"
        );
        assert_fresh(&format!("{name}: b while a is exhausted"), h, &b, &p).await;
    }
}

/// A batch returns one decision per request, in order, each applied after the ones before it;
/// the same through `acquire_many_by` with a deadline far off (on fresh keys, same time).
pub async fn acquire_many_returns_one_decision_per_request_in_order<H: Harness>(h: &H) {
    h.set_time(T0 + 35_000 * SEC).await;
    let [(_, tbp), (_, fwp), (_, slp)] = all_algorithms();
    for by_deadline in [false, true] {
        let call = if by_deadline {
            "acquire_many_by"
        } else {
            "acquire_many"
        };
        let (a, b, c) = (key(call, "a"), key(call, "b"), key(call, "c"));
        let requests = [
            Acquire::new(&a, &tbp, 3),
            Acquire::new(&a, &tbp, 3),
            Acquire::new(&b, &fwp, 5),
            Acquire::new(&a, &tbp, 2),
            Acquire::new(&c, &slp, 1),
            Acquire::new(&b, &fwp, 1),
        ];
        let batch = if by_deadline {
            let far = std::time::Instant::now() + std::time::Duration::from_secs(3600);
            h.store().acquire_many_by(&requests, far).await
        } else {
            h.store().acquire_many(&requests).await
        };
        let got = batch
            .unwrap_or_else(|e| panic!("{call} failed: {e}"))
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.unwrap_or_else(|e| panic!("{call} request {i} failed: {e}")))
            .collect::<Vec<_>>();
        assert_eq!(
            got.len(),
            requests.len(),
            "{call}: one decision per request"
        );
        check(
            &format!("{call}[0] tb cost 3"),
            &tbp,
            &got[0],
            allowed(2, 3 * SEC),
        );
        check(
            &format!("{call}[1] tb cost 3"),
            &tbp,
            &got[1],
            denied(2, SEC, 3 * SEC),
        );
        check(
            &format!("{call}[2] fw cost 5"),
            &fwp,
            &got[2],
            allowed(0, 10 * SEC),
        );
        check(
            &format!("{call}[3] tb cost 2"),
            &tbp,
            &got[3],
            allowed(0, 5 * SEC),
        );
        check(
            &format!("{call}[4] sl cost 1"),
            &slp,
            &got[4],
            allowed(4, 10 * SEC),
        );
        check(
            &format!("{call}[5] fw cost 1"),
            &fwp,
            &got[5],
            denied(0, 10 * SEC, 10 * SEC),
        );
    }
    let empty = h.store().acquire_many(&[]).await.expect("empty batch");
    assert!(empty.is_empty(), "an empty batch gives no decisions");
}

/// If any request of a batch is invalid, the batch fails and nothing of it is applied.
pub async fn acquire_many_with_an_invalid_request_writes_nothing<H: Harness>(h: &H) {
    h.set_time(T0 + 36_000 * SEC).await;
    let [(_, tbp), (_, fwp), (_, slp)] = all_algorithms();
    let (a, b, c) = (
        key("batch-invalid", "a"),
        key("batch-invalid", "b"),
        key("batch-invalid", "c"),
    );
    let requests = [
        Acquire::new(&a, &tbp, 3),
        Acquire::new(&b, &fwp, 5),
        Acquire::new(&c, &slp, 6),
    ];
    let got = h.store().acquire_many(&requests).await;
    assert!(
        matches!(
            got,
            Err(StoreError::InvalidPolicy(PolicyError::CostAboveCapacity {
                cost: 6,
                max: 5
            }))
        ),
        "a batch with cost 6 on a limit of 5 should be InvalidPolicy, got {got:?}"
    );
    let zero = [Acquire::new(&a, &tbp, 1), Acquire::new(&b, &fwp, 0)];
    let got = h.store().acquire_many(&zero).await;
    assert!(
        matches!(got, Err(StoreError::InvalidPolicy(PolicyError::ZeroCost))),
        "a batch with cost 0 should be InvalidPolicy, got {got:?}"
    );
    assert_fresh("a after the failed batches", h, &a, &tbp).await;
    assert_fresh("b after the failed batches", h, &b, &fwp).await;
    assert_fresh("c after the failed batches", h, &c, &slp).await;
}

/// Many concurrent requests on one key at one frozen instant admit exactly the limit, each
/// admitted request seeing a distinct `remaining`.
pub async fn concurrent_acquires_never_admit_more_than_capacity<H: Harness>(h: &H) {
    h.set_time(T0 + 37_000 * SEC).await;
    let policies = [
        ("tb", tb(10, Rate::per_second(1))),
        ("fw", fw(10, 10)),
        ("sl", sl(10, 10)),
    ];
    for (name, p) in policies {
        let k = key("concurrent", name);
        let calls = (0..64).map(|_| h.store().acquire(&k, &p, 1)).collect();
        let decisions = join_all(calls).await;
        let mut remaining: Vec<u64> = Vec::new();
        for d in decisions {
            let d = d.unwrap_or_else(|e| panic!("{name}: concurrent acquire failed: {e}"));
            if d.allowed {
                remaining.push(d.remaining);
            }
        }
        remaining.sort_unstable();
        assert_eq!(
            remaining,
            (0..10).collect::<Vec<_>>(),
            "{name}: 64 concurrent requests on a limit of 10 should admit exactly 10, each seeing a distinct remaining"
        );
    }
}

/// Decisions at the edges of a compact reply come back exact. A store may encode a decision
/// compactly (the Redis script replies most admissions as one integer, `remaining * 2^37 +
/// reset_after_us`, when remaining < 2^16 and reset_after_us < 2^37); every field must still
/// come back as computed: a `reset_after` of 2^37 µs (about 38.2 h) and 2^37 - 1 for each
/// algorithm, and a `remaining` of 2^16 - 1, 2^16 and 2^16 + 1 with an odd `reset_after`.
pub async fn decisions_are_exact_at_the_edges_of_a_compact_reply<H: Harness>(h: &H) {
    const P37: u64 = 1 << 37;
    const P16: u64 = 1 << 16;
    let long = Duration::from_micros(P37);
    // the start of a 2^37 µs window, past every other case's instants
    let t = (T0 + 100_000 * SEC).next_multiple_of(P37);
    h.set_time(t).await;
    let k = |part: &str| key("compact-reply", part);
    // reset_after 2^37 exactly: a token bucket of 1 refilling 1 per 2^37 µs; a window of
    // 2^37 µs at its start; a log of window 2^37 µs
    let bucket = tb(1, Rate::new(1, long));
    let window = Policy::fixed_window(5, long).expect("valid fixed window");
    let log = Policy::sliding_log(5, long).expect("valid sliding log");
    expect(h, "tb: reset 2^37", &k("tb"), &bucket, 1, allowed(0, P37)).await;
    expect(h, "fw: reset 2^37", &k("fw"), &window, 1, allowed(4, P37)).await;
    expect(h, "sl: reset 2^37", &k("sl"), &log, 1, allowed(4, P37)).await;
    h.set_time(t + 1).await;
    let step = "fw 1 µs later: reset 2^37 - 1";
    expect(h, step, &k("fw"), &window, 1, allowed(3, P37 - 1)).await;
    // remaining around 2^16, with an odd reset_after: a token bucket refilling 1 per 3 µs,
    // and a window of 2^37 µs 1 µs after its start
    for left in [P16 - 1, P16, P16 + 1] {
        let bucket = tb(left + 1, Rate::new(1, Duration::from_micros(3)));
        let step = format!("tb: remaining {left}, reset 3");
        expect(
            h,
            &step,
            &k(&format!("tb-{left}")),
            &bucket,
            1,
            allowed(left, 3),
        )
        .await;
        let window = Policy::fixed_window(left + 1, long).expect("valid fixed window");
        let step = format!("fw: remaining {left}, reset 2^37 - 1");
        let want = allowed(left, P37 - 1);
        expect(h, &step, &k(&format!("fw-{left}")), &window, 1, want).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Policy changes (docs/policy-changes.md)

/// Generation 2 (limit 3, `Carry`) meets a bucket on which generation 1 (limit 5) took 2: the
/// used allowance carries over, and from then on generation-1 callers are decided under
/// generation 2's parameters (newest governs), with its limit in the decision.
pub async fn newer_generation_carries_and_then_governs_older_callers<H: Harness>(h: &H) {
    h.set_time(T0 + 40_000 * SEC).await;
    let shrunk = [
        tb(3, Rate::new(5, Duration::from_secs(5))),
        fw(3, 10),
        sl(3, 10),
    ];
    for ((name, p), new) in all_algorithms().into_iter().zip(shrunk) {
        let k = key("generations", name);
        let old = p.with_generation(1);
        let new = new.with_generation(2).with_transition(Transition::Carry);
        let d = acquire(h, &k, &old, 2).await;
        assert!(
            d.allowed && d.remaining == 3,
            "{name}: generation 1 takes 2 of 5: {d:?}"
        );
        let d = acquire(h, &k, &new, 1).await;
        // token bucket: 3 tokens carried (at most 3), 1 taken; windows: 2 used + 1 = 3 of 3
        let left = if name == "tb" { 2 } else { 0 };
        assert!(
            d.allowed && d.limit == 3 && d.remaining == left,
            "{name}: generation 2 carries: {d:?}"
        );
        let d = acquire(h, &k, &old, 1).await;
        let want = (name == "tb", 3, left.saturating_sub(1));
        assert_eq!(
            (d.allowed, d.limit, d.remaining),
            want,
            "{name}: a generation-1 caller is decided under generation 2"
        );
        assert_invalid(
            &format!("{name}: a generation-1 cost above generation 2's limit"),
            h.store().acquire(&k, &old, 4).await,
            &PolicyError::CostAboveCapacity { cost: 4, max: 3 },
        );
    }
}

/// Two policies of one generation (0) with other parameters (limits 5 and 4), alternating on
/// one key with no time passing: whatever their transition rule, the bucket is never granted
/// afresh. At an equal generation the caller's parameters take over by `Carry` (the rule
/// applies only to a strictly newer generation), so together they admit at most the larger
/// limit, 5.
pub async fn equal_generations_with_other_parameters_enforce_one_bound<H: Harness>(h: &H) {
    h.set_time(T0 + 50_000 * SEC).await;
    let smaller = [
        tb(4, Rate::new(5, Duration::from_secs(5))),
        fw(4, 10),
        sl(4, 10),
    ];
    for ((name, five), four) in all_algorithms().into_iter().zip(smaller) {
        for rule in [
            Transition::Reset,
            Transition::Carry,
            Transition::Proportional,
            Transition::DeferUntilExpiry,
        ] {
            let bucket = key("equal-generations", &format!("{name}-{rule}"));
            let pair = [five.with_transition(rule), four.with_transition(rule)];
            let mut admitted = 0;
            for _ in 0..50 {
                for caller in &pair {
                    let got = acquire(h, &bucket, caller, 1).await;
                    assert_eq!(
                        got.limit,
                        caller.limit(),
                        "{name} {rule}: the caller's limit governs"
                    );
                    admitted += u64::from(got.allowed);
                }
            }
            assert_eq!(
                admitted, 5,
                "{name} {rule}: generation 0 with limits 5 and 4 alternating admitted {admitted} with no time passing"
            );
        }
    }
}

/// A mid-rollout algorithm change: generation 1 is a fixed window (3 per 10 s), generation 0
/// a token bucket (5, 1/s), alternating on one key with no time passing. One bucket per key
/// whatever the algorithm, so the fleet enforces exactly generation 1's policy: generation-0
/// callers are decided under the stored fixed window (its limit in their decisions), and
/// generation 1 moves a token bucket it meets by its rule (`Carry`: the 2 tokens used stay
/// used; `Proportional`: 3 of 5 left → 1 of 3 left; `Reset`: a fresh window;
/// `DeferUntilExpiry`: the token bucket governs until its key expires, then the window).
pub async fn newest_generation_governs_across_algorithms<H: Harness>(h: &H) {
    let t = T0 + 60_000 * SEC;
    let old = tb(5, Rate::per_second(1));
    let window = fw(3, 10);
    // the fixed window meets no bucket: it writes one, and every caller obeys it
    h.set_time(t).await;
    let k = key("across-algorithms", "fresh");
    let new = window.with_generation(1).with_transition(Transition::Reset);
    let mut admitted = 0;
    for i in 0..10 {
        for caller in [&new, &old] {
            let got = acquire(h, &k, caller, 1).await;
            assert_eq!(
                got.limit, 3,
                "fresh, call {i}: generation 1 governs ({got:?})"
            );
            admitted += u64::from(got.allowed);
        }
    }
    assert_eq!(
        admitted, 3,
        "fresh: one fixed window of 3 for both algorithms"
    );
    // the token bucket wrote first (2 taken); generation 1 meets it under each rule
    for (rule, after) in [
        (Transition::Reset, 3),
        (Transition::Carry, 1),
        (Transition::Proportional, 1),
        (Transition::DeferUntilExpiry, 3),
    ] {
        let t = t + 100 * SEC;
        h.set_time(t).await;
        let k = key("across-algorithms", &format!("{rule}"));
        let new = window.with_generation(1).with_transition(rule);
        expect(h, "generation 0 first", &k, &old, 2, allowed(3, 2 * SEC)).await;
        let governing = if rule == Transition::DeferUntilExpiry {
            5
        } else {
            3
        };
        let mut admitted = 0;
        for i in 0..10 {
            for caller in [&new, &old] {
                let got = acquire(h, &k, caller, 1).await;
                assert_eq!(got.limit, governing, "{rule}, call {i}: {got:?}");
                admitted += u64::from(got.allowed);
            }
        }
        assert_eq!(
            admitted, after,
            "{rule}: admitted after generation 1 arrived"
        );
        if rule == Transition::DeferUntilExpiry {
            // the token bucket's key expires (it kept its expiry, t + 2 s: the 2 tokens'
            // refill); then generation 1 writes a fixed window, which governs everyone
            h.set_time(t + 3 * SEC).await;
            let mut admitted = 0;
            for i in 0..10 {
                for caller in [&new, &old] {
                    let got = acquire(h, &k, caller, 1).await;
                    assert_eq!(got.limit, 3, "{rule} after expiry, call {i}: {got:?}");
                    admitted += u64::from(got.allowed);
                }
            }
            assert_eq!(admitted, 3, "{rule}: after expiry, one fixed window of 3");
        }
    }
}

/// Under `DeferUntilExpiry` the old parameters govern until the bucket's key expires (its
/// expiry kept), and then a fresh bucket admits the caller's cost: so `retry_after` and
/// `reset_after` end at the first microsecond the key is gone, however long the old
/// parameters' refill would take. A deny cache trusts `retry_after`: later would deny what
/// the store admits.
pub async fn a_deferrals_waits_end_when_its_bucket_expires<H: Harness>(h: &H) {
    let t = T0 + 70_000 * SEC;
    let old = tb(4, Rate::per_second(4)).with_generation(1);
    let new = old
        .with_generation(2)
        .with_transition(Transition::DeferUntilExpiry);
    let k = key("defer-expiry", "k");
    h.set_time(t).await;
    // generation 1 drains the bucket: its key lives through millisecond t/1000 + 1000
    expect(h, "generation 1 takes 4", &k, &old, 4, allowed(0, SEC)).await;
    let gone = (t / 1000 + 1000 + 1) * 1000;
    let now = t + SEC / 2;
    h.set_time(now).await;
    // generation 2 defers: the old bucket (2 tokens refilled) governs, keeping its expiry; a
    // full refill would take 1 s, but the key is gone sooner
    expect(
        h,
        "generation 2 takes 2",
        &k,
        &new,
        2,
        allowed(0, gone - now),
    )
    .await;
    let short = denied(0, gone - now, gone - now);
    check(
        "generation 2 peeks 4",
        &new,
        &peek(h, &k, &new, 4).await,
        short,
    );
    expect(h, "generation 2 asks 4", &k, &new, 4, short).await;
    expect(h, "generation 1 asks 4", &k, &old, 4, short).await;
    h.set_time(gone - 1).await;
    expect(h, "the last microsecond", &k, &new, 4, denied(2, 1, 1)).await;
    h.set_time(gone).await;
    // gone: a fresh bucket of generation 2 admits the cost denied until then
    expect(h, "at the expiry", &k, &new, 4, allowed(0, SEC)).await;
}

/// A raise under `DeferUntilExpiry`: the old, smaller parameters govern the live bucket until
/// its key expires, so a cost above the old limit but within the new one cannot pass before
/// then, and passes at once after (a fresh bucket under the new parameters). It is denied
/// until the expiry — under the old limit, with what the old bucket has left, nothing spent —
/// never refused as invalid input (it was a `CostAboveCapacity`, HTTP 413, for a request the
/// store admits a moment later; found by a review). An old caller's cost above its own limit
/// stays invalid.
pub async fn a_deferred_raise_denies_what_only_the_new_limit_admits_until_the_expiry<H: Harness>(
    h: &H,
) {
    let t = T0 + 80_000 * SEC;
    let old = tb(4, Rate::per_second(4)).with_generation(1);
    let new = tb(8, Rate::per_second(8))
        .with_generation(2)
        .with_transition(Transition::DeferUntilExpiry);
    let k = key("defer-raise", "k");
    h.set_time(t).await;
    // generation 1 drains the bucket: its key lives through millisecond t/1000 + 1000
    expect(h, "generation 1 takes 4", &k, &old, 4, allowed(0, SEC)).await;
    let gone = (t / 1000 + 1000 + 1) * 1000;
    let now = t + SEC / 2;
    h.set_time(now).await;
    // 2 tokens refilled under the old parameters; 6 only the new capacity holds
    let wait = denied(2, gone - now, gone - now);
    check(
        "generation 2 peeks 6",
        &old,
        &peek(h, &k, &new, 6).await,
        wait,
    );
    check(
        "generation 2 asks 6",
        &old,
        &acquire(h, &k, &new, 6).await,
        wait,
    );
    // nothing was spent: the old bucket still holds its 2, the deferral governs
    expect(
        h,
        "generation 2 takes 2",
        &k,
        &old,
        2,
        allowed(0, gone - now),
    )
    .await;
    let dry = denied(0, gone - now, gone - now);
    check(
        "generation 2 asks 6 again",
        &old,
        &acquire(h, &k, &new, 6).await,
        dry,
    );
    let refused = h.store().acquire(&k, &old, 6).await;
    assert!(
        matches!(
            refused,
            Err(tollgate_core::StoreError::InvalidPolicy(
                tollgate_core::PolicyError::CostAboveCapacity { .. }
            ))
        ),
        "generation 1 asks above its own limit: {refused:?}"
    );
    h.set_time(gone).await;
    expect(h, "at the expiry", &k, &new, 6, allowed(2, SEC / 8 * 6)).await;
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_case_is_listed_once() {
        let mut names = super::CASES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), super::CASES.len());
        assert_eq!(names.len(), 33);
    }
}
