//! Real redis-server processes for tests: one standalone server on a free loopback port, in
//! a private temp dir, that a test can stop, kill, restart on the same port, pause, flush of
//! scripts and run under a [`ServerClock`] it moves.
//!
//! Built on `redis_test::server::RedisServer` (which spawns the process); this module adds
//! readiness, restart on the same port, pause/resume and clock control.

use std::ffi::OsString;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::thread;
use std::time::{Duration, Instant};

use redis::{ConnectionAddr, IntoConnectionInfo};
use tempfile::TempDir;

use crate::clock::ServerClock;

/// Loopback address every server binds to.
const HOST: &str = "127.0.0.1";
/// How long a start or restart may take before it panics, unless the builder says otherwise.
const DEFAULT_STARTUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Attempts with a fresh port when another process takes the chosen one first.
const FRESH_PORT_ATTEMPTS: u32 = 5;
/// How long a graceful stop may take before the process is killed.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// Poll interval while waiting for a process to change state.
const POLL: Duration = Duration::from_millis(10);

/// True when a `redis-server` binary can be run: `REDISRS_SERVER_BIN` (the variable
/// `redis-test` honours) if set, else `redis-server` on `PATH`.
pub fn redis_available() -> bool {
    if let Some(bin) = std::env::var_os("REDISRS_SERVER_BIN") {
        return is_executable(Path::new(&bin));
    }
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| is_executable(&dir.join("redis-server")))
    })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
}

/// Configures a [`RedisServer`] before it starts; see [`RedisServer::builder`].
#[derive(Debug, Default)]
#[must_use = "a builder does nothing until .start() is called"]
pub struct RedisServerBuilder {
    clock: ClockChoice,
    extra_args: Vec<OsString>,
    startup_timeout: Option<Duration>,
    config_file: Option<String>,
}

#[derive(Debug, Default)]
enum ClockChoice {
    #[default]
    Real,
    Fresh,
    Shared(ServerClock),
}

impl RedisServerBuilder {
    /// Runs the server under a new [`ServerClock`] (initially real time), reachable through
    /// [`RedisServer::clock`]. `false` (the default) leaves the server on the real clock.
    pub fn clock_control(mut self, enabled: bool) -> Self {
        self.clock = if enabled {
            ClockChoice::Fresh
        } else {
            ClockChoice::Real
        };
        self
    }

    /// Runs the server under an existing clock, so several servers move together.
    pub fn clock(mut self, clock: ServerClock) -> Self {
        self.clock = ClockChoice::Shared(clock);
        self
    }

    /// Appends command-line arguments for redis-server (e.g. `["--maxmemory", "1mb"]`); they
    /// come after testkit's own, so they override them. Kept for restarts.
    pub fn extra_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.extra_args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Starts the server with a config file holding `contents`, written to `redis.conf` in its
    /// temp dir and passed as the first argument (command-line arguments still override it).
    /// The file is writable, as Sentinel and `CONFIG REWRITE` need, and is kept across
    /// restarts with whatever the server wrote into it.
    pub fn config_file(mut self, contents: impl Into<String>) -> Self {
        self.config_file = Some(contents.into());
        self
    }

    /// How long a start (or restart) may take before it panics; 10 s by default.
    pub fn startup_timeout(mut self, timeout: Duration) -> Self {
        self.startup_timeout = Some(timeout);
        self
    }

    /// Starts the server on a free loopback port and returns once it answers.
    ///
    /// # Panics
    /// If `redis-server` is missing, or the server does not answer within the startup
    /// timeout (the message carries its log).
    pub fn start(self) -> RedisServer {
        assert!(
            redis_available(),
            "redis-server not found on PATH (install Debian's redis-server package, or set \
             REDISRS_SERVER_BIN)"
        );
        let dir = tempfile::Builder::new()
            .prefix("tollgate-redis")
            .tempdir()
            .expect("failed to create a temp dir for redis-server");
        fs::create_dir(dir.path().join("data")).expect("failed to create the data dir");
        let config_path = self.config_file.map(|contents| {
            let path = dir.path().join("redis.conf");
            fs::write(&path, contents).expect("failed to write redis.conf");
            path
        });
        let clock = match self.clock {
            ClockChoice::Real => None,
            ClockChoice::Fresh => Some(ServerClock::new()),
            ClockChoice::Shared(clock) => Some(clock),
        };
        let mut server = RedisServer {
            process: None,
            port: 0,
            dir,
            clock,
            extra_args: self.extra_args,
            config_path,
            startup_timeout: self.startup_timeout.unwrap_or(DEFAULT_STARTUP_TIMEOUT),
            paused: false,
        };
        for attempt in 1..=FRESH_PORT_ATTEMPTS {
            server.port = crate::ports::fresh_port();
            match server.spawn_and_wait() {
                Ok(()) => return server,
                Err(Startup::PortTaken(_)) if attempt < FRESH_PORT_ATTEMPTS => {}
                Err(failure) => panic!("redis-server did not start: {failure}"),
            }
        }
        unreachable!("the last attempt either returns or panics")
    }
}

