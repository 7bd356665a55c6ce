//! Building a [`RedisStore`]: where Redis is (one server, the primary Sentinel names, or a
//! Cluster), the key prefix, the per-call timeout and the connection kind.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType};
use redis::{AsyncConnectionConfig, RedisConnectionInfo, Value};
use tollgate_core::{KeyError, StoreError};

use crate::connection::{Cluster, Conn, Managed, Pool, SentinelConn};
use crate::error::classify;
use crate::redact::{RedactedUrls, redact_url};
use crate::registry::{RedisRegistry, RegistryError};
use crate::store::{Inner, RedisStore};

/// The key prefix used unless [`RedisStoreBuilder::prefix`] sets another.
pub const DEFAULT_PREFIX: &str = "tollgate:";

/// The per-call timeout used unless [`RedisStoreBuilder::timeout`] sets another.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// The connect timeout used unless [`RedisStoreBuilder::connect_timeout`] sets another.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Connections in the pool a store uses unless [`RedisStoreBuilder::multiplexed`] or
/// [`RedisStoreBuilder::pool`] says otherwise. A pool is the default because it was the faster
/// in the side-by-side runs of `benches/scripts/redis-compare.sh`: with 16 concurrent callers
/// a pool of 4, connecting on demand, made 1.39 × (one runtime thread) and 1.56 × (two) the
/// decisions of one multiplexed connection; with 64 they were within the rounds' spread.
/// Larger pools gained nothing reliable, and a pool with every connection in use
/// ([`RedisStore::connect_all`](crate::RedisStore::connect_all)) was slower than one on
/// demand. BENCHMARKS.md has the figures (goal 7).
pub const DEFAULT_POOL_SIZE: u32 = 4;

/// The longest key prefix accepted, in bytes.
pub const MAX_PREFIX_LEN: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Multiplexed,
    Pool(u32),
}

/// Where the buckets live. Its `Debug` shows every URL through [`redact_url`].
#[derive(Clone)]
enum Target {
    /// One server.
    Url(String),
    /// The primary that the sentinels name `master`, connected to with `primary`.
    Sentinel {
        master: String,
        sentinels: RedactedUrls,
        primary: PrimaryAuth,
    },
    /// A Redis Cluster, discovered from these nodes.
    Cluster(RedactedUrls),
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Url(url) => f.debug_tuple("Url").field(&redact_url(url)).finish(),
            Self::Sentinel {
                master,
                sentinels,
                primary,
            } => f
                .debug_struct("Sentinel")
                .field("master", master)
                .field("sentinels", sentinels)
                .field("primary", primary)
                .finish(),
            Self::Cluster(nodes) => f.debug_tuple("Cluster").field(nodes).finish(),
        }
    }
}

/// How a Sentinel store authenticates to the data nodes (the primary, and each replica once
/// promoted) and which database it uses. Its `Debug` hides the password.
#[derive(Clone, Default, PartialEq, Eq)]
struct PrimaryAuth {
    username: Option<String>,
    password: Option<String>,
    db: i64,
    /// Connect to the data nodes over verified TLS.
    tls: bool,
}

impl fmt::Debug for PrimaryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrimaryAuth")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("db", &self.db)
            .field("tls", &self.tls)
            .finish()
    }
}

impl PrimaryAuth {
    /// The settings redis-rs connects to the primary with: these credentials and database,
    /// over RESP3.
    fn node_connection_info(&self) -> SentinelNodeConnectionInfo {
        // RESP3 always, so a closed primary connection is noticed while idle (see `with_resp3`)
        let mut info = RedisConnectionInfo::default()
            .set_db(self.db)
            .set_protocol(redis::ProtocolVersion::RESP3);
        if let Some(username) = &self.username {
            info = info.set_username(username);
        }
        if let Some(password) = &self.password {
            info = info.set_password(password);
        }
        let node = SentinelNodeConnectionInfo::default().set_redis_connection_info(info);
        if self.tls {
            node.set_tls_mode(redis::TlsMode::Secure)
        } else {
            node
        }
    }
}

