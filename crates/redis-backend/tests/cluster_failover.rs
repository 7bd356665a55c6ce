//! A Redis Cluster losing a node, against a store built on it: a primary killed and its
//! replica promoted by the cluster, and a primary restarted on its port with its data and
//! script cache lost. The store decides that node's keys again within a bound, and every
//! failure on the way is an outage (class unavailable: the failure mode applies), never a
//! script error (NOSCRIPT absorbed). Written from a review's probes (they passed: these pin
//! it). And the policy registry on a Cluster losing nodes. Loopback only, every wait bounded.

use std::time::{Duration, Instant};

use tollgate_core::{ErrorClass, Key, Policy, Rate, Store, StoreError};
use tollgate_redis::{Published, RedisRegistry, RedisStore};
use tollgate_testkit::cluster::RedisCluster;
use tollgate_testkit::server::RedisServer;
use tollgate_testkit::wait::until;

const HOUR: Duration = Duration::from_secs(3600);

fn admin(server: &RedisServer) -> redis::Connection {
    let c = server
        .client()
        .get_connection_with_timeout(Duration::from_secs(2))
        .unwrap();
    c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    c
}

fn info(server: &RedisServer, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query(&mut admin(server))
        .unwrap_or_default()
}

/// Whether `server` answers `CLUSTER INFO` with the cluster's state ok.
fn cluster_ok(server: &RedisServer) -> bool {
    server
        .client()
        .get_connection_with_timeout(Duration::from_millis(500))
        .ok()
        .and_then(|mut c| {
            redis::cmd("CLUSTER")
                .arg("INFO")
                .query::<String>(&mut c)
                .ok()
        })
        .is_some_and(|s| s.contains("cluster_state:ok"))
}

/// A new node joined to `cluster` as a replica of node `of`, in sync and known to every node.
fn replica_of(cluster: &mut RedisCluster, of: usize) -> RedisServer {
    let replica = RedisCluster::empty_node();
    cluster.join(&replica, replica.port());
    let () = redis::cmd("CLUSTER")
        .arg("REPLICATE")
        .arg(cluster.node_id(of))
        .query(&mut admin(&replica))
        .unwrap();
    until(Duration::from_secs(20), "the replica in sync", || {
        info(&replica, "replication").contains("master_link_status:up")
    });
    let tag = format!(":{}@", replica.port());
    until(
        Duration::from_secs(20),
        "every node knows the replica",
        || {
            cluster.nodes().iter().all(|n| {
                redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query::<String>(&mut admin(n))
                    .is_ok_and(|nodes| {
                        nodes
                            .lines()
                            .any(|l| l.contains(&tag) && l.contains("slave"))
                    })
            })
        },
    );
    replica
}

/// `n` keys whose buckets live on node `node`.
fn keys_on(
    cluster: &RedisCluster,
    store: &RedisStore,
    policy: &Policy,
    node: usize,
    n: usize,
) -> Vec<Key> {
    (0..)
        .map(|i| Key::new("failover", [format!("k{i}")]).unwrap())
        .filter(|k| cluster.nodes_for_keys([store.redis_key(k, policy)])[0] == node)
        .take(n)
        .collect()
}

/// A store on `cluster` whose calls time out after 500 ms.
async fn store(cluster: &RedisCluster) -> RedisStore {
    RedisStore::cluster(cluster.urls())
        .timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_secs(1))
        .build()
        .await
        .unwrap()
}

