//! A Sentinel topology on loopback for failover tests: one primary, one replica and three
//! sentinels (quorum 2), each its own [`RedisServer`] process in its own temp dir.
//!
//! Sentinels run with fast-failover settings (`down-after-milliseconds 1000`,
//! `failover-timeout 3000`, `parallel-syncs 1`), so a killed primary is replaced in a few
//! seconds. Replication and Sentinel time out on the wall clock: never freeze the clock of
//! these servers (see [`crate::clock`]).
//!
//! `redis_test::sentinel::RedisSentinelCluster` spawns a similar topology, but with quorum 1,
//! default (30 s) timeouts and processes that cannot be restarted or paused; this module
//! builds it from testkit's [`RedisServer`] instead, which can.

use std::fmt::Write as _;
use std::thread;
use std::time::{Duration, Instant};

use crate::server::RedisServer;

/// Loopback address of every process.
const HOST: &str = "127.0.0.1";
/// Sentinels that must agree the primary is down.
const QUORUM: usize = 2;
/// Number of sentinels.
const SENTINELS: usize = 3;
/// How long [`SentinelCluster::start`] may wait for replication and Sentinel discovery.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);
/// Poll interval of every bounded wait here.
const POLL: Duration = Duration::from_millis(20);
/// Connect and read timeout of the probes (sentinel and ROLE queries).
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Primary + replica + 3 sentinels on free loopback ports; everything is killed (and its temp
/// dir removed) on drop.
///
/// Data servers are addressed by index: 0 started as the primary, 1 as its replica. After a
/// failover the roles swap; ask [`current_primary`](Self::current_primary) or
/// [`current_primary_index`](Self::current_primary_index) for the present one.
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate_testkit::sentinel::SentinelCluster;
///
/// let mut topology = SentinelCluster::start("tollgate");
/// topology.kill_primary();
/// let outage = topology.wait_for_failover(Duration::from_secs(20));
/// println!("failover took {outage:?}; primary now {:?}", topology.current_primary());
/// ```
pub struct SentinelCluster {
    master_name: String,
    data: Vec<RedisServer>,
    sentinels: Vec<RedisServer>,
    /// The primary's address and the instant [`kill_primary`](Self::kill_primary) killed it
    /// (or [`fail_over_via`](Self::fail_over_via) deposed it).
    killed: Option<((String, u16), Instant)>,
}

impl std::fmt::Debug for SentinelCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelCluster")
            .field("master_name", &self.master_name)
            .field("data", &self.data)
            .field("sentinels", &self.sentinels)
            .finish_non_exhaustive()
    }
}

impl SentinelCluster {
    /// Starts the topology, with the sentinels monitoring the primary as `master_name`, and
    /// returns once the replica is in sync and every sentinel knows the replica and the two
    /// other sentinels.
    ///
    /// # Panics
    /// If a process does not start, or replication or Sentinel discovery does not complete
    /// within 20 s (the message carries the logs).
    pub fn start(master_name: &str) -> Self {
        assert!(
            !master_name.is_empty() && !master_name.contains(char::is_whitespace),
            "master name must be one non-empty word, got {master_name:?}"
        );
        // No diskless-sync delay (5 s by default): the replica syncs at once. The config file
        // lets Sentinel's `CONFIG REWRITE` after a promotion succeed.
        let primary = RedisServer::builder()
            .config_file("")
            .extra_args(["--repl-diskless-sync-delay", "0"])
            .start();
        let replica = RedisServer::builder()
            .config_file("")
            .extra_args(["--repl-diskless-sync-delay", "0", "--replicaof", HOST])
            .extra_args([primary.port().to_string()])
            .start();
        let mut topology = Self {
            master_name: master_name.to_owned(),
            data: vec![primary, replica],
            sentinels: Vec::new(),
            killed: None,
        };
        // Sentinels learn replicas from the primary's INFO: start them after the replica is
        // attached, or they would only see it on their next 10 s INFO poll.
        topology.wait_replica_synced(STARTUP_TIMEOUT);

        let config = sentinel_config(master_name, topology.data[0].port());
        for _ in 0..SENTINELS {
            let sentinel = RedisServer::builder()
                .config_file(config.clone())
                .extra_args(["--sentinel"])
                .start();
            topology.sentinels.push(sentinel);
        }
        topology.wait_for_discovery(STARTUP_TIMEOUT);
        topology
    }

