//! What `tollgate load` measures, checked against the server's own record of the run: the
//! rate's elapsed time against the span between the first and the last `EVALSHA` the server
//! saw (MONITOR), and the comparison's ceiling against the load run's own workload.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use tollgate_testkit::server::RedisServer;

/// The JSON a successful `tollgate load ARGS` printed (its stderr shown if it failed).
fn load_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .arg("load")
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the tollgate binary runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

/// The server's timestamps (seconds) of every `EVALSHA` it ran while `run` ran, read by a
/// MONITOR connection (at most 60 s of reading after `run` returns, stopped by a flag).
fn evalsha_times<T>(redis: &RedisServer, run: impl FnOnce() -> T) -> (T, Vec<f64>) {
    let (out, commands) = monitored(redis, run);
    let times = commands
        .into_iter()
        .filter(|c| c.name == "EVALSHA")
        .map(|c| c.at)
        .collect();
    (out, times)
}

/// One command as MONITOR showed it.
struct Seen {
    /// The server's timestamp, seconds.
    at: f64,
    /// The client's address (`ip:port`): one per connection.
    client: String,
    /// The command's name, upper case.
    name: String,
}

/// Every command the server ran while `run` ran, read by a MONITOR connection (at most 600 s
/// of reading, stopped by a flag once `run` returned).
fn monitored<T>(redis: &RedisServer, run: impl FnOnce() -> T) -> (T, Vec<Seen>) {
    let mut stream = TcpStream::connect(("127.0.0.1", redis.port())).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    stream.write_all(b"MONITOR\r\n").unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut ok = String::new();
    reader.read_line(&mut ok).expect("MONITOR's reply");
    assert!(ok.starts_with("+OK"), "MONITOR: {ok}");
    let stop = Arc::new(AtomicBool::new(false));
    let reading = {
        let stop = stop.clone();
        thread::spawn(move || {
            let limit = Instant::now() + Duration::from_secs(600);
            let (mut seen, mut line) = (Vec::new(), Vec::new());
            while Instant::now() < limit {
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) => break,
                    Ok(_) if line.ends_with(b"\n") => {
                        // +1700000000.123456 [0 127.0.0.1:50000] "EVALSHA" "…" …
                        let text = String::from_utf8_lossy(&line);
                        let mut parts = text.trim_start_matches('+').splitn(4, ' ');
                        let at = parts.next().unwrap_or_default();
                        let _db = parts.next();
                        let client = parts.next().unwrap_or_default().trim_end_matches(']');
                        let name = parts.next().unwrap_or_default();
                        let name = name.split('"').nth(1).unwrap_or_default();
                        seen.push(Seen {
                            at: at.parse::<f64>().expect("a MONITOR timestamp"),
                            client: client.to_owned(),
                            name: name.to_ascii_uppercase(),
                        });
                        line.clear();
                    }
                    Err(_) if stop.load(Ordering::Relaxed) => break,
                    // a partial line (timed out inside it: kept), or a timeout: read on
                    Ok(_) | Err(_) => {}
                }
            }
            seen
        })
    };
    let out = run();
    // the monitor's last lines reach it after the run's last reply
    thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let seen = reading.join().expect("the monitor thread");
    (out, seen)
}

/// One run of 256 calls on 256 keys with `tasks` tasks, one runtime thread, one connection:
/// its summary and the span (seconds) between the server's first and last `EVALSHA`.
fn timed_run(redis: &RedisServer, tasks: &str) -> (serde_json::Value, f64) {
    let (s, times) = evalsha_times(redis, || {
        load_json(&[
            "--redis",
            &redis.url(),
            "--multiplexed",
            "--threads",
            "1",
            "--policy",
            "token-bucket:capacity=100,rate=50",
            "--tasks",
            tasks,
            "--requests",
            "256",
            "--keys",
            "256",
            "--json",
        ])
    });
    let decided = s["allowed"].as_u64().unwrap() + s["denied"].as_u64().unwrap();
    assert_eq!(decided, 256, "{s}");
    assert_eq!(times.len(), 256, "every decision one EVALSHA");
    let rate = s["decisions_per_sec"].as_f64().unwrap();
    let elapsed = s["elapsed_secs"].as_f64().unwrap();
    assert!((rate - 256.0 / elapsed).abs() <= rate * 1e-9, "{s}");
    (s, times.last().unwrap() - times.first().unwrap())
}

/// The rate's clock covers deciding, not the tool's own setup. Each task made its latency
/// histogram (~220 KB, written in full) once the clock ran, between the calls of the tasks
/// already deciding, and the histograms were merged before the clock stopped; so tasks that
/// decided nothing slowed the figure (before, 256 calls, one runtime thread, in this debug
/// build: 4 tasks 0.040 s, 4,096 tasks (4 of them deciding, 64 request numbers at a time)
/// 1.47 s "elapsed", 1.33 s between the server's first and last `EVALSHA`; in a release build
/// 4,096 tasks of one call each took 0.13 s more than the server's span of 0.99 s), and every
/// ratio to the ceiling, whose clock starts once its clients are connected, with it.
#[test]
fn the_rate_counts_the_time_spent_deciding() {
    let redis = RedisServer::start();
    let (few, few_span) = timed_run(&redis, "4");
    let (many, many_span) = timed_run(&redis, "4096");
    let e = |s: &serde_json::Value| s["elapsed_secs"].as_f64().unwrap();
    eprintln!(
        "4 tasks: {:.4} s (server {few_span:.4} s); 4,096 tasks: {:.4} s (server {many_span:.4} s)",
        e(&few),
        e(&many)
    );
    assert!(
        e(&many) <= 2.0 * e(&few) + 0.05,
        "4,092 tasks that decided nothing: {:.4} s for 256 calls, against {:.4} s with 4 tasks",
        e(&many),
        e(&few)
    );
    // the span misses the first request's way to the server and the last reply's way back
    for (s, span) in [(&few, few_span), (&many, many_span)] {
        assert!(
            e(s) <= span * 1.5 + 0.02,
            "elapsed {:.4} s for {span:.4} s between the server's first and last EVALSHA",
            e(s)
        );
    }
}

