//! A circuit breaker in front of the store: after repeated unavailability the limiter stops
//! calling a dead store, applies the failure mode at once, and lets a single caller probe the
//! store on an interval. When a probe succeeds, shared enforcement resumes for everyone.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Breaker settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive unavailable/busy results that open the breaker.
    pub failure_threshold: u32,
    /// How long the breaker stays open before one caller probes the store.
    pub probe_interval: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            probe_interval: Duration::from_millis(500),
        }
    }
}

/// The breaker's state, as reported in metrics (`tollgate_breaker_state`) and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BreakerState {
    /// Calls go to the store.
    Closed,
    /// Calls skip the store and take the failure mode.
    Open,
    /// One probe is in flight; other calls take the failure mode.
    HalfOpen,
}

impl BreakerState {
    /// A stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }

    /// The gauge value: 0 closed, 1 open, 2 half-open.
    pub fn as_gauge(self) -> f64 {
        match self {
            Self::Closed => 0.0,
            Self::Open => 1.0,
            Self::HalfOpen => 2.0,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Open,
            2 => Self::HalfOpen,
            _ => Self::Closed,
        }
    }
}

/// What the breaker lets a caller do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Permit {
    /// Call the store normally; `opened` is how many times the breaker had opened when the
    /// call was let through.
    Call {
        /// The breaker's open count then: a failure of a call let through before the breaker
        /// last opened belongs to the outage already handled, and is not counted again.
        opened: u32,
    },
    /// Call the store as the single probe.
    Probe,
    /// Do not call the store.
    Skip,
}

pub(crate) struct Breaker {
    config: BreakerConfig,
    epoch: Instant,
    /// The state (the low two bits: 0 closed, 1 open, 2 half-open) and how many times the
    /// breaker has opened (the bits above, wrapping at `u32`: see [`Permit::Call`]), in one
    /// word, so that the count moves in the same step as the state: a call let through after
    /// an opening can never read the count from before it.
    word: AtomicU64,
    failures: AtomicU32,
    /// Microseconds since `epoch` when an open breaker lets a probe through.
    reopen_at: AtomicU64,
}

/// A state change to report.
pub(crate) type Transition = Option<(BreakerState, BreakerState)>;

