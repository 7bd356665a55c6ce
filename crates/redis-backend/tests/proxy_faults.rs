//! RedisStore behind testkit's fault proxy, in front of a real redis-server: latency beyond the
//! deadline is a timeout (class unavailable) and no call outlives its deadline; cut
//! connections fail fast and the store reconnects; a blackhole fires every deadline; refused
//! connections fail fast. Each for the multiplexed connection and the pool. Loopback only.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate_core::{ErrorClass, Key, Policy, Rate, Store, StoreError};
use tollgate_redis::RedisStore;
use tollgate_testkit::proxy::FaultProxy;
use tollgate_testkit::server::RedisServer;

const DEADLINE: Duration = Duration::from_millis(100);
/// Scheduling slack on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(400);
const RECOVERY: Duration = Duration::from_secs(5);

fn policy() -> Policy {
    Policy::token_bucket(1_000_000, Rate::per_second(1000)).unwrap()
}

fn key(i: usize) -> Key {
    Key::new("proxy", [format!("k{i}")]).unwrap()
}

const KINDS: [&str; 2] = ["multiplexed", "pool"];

/// A store of connection kind `kind` through the proxy, built fresh so one kind's faults do
/// not carry over to the next.
async fn store(proxy: &FaultProxy, kind: &str) -> RedisStore {
    let builder = RedisStore::builder(proxy.url())
        .timeout(DEADLINE)
        .connect_timeout(Duration::from_millis(500));
    let builder = if kind == "pool" {
        builder.pool(4)
    } else {
        builder
    };
    builder.build().await.unwrap()
}

/// One acquire, asserted to return within the deadline plus slack.
async fn bounded(store: &RedisStore, i: usize) -> (Result<(), StoreError>, Duration) {
    let started = Instant::now();
    let out = store.acquire(&key(i), &policy(), 1).await.map(drop);
    let took = started.elapsed();
    assert!(took < DEADLINE + SLACK, "a call took {took:?}");
    (out, took)
}

