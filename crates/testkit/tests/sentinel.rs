//! Pins the Sentinel topology against real processes: it starts replicated and discovered,
//! and killing the primary promotes the replica within a few seconds, which then takes writes.

use std::time::{Duration, Instant};

use redis::Commands;
use tollgate_testkit::sentinel::SentinelCluster;

const FAILOVER_TIMEOUT: Duration = Duration::from_secs(20);

fn connect(host: &str, port: u16) -> redis::Connection {
    let client = redis::Client::open(format!("redis://{host}:{port}")).expect("client");
    let conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("read timeout");
    conn
}

fn role(conn: &mut redis::Connection) -> String {
    let reply: Vec<redis::Value> = redis::cmd("ROLE").query(conn).expect("ROLE");
    redis::from_redis_value(reply[0].clone()).expect("role name")
}

#[test]
fn starts_with_a_synced_replica_and_sentinels_agreeing_on_the_primary() {
    let topology = SentinelCluster::start("tollgate");
    assert_eq!(topology.master_name(), "tollgate");
    assert_eq!(topology.sentinel_urls().len(), 3);
    assert_eq!(
        topology.current_primary(),
        ("127.0.0.1".to_owned(), topology.primary_port())
    );
    assert_eq!(topology.current_primary_index(), 0);

    let mut primary = connect("127.0.0.1", topology.primary_port());
    let _: () = primary.set("replicated", 42).expect("SET on the primary");
    topology.wait_replica_synced(Duration::from_secs(5));
    let mut replica = connect("127.0.0.1", topology.data_servers()[1].port());
    assert_eq!(role(&mut replica), "slave");
    let value: i64 = replica.get("replicated").expect("GET on the replica");
    assert_eq!(value, 42);
}

#[test]
fn killing_the_primary_promotes_the_replica_which_accepts_writes() {
    let mut topology = SentinelCluster::start("tollgate");
    let mut primary = connect("127.0.0.1", topology.primary_port());
    let _: () = primary.set("before", "kept").expect("SET before the kill");
    topology.wait_replica_synced(Duration::from_secs(5));
    drop(primary);

    let killed = topology.kill_primary();
    assert_eq!(killed, 0);
    let failover = topology.wait_for_failover(FAILOVER_TIMEOUT);
    println!("sentinel failover: primary killed -> replica promoted and reported in {failover:?}");

    let (host, port) = topology.current_primary();
    assert_eq!(port, topology.data_servers()[1].port());
    assert_eq!(topology.current_primary_index(), 1);
    let mut promoted = connect(&host, port);
    assert_eq!(role(&mut promoted), "master");
    let kept: String = promoted.get("before").expect("GET after failover");
    assert_eq!(
        kept, "kept",
        "a write the replica had acknowledged survives"
    );
    let _: () = promoted
        .set("after", 1)
        .expect("SET on the promoted replica");

    // The redis crate's Sentinel client finds the new primary on its own.
    let mut via_sentinel = redis::sentinel::SentinelClient::build(
        topology.sentinel_urls(),
        topology.master_name().to_owned(),
        None,
        redis::sentinel::SentinelServerType::Master,
    )
    .expect("sentinel client");
    let started = Instant::now();
    let mut conn = via_sentinel.get_connection().expect("connect via sentinel");
    let after: i64 = conn.get("after").expect("GET via sentinel");
    assert_eq!(after, 1);
    assert!(started.elapsed() < Duration::from_secs(5));

    // The old primary comes back empty and catches up as a replica of the new one.
    topology.restart_as_replica(0, Duration::from_secs(10));
    let mut rejoined = connect("127.0.0.1", topology.primary_port());
    assert_eq!(role(&mut rejoined), "slave");
    let after: i64 = rejoined.get("after").expect("GET on the rejoined replica");
    assert_eq!(after, 1);
}