/// Calls `acquire` on each of `keys` every 20 ms until it is decided, at most 10 s each,
/// asserting every failure on the way is an outage; the failures seen.
async fn decided_again(store: &RedisStore, keys: &[Key], policy: &Policy) -> Vec<StoreError> {
    let mut failures = Vec::new();
    for k in keys {
        let started = Instant::now();
        loop {
            match store.acquire(k, policy, 1).await {
                Ok(d) => {
                    assert!(d.allowed, "{k}: {d:?}");
                    break;
                }
                Err(e) => failures.push(e),
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{k} never decided again; failures: {failures:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let bugs: Vec<_> = failures
        .iter()
        .filter(|e| e.class() != ErrorClass::Unavailable)
        .collect();
    assert!(bugs.is_empty(), "failures other than outages: {bugs:?}");
    failures
}

/// A primary killed and restarted on its port (its `nodes.conf` kept; data and script cache
/// lost): once the cluster is ok again the store decides that node's keys again.
#[tokio::test]
async fn a_restarted_primary_is_used_again_and_never_a_script_error() {
    let mut cluster = RedisCluster::start(3);
    let store = store(&cluster).await;
    let policy = Policy::token_bucket(100, Rate::new(1, HOUR)).unwrap();
    let keys = keys_on(&cluster, &store, &policy, 0, 4);
    for k in &keys {
        store.acquire(k, &policy, 1).await.unwrap();
    }
    cluster.node_mut(0).kill();
    cluster.node_mut(0).restart();
    until(Duration::from_secs(20), "the cluster ok again", || {
        cluster.nodes().iter().all(cluster_ok)
    });
    let failures = decided_again(&store, &keys, &policy).await;
    eprintln!("{} outage failures on the way", failures.len());
}

/// A primary with a replica is killed and the cluster promotes the replica: the store follows
/// the promotion for that primary's keys, which keep what was spent before the kill.
#[tokio::test]
async fn a_promoted_replica_is_followed() {
    let mut cluster = RedisCluster::start(3);
    let replica = replica_of(&mut cluster, 0);
    let store = store(&cluster).await;
    let policy = Policy::token_bucket(100, Rate::new(1, HOUR)).unwrap();
    let keys = keys_on(&cluster, &store, &policy, 0, 4);
    for k in &keys {
        assert_eq!(store.acquire(k, &policy, 10).await.unwrap().remaining, 90);
    }
    // every write on the replica before the kill
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query(&mut admin(&cluster.nodes()[0]))
        .unwrap();
    assert_eq!(acked, 1, "the replica acknowledged the writes");
    cluster.node_mut(0).kill();
    until(Duration::from_secs(30), "the replica promoted", || {
        info(&replica, "replication").contains("role:master")
    });
    until(Duration::from_secs(20), "the cluster ok again", || {
        cluster.nodes()[1..]
            .iter()
            .chain([&replica])
            .all(cluster_ok)
    });
    decided_again(&store, &keys, &policy).await;
    for k in &keys {
        let d = store.peek(k, &policy, 1).await.unwrap();
        assert_eq!(
            d.remaining, 88,
            "{k}: spent 10 and 1 kept across the promotion: {d:?}"
        );
    }
}

/// Generation `g` of the policy the registry tests publish.
fn registry_policy(g: u64) -> Policy {
    Policy::fixed_window(10 + g, Duration::from_secs(60))
        .unwrap()
        .with_generation(g)
        .with_transition(tollgate_core::Transition::Carry)
}

/// The node owning the policy registry's hash (`tollgate:registry`).
fn registry_owner(cluster: &RedisCluster) -> usize {
    cluster.node_for_slot(RedisCluster::slot_of("tollgate:registry"))
}

/// A policy registry through `url` (prefix `tollgate:`), calls bounded by `timeout`.
async fn registry_at(url: &str, timeout: Duration) -> RedisRegistry {
    RedisRegistry::connect(url, "tollgate:", timeout)
        .await
        .unwrap()
}

/// Every node keeps serving its slots while another is down.
fn partial_coverage(cluster: &RedisCluster) {
    for node in cluster.nodes() {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-require-full-coverage")
            .arg("no")
            .query(&mut admin(node))
            .unwrap();
    }
}

/// `registry.get("api")` every 200 ms for up to `bound`: the last answer.
async fn keep_asking(
    registry: &RedisRegistry,
    bound: Duration,
) -> Result<Option<Policy>, tollgate_redis::RegistryError> {
    let started = Instant::now();
    loop {
        let got = registry.get("api").await;
        if got.is_ok() || started.elapsed() > bound {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The policy registry on a Cluster after one timed-out call (the slot's owner hung for a
/// moment): it makes a new cluster connection, so once the node its URL names is gone it goes
/// on answering from the slot's owner, as a registry that never timed out does. (It went back
/// to the URL's node alone and failed every call for good: found by a review.)
#[tokio::test]
async fn the_policy_registry_outlives_its_url_node_after_a_timeout() {
    let mut cluster = RedisCluster::start(3);
    partial_coverage(&cluster);
    let timeout = Duration::from_secs(1);
    let urls = cluster.urls();
    let owner = registry_owner(&cluster);
    let home = (owner + 1) % 3; // the URL both registries are given: not the slot's owner
    let registry = registry_at(&urls[home], timeout).await;
    let steady = registry_at(&urls[home], timeout).await;
    assert!(matches!(
        registry.publish("api", &registry_policy(1)).await,
        Ok(Published::Stored)
    ));
    // both on their cluster connections now
    assert_eq!(steady.get("api").await.unwrap(), Some(registry_policy(1)));
    // the slot's owner hangs for a moment: one call of `registry` times out
    cluster.node_mut(owner).pause();
    let during = registry.get("api").await;
    cluster.node_mut(owner).resume();
    assert!(during.is_err(), "a call to a hung owner: {during:?}");
    // the URL's node is then lost (the slot's owner is fine and serves the slot)
    cluster.node_mut(home).kill();
    let control = keep_asking(&steady, Duration::from_secs(3)).await;
    assert_eq!(
        control.as_ref().ok(),
        Some(&Some(registry_policy(1))),
        "control (no timeout): {control:?}"
    );
    let got = keep_asking(&registry, Duration::from_secs(5)).await;
    assert_eq!(
        got.as_ref().ok(),
        Some(&Some(registry_policy(1))),
        "the registry that met one timeout, its URL's node gone: {got:?}"
    );
}

/// The policy registry given the URL of the node owning its slot follows that node's failover
/// (the replica promoted by the cluster): the node says it is a Cluster node (`HELLO`) and
/// the registry takes a cluster connection at once. (It met no redirection, stayed on a
/// plain connection to the failed node and failed every call: found by a review.)
#[tokio::test]
async fn the_policy_registry_given_the_owners_url_follows_its_failover() {
    let mut cluster = RedisCluster::start(3);
    let timeout = Duration::from_secs(1);
    let urls = cluster.urls();
    let owner = registry_owner(&cluster);
    let other = (owner + 1) % 3;
    let replica = replica_of(&mut cluster, owner);
    let at_owner = registry_at(&urls[owner], timeout).await;
    let at_other = registry_at(&urls[other], timeout).await;
    assert!(matches!(
        at_owner.publish("api", &registry_policy(1)).await,
        Ok(Published::Stored)
    ));
    assert_eq!(at_other.get("api").await.unwrap(), Some(registry_policy(1)));
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query(&mut admin(&cluster.nodes()[owner]))
        .unwrap();
    assert_eq!(acked, 1);
    cluster.node_mut(owner).kill();
    until(Duration::from_secs(30), "the replica promoted", || {
        redis::cmd("INFO")
            .arg("replication")
            .query::<String>(&mut admin(&replica))
            .unwrap_or_default()
            .contains("role:master")
    });
    let control = keep_asking(&at_other, Duration::from_secs(10)).await;
    assert_eq!(
        control.as_ref().ok(),
        Some(&Some(registry_policy(1))),
        "control (given another node's URL): {control:?}"
    );
    let got = keep_asking(&at_owner, Duration::from_secs(10)).await;
    assert_eq!(
        got.as_ref().ok(),
        Some(&Some(registry_policy(1))),
        "the registry given {} (the slot's owner, failed over): {got:?}",
        urls[owner]
    );
}

/// A policy registry call on a Cluster keeps its deadline when it times out (the slot's owner
/// hung): the new cluster connection is made in the background. It was made inside the same
/// call, whose handshake with the hung node hung too: the call returned after twice its
/// deadline (found by a review).
#[tokio::test]
async fn a_timed_out_policy_registry_call_keeps_its_deadline() {
    let mut cluster = RedisCluster::start(3);
    let timeout = Duration::from_secs(1);
    let urls = cluster.urls();
    let owner = registry_owner(&cluster);
    let registry = registry_at(&urls[(owner + 1) % 3], timeout).await;
    assert!(matches!(
        registry.publish("api", &registry_policy(1)).await,
        Ok(Published::Stored)
    ));
    cluster.node_mut(owner).pause();
    let started = Instant::now();
    let during = registry.get("api").await;
    let took = started.elapsed();
    cluster.node_mut(owner).resume();
    assert!(during.is_err(), "a call to a hung owner: {during:?}");
    assert!(
        took < timeout + Duration::from_millis(400),
        "a call with a deadline of {timeout:?} returned after {took:?} ({during:?})"
    );
    // and the registry answers again once the owner does
    let again = keep_asking(&registry, Duration::from_secs(5)).await;
    assert_eq!(again.ok(), Some(Some(registry_policy(1))));
}
