//! Pins the fault proxy against a real redis-server: it forwards, delays by at least the set
//! latency, cuts open connections, hangs reads while blackholed and refuses connects.

use std::io::ErrorKind;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use redis::Commands;
use tollgate_testkit::proxy::FaultProxy;
use tollgate_testkit::server::RedisServer;

fn connect(proxy: &FaultProxy) -> redis::Connection {
    let conn = redis::Client::open(proxy.url())
        .expect("client")
        .get_connection_with_timeout(Duration::from_secs(2))
        .expect("connect through the proxy");
    conn.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("read timeout");
    conn
}

fn ping(conn: &mut redis::Connection) -> redis::RedisResult<String> {
    redis::cmd("PING").query(conn)
}

#[test]
fn forwards_commands_and_counts_traffic() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    assert_eq!(proxy.target().port(), server.port());
    let mut conn = connect(&proxy);
    let _: () = conn.set("through", "proxy").expect("SET through the proxy");
    let direct: String = server
        .client()
        .get_connection()
        .expect("direct connection")
        .get("through")
        .expect("GET directly");
    assert_eq!(direct, "proxy");

    let stats = proxy.stats();
    assert_eq!((stats.accepted, stats.active), (1, 1));
    assert!(stats.bytes_to_target > 0 && stats.bytes_from_target > 0);
    drop(conn);
    let deadline = Instant::now() + Duration::from_secs(2);
    while proxy.stats().active > 0 {
        assert!(Instant::now() < deadline, "closed connection still counted");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn latency_delays_each_direction() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut conn = connect(&proxy);
    ping(&mut conn).expect("warm-up PING");

    let latency = Duration::from_millis(60);
    proxy.set_latency(latency);
    assert_eq!(proxy.latency(), latency);
    let started = Instant::now();
    ping(&mut conn).expect("PING with latency");
    let round_trip = started.elapsed();
    println!("proxy: PING round trip with {latency:?} per direction took {round_trip:?}");
    assert!(
        round_trip >= latency * 2,
        "round trip {round_trip:?} < 2 x {latency:?}"
    );

    proxy.set_latency(Duration::ZERO);
    let started = Instant::now();
    ping(&mut conn).expect("PING without latency");
    assert!(started.elapsed() < latency, "latency still applied");
}

#[test]
fn cut_all_breaks_open_connections_but_accepts_new_ones() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut conn = connect(&proxy);
    ping(&mut conn).expect("PING before the cut");

    proxy.cut_all();
    assert_eq!(proxy.stats().active, 0);
    let err = ping(&mut conn).expect_err("the cut connection fails");
    assert!(
        err.is_io_error() || err.is_connection_dropped() || err.is_unrecoverable_error(),
        "unexpected error after cut: {err:?}"
    );
    let mut fresh = connect(&proxy);
    assert_eq!(ping(&mut fresh).expect("PING on a new connection"), "PONG");
}

#[test]
fn blackhole_makes_reads_time_out_until_lifted() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut conn = connect(&proxy);
    ping(&mut conn).expect("PING before the blackhole");

    proxy.blackhole(true);
    conn.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("read timeout");
    let started = Instant::now();
    let err = ping(&mut conn).expect_err("a blackholed PING gets no answer");
    assert!(err.is_timeout(), "expected a timeout, got {err:?}");
    assert!(started.elapsed() >= Duration::from_millis(200));

    // New connections are accepted at TCP level, but the client's handshake hangs too.
    let _accepted = TcpStream::connect(proxy.addr()).expect("TCP connect while blackholed");
    let started = Instant::now();
    let handshake = redis::Client::open(proxy.url())
        .expect("client")
        .get_connection_with_timeout(Duration::from_millis(200));
    assert!(
        handshake.is_err(),
        "a blackholed handshake must not complete"
    );
    assert!(started.elapsed() >= Duration::from_millis(200));

    proxy.blackhole(false);
    let mut fresh = connect(&proxy);
    assert_eq!(ping(&mut fresh).expect("PING after the blackhole"), "PONG");
}

#[test]
fn refuse_makes_connects_fail_until_lifted() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let mut open = connect(&proxy);

    proxy.set_refuse(true);
    let err = TcpStream::connect(proxy.addr()).expect_err("connect must be refused");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused);
    let Err(redis_err) = redis::Client::open(proxy.url())
        .expect("client")
        .get_connection_with_timeout(Duration::from_secs(1))
    else {
        panic!("redis connect must fail while refusing");
    };
    assert!(redis_err.is_connection_refusal(), "got {redis_err:?}");
    // Connections opened before stay up.
    assert_eq!(
        ping(&mut open).expect("PING on the open connection"),
        "PONG"
    );

    proxy.set_refuse(false);
    let mut fresh = connect(&proxy);
    assert_eq!(ping(&mut fresh).expect("PING after refusing"), "PONG");
}

#[tokio::test]
async fn controls_work_from_an_async_test() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let client = redis::Client::open(proxy.url()).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("async connection");
    let pong: String = redis::cmd("PING")
        .query_async(&mut conn)
        .await
        .expect("PING");
    assert_eq!(pong, "PONG");
    proxy.set_latency(Duration::from_millis(30));
    let started = Instant::now();
    let _: String = redis::cmd("PING")
        .query_async(&mut conn)
        .await
        .expect("PING with latency");
    assert!(started.elapsed() >= Duration::from_millis(60));
    proxy.cut_all();
    let result: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
    assert!(result.is_err(), "the cut multiplexed connection fails");
}
