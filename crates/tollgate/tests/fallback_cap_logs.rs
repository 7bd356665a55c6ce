//! The degraded mode's local store at its key cap during an outage, meeting a flood of new
//! keys: each such request fails closed, and the limiter bounds the error line that says so
//! (the breaker is open: nothing else would). Alone in its test binary, as `key_cap_logs.rs`
//! (a thread-scoped subscriber and tracing's process-wide callsite interest).

mod flood;

use std::sync::Arc;
use std::time::Duration;

use tollgate::{Enforcement, Error, FailureMode, Limiter, LocalStore, Policy, Rate};
use tollgate_redis::RedisStore;

const CAP: usize = 4;

#[test]
fn a_new_key_flood_at_the_fallbacks_cap_is_logged_boundedly_and_counted_fully() {
    const FLOOD: usize = 1000;
    let (lines, snapshotter, elapsed) = flood::run(async || {
        // Redis is down for the whole run: a loopback port nothing listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let store = RedisStore::builder(format!("redis://127.0.0.1:{port}"))
            .timeout(Duration::from_millis(50))
            .build_lazy()
            .await
            .unwrap();
        let local = Arc::new(LocalStore::builder().max_keys(CAP).build());
        // A token bucket refilling one token an hour: the held keys stay held for the test (an
        // hour's fixed window, aligned to the epoch on the local store's real clock, restarted
        // at the top of the hour and could free them in a run that crossed it).
        let limiter = Limiter::builder(
            "capped",
            Policy::token_bucket(3, Rate::new(1, Duration::from_secs(3600))).unwrap(),
        )
        .store(Arc::new(store))
        .failure_mode(FailureMode::degraded_with(local, 1))
        .build()
        .unwrap();
        for i in 0..CAP {
            let d = limiter.check([format!("held{i}")], 1).await.unwrap();
            assert_eq!(d.enforcement, Enforcement::Degraded);
        }
        for i in 0..FLOOD {
            let e = limiter.check([format!("new{i}")], 1).await.unwrap_err();
            assert!(matches!(e, Error::Unavailable { .. }), "{e}");
        }
    });

    let logged = lines.matching(&["degraded local limiter failed too"]);
    flood::assert_logged_boundedly("error", &logged, FLOOD, elapsed);

    let counter = flood::counters(&snapshotter);
    assert_eq!(
        counter("tollgate_fallback_errors_total", ("class", "capacity")),
        Some(FLOOD as u64)
    );
    assert_eq!(
        counter("tollgate_decisions_total", ("outcome", "unavailable")),
        Some(FLOOD as u64)
    );
}
