//! A Redis Cluster on loopback: N primaries (no replicas), each a [`RedisServer`] process in its
//! own temp dir, formed with `redis-cli --cluster create`, plus live slot migration so tests
//! can make clients meet `MOVED` and `ASK` under load.
//!
//! `redis_test::cluster::RedisCluster` forms a cluster too, but its nodes cannot be restarted
//! or paused and it has no slot migration; this module builds on testkit's [`RedisServer`].
//! A node restarted with [`RedisServer::restart`] keeps its `nodes.conf` (so it rejoins as the
//! same node) but not its data.

use std::fmt::Write as _;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use crate::clock::ServerClock;
use crate::server::RedisServer;

/// Loopback address of every node.
const HOST: &str = "127.0.0.1";

/// A cluster node's arguments (the config file is relative to `--dir`: the node's own data dir).
const NODE_ARGS: [&str; 6] = [
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
    "nodes.conf",
    "--cluster-node-timeout",
    "2000",
];
/// Number of hash slots in Redis Cluster.
pub const SLOTS: u16 = 16384;
/// How long forming the cluster, or a slot's new owner spreading, may take.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(20);
/// Poll interval of every bounded wait here.
const POLL: Duration = Duration::from_millis(20);
/// Connect and read timeout of the admin connections.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Keys moved per `MIGRATE` call.
const MIGRATE_BATCH: usize = 100;
/// `MIGRATE` timeout, in milliseconds.
const MIGRATE_TIMEOUT_MS: u64 = 5000;

/// A running Redis Cluster of N primaries on free loopback ports, covering all 16384 slots;
/// every node is killed (and its temp dir removed) on drop.
///
/// ```no_run
/// use tollgate_testkit::cluster::RedisCluster;
///
/// let cluster = RedisCluster::start(3);
/// let client = redis::cluster::ClusterClient::new(cluster.urls()).unwrap();
/// let slot = RedisCluster::slot_of(b"bucket:alice");
/// let (from, to) = (cluster.node_for_slot(slot), (cluster.node_for_slot(slot) + 1) % 3);
/// let migration = cluster.begin_slot_migration(slot, from, to, 10); // the ASK window is open
/// // ... run load against `client` ...
/// let report = migration.finish();
/// println!("moved {} keys in {:?}", report.keys_moved, report.elapsed);
/// ```
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    ids: Vec<String>,
}

impl std::fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCluster")
            .field("nodes", &self.nodes)
            .field("ids", &self.ids)
            .finish()
    }
}

impl RedisCluster {
    /// Starts `primaries` cluster-enabled servers (`--cluster-node-timeout 2000`), forms them
    /// into a cluster with `redis-cli --cluster create --cluster-replicas 0`, and returns once
    /// every node reports `cluster_state:ok` and knows every other node.
    ///
    /// # Panics
    /// If `primaries < 3` (redis-cli's minimum), `redis-cli` is missing, or the cluster does
    /// not form within 20 s (the message carries the logs).
    pub fn start(primaries: usize) -> Self {
        Self::start_with(primaries, None)
    }

    /// [`start`](Self::start) with every node on `clock` (one control file: the nodes' time
    /// moves together when the test moves it, forward or back). Gossip survives a frozen or
    /// moved clock: node timeouts are measured between a ping and its pong.
    ///
    /// # Panics
    /// As [`start`](Self::start).
    pub fn start_on_clock(primaries: usize, clock: &ServerClock) -> Self {
        Self::start_with(primaries, Some(clock))
    }

