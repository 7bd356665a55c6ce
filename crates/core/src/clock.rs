//! The time source for local decisions. Tests use [`ManualClock`] and move it by hand;
//! nothing in tollgate sleeps to let time pass.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
}

impl MonotonicClock {
    /// A clock anchored to the system's wall clock now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let base_raw = clock.raw();
        Self {
            base_wall_micros: SystemClock.now_micros(),
            base_raw,
            clock,
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_micros(&self) -> u64 {
        self.base_wall_micros + self.clock.delta_as_nanos(self.base_raw, self.clock.raw()) / 1000
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

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.advance_micros(by.as_micros() as u64);
    }

    /// Moves the clock forward by `micros` microseconds.
    pub fn advance_micros(&self, micros: u64) {
        self.0.fetch_add(micros, Ordering::SeqCst);
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
