//! The wall clock of test redis-servers, moved by the test: [`ServerClock`] drives the clock
//! shim (an LD_PRELOAD library built from `shim/clockshim.c`) through a small control file.
//! Redis `TIME`, `TIME` inside scripts and key expiry all follow it, forward and back.
//!
//! # Control file format
//!
//! One line, re-read by the shim on every `clock_gettime(CLOCK_REALTIME | CLOCK_REALTIME_COARSE)`,
//! `gettimeofday`, `time` and `timespec_get` call:
//!
//! | content | meaning                                             |
//! |---------|-----------------------------------------------------|
//! | `+N`    | real time plus `N` nanoseconds                      |
//! | `-N`    | real time minus `N` nanoseconds                     |
//! | `=N`    | frozen at `N` nanoseconds since the Unix epoch      |
//! | empty / missing / unparsable | real time                  |
//!
//! Monotonic clocks are never shifted, so Redis's event loop and timers keep running.
//!
//! # What moves with the clock (Redis 7.0, pinned by `tests/server.rs`)
//!
//! - `TIME` and `redis.call('TIME')` in scripts: exactly the frozen instant, or real time
//!   plus the offset.
//! - Key expiry (TTLs are absolute wall-clock deadlines): advancing past a deadline expires the
//!   key on its next access. Once a key is deleted, rewinding does not bring it back; but
//!   whether Redis's background expiry cycle deleted it *before* a rewind is a race, so a test
//!   should read a key after advancing if it needs it gone.
//! - Anything else Redis times on the wall clock: blocking-command timeouts (`BLPOP k 0.05`
//!   never times out while the clock is frozen; advancing releases it), `WAIT`, client idle
//!   `timeout`, and replication and Sentinel timeouts. Freeze a primary, replica or sentinel
//!   only when the test means to stall those too; an offset keeps them running.
//!
//! The shim re-reads the control file (three syscalls) on every wall-clock read, and sends
//! monotonic reads through `syscall()` rather than the vDSO: fine for tests, not for benchmarks.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tempfile::TempDir;

/// Path of the clock shim built by build.rs; empty on platforms without one.
const SHIM_PATH: &str = env!("TOLLGATE_CLOCKSHIM");

/// Environment variable through which the shim learns where the control file is.
const CLOCK_FILE_ENV: &str = "TOLLGATE_CLOCK_FILE";

/// What a shimmed process's wall clock currently does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ClockMode {
    /// Real time, unshifted (the control file is empty).
    #[default]
    Real,
    /// Real time plus a signed offset.
    Offset {
        /// Offset added to real time, in nanoseconds (negative: the clock is behind).
        nanos: i64,
    },
    /// Stopped at one instant until the test moves it.
    Frozen {
        /// The frozen instant, in nanoseconds since the Unix epoch.
        at_nanos: u64,
    },
}

impl ClockMode {
    /// The control-file line for this mode.
    fn control_line(self) -> String {
        match self {
            Self::Real => String::new(),
            Self::Offset { nanos } if nanos < 0 => format!("-{}\n", nanos.unsigned_abs()),
            Self::Offset { nanos } => format!("+{nanos}\n"),
            Self::Frozen { at_nanos } => format!("={at_nanos}\n"),
        }
    }
}

/// A handle on the wall clock of every redis-server started with it.
///
/// Cloning shares the clock: all clones (and every server started with one, across
/// restarts) see the same control file. Every change is written atomically (temp file and
/// rename), so the shim reads either the old setting or the new one, and takes effect at the
/// server's next clock read — no sleep is needed.
///
/// Dropping the last clone removes the control file; servers still running under it
/// then fall back to real time.
#[derive(Clone)]
pub struct ServerClock {
    inner: Arc<Inner>,
}

struct Inner {
    dir: TempDir,
    file: PathBuf,
    mode: Mutex<ClockMode>,
}

impl fmt::Debug for ServerClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerClock")
            .field("control_file", &self.inner.file)
            .field("mode", &self.mode())
            .finish()
    }
}

