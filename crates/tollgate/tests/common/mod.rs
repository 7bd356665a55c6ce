//! Setup shared by this crate's tests against Redis.

use std::sync::Arc;
use std::time::Duration;

use tollgate::redis::RedisStore;
use tollgate::{BreakerConfig, FailureMode, Limiter, Policy};

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