impl RedisStore {
    /// Starts configuring a store on the primary that the sentinels at `sentinel_urls`
    /// (`redis://host:port`, with `user:password@` if the sentinels need it) monitor as
    /// `master_name`.
    ///
    /// The sentinel URLs' credentials are the sentinels' own. The primary's — the
    /// `requirepass` or ACL user of the data nodes, which the sentinels do not hand out — are
    /// given separately with [`primary_password`](RedisStoreBuilder::primary_password) or
    /// [`primary_credentials`](RedisStoreBuilder::primary_credentials), and a database other
    /// than 0 with [`primary_db`](RedisStoreBuilder::primary_db); every data node that may
    /// become the primary must accept them. Without them, a password-protected primary refuses
    /// the store: [`build`](RedisStoreBuilder::build) fails with a [`StoreError::Script`] that
    /// says the authentication failed (a misconfiguration, never taken for an outage).
    ///
    /// The store asks the sentinels for the primary, checks that it answers `ROLE` as master,
    /// and keeps one multiplexed connection to it. When a call fails in a way that says the
    /// server may no longer be the primary — connection lost or refused, `READONLY`,
    /// `MASTERDOWN`, or a call abandoned at its deadline — that call fails (it is never
    /// resent) and the next one asks the sentinels again, so after a failover the store
    /// follows the promoted replica by itself. The promoted replica's empty script cache is
    /// absorbed like any `NOSCRIPT`.
    ///
    /// The sentinels are asked side by side and the first that names a server answering `ROLE`
    /// as master is followed, so one that is down or hangs (a frozen process, a host that drops
    /// packets) does not hold up the others.
    ///
    /// A primary deposed while it stays up — `SENTINEL FAILOVER`, or a primary cut off and
    /// back — keeps answering as master until the sentinels convert it to a replica, some 10 s
    /// after the promotion, and whatever it decides meanwhile is lost when it resyncs, while
    /// other instances already decide on the promoted replica. So the store also watches every
    /// sentinel, each on a background task and a connection of its own (over RESP3): it
    /// subscribes to the sentinel's `+switch-master` announcements and, on every
    /// (re)subscription, asks `SENTINEL GET-MASTER-ADDR-BY-NAME` (a switch missed while not
    /// subscribed). When one names another server for the master, the connection is dropped
    /// and the next call asks the sentinels again; calls already sent finish on it, nothing is
    /// resent, and no call waits on a watch. A watch whose sentinel is down, or does not answer
    /// a `PING` every 5 s within the connect timeout, connects again after a back-off of up to
    /// 5 s; the other sentinels' watches carry on meanwhile. The watches end when the store is
    /// dropped. Measured on loopback, the last decision on the deposed primary came about 0.9 s
    /// after the promotion (about 11 s without the watches).
    ///
    /// Until the sentinels have promoted a replica, calls fail as
    /// [`StoreError::Unavailable`]; bucket state the old primary had not yet replicated is lost
    /// (Redis replication is asynchronous). [`multiplexed`](RedisStoreBuilder::multiplexed)
    /// and [`pool`](RedisStoreBuilder::pool) do not apply.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tollgate_core::StoreError> {
    /// use tollgate_redis::RedisStore;
    ///
    /// let store = RedisStore::sentinel(
    ///     "rate-limits",
    ///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
    /// )
    /// .primary_credentials("tollgate", "CHANGE-ME")
    /// .build()
    /// .await?;
    /// # Ok(()) }
    /// ```
    pub fn sentinel<I, S>(master_name: impl Into<String>, sentinel_urls: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder::with_target(Target::Sentinel {
            master: master_name.into(),
            sentinels: RedactedUrls(sentinel_urls.into_iter().map(Into::into).collect()),
            primary: PrimaryAuth::default(),
        })
    }

