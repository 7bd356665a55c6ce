//! A batch on Redis Cluster with one primary down or hung: the requests whose keys live on the
//! live primaries are decided and keep their decisions; only those on the failed one fail
//! (class `unavailable`, so the failure mode applies to them alone). Loopback only; bounded.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use tollgate_core::{Acquire, Batch, ErrorClass, Key, Policy, Rate, Store};
use tollgate_redis::RedisStore;
use tollgate_testkit::cluster::RedisCluster;

// The cluster runs on the real clock, and fixed windows are aligned to the epoch
// (`floor(now / window)`): an hour's window restarts at the top of the hour, so the buckets are
// token buckets refilling one token an hour (no whole token within a test): the second batch
// leaves 1 of 3 whatever the time.
const HOUR: Duration = Duration::from_secs(3600);

/// Three primaries, a store with `deadline`, and 12 keys spread over all three nodes, each
/// admitted once (so the connection knows every node).
struct Fixture {
    cluster: RedisCluster,
    store: RedisStore,
    policy: Policy,
    keys: Vec<Key>,
    node_of: Vec<usize>,
}

impl Fixture {
    async fn start(deadline: Duration) -> Self {
        let cluster = RedisCluster::start(3);
        let store = RedisStore::cluster(cluster.urls())
            .timeout(deadline)
            .build()
            .await
            .expect("cluster store");
        let policy = Policy::token_bucket(3, Rate::new(1, HOUR)).unwrap();
        let keys: Vec<Key> = (0..12)
            .map(|i| Key::new("partial", [format!("k{i}")]).unwrap())
            .collect();
        let node_of = cluster.nodes_for_keys(keys.iter().map(|k| store.redis_key(k, &policy)));
        assert_eq!(node_of.iter().collect::<BTreeSet<_>>().len(), 3);
        let f = Self {
            cluster,
            store,
            policy,
            keys,
            node_of,
        };
        for r in f.batch().await.unwrap() {
            assert!(r.unwrap().allowed);
        }
        f
    }

    /// One batch of every key, cost 1.
    async fn batch(&self) -> Result<Batch, tollgate_core::StoreError> {
        let requests: Vec<Acquire<'_>> = self
            .keys
            .iter()
            .map(|key| Acquire {
                key,
                policy: &self.policy,
                cost: 1,
            })
            .collect();
        self.store.acquire_many(&requests).await
    }

    /// The second batch's results: the failed node's requests unavailable, the others decided
    /// (admitted, one left of 3).
    fn check(&self, results: &Batch, failed: usize, what: &str, took: Duration) {
        assert_eq!(results.len(), self.keys.len());
        for (i, r) in results.iter().enumerate() {
            if self.node_of[i] == failed {
                let e = r.as_ref().expect_err("its primary failed");
                assert_eq!(e.class(), ErrorClass::Unavailable, "request {i}: {e}");
            } else {
                let d = r.as_ref().unwrap_or_else(|e| panic!("request {i}: {e}"));
                assert!(d.allowed && d.remaining == 1, "request {i}: {d:?}");
            }
        }
        let on_failed = self.node_of.iter().filter(|&&n| n == failed).count();
        eprintln!(
            "one primary of 3 {what}: {} of {} requests decided, {on_failed} unavailable, in {took:?}",
            self.keys.len() - on_failed,
            self.keys.len(),
        );
    }
}

#[tokio::test]
async fn a_batch_keeps_the_decisions_of_live_primaries_when_one_is_down() {
    const DEADLINE: Duration = Duration::from_secs(2);
    let mut f = Fixture::start(DEADLINE).await;
    let down = f.node_of[0];
    f.cluster.node_mut(down).kill();

    let started = Instant::now();
    let results = f.batch().await.expect("the live primaries answered");
    let took = started.elapsed();
    f.check(&results, down, "down", took);
    assert!(took <= DEADLINE + Duration::from_secs(1), "took {took:?}");
}

/// A primary that hangs (SIGSTOP: its connections stay open, nothing answers) rather than
/// refusing: the batch waits for it until the store's deadline, no longer, and the requests
/// the other primaries answered keep their decisions; only the hung primary's are unavailable.
#[tokio::test]
async fn a_hung_primary_fails_only_its_own_requests_at_the_deadline() {
    // well below the cluster's node timeout (2 s), after which the live primaries would
    // refuse every key (CLUSTERDOWN) until the hung one answers again
    const SHORT: Duration = Duration::from_millis(300);
    let mut f = Fixture::start(SHORT).await;
    let hung = f.node_of[0];
    f.cluster.node_mut(hung).pause();

    let started = Instant::now();
    let results = f.batch().await;
    let took = started.elapsed();
    f.cluster.node_mut(hung).resume();
    f.check(
        &results.expect("the live primaries answered"),
        hung,
        "hung",
        took,
    );
    assert!(
        took >= Duration::from_millis(250) && took <= SHORT + Duration::from_secs(1),
        "took {took:?}"
    );
}