impl ServerClock {
    /// A new clock, initially real time, with its own control file in a private temp dir.
    ///
    /// # Panics
    /// If the clock shim is unavailable on this platform (see [`ServerClock::shim_path`]) or
    /// the temp dir cannot be created.
    pub fn new() -> Self {
        assert!(
            Self::shim_path().is_some(),
            "the tollgate clock shim is only built on Linux; clock control is unavailable here"
        );
        let dir = tempfile::Builder::new()
            .prefix("tollgate-clock")
            .tempdir()
            .expect("failed to create a temp dir for the clock control file");
        let file = dir.path().join("clock");
        Self {
            inner: Arc::new(Inner {
                dir,
                file,
                mode: Mutex::new(ClockMode::Real),
            }),
        }
    }

    /// Path of the LD_PRELOAD clock shim, or `None` where it is not built (non-Linux).
    pub fn shim_path() -> Option<&'static Path> {
        (!SHIM_PATH.is_empty()).then(|| Path::new(SHIM_PATH))
    }

    /// The control file the shim reads (format in the [module docs](self)).
    pub fn control_file(&self) -> &Path {
        &self.inner.file
    }

    /// Puts a process about to be spawned under this clock: sets `LD_PRELOAD` to the shim
    /// and `TOLLGATE_CLOCK_FILE` to the control file.
    pub fn apply_to(&self, command: &mut Command) {
        let shim = Self::shim_path().expect("checked in ServerClock::new");
        command
            .env("LD_PRELOAD", shim)
            .env(CLOCK_FILE_ENV, &self.inner.file);
    }

    /// The current mode.
    pub fn mode(&self) -> ClockMode {
        *self.lock()
    }

    /// Stops the clock at `micros` microseconds since the Unix epoch: Redis `TIME` then
    /// returns exactly that instant until the clock is moved.
    pub fn freeze_at_micros(&self, micros: u64) {
        let at_nanos = micros
            .checked_mul(1_000)
            .unwrap_or_else(|| panic!("freeze_at_micros({micros}) overflows nanoseconds"));
        self.set(ClockMode::Frozen { at_nanos });
    }

    /// Stops the clock at the instant it shows now (per [`ServerClock::now_micros`]).
    pub fn freeze_now(&self) {
        self.freeze_at_micros(self.now_micros());
    }

    /// Lets the clock run at real time plus `nanos` (negative: behind real time).
    pub fn set_offset(&self, nanos: i64) {
        self.set(ClockMode::Offset { nanos });
    }

    /// Returns the clock to plain real time.
    pub fn use_real_time(&self) {
        self.set(ClockMode::Real);
    }

    /// Moves the clock forward by `by`: a frozen clock stays frozen at the later instant; a
    /// running clock's offset grows by `by`.
    pub fn advance(&self, by: Duration) {
        self.shift(i128::try_from(by.as_nanos()).expect("a Duration fits in i128"));
    }

    /// Moves the clock back by `by`: a frozen clock stays frozen at the earlier instant; a
    /// running clock's offset shrinks by `by`.
    pub fn rewind(&self, by: Duration) {
        self.shift(-i128::try_from(by.as_nanos()).expect("a Duration fits in i128"));
    }

    /// What Redis `TIME` says now, as microseconds since the epoch (s·10⁶ + µs).
    ///
    /// Computed, not asked of the server (so it works while the server is stopped or
    /// paused): exact when frozen; when running, it reads this process's real clock plus the
    /// offset, so it is only as close to the server's `TIME` as the two reads are in time.
    pub fn now_micros(&self) -> u64 {
        match self.mode() {
            ClockMode::Real => real_now_nanos() / 1_000,
            ClockMode::Offset { nanos } => {
                let shifted = i128::from(real_now_nanos()) + i128::from(nanos);
                u64::try_from(shifted.max(0) / 1_000).expect("time in microseconds fits in u64")
            }
            ClockMode::Frozen { at_nanos } => at_nanos / 1_000,
        }
    }

    fn shift(&self, delta_nanos: i128) {
        let mut mode = self.lock();
        let next = match *mode {
            ClockMode::Frozen { at_nanos } => {
                let at = i128::from(at_nanos) + delta_nanos;
                ClockMode::Frozen {
                    at_nanos: u64::try_from(at).unwrap_or_else(|_| {
                        panic!("moving the frozen clock ({at_nanos} ns) by {delta_nanos} ns leaves the u64 range")
                    }),
                }
            }
            ClockMode::Real | ClockMode::Offset { .. } => {
                let current = match *mode {
                    ClockMode::Offset { nanos } => nanos,
                    _ => 0,
                };
                let nanos = i64::try_from(i128::from(current) + delta_nanos).unwrap_or_else(|_| {
                    panic!(
                        "clock offset {current} ns moved by {delta_nanos} ns leaves the i64 range"
                    )
                });
                ClockMode::Offset { nanos }
            }
        };
        self.write(&mut mode, next);
    }

    fn set(&self, next: ClockMode) {
        let mut mode = self.lock();
        self.write(&mut mode, next);
    }

    /// Writes the control file atomically (temp file + rename in the same dir), then records
    /// the mode. Called with the lock held, so clones never race on the temp file.
    fn write(&self, mode: &mut MutexGuard<'_, ClockMode>, next: ClockMode) {
        let tmp = self.inner.dir.path().join("clock.tmp");
        fs::write(&tmp, next.control_line())
            .unwrap_or_else(|err| panic!("failed to write {}: {err}", tmp.display()));
        fs::rename(&tmp, &self.inner.file).unwrap_or_else(|err| {
            panic!(
                "failed to rename {} to {}: {err}",
                tmp.display(),
                self.inner.file.display()
            )
        });
        **mode = next;
    }

    fn lock(&self) -> MutexGuard<'_, ClockMode> {
        // A panic while holding the lock cannot leave the mode torn (it is assigned last).
        self.inner
            .mode
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Default for ServerClock {
    fn default() -> Self {
        Self::new()
    }
}