    /// Starts configuring a store on a Redis Cluster, discovered from `initial_nodes`
    /// (`redis://host:port` of one or more of its nodes).
    ///
    /// Every bucket is one key with the whole [`Key`](tollgate_core::Key) as its hash tag, so
    /// each script runs on one slot of one node. The store follows `MOVED` and `ASK` (a slot
    /// being resharded) itself, up to 5 redirections per call, so a migration is invisible to
    /// callers — also towards a node that joined after the store connected (it is in no slot
    /// map until it owns a slot, so it is reached on a direct connection made with the first
    /// initial node's credentials and TLS settings). A node whose connection stalls silently
    /// (a dropped path: calls abandoned at their deadlines) is probed with a `PING` within the
    /// connect timeout, and without an answer the cluster connection is replaced by a fresh
    /// one, as the other connection kinds do. A connection a node closes while idle (its
    /// `timeout`, `CLIENT KILL`, a load balancer's idle cut) is replaced before the next call:
    /// the store speaks RESP3, over which redis-rs hears of the close, unless the first
    /// node's URL names a protocol (`?protocol=resp2`: then the first call on each closed
    /// connection fails as unavailable). It never resends a command after a connection
    /// failure, so every decision is applied at most once. A batch ([`acquire_many`](tollgate_core::Store::acquire_many))
    /// sends all its scripts at once, each to its key's node: one round trip per node, the
    /// nodes in parallel. `CLUSTERDOWN` and `TRYAGAIN` are [`StoreError::Unavailable`].
    /// [`multiplexed`](RedisStoreBuilder::multiplexed) and [`pool`](RedisStoreBuilder::pool)
    /// do not apply: the cluster connection keeps one multiplexed connection per node.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), tollgate_core::StoreError> {
    /// use tollgate_redis::RedisStore;
    ///
    /// let store = RedisStore::cluster(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])
    ///     .build()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn cluster<I, S>(initial_nodes: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder::with_target(Target::Cluster(RedactedUrls(
            initial_nodes.into_iter().map(Into::into).collect(),
        )))
    }
}

/// The Sentinel store's connection settings for the data nodes.
impl RedisStoreBuilder {
    /// Sentinel only: authenticates to the primary with `password` (`AUTH password`: the
    /// data nodes' `requirepass`, i.e. the `default` user's password). The sentinels' own
    /// password goes in their URLs, and Sentinel's `auth-pass` is theirs to reach the data
    /// nodes: neither is used for this. For an ACL user, see
    /// [`primary_credentials`](Self::primary_credentials).
    ///
    /// Applies to every primary the store connects to, including a replica promoted by a
    /// failover. A single server or a Cluster takes its credentials from its URLs
    /// (`redis://user:password@host:port/db`); this is ignored there.
    pub fn primary_password(self, password: impl Into<String>) -> Self {
        self.with_primary(|auth| {
            auth.username = None;
            auth.password = Some(password.into());
        })
    }

    /// Sentinel only: authenticates to the primary as the ACL user `username` with `password`
    /// (`AUTH username password`); otherwise as
    /// [`primary_password`](Self::primary_password).
    pub fn primary_credentials(
        self,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.with_primary(|auth| {
            auth.username = Some(username.into());
            auth.password = Some(password.into());
        })
    }

    /// Sentinel only: keeps the buckets in database `db` of the primary (`SELECT db`; default
    /// 0). A single server takes it from its URL's path; a Cluster has only database 0.
    pub fn primary_db(self, db: i64) -> Self {
        self.with_primary(|auth| auth.db = db)
    }

    /// Sentinel only: connects to the data nodes over TLS, verifying each node's certificate
    /// (issued for the address the sentinels report, usually an IP) against the system's
    /// roots, or those in `SSL_CERT_FILE` / `SSL_CERT_DIR`, as a `rediss://` URL does. The
    /// sentinels must monitor the nodes' TLS ports (`tls-replication yes` on the sentinels
    /// and nodes), since the store connects to the address they report. The sentinels
    /// themselves are reached over TLS when their URLs are `rediss://`.
    #[cfg(feature = "tls")]
    pub fn primary_tls(self) -> Self {
        self.with_primary(|auth| auth.tls = true)
    }

    fn with_primary(mut self, set: impl FnOnce(&mut PrimaryAuth)) -> Self {
        if let Target::Sentinel { primary, .. } = &mut self.target {
            set(primary);
        }
        self
    }
}

/// Configures and connects a [`RedisStore`]; see [`RedisStore::builder`],
/// [`RedisStore::sentinel`] and [`RedisStore::cluster`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    target: Target,
    prefix: String,
    timeout: Duration,
    connect_timeout: Duration,
    kind: Kind,
}