    fn start_with(primaries: usize, clock: Option<&ServerClock>) -> Self {
        assert!(
            primaries >= 3,
            "a Redis Cluster needs at least 3 primaries, got {primaries}"
        );
        let nodes: Vec<RedisServer> = (0..primaries)
            .map(|_| {
                let builder = RedisServer::builder();
                let builder = match clock {
                    Some(clock) => builder.clock(clock.clone()),
                    None => builder,
                };
                builder.extra_args(NODE_ARGS).start()
            })
            .collect();
        let output = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(nodes.iter().map(|node| format!("{HOST}:{}", node.port())))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap_or_else(|err| {
                panic!("failed to run redis-cli (install Debian's redis-tools): {err}")
            });
        let mut cluster = Self {
            nodes,
            ids: Vec::new(),
        };
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed ({}):\n{}\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
            cluster.diagnostics(),
        );
        cluster.ids = (0..cluster.nodes.len())
            .map(|index| {
                redis::cmd("CLUSTER")
                    .arg("MYID")
                    .query(&mut cluster.admin(index))
                    .expect("CLUSTER MYID")
            })
            .collect();
        cluster.wait_until_converged(CONVERGE_TIMEOUT);
        cluster
    }

    /// A cluster-enabled server that is no cluster's node yet: an empty primary to
    /// [`join`](Self::join) to a running cluster (scaling out).
    pub fn empty_node() -> RedisServer {
        RedisServer::builder().extra_args(NODE_ARGS).start()
    }

    /// Makes `node` (an [`empty_node`](Self::empty_node)) meet this cluster, and returns its
    /// node id once every node knows it at `announced_port` (its own port, unless it announces
    /// another with `cluster-announce-port`) and it knows every node with `cluster_state:ok`.
    /// It owns no slot: it is in no slot map until a slot moves to it. It is not added to
    /// [`nodes`](Self::nodes).
    ///
    /// # Panics
    /// If a command fails or the node has not joined within 20 s.
    pub fn join(&self, node: &RedisServer, announced_port: u16) -> String {
        let admin = |server: &RedisServer| {
            let conn = server
                .client()
                .get_connection_with_timeout(ADMIN_TIMEOUT)
                .expect("connect to the joining node");
            conn.set_read_timeout(Some(ADMIN_TIMEOUT))
                .expect("set read timeout");
            conn
        };
        let cluster_text = |server: &RedisServer, what: &str| -> String {
            redis::cmd("CLUSTER")
                .arg(what)
                .query(&mut admin(server))
                .unwrap_or_else(|err| panic!("CLUSTER {what}: {err}"))
        };
        let id: String = redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut admin(node))
            .expect("CLUSTER MYID");
        redis::cmd("CLUSTER")
            .arg("MEET")
            .arg(HOST)
            .arg(node.port())
            .exec(&mut self.admin(0))
            .expect("CLUSTER MEET");
        let known = format!("cluster_known_nodes:{}\r", self.nodes.len() + 1);
        let at = format!("{id} {HOST}:{announced_port}");
        let started = Instant::now();
        loop {
            let joined = self
                .nodes
                .iter()
                .chain([node])
                .all(|n| cluster_text(n, "INFO").contains(&known))
                && cluster_text(node, "INFO").contains("cluster_state:ok")
                && {
                    let nodes = cluster_text(node, "NODES");
                    self.ids.iter().all(|other| nodes.contains(other.as_str()))
                }
                && self
                    .nodes
                    .iter()
                    .all(|n| cluster_text(n, "NODES").contains(&at));
            if joined {
                return id;
            }
            assert!(
                started.elapsed() < CONVERGE_TIMEOUT,
                "node {id} did not join within {CONVERGE_TIMEOUT:?}:\n{}",
                self.diagnostics()
            );
            thread::sleep(POLL);
        }
    }

    /// The nodes, in start order; index them for [`node_for_slot`](Self::node_for_slot) and
    /// the migrations.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Node `index`, to kill, restart or pause.
    ///
    /// # Panics
    /// If `index` is out of range.
    pub fn node_mut(&mut self, index: usize) -> &mut RedisServer {
        &mut self.nodes[index]
    }

    /// Node `index`'s cluster node id.
    ///
    /// # Panics
    /// If `index` is out of range.
    pub fn node_id(&self, index: usize) -> &str {
        &self.ids[index]
    }

    /// `redis://127.0.0.1:PORT` of every node: initial nodes for `redis::cluster::ClusterClient`
    /// (or `redis::cluster_async`).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// Connection info of every node, for `ClusterClient::new`.
    pub fn initial_nodes(&self) -> Vec<redis::ConnectionInfo> {
        self.nodes
            .iter()
            .map(RedisServer::connection_info)
            .collect()
    }

    /// The hash slot of `key` (CRC16/XMODEM of the key, or of its `{hash tag}`, mod 16384), as
    /// `CLUSTER KEYSLOT` computes it.
    pub fn slot_of(key: impl AsRef<[u8]>) -> u16 {
        let key = key.as_ref();
        let hashed = key
            .iter()
            .position(|&byte| byte == b'{')
            .and_then(|open| {
                let rest = &key[open + 1..];
                let close = rest.iter().position(|&byte| byte == b'}')?;
                (close > 0).then(|| &rest[..close])
            })
            .unwrap_or(key);
        crc16_xmodem(hashed) % SLOTS
    }

    /// A hash tag whose keys (`{tag}…`) all land in `slot`: use it to put test keys in a slot
    /// you are about to migrate.
    ///
    /// # Panics
    /// If `slot >= 16384`.
    pub fn hash_tag_for_slot(slot: u16) -> String {
        assert!(slot < SLOTS, "slot {slot} out of range 0..{SLOTS}");
        // CRC16 spreads short decimal strings over all slots; 2^20 candidates cover every
        // slot many times over (checked for all slots by a unit test).
        (0..1_u32 << 20)
            .map(|n| format!("t{n}"))
            .find(|tag| crc16_xmodem(tag.as_bytes()) % SLOTS == slot)
            .expect("every slot has a tag among the candidates")
    }

    /// Index of the node that owns each of `keys` (Redis keys, as a store writes them), by
    /// [`Self::slot_of`] and [`Self::node_for_slot`].
    ///
    /// # Panics
    /// As [`Self::node_for_slot`].
    pub fn nodes_for_keys<K: AsRef<[u8]>>(&self, keys: impl IntoIterator<Item = K>) -> Vec<usize> {
        keys.into_iter()
            .map(|key| self.node_for_slot(Self::slot_of(key)))
            .collect()
    }

    /// Index of the node that owns `slot`, according to node 0's `CLUSTER SLOTS` (or the first
    /// node that answers).
    ///
    /// # Panics
    /// If no node answers or no node owns the slot.
    pub fn node_for_slot(&self, slot: u16) -> usize {
        let view = (0..self.nodes.len())
            .find_map(|index| self.try_slot_owners(index))
            .unwrap_or_else(|| panic!("no node answered CLUSTER SLOTS.\n{}", self.diagnostics()));
        let Some(&(_, port)) = view.iter().find(|(range, _)| range.contains(&slot)) else {
            panic!("no node owns slot {slot}: {view:?}");
        };
        self.index_of_port(port)
    }

    /// Moves `slot` from node `from` to node `to` the way `redis-cli --cluster reshard` does:
    /// `SETSLOT IMPORTING`/`MIGRATING`, `MIGRATE` of every key in batches of 100
    /// (`GETKEYSINSLOT`), then `SETSLOT NODE` on every node; returns once every node agrees
    /// on the new owner.
    ///
    /// # Panics
    /// See [`begin_slot_migration`](Self::begin_slot_migration) and
    /// [`SlotMigration::finish`].
    pub fn migrate_slot(&self, slot: u16, from: usize, to: usize) -> MigrationReport {
        self.begin_slot_migration(slot, from, to, 0).finish()
    }

    /// Opens the ASK window for `slot`: marks it `IMPORTING` on `to` and `MIGRATING` on
    /// `from`, then moves up to `keys_to_move` of its keys. While the returned
    /// [`SlotMigration`] is open, a command for a moved (or absent) key sent to `from` gets
    /// `-ASK`, and one sent to `to` without `ASKING` gets `-MOVED` back to `from`.
    ///
    /// Finish it with [`SlotMigration::finish`]; dropping it leaves the slot half migrated.
    ///
    /// # Panics
    /// If an index is out of range, `from == to`, `from` does not own the slot, or a command
    /// fails.
    pub fn begin_slot_migration(
        &self,
        slot: u16,
        from: usize,
        to: usize,
        keys_to_move: usize,
    ) -> SlotMigration<'_> {
        assert!(slot < SLOTS, "slot {slot} out of range 0..{SLOTS}");
        assert!(
            from < self.nodes.len() && to < self.nodes.len() && from != to,
            "bad migration {from} -> {to} in a cluster of {}",
            self.nodes.len()
        );
        let owner = self.node_for_slot(slot);
        assert_eq!(
            owner, from,
            "slot {slot} is owned by node {owner}, not node {from}"
        );
        let started = Instant::now();
        // Importing first, so that once the source starts answering ASK the target accepts
        // the redirected commands.
        self.setslot(to, slot, "IMPORTING", Some(from));
        self.setslot(from, slot, "MIGRATING", Some(to));
        let mut migration = SlotMigration {
            cluster: self,
            slot,
            from,
            to,
            keys_moved: 0,
            batches: 0,
            started,
        };
        migration.move_keys(keys_to_move);
        migration
    }

    fn setslot(&self, index: usize, slot: u16, state: &str, node: Option<usize>) {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SETSLOT").arg(slot).arg(state);
        if let Some(node) = node {
            cmd.arg(&self.ids[node]);
        }
        cmd.exec(&mut self.admin(index)).unwrap_or_else(|err| {
            panic!("CLUSTER SETSLOT {slot} {state} {node:?} on node {index} failed: {err}")
        });
    }

    /// An admin connection to node `index` with 5 s timeouts.
    fn admin(&self, index: usize) -> redis::Connection {
        let conn = self.nodes[index]
            .client()
            .get_connection_with_timeout(ADMIN_TIMEOUT)
            .unwrap_or_else(|err| panic!("cannot connect to cluster node {index}: {err}"));
        conn.set_read_timeout(Some(ADMIN_TIMEOUT))
            .expect("set read timeout");
        conn
    }

    /// Slot ranges and owner ports according to node `index`, or `None` if it does not answer.
    fn try_slot_owners(&self, index: usize) -> Option<Vec<(std::ops::RangeInclusive<u16>, u16)>> {
        let client = self.nodes[index].client();
        let mut conn = client
            .get_connection_with_timeout(Duration::from_millis(500))
            .ok()?;
        conn.set_read_timeout(Some(Duration::from_millis(500)))
            .ok()?;
        // Each entry: [start, end, [ip, port, id, ...], replicas...].
        let entries: Vec<Vec<redis::Value>> =
            redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn).ok()?;
        entries
            .into_iter()
            .map(|entry| {
                let mut fields = entry.into_iter();
                let start: u16 = redis::from_redis_value(fields.next()?).ok()?;
                let end: u16 = redis::from_redis_value(fields.next()?).ok()?;
                let primary: Vec<redis::Value> = redis::from_redis_value(fields.next()?).ok()?;
                let port: u16 = redis::from_redis_value(primary.get(1)?.clone()).ok()?;
                Some((start..=end, port))
            })
            .collect()
    }

    fn index_of_port(&self, port: u16) -> usize {
        self.nodes
            .iter()
            .position(|node| node.port() == port)
            .unwrap_or_else(|| panic!("port {port} is not a node of this cluster"))
    }

    /// Waits until every node says `cluster_state:ok`, knows all nodes, and they all agree on
    /// who owns every slot.
    fn wait_until_converged(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let states_ok = (0..self.nodes.len()).all(|index| {
                let Ok(mut conn) = self.nodes[index]
                    .client()
                    .get_connection_with_timeout(Duration::from_millis(500))
                else {
                    return false;
                };
                let _ = conn.set_read_timeout(Some(Duration::from_millis(500)));
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut conn)
                    .unwrap_or_default();
                info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_known_nodes:{}\r", self.nodes.len()))
            });
            let views: Vec<_> = (0..self.nodes.len())
                .map(|index| {
                    self.try_slot_owners(index).map(|mut view| {
                        view.sort_by_key(|(range, _)| *range.start());
                        view
                    })
                })
                .collect();
            let agree = views.iter().all(|view| view.is_some() && *view == views[0]);
            if states_ok && agree {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not converge within {timeout:?} (slot views {views:?}).\n{}",
                self.diagnostics()
            );
            thread::sleep(POLL);
        }
    }

    /// `CLUSTER NODES` and the log tail of every node, for panic messages.
    fn diagnostics(&self) -> String {
        let mut out = String::new();
        for (index, node) in self.nodes.iter().enumerate() {
            let nodes: Option<String> = node
                .client()
                .get_connection_with_timeout(Duration::from_millis(500))
                .ok()
                .and_then(|mut conn| {
                    let _ = conn.set_read_timeout(Some(Duration::from_millis(500)));
                    redis::cmd("CLUSTER").arg("NODES").query(&mut conn).ok()
                });
            let log = node.log_contents();
            let lines: Vec<&str> = log.lines().collect();
            let _ = writeln!(
                out,
                "--- node {index} (port {}) CLUSTER NODES ---\n{}\n--- log ---\n{}",
                node.port(),
                nodes.as_deref().unwrap_or("(no answer)"),
                lines[lines.len().saturating_sub(30)..].join("\n"),
            );
        }
        out
    }
}

