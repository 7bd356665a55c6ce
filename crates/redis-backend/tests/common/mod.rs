//! Shared test support: testkit's real redis-server (optionally under a clock the test
//! freezes and moves), plus store constructors and inspection helpers, and the bounded wait
//! for a condition ([`until`], [`eventually`]) that every test here polls with.
#![allow(dead_code, clippy::missing_panics_doc)]

use std::time::{Duration, Instant};

use tollgate_redis::RedisStore;
use tollgate_testkit::server::RedisServer;

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

/// How often [`until`] and [`eventually`] check their condition.
pub const POLL_EVERY: Duration = Duration::from_millis(20);

/// The most checks a wait of `bound` makes: one every [`POLL_EVERY`], and one more at the end.
fn checks(bound: Duration) -> u128 {
    bound.as_millis() / POLL_EVERY.as_millis() + 1
}

/// Checks `condition` every [`POLL_EVERY`] until it holds, for at most `bound` (and at most
/// `bound / POLL_EVERY + 1` checks), sleeping the thread in between.
///
/// # Panics
/// With `"{what}: not within {bound:?}"` if it does not hold within `bound` (reported at the
/// caller).
#[track_caller]
pub fn until(bound: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + bound;
    for _ in 0..checks(bound) {
        if condition() {
            return;
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(POLL_EVERY);
    }
    assert!(condition(), "{what}: not within {bound:?}");
}

/// [`until`] for async tests whose failure message shows more than a name: sleeps on the
/// runtime between checks (so its tasks, such as a store's sentinel watches, run meanwhile)
/// and returns whether `condition` held within `bound` instead of panicking.
pub async fn eventually(bound: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + bound;
    for _ in 0..checks(bound) {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
    condition()
}
