//! Server restarts and stalls: the store reports them as unavailable or timed out (never as a
//! script error), reconnects, and absorbs the NOSCRIPT of the restarted server's empty cache.

mod common;

use std::time::Duration;

use common::Server;
use tollgate_core::{ErrorClass, Key, Policy, Rate, Store, StoreError};
use tollgate_redis::RedisStore;

/// Calls until one succeeds (at most 40 tries, 50 ms apart); every failure on the way must be
/// an outage, never a script error.
async fn until_ok(store: &RedisStore, key: &Key, policy: &Policy) -> (u64, u32) {
    for attempt in 0..40 {
        match store.acquire(key, policy, 1).await {
            Ok(d) => return (d.remaining, attempt),
            Err(e) => {
                assert_eq!(e.class(), ErrorClass::Unavailable, "{e:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    panic!("the store did not recover within 2 s");
}

async fn survives_restart(pooled: bool) {
    let mut server = Server::start();
    let store = if pooled {
        server.pooled(3).await
    } else {
        server.multiplexed().await
    };
    let p = Policy::token_bucket(5, Rate::per_minute(1)).unwrap();
    let k = Key::global("restart");
    assert_eq!(store.acquire(&k, &p, 1).await.unwrap().remaining, 4);
    server.0.restart();
    let (remaining, failures) = until_ok(&store, &k, &p).await;
    assert_eq!(
        remaining, 4,
        "the restarted server is empty: a fresh bucket"
    );
    eprintln!("pooled={pooled}: recovered after {failures} unavailable call(s)");
    for _ in 0..5 {
        store.acquire(&k, &p, 0).await.unwrap_err(); // invalid, never sent
    }
    assert_eq!(store.acquire(&k, &p, 1).await.unwrap().remaining, 3);
}

#[tokio::test]
async fn multiplexed_store_reconnects_and_reloads_scripts_after_a_restart() {
    survives_restart(false).await;
}

#[tokio::test]
async fn pooled_store_replaces_broken_connections_and_reloads_scripts_after_a_restart() {
    survives_restart(true).await;
}

#[tokio::test]
async fn a_paused_server_times_out_then_serves_again() {
    let mut server = Server::start();
    let timeout = Duration::from_millis(150);
    let stores = [
        RedisStore::builder(server.url())
            .timeout(timeout)
            .build()
            .await
            .unwrap(),
        RedisStore::builder(server.url())
            .timeout(timeout)
            .pool(2)
            .build()
            .await
            .unwrap(),
    ];
    let p = Policy::fixed_window(100, Duration::from_secs(3600)).unwrap();
    let k = Key::global("pause");
    server.0.pause();
    for s in &stores {
        let err = s.acquire(&k, &p, 1).await.unwrap_err();
        assert!(
            matches!(err, StoreError::Timeout(d) if d == timeout),
            "{err:?}"
        );
        assert_eq!(err.class(), ErrorClass::Unavailable);
    }
    server.0.resume();
    for s in &stores {
        until_ok(s, &k, &p).await;
    }
}

/// `build_lazy` needs no Redis: against a server that is down, `build` fails but `build_lazy`
/// returns a store whose calls are unavailable (an outage, never a script error) until the
/// server listens, and then decide, loading the scripts on the way (NOSCRIPT).
#[tokio::test]
async fn a_lazily_built_store_starts_while_redis_is_down_and_serves_once_it_is_up() {
    let mut server = Server::start();
    server.0.kill();
    let builder = |multiplexed: bool| {
        let b = RedisStore::builder(server.url()).timeout(Duration::from_millis(200));
        if multiplexed { b.multiplexed() } else { b }
    };
    // A token bucket refilling one token an hour: the second store's call leaves 8 whatever
    // the time (an hour's fixed window, aligned to the epoch on Redis's real clock, restarted
    // at the top of the hour and broke the count of a run that crossed it).
    let p = Policy::token_bucket(10, Rate::new(1, Duration::from_secs(3600))).unwrap();
    let k = Key::global("lazy");
    let mut stores = Vec::new();
    for multiplexed in [false, true] {
        let err = builder(multiplexed).build().await.unwrap_err();
        assert_eq!(err.class(), ErrorClass::Unavailable, "{err:?}");
        let store = builder(multiplexed).build_lazy().await.unwrap();
        let err = store.acquire(&k, &p, 1).await.unwrap_err();
        assert_eq!(err.class(), ErrorClass::Unavailable, "{err:?}");
        stores.push(store);
    }
    server.0.restart();
    let mut remaining = Vec::new();
    for store in &stores {
        remaining.push(until_ok(store, &k, &p).await.0);
    }
    assert_eq!(remaining, [9, 8], "one bucket, in the server that came up");
}

/// A zero connect timeout builds no panic: the pool handed it to bb8, which asserts a
/// non-zero timeout, and `build` / `build_lazy` panicked. Zero is as short a deadline as the
/// runtime's timer has (a connect on loopback may finish within the first poll): `build`
/// and a call either succeed or fail as unavailable (timed out).
#[tokio::test]
async fn a_zero_connect_timeout_is_a_deadline_not_a_panic() {
    let server = Server::start();
    let p = Policy::token_bucket(10, Rate::per_second(1)).unwrap();
    let k = Key::global("zero");
    let outage_or_ok = |what: &str, r: Result<(), StoreError>| {
        if let Err(e) = r {
            assert_eq!(e.class(), ErrorClass::Unavailable, "{what}: {e:?}");
        }
    };
    for multiplexed in [false, true] {
        let builder = || {
            let b = RedisStore::builder(server.url())
                .timeout(Duration::from_millis(200))
                .connect_timeout(Duration::ZERO);
            if multiplexed { b.multiplexed() } else { b }
        };
        let built = tokio::spawn(builder().build()).await;
        outage_or_ok("build", built.expect("build does not panic").map(drop));
        let lazy = tokio::spawn(builder().build_lazy()).await;
        let store = lazy.expect("build_lazy does not panic").unwrap();
        let k = k.clone();
        let call = tokio::spawn(async move { store.acquire(&k, &p, 1).await }).await;
        outage_or_ok("call", call.expect("a call does not panic").map(drop));
    }
}

/// A batch that repeats a key goes as one transaction (MULTI … EXEC). While another script
/// runs past `busy-reply-threshold`, the server refuses each queued EVALSHA with `BUSY` and
/// EXEC answers `EXECABORT`: the batch must fail as busy (DESIGN: BUSY → busy, so the
/// failure mode applies), like a lone call or a batch without a repeated key — never as a
/// script error (a bug, reported loudly, no failure mode). `server` is the store's server.
async fn a_busy_server_makes_a_repeated_key_batch_busy(store: &RedisStore, server: &redis::Client) {
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("busy-reply-threshold")
        .arg(50)
        .query(&mut server.get_connection().unwrap())
        .unwrap();
    let busy = tollgate_testkit::busy::BusyScript::start(server);
    let p = Policy::fixed_window(5, Duration::from_secs(3600)).unwrap();
    let (a, b) = (
        Key::new("busy", ["a"]).unwrap(),
        Key::new("busy", ["b"]).unwrap(),
    );
    // Control: distinct keys (a plain pipeline) are each busy.
    let distinct = [
        tollgate_core::Acquire::new(&a, &p, 1),
        tollgate_core::Acquire::new(&b, &p, 1),
    ];
    let plain = store.acquire_many(&distinct).await;
    // A repeated key: one transaction.
    let repeated = [
        tollgate_core::Acquire::new(&a, &p, 1),
        tollgate_core::Acquire::new(&a, &p, 1),
    ];
    let txn = store.acquire_many(&repeated).await;
    busy.stop();
    let classes = |r: &Result<tollgate_core::Batch, StoreError>| -> Vec<ErrorClass> {
        match r {
            Err(e) => vec![e.class()],
            Ok(batch) => batch
                .iter()
                .map(|d| {
                    d.as_ref()
                        .map_or_else(StoreError::class, |_| ErrorClass::Invalid)
                })
                .collect(),
        }
    };
    assert!(
        classes(&plain).iter().all(|c| *c == ErrorClass::Busy),
        "control: {plain:?}"
    );
    assert!(
        classes(&txn).iter().all(|c| *c == ErrorClass::Busy),
        "a busy server refused the batch's transaction: {txn:?}"
    );
}

#[tokio::test]
async fn a_batch_repeating_a_key_on_a_busy_server_is_busy_not_a_script_error() {
    let server = Server::start();
    let store = server.pooled(2).await;
    a_busy_server_makes_a_repeated_key_batch_busy(&store, &server.0.client()).await;
}

#[tokio::test]
async fn a_batch_repeating_a_key_on_a_busy_sentinel_primary_is_busy_not_a_script_error() {
    let topology = tollgate_testkit::sentinel::SentinelCluster::start("busy");
    let store = RedisStore::sentinel("busy", topology.sentinel_urls())
        .timeout(Duration::from_secs(5))
        .build()
        .await
        .unwrap();
    let primary = &topology.data_servers()[topology.current_primary_index()];
    a_busy_server_makes_a_repeated_key_batch_busy(&store, &primary.client()).await;
}
