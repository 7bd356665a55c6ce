//! Pins the testkit's redis-server harness against a real server: the shimmed clock moves
//! `TIME`, `TIME` in scripts and key expiry; restart, kill, pause and script flush behave
//! as the fault tests downstream assume; nothing outlives a dropped server.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::{Commands, Connection};
use tollgate_testkit::clock::{ClockMode, ServerClock};
use tollgate_testkit::server::{RedisServer, redis_available};

/// 2023-11-14T22:13:20.123456Z, with a non-zero microsecond part to catch truncation.
const FROZEN_AT_MICROS: u64 = 1_700_000_000_123_456;
const HOUR: Duration = Duration::from_secs(3600);

fn connect(server: &RedisServer) -> Connection {
    let conn = server
        .client()
        .get_connection_with_timeout(Duration::from_secs(5))
        .expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("set read timeout");
    conn
}

fn redis_time_micros(conn: &mut Connection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(conn).expect("TIME");
    secs * 1_000_000 + micros
}

fn script_time_micros(conn: &mut Connection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("EVAL")
        .arg("return redis.call('TIME')")
        .arg(0)
        .query(conn)
        .expect("EVAL TIME");
    secs * 1_000_000 + micros
}

fn real_now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn clocked_server() -> RedisServer {
    RedisServer::builder().clock_control(true).start()
}

#[test]
fn redis_is_available_on_this_machine() {
    assert!(redis_available(), "install redis-server to run these tests");
}

#[test]
fn frozen_clock_pins_time_and_time_inside_scripts() {
    let server = clocked_server();
    let mut conn = connect(&server);
    server.clock().freeze_at_micros(FROZEN_AT_MICROS);

    assert_eq!(redis_time_micros(&mut conn), FROZEN_AT_MICROS);
    assert_eq!(redis_time_micros(&mut conn), FROZEN_AT_MICROS);
    assert_eq!(script_time_micros(&mut conn), FROZEN_AT_MICROS);
    assert_eq!(server.clock().now_micros(), FROZEN_AT_MICROS);

    server.clock().advance(HOUR);
    let hour_micros = HOUR.as_micros() as u64;
    assert_eq!(redis_time_micros(&mut conn), FROZEN_AT_MICROS + hour_micros);
    assert_eq!(
        script_time_micros(&mut conn),
        FROZEN_AT_MICROS + hour_micros
    );

    server.clock().rewind(HOUR);
    server.clock().rewind(HOUR);
    assert_eq!(redis_time_micros(&mut conn), FROZEN_AT_MICROS - hour_micros);
    assert_eq!(
        script_time_micros(&mut conn),
        FROZEN_AT_MICROS - hour_micros
    );
}

#[test]
fn redis_stays_healthy_under_a_frozen_clock() {
    let server = clocked_server();
    let mut conn = connect(&server);
    server.clock().freeze_at_micros(FROZEN_AT_MICROS);

    // The event loop runs on CLOCK_MONOTONIC: commands keep answering while the wall clock
    // stands still, across many event-loop iterations and serverCron runs.
    let deadline = Instant::now() + Duration::from_millis(300);
    let mut count: u64 = 0;
    while Instant::now() < deadline {
        let n: u64 = conn.incr("counter", 1).expect("INCR under a frozen clock");
        count += 1;
        assert_eq!(n, count);
    }
    let pong: String = redis::cmd("PING").query(&mut conn).expect("PING");
    assert_eq!(pong, "PONG");
    // A fresh connection is accepted too.
    let mut fresh = connect(&server);
    assert_eq!(redis_time_micros(&mut fresh), FROZEN_AT_MICROS);
}

