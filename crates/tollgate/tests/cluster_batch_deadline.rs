//! `Limiter::check_many` on Redis Cluster with one primary hung (SIGSTOP): whichever deadline
//! is shorter, the limiter's or the store's, the requests the live primaries decided keep
//! their decisions (they consumed allowance) and only the hung primary's take the failure
//! mode. Loopback only; bounded by the deadlines.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::{Enforcement, FailureMode, Limiter, Policy, Rate};
use tollgate_core::Store;
use tollgate_redis::RedisStore;
use tollgate_testkit::cluster::RedisCluster;

async fn a_hung_primary_costs_only_its_own_keys(
    store_timeout: Duration,
    limiter_timeout: Duration,
) {
    let mut cluster = RedisCluster::start(3);
    let store = RedisStore::cluster(cluster.urls())
        .timeout(store_timeout)
        .build()
        .await
        .unwrap();
    // A token bucket refilling one token an hour: the second batch leaves 1 of 3 whatever the
    // time (an hour's fixed window, aligned to the epoch on Redis's real clock, restarted at the
    // top of the hour and broke the counts of a run that crossed it).
    let policy = Policy::token_bucket(3, Rate::new(1, Duration::from_secs(3600))).unwrap();
    let limiter = Limiter::builder("partial", policy)
        .store(Arc::new(store.clone()))
        .failure_mode(FailureMode::Open)
        .timeout(limiter_timeout)
        .build()
        .unwrap();
    let keys: Vec<_> = (0..12)
        .map(|i| limiter.key([format!("k{i}")]).unwrap())
        .collect();
    let node_of = cluster.nodes_for_keys(keys.iter().map(|k| store.redis_key(k, &policy)));
    assert_eq!(node_of.iter().collect::<BTreeSet<_>>().len(), 3);
    for r in limiter.check_many(&keys, 1).await.unwrap() {
        assert_eq!(r.unwrap().enforcement, Enforcement::Shared);
    }
    let hung = node_of[0];
    cluster.node_mut(hung).pause();
    let started = Instant::now();
    let results = limiter.check_many(&keys, 1).await;
    let took = started.elapsed();
    cluster.node_mut(hung).resume();

    let results = results.expect("a batch");
    for (i, r) in results.iter().enumerate() {
        let d = r.as_ref().unwrap_or_else(|e| panic!("request {i}: {e}"));
        if node_of[i] == hung {
            assert_eq!(d.enforcement, Enforcement::Bypassed, "request {i}");
        } else {
            assert_eq!(
                (d.enforcement, d.allowed, d.remaining),
                (Enforcement::Shared, true, 1),
                "request {i}"
            );
            // the bucket holds what the decision said: 2 of 3 spent, so one more would pass
            // and leave none
            let next = store.peek(&keys[i], &policy, 1).await.unwrap();
            assert_eq!((next.allowed, next.remaining), (true, 0), "request {i}");
        }
    }
    let shortest = store_timeout.min(limiter_timeout);
    assert!(took <= shortest + Duration::from_secs(1), "took {took:?}");
    eprintln!(
        "store deadline {store_timeout:?}, limiter deadline {limiter_timeout:?}: the live primaries' {} decisions kept, the hung one's {} bypassed, in {took:?}",
        node_of.iter().filter(|&&n| n != hung).count(),
        node_of.iter().filter(|&&n| n == hung).count(),
    );
}

#[tokio::test]
async fn with_the_limiter_deadline_shorter_than_the_stores() {
    a_hung_primary_costs_only_its_own_keys(Duration::from_millis(300), Duration::from_millis(200))
        .await;
}

#[tokio::test]
async fn with_equal_deadlines() {
    a_hung_primary_costs_only_its_own_keys(Duration::from_millis(300), Duration::from_millis(300))
        .await;
}
