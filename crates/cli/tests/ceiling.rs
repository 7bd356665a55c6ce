//! `tollgate ceiling` as a user runs it: the built binary against a real redis-server. It must
//! send exactly the requests asked for, on random keys of the given shape, with the given
//! arguments, read every reply (nested arrays included) and report requests/s.

use std::process::Command;

use std::time::Duration;

use tollgate_testkit::proxy::FaultProxy;
use tollgate_testkit::server::RedisServer;

fn ceiling(server: &RedisServer, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["ceiling", "--redis", &server.url()])
        .args(args)
        .output()
        .expect("the tollgate binary runs")
}

/// `out`, which must be a success.
fn succeeded(out: std::process::Output) -> std::process::Output {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn a_script_file_runs_with_its_arguments_on_every_request() {
    let server = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("count.lua");
    // adds ARGV[1] to one counter per key and to a total; replies a nested array
    std::fs::write(
        &script,
        "redis.call('INCRBY', KEYS[1], ARGV[1]) \
         redis.call('INCRBY', 'total', ARGV[2]) \
         return {1, {'a', false}, 'b'}",
    )
    .unwrap();
    let out = succeeded(ceiling(
        &server,
        &[
            "--script",
            script.to_str().unwrap(),
            "--arg",
            "3",
            "--arg",
            "1",
            "--clients",
            "4",
            "--pipeline",
            "7",
            "--requests",
            "1001",
            "--keys",
            "50",
            "--prefix",
            "t:",
            "--json",
        ],
    ));
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(s["requests"], 1001);
    assert!(s["requests_per_sec"].as_f64().unwrap() > 0.0, "{s}");
    let mut conn = server.client().get_connection().unwrap();
    let total: u64 = redis::cmd("GET").arg("total").query(&mut conn).unwrap();
    assert_eq!(total, 1001);
    let keys: Vec<String> = redis::cmd("KEYS").arg("t:*").query(&mut conn).unwrap();
    assert!(
        keys.len() > 1 && keys.len() <= 50,
        "random keys of 50: {keys:?}"
    );
    let mut sum = 0;
    for k in &keys {
        assert!(k.starts_with("t:{load:k") && k.ends_with('}'), "{k}");
        let n: u64 = redis::cmd("GET").arg(k).query(&mut conn).unwrap();
        sum += n;
    }
    assert_eq!(sum, 3 * 1001);
}

#[test]
fn tollgate_scripts_run_by_policy_and_errors_are_reported() {
    let server = RedisServer::start();
    let out = succeeded(ceiling(
        &server,
        &[
            "--policy",
            "token-bucket:capacity=10,rate=2",
            "--requests",
            "500",
            "--clients",
            "2",
        ],
    ));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("requests/s"), "{text}");
    let mut conn = server.client().get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("tollgate:{load:k*}")
        .query(&mut conn)
        .unwrap();
    assert!(!keys.is_empty());

    // a script that fails is an error, not a rate
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("fail.lua");
    std::fs::write(&script, "return redis.error_reply('ERR nope')").unwrap();
    let out = ceiling(
        &server,
        &["--script", script.to_str().unwrap(), "--requests", "10"],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope"));
    // a cost above the policy's capacity is refused before anything runs
    let out = ceiling(
        &server,
        &[
            "--policy",
            "token-bucket:capacity=10,rate=2",
            "--cost",
            "11",
        ],
    );
    assert!(!out.status.success());
    // zero clients, pipeline, requests or keys would measure nothing (or something else than
    // the report says): refused by the argument parser
    for flag in ["--clients", "--pipeline", "--requests", "--keys"] {
        let out = ceiling(
            &server,
            &["--policy", "token-bucket:capacity=10,rate=2", flag, "0"],
        );
        assert!(!out.status.success(), "{flag} 0 was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{flag}: {err}");
    }
}

/// `pipeline.py`'s `mp:` notation: each integer in MessagePack's smallest encoding.
fn encode_mp(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for n in text.strip_prefix("mp:").expect("mp:").split(',') {
        let n: u64 = n.parse().expect("an integer");
        match n {
            0..=0x7f => out.push(n as u8),
            0x80..=0xff => out.extend([0xcc, n as u8]),
            0x100..=0xffff => {
                out.push(0xcd);
                out.extend((n as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                out.push(0xce);
                out.extend((n as u32).to_be_bytes());
            }
            _ => {
                out.push(0xcf);
                out.extend(n.to_be_bytes());
            }
        }
    }
    out
}

/// `tollgate ceiling --policy P --cost C --print-arg` prints the store's argument for P and C in
/// the `mp:` notation of `benches/scripts/pipeline.py`, so script-cost.sh sends exactly the
/// store's bytes. Before, there was no such print and script-cost.sh wrote its arguments by
/// hand: `mp:1,0,0,100,1000000,50,…` for token-bucket 100, 50/s, where the store sends the
/// reduced rate `mp:1,0,0,100,20000,1,…`.
#[test]
fn print_arg_prints_the_stores_argument() {
    for (policy, cost) in [
        ("token-bucket:capacity=100,rate=50", 1),
        ("token-bucket:capacity=100,rate=100,period=1h", 1),
        ("token-bucket:capacity=1,rate=1,period=1h", 1),
        ("fixed-window:limit=100,window=1m", 7),
        ("sliding-log:limit=100,window=1m", 1),
        ("token-bucket:capacity=4000000000,rate=3,period=1ms", 300),
        (
            "token-bucket:capacity=5000000000,rate=1000,period=1ms",
            4_000_000_000,
        ),
    ] {
        let out = succeeded(
            Command::new(env!("CARGO_BIN_EXE_tollgate"))
                .args(["ceiling", "--policy", policy, "--cost", &cost.to_string()])
                .arg("--print-arg")
                .output()
                .expect("the tollgate binary runs"),
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let p: tollgate::Policy = policy.parse().unwrap();
        let store = tollgate::redis::scripts::args(&p, cost, true);
        assert_eq!(
            encode_mp(text.trim_end()),
            store.as_bytes(),
            "{policy}: {text}"
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["ceiling", "--policy", "token-bucket:capacity=100,rate=50"])
        .arg("--print-arg")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim_end(),
        "mp:1,0,0,100,20000,1,0,1,1,1"
    );
}

/// The ceiling's clock starts once every client is connected, authenticated and on its
/// database, as redis-benchmark's does. Through a proxy adding 100 ms each way, two requests
/// on one connection take two round trips (~0.4 s: ~5 requests/s); before, AUTH and SELECT
/// were timed too, four round trips (~0.8 s: 2.5 requests/s).
#[test]
fn the_clock_starts_after_the_clients_connect() {
    let redis = RedisServer::start();
    let mut conn = redis.client().get_connection().unwrap();
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("pw")
        .query(&mut conn)
        .unwrap();
    let proxy = FaultProxy::start(redis.port());
    proxy.set_latency(Duration::from_millis(100));
    let url = format!("redis://:pw@127.0.0.1:{}/2", proxy.port());
    let out = succeeded(
        Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["ceiling", "--redis", &url])
            .args(["--policy", "token-bucket:capacity=10,rate=2"])
            .args(["--clients", "1", "--pipeline", "1", "--requests", "2"])
            .arg("--json")
            .output()
            .expect("the tollgate binary runs"),
    );
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let rps = s["requests_per_sec"].as_f64().unwrap();
    // two round trips of >= 0.4 s in all: at most 5/s; four would be at most 2.5/s
    assert!(rps > 3.5 && rps <= 5.1, "{rps} requests/s: {s}");
}

/// Sizes beyond what the driver can hold are usage errors (exit 2, naming the flag), not an
/// abort on allocation: a round's `--pipeline` commands are built in one buffer, and
/// `--pipeline 100000000` asked for gigabytes (found by a review: "memory allocation of
/// 4294967296 bytes failed" under a 4 GiB address-space limit).
#[test]
fn sizes_beyond_what_the_driver_can_hold_are_usage_errors() {
    let server = RedisServer::start();
    for (flag, value) in [("--pipeline", "100000000"), ("--clients", "10000000")] {
        let out = ceiling(
            &server,
            &[
                "--policy",
                "token-bucket:capacity=10,rate=2",
                flag,
                value,
                "--requests",
                "100000000",
            ],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {stderr}");
        assert!(
            stderr.contains(flag) && stderr.contains("10000"),
            "{stderr}"
        );
    }
}