impl RedisStoreBuilder {
    pub(crate) fn new(url: String) -> Self {
        Self::with_target(Target::Url(url))
    }

    fn with_target(target: Target) -> Self {
        Self {
            target,
            prefix: DEFAULT_PREFIX.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            kind: Kind::Pool(DEFAULT_POOL_SIZE),
        }
    }

    /// The prefix of every key the store writes (default [`DEFAULT_PREFIX`]): up to 64 bytes of
    /// `[A-Za-z0-9:_.-]`. Braces are refused, since they would change the hash slot.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The deadline of each store call, including a NOSCRIPT reload and a pool checkout
    /// (default [`DEFAULT_TIMEOUT`]). A call that misses it fails with
    /// [`StoreError::Timeout`]. A timed-out call may still be applied by the server later (the
    /// command was sent); the store never retries it, so it is applied at most once.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The deadline for connecting (in [`build`](Self::build) and on reconnects; default
    /// [`DEFAULT_CONNECT_TIMEOUT`]).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Uses one multiplexed connection that reconnects by itself (redis-rs's
    /// `ConnectionManager`) instead of the default pool. Every clone of the store shares it;
    /// concurrent calls are pipelined on it. Only for a single server.
    pub fn multiplexed(mut self) -> Self {
        self.kind = Kind::Multiplexed;
        self
    }

    /// Uses a bb8 pool of up to `size` multiplexed connections (at least 1; the default is a
    /// pool of [`DEFAULT_POOL_SIZE`]). A call takes an idle connection and gives it back at
    /// once (it holds none while it waits for its reply, so no call queues behind another);
    /// a connection is made only when a call finds none idle. So the pool grows as calls
    /// contend, up to `size`: on one runtime thread it keeps the one connection it starts
    /// with. [`RedisStore::connect_all`](crate::RedisStore::connect_all) makes them all at
    /// once. Only for a single server.
    pub fn pool(mut self, size: u32) -> Self {
        self.kind = Kind::Pool(size.max(1));
        self
    }

    /// Validates the configuration, connects, and loads the scripts into the server's cache
    /// (every primary's, on a Cluster).
    ///
    /// Fails with [`StoreError::InvalidKey`] for a bad prefix, and with
    /// [`StoreError::Unavailable`] for an unparsable URL (`redis://`, `rediss://` with the
    /// `tls` feature, `redis://user:password@host:port/db`), an empty list of sentinels or
    /// cluster nodes, or a Redis that refuses or drops the connection. One that does not answer
    /// within the connect timeout (which bounds connecting and loading the scripts together)
    /// fails it with [`StoreError::Timeout`], or `Unavailable` where the connection attempt's
    /// own timeout fires first; both are of class
    /// [`ErrorClass::Unavailable`](tollgate_core::ErrorClass::Unavailable). No failure mode
    /// applies here: a service that must start while Redis is down uses
    /// [`build_lazy`](Self::build_lazy).
    pub async fn build(self) -> Result<RedisStore, StoreError> {
        check_prefix(&self.prefix)?;
        let store = async {
            let conn = self.connect().await?;
            let store = RedisStore {
                inner: Arc::new(Inner {
                    conn,
                    prefix: self.prefix.clone().into(),
                    timeout: self.timeout,
                }),
            };
            store.load_scripts_now().await?;
            Ok(store)
        };
        tokio::time::timeout(self.connect_timeout, store)
            .await
            .map_err(|_| StoreError::Timeout(self.connect_timeout))?
    }

