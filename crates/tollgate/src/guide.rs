//! A short guide: choosing an algorithm and a failure mode.
//!
//! # Choosing an algorithm
//!
//! | algorithm | bursts | precision | state per key |
//! |---|---|---|---|
//! | token bucket | up to `capacity`, then `rate` | smooth; exact | two numbers |
//! | fixed window | up to `limit` per epoch-aligned window; up to 2× across a boundary | coarse | two numbers |
//! | sliding log | `limit` in *any* window ending now | exact | one entry per admitted instant, at most `limit` |
//!
//! Pick the token bucket for ordinary API traffic (it allows a burst and then a steady rate),
//! the fixed window where the limit must be easy to explain ("100 per minute, resets on the
//! minute"), and the sliding log for high-value, audit-sensitive limits with small limits
//! (it is bounded to 1,000 per window).
//!
//! Every request has a cost (at least 1). A cost above the policy's limit could never pass and
//! is refused as invalid input ([`crate::Error::Invalid`]), not as a denial.
//!
//! # Choosing a failure mode
//!
//! When the store cannot answer (connection refused, timeout, failover in progress, BUSY), the
//! limiter does what the operation's owner chose — there is no default:
//!
//! - [`FailureMode::Open`](crate::FailureMode::Open): admit, labelled
//!   [`Enforcement::Bypassed`](crate::Enforcement::Bypassed). Favours availability; nothing is
//!   enforced during the outage. Right for limits that only smooth ordinary traffic.
//! - [`FailureMode::Closed`](crate::FailureMode::Closed): refuse with
//!   [`Error::Unavailable`](crate::Error::Unavailable) — never a quota denial, so an HTTP layer
//!   answers 503, not 429. Right for expensive or abuse-sensitive operations.
//! - [`FailureMode::Degraded`](crate::FailureMode::Degraded): decide on a per-process
//!   [`LocalStore`](crate::LocalStore), labelled
//!   [`Enforcement::Degraded`](crate::Enforcement::Degraded). Approximate: each instance
//!   enforces its own share, the quota divided by the expected instance count that
//!   [`FailureMode::degraded`](crate::FailureMode::degraded) requires (there is no default:
//!   it is how much of the quota one instance enforces alone), so the fleet as a whole admits
//!   roughly the quota only if traffic is spread evenly over that many instances.
//!   [`FailureMode::degraded_with`](crate::FailureMode::degraded_with) takes a local store on
//!   a clock of your choosing (a [`ManualClock`](crate::ManualClock) in tests, to move the
//!   degraded buckets' time by hand).
//!
//! A script error (a bug) is never a mode switch: it is reported as [`crate::Error::Store`].
