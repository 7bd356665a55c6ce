//! Each failure mode behind testkit's fault proxy in front of a real redis-server: latency
//! beyond the deadline makes every call a timeout, so the limiter answers per its mode within
//! the deadline (plus slack) and its breaker opens; when latency goes, a probe brings shared
//! enforcement back. Loopback only; bounded.

mod common;

use std::time::{Duration, Instant};

use common::limiter_with_breaker;
use tollgate::redis::RedisStore;
use tollgate::{BreakerState, Enforcement, Error, ErrorClass, FailureMode, Policy, Rate};
use tollgate_testkit::proxy::FaultProxy;
use tollgate_testkit::server::RedisServer;

const DEADLINE: Duration = Duration::from_millis(100);
/// Scheduling slack on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(400);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_beyond_the_deadline_applies_each_failure_mode_in_time() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    for mode in [
        FailureMode::Open,
        FailureMode::Closed,
        FailureMode::degraded(2),
    ] {
        let name = mode.as_str();
        // Store deadline above the limiter's: the limiter's own deadline is what fires.
        let store = RedisStore::builder(proxy.url())
            .timeout(Duration::from_secs(2))
            .build()
            .await
            .unwrap();
        let limiter = limiter_with_breaker(
            "proxied",
            Policy::token_bucket(10, Rate::per_second(1)).unwrap(),
            store,
            mode,
            DEADLINE,
        );
        let user = format!("user-{name}");
        assert_eq!(
            limiter.check([&user], 1).await.unwrap().enforcement,
            Enforcement::Shared
        );

        proxy.set_latency(Duration::from_millis(150));
        let mut slowest = Duration::ZERO;
        for _ in 0..8 {
            let started = Instant::now();
            let out = limiter.check([&user], 1).await;
            let took = started.elapsed();
            assert!(took < DEADLINE + SLACK, "{name}: a call took {took:?}");
            slowest = slowest.max(took);
            match (name, &out) {
                ("open", Ok(d)) => assert!(d.allowed && d.enforcement == Enforcement::Bypassed),
                ("closed", Err(Error::Unavailable { source, .. })) => {
                    assert_eq!(source.class(), ErrorClass::Unavailable);
                }
                ("degraded", Ok(d)) => assert_eq!(d.enforcement, Enforcement::Degraded),
                _ => panic!("{name}: unexpected outcome {out:?}"),
            }
        }
        assert_eq!(limiter.breaker_state(), BreakerState::Open, "{name}");

        proxy.set_latency(Duration::ZERO);
        let started = Instant::now();
        loop {
            if let Ok(d) = limiter.check([&user], 1).await
                && d.enforcement == Enforcement::Shared
            {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{name}: shared enforcement did not resume"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        eprintln!(
            "proxy latency ({name}): +300 ms RTT, slowest answer {slowest:?} under a \
             {DEADLINE:?} deadline; shared again {:?} after the latency went",
            started.elapsed()
        );
    }
}