/// One real redis-server on `127.0.0.1`, killed (and its temp dir removed) on drop — also
/// when the test panics, and also while paused.
///
/// Nothing is persisted (`--save ""`, no AOF): a restarted server is empty and its script
/// cache is empty, as after a real crash of a cache-only Redis.
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate_testkit::server::RedisServer;
///
/// let server = RedisServer::builder().clock_control(true).start();
/// server.clock().freeze_at_micros(1_700_000_000_000_000);
/// let mut conn = server.client().get_connection().unwrap();
/// let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
/// assert_eq!((secs, micros), (1_700_000_000, 0));
/// server.clock().advance(Duration::from_secs(60));
/// ```
pub struct RedisServer {
    process: Option<redis_test::server::RedisServer>,
    port: u16,
    dir: TempDir,
    clock: Option<ServerClock>,
    extra_args: Vec<OsString>,
    config_path: Option<PathBuf>,
    startup_timeout: Duration,
    paused: bool,
}

impl std::fmt::Debug for RedisServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisServer")
            .field("url", &self.url())
            .field("pid", &self.pid())
            .field("paused", &self.paused)
            .field("dir", &self.dir.path())
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

/// Why one spawn did not produce a ready server.
#[derive(Debug, thiserror::Error)]
enum Startup {
    /// The port was in use (bind failed); retrying may help.
    #[error("{0}")]
    PortTaken(String),
    /// Anything else: exited, or did not answer in time.
    #[error("{0}")]
    Failed(String),
}

impl RedisServer {
    /// Starts a server with default settings (real clock); see [`RedisServerBuilder::start`].
    pub fn start() -> Self {
        Self::builder().start()
    }

    /// A builder for a server with clock control or extra arguments.
    pub fn builder() -> RedisServerBuilder {
        RedisServerBuilder::default()
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://{HOST}:{}", self.port)
    }

    /// The TCP port; stable across [`restart`](Self::restart).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connection info for this server (RESP2, database 0, no auth).
    pub fn connection_info(&self) -> redis::ConnectionInfo {
        ConnectionAddr::Tcp(HOST.to_owned(), self.port)
            .into_connection_info()
            .expect("a TCP address is valid connection info")
    }