/// A slot migration in progress (the ASK window), from
/// [`RedisCluster::begin_slot_migration`].
#[derive(Debug)]
#[must_use = "a slot migration left open keeps the slot half migrated; call .finish()"]
pub struct SlotMigration<'a> {
    cluster: &'a RedisCluster,
    slot: u16,
    from: usize,
    to: usize,
    keys_moved: usize,
    batches: usize,
    started: Instant,
}

/// What a finished slot migration did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigrationReport {
    /// The slot that moved.
    pub slot: u16,
    /// Index of the node that owned it.
    pub from: usize,
    /// Index of the node that owns it now.
    pub to: usize,
    /// Keys moved with `MIGRATE`.
    pub keys_moved: usize,
    /// `MIGRATE` calls made.
    pub batches: usize,
    /// From `SETSLOT IMPORTING` until every node agreed on the new owner.
    pub elapsed: Duration,
}

impl SlotMigration<'_> {
    /// The slot being migrated.
    pub fn slot(&self) -> u16 {
        self.slot
    }

    /// Index of the source node (answers `-ASK` for keys it no longer has).
    pub fn from(&self) -> usize {
        self.from
    }

    /// Index of the target node.
    pub fn to(&self) -> usize {
        self.to
    }

    /// Keys moved so far.
    pub fn keys_moved(&self) -> usize {
        self.keys_moved
    }

    /// Moves up to `max` more keys of the slot from the source to the target (in `MIGRATE`
    /// batches of 100), returning how many moved: fewer when the source has no more.
    ///
    /// # Panics
    /// If `GETKEYSINSLOT` or `MIGRATE` fails.
    pub fn move_keys(&mut self, max: usize) -> usize {
        let mut moved = 0;
        while moved < max {
            let batch = (max - moved).min(MIGRATE_BATCH);
            let n = self.migrate_batch(batch);
            if n == 0 {
                break;
            }
            moved += n;
        }
        moved
    }

    /// Moves every remaining key, then assigns the slot to the target on every node (target
    /// first, then source, then the others) and waits until all of them agree.
    ///
    /// # Panics
    /// If a command fails or the nodes do not agree within 20 s.
    pub fn finish(mut self) -> MigrationReport {
        while self.migrate_batch(MIGRATE_BATCH) > 0 {}
        let cluster = self.cluster;
        let mut order = vec![self.to, self.from];
        order.extend((0..cluster.nodes.len()).filter(|i| *i != self.to && *i != self.from));
        for index in order {
            cluster.setslot(index, self.slot, "NODE", Some(self.to));
        }
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        let to_port = cluster.nodes[self.to].port();
        loop {
            let views: Vec<Option<u16>> = (0..cluster.nodes.len())
                .map(|index| {
                    cluster.try_slot_owners(index).and_then(|view| {
                        view.iter()
                            .find(|(range, _)| range.contains(&self.slot))
                            .map(|(_, port)| *port)
                    })
                })
                .collect();
            if views.iter().all(|port| *port == Some(to_port)) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "nodes did not agree that slot {} moved to node {} within {CONVERGE_TIMEOUT:?}: \
                 owners by node {views:?}.\n{}",
                self.slot,
                self.to,
                cluster.diagnostics()
            );
            thread::sleep(POLL);
        }
        MigrationReport {
            slot: self.slot,
            from: self.from,
            to: self.to,
            keys_moved: self.keys_moved,
            batches: self.batches,
            elapsed: self.started.elapsed(),
        }
    }

    /// Moves up to `count` keys in one `MIGRATE`; returns how many.
    fn migrate_batch(&mut self, count: usize) -> usize {
        let cluster = self.cluster;
        let mut source = cluster.admin(self.from);
        let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(self.slot)
            .arg(count)
            .query(&mut source)
            .unwrap_or_else(|err| panic!("GETKEYSINSLOT {} failed: {err}", self.slot));
        if keys.is_empty() {
            return 0;
        }
        redis::cmd("MIGRATE")
            .arg(HOST)
            .arg(cluster.nodes[self.to].port())
            .arg("")
            .arg(0)
            .arg(MIGRATE_TIMEOUT_MS)
            .arg("KEYS")
            .arg(&keys)
            .exec(&mut source)
            .unwrap_or_else(|err| {
                panic!(
                    "MIGRATE of {} keys of slot {} to node {} failed: {err}",
                    keys.len(),
                    self.slot,
                    self.to
                )
            });
        self.keys_moved += keys.len();
        self.batches += 1;
        keys.len()
    }
}

