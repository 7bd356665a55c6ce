//! Shared test support: a real redis-server on a free loopback port, and helpers.
#![allow(dead_code, clippy::missing_panics_doc)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tollgate_redis::RedisStore;

/// A redis-server child process in its own temp dir, killed on drop.
pub struct Server {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Server {
    pub fn start() -> Self {
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("temp dir");
            let port = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let child = Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .arg("--dir")
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server on PATH");
            let mut server = Self {
                child,
                port,
                _dir: dir,
            };
            if server.wait_ready() {
                return server;
            }
        }
        panic!("redis-server did not start");
    }

    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        let client = redis::Client::open(self.url()).unwrap();
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(100))
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A plain synchronous connection for inspecting the server.
    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url())
            .unwrap()
            .get_connection()
            .unwrap()
    }

    pub async fn multiplexed(&self) -> RedisStore {
        RedisStore::builder(self.url())
            .timeout(Duration::from_secs(5))
            .build()
            .await
            .unwrap()
    }

    pub async fn pooled(&self, size: u32) -> RedisStore {
        RedisStore::builder(self.url())
            .timeout(Duration::from_secs(5))
            .pool(size)
            .build()
            .await
            .unwrap()
    }

    /// Redis's clock in microseconds.
    pub fn time_micros(&self) -> u64 {
        let (s, us): (u64, u64) = redis::cmd("TIME").query(&mut self.conn()).unwrap();
        s * 1_000_000 + us
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
