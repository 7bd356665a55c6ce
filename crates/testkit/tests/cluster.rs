//! Pins the Cluster harness against real processes: the cluster forms and spreads slots over
//! its primaries, `slot_of` agrees with `CLUSTER KEYSLOT`, and a live slot migration moves
//! keys, answers `ASK` while half done, and stays invisible to a cluster client.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use redis::{Commands, ErrorKind, ServerErrorKind};
use tollgate_testkit::cluster::RedisCluster;
use tollgate_testkit::wait::holds_within;

fn connect(cluster: &RedisCluster, index: usize) -> redis::Connection {
    let conn = cluster.nodes()[index]
        .client()
        .get_connection_with_timeout(Duration::from_secs(2))
        .expect("connect to a node");
    conn.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("read timeout");
    conn
}

/// `-ASK` replies node `index` has sent (Redis 7 counts redirections in `INFO errorstats`).
fn ask_replies(cluster: &RedisCluster, index: usize) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("errorstats")
        .query(&mut connect(cluster, index))
        .expect("INFO errorstats");
    stats
        .lines()
        .find_map(|line| line.strip_prefix("errorstat_ASK:count="))
        .map_or(0, |count| count.trim().parse().expect("a count"))
}

fn cluster_client(cluster: &RedisCluster) -> redis::cluster::ClusterConnection {
    redis::cluster::ClusterClient::new(cluster.urls())
        .expect("cluster client")
        .get_connection()
        .expect("cluster connection")
}

#[test]
fn keys_in_different_slots_land_on_different_nodes() {
    let cluster = RedisCluster::start(3);
    assert_eq!(cluster.nodes().len(), 3);
    let mut client = cluster_client(&cluster);

    let mut owners = HashSet::new();
    for n in 0..30 {
        let key = format!("bucket:{n}");
        let slot = RedisCluster::slot_of(&key);
        let keyslot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(&key)
            .query(&mut connect(&cluster, 0))
            .expect("CLUSTER KEYSLOT");
        assert_eq!(slot, keyslot, "slot_of({key:?}) disagrees with Redis");

        let _: () = client.set(&key, n).expect("SET via the cluster client");
        let owner = cluster.node_for_slot(slot);
        owners.insert(owner);
        // The owner serves the key directly; another node redirects with MOVED.
        let direct: i64 = connect(&cluster, owner)
            .get(&key)
            .expect("GET on the owner");
        assert_eq!(direct, n);
        let other = (owner + 1) % 3;
        let err = connect(&cluster, other)
            .get::<_, i64>(&key)
            .expect_err("a non-owner must redirect");
        assert_eq!(err.kind(), ErrorKind::Server(ServerErrorKind::Moved));
    }
    assert_eq!(owners.len(), 3, "30 keys should touch every primary");
}

#[test]
fn migrate_slot_moves_keys_and_opens_an_ask_window() {
    let cluster = RedisCluster::start(3);
    let mut client = cluster_client(&cluster);
    let slot = RedisCluster::slot_of("bucket:alice");
    let tag = RedisCluster::hash_tag_for_slot(slot);
    let keys: Vec<String> = (0..250).map(|n| format!("{{{tag}}}:{n}")).collect();
    for (n, key) in keys.iter().enumerate() {
        let _: () = client.set(key, n).expect("SET before the migration");
    }
    let from = cluster.node_for_slot(slot);
    let to = (from + 1) % 3;

    let mut migration = cluster.begin_slot_migration(slot, from, to, 100);
    assert_eq!(migration.keys_moved(), 100);
    // Which keys moved is up to GETKEYSINSLOT: find one that is gone from the source.
    let mut source = connect(&cluster, from);
    let remaining: HashSet<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(1000)
        .query(&mut source)
        .expect("GETKEYSINSLOT on the source");
    assert_eq!(remaining.len(), 150);
    let moved = keys
        .iter()
        .find(|key| !remaining.contains(*key))
        .expect("100 keys left the source");
    let kept = keys
        .iter()
        .position(|key| remaining.contains(key))
        .expect("150 keys stay");
    // The source still serves keys it has; only the moved ones are redirected.
    let value: usize = source.get(&keys[kept]).expect("GET of a key not yet moved");
    assert_eq!(value, kept);
    let ask = source
        .get::<_, i64>(moved)
        .expect_err("a moved key must be redirected");
    assert_eq!(ask.kind(), ErrorKind::Server(ServerErrorKind::Ask));
    assert_eq!(
        ask.redirect_node(),
        Some((
            format!("127.0.0.1:{}", cluster.nodes()[to].port()).as_str(),
            slot
        ))
    );
    // The target refuses it without ASKING: the slot is not its own yet.
    let moved_err = connect(&cluster, to)
        .get::<_, i64>(moved)
        .expect_err("the target redirects without ASKING");
    assert_eq!(moved_err.kind(), ErrorKind::Server(ServerErrorKind::Moved));
    // A cluster client follows ASK for moved keys and reads the rest from the source.
    for (n, key) in keys.iter().enumerate() {
        let value: usize = client.get(key).expect("GET during the migration");
        assert_eq!(value, n);
    }
    assert_eq!(migration.move_keys(50), 50);

    let report = migration.finish();
    println!("slot migration: {report:?}");
    assert_eq!(report.keys_moved, 250);
    assert_eq!((report.from, report.to), (from, to));
    assert_eq!(cluster.node_for_slot(slot), to);
    let direct: usize = connect(&cluster, to)
        .get(&keys[0])
        .expect("GET on the new owner");
    assert_eq!(direct, 0);
    let gone = connect(&cluster, from)
        .get::<_, i64>(&keys[0])
        .expect_err("the old owner redirects");
    assert_eq!(gone.kind(), ErrorKind::Server(ServerErrorKind::Moved));
    for (n, key) in keys.iter().enumerate() {
        let value: usize = client.get(key).expect("GET after the migration");
        assert_eq!(value, n);
    }

    // And back in one call.
    let back = cluster.migrate_slot(slot, to, from);
    println!("slot migration back: {back:?}");
    assert_eq!(back.keys_moved, 250);
    assert_eq!(cluster.node_for_slot(slot), from);
    let value: usize = client.get(&keys[249]).expect("GET after moving back");
    assert_eq!(value, 249);
}

