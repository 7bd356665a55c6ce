//! The harness shared by the tests of the `tollgate` binary: `tollgate serve` on a free
//! loopback port (killed on drop), an HTTP client, a redis-server on a frozen clock, and the
//! JSON a successful command printed.
#![allow(dead_code)] // each test binary uses its own part

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use reqwest::Response;
use tollgate_testkit::server::RedisServer;

pub const START_MICROS: u64 = 1_700_000_000_300_000;

/// A running `tollgate serve`, killed on drop.
pub struct Serve {
    pub child: Child,
    pub base: String,
}

impl Serve {
    pub fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn tollgate serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // Keep draining so the child never blocks on a full pipe.
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let first = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("tollgate serve printed no address");
        let base = first
            .strip_prefix("listening on ")
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("unexpected first line: {first}"))
            .to_owned();
        Self { child, base }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client whose requests give up after 10 s.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

pub fn header<'a>(resp: &'a Response, name: &str) -> Option<&'a str> {
    resp.headers().get(name).map(|v| v.to_str().unwrap())
}

/// `text` as `policy.toml` in `dir`; its path.
pub fn write_config(dir: &Path, text: &str) -> String {
    let path = dir.join("policy.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// A redis-server whose clock stands at [`START_MICROS`].
pub fn frozen_redis() -> RedisServer {
    let server = RedisServer::builder().clock_control(true).start();
    server.clock().freeze_at_micros(START_MICROS);
    server
}

/// The JSON a successful command printed on standard output (its stderr shown if it failed).
pub fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}