fn real_now_nanos() -> u64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the system clock is after 1970");
    u64::try_from(since_epoch.as_nanos()).expect("nanoseconds since the epoch fit in u64")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_lines_follow_the_shim_format() {
        assert_eq!(ClockMode::Real.control_line(), "");
        assert_eq!(ClockMode::Offset { nanos: 5 }.control_line(), "+5\n");
        assert_eq!(ClockMode::Offset { nanos: -5 }.control_line(), "-5\n");
        assert_eq!(
            ClockMode::Offset { nanos: i64::MIN }.control_line(),
            "-9223372036854775808\n"
        );
        assert_eq!(ClockMode::Frozen { at_nanos: 7 }.control_line(), "=7\n");
    }

    #[test]
    fn advance_and_rewind_move_a_frozen_instant() {
        let clock = ServerClock::new();
        clock.freeze_at_micros(1_000_000);
        clock.advance(Duration::from_secs(1));
        assert_eq!(clock.now_micros(), 2_000_000);
        clock.rewind(Duration::from_millis(1_500));
        assert_eq!(clock.now_micros(), 500_000);
        assert_eq!(
            fs::read_to_string(clock.control_file()).unwrap(),
            "=500000000\n"
        );
    }

    #[test]
    fn advance_and_rewind_move_a_running_offset() {
        let clock = ServerClock::new();
        clock.advance(Duration::from_secs(3));
        clock.rewind(Duration::from_secs(5));
        assert_eq!(
            clock.mode(),
            ClockMode::Offset {
                nanos: -2_000_000_000
            }
        );
        assert_eq!(
            fs::read_to_string(clock.control_file()).unwrap(),
            "-2000000000\n"
        );
        clock.use_real_time();
        assert_eq!(fs::read_to_string(clock.control_file()).unwrap(), "");
    }
}
