//! Setup shared by this crate's tests against Redis.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::redis::RedisStore;
use tollgate::{BreakerConfig, Decision, Error, FailureMode, Limiter, Policy};

/// A limiter for `operation` on `store`, failing by `mode` within `timeout`, with a breaker
/// that opens after 3 failures in a row and probes every 100 ms: short enough for a test to
/// see it open and close.
pub fn limiter_with_breaker(
    operation: &str,
    policy: Policy,
    store: RedisStore,
    mode: FailureMode,
    timeout: Duration,
) -> Limiter {
    Limiter::builder(operation, policy)
        .store(Arc::new(store))
        .failure_mode(mode)
        .timeout(timeout)
        .breaker(BreakerConfig {
            failure_threshold: 3,
            probe_interval: Duration::from_millis(100),
        })
        .build()
        .unwrap()
}

/// Calls `check` once for `who` at cost 1, asserting it returns within `bound`.
#[allow(dead_code)] // not every test binary with this module times its calls
pub async fn timed_within(
    limiter: &Limiter,
    who: &str,
    bound: Duration,
) -> Result<Decision, Error> {
    let started = Instant::now();
    let out = limiter.check([who], 1).await;
    assert!(
        started.elapsed() < bound,
        "a call took {:?}",
        started.elapsed()
    );
    out
}