    /// A client for this server (connects lazily, so it can be made while the server is down).
    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.connection_info()).expect("a TCP address makes a valid client")
    }

    /// `INFO commandstats` summed over `commands` (lower case, as Redis names them: `evalsha`,
    /// `hget`, ...): how many calls the server has executed, and the microseconds it spent in
    /// them (its own time, which a loaded machine does not stretch as it does a client's).
    ///
    /// # Panics
    /// If the server does not answer.
    pub fn command_stats(&self, commands: &[&str]) -> CommandStats {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.client().get_connection().expect("the server answers"))
            .expect("INFO commandstats");
        let field = |rest: &str, name: &str| -> u64 {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        let mut stats = CommandStats::default();
        for line in info.lines() {
            let Some((name, rest)) = line
                .strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
            else {
                continue;
            };
            if commands.contains(&name) {
                stats.calls += field(rest, "calls");
                stats.usec += field(rest, "usec");
            }
        }
        stats
    }

    /// Closes every normal client connection of this server except the caller's
    /// (`CLIENT KILL TYPE normal`): what the server's idle `timeout`, an operator's `CLIENT
    /// KILL` or a load balancer's idle cut does to a connection. How many it closed.
    ///
    /// # Panics
    /// If the server does not answer.
    pub fn kill_clients(&self) -> i64 {
        let mut admin = self.client().get_connection().expect("the server answers");
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .query(&mut admin)
            .expect("CLIENT KILL answers")
    }

    /// The server's clock.
    ///
    /// # Panics
    /// If the server was built without clock control (use
    /// `RedisServer::builder().clock_control(true)`).
    pub fn clock(&self) -> &ServerClock {
        self.clock.as_ref().expect(
            "this server has no clock control; start it with RedisServer::builder().clock_control(true)",
        )
    }

    /// The server's clock, or `None` without clock control.
    pub fn try_clock(&self) -> Option<&ServerClock> {
        self.clock.as_ref()
    }

    /// The OS process id, while a process exists (running or paused).
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|server| server.process.id())
    }

    /// The private temp dir (data dir and logs); removed on drop.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The config file given with [`RedisServerBuilder::config_file`], as the server last
    /// rewrote it; `None` without one.
    pub fn config_path(&self) -> Option<&Path> {
        self.config_path.as_deref()
    }

    /// The server log so far, across restarts (empty if none yet).
    pub fn log_contents(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// True while the process exists and has not exited (a paused server is running).
    pub fn is_running(&mut self) -> bool {
        self.process
            .as_mut()
            .is_some_and(|server| matches!(server.process.try_wait(), Ok(None)))
    }

    /// True while the server is stopped with SIGSTOP by [`pause`](Self::pause).
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// Stops the server gracefully (`SHUTDOWN NOSAVE`), falling back to SIGKILL after 5 s. A
    /// paused server is killed outright. Does nothing when already stopped.
    pub fn stop(&mut self) {
        if self.process.is_none() {
            return;
        }
        if self.paused {
            self.kill();
            return;
        }
        if let Ok(mut conn) = self
            .client()
            .get_connection_with_timeout(Duration::from_secs(1))
        {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
            // The server closes the connection instead of replying.
            let _: redis::RedisResult<()> = redis::cmd("SHUTDOWN").arg("NOSAVE").query(&mut conn);
        }
        let deadline = Instant::now() + SHUTDOWN_TIMEOUT;
        while Instant::now() < deadline {
            if !self.is_running() {
                break;
            }
            thread::sleep(POLL);
        }
        self.kill();
    }

    /// Kills the server with SIGKILL (a crash: no shutdown work), and reaps it. Does nothing
    /// when already stopped.
    pub fn kill(&mut self) {
        if let Some(mut server) = self.process.take() {
            let _ = server.process.kill();
            let _ = server.process.wait();
        }
        self.paused = false;
    }

    /// Starts the server again on the same port (stopping it first if it runs), with the
    /// same arguments and the same clock. The new server is empty. A port still held
    /// briefly by the old process is retried with backoff until the startup timeout.
    ///
    /// # Panics
    /// If the port stays taken or the server does not answer within the startup timeout.
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + self.startup_timeout;
        let mut backoff = Duration::from_millis(20);
        loop {
            match self.spawn_and_wait() {
                Ok(()) => return,
                Err(Startup::PortTaken(_)) if Instant::now() < deadline => {
                    thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(failure) => panic!(
                    "redis-server did not restart on port {}: {failure}",
                    self.port
                ),
            }
        }
    }

    /// Freezes the process with SIGSTOP: connections stay open, commands get no answer
    /// (clients see timeouts, not refusals). Returns once the kernel reports it stopped.
    ///
    /// # Panics
    /// If the server is not running.
    pub fn pause(&mut self) {
        let pid = self.pid().expect("pause: the server is not running");
        signal(pid, libc::SIGSTOP);
        self.paused = true;
        wait_for_state(pid, true);
    }

    /// Continues a paused process with SIGCONT. Does nothing if it is not paused.
    pub fn resume(&mut self) {
        if !self.paused {
            return;
        }
        let pid = self.pid().expect("a paused server has a process");
        signal(pid, libc::SIGCONT);
        self.paused = false;
        wait_for_state(pid, false);
    }

    /// Empties the server's script cache (`SCRIPT FLUSH SYNC`), so the next `EVALSHA` of any
    /// script gets `NOSCRIPT`.
    ///
    /// # Panics
    /// If the server does not answer.
    pub fn script_flush(&self) {
        let mut conn = self
            .client()
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("script_flush: cannot connect");
        redis::cmd("SCRIPT")
            .arg("FLUSH")
            .arg("SYNC")
            .exec(&mut conn)
            .expect("SCRIPT FLUSH failed");
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    /// Spawns redis-server on `self.port` and waits until it answers as itself.
    fn spawn_and_wait(&mut self) -> Result<(), Startup> {
        let stderr_path = self.dir.path().join("stderr.log");
        let stderr = File::create(&stderr_path).expect("failed to create stderr.log");
        let data_dir = self.dir.path().join("data");
        let log_path = self.log_path();
        let extra_args = &self.extra_args;
        let clock = self.clock.as_ref();
        let server = redis_test::server::RedisServer::new_with_addr_tls_modules_and_spawner(
            ConnectionAddr::Tcp(HOST.to_owned(), self.port),
            self.config_path.as_deref(),
            None,
            false,
            None,
            &[],
            |cmd| {
                // Later arguments win: our dir and log (kept across restarts) replace
                // redis-test's per-spawn ones.
                cmd.arg("--dir")
                    .arg(&data_dir)
                    .arg("--logfile")
                    .arg(&log_path)
                    .args(["--appendonly", "no"])
                    .args(extra_args)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(stderr);
                if let Some(clock) = clock {
                    clock.apply_to(cmd);
                }
                cmd.spawn()
                    .unwrap_or_else(|err| panic!("failed to run {cmd:?}: {err}"))
            },
        );
        self.process = Some(server);
        let result = self.wait_until_ready();
        if result.is_err() {
            self.kill();
        }
        result
    }

    fn wait_until_ready(&mut self) -> Result<(), Startup> {
        let deadline = Instant::now() + self.startup_timeout;
        let pid = self.pid().expect("just spawned");
        let client = self.client();
        loop {
            let exited = self
                .process
                .as_mut()
                .and_then(|server| server.process.try_wait().ok().flatten());
            if let Some(status) = exited {
                let detail = format!(
                    "redis-server on port {} exited ({status}).\n--- log ---\n{}\n--- stderr ---\n{}",
                    self.port,
                    self.log_contents(),
                    fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default(),
                );
                return Err(if detail.contains("Address already in use") {
                    Startup::PortTaken(detail)
                } else {
                    Startup::Failed(detail)
                });
            }
            if answers_as(&client, pid) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Startup::Failed(format!(
                    "redis-server (pid {pid}) did not answer on port {} within {:?}.\n--- log ---\n{}",
                    self.port,
                    self.startup_timeout,
                    self.log_contents(),
                )));
            }
            thread::sleep(POLL);
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL also ends a SIGSTOPped process; the TempDir field then removes the dir.
        self.kill();
    }
}

