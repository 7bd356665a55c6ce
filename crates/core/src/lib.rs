//! The pure core of tollgate: policies, decisions, the maths of every algorithm, and the
//! `Store` and `Clock` traits that backends implement. Nothing here does I/O.
//!
//! Time is integer microseconds everywhere. Every algorithm is a pure function of
//! (stored state, policy, now, cost) so that the Redis scripts can be proven equal to it.
//!
//! ```
//! use std::time::Duration;
//! use tollgate_core::{Policy, Rate, algorithm};
//!
//! let policy = Policy::token_bucket(10, Rate::per_second(2)).unwrap();
//! let mut state = None;
//! let out = algorithm::apply(&mut state, &policy, 1_000_000, 4, true).unwrap();
//! assert!(out.decision.allowed);
//! assert_eq!(out.decision.remaining, 6);
//! ```

pub mod algorithm;
mod clock;
mod decision;
mod key;
mod policy;
mod spec;
mod store;

pub use clock::{Clock, ManualClock, MonotonicClock, SystemClock, deadline_after};
pub use decision::{Decision, Enforcement};
pub use key::{Key, KeyError, MAX_KEY_PART_BYTES};
pub use policy::{
    Algorithm, FixedWindow, MAX_DURATION, MAX_EXACT, MAX_SLIDING_LOG_LIMIT, Policy, PolicyError,
    Rate, SlidingLog, TokenBucket, Transition,
};
pub use spec::SpecError;
pub use store::{Acquire, Batch, ErrorClass, Store, StoreError};

/// Microseconds in one second.
pub const MICROS_PER_SEC: u64 = 1_000_000;