    /// Like [`build`](Self::build), but Redis need not answer yet: checks the configuration
    /// and returns a store that connects on its first call (and loads its scripts then, by the
    /// NOSCRIPT reload). Until Redis answers, calls fail as unavailable, so each limiter applies
    /// its failure mode: a service can start during a Redis outage and enforce the shared quota
    /// once Redis is back.
    ///
    /// Fails as `build` does for a configuration that can never work (a bad prefix or URL, an
    /// empty list of sentinels or nodes). A Cluster still connects here (its slot map is read
    /// when connecting), within the connect timeout.
    pub async fn build_lazy(self) -> Result<RedisStore, StoreError> {
        check_prefix(&self.prefix)?;
        let conn = match (&self.target, self.kind) {
            (Target::Url(url), Kind::Multiplexed) => {
                let client = client_for(url)?;
                ConnectionManager::new_lazy_with_config(client.clone(), self.manager_config())
                    .map(|manager| self.multiplexed_conn(manager, client))
                    .map_err(|e| classify(&e))?
            }
            // The pool and Sentinel connect on first use already.
            (Target::Url(_) | Target::Sentinel { .. }, _) => self.connect().await?,
            (Target::Cluster(_), _) => tokio::time::timeout(self.connect_timeout, self.connect())
                .await
                .map_err(|_| StoreError::Timeout(self.connect_timeout))??,
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                conn,
                prefix: self.prefix.into(),
                timeout: self.timeout,
            }),
        })
    }

    /// A policy registry ([`RedisRegistry`]) on the Redis this store is configured for, under
    /// the same [`prefix`](Self::prefix), each registry call within the store's
    /// [`timeout`](Self::timeout): one builder configures both, so a registry follows the
    /// store's servers through what the store follows.
    ///
    /// - A single server: [`RedisRegistry::connect`] with its URL.
    /// - Sentinel: the registry's commands go to the primary the sentinels name, with the
    ///   primary's credentials, database and TLS set here, and follow a failover as the
    ///   store's calls do (the sentinels watched; a call that meets a dead or deposed primary
    ///   fails, and the next goes to the primary named then). Each
    ///   [`subscribe`](RedisRegistry::subscribe) goes to the primary named when it is made, so
    ///   a [`PolicyFollower`](https://docs.rs/tollgate) whose subscription's server died or
    ///   was deposed (the subscription ends then) subscribes again on the promoted replica.
    ///   The primary is resolved and answers a `PING` within the
    ///   [connect timeout](Self::connect_timeout), or this fails.
    /// - A Cluster: [`RedisRegistry::connect`] with the first initial node that answers.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tollgate_redis::RedisStore;
    ///
    /// let builder = RedisStore::sentinel(
    ///     "rate-limits",
    ///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
    /// )
    /// .primary_credentials("tollgate", "CHANGE-ME");
    /// let registry = builder.build_registry().await?;
    /// let store = builder.build().await?;
    /// # drop((registry, store)); Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`RedisRegistry::connect`]; under Sentinel, [`RegistryError::Store`] when no
    /// primary is found and answers within the connect timeout.
    pub async fn build_registry(&self) -> Result<RedisRegistry, RegistryError> {
        check_prefix(&self.prefix)?;
        match &self.target {
            Target::Url(url) => RedisRegistry::connect(url, &self.prefix, self.timeout).await,
            Target::Sentinel {
                master,
                sentinels,
                primary,
            } => {
                let conn = Arc::new(self.sentinel_conn(master, sentinels, primary)?);
                let ping = redis::cmd("PING");
                tokio::time::timeout(self.connect_timeout, conn.command(&ping))
                    .await
                    .map_err(|_| StoreError::Timeout(self.connect_timeout))?
                    .and_then(Value::extract_error)
                    .map_err(|e| classify(&e))?;
                Ok(RedisRegistry::on_sentinel(
                    conn,
                    primary.db,
                    &self.prefix,
                    self.timeout,
                ))
            }
            Target::Cluster(RedactedUrls(nodes)) => {
                let mut last = None;
                for node in nodes {
                    match RedisRegistry::connect(node, &self.prefix, self.timeout).await {
                        Ok(registry) => return Ok(registry),
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| RegistryError::Store(no_cluster_nodes())))
            }
        }
    }

    /// The multiplexed connection `manager` made for `client`, replaced with the same settings
    /// when it stalls.
    fn multiplexed_conn(&self, manager: ConnectionManager, client: redis::Client) -> Conn {
        Conn::Multiplexed(Arc::new(Managed::new(
            manager,
            client,
            self.manager_config(),
            self.connect_timeout,
        )))
    }

    /// The multiplexed connection's settings.
    fn manager_config(&self) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(None)
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500))
    }

    /// The connection to the primary `sentinels` name for `master`, logged in with `primary`
    /// (see [`RedisStore::sentinel`]); connects on first use.
    fn sentinel_conn(
        &self,
        master: &str,
        sentinels: &RedactedUrls,
        primary: &PrimaryAuth,
    ) -> Result<SentinelConn, StoreError> {
        if sentinels.0.is_empty() {
            return Err(StoreError::unavailable(
                "no sentinel URLs given".to_owned(),
                redis::RedisError::from((redis::ErrorKind::EmptySentinelList, "no sentinels")),
            ));
        }
        // One client per sentinel, so that they are asked side by side and a sentinel
        // that hangs is not waited for (see `SentinelConn`); each with the primary's
        // credentials and database, for every primary the sentinels name.
        let clients = sentinels
            .0
            .iter()
            .map(|url| {
                SentinelClient::build(
                    vec![url.as_str()],
                    master.to_owned(),
                    Some(primary.node_connection_info()),
                    SentinelServerType::Master,
                )
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid("Sentinel configuration", e))?;
        // And one more per sentinel to watch it for failovers (see `SentinelConn`), over
        // RESP3 whatever the URL says: a subscribed connection runs commands only there.
        let watched = sentinels
            .0
            .iter()
            .map(|url| watch_client(url))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid("Sentinel configuration", e))?;
        Ok(SentinelConn::new(
            clients,
            master,
            watched,
            self.connect_timeout,
        ))
    }

    async fn connect(&self) -> Result<Conn, StoreError> {
        match &self.target {
            Target::Url(url) => {
                let client = client_for(url)?;
                // No response timeout from redis-rs (its default is 500 ms, which would cut
                // short calls the store gives longer): the store's own deadline bounds every
                // call, and `build` is bounded by the connect timeout.
                match self.kind {
                    Kind::Multiplexed => {
                        ConnectionManager::new_with_config(client.clone(), self.manager_config())
                            .await
                            .map(|manager| self.multiplexed_conn(manager, client))
                            .map_err(|e| classify(&e))
                    }
                    Kind::Pool(size) => {
                        Ok(Conn::Pool(Pool::new(client, size, self.connect_timeout)))
                    }
                }
            }
            Target::Sentinel {
                master,
                sentinels,
                primary,
            } => self
                .sentinel_conn(master, sentinels, primary)
                .map(|conn| Conn::Sentinel(Arc::new(conn))),
            Target::Cluster(RedactedUrls(nodes)) => {
                if nodes.is_empty() {
                    return Err(no_cluster_nodes());
                }
                // A node reached directly (see `Cluster`) gets the first node's settings: over
                // RESP3 unless its URL names a protocol, as every node connection.
                let node_info = redis::IntoConnectionInfo::into_connection_info(nodes[0].as_str())
                    .map(|info| with_resp3(&nodes[0], info))
                    .map_err(|e| invalid("cluster configuration", e))?;
                // No retries by the connection itself: it would resend a request after a
                // dropped connection. Redirections are followed in `connection.rs`. Over RESP3
                // redis-rs hears when a node closes an idle connection and reconnects to that
                // node before the next call, which otherwise failed on the closed connection.
                let client =
                    redis::cluster::ClusterClient::builder(nodes.iter().map(String::as_str))
                        .use_protocol(node_info.redis_settings().protocol())
                        .retries(0)
                        .connection_timeout(self.connect_timeout)
                        .response_timeout(self.timeout.max(self.connect_timeout))
                        .build()
                        .map_err(|e| invalid("cluster configuration", e))?;
                let node_config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_response_timeout(Some(self.timeout.max(self.connect_timeout)));
                let conn = client
                    .get_async_connection()
                    .await
                    .map_err(|e| classify(&e))?;
                Ok(Conn::Cluster(Arc::new(Cluster::new(
                    conn,
                    client,
                    self.connect_timeout,
                    node_info,
                    node_config,
                ))))
            }
        }
    }
}

