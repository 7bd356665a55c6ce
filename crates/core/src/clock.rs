//! The time source for local decisions. Tests use [`ManualClock`] and move it by hand;
//! nothing in tollgate sleeps to let time pass.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// `timeout` after `now`, or about 30 years after it when that is past what an [`Instant`]
/// can hold: a deadline for a timeout of `Duration::MAX` ("no timeout", as
/// `tokio::time::timeout` takes it) rather than a panic.
///
/// ```
/// use std::time::{Duration, Instant};
/// use tollgate_core::deadline_after;
/// let now = Instant::now();
/// assert_eq!(deadline_after(now, Duration::from_secs(1)), now + Duration::from_secs(1));
/// assert!(deadline_after(now, Duration::MAX) > now + Duration::from_secs(365 * 86_400));
/// ```
pub fn deadline_after(now: Instant, timeout: Duration) -> Instant {
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(30 * 365 * 86_400))
}

/// A source of the current time in integer microseconds since the Unix epoch.
///
/// The Redis store never uses a `Clock`: its scripts read Redis `TIME`. The local store and
/// the core maths take time from here so that tests control it.
pub trait Clock: Send + Sync + 'static {
    /// The current time in microseconds since the Unix epoch.
    fn now_micros(&self) -> u64;
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_micros(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| {
            d.as_secs() * 1_000_000 + u64::from(d.subsec_micros())
        })
    }
}

/// Wall-clock time read once at creation, advanced by a fast monotonic counter (the CPU's
/// timestamp counter through `quanta`, where available). A few nanoseconds per read instead of
/// a system call, and immune to wall-clock steps while it lives: the default clock of the local
/// store, whose decisions never leave the process.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    clock: quanta::Clock,
    base_raw: u64,
    base_wall_micros: u64,
    /// Microseconds per raw tick in 0.64 fixed point, derived once from quanta's own
    /// calibration, so a read is one multiplication (its high half) instead of quanta's
    /// tick-to-nanosecond scaling followed by a division by 1,000 (~13 % of a hot-key
    /// decision's time on an AMD EPYC VM, perf; the counter read itself stays).
    micros_per_tick: u64,
}

/// Raw ticks over which quanta's calibration is read: long enough that the conversion's
/// relative error (one nanosecond in quanta's answer) is below 10^-11.
const CALIBRATION_TICKS: u64 = 1 << 40;

impl MonotonicClock {
    /// A clock anchored to the system's wall clock now.
    ///
    /// # Panics
    /// If quanta's counter ticked slower than once per microsecond (it counts TSC ticks, or
    /// nanoseconds where it falls back to the OS clock).
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let base_raw = clock.raw();
        // micros = ticks · nanos(2^40 ticks) / (2^40 · 1000) = (ticks · factor) >> 64 with
        // factor = nanos(2^40 ticks) · 2^24 / 1000. A tick is far shorter than a microsecond
        // (a TSC tick, or a nanosecond where quanta falls back to the OS clock), so the factor
        // is below 2^64.
        let nanos = clock.delta_as_nanos(0, CALIBRATION_TICKS);
        let factor = (u128::from(nanos) << 24) / 1000;
        Self {
            base_wall_micros: SystemClock.now_micros(),
            base_raw,
            clock,
            micros_per_tick: u64::try_from(factor)
                .expect("quanta counts TSC ticks or nanoseconds, each shorter than a microsecond"),
        }
    }

    /// Microseconds in `ticks` raw ticks.
    fn ticks_to_micros(&self, ticks: u64) -> u64 {
        ((u128::from(ticks) * u128::from(self.micros_per_tick)) >> 64) as u64
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now_micros(&self) -> u64 {
        self.base_wall_micros + self.ticks_to_micros(self.clock.raw().saturating_sub(self.base_raw))
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now_micros(&self) -> u64 {
        (**self).now_micros()
    }
}

impl<C: Clock + ?Sized> Clock for Box<C> {
    fn now_micros(&self) -> u64 {
        (**self).now_micros()
    }
}

/// A clock that only moves when told to. Clones share the same time.
///
/// ```
/// use std::time::Duration;
/// use tollgate_core::{Clock, ManualClock};
/// let clock = ManualClock::new(1_000);
/// clock.advance(Duration::from_millis(1));
/// assert_eq!(clock.now_micros(), 2_000);
/// clock.set(500); // steps back
/// assert_eq!(clock.now_micros(), 500);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock that reads `start_micros` until moved.
    pub fn new(start_micros: u64) -> Self {
        Self(Arc::new(AtomicU64::new(start_micros)))
    }

    /// Moves the clock forward by `by` (whole microseconds).
    ///
    /// # Panics
    ///
    /// If the clock would pass `u64::MAX` µs: a test clock never wraps back to the epoch.
    pub fn advance(&self, by: Duration) {
        let micros =
            u64::try_from(by.as_micros()).expect("ManualClock advanced past u64::MAX microseconds");
        self.advance_micros(micros);
    }

    /// Moves the clock forward by `micros` microseconds.
    ///
    /// # Panics
    ///
    /// If the clock would pass `u64::MAX` µs: a test clock never wraps back to the epoch.
    pub fn advance_micros(&self, micros: u64) {
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                now.checked_add(micros)
            })
            .expect("ManualClock advanced past u64::MAX microseconds");
    }

    /// Sets the clock to `micros`, forward or back.
    pub fn set(&self, micros: u64) {
        self.0.store(micros, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_micros(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_never_wraps_past_the_end_of_time() {
        let clock = ManualClock::new(u64::MAX - 10);
        clock.advance_micros(10);
        assert_eq!(clock.now_micros(), u64::MAX);
        let wrapped = std::panic::catch_unwind(|| clock.advance(Duration::from_micros(1)));
        assert!(wrapped.is_err(), "advanced past u64::MAX");
        assert_eq!(clock.now_micros(), u64::MAX, "unchanged after the refusal");
        let clock = ManualClock::new(0);
        let huge = std::panic::catch_unwind(|| clock.advance(Duration::MAX));
        assert!(
            huge.is_err(),
            "Duration::MAX truncated to a smaller advance"
        );
        assert_eq!(clock.now_micros(), 0);
    }

    #[test]
    fn the_one_multiplication_agrees_with_quantas_own_conversion() {
        let c = MonotonicClock::new();
        // from one tick to about a day of TSC ticks at a few GHz
        for ticks in [
            0,
            1,
            999,
            3_000,
            1 << 20,
            123_456_789,
            1 << 40,
            1 << 48,
            3 << 48,
        ] {
            let quanta = c.clock.delta_as_nanos(0, ticks) / 1000;
            let ours = c.ticks_to_micros(ticks);
            assert!(
                ours.abs_diff(quanta) <= 1,
                "{ticks} ticks: {ours} vs {quanta} µs"
            );
        }
    }

    #[test]
    fn monotonic_clock_reads_the_wall_clock_and_never_goes_back() {
        let c = MonotonicClock::new();
        let wall = SystemClock.now_micros();
        let mut last = c.now_micros();
        assert!(last.abs_diff(wall) < 1_000_000, "{last} vs wall {wall}");
        for _ in 0..10_000 {
            let now = c.now_micros();
            assert!(now >= last, "{now} after {last}");
            last = now;
        }
    }
}