/// The comparison's ceiling runs the load run's workload: as many requests as the run made
/// (before: at least 10,000, so a run of 300 requests over 100 keys, each key visited 3
/// times, was compared with a ceiling of 10,000 requests visiting each key 100 times: its
/// sliding logs held 100 entries against the load's 3, and the ratio compared two workloads).
#[test]
fn the_ceiling_runs_as_many_requests_as_the_load_run() {
    let redis = RedisServer::start();
    let s = load_json(&[
        "--redis",
        &redis.url(),
        "--policy",
        "sliding-log:limit=100,window=1m",
        "--tasks",
        "4",
        "--requests",
        "300",
        "--keys",
        "100",
        "--compare-redis-benchmark",
        "--json",
    ]);
    assert_eq!(s["errors"], 0, "{s}");
    assert_eq!(s["requests"], 300, "{s}");
    let ceilings = s["redis_benchmark"].as_array().expect("the ceilings");
    assert_eq!(ceilings.len(), 2, "{s}");
    for c in ceilings {
        assert_eq!(c["requests"], 300, "the ceiling's -n: {c}");
    }
    // every key of every run (tollgate's and the two ceilings') visited as often: one log
    // length for all 300 keys
    let mut conn = redis.client().get_connection().unwrap();
    let names: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert_eq!(names.len(), 300, "100 keys per run: {names:?}");
    let mut sizes = std::collections::BTreeMap::<usize, usize>::new();
    for name in &names {
        let n: usize = redis::cmd("STRLEN").arg(name).query(&mut conn).unwrap();
        *sizes.entry(n).or_default() += 1;
    }
    assert_eq!(
        sizes.len(),
        1,
        "log lengths (bytes: keys) differ between the runs: {sizes:?}"
    );
}

/// The clients that sent commands in a `load` run with `args` (besides `--json`), as
/// `(connected before the first decision, connected during the run, deciding)`: a
/// connection's first command marks its connect (`HELLO` over RESP3, or whatever it sent).
fn connections_of(args: &[&str]) -> [std::collections::BTreeSet<String>; 3] {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut all = vec!["--redis", url.as_str()];
    all.extend_from_slice(args);
    all.push("--json");
    let (s, seen) = monitored(&redis, || load_json(&all));
    assert_eq!(s["errors"], 0, "{s}");
    let first = seen
        .iter()
        .position(|c| c.name == "EVALSHA")
        .expect("the run's decisions");
    let mut before = std::collections::BTreeSet::new();
    let mut during = std::collections::BTreeSet::new();
    // (the commands a script runs show as client `lua`)
    for (i, c) in seen.iter().enumerate().filter(|(_, c)| c.client != "lua") {
        if !before.contains(&c.client) && !during.contains(&c.client) {
            if i < first {
                before.insert(c.client.clone());
            } else {
                during.insert(c.client.clone());
            }
        }
    }
    let deciding: std::collections::BTreeSet<String> = seen
        .iter()
        .filter(|c| c.name == "EVALSHA")
        .map(|c| c.client.clone())
        .collect();
    eprintln!(
        "{args:?}: connections made before the first decision: {}, during the run: {}, deciding: {}",
        before.len(),
        during.len(),
        deciding.len()
    );
    [before, during, deciding]
}

const POOLED: [&str; 10] = [
    "--pool",
    "4",
    "--instances",
    "2",
    "--tasks",
    "32",
    "--requests",
    "4000",
    "--keys",
    "1000",
];

/// With `--connect-all`, every connection of a pool is made before the clock starts. The pool
/// connects on demand, when a call finds no connection idle, so connects fell inside the timed
/// run (before, with no way to make them first, two instances with `--pool 4`, 2 runtime
/// threads, 32 tasks each: 2 connections made before the first decision, the rest during it,
/// their connects timed as decisions; with one runtime thread a pool never made a second
/// connection, so `--pool 4` measured one).
#[test]
fn every_pooled_connection_is_made_before_the_first_decision() {
    let mut args = POOLED.to_vec();
    args.extend([
        "--connect-all",
        "--threads",
        "2",
        "--policy",
        "token-bucket:capacity=100,rate=50",
    ]);
    let [before, during, deciding] = connections_of(&args);
    assert!(
        during.is_empty(),
        "{} connection(s) made while the run was timed: {during:?}",
        during.len()
    );
    assert_eq!(
        before.len(),
        8,
        "2 instances x a pool of 4 connected before the first decision: {before:?}"
    );
    assert_eq!(
        deciding.len(),
        8,
        "every pooled connection decides: {deciding:?}"
    );
}

/// Without `--connect-all` the run measures the pool as a service gets it, connecting on
/// demand: on one runtime thread each instance's pool keeps the one connection it starts
/// with (a call always finds it idle again), as `--connect-all`'s help says.
#[test]
fn without_connect_all_a_pool_on_one_thread_keeps_one_connection() {
    let mut args = POOLED.to_vec();
    args.extend([
        "--threads",
        "1",
        "--policy",
        "token-bucket:capacity=100,rate=50",
    ]);
    let [_, during, deciding] = connections_of(&args);
    assert!(during.is_empty(), "connected during the run: {during:?}");
    assert_eq!(
        deciding.len(),
        2,
        "one connection per instance: {deciding:?}"
    );
}