/// A Cluster configured with no initial node, as the store and the registry report it.
fn no_cluster_nodes() -> StoreError {
    StoreError::unavailable(
        "no cluster nodes given".to_owned(),
        redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "no initial nodes")),
    )
}

/// A configuration redis-rs refuses (`what`: which), as the store reports it.
fn invalid(what: &str, e: redis::RedisError) -> StoreError {
    StoreError::unavailable(format!("invalid {what}: {e}"), e)
}

/// The redis-rs client a store opens for the single server at `url`: over RESP3 unless the
/// URL's query names a protocol (`?protocol=resp2`), so that a connection the server closes
/// while idle is heard of. For connections of your own that should speak as the store does
/// (the `tollgate load` tool's `PING` and script probes use it).
///
/// ```
/// let client = tollgate_redis::client_for("redis://127.0.0.1:6379/0").unwrap();
/// let settings = client.get_connection_info().redis_settings();
/// assert_eq!(settings.protocol(), redis::ProtocolVersion::RESP3);
/// let resp2 = tollgate_redis::client_for("redis://127.0.0.1:6379/0?protocol=resp2").unwrap();
/// assert_eq!(resp2.get_connection_info().redis_settings().protocol(), redis::ProtocolVersion::RESP2);
/// assert!(tollgate_redis::client_for("not a url").is_err());
/// ```
///
/// # Errors
/// [`StoreError::Unavailable`] naming the URL's fault when it does not parse.
pub fn client_for(url: &str) -> Result<redis::Client, StoreError> {
    let invalid =
        |e: redis::RedisError| StoreError::unavailable(format!("invalid Redis URL: {e}"), e);
    let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(invalid)?;
    redis::Client::open(with_resp3(url, info)).map_err(invalid)
}

