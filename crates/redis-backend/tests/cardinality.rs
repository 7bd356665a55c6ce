//! Cardinality: a bounded run writing many distinct keys (every algorithm, pipelined in
//! batches) leaves no key behind once their expiry passes, and Redis's `used_memory` returns to
//! where it was.
//!
//! - On Redis's own clock, moved by the test (testkit's clock shim): 50,000 keys with expiries
//!   up to a minute, all present until the clock jumps two minutes, then none. The shim reads its
//!   control file on every clock call, which makes the server ~15x slower, hence the count.
//!   `TOLLGATE_CARDINALITY_CLOCK_KEYS` sets it.
//! - On the real clock: 250,000 keys by default (about 10 s in a debug build; a million take
//!   about 38 s, 26,500 keys/s, bound by the debug client), with expiries of at most 5 s, then
//!   none. `TOLLGATE_CARDINALITY_KEYS=1000000` runs the full million.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate_core::{Acquire, Key, Policy, Rate, Store, StoreError};
use tollgate_redis::RedisStore;
use tollgate_testkit::server::RedisServer;

/// Redis `TIME` in 2023, on a whole minute.
const T0: u64 = 1_699_999_980_000_000;
/// Requests per pipeline, on the real clock and under the (slower) clock shim. Kept small so that
/// one round trip stays short even on a loaded machine (it once had to stay under redis-rs's
/// 500 ms response timeout; see `store_timeout_above_half_a_second_is_honoured`).
const BATCH: usize = 250;
const SHIM_BATCH: usize = 50;
const IN_FLIGHT: usize = 2;

fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn query<T: redis::FromRedisValue>(conn: &mut redis::Connection, cmd: &mut redis::Cmd) -> T {
    cmd.query(conn).unwrap()
}

fn info_field(conn: &mut redis::Connection, section: &str, field: &str) -> String {
    let info: String = query(conn, redis::cmd("INFO").arg(section));
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")).map(str::to_owned))
        .unwrap_or_default()
}

fn used_memory(conn: &mut redis::Connection) -> i64 {
    info_field(conn, "memory", "used_memory").parse().unwrap()
}

