//! Sentinel failover against real processes (primary + replica + 3 sentinels on loopback):
//! the store follows the promoted replica with the first sentinel frozen, and an unknown
//! master name fails at once.

use std::time::{Duration, Instant};

use tollgate_core::{ErrorClass, Key, Policy, Rate, Store};
use tollgate_redis::RedisStore;
use tollgate_testkit::sentinel::SentinelCluster;

const HOUR: Duration = Duration::from_secs(3600);

fn policy() -> Policy {
    Policy::token_bucket(1_000_000, Rate::new(1, HOUR)).unwrap()
}

fn key(i: usize) -> Key {
    Key::new("sentinel-failover", [format!("k{i}")]).unwrap()
}

/// Calls the store every 50 ms until a decision, for at most `limit`: the time it took and the
/// number of calls that failed (`Err`: the calls made and the last failure). Every failure must be of class unavailable, and no call may
/// outlast `call_bound`.
async fn until_decided(
    store: &RedisStore,
    limit: Duration,
    call_bound: Duration,
) -> Result<(Duration, usize), (usize, String)> {
    let start = Instant::now();
    let mut failed = 0;
    let mut last = String::new();
    for i in 0..10_000 {
        let called = Instant::now();
        let result = store.acquire(&key(i), &policy(), 1).await;
        let took = called.elapsed();
        assert!(took <= call_bound, "call {i} took {took:?}: {result:?}");
        match result {
            Ok(d) => {
                assert!(d.allowed, "{d:?}");
                return Ok((start.elapsed(), failed));
            }
            Err(e) => {
                assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
                failed += 1;
                last = format!("{e} ({:?})", std::error::Error::source(&e));
            }
        }
        if start.elapsed() >= limit {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err((failed, last))
}

/// A frozen sentinel (SIGSTOP: its port accepts connections, nothing answers) listed first
/// is skipped for the next one: once the two others report the promoted replica, the store
/// decides on it within a few seconds. The store's connect timeout (1 s) bounds one
/// resolution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_first_sentinel_is_skipped_after_a_failover() {
    let mut topology = tokio::task::block_in_place(|| SentinelCluster::start("frozen"));
    let store = RedisStore::sentinel(topology.master_name(), topology.sentinel_urls())
        .timeout(Duration::from_millis(250))
        .connect_timeout(Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    assert!(store.acquire(&key(0), &policy(), 1).await.is_ok());

    topology.sentinel_mut(0).pause();
    let killed = topology.kill_primary();
    let failover =
        tokio::task::block_in_place(|| topology.wait_for_failover(Duration::from_secs(30)));
    let reported = Instant::now();
    let recovered = until_decided(&store, Duration::from_secs(10), Duration::from_secs(1)).await;
    eprintln!(
        "frozen sentinel 0: killed data server {killed}; sentinels reported the new primary \
         {failover:?} after the kill; store: {recovered:?} after that ({:?})",
        reported.elapsed()
    );
    topology.sentinel_mut(0).resume();
    let (took, _) = recovered.expect("the store decides on the promoted replica within 10 s");
    assert!(took < Duration::from_secs(3), "took {took:?}");
}

/// A master name no sentinel monitors fails `build` at once, as unavailable, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_master_name_fails_build_at_once_and_says_so() {
    let topology = tokio::task::block_in_place(|| SentinelCluster::start("known"));
    let start = Instant::now();
    let err = RedisStore::sentinel("unknown", topology.sentinel_urls())
        .connect_timeout(Duration::from_secs(1))
        .build()
        .await
        .unwrap_err();
    let took = start.elapsed();
    eprintln!("unknown master: {:?} after {took:?}: {err}", err.class());
    assert_eq!(err.class(), ErrorClass::Unavailable, "{err}");
    assert!(err.to_string().contains("master name not found"), "{err}");
    assert!(took < Duration::from_secs(1), "took {took:?}");
}
