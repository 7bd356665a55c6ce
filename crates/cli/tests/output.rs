//! What the `tollgate` binary writes and how it exits, as a user runs it: an error reported
//! once, a reader that closes the pipe early, a policy file that would limit nothing.

use std::io::{PipeReader, PipeWriter};
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tollgate_testkit::server::RedisServer;

fn tollgate() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.env("RUST_BACKTRACE", "0").env("RUST_LOG", "error");
    cmd
}

/// Runs `cmd` to its end, killing it after `limit` (then `None`).
fn run_bounded(cmd: &mut Command, limit: Duration) -> Option<Output> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the tollgate binary runs");
    let deadline = Instant::now() + limit;
    // at most limit / 20 ms polls
    while Instant::now() < deadline {
        if child.try_wait().expect("wait").is_some() {
            return Some(child.wait_with_output().expect("output"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// A pipe whose reader has already gone: every write to its other end fails (EPIPE), as
/// when `head -1` has read its line and exited, without racing the writer.
fn closed_pipe() -> PipeWriter {
    let (reader, writer): (PipeReader, PipeWriter) = std::io::pipe().expect("a pipe");
    drop(reader);
    writer
}

/// A cost above the policy's capacity was reported twice: `invalid request: cost 11 exceeds
/// the policy's maximum burst of 10`, then again under `Caused by:` as `cost 11 exceeds …`
/// (the store's error names its cause in its own message and returns it as its source).
#[test]
fn a_cost_above_capacity_is_reported_once() {
    let out = tollgate()
        .args([
            "check",
            "--policy",
            "token-bucket:capacity=10,rate=2",
            "--key",
            "user:1",
            "--cost",
            "11",
        ])
        .output()
        .expect("the tollgate binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(out.stdout.is_empty(), "no decision is printed");
    assert_eq!(
        stderr
            .matches("cost 11 exceeds the policy's maximum burst of 10")
            .count(),
        1,
        "{stderr}"
    );
    // nothing lost: what failed, and why
    assert!(stderr.starts_with("Error: no decision"), "{stderr}");
    assert!(stderr.contains("invalid request: cost 11"), "{stderr}");
}

/// A reader that closes the pipe early (`tollgate check … | true`, `tollgate load … | head
/// -1`) made `println!` panic: exit 101 and `failed printing to stdout: Broken pipe`. The
/// command now ends quietly, as `ls | head` does.
#[test]
fn a_reader_that_closes_the_pipe_early_ends_the_command_quietly() {
    let server = RedisServer::start();
    let url = server.url();
    let commands: Vec<Vec<&str>> = vec![
        vec![
            "check",
            "--policy",
            "token-bucket:capacity=10,rate=2",
            "--key",
            "user:1",
        ],
        vec![
            "load",
            "--policy",
            "token-bucket:capacity=10,rate=2",
            "--requests",
            "20",
        ],
        vec![
            "load",
            "--policy",
            "fixed-window:limit=5,window=1s",
            "--requests",
            "20",
            "--json",
        ],
        vec!["serve", "--print-config"],
        vec![
            "ceiling",
            "--print-script",
            "--policy",
            "token-bucket:capacity=10,rate=2",
        ],
        vec!["policy", "show", "--redis", &url],
    ];
    for args in commands {
        let out = run_bounded(
            tollgate().args(&args).stdout(closed_pipe()),
            Duration::from_secs(60),
        )
        .unwrap_or_else(|| panic!("{args:?} did not end"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.is_empty(),
            "{args:?}: {:?}\n{stderr}",
            out.status
        );
    }
}

/// `serve` whose stdout reader has gone (`tollgate serve | head -1`) panicked printing its
/// banner and exited 101; it keeps serving: the banner is only for that reader.
#[test]
fn serve_keeps_serving_when_its_stdout_reader_has_gone() {
    let port = {
        let probe = TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let listen = format!("127.0.0.1:{port}");
    let mut child = tollgate()
        .args(["serve", "--listen", &listen])
        .stdin(Stdio::null())
        .stdout(closed_pipe())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn tollgate serve");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut answered = None;
    // at most 30 s / 50 ms attempts
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            answered = Some(Err(status));
            break;
        }
        if let Ok(mut conn) = std::net::TcpStream::connect(&listen) {
            use std::io::{Read, Write};
            conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            conn.write_all(b"GET / HTTP/1.0\r\nhost: x\r\n\r\n")
                .unwrap();
            let mut reply = String::new();
            let _ = conn.read_to_string(&mut reply);
            answered = Some(Ok(reply));
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let still_running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    match answered {
        Some(Ok(reply)) => assert!(reply.starts_with("HTTP/1.0 200"), "{reply}"),
        Some(Err(status)) => panic!("serve exited ({status}) instead of serving"),
        None => panic!("serve did not answer on {listen} within 30 s"),
    }
    assert!(still_running, "serve exited after answering");
}

/// A policy file without any `[[route]]` (an empty file, or settings alone) started a server
/// that limited nothing, silently. It is refused, naming the file and why.
#[test]
fn serve_refuses_a_policy_file_without_routes() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in [
        ("empty.toml", ""),
        ("settings.toml", "legacy_headers = true\n"),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let out = run_bounded(
            tollgate()
                .args(["serve", "--listen", "127.0.0.1:0", "--config"])
                .arg(&path)
                .stdout(Stdio::piped()),
            Duration::from_secs(20),
        )
        .unwrap_or_else(|| panic!("{name}: serve started with no route, limiting nothing"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(
            stderr.contains(&path.display().to_string()) && stderr.contains("no [[route]]"),
            "{name}: {stderr}"
        );
    }
}
