//! The opt-in deny cache against a real redis-server: a denied key is answered with zero round
//! trips until its retry instant, and a reset invalidates it.

use std::sync::Arc;
use std::time::Duration;

use tollgate::redis::RedisStore;
use tollgate::{FailureMode, Limiter, Policy};
use tollgate_testkit::server::RedisServer;

/// EVALSHA + EVAL calls the server has executed.
fn script_calls(server: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[tokio::test]
async fn a_denied_key_costs_no_round_trip_until_its_retry_instant() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().await.unwrap();
    let limiter = Limiter::builder(
        "abuse",
        Policy::fixed_window(3, Duration::from_secs(3600)).unwrap(),
    )
    .store(Arc::new(store))
    .failure_mode(FailureMode::Closed)
    .deny_cache(10_000)
    .build()
    .unwrap();
    for _ in 0..3 {
        assert!(limiter.check(["mallory"], 1).await.unwrap().allowed);
    }
    let first_denial = limiter.check(["mallory"], 1).await.unwrap();
    assert!(!first_denial.allowed);
    let before = script_calls(&server);
    for _ in 0..1_000 {
        let d = limiter.check(["mallory"], 1).await.unwrap();
        assert!(!d.allowed);
        assert!(d.retry_after.unwrap() <= first_denial.retry_after.unwrap());
    }
    assert_eq!(
        script_calls(&server),
        before,
        "1,000 denials served without a round trip"
    );

    // Another key still goes to Redis; a reset invalidates the cached denial.
    assert!(limiter.check(["alice"], 1).await.unwrap().allowed);
    limiter.reset(["mallory"]).await.unwrap();
    assert!(limiter.check(["mallory"], 1).await.unwrap().allowed);
}
