//! A follower that cannot put a lost generation back into the registry says so once, not at
//! every poll. Alone in its test binary: a thread-scoped subscriber misses events whose
//! callsite another test's thread registers first (tracing's callsite interest is
//! process-wide).

mod common;

use std::time::{Duration, Instant};

use tollgate::redis::RedisRegistry;
use tollgate::registry::PolicyFollower;
use tollgate::{FailureMode, Policy};
use tollgate_testkit::server::RedisServer;

const TIMEOUT: Duration = Duration::from_secs(2);
/// What the warning about a failed restore says.
const FAILED: &str = "publishing it again failed";

fn admin(server: &RedisServer, args: &[&str]) {
    redis::cmd(args[0])
        .arg(&args[1..])
        .exec(&mut server.client().get_connection().unwrap())
        .unwrap();
}

/// The registry flushed under a follower whose publication is refused (here `OOM`, as a
/// follower's user without a publisher's rights is refused `NOPERM`): the registry stays
/// without the generation, and the follower, polling every 10 ms, warns about it once while
/// it lasts (before: a warning at every poll and notification, for as long as it lasts).
#[tokio::test]
async fn a_restore_that_keeps_failing_is_warned_about_once() {
    let (logs, _guard) = tollgate_testkit::logs::capture();
    let server = RedisServer::start();
    let g5: Policy = "fixed-window:limit=10,window=30d,generation=5,transition=carry"
        .parse()
        .unwrap();
    let registry = RedisRegistry::connect(&server.url(), "tollgate:", TIMEOUT)
        .await
        .unwrap();
    registry.publish("api", &g5).await.unwrap();
    let limiter = common::api_builder(server.url(), g5, FailureMode::Closed)
        .await
        .build()
        .unwrap();
    let _follower = PolicyFollower::start(
        registry.clone(),
        "api",
        std::slice::from_ref(&limiter),
        Duration::from_millis(10),
    )
    .await
    .unwrap();
    admin(
        &server,
        &["CONFIG", "SET", "maxmemory-policy", "noeviction"],
    );
    admin(&server, &["CONFIG", "SET", "maxmemory", "1"]);
    admin(&server, &["FLUSHALL"]);
    // The first failed restore is warned about (within 10 s), then 50 more polls' time (the
    // follower runs on this thread's runtime while the test sleeps): each found the generation
    // lost and could not put it back, and none warned again.
    let started = Instant::now();
    while logs.matching(&[FAILED]).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the failed restore was not warned about"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(registry.get("api").await.unwrap(), None);
    let failed = logs.matching(&[FAILED]);
    assert_eq!(
        failed.len(),
        1,
        "one warning over {:?} of polls: {failed:#?}",
        started.elapsed()
    );
    // Put back once the server takes writes again, and a later loss is warned about again.
    admin(&server, &["CONFIG", "SET", "maxmemory", "0"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while registry.get("api").await.unwrap() != Some(g5) {
        assert!(Instant::now() < deadline, "generation 5 not put back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    admin(&server, &["CONFIG", "SET", "maxmemory", "1"]);
    admin(&server, &["FLUSHALL"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while logs.matching(&[FAILED]).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the second loss was not warned about"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    admin(&server, &["CONFIG", "SET", "maxmemory", "0"]);
}