#[test]
fn blocking_timeouts_wait_for_the_frozen_clock_to_move() {
    // Redis 7.0 measures blocking-command timeouts on the wall clock: under a frozen clock a
    // BLPOP timeout never elapses until the test advances the clock. Pinned so tests that
    // freeze the clock know not to rely on blocking timeouts.
    let server = clocked_server();
    server.clock().freeze_at_micros(FROZEN_AT_MICROS);
    let mut conn = connect(&server);
    let handle = {
        let client = server.client();
        std::thread::spawn(move || {
            let mut conn = client
                .get_connection_with_timeout(Duration::from_secs(5))
                .unwrap();
            conn.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            redis::cmd("BLPOP")
                .arg("nothing")
                .arg(0.05)
                .query::<Option<(String, String)>>(&mut conn)
        })
    };
    let blocked_clients = |conn: &mut Connection| -> String {
        let info: String = redis::cmd("INFO").arg("clients").query(conn).unwrap();
        info.lines()
            .find_map(|line| line.strip_prefix("blocked_clients:"))
            .unwrap()
            .trim()
            .to_owned()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while blocked_clients(&mut conn) != "1" {
        assert!(Instant::now() < deadline, "BLPOP never blocked");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Far past the 50 ms timeout in real time, the client is still blocked.
    let watch_until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < watch_until {
        assert_eq!(
            blocked_clients(&mut conn),
            "1",
            "BLPOP timed out under a frozen clock"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!handle.is_finished());

    server.clock().advance(Duration::from_secs(1));
    assert_eq!(handle.join().unwrap().expect("BLPOP times out"), None);
}

#[test]
fn key_expiry_follows_the_moved_clock_and_rewinding_does_not_resurrect() {
    let server = clocked_server();
    let mut conn = connect(&server);
    server.clock().freeze_at_micros(FROZEN_AT_MICROS);

    redis::cmd("SET")
        .arg("k")
        .arg("v")
        .arg("PX")
        .arg(60_000)
        .exec(&mut conn)
        .unwrap();
    let pttl: i64 = conn.pttl("k").unwrap();
    assert_eq!(pttl, 60_000, "no time passes under a frozen clock");

    server.clock().advance(Duration::from_secs(59));
    let v: Option<String> = conn.get("k").unwrap();
    assert_eq!(v.as_deref(), Some("v"), "alive 1 s before expiry");
    assert_eq!(conn.pttl::<_, i64>("k").unwrap(), 1_000);

    server.clock().advance(Duration::from_secs(2));
    let v: Option<String> = conn.get("k").unwrap();
    assert_eq!(
        v, None,
        "expired 1 s after its deadline (lazy expiry on access)"
    );
    assert_eq!(conn.exists::<_, u64>("k").unwrap(), 0);
    let dbsize: u64 = redis::cmd("DBSIZE").query(&mut conn).unwrap();
    assert_eq!(dbsize, 0);

    server.clock().rewind(Duration::from_secs(61));
    let v: Option<String> = conn.get("k").unwrap();
    assert_eq!(
        v, None,
        "an expired key stays deleted when the clock steps back"
    );
}

#[test]
fn offset_clock_runs_at_real_time_plus_the_offset() {
    let server = clocked_server();
    let mut conn = connect(&server);
    let tolerance = 5_000_000; // 5 s: generous for a loaded 2-core machine

    server.clock().set_offset(HOUR.as_nanos() as i64);
    let ahead = redis_time_micros(&mut conn);
    let expected = real_now_micros() + HOUR.as_micros() as u64;
    assert!(
        ahead.abs_diff(expected) < tolerance,
        "{ahead} vs {expected}"
    );
    assert!(script_time_micros(&mut conn).abs_diff(expected) < tolerance);
    assert!(server.clock().now_micros().abs_diff(ahead) < tolerance);

    server.clock().rewind(HOUR * 3);
    assert_eq!(
        server.clock().mode(),
        ClockMode::Offset {
            nanos: -2 * HOUR.as_nanos() as i64
        }
    );
    let behind = redis_time_micros(&mut conn);
    let expected = real_now_micros() - 2 * HOUR.as_micros() as u64;
    assert!(
        behind.abs_diff(expected) < tolerance,
        "{behind} vs {expected}"
    );

    server.clock().use_real_time();
    let real = redis_time_micros(&mut conn);
    assert!(real.abs_diff(real_now_micros()) < tolerance);
}

#[test]
fn servers_without_clock_control_run_on_real_time() {
    let server = RedisServer::start();
    assert!(server.try_clock().is_none());
    let mut conn = connect(&server);
    assert!(redis_time_micros(&mut conn).abs_diff(real_now_micros()) < 5_000_000);
}

#[test]
fn servers_sharing_a_clock_move_together() {
    let clock = ServerClock::new();
    let a = RedisServer::builder().clock(clock.clone()).start();
    let b = RedisServer::builder().clock(clock.clone()).start();
    clock.freeze_at_micros(FROZEN_AT_MICROS);
    assert_eq!(redis_time_micros(&mut connect(&a)), FROZEN_AT_MICROS);
    assert_eq!(redis_time_micros(&mut connect(&b)), FROZEN_AT_MICROS);
}

#[test]
fn restart_keeps_the_port_and_the_clock_and_loses_the_data() {
    let mut server = clocked_server();
    let port = server.port();
    let url = server.url();
    server.clock().freeze_at_micros(FROZEN_AT_MICROS);
    let mut conn = connect(&server);
    conn.set::<_, _, ()>("k", "v").unwrap();
    let old_pid = server.pid().unwrap();

    server.restart();

    assert_eq!(server.port(), port);
    assert_eq!(server.url(), url);
    assert_ne!(server.pid().unwrap(), old_pid);
    assert!(!process_exists(old_pid));
    let mut conn = connect(&server);
    assert_eq!(conn.get::<_, Option<String>>("k").unwrap(), None);
    assert_eq!(redis_time_micros(&mut conn), FROZEN_AT_MICROS);
}

#[test]
fn killed_server_refuses_connections_until_restarted() {
    let mut server = RedisServer::start();
    let mut conn = connect(&server);
    conn.set::<_, _, ()>("k", "v").unwrap();
    let pid = server.pid().unwrap();

    server.kill();
    assert!(!server.is_running());
    assert!(!process_exists(pid));
    let refused = server
        .client()
        .get_connection_with_timeout(Duration::from_secs(1));
    assert!(
        refused
            .as_ref()
            .is_err_and(redis::RedisError::is_connection_refusal),
        "{:?}",
        refused.map(|_| ())
    );

    server.restart();
    assert!(server.is_running());
    let mut conn = connect(&server);
    assert_eq!(conn.get::<_, Option<String>>("k").unwrap(), None);
}

#[test]
fn stop_is_graceful_and_restart_follows() {
    let mut server = RedisServer::start();
    server.stop();
    assert!(!server.is_running());
    assert!(server.pid().is_none());
    assert!(
        server.log_contents().contains("ready to exit"),
        "{}",
        server.log_contents()
    );
    server.restart();
    let pong: String = redis::cmd("PING").query(&mut connect(&server)).unwrap();
    assert_eq!(pong, "PONG");
}

#[test]
fn paused_server_times_out_and_answers_after_resume() {
    let mut server = RedisServer::start();
    let mut conn = connect(&server);
    conn.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();

    server.pause();
    assert!(server.is_paused());
    assert!(server.is_running());
    let timed_out: redis::RedisResult<String> = redis::cmd("PING").query(&mut conn);
    assert!(
        timed_out.as_ref().is_err_and(redis::RedisError::is_timeout),
        "{timed_out:?}"
    );

    server.resume();
    assert!(!server.is_paused());
    let pong: String = redis::cmd("PING").query(&mut connect(&server)).unwrap();
    assert_eq!(pong, "PONG");
}

#[test]
fn script_flush_makes_evalsha_report_noscript() {
    let server = RedisServer::start();
    let mut conn = connect(&server);
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg("return 42")
        .query(&mut conn)
        .unwrap();
    let answer: i64 = redis::cmd("EVALSHA")
        .arg(&sha)
        .arg(0)
        .query(&mut conn)
        .unwrap();
    assert_eq!(answer, 42);

    server.script_flush();

    let err = redis::cmd("EVALSHA")
        .arg(&sha)
        .arg(0)
        .query::<i64>(&mut conn)
        .unwrap_err();
    assert_eq!(err.code(), Some("NOSCRIPT"), "{err:?}");
}

#[test]
fn dropping_a_server_ends_the_process_and_removes_its_dir() {
    let server = clocked_server();
    let pid = server.pid().unwrap();
    let dir = server.dir().to_path_buf();
    let clock_file = server.clock().control_file().to_path_buf();
    server.clock().freeze_at_micros(FROZEN_AT_MICROS);
    assert!(process_exists(pid) && dir.exists() && clock_file.exists());

    drop(server);

    assert!(!process_exists(pid));
    assert!(!dir.exists());
    assert!(!clock_file.exists());
}

#[test]
fn dropping_a_paused_server_ends_the_process() {
    let mut server = RedisServer::start();
    let pid = server.pid().unwrap();
    server.pause();
    drop(server);
    assert!(!process_exists(pid));
}

#[test]
fn a_panicking_test_still_ends_its_server() {
    let (tx, rx) = std::sync::mpsc::channel();
    let outcome = std::thread::spawn(move || {
        let mut server = RedisServer::start();
        server.pause();
        tx.send((server.pid().unwrap(), server.dir().to_path_buf()))
            .unwrap();
        panic!("simulated test failure");
    })
    .join();
    assert!(outcome.is_err());
    let (pid, dir) = rx.recv().unwrap();
    assert!(!process_exists(pid));
    assert!(!dir.exists());
}

#[tokio::test]
async fn async_connections_see_the_frozen_clock() {
    let server = clocked_server();
    server.clock().freeze_at_micros(FROZEN_AT_MICROS);
    let mut conn = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    assert_eq!(secs * 1_000_000 + micros, FROZEN_AT_MICROS);
}

#[test]
fn server_and_clock_handles_are_send_and_sync() {
    fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<RedisServer>();
    is_send_sync::<ServerClock>();
}