    /// The name the sentinels monitor the primary under.
    pub fn master_name(&self) -> &str {
        &self.master_name
    }

    /// `redis://127.0.0.1:PORT` of each sentinel.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// `(host, port)` of each sentinel.
    pub fn sentinel_addrs(&self) -> Vec<(String, u16)> {
        self.sentinels
            .iter()
            .map(|sentinel| (HOST.to_owned(), sentinel.port()))
            .collect()
    }

    /// Port of the server that *started* as the primary (data server 0). After a failover it
    /// is a replica or dead; see [`current_primary`](Self::current_primary).
    pub fn primary_port(&self) -> u16 {
        self.data[0].port()
    }

    /// The data servers: index 0 started as the primary, 1 as the replica.
    pub fn data_servers(&self) -> &[RedisServer] {
        &self.data
    }

    /// Data server `index`, to kill, restart, pause or flush.
    ///
    /// # Panics
    /// If `index` is not 0 or 1.
    pub fn data_server_mut(&mut self, index: usize) -> &mut RedisServer {
        &mut self.data[index]
    }

    /// The three sentinels.
    pub fn sentinels(&self) -> &[RedisServer] {
        &self.sentinels
    }

    /// Sentinel `index` (0..3), to kill, restart or pause.
    ///
    /// # Panics
    /// If `index` is out of range.
    pub fn sentinel_mut(&mut self, index: usize) -> &mut RedisServer {
        &mut self.sentinels[index]
    }

    /// The primary's address according to the first sentinel that answers
    /// `SENTINEL GET-MASTER-ADDR-BY-NAME`.
    ///
    /// # Panics
    /// If no sentinel answers.
    pub fn current_primary(&self) -> (String, u16) {
        self.sentinel_views()
            .into_iter()
            .flatten()
            .next()
            .unwrap_or_else(|| panic!("no sentinel answered.\n{}", self.diagnostics()))
    }

    /// Index (into [`data_servers`](Self::data_servers)) of the primary the sentinels report.
    ///
    /// # Panics
    /// If no sentinel answers, or it reports an address that is not one of the data servers.
    pub fn current_primary_index(&self) -> usize {
        let (_, port) = self.current_primary();
        self.data
            .iter()
            .position(|server| server.port() == port)
            .unwrap_or_else(|| panic!("sentinels report an unknown primary on port {port}"))
    }

    /// Kills (SIGKILL) the data server the sentinels report as primary and remembers when, for
    /// [`wait_for_failover`](Self::wait_for_failover). Returns the killed server's index.
    pub fn kill_primary(&mut self) -> usize {
        let index = self.current_primary_index();
        let port = self.data[index].port();
        self.data[index].kill();
        self.killed = Some(((HOST.to_owned(), port), Instant::now()));
        index
    }

    /// Asks sentinel `via` (an index into [`sentinels`](Self::sentinels)) for a manual
    /// failover (`SENTINEL FAILOVER`): the primary is deposed while it stays up, and a replica
    /// promoted. Remembers the deposed primary and when, as [`kill_primary`](Self::kill_primary)
    /// does, for [`wait_for_failover`](Self::wait_for_failover).
    ///
    /// # Panics
    /// If the sentinel refuses (or does not answer within 2 s).
    pub fn fail_over_via(&mut self, via: usize) {
        let primary = self.current_primary();
        let mut conn = self.sentinels[via]
            .client()
            .get_connection_with_timeout(Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("sentinel {via}: {e}"));
        conn.set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap_or_else(|e| panic!("sentinel {via}: {e}"));
        redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(&self.master_name)
            .exec(&mut conn)
            .unwrap_or_else(|e| panic!("SENTINEL FAILOVER through sentinel {via}: {e}"));
        self.killed = Some((primary, Instant::now()));
    }

