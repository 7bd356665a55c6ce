//! Sliding log: the exact cost admitted in the last `window`, from a log of (time, cost)
//! entries. Entries at the same microsecond are merged, so the log never holds more than
//! `limit` entries whatever the traffic, and each call's work is bounded by the limit.

use std::collections::VecDeque;

use crate::{Decision, SlidingLog};

use super::Outcome;

/// A sliding log's stored state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingLogState {
    /// (time in microseconds, cost) of admitted requests, oldest first, times strictly rising.
    pub entries: VecDeque<(u64, u64)>,
}

/// Applies `cost` at `now`; see [`super::apply`]. An entry at time `t` counts while
/// `t + window > now`. The newest entry's time is the bucket's clock high-water mark.
pub fn apply(
    state: &mut SlidingLogState,
    p: &SlidingLog,
    now: u64,
    cost: u64,
    commit: bool,
) -> Outcome {
    let w = p.window_micros;
    let eff = state.entries.back().map_or(now, |&(t, _)| now.max(t));
    let first_live = state
        .entries
        .iter()
        .position(|&(t, _)| eff - t < w)
        .unwrap_or(state.entries.len());
    let live = state.entries.range(first_live..);
    let sum: u64 = live.clone().map(|&(_, c)| c).sum();
    let allowed = sum + cost <= p.limit;

    let retry_after = (!allowed).then(|| {
        let mut left = sum;
        let mut wait = eff - now;
        for &(t, c) in live.clone() {
            left -= c;
            wait = super::until(t, w, now);
            if left + cost <= p.limit {
                break;
            }
        }
        wait
    });

    let (sum, newest) = if allowed {
        (sum + cost, Some(eff))
    } else {
        (sum, live.clone().next_back().map(|&(t, _)| t))
    };
    let reset_after = newest.map_or(0, |t| super::until(t, w, now));

    let mut ttl_micros = None;
    // Only an admission records its time, so only an admission may prune: pruning on a denial
    // would forget entries that are live again if the clock steps back (Redis writes nothing
    // on a denial either).
    if commit && allowed {
        state.entries.drain(..first_live);
        match state.entries.back_mut() {
            Some((t, c)) if *t == eff => *c += cost,
            _ => state.entries.push_back((eff, cost)),
        }
        ttl_micros = Some(reset_after);
    }
    Outcome {
        decision: Decision::shared(
            allowed,
            p.limit,
            p.limit.saturating_sub(sum),
            retry_after,
            reset_after,
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

    fn sl(limit: u64, window: Duration) -> SlidingLog {
        match *Policy::sliding_log(limit, window).unwrap().algorithm() {
            Algorithm::SlidingLog(s) => s,
            _ => unreachable!(),
        }
    }

    #[test]
    fn counts_exactly_the_last_window_with_weighted_costs() {
        let p = sl(5, Duration::from_secs(10));
        let mut s = SlidingLogState::default();
        assert!(apply(&mut s, &p, 0, 2, true).decision.allowed);
        assert!(apply(&mut s, &p, 4_000_000, 3, true).decision.allowed);
        let out = apply(&mut s, &p, 6_000_000, 2, true);
        assert!(!out.decision.allowed);
        // the cost-2 entry at 0 leaves the window at 10 s
        assert_eq!(out.decision.retry_after, Some(Duration::from_secs(4)));
        assert!(!apply(&mut s, &p, 9_999_999, 2, true).decision.allowed);
        assert!(apply(&mut s, &p, 10_000_000, 2, true).decision.allowed);
        assert_eq!(s.entries.len(), 2);
    }

    #[test]
    fn merges_entries_at_the_same_instant() {
        let p = sl(100, Duration::from_secs(1));
        let mut s = SlidingLogState::default();
        for _ in 0..50 {
            apply(&mut s, &p, 7, 1, true);
        }
        assert_eq!(s.entries, VecDeque::from([(7, 50)]));
    }
}
