//! What one decision costs the client's allocator on the multiplexed connection, against a
//! real redis-server: the allocations the store itself makes per call are pinned, so that a
//! change which adds one (a `format!`, a `String`, a fresh buffer per call) fails here.

mod common;

use common::Server;
use redis::aio::ConnectionLike as _;
use tollgate_core::{Key, Policy, Rate, Store};
use tollgate_redis::{RedisStore, scripts};
use tollgate_testkit::alloc::{Counting, allocations};

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations per call of `call`, over `calls` calls after as many unrecorded ones.
async fn per_call(calls: u64, mut call: impl AsyncFnMut(u64)) -> f64 {
    for i in 0..calls {
        call(i).await;
    }
    let before = allocations();
    for i in 0..calls {
        call(i).await;
    }
    (allocations() - before) as f64 / calls as f64
}

/// One decision at a time on a current-thread runtime, so that the connection's driver task
/// allocates on this thread too and every allocation of a call is counted, against the floor:
/// the same `EVALSHA` sent by redis-rs's `ConnectionManager` (as the store's multiplexed
/// connection is) from one command built once. The store may add one allocation to the
/// floor, the boxed future of `Store::acquire` (async-trait); building each call's command
/// afresh added two more (its argument and data buffers).
#[tokio::test(flavor = "current_thread")]
async fn a_decision_allocates_no_more_than_a_prebuilt_evalsha_and_its_boxed_future() {
    const CALLS: u64 = 2_000;
    let server = Server::start();
    let store = RedisStore::builder(server.url())
        .multiplexed()
        .build()
        .await
        .unwrap();
    let policy = Policy::token_bucket(60_000, Rate::per_second(1)).unwrap();
    let keys: Vec<Key> = (0..64)
        .map(|i| Key::new("alloc", [format!("user-{i}")]).unwrap())
        .collect();
    store.load_scripts().await.unwrap();
    let store_calls = per_call(CALLS, async |i| {
        let key = &keys[(i % 64) as usize];
        assert!(store.acquire(key, &policy, 1).await.unwrap().allowed);
    })
    .await;

    let client = redis::Client::open(format!("{}?protocol=resp3", server.url())).unwrap();
    let mut manager = client.get_connection_manager().await.unwrap();
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(scripts::all()[0].sha())
        .arg(1)
        .arg(store.redis_key(&keys[0], &policy))
        .arg(scripts::args(&policy, 1, true));
    let floor = per_call(CALLS, async |_| {
        let reply = manager.req_packed_command(&cmd).await.unwrap();
        assert!(matches!(reply, redis::Value::Int(_)), "{reply:?}");
    })
    .await;
    assert!(
        store_calls <= floor + 1.05,
        "{store_calls:.3} allocations per decision, {floor:.3} per prebuilt EVALSHA"
    );
}