    /// Waits until a majority of the sentinels report a primary other than the one
    /// [`kill_primary`](Self::kill_primary) killed (or, without a kill, the one reported when
    /// this call began), and that server answers `ROLE` as master. Returns the time since the
    /// kill (or since this call, without one).
    ///
    /// # Panics
    /// If that does not happen within `timeout` (the message carries the sentinel logs).
    pub fn wait_for_failover(&self, timeout: Duration) -> Duration {
        let (old, since) = self
            .killed
            .clone()
            .unwrap_or_else(|| (self.current_primary(), Instant::now()));
        let deadline = Instant::now() + timeout;
        loop {
            let views = self.sentinel_views();
            let mut candidates: Vec<&(String, u16)> = views
                .iter()
                .flatten()
                .filter(|addr| **addr != old)
                .collect();
            candidates.sort();
            let majority = candidates
                .chunk_by(|a, b| a == b)
                .find(|group| group.len() > SENTINELS / 2)
                .map(|group| group[0]);
            if let Some((host, port)) = majority
                && role(host, *port).as_deref() == Some("master")
            {
                return since.elapsed();
            }
            assert!(
                Instant::now() < deadline,
                "no failover from {old:?} within {timeout:?} (sentinels report {views:?}).\n{}",
                self.diagnostics()
            );
            thread::sleep(POLL);
        }
    }

    /// Restarts data server `index` (empty, as after a crash) and makes it a replica of the
    /// current primary at once with `REPLICAOF`, instead of waiting for the sentinels to
    /// convert it (which takes them about 8 s); returns once it is in sync.
    ///
    /// # Panics
    /// If `index` is the current primary, or the replica does not sync within `timeout`.
    pub fn restart_as_replica(&mut self, index: usize, timeout: Duration) {
        let (host, port) = self.current_primary();
        assert_ne!(
            port,
            self.data[index].port(),
            "data server {index} is the current primary"
        );
        self.data[index].restart();
        let mut conn = connect(self.data[index].port())
            .unwrap_or_else(|| panic!("data server {index} does not answer after its restart"));
        redis::cmd("REPLICAOF")
            .arg(&host)
            .arg(port)
            .exec(&mut conn)
            .unwrap_or_else(|err| panic!("REPLICAOF {host} {port} on data server {index}: {err}"));
        self.wait_replica_synced(timeout);
    }

    /// Waits until the current primary (as the sentinels report it) has at least one replica
    /// online and every replica it lists has acknowledged its whole replication stream. Use it
    /// after writes to know they would survive a failover.
    ///
    /// # Panics
    /// If that does not happen within `timeout`.
    pub fn wait_replica_synced(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let primary = if self.sentinels.is_empty() {
                (HOST.to_owned(), self.data[0].port())
            } else {
                self.current_primary()
            };
            let info = info_replication(&primary.0, primary.1);
            if info.as_deref().is_some_and(replicas_in_sync) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the replica of {primary:?} did not sync within {timeout:?}; INFO replication:\n{}\n{}",
                info.unwrap_or_else(|| "(no answer)".to_owned()),
                self.diagnostics()
            );
            thread::sleep(POLL);
        }
    }

    /// Each sentinel's answer to `GET-MASTER-ADDR-BY-NAME` (`None`: no answer).
    fn sentinel_views(&self) -> Vec<Option<(String, u16)>> {
        self.sentinels
            .iter()
            .map(|sentinel| {
                let mut conn = connect(sentinel.port())?;
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(&self.master_name)
                    .query::<Option<(String, u16)>>(&mut conn)
                    .ok()
                    .flatten()
            })
            .collect()
    }

    /// Waits until every sentinel sees the primary as up, knows the replica and the other
    /// sentinels.
    fn wait_for_discovery(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let ready = self.sentinels.iter().all(|sentinel| {
                let Some(fields) = sentinel_master(sentinel.port(), &self.master_name) else {
                    return false;
                };
                let field = |name: &str| {
                    fields
                        .iter()
                        .find(|(key, _)| key == name)
                        .map(|(_, value)| value.as_str())
                };
                field("flags") == Some("master")
                    && field("num-slaves").is_some_and(|n| n.parse::<usize>().unwrap_or(0) >= 1)
                    && field("num-other-sentinels")
                        .is_some_and(|n| n.parse::<usize>().unwrap_or(0) >= SENTINELS - 1)
            });
            if ready {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "sentinels did not discover the replica and each other within {timeout:?}.\n{}",
                self.diagnostics()
            );
            thread::sleep(POLL);
        }
    }

    /// Roles, sentinel views and logs of every process, for panic messages.
    fn diagnostics(&self) -> String {
        let mut out = String::new();
        for (index, server) in self.data.iter().enumerate() {
            let _ = writeln!(
                out,
                "--- data server {index} (port {}, role {:?}) log ---\n{}",
                server.port(),
                role(HOST, server.port()),
                tail(&server.log_contents(), 40),
            );
        }
        for (index, sentinel) in self.sentinels.iter().enumerate() {
            let _ = writeln!(
                out,
                "--- sentinel {index} (port {}) master view {:?} log ---\n{}",
                sentinel.port(),
                sentinel_master(sentinel.port(), &self.master_name),
                tail(&sentinel.log_contents(), 40),
            );
        }
        out
    }
}

