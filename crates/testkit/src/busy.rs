//! A redis-server kept busy by a long script, for tests of how a store answers `BUSY`.
//!
//! Such a test used to start a script that ran for a fixed 600–700 ms and sleep a fixed
//! 200–250 ms before its call: a host that stalled either thread for the difference made the
//! call miss the busy window. [`BusyScript::start`] returns once the server answers `BUSY`, and
//! the script runs until [`BusyScript::stop`] kills it (a script that writes nothing can be
//! killed with `SCRIPT KILL`), so the window lasts as long as the test needs it.

use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// The longest the script runs if nothing stops it (a test that panics before
/// [`BusyScript::stop`] still leaves a server that answers again).
const LONGEST: Duration = Duration::from_secs(30);

/// How long [`BusyScript::start`] waits for the server to answer `BUSY`.
const START_BOUND: Duration = Duration::from_secs(10);

/// A script running on a redis-server, past its `busy-reply-threshold`: until it is stopped,
/// the server answers other clients' commands with `BUSY`.
///
/// ```no_run
/// use tollgate_testkit::busy::BusyScript;
/// use tollgate_testkit::server::RedisServer;
///
/// let server = RedisServer::builder()
///     .extra_args(["--busy-reply-threshold", "50"])
///     .start();
/// let busy = BusyScript::start(&server.client());
/// // ... every command from another connection is refused with BUSY here ...
/// busy.stop();
/// ```
#[derive(Debug)]
pub struct BusyScript {
    client: redis::Client,
    thread: Option<JoinHandle<()>>,
}

impl BusyScript {
    /// Runs a script that writes nothing on `client`'s server, on a thread of its own, and
    /// returns once the server answers another connection's `PING` with `BUSY` (the script has
    /// run past the server's `busy-reply-threshold`, which the caller sets low).
    ///
    /// # Panics
    /// If the server does not answer `BUSY` within 10 s, or cannot be reached.
    pub fn start(client: &redis::Client) -> Self {
        let mut conn = client
            .get_connection()
            .expect("a connection for the script");
        let longest = LONGEST.as_micros();
        let thread = thread::spawn(move || {
            let script = format!(
                "local a = redis.call('TIME') \
                 while true do local b = redis.call('TIME') \
                 if (b[1] - a[1]) * 1000000 + (b[2] - a[2]) > {longest} then return 1 end end"
            );
            // killed by `stop` (an error reply), or run to its end
            let _: redis::RedisResult<i64> = redis::cmd("EVAL").arg(script).arg(0).query(&mut conn);
        });
        let busy = Self {
            client: client.clone(),
            thread: Some(thread),
        };
        let mut probe = client.get_connection().expect("a connection to probe");
        let started = Instant::now();
        loop {
            match redis::cmd("PING").query::<String>(&mut probe) {
                Err(e) if e.code() == Some("BUSY") => return busy,
                _ if started.elapsed() > START_BOUND => {
                    panic!("the server did not answer BUSY within {START_BOUND:?}")
                }
                _ => thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Kills the script (`SCRIPT KILL`) and waits for its thread: the server answers again.
    pub fn stop(mut self) {
        self.end();
    }

    fn end(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        if let Ok(mut conn) = self.client.get_connection() {
            // fails only if the script has ended already
            let _: redis::RedisResult<()> = redis::cmd("SCRIPT").arg("KILL").query(&mut conn);
        }
        let _ = thread.join();
    }
}

impl Drop for BusyScript {
    fn drop(&mut self) {
        self.end();
    }
}