/// True when the server answering on the client's port is process `pid` — not another
/// server that won a race for the same port.
fn answers_as(client: &redis::Client, pid: u32) -> bool {
    let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_millis(250)) else {
        return false;
    };
    if conn
        .set_read_timeout(Some(Duration::from_millis(500)))
        .is_err()
    {
        return false;
    }
    let Ok(info) = redis::cmd("INFO").arg("server").query::<String>(&mut conn) else {
        return false;
    };
    info.lines()
        .filter_map(|line| line.strip_prefix("process_id:"))
        .any(|value| value.trim() == pid.to_string())
}

/// Calls and server time of some commands ([`RedisServer::command_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommandStats {
    /// Calls executed.
    pub calls: u64,
    /// Microseconds the server spent in them.
    pub usec: u64,
}

/// Sends SIGTERM to `pid` (a child process of the test's: its own `tollgate serve`, say),
/// by the system call: a test need not find a `kill` program (procps), which a minimal Debian
/// lacks.
pub fn sigterm(pid: u32) {
    signal(pid, libc::SIGTERM);
}

/// Sends `sig` to `pid`.
#[allow(unsafe_code)]
fn signal(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("a pid fits in pid_t");
    // SAFETY: kill(2) takes plain integers and touches no memory of ours; `pid` is our own
    // unreaped child, so it cannot name a recycled process.
    let rc = unsafe { libc::kill(pid, sig) };
    assert!(
        rc == 0,
        "kill({pid}, {sig}) failed: {}",
        std::io::Error::last_os_error()
    );
}

/// Waits (bounded) until /proc says `pid` is stopped (`stopped == true`) or not.
///
/// # Panics
/// If it does not within 30 s; the message names the last state /proc showed and, for a
/// process asleep in the kernel, where (`wchan`): a signal waits until an uninterruptible
/// sleep (`D`, such as an `fsync`) ends. (5 s once ran out in a chaos soak on a busy host,
/// cause not seen; waiting longer costs nothing when the process obeys at once.)
fn wait_for_state(pid: u32, stopped: bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let stat_path = format!("/proc/{pid}/stat");
    let mut last = None;
    while Instant::now() < deadline {
        let Ok(stat) = fs::read_to_string(&stat_path) else {
            return; // no /proc (or the process is gone): nothing to wait for
        };
        // The state follows the parenthesised command name, which may contain spaces.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        if matches!(state, Some('T' | 't')) == stopped || matches!(state, Some('Z' | 'X')) {
            return; // done, or the process already exited: nothing left to wait for
        }
        last = state;
        thread::sleep(Duration::from_millis(1));
    }
    let wchan = fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
    panic!(
        "process {pid} did not become {} within 30 s (last state {last:?}, wchan {wchan:?})",
        if stopped { "stopped" } else { "running" }
    );
}
