//! Fixed window: `limit` per window aligned to the Unix epoch (`floor(now / window)`).
//! The state expires at the window's end.

use crate::{Decision, FixedWindow};

use super::Outcome;

/// A fixed window's stored state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FixedWindowState {
    /// Start of the window the count belongs to, in microseconds.
    pub window_start: u64,
    /// Cost admitted in that window.
    pub count: u64,
}

/// Applies `cost` at `now`; see [`super::apply`]. A stored window later than the current one
/// (the clock stepped back) stays in force: a backward step never reopens a closed window.
pub fn apply(
    state: &mut Option<FixedWindowState>,
    p: &FixedWindow,
    now: u64,
    cost: u64,
    commit: bool,
) -> Outcome {
    let current = now - now % p.window_micros;
    let (start, count) = match *state {
        Some(s) if s.window_start >= current => (s.window_start, s.count),
        _ => (current, 0),
    };
    let until_end = super::until(start, p.window_micros, now);
    let allowed = count + cost <= p.limit;
    let count = if allowed { count + cost } else { count };
    let ttl_micros = (commit && allowed).then(|| {
        *state = Some(FixedWindowState {
            window_start: start,
            count,
        });
        until_end
    });
    Outcome {
        decision: Decision::shared(
            allowed,
            p.limit,
            // A live window counted under a larger, older limit may hold more than this one.
            p.limit.saturating_sub(count),
            (!allowed).then_some(until_end),
            until_end,
        ),
        ttl_micros,
        keep_expiry: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Policy};
    use std::time::Duration;

    fn fw(limit: u64, window: Duration) -> FixedWindow {
        match *Policy::fixed_window(limit, window).unwrap().algorithm() {
            Algorithm::FixedWindow(f) => f,
            _ => unreachable!(),
        }
    }

    #[test]
    fn windows_align_to_the_epoch_and_reset_at_the_boundary() {
        let p = fw(3, Duration::from_secs(10));
        let mut s = None;
        assert!(apply(&mut s, &p, 12_000_000, 3, true).decision.allowed);
        let denied = apply(&mut s, &p, 15_000_000, 1, true);
        assert!(!denied.decision.allowed);
        assert_eq!(denied.decision.retry_after, Some(Duration::from_secs(5)));
        assert!(apply(&mut s, &p, 20_000_000, 3, true).decision.allowed);
    }

    #[test]
    fn backward_step_does_not_reopen_a_closed_window() {
        let p = fw(2, Duration::from_secs(10));
        let mut s = None;
        apply(&mut s, &p, 25_000_000, 2, true);
        let out = apply(&mut s, &p, 15_000_000, 1, true);
        assert!(!out.decision.allowed);
        assert_eq!(out.decision.retry_after, Some(Duration::from_secs(15)));
    }
}