#[test]
fn slot_migration_under_load_loses_no_writes_for_a_cluster_client() {
    let cluster = RedisCluster::start(3);
    let slot = RedisCluster::slot_of("bucket:bob");
    let tag = RedisCluster::hash_tag_for_slot(slot);
    let keys: Vec<String> = (0..20).map(|n| format!("{{{tag}}}:{n}")).collect();
    let from = cluster.node_for_slot(slot);
    let to = (from + 2) % 3;

    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (urls, keys, stop) = (cluster.urls(), keys.clone(), Arc::clone(&stop));
        thread::spawn(move || {
            let mut client = redis::cluster::ClusterClient::new(urls)
                .expect("cluster client")
                .get_connection()
                .expect("cluster connection");
            let (mut ok, mut errors) = (0_u64, Vec::new());
            // Bounded: the test sets `stop` within a few seconds; 200k is a backstop.
            for n in 0..200_000 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                match client.incr::<_, _, i64>(&keys[n % keys.len()], 1) {
                    Ok(_) => ok += 1,
                    Err(err) => errors.push(err.to_string()),
                }
            }
            (ok, errors)
        })
    };
    // The load has written every key before the migration starts (polled, bounded; a fixed
    // 100 ms before).
    let mut source = connect(&cluster, from);
    let written = |source: &mut redis::Connection| -> usize {
        redis::cmd("DBSIZE").query(source).expect("DBSIZE")
    };
    assert!(
        holds_within(Duration::from_secs(5), || written(&mut source)
            >= keys.len()),
        "the load wrote {} of {} keys within 5 s",
        written(&mut source),
        keys.len()
    );
    let migration = cluster.begin_slot_migration(slot, from, to, 5);
    // Hold the ASK window until the load has been redirected (bounded).
    let deadline = Instant::now() + Duration::from_secs(5);
    while ask_replies(&cluster, from) < 50 {
        assert!(
            Instant::now() < deadline,
            "the load never met the ASK window"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let report = migration.finish();
    // The load goes on against the slot's new owner (polled until it has counted 50 more
    // INCRs there, bounded; a fixed 100 ms before).
    let mut target = connect(&cluster, to);
    let counted = |conn: &mut redis::Connection| -> i64 {
        keys.iter()
            .map(|key| conn.get::<_, Option<i64>>(key).expect("GET").unwrap_or(0))
            .sum()
    };
    let at_finish = counted(&mut target);
    assert!(
        holds_within(Duration::from_secs(5), || counted(&mut target)
            >= at_finish + 50),
        "the load made no 50 INCRs on the new owner within 5 s of the migration"
    );
    stop.store(true, Ordering::SeqCst);
    let (ok, errors) = load.join().expect("load thread");

    println!(
        "slot migration under load: {report:?}; {ok} INCRs, {} ASK replies, {} errors",
        ask_replies(&cluster, from),
        errors.len()
    );
    assert!(
        errors.is_empty(),
        "errors surfaced to the client: {errors:?}"
    );
    let total: i64 = keys
        .iter()
        .map(|key| target.get::<_, Option<i64>>(key).expect("GET").unwrap_or(0))
        .sum();
    assert_eq!(
        total,
        i64::try_from(ok).unwrap(),
        "every acknowledged INCR is counted"
    );
}