/// A client for the sentinel at `url` over RESP3, whatever the URL says (a subscribed
/// connection runs commands only over RESP3): the store's watch of that sentinel.
fn watch_client(url: &str) -> redis::RedisResult<redis::Client> {
    redis::Client::open(over_resp3(redis::IntoConnectionInfo::into_connection_info(
        url,
    )?))
}

/// `info` over RESP3 unless its URL names a protocol (`?protocol=resp2`): redis-rs tells a
/// RESP3 connection's owner when the server closes it while idle (Redis's `timeout`,
/// `CLIENT KILL`, a load balancer's idle cut), so the store moves to a fresh connection
/// before the next call rather than failing that call as if Redis were down. The store's
/// replies read the same under both protocols.
fn with_resp3(url: &str, info: redis::ConnectionInfo) -> redis::ConnectionInfo {
    // the query's own parameters only: a password or path may contain the text
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let query = query.split_once('#').map_or(query, |(q, _)| q);
    if query.split('&').any(|pair| pair.starts_with("protocol=")) {
        return info;
    }
    over_resp3(info)
}

/// `info` over RESP3, whatever it said.
fn over_resp3(info: redis::ConnectionInfo) -> redis::ConnectionInfo {
    let settings = info
        .redis_settings()
        .clone()
        .set_protocol(redis::ProtocolVersion::RESP3);
    info.set_redis_settings(settings)
}

/// Checks a key prefix: at most [`MAX_PREFIX_LEN`] bytes of `[A-Za-z0-9:_.-]`.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), StoreError> {
    let ok = prefix.len() <= MAX_PREFIX_LEN
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b':' | b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(KeyError::BadPrefix(prefix.to_owned()).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_never_shows_a_password() {
        let single = format!(
            "{:?}",
            RedisStore::builder("redis://u:s3cret@127.0.0.1:6379/0")
        );
        let cluster = format!(
            "{:?}",
            RedisStore::cluster(["redis://:s3cret@127.0.0.1:7000", "redis://127.0.0.1:7001"])
        );
        for out in [&single, &cluster] {
            assert!(!out.contains("s3cret"), "{out}");
            assert!(out.contains("***@127.0.0.1"), "{out}");
        }
    }

    #[test]
    fn prefix_refuses_braces_and_odd_bytes() {
        assert!(check_prefix("tollgate:").is_ok());
        assert!(check_prefix("").is_ok());
        assert!(check_prefix("App-1.rl_v2:").is_ok());
        for bad in ["{x}:", "a}", "a b", "a\n", "ünï", &"x".repeat(65)] {
            assert!(
                matches!(check_prefix(bad), Err(StoreError::InvalidKey(_))),
                "{bad:?}"
            );
        }
    }
}