/// Polls until a call succeeds; returns how long that took.
async fn recovers(name: &str, store: &RedisStore) -> Duration {
    let started = Instant::now();
    while bounded(store, 0).await.0.is_err() {
        assert!(
            started.elapsed() < RECOVERY,
            "{name}: no recovery within {RECOVERY:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_beyond_the_deadline_is_a_timeout_and_no_call_outlives_it() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    for name in KINDS {
        let store = store(&proxy, name).await;
        bounded(&store, 0).await.0.unwrap();
        // Each direction +80 ms: a round trip of 160 ms, beyond the 100 ms deadline.
        proxy.set_latency(Duration::from_millis(80));
        let calls = (0..16).map(|i| {
            let store = store.clone();
            tokio::spawn(async move { bounded(&store, i).await })
        });
        let mut slowest = Duration::ZERO;
        for call in calls.collect::<Vec<_>>() {
            let (out, took) = call.await.unwrap();
            match out {
                Err(StoreError::Timeout(d)) => assert_eq!(d, DEADLINE),
                other => panic!("{name}: expected a timeout, got {other:?}"),
            }
            assert!(took >= DEADLINE, "{name}: the deadline fired, not an error");
            slowest = slowest.max(took);
        }
        assert_eq!(
            StoreError::Timeout(DEADLINE).class(),
            ErrorClass::Unavailable
        );
        // Latency under the deadline: calls succeed again, slower (once what was sent at the
        // old latency — the timed-out calls, and the PING that checks the connection is alive
        // after them — has drained: the proxy keeps each direction in order), and over the
        // same connection: slow is not dead.
        let before = proxy.stats().accepted;
        proxy.set_latency(Duration::from_millis(20));
        recovers(name, &store).await;
        let (out, took) = bounded(&store, 1).await;
        out.unwrap_or_else(|e| panic!("{name}: 40 ms round trip under a 100 ms deadline: {e}"));
        proxy.set_latency(Duration::ZERO);
        assert_eq!(
            proxy.stats().accepted,
            before,
            "{name}: a slow connection is kept"
        );
        eprintln!(
            "proxy latency ({name}): 16 calls at +160 ms RTT all timed out, slowest returned after \
             {slowest:?} (deadline {DEADLINE:?}); at +40 ms RTT a call took {took:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_connections_mid_load_fail_fast_and_the_store_reconnects() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    for name in KINDS {
        let store = store(&proxy, name).await;
        let stop = Arc::new(AtomicBool::new(false));
        let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let tasks: Vec<_> = (0..8)
            .map(|t| {
                let (store, stop, ok, failed) =
                    (store.clone(), stop.clone(), ok.clone(), failed.clone());
                tokio::spawn(async move {
                    let mut i = t;
                    while !stop.load(Ordering::Relaxed) {
                        match bounded(&store, i % 20).await.0 {
                            Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                            Err(e) => {
                                assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
                                failed.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                        i += 1;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                })
            })
            .collect();
        let mut recoveries = Vec::new();
        for cut in 0..3 {
            // The load runs over the store's connection(s) before each cut: 40 more calls
            // succeed (5 from each task, were they even).
            let want = ok.load(Ordering::Relaxed) + 40;
            assert!(
                common::eventually(RECOVERY, || ok.load(Ordering::Relaxed) >= want).await,
                "{name}: before cut {cut}, {} calls ok, not {want}, within {RECOVERY:?}",
                ok.load(Ordering::Relaxed)
            );
            tokio::task::block_in_place(|| proxy.cut_all());
            recoveries.push(recovers(name, &store).await);
        }
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
        eprintln!(
            "proxy cuts ({name}): 3 cuts under load from 8 tasks: {} calls ok, {} failed as \
             unavailable; recovered after {recoveries:?}",
            ok.load(Ordering::Relaxed),
            failed.load(Ordering::Relaxed)
        );
        assert!(ok.load(Ordering::Relaxed) > 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackhole_fires_every_deadline_and_traffic_resumes() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    for name in KINDS {
        let store = store(&proxy, name).await;
        bounded(&store, 0).await.0.unwrap();
        proxy.blackhole(true);
        for i in 0..5 {
            let (out, took) = bounded(&store, i).await;
            assert!(
                matches!(out, Err(StoreError::Timeout(_))),
                "{name}: {out:?}"
            );
            assert!(took >= DEADLINE);
        }
        proxy.blackhole(false);
        let took = recovers(name, &store).await;
        eprintln!(
            "proxy blackhole ({name}): 5 calls timed out at the deadline; back after {took:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connections_fail_fast_as_unavailable() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    for name in KINDS {
        let store = store(&proxy, name).await;
        bounded(&store, 0).await.0.unwrap();
        tokio::task::block_in_place(|| {
            proxy.set_refuse(true);
            proxy.cut_all();
        });
        for i in 0..5 {
            let (out, _) = bounded(&store, i).await;
            let err = out.expect_err("the server is unreachable");
            assert_eq!(err.class(), ErrorClass::Unavailable, "{name}: {err}");
        }
        tokio::task::block_in_place(|| proxy.set_refuse(false));
        let took = recovers(name, &store).await;
        eprintln!("proxy refuse ({name}): calls failed as unavailable; back after {took:?}");
    }
}

/// A connection whose path dies without a reset (the proxy holds its traffic for good, as a
/// NAT or firewall that dropped its state would) fails no call and drops nothing: only the
/// deadline notices. A call abandoned at its deadline replaces the connection, so the next
/// calls go over a new one and succeed at once, rather than timing out until the kernel gives
/// up on the dead path (~15 minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_hangs_silently_is_replaced() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    for name in KINDS {
        let store = store(&proxy, name).await;
        bounded(&store, 0).await.0.unwrap();
        let before = proxy.stats().accepted;
        proxy.stall_open();
        let (out, _) = bounded(&store, 1).await;
        assert!(
            matches!(out, Err(StoreError::Timeout(_))),
            "{name}: the stalled connection's call times out: {out:?}"
        );
        let took = recovers(name, &store).await;
        let made = proxy.stats().accepted - before;
        eprintln!(
            "silent hang ({name}): a call timed out, then a call succeeded after {took:?} \
             over {made} new connection(s)"
        );
        assert!(made >= 1, "{name}: a new connection was made");
        // And the store keeps working over it.
        for i in 0..20 {
            bounded(&store, i).await.0.unwrap();
        }
    }
}

/// Sparse traffic after a silent hang: the call abandoned at its deadline has the connection
/// probed at once, so a call that comes after the probe's limit (the connect timeout) goes over
/// a new connection. A pooled connection's probe waited for the connection's next checkout, so
/// that call went to the dead path too and timed out: one more failed call per stalled
/// connection, however long the next call came after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_connection_is_probed_before_the_next_call() {
    const CONNECT: Duration = Duration::from_millis(200);
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    for name in KINDS {
        let builder = RedisStore::builder(proxy.url())
            .timeout(DEADLINE)
            .connect_timeout(CONNECT);
        let store = if name == "pool" {
            builder.pool(1)
        } else {
            builder.multiplexed()
        }
        .build()
        .await
        .unwrap();
        bounded(&store, 0).await.0.unwrap();
        proxy.stall_open();
        let (out, _) = bounded(&store, 1).await;
        assert!(
            matches!(out, Err(StoreError::Timeout(_))),
            "{name}: the stalled connection's call times out: {out:?}"
        );
        // Five times the probe's limit: its verdict is in. Kept fixed: the verdict shows
        // nowhere outside the store. The proxy's counters (accepted, active, bytes) stay as
        // they are for a second after the abandoned call, on both kinds: the multiplexed
        // kind's replacement connects on the next call, and the pool's verdict is a flag read
        // at the next checkout. What is awaited is the probe's own timer (`CONNECT` after the
        // abandoned call), a timer in the test's own process: testkit's clock shim moves
        // only Redis's clock.
        tokio::time::sleep(CONNECT * 5).await;
        let (out, _) = bounded(&store, 2).await;
        assert!(
            out.is_ok(),
            "{name}: the next call, {:?} later: {out:?}",
            CONNECT * 5
        );
    }
}

/// Callers that give up early (a cancelled request: the future dropped after 5 ms, on a
/// connection whose round trip takes 40 ms) say nothing of the connection: it is kept, not
/// replaced, and the next call goes over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_calls_do_not_replace_the_connection() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    for name in KINDS {
        let builder = RedisStore::builder(proxy.url()).timeout(Duration::from_secs(10));
        let store = if name == "pool" {
            builder.pool(1)
        } else {
            builder
        }
        .build()
        .await
        .unwrap();
        store.acquire(&key(0), &policy(), 1).await.unwrap();
        let before = proxy.stats().accepted;
        proxy.set_latency(Duration::from_millis(20));
        for i in 0..10 {
            let (k, p) = (key(i), policy());
            let call = store.acquire(&k, &p, 1);
            assert!(
                tokio::time::timeout(Duration::from_millis(5), call)
                    .await
                    .is_err(),
                "{name}: cancelled before its reply"
            );
        }
        store.acquire(&key(0), &policy(), 1).await.unwrap();
        proxy.set_latency(Duration::ZERO);
        assert_eq!(
            proxy.stats().accepted - before,
            0,
            "{name}: no new connection for cancelled calls"
        );
    }
}

/// A primary that is only slow (a round trip of ~60 ms against a 40 ms deadline: every call
/// times out, yet the connection answers) keeps its connection, on the multiplexed kind and
/// behind Sentinel alike: the `PING` that checks a suspected stall gets its answer, so nothing
/// reconnects or asks the sentinels again. (Before, Sentinel re-resolved and reconnected on
/// about every second timeout.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_primary_keeps_its_connection() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let sentinel = RedisServer::builder()
        .config_file(format!(
            "sentinel monitor m 127.0.0.1 {} 1\nsentinel down-after-milliseconds m 60000\n",
            proxy.port()
        ))
        .extra_args(["--sentinel"])
        .start();
    for kind in ["sentinel", "multiplexed", "pool"] {
        let builder = match kind {
            "sentinel" => RedisStore::sentinel("m", [sentinel.url()]),
            "pool" => RedisStore::builder(proxy.url()).pool(1),
            _ => RedisStore::builder(proxy.url()),
        };
        let store = builder
            .timeout(Duration::from_millis(40))
            .connect_timeout(Duration::from_millis(500))
            .build()
            .await
            .unwrap();
        store.acquire(&key(0), &policy(), 1).await.unwrap();
        let before = proxy.stats().accepted;
        proxy.set_latency(Duration::from_millis(30));
        let mut timed_out = 0;
        // A call answered before a 60 ms round trip could be would mean the latency was not
        // there. One answered later than its deadline is the runtime polling it late (a
        // starved CI runner: tokio's timeout polls the call before its timer, so a reply that
        // arrived meanwhile wins; 2 of 20 under two CPU burners), not a fast answer.
        let mut fast = Vec::new();
        for i in 0..20 {
            let sent = std::time::Instant::now();
            match store.acquire(&key(i), &policy(), 1).await {
                Err(_) => timed_out += 1,
                Ok(_) if sent.elapsed() < Duration::from_millis(60) => fast.push(sent.elapsed()),
                Ok(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The last probe's PING (a 60 ms round trip) has its answer by then.
        tokio::time::sleep(Duration::from_millis(200)).await;
        proxy.set_latency(Duration::ZERO);
        let made = proxy.stats().accepted - before;
        eprintln!(
            "slow primary ({kind}): {timed_out} of 20 calls timed out, {made} new connections"
        );
        assert!(
            fast.is_empty() && timed_out >= 15,
            "{kind}: a 60 ms round trip misses a 40 ms deadline: {timed_out} of 20 timed out, \
             answered sooner than 60 ms: {fast:?}"
        );
        assert_eq!(made, 0, "{kind}: a slow connection is kept");
        recovers(kind, &store).await;
    }
}

/// `CLUSTER SLOTS` of `server` as (start, end, port) of each range's primary.
fn slot_ports(server: &RedisServer) -> Vec<(u16, u16, u16)> {
    let mut conn = server
        .client()
        .get_connection_with_timeout(Duration::from_millis(500))
        .unwrap();
    conn.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let entries: Vec<Vec<redis::Value>> =
        redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn).unwrap();
    entries
        .into_iter()
        .map(|e| {
            let start: u16 = redis::from_redis_value(e[0].clone()).unwrap();
            let end: u16 = redis::from_redis_value(e[1].clone()).unwrap();
            let primary: Vec<redis::Value> = redis::from_redis_value(e[2].clone()).unwrap();
            let port: u16 = redis::from_redis_value(primary[1].clone()).unwrap();
            (start, end, port)
        })
        .collect()
}

/// The same silent hang on a Redis Cluster: one primary is reached through the proxy (it
/// announces the proxy's port), and the path of the store's open connection to it dies
/// without a reset. New connections to it work at once, so — as on a single server — the
/// store must be serving that primary's keys again within a few seconds, rather than timing
/// out every call for them until the kernel gives up on the dead path (~15 minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_nodes_connection_that_hangs_silently_is_replaced() {
    use tollgate_testkit::cluster::RedisCluster;
    let cluster = RedisCluster::start(3);
    let node0 = &cluster.nodes()[0];
    let proxy = FaultProxy::start(node0.port());
    for (name, value) in [
        ("cluster-announce-bus-port", node0.port() + 10_000),
        ("cluster-announce-port", proxy.port()),
    ] {
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut node0.client().get_connection().unwrap())
            .unwrap();
    }
    let started = Instant::now();
    while !cluster.nodes()[1..]
        .iter()
        .all(|n| slot_ports(n).iter().any(|&(_, _, p)| p == proxy.port()))
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "announce spread"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The store knows node 0 only by the proxy's address.
    let store = RedisStore::cluster(cluster.nodes()[1..].iter().map(RedisServer::url))
        .timeout(DEADLINE)
        .connect_timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap();
    let ranges = slot_ports(&cluster.nodes()[1]);
    let on_node0 = |k: &Key| {
        let slot = RedisCluster::slot_of(store.redis_key(k, &policy()));
        ranges
            .iter()
            .any(|&(s, e, p)| p == proxy.port() && (s..=e).contains(&slot))
    };
    let i = (0..10_000)
        .find(|&i| on_node0(&key(i)))
        .expect("a key on node 0");
    bounded(&store, i).await.0.unwrap();
    assert!(
        proxy.stats().accepted >= 1,
        "node 0 is reached through the proxy"
    );

    let before = proxy.stats().accepted;
    proxy.stall_open();
    let (out, _) = bounded(&store, i).await;
    assert!(matches!(out, Err(StoreError::Timeout(_))), "{out:?}");
    let started = Instant::now();
    let mut outcomes = Vec::new();
    while started.elapsed() < RECOVERY {
        let (out, _) = bounded(&store, i).await;
        if out.is_ok() {
            eprintln!(
                "cluster silent hang: recovered after {:?} over {} new connection(s)",
                started.elapsed(),
                proxy.stats().accepted - before
            );
            return;
        }
        outcomes.push(out.unwrap_err().to_string());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "no recovery within {RECOVERY:?}: {} calls failed, {} new connection(s) to the node; last: {:?}",
        outcomes.len(),
        proxy.stats().accepted - before,
        outcomes.last()
    );
}

/// `args` run on `server` on a fresh connection with 500 ms timeouts.
fn run_on(server: &RedisServer, args: &[&str]) -> redis::Value {
    let mut conn = server
        .client()
        .get_connection_with_timeout(Duration::from_millis(500))
        .unwrap();
    conn.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query(&mut conn).unwrap()
}

/// A node that joined the cluster after the store connected is reached on a direct connection
/// while a slot moves to it (the ASK window). When that connection's path dies silently, it
/// is probed and forgotten like any other stalled connection, and the next call connects
/// afresh: the store serves the key again within a few seconds (it timed out every call for
/// the whole window: 45 of 45 over 5 s, no new connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_direct_connection_to_a_joining_node_is_replaced() {
    use tollgate_testkit::cluster::RedisCluster;
    let cluster = RedisCluster::start(3);
    let store = RedisStore::cluster(cluster.urls())
        .timeout(DEADLINE)
        .connect_timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap();
    let policy = policy();
    let key = key(0);
    let rkey = store.redis_key(&key, &policy);
    let slot = RedisCluster::slot_of(&rkey);
    store.acquire(&key, &policy, 1).await.unwrap();

    // A fourth, empty primary, reached (as it announces) through the proxy.
    let new = RedisCluster::empty_node();
    let proxy = FaultProxy::start(new.port());
    let bus = (new.port() + 10_000).to_string();
    let announced = proxy.port().to_string();
    run_on(&new, &["CONFIG", "SET", "cluster-announce-bus-port", &bus]);
    run_on(
        &new,
        &["CONFIG", "SET", "cluster-announce-port", &announced],
    );
    let new_id = tokio::task::block_in_place(|| cluster.join(&new, proxy.port()));
    let from = cluster.node_for_slot(slot);
    let from_id = cluster.node_id(from).to_owned();
    let new_port = new.port().to_string();
    let slot_s = slot.to_string();
    run_on(
        &new,
        &["CLUSTER", "SETSLOT", &slot_s, "IMPORTING", &from_id],
    );
    run_on(
        &cluster.nodes()[from],
        &["CLUSTER", "SETSLOT", &slot_s, "MIGRATING", &new_id],
    );
    run_on(
        &cluster.nodes()[from],
        &["MIGRATE", "127.0.0.1", &new_port, &rkey, "0", "5000"],
    );

    // The ASK window: the store follows the ASK to the new node on a direct connection.
    store.acquire(&key, &policy, 1).await.unwrap();
    let before = proxy.stats().accepted;
    assert!(before >= 1, "the new node is reached through the proxy");

    // The direct connection's path dies without a reset.
    proxy.stall_open();
    let started = Instant::now();
    let mut failed = Vec::new();
    while started.elapsed() < RECOVERY {
        match store.acquire(&key, &policy, 1).await {
            Ok(_) => {
                eprintln!(
                    "direct silent hang: recovered after {:?} over {} new connection(s)",
                    started.elapsed(),
                    proxy.stats().accepted - before
                );
                return;
            }
            Err(e) => failed.push(e),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "no recovery within {RECOVERY:?}: {} calls failed, {} new connection(s) to the node",
        failed.len(),
        proxy.stats().accepted - before,
    );
}