/// A sentinel config monitoring `127.0.0.1:primary_port` as `name` with fast failover.
fn sentinel_config(name: &str, primary_port: u16) -> String {
    format!(
        "sentinel monitor {name} {HOST} {primary_port} {QUORUM}\n\
         sentinel down-after-milliseconds {name} 1000\n\
         sentinel failover-timeout {name} 3000\n\
         sentinel parallel-syncs {name} 1\n"
    )
}

/// A connection to `127.0.0.1:port` with short timeouts, or `None` if it cannot connect.
fn connect(port: u16) -> Option<redis::Connection> {
    connect_to(HOST, port)
}

fn connect_to(host: &str, port: u16) -> Option<redis::Connection> {
    let client = redis::Client::open(format!("redis://{host}:{port}")).ok()?;
    let conn = client.get_connection_with_timeout(PROBE_TIMEOUT).ok()?;
    conn.set_read_timeout(Some(PROBE_TIMEOUT)).ok()?;
    conn.set_write_timeout(Some(PROBE_TIMEOUT)).ok()?;
    Some(conn)
}

/// First element of `ROLE` (`master`, `slave`, `sentinel`), or `None` if it does not answer.
fn role(host: &str, port: u16) -> Option<String> {
    let mut conn = connect_to(host, port)?;
    let reply: Vec<redis::Value> = redis::cmd("ROLE").query(&mut conn).ok()?;
    redis::from_redis_value(reply.into_iter().next()?).ok()
}

fn info_replication(host: &str, port: u16) -> Option<String> {
    let mut conn = connect_to(host, port)?;
    redis::cmd("INFO").arg("replication").query(&mut conn).ok()
}

/// True when `INFO replication` of a primary lists at least one replica, and all of them
/// are online at the primary's offset.
fn replicas_in_sync(info: &str) -> bool {
    let mut master_offset = None;
    let mut replicas = Vec::new();
    for line in info.lines().map(str::trim) {
        if let Some(value) = line.strip_prefix("master_repl_offset:") {
            master_offset = value.parse::<u64>().ok();
        } else if line.starts_with("slave") && line.contains("state=") {
            // slave0:ip=127.0.0.1,port=1234,state=online,offset=42,lag=0
            let field = |name: &str| {
                line.split([':', ','])
                    .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
            };
            replicas.push((
                field("state").map(str::to_owned),
                field("offset").and_then(|n| n.parse::<u64>().ok()),
            ));
        }
    }
    info.contains("role:master")
        && !replicas.is_empty()
        && replicas
            .iter()
            .all(|(state, offset)| state.as_deref() == Some("online") && *offset == master_offset)
}

/// `SENTINEL MASTER name` as field/value pairs, or `None` if the sentinel does not answer.
fn sentinel_master(port: u16, name: &str) -> Option<Vec<(String, String)>> {
    let mut conn = connect(port)?;
    let flat: Vec<String> = redis::cmd("SENTINEL")
        .arg("MASTER")
        .arg(name)
        .query(&mut conn)
        .ok()?;
    Some(
        flat.chunks_exact(2)
            .map(|pair| (pair[0].clone(), pair[1].clone()))
            .collect(),
    )
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::replicas_in_sync;

    #[test]
    fn replicas_in_sync_needs_every_replica_online_at_the_primary_offset() {
        let synced = "# Replication\r\nrole:master\r\nconnected_slaves:1\r\n\
                      slave0:ip=127.0.0.1,port=7001,state=online,offset=42,lag=0\r\n\
                      master_repl_offset:42\r\n";
        assert!(replicas_in_sync(synced));
        assert!(!replicas_in_sync(&synced.replace("offset=42", "offset=41")));
        assert!(!replicas_in_sync(
            &synced.replace("state=online", "state=wait_bgsave")
        ));
        assert!(!replicas_in_sync(
            "role:master\r\nconnected_slaves:0\r\nmaster_repl_offset:42\r\n"
        ));
    }
}
