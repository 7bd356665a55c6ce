//! tollgate enforces one rate-limit quota across every instance of a service.
//!
//! Each protected operation gets a [`Limiter`]: a [`Policy`] (token bucket, fixed window or
//! sliding log, weighted by cost), a [`Store`] holding the buckets (Redis for the shared quota,
//! [`LocalStore`] in-process), a deadline per call, and a [`FailureMode`] chosen explicitly for
//! what happens when the store cannot answer.
//!
//! ```
//! use std::sync::Arc;
//! use tollgate::{FailureMode, Limiter, LocalStore, Policy, Rate};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), tollgate::Error> {
//! let limiter = Limiter::builder("login", Policy::token_bucket(5, Rate::per_minute(5))?)
//!     .store(Arc::new(LocalStore::new()))
//!     .failure_mode(FailureMode::Closed)
//!     .build()?;
//! let decision = limiter.check(["alice@example.com"], 1).await?;
//! assert!(decision.allowed);
//! assert_eq!(decision.remaining, 4);
//! # Ok(()) }
//! ```
//!
//! See the [`guide`] for choosing an algorithm and a failure mode.

mod breaker;
mod deny_cache;
mod fallback;
pub mod guide;
mod limiter;
mod log_throttle;
mod meters;
pub mod registry;

pub use breaker::{BreakerConfig, BreakerState};

pub use fallback::LocalFallback;
pub use limiter::{Error, FailureMode, Limiter, LimiterBuilder};
pub use tollgate_core::{
    Acquire, Algorithm, Batch, Clock, Decision, Enforcement, ErrorClass, Key, KeyError,
    ManualClock, Policy, PolicyError, Rate, SpecError, Store, StoreError, SystemClock, Transition,
};
pub use tollgate_local::LocalStore;
/// The Redis store (re-export of `tollgate-redis`).
pub use tollgate_redis as redis;