impl Breaker {
    pub(crate) fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            epoch: Instant::now(),
            word: AtomicU64::new(0),
            failures: AtomicU32::new(0),
            reopen_at: AtomicU64::new(0),
        }
    }

    pub(crate) fn state(&self) -> BreakerState {
        state_of(self.word.load(Ordering::Acquire))
    }

    /// Writes the state, keeping the open count: only for the probe, which owns a half-open
    /// breaker (no other caller writes the word then).
    fn set_state(&self, state: u64) {
        let word = self.word.load(Ordering::Acquire);
        self.word.store(with_state(word, state), Ordering::Release);
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Decides whether this call may reach the store.
    pub(crate) fn permit(&self) -> (Permit, Transition) {
        let word = self.word.load(Ordering::Acquire);
        match state_of(word) {
            BreakerState::Closed => (
                Permit::Call {
                    opened: opened_of(word),
                },
                None,
            ),
            BreakerState::HalfOpen => (Permit::Skip, None),
            BreakerState::Open => {
                if self.now() < self.reopen_at.load(Ordering::Acquire) {
                    return (Permit::Skip, None);
                }
                // Exactly one caller wins the probe.
                match self.word.compare_exchange(
                    word,
                    with_state(word, HALF_OPEN),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => (
                        Permit::Probe,
                        Some((BreakerState::Open, BreakerState::HalfOpen)),
                    ),
                    Err(_) => (Permit::Skip, None),
                }
            }
        }
    }

    /// Records a store answer (any answer, even an error that is not unavailability).
    pub(crate) fn on_success(&self, permit: Permit) -> Transition {
        self.failures.store(0, Ordering::Release);
        if permit == Permit::Probe {
            // Half-open, owned by this probe: nobody else writes the word meanwhile.
            self.set_state(CLOSED);
            return Some((BreakerState::HalfOpen, BreakerState::Closed));
        }
        None
    }

    /// Gives back a probe that ended without an outcome (the probing call's future was
    /// dropped: its client went away, or an outer timeout fired). The breaker opens again with
    /// its probe due at once, so the next caller probes; otherwise it would stay half-open with
    /// nobody probing, and every call would take the failure mode for the process's life.
    pub(crate) fn abandon_probe(&self) -> Transition {
        self.reopen_at.store(self.now(), Ordering::Release);
        let word = self.word.load(Ordering::Acquire);
        (state_of(word) == BreakerState::HalfOpen)
            .then(|| {
                self.word.compare_exchange(
                    word,
                    with_state(word, OPEN),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
            })
            .and_then(Result::ok)
            .map(|_| (BreakerState::HalfOpen, BreakerState::Open))
    }

    /// The configured probe interval.
    pub(crate) fn probe_interval(&self) -> Duration {
        self.config.probe_interval
    }

    /// Records an unavailable/busy result.
    pub(crate) fn on_failure(&self, permit: Permit) -> Transition {
        let interval = u64::try_from(self.config.probe_interval.as_micros()).unwrap_or(u64::MAX);
        let due = || self.now().saturating_add(interval);
        if permit == Permit::Probe {
            // The state is half-open and this probe owns it: set the next probe's time first,
            // so no caller can see the breaker open with the old time.
            self.reopen_at.store(due(), Ordering::Release);
            self.set_state(OPEN);
            return Some((BreakerState::HalfOpen, BreakerState::Open));
        }
        if let Permit::Call { opened } = permit
            && opened != opened_of(self.word.load(Ordering::Acquire))
        {
            // Let through before the breaker last opened: that outage is handled; counting its
            // stragglers after a successful probe would reopen a breaker whose store answers.
            return None;
        }
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        let word = self.word.load(Ordering::Acquire);
        if n >= self.config.failure_threshold && state_of(word) == BreakerState::Closed {
            // The probe's time is written before the breaker opens (the same reason), and the
            // state is not written again after the swap: a probe may already own it. The open
            // count moves with the state, in the swap: counted after it, a probe could close
            // the breaker first, and a call let through then would carry the old count and
            // its failure be taken for a straggler's, uncounted.
            self.reopen_at.store(due(), Ordering::Release);
            let opened = u64::from(opened_of(word).wrapping_add(1)) << STATE_BITS;
            if self
                .word
                .compare_exchange(word, opened | OPEN, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                self.failures.store(0, Ordering::Release);
                return Some((BreakerState::Closed, BreakerState::Open));
            }
        }
        None
    }
}

/// The word's low bits hold the state ([`Breaker::word`]).
const STATE_BITS: u32 = 2;
const STATE_MASK: u64 = (1 << STATE_BITS) - 1;
const CLOSED: u64 = 0;
const OPEN: u64 = 1;
const HALF_OPEN: u64 = 2;

fn state_of(word: u64) -> BreakerState {
    BreakerState::from_u8((word & STATE_MASK) as u8)
}

/// The open count of a [`Breaker::word`] (it wraps at `u32`, as the count it stands for).
fn opened_of(word: u64) -> u32 {
    (word >> STATE_BITS) as u32
}

fn with_state(word: u64, state: u64) -> u64 {
    (word & !STATE_MASK) | state
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    use super::*;

    /// A call let through now.
    fn call(b: &Breaker) -> Permit {
        let (p, _) = b.permit();
        assert!(matches!(p, Permit::Call { .. }), "{p:?}");
        p
    }

    #[test]
    fn opens_after_threshold_and_lets_one_probe_through() {
        let b = Breaker::new(BreakerConfig {
            failure_threshold: 3,
            probe_interval: Duration::ZERO,
        });
        for _ in 0..2 {
            assert_eq!(b.on_failure(call(&b)), None);
        }
        assert_eq!(
            b.on_failure(call(&b)),
            Some((BreakerState::Closed, BreakerState::Open))
        );
        let (first, t) = b.permit();
        assert_eq!(first, Permit::Probe);
        assert_eq!(t, Some((BreakerState::Open, BreakerState::HalfOpen)));
        assert_eq!(b.permit().0, Permit::Skip, "only one probe at a time");
        assert_eq!(
            b.on_success(first),
            Some((BreakerState::HalfOpen, BreakerState::Closed))
        );
        call(&b);
    }

    /// A probe interval too long for the clock's microseconds ("never probe", `Duration::MAX`)
    /// opens the breaker for good rather than overflowing.
    #[test]
    fn an_unbounded_probe_interval_keeps_the_breaker_open() {
        let b = Breaker::new(BreakerConfig {
            failure_threshold: 1,
            probe_interval: Duration::MAX,
        });
        assert_eq!(
            b.on_failure(call(&b)),
            Some((BreakerState::Closed, BreakerState::Open))
        );
        assert_eq!(b.permit().0, Permit::Skip);
        assert_eq!(b.state(), BreakerState::Open);
    }

    #[test]
    fn an_abandoned_probe_lets_the_next_caller_probe() {
        let b = Breaker::new(BreakerConfig {
            failure_threshold: 1,
            probe_interval: Duration::from_secs(3600),
        });
        b.on_failure(call(&b));
        b.reopen_at.store(0, Ordering::Release); // the interval has passed
        assert_eq!(b.permit().0, Permit::Probe);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert_eq!(
            b.abandon_probe(),
            Some((BreakerState::HalfOpen, BreakerState::Open))
        );
        assert_eq!(b.permit().0, Permit::Probe, "not another hour of skipping");
    }

    #[test]
    fn failed_probe_reopens_for_another_interval() {
        let b = Breaker::new(BreakerConfig {
            failure_threshold: 1,
            probe_interval: Duration::from_secs(3600),
        });
        b.on_failure(call(&b));
        assert_eq!(b.permit().0, Permit::Skip, "interval not elapsed");
        b.reopen_at.store(0, Ordering::Release);
        let (p, _) = b.permit();
        assert_eq!(p, Permit::Probe);
        assert_eq!(
            b.on_failure(p),
            Some((BreakerState::HalfOpen, BreakerState::Open))
        );
        assert_eq!(b.permit().0, Permit::Skip);
    }

    /// Calls let through before the breaker opened, failing after a probe closed it again,
    /// belong to the outage already handled: they do not reopen a breaker whose store answers.
    #[test]
    fn stragglers_of_a_handled_outage_do_not_reopen_it() {
        let b = Breaker::new(BreakerConfig {
            failure_threshold: 3,
            probe_interval: Duration::ZERO,
        });
        let stragglers: Vec<Permit> = (0..10).map(|_| call(&b)).collect();
        for _ in 0..3 {
            b.on_failure(call(&b));
        }
        assert_eq!(b.state(), BreakerState::Open);
        let (probe, _) = b.permit();
        assert_eq!(probe, Permit::Probe);
        b.on_success(probe);
        assert_eq!(b.state(), BreakerState::Closed);
        for p in stragglers {
            assert_eq!(b.on_failure(p), None);
        }
        assert_eq!(b.state(), BreakerState::Closed, "the store answers");
        // a new outage still opens it
        for _ in 0..3 {
            b.on_failure(call(&b));
        }
        assert_eq!(b.state(), BreakerState::Open);
    }

    /// Two threads calling against a dead store with a probe due at once: each call let
    /// through when the breaker is closed must carry an open count at least the number of
    /// probes that closed it before (each closed an opening). The count was bumped after the
    /// opening's swap, so a probe could close the breaker in between, and a call let through
    /// then carried the old count: its failure was taken for a straggler's of the handled
    /// outage and not counted (in 1 s, 59,810 and 72,299 such calls on the two threads).
    /// Bounded by time and iterations.
    #[test]
    fn a_call_after_a_probe_carries_the_count_of_the_opening_it_closed() {
        fn run(b: &Breaker, closed: &AtomicU32, stop: &AtomicBool) -> u64 {
            let started = Instant::now();
            let (mut stale, mut iterations) = (0, 0);
            while !stop.load(Ordering::Relaxed)
                && started.elapsed() < Duration::from_secs(1)
                && iterations < 20_000_000
            {
                iterations += 1;
                let closed_before = closed.load(Ordering::SeqCst);
                match b.permit().0 {
                    p @ Permit::Probe => {
                        b.on_success(p);
                        closed.fetch_add(1, Ordering::SeqCst);
                    }
                    p @ Permit::Call { opened } => {
                        if closed_before > opened {
                            stale += 1;
                        }
                        b.on_failure(p);
                    }
                    Permit::Skip => {}
                }
            }
            stop.store(true, Ordering::Relaxed);
            stale
        }
        let b = Arc::new(Breaker::new(BreakerConfig {
            failure_threshold: 1,
            probe_interval: Duration::ZERO,
        }));
        let closed = Arc::new(AtomicU32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let other = {
            let (b, closed, stop) = (Arc::clone(&b), Arc::clone(&closed), Arc::clone(&stop));
            std::thread::spawn(move || run(&b, &closed, &stop))
        };
        let stale = (run(&b, &closed, &stop), other.join().unwrap());
        assert_eq!(
            stale,
            (0, 0),
            "calls let through with the count from before the opening their probe closed \
             ({} probes closed the breaker)",
            closed.load(Ordering::SeqCst)
        );
    }
}
