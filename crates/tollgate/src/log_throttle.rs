//! Bounds a warning that traffic can repeat on every request (a new key at a local store's
//! cap) to one line per interval, each line counting the occurrences held back before it.
//! Metrics still count every occurrence; only the log is thinned.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// At most one caller per interval gets through: a time after which the next may pass, moved
/// by one compare-and-swap (the winner of a race passes, the others do not). Shared by the log
/// throttle and the deny cache's sweep of a full cache.
pub(crate) struct Gate {
    pub(crate) epoch: Instant,
    interval_micros: u64,
    /// Microseconds since `epoch` from which the next caller may pass (0: the first passes).
    next_at: AtomicU64,
}

impl Gate {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            interval_micros: interval.as_micros() as u64,
            next_at: AtomicU64::new(0),
        }
    }

    /// Whether this caller passes at `now`.
    pub(crate) fn pass(&self, now: Instant) -> bool {
        let t = now.saturating_duration_since(self.epoch).as_micros() as u64;
        let next = self.next_at.load(Ordering::Acquire);
        t >= next
            && self
                .next_at
                .compare_exchange(
                    next,
                    t.saturating_add(self.interval_micros),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }
}

pub(crate) struct LogThrottle {
    gate: Gate,
    /// Occurrences held back since the last line written.
    suppressed: AtomicU64,
}

impl LogThrottle {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            gate: Gate::new(interval),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Records `n` occurrences at `now`. `Some(held_back)` when a line is due, with the number
    /// of occurrences held back since the previous line; `None` when this one is held back.
    /// Every occurrence is either in a line or counted in the next one.
    pub(crate) fn hit(&self, now: Instant, n: u64) -> Option<u64> {
        if self.gate.pass(now) {
            return Some(self.suppressed.swap(0, Ordering::AcqRel));
        }
        self.suppressed.fetch_add(n, Ordering::AcqRel);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_first_then_one_line_per_interval_with_the_count_held_back() {
        let throttle = LogThrottle::new(Duration::from_secs(10));
        let at = |secs: u64| throttle.gate.epoch + Duration::from_secs(secs);
        assert_eq!(throttle.hit(at(0), 1), Some(0), "the first is written");
        for _ in 0..999 {
            assert_eq!(throttle.hit(at(9), 1), None);
        }
        assert_eq!(throttle.hit(at(9), 3), None, "a batch counts its requests");
        assert_eq!(throttle.hit(at(10), 1), Some(1002), "one interval later");
        assert_eq!(throttle.hit(at(19), 1), None);
        assert_eq!(
            throttle.hit(at(500), 1),
            Some(1),
            "after a quiet spell, at once"
        );
        assert_eq!(throttle.hit(at(500), 1), None);
    }

    #[test]
    fn a_zero_interval_writes_every_occurrence() {
        let throttle = LogThrottle::new(Duration::ZERO);
        for _ in 0..3 {
            assert_eq!(throttle.hit(throttle.gate.epoch, 1), Some(0));
        }
    }
}
