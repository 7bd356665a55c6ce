//! Setup shared by this crate's tests against Redis.
#![allow(dead_code)] // each test binary uses its own part

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

/// A limiter named "api" on its own store at `url` (calls time out after 2 s), failing over to
/// `mode`, ready to build: one instance of a fleet following the registry's "api".
pub async fn api_builder(
    url: String,
    policy: Policy,
    mode: FailureMode,
) -> tollgate::LimiterBuilder {
    let store = RedisStore::builder(url)
        .timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    Limiter::builder("api", policy)
        .store(Arc::new(store))
        .failure_mode(mode)
}
