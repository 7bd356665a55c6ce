//! Shared test support: testkit's real redis-server (optionally under a clock the test
//! freezes and moves), plus store constructors and inspection helpers, and the bounded wait
//! for a condition ([`until`], [`eventually`]) that every test here polls with.
#![allow(dead_code, clippy::missing_panics_doc)]

use std::time::Duration;

use tollgate_redis::RedisStore;
use tollgate_testkit::server::RedisServer;
#[allow(unused_imports)] // each test binary uses its own part
pub use tollgate_testkit::wait::{eventually, until};

/// A redis-server on a free loopback port, killed on drop.
pub struct Server(pub RedisServer);

impl Server {
    pub fn start() -> Self {
        Self(RedisServer::start())
    }

    /// A server started with extra command-line arguments.
    pub fn start_with_args(args: &[String]) -> Self {
        Self(RedisServer::builder().extra_args(args).start())
    }

    /// A server whose wall clock (TIME, TIME in scripts, key expiry) the test sets with
    /// [`Server::set_time`].
    pub fn start_with_clock() -> Self {
        Self(RedisServer::builder().clock_control(true).start())
    }

    /// Freezes the server's wall clock at `micros` since the epoch.
    pub fn set_time(&self, micros: u64) {
        self.0.clock().freeze_at_micros(micros);
    }

    pub fn url(&self) -> String {
        self.0.url()
    }

    pub fn port(&self) -> u16 {
        self.0.port()
    }

    /// A plain synchronous connection for inspecting the server.
    pub fn conn(&self) -> redis::Connection {
        self.0.client().get_connection().unwrap()
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