/// One full `SCAN` pass: Redis deletes every expired key the scan meets (lazy expiry).
fn scan_pass(conn: &mut redis::Connection) {
    let mut cursor = 0_u64;
    loop {
        let (next, _): (u64, Vec<Vec<u8>>) = query(
            conn,
            redis::cmd("SCAN").arg(cursor).arg("COUNT").arg(10_000),
        );
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
}

/// Writes `n` distinct keys (`policies` in turn), `batch` per pipeline; returns the time taken.
async fn write_keys(
    store: &RedisStore,
    policies: &Arc<[Policy; 3]>,
    n: usize,
    batch: usize,
) -> Duration {
    let started = Instant::now();
    let batches: Vec<usize> = (0..n).step_by(batch).collect();
    for wave in batches.chunks(IN_FLIGHT) {
        let mut tasks = Vec::with_capacity(wave.len());
        for &first in wave {
            let (store, policies) = (store.clone(), policies.clone());
            tasks.push(tokio::spawn(async move {
                let end = (first + batch).min(n);
                let keys: Vec<Key> = (first..end)
                    .map(|i| Key::new("card", [i.to_string()]).unwrap())
                    .collect();
                let requests: Vec<Acquire<'_>> = keys
                    .iter()
                    .enumerate()
                    .map(|(j, key)| Acquire {
                        key,
                        policy: &policies[(first + j) % 3],
                        cost: 1,
                    })
                    .collect();
                let decisions = store.acquire_many(&requests).await.unwrap();
                assert!(
                    decisions
                        .iter()
                        .all(|d| d.as_ref().is_ok_and(|d| d.allowed && d.remaining == 9))
                );
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    }
    started.elapsed()
}

/// Waits until `DBSIZE` is 0, running `SCAN` passes after `scan_after`; returns the time taken
/// and the number of passes.
async fn wait_until_empty(
    conn: &mut redis::Connection,
    scan_after: Duration,
    limit: Duration,
) -> (Duration, u32) {
    let started = Instant::now();
    let mut scans = 0;
    loop {
        let left: u64 = query(conn, &mut redis::cmd("DBSIZE"));
        if left == 0 {
            return (started.elapsed(), scans);
        }
        assert!(
            started.elapsed() < limit,
            "{left} keys still there {limit:?} after their expiry"
        );
        if started.elapsed() > scan_after {
            scan_pass(conn);
            scans += 1;
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_keys_leave_nothing_behind_once_a_moved_redis_clock_passes_their_expiry() {
    let n = env_count("TOLLGATE_CARDINALITY_CLOCK_KEYS", 50_000);
    let server = RedisServer::builder().clock_control(true).start();
    server.clock().freeze_at_micros(T0);
    let mut conn = server.client().get_connection().unwrap();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(30))
        .build()
        .await
        .unwrap();
    // Expiries: 1 s (one token of ten), the rest of a minute's window, a minute after the entry.
    let policies = Arc::new([
        Policy::token_bucket(10, Rate::per_second(10)).unwrap(),
        Policy::fixed_window(10, Duration::from_secs(60)).unwrap(),
        Policy::sliding_log(10, Duration::from_secs(60)).unwrap(),
    ]);
    let memory_before = used_memory(&mut conn);
    let write_time = write_keys(&store, &policies, n, SHIM_BATCH).await;

    // The clock is frozen: every key is still there, each with an expiry.
    let dbsize: u64 = query(&mut conn, &mut redis::cmd("DBSIZE"));
    assert_eq!(dbsize, n as u64, "one key per distinct bucket");
    let keyspace = info_field(&mut conn, "keyspace", "db0");
    assert!(
        keyspace.starts_with(&format!("keys={n},expires={n},")),
        "every key carries an expiry: {keyspace}"
    );
    let memory_full = used_memory(&mut conn);

    server.clock().advance(Duration::from_secs(121));
    let (expiry_time, scans) =
        wait_until_empty(&mut conn, Duration::from_secs(2), Duration::from_secs(60)).await;
    let memory_after = used_memory(&mut conn);
    println!(
        "cardinality (moved clock): {n} keys written in {write_time:.2?} ({:.0} keys/s), {} B/key \
         in used_memory; none left {expiry_time:.2?} after the clock jumped past their expiry \
         ({scans} SCAN passes); used_memory before {memory_before} B, full {memory_full} B, \
         after {memory_after} B",
        n as f64 / write_time.as_secs_f64(),
        (memory_full - memory_before) / i64::try_from(n).unwrap(),
    );
    assert!(
        memory_after < memory_before + (1 << 20),
        "used_memory did not come back: {memory_before} B before, {memory_after} B after"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_distinct_keys_leave_nothing_behind_once_expired() {
    let n = env_count("TOLLGATE_CARDINALITY_KEYS", 250_000);
    let server = RedisServer::start();
    let mut conn = server.client().get_connection().unwrap();
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_secs(30))
        .build()
        .await
        .unwrap();
    // Every expiry is at most 5 s: one token of ten at 1 per 5 s, a 5 s window, a 5 s log.
    let policies = Arc::new([
        Policy::token_bucket(10, Rate::new(1, Duration::from_secs(5))).unwrap(),
        Policy::fixed_window(10, Duration::from_secs(5)).unwrap(),
        Policy::sliding_log(10, Duration::from_secs(5)).unwrap(),
    ]);
    let memory_before = used_memory(&mut conn);
    let write_time = write_keys(&store, &policies, n, BATCH).await;
    let keyspace = info_field(&mut conn, "keyspace", "db0");
    let counts: Vec<u64> = keyspace
        .split(',')
        .take(2)
        .filter_map(|f| f.split_once('=').and_then(|(_, v)| v.parse().ok()))
        .collect();
    assert!(
        counts.len() == 2 && counts[0] == counts[1] && counts[0] > 0,
        "every key carries an expiry: {keyspace}"
    );
    let memory_full = used_memory(&mut conn);
    let (expiry_time, scans) =
        wait_until_empty(&mut conn, Duration::from_secs(6), Duration::from_secs(30)).await;
    let memory_after = used_memory(&mut conn);
    println!(
        "cardinality (real clock): {n} keys written in {write_time:.2?} ({:.0} keys/s), {} keys \
         live at the end; none left {expiry_time:.2?} later ({scans} SCAN passes); used_memory \
         before {memory_before} B, at the end of writing {memory_full} B, after {memory_after} B",
        n as f64 / write_time.as_secs_f64(),
        counts[0],
    );
    assert!(
        memory_after < memory_before + (1 << 20),
        "used_memory did not come back: {memory_before} B before, {memory_after} B after"
    );
}

/// `RedisStoreBuilder::timeout` is documented as "the deadline of each store call". Both
/// connection kinds used to keep redis-rs's own default response timeout of 500 ms (the
/// multiplexed `ConnectionManager`, and the pool's connections made by `bb8_redis` with the
/// default `AsyncConnectionConfig`), so any round trip longer than 500 ms failed as
/// `Unavailable(I/O error: timed out)` even under `timeout(5 s)` — and, being "unavailable", it
/// switched a limiter to its failure mode. Now neither has a response timeout of its own: an
/// 800 ms round trip succeeds under a 5 s store timeout, and a 300 ms store timeout still
/// fails the same round trip as `StoreError::Timeout`, on both kinds.
#[tokio::test]
async fn store_timeout_above_half_a_second_is_honoured() {
    let server = RedisServer::start();
    // A token bucket refilling one token an hour: no refill within the test, so the third call
    // leaves 7 whatever the time (a minute's fixed window, aligned to the epoch on Redis's real
    // clock, restarted at the top of each minute and broke the count of a run that crossed it).
    let policy = Policy::token_bucket(10, Rate::new(1, Duration::from_secs(3600))).unwrap();
    for (kind, pool) in [("multiplexed", None), ("pool", Some(2))] {
        let build = |timeout| {
            let builder = RedisStore::builder(server.url()).timeout(timeout);
            match pool {
                Some(size) => builder.pool(size),
                None => builder.multiplexed(),
            }
            .build()
        };
        let patient = build(Duration::from_secs(5)).await.unwrap();
        let hasty = build(Duration::from_millis(300)).await.unwrap();
        let slow = Key::new("slow", [kind]).unwrap();
        let quick = Key::new("quick", [kind]).unwrap();
        // Every connection the stores will use is up before the server stalls.
        for _ in 0..2 {
            patient.acquire(&slow, &policy, 1).await.unwrap();
            hasty.acquire(&quick, &policy, 1).await.unwrap();
        }
        // Another client holds the server for 800 ms. It says when it is connected (the
        // slow part on a loaded host: a fixed sleep of 50 ms from the spawn was once too
        // short, and the calls ran before the stall), and the test then polls until the
        // server is inside the stall ([`busy`]: a fixed 100 ms before), with more than
        // 600 ms of it left: more than the hasty store's 300 ms.
        let client = server.client();
        let (connected, ready) = tokio::sync::oneshot::channel();
        let stall = std::thread::spawn(move || {
            let mut conn = client.get_connection().unwrap();
            connected.send(()).unwrap();
            redis::cmd("EVAL")
                .arg(STALL_800_MS)
                .arg(0)
                .exec(&mut conn)
                .unwrap();
        });
        ready.await.unwrap();
        common::until(
            Duration::from_secs(5),
            &format!("{kind}: the server is inside the stall script"),
            || busy(server.port()),
        );
        let (got, cut) = tokio::join!(
            patient.acquire(&slow, &policy, 1),
            hasty.acquire(&quick, &policy, 1),
        );
        stall.join().unwrap();
        let d = got.unwrap_or_else(|e| {
            panic!("{kind}: an 800 ms round trip is within the 5 s store timeout: {e}")
        });
        assert_eq!(d.remaining, 7, "{kind}");
        assert!(
            matches!(cut, Err(StoreError::Timeout(t)) if t == Duration::from_millis(300)),
            "{kind}: the store's own deadline still bounds the call: {cut:?}"
        );
    }
}

/// Whether the server on `port` is busy (inside a script): a `PING` on a fresh connection gets
/// no answer within [`BUSY_AFTER`]. (A raw socket: redis-rs's connection setup would wait on
/// the busy server itself.)
fn busy(port: u16) -> bool {
    use std::io::{Read as _, Write as _};
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(BUSY_AFTER)).unwrap();
    conn.write_all(b"PING\r\n").unwrap();
    let mut pong = [0; 7];
    conn.read_exact(&mut pong).is_err()
}

/// How long [`busy`] waits for a `PONG`: far more than an idle server's answer takes, far less
/// than [`STALL_800_MS`] lasts.
const BUSY_AFTER: Duration = Duration::from_millis(150);

/// Busy-waits 800 ms of Redis time inside the server.
const STALL_800_MS: &str = "local s = redis.call('TIME') \
    while true do \
      local t = redis.call('TIME') \
      if (t[1] - s[1]) * 1000000 + (t[2] - s[2]) > 800000 then return 1 end \
    end";
