//! A batch on Redis Cluster with one primary down: the requests whose keys live on the live
//! primaries are decided and keep their decisions; only those on the dead one fail (class
//! `unavailable`, so the failure mode applies to them alone). Loopback only; bounded.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use tollgate_core::{Acquire, ErrorClass, Key, Policy, Store};
use tollgate_redis::RedisStore;
use tollgate_testkit::cluster::RedisCluster;

const HOUR: Duration = Duration::from_secs(3600);
const DEADLINE: Duration = Duration::from_secs(2);

#[tokio::test]
async fn a_batch_keeps_the_decisions_of_live_primaries_when_one_is_down() {
    let mut cluster = RedisCluster::start(3);
    let store = RedisStore::cluster(cluster.urls())
        .timeout(DEADLINE)
        .build()
        .await
        .expect("cluster store");
    let policy = Policy::fixed_window(3, HOUR).unwrap();
    let keys: Vec<Key> = (0..12)
        .map(|i| Key::new("partial", [format!("k{i}")]).unwrap())
        .collect();
    let node_of: Vec<usize> = keys
        .iter()
        .map(|k| cluster.node_for_slot(RedisCluster::slot_of(store.redis_key(k, &policy))))
        .collect();
    assert_eq!(node_of.iter().collect::<BTreeSet<_>>().len(), 3);
    let requests: Vec<Acquire<'_>> = keys
        .iter()
        .map(|key| Acquire {
            key,
            policy: &policy,
            cost: 1,
        })
        .collect();
    // Every node answers once (the connection knows them all), then one primary dies.
    for r in store.acquire_many(&requests).await.unwrap() {
        assert!(r.unwrap().allowed);
    }
    let down = node_of[0];
    cluster.node_mut(down).kill();

    let started = Instant::now();
    let results = store
        .acquire_many(&requests)
        .await
        .expect("the live primaries answered");
    let took = started.elapsed();
    assert_eq!(results.len(), keys.len());
    for (i, r) in results.iter().enumerate() {
        if node_of[i] == down {
            let e = r.as_ref().expect_err("its primary is down");
            assert_eq!(e.class(), ErrorClass::Unavailable, "request {i}: {e}");
        } else {
            let d = r.as_ref().unwrap_or_else(|e| panic!("request {i}: {e}"));
            assert!(d.allowed && d.remaining == 1, "request {i}: {d:?}");
        }
    }
    assert!(took <= DEADLINE + Duration::from_secs(1), "took {took:?}");
    eprintln!(
        "one primary of 3 down: {} of {} requests decided, {} unavailable, in {took:?}",
        node_of.iter().filter(|&&n| n != down).count(),
        keys.len(),
        node_of.iter().filter(|&&n| n == down).count(),
    );
}

/// A primary that hangs (SIGSTOP: its connections stay open, nothing answers) rather than
/// refusing: the batch waits for it until the store's deadline, no longer, and the requests
/// the other primaries answered keep their decisions; only the hung primary's are unavailable.
#[tokio::test]
async fn a_hung_primary_fails_only_its_own_requests_at_the_deadline() {
    // well below the cluster's node timeout (2 s), after which the live primaries would
    // refuse every key (CLUSTERDOWN) until the hung one answers again
    const SHORT: Duration = Duration::from_millis(300);
    let mut cluster = RedisCluster::start(3);
    let store = RedisStore::cluster(cluster.urls())
        .timeout(SHORT)
        .build()
        .await
        .expect("cluster store");
    let policy = Policy::fixed_window(3, HOUR).unwrap();
    let keys: Vec<Key> = (0..12)
        .map(|i| Key::new("hung", [format!("k{i}")]).unwrap())
        .collect();
    let node_of: Vec<usize> = keys
        .iter()
        .map(|k| cluster.node_for_slot(RedisCluster::slot_of(store.redis_key(k, &policy))))
        .collect();
    assert_eq!(node_of.iter().collect::<BTreeSet<_>>().len(), 3);
    let requests: Vec<Acquire<'_>> = keys
        .iter()
        .map(|key| Acquire {
            key,
            policy: &policy,
            cost: 1,
        })
        .collect();
    for r in store.acquire_many(&requests).await.unwrap() {
        assert!(r.unwrap().allowed);
    }
    let hung = node_of[0];
    cluster.node_mut(hung).pause();

    let started = Instant::now();
    let results = store.acquire_many(&requests).await;
    let took = started.elapsed();
    cluster.node_mut(hung).resume();
    let results = results.expect("the live primaries answered");
    assert_eq!(results.len(), keys.len());
    for (i, r) in results.iter().enumerate() {
        if node_of[i] == hung {
            let e = r.as_ref().expect_err("its primary hangs");
            assert_eq!(e.class(), ErrorClass::Unavailable, "request {i}: {e}");
        } else {
            let d = r.as_ref().unwrap_or_else(|e| panic!("request {i}: {e}"));
            assert!(d.allowed && d.remaining == 1, "request {i}: {d:?}");
        }
    }
    assert!(
        took >= Duration::from_millis(250) && took <= SHORT + Duration::from_secs(1),
        "took {took:?}"
    );
    eprintln!(
        "one primary of 3 hung: {} of {} requests decided, {} unavailable, in {took:?}",
        node_of.iter().filter(|&&n| n != hung).count(),
        keys.len(),
        node_of.iter().filter(|&&n| n == hung).count(),
    );
}
