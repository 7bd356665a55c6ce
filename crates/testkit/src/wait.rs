//! The bounded wait every test polls with: a condition checked every [`POLL_EVERY`] until it
//! holds, for at most a bound of time and of checks, in place of a fixed sleep.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use tollgate_testkit::wait::until;
//!
//! let start = Instant::now();
//! until(Duration::from_secs(5), "50 ms passed", || {
//!     start.elapsed() >= Duration::from_millis(50)
//! });
//! ```

use std::time::{Duration, Instant};

/// How often [`until`] and [`eventually`] check their condition.
pub const POLL_EVERY: Duration = Duration::from_millis(20);

/// The most checks a wait of `bound` makes: one every [`POLL_EVERY`], and one more at the end.
fn checks(bound: Duration) -> u128 {
    bound.as_millis() / POLL_EVERY.as_millis() + 1
}

/// Checks `condition` every [`POLL_EVERY`] until it holds, for at most `bound` (and at most
/// `bound / POLL_EVERY + 1` checks), sleeping the thread in between.
///
/// # Panics
/// With `"{what}: not within {bound:?}"` if it does not hold within `bound` (reported at the
/// caller).
#[track_caller]
pub fn until(bound: Duration, what: &str, condition: impl FnMut() -> bool) {
    assert!(
        holds_within(bound, condition),
        "{what}: not within {bound:?}"
    );
}

/// [`until`] for async tests, and for failure messages that show more than a name: sleeps on
/// the runtime between checks (so its tasks, such as a store's sentinel watches, run
/// meanwhile) and returns whether `condition` held within `bound` instead of panicking.
pub async fn eventually(bound: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + bound;
    for _ in 0..checks(bound) {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
    condition()
}

/// Whether `condition` holds within `bound`, checked every [`POLL_EVERY`] (at most
/// `bound / POLL_EVERY + 1` checks), the thread sleeping in between: [`until`] for a failure
/// message of the caller's own.
pub fn holds_within(bound: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + bound;
    for _ in 0..checks(bound) {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(POLL_EVERY);
    }
    condition()
}