/// CRC16/XMODEM (polynomial 0x1021, initial value 0), the checksum Redis Cluster hashes keys
/// with.
fn crc16_xmodem(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 == 0 {
                crc << 1
            } else {
                (crc << 1) ^ 0x1021
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::{RedisCluster, SLOTS};

    #[test]
    fn slot_of_matches_the_redis_cluster_spec_examples() {
        // The reference value from the Redis Cluster spec: CRC16("123456789") = 0x31C3.
        assert_eq!(super::crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(RedisCluster::slot_of("foo"), 12182);
        assert_eq!(RedisCluster::slot_of("bar"), 5061);
        // Hash tags: only the first non-empty {...} counts.
        assert_eq!(
            RedisCluster::slot_of("{user1000}.following"),
            RedisCluster::slot_of("user1000")
        );
        assert_ne!(
            RedisCluster::slot_of("foo{}{bar}"),
            RedisCluster::slot_of("bar")
        );
        assert_eq!(
            RedisCluster::slot_of("foo{{bar}}zap"),
            RedisCluster::slot_of("{bar")
        );
    }

    #[test]
    fn hash_tag_candidates_cover_every_slot() {
        let mut covered = vec![false; usize::from(SLOTS)];
        for n in 0..1_u32 << 20 {
            covered[usize::from(super::crc16_xmodem(format!("t{n}").as_bytes()) % SLOTS)] = true;
        }
        assert!(covered.iter().all(|hit| *hit));
        for slot in [0, 1, 8191, SLOTS - 1] {
            let tag = RedisCluster::hash_tag_for_slot(slot);
            assert_eq!(RedisCluster::slot_of(format!("{{{tag}}}:key")), slot);
        }
    }
}
