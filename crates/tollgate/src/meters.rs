//! The limiter's metrics, registered once per limiter so the decision path only bumps handles
//! (no label strings built per call). Install the `metrics` recorder before building limiters.
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `tollgate_decisions_total` | counter | `operation`, `outcome` (allowed, denied, invalid, unavailable, error), `enforcement` (shared, degraded, bypassed, none) |
//! | `tollgate_store_errors_total` | counter | `operation`, `class` (invalid, unavailable, busy, capacity, script) |
//! | `tollgate_fallback_errors_total` | counter | `operation`, `class`: the degraded mode's local store failing too (capacity: at its key cap), so the request fails closed |
//! | `tollgate_breaker_state` | gauge | `operation`; 0 closed, 1 open, 2 half-open |
//! | `tollgate_decision_seconds` | histogram | `operation` |
//! | `tollgate_deny_cache_answers_total` | counter | `operation`: decisions the opt-in deny cache answered with no round trip (each also counted in `tollgate_decisions_total` as a shared denial) |

use std::time::Instant;

use metrics::{Counter, Gauge, Histogram};
use tollgate_core::{Decision, Enforcement, ErrorClass};

use crate::Error;

const ENFORCEMENTS: [&str; 3] = ["shared", "degraded", "bypassed"];
const CLASSES: [&str; 5] = ["invalid", "unavailable", "busy", "capacity", "script"];

pub(crate) struct Meters {
    /// `[allowed, denied][shared, degraded, bypassed]`.
    decided: [[Counter; 3]; 2],
    invalid: Counter,
    unavailable: Counter,
    error: Counter,
    store_errors: [Counter; 5],
    fallback_errors: [Counter; 5],
    pub(crate) breaker: Gauge,
    latency: Histogram,
    deny_cached: Counter,
}

impl Meters {
    pub(crate) fn new(operation: &str) -> Self {
        let op = operation.to_owned();
        let decision = |outcome: &'static str, enforcement: &'static str| {
            metrics::counter!(
                "tollgate_decisions_total",
                "operation" => op.clone(),
                "outcome" => outcome,
                "enforcement" => enforcement
            )
        };
        Self {
            decided: [
                ENFORCEMENTS.map(|e| decision("allowed", e)),
                ENFORCEMENTS.map(|e| decision("denied", e)),
            ],
            invalid: decision("invalid", "none"),
            unavailable: decision("unavailable", "none"),
            error: decision("error", "none"),
            store_errors: CLASSES.map(|class| {
                metrics::counter!("tollgate_store_errors_total", "operation" => op.clone(), "class" => class)
            }),
            fallback_errors: CLASSES.map(|class| {
                metrics::counter!("tollgate_fallback_errors_total", "operation" => op.clone(), "class" => class)
            }),
            breaker: metrics::gauge!("tollgate_breaker_state", "operation" => op.clone()),
            latency: metrics::histogram!("tollgate_decision_seconds", "operation" => op.clone()),
            deny_cached: metrics::counter!("tollgate_deny_cache_answers_total", "operation" => op),
        }
    }

    pub(crate) fn record(&self, outcome: &Result<Decision, Error>, started: Instant) {
        match outcome {
            Ok(d) => {
                let e = match d.enforcement {
                    Enforcement::Shared => 0,
                    Enforcement::Degraded => 1,
                    _ => 2,
                };
                self.decided[usize::from(!d.allowed)][e].increment(1);
            }
            Err(Error::Invalid(_)) => self.invalid.increment(1),
            Err(Error::Unavailable { .. }) => self.unavailable.increment(1),
            Err(_) => self.error.increment(1),
        }
        self.latency.record(started.elapsed().as_secs_f64());
    }

    /// A decision the deny cache answered (no round trip).
    pub(crate) fn deny_cached(&self) {
        self.deny_cached.increment(1);
    }

    pub(crate) fn store_error(&self, class: ErrorClass) {
        self.store_errors[class_index(class)].increment(1);
    }

    /// The degraded mode's local store failed too.
    pub(crate) fn fallback_error(&self, class: ErrorClass) {
        self.fallback_errors[class_index(class)].increment(1);
    }
}

/// `class`'s place in [`CLASSES`].
fn class_index(class: ErrorClass) -> usize {
    match class {
        ErrorClass::Invalid => 0,
        ErrorClass::Unavailable => 1,
        ErrorClass::Busy => 2,
        ErrorClass::Capacity => 3,
        _ => 4,
    }
}
