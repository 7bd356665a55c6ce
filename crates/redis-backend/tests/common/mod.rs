//! Shared test support: a real redis-server on a free loopback port (optionally under a clock
//! the test sets), and helpers.
#![allow(dead_code, clippy::missing_panics_doc)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tollgate_redis::RedisStore;

/// A redis-server child process in its own temp dir, killed on drop.
pub struct Server {
    child: Child,
    port: u16,
    clock_file: Option<PathBuf>,
    dir: tempfile::TempDir,
}

impl Server {
    pub fn start() -> Self {
        Self::start_inner(false, &[])
    }

    /// A server started with extra command-line arguments.
    pub fn start_with_args(args: &[String]) -> Self {
        Self::start_inner(false, args)
    }

    /// A server whose wall clock (TIME, TIME in scripts, key expiry) the test sets with
    /// [`Server::set_time`], through an LD_PRELOAD clock shim.
    pub fn start_with_clock() -> Self {
        Self::start_inner(true, &[])
    }

    fn start_inner(clock: bool, extra: &[String]) -> Self {
        for _ in 0..5 {
            let dir = tempfile::tempdir().expect("temp dir");
            let port = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let mut cmd = Command::new("redis-server");
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .args(extra)
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let clock_file = clock.then(|| {
                let shim = build_shim(dir.path());
                let file = dir.path().join("clock");
                std::fs::write(&file, "").unwrap();
                cmd.env("LD_PRELOAD", shim)
                    .env("TOLLGATE_CLOCK_FILE", &file);
                file
            });
            let child = cmd.spawn().expect("redis-server on PATH");
            let mut server = Self {
                child,
                port,
                clock_file,
                dir,
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

    /// Freezes the server's wall clock at `micros` since the epoch.
    pub fn set_time(&self, micros: u64) {
        let file = self
            .clock_file
            .as_ref()
            .expect("server started with a clock");
        let tmp = self.dir.path().join("clock.tmp");
        std::fs::write(&tmp, format!("={}\n", u128::from(micros) * 1000)).unwrap();
        std::fs::rename(&tmp, file).unwrap();
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

/// Compiles testkit's clock shim into `dir` (a stand-in until testkit's server lands).
fn build_shim(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testkit/shim/clockshim.c");
    let out = dir.join("libclockshim.so");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("cc");
    assert!(status.success(), "building the clock shim failed");
    out
}

/// A free loopback port (free when asked; a server binds it right after).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
