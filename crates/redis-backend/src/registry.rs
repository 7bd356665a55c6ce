//! [`RedisRegistry`]: named policies in Redis, so that every instance of a service can follow
//! one published policy. A publication is one atomic script that refuses to go back a
//! generation and announces the change on a pub/sub channel in the same step.
//!
//! Layout: one hash `<prefix>registry`, field = policy name, value = `"<generation> <spec>"`
//! (the spec is [`Policy::to_spec`], which parses back to an equal policy). Notifications go
//! to the channel `<prefix>registry` with the name as the message. Followers (see the
//! `tollgate` crate's `registry` module) re-read the entry on a notification and also poll it,
//! so a lost notification (a dropped subscription) delays a switch by at most one poll.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;

use futures_util::StreamExt as _;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};
use tollgate_core::{Key, Policy, SpecError, StoreError};

use crate::builder::{check_prefix, client_for};
use crate::connection::SentinelConn;
use crate::error::classify;

/// Why a registry call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The name is not 1-64 characters of `[a-z0-9_.-]`.
    #[error("policy name {0:?} must be 1-64 characters of [a-z0-9_.-]")]
    BadName(String),
    /// A higher generation is already published under this name.
    #[error(
        "policy {name:?} is already at generation {stored}; generation {offered} would go back"
    )]
    Stale {
        /// The name.
        name: String,
        /// The generation stored.
        stored: u64,
        /// The generation offered.
        offered: u64,
    },
    /// This generation is already published under this name with another policy: a
    /// generation names one policy, so a change needs a new generation.
    #[error(
        "policy {name:?} generation {generation} is already published with other parameters; publish a new generation"
    )]
    Conflict {
        /// The name.
        name: String,
        /// The generation.
        generation: u64,
    },
    /// A stored entry cannot be read (written by something else, or a newer version): not
    /// UTF-8, not `"<generation> <spec>"`, a spec that does not parse, or a generation before
    /// the space other than the spec's.
    #[error("the registry entry of policy {name:?} does not parse: {error}")]
    Corrupt {
        /// The name.
        name: String,
        /// Why.
        #[source]
        error: SpecError,
    },
    /// Redis could not be reached or refused the call.
    #[error("policy registry: {0}")]
    Store(#[from] StoreError),
}

/// What [`RedisRegistry::publish`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Published {
    /// Stored, and followers notified.
    Stored,
    /// The same policy was already stored under this generation; nothing changed.
    Unchanged,
}

/// Named policies in Redis. Cloning is cheap; clones share the connection, which reconnects
/// by itself after Redis restarts or drops it (the call that met the failure reports it; the
/// next one goes over a new connection), and is replaced after a call times out: a path that
/// died without a reset (a NAT or firewall dropping its state) answers nothing, and would
/// otherwise time every later call out for good.
///
/// Like the store, the registry speaks RESP3 unless its URL's query names a protocol
/// (`?protocol=resp2`): a connection the server closes while idle (Redis's `timeout`,
/// `CLIENT KILL`, a load balancer's idle cut) is then replaced before the next call, which
/// succeeds. Over RESP2 the first call after such a close fails as unavailable.
#[derive(Clone)]
pub struct RedisRegistry {
    /// Where subscriptions go, and how a connection is made again.
    origin: Origin,
    conn: Arc<ArcSwap<RegistryConn>>,
    key: String,
    timeout: Duration,
}

/// What a registry was connected to. (One per registry, shared by its clones: its size is
/// of no account.)
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Origin {
    /// The URL's server (subscriptions go there; on a Cluster, publications reach every node),
    /// with the settings its connections are made with.
    Url {
        client: redis::Client,
        config: ConnectionManagerConfig,
    },
    /// The primary the sentinels name, asked again for each subscription.
    Sentinel(Arc<SentinelConn>),
}

/// The connection the registry's commands go over: to the URL's server, or — once that server
/// answered `MOVED` or `ASK`, a Redis Cluster node — a cluster connection seeded with it, which
/// follows the hash's slot through redirections, migrations and failovers as the cluster
/// reports them; or to the primary the sentinels name, which follows failovers as the Sentinel
/// store does ([`RedisStoreBuilder::build_registry`](crate::RedisStoreBuilder::build_registry)).
#[derive(Clone)]
enum RegistryConn {
    Single(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
    Sentinel(Arc<SentinelConn>, i64),
}

impl redis::aio::ConnectionLike for RegistryConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
            // An error reply as `Err`, as the other connections give it (a script's `NOSCRIPT`
            // then has `invoke_async` send the script itself).
            Self::Sentinel(s, _) => {
                Box::pin(async move { s.command(cmd).await.and_then(Value::extract_error) })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Sentinel(s, _) => Box::pin(s.pipeline(pipeline, offset, count)),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
            Self::Sentinel(_, db) => *db,
        }
    }
}

impl fmt::Debug for RedisRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRegistry")
            .field("key", &self.key)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

fn check_name(name: &str) -> Result<(), RegistryError> {
    Key::new(name, std::iter::empty::<&[u8]>())
        .map(drop)
        .map_err(|_| RegistryError::BadName(name.to_owned()))
}

/// At most this much of an unreadable entry is quoted in its error (a hand-written value may
/// be large, and a follower logs the error at every poll).
const QUOTED: usize = 64;

/// An unreadable entry's error: `value` (quoted, shortened) is not an entry because `reason`.
fn unreadable(name: &str, value: &str, reason: &str) -> RegistryError {
    let mut quoted: String = value.chars().take(QUOTED).collect();
    if quoted.len() < value.len() {
        quoted.push('…');
    }
    RegistryError::Corrupt {
        name: name.to_owned(),
        error: SpecError::BadValue {
            name: "registry entry".to_owned(),
            value: quoted,
            reason: reason.to_owned(),
        },
    }
}

/// Reads a stored entry, `"<generation> <spec>"`. The publication script orders entries by
/// the generation before the space (`registry_publish.lua`), so an entry is read only when
/// that generation is there, in decimal digits, and is the spec's own: an entry whose two
/// generations disagree (a hand edit) would have followers switch to a generation the
/// registry does not hold, and then ignore the next publication the registry accepts.
fn parse_entry(name: &str, value: &[u8]) -> Result<Policy, RegistryError> {
    let Ok(value) = std::str::from_utf8(value) else {
        return Err(unreadable(
            name,
            &String::from_utf8_lossy(value),
            "not UTF-8",
        ));
    };
    let Some((stored, spec)) = value
        .split_once(' ')
        .filter(|(g, _)| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()))
    else {
        return Err(unreadable(name, value, "expected \"<generation> <spec>\""));
    };
    let policy: Policy = spec.parse().map_err(|error| RegistryError::Corrupt {
        name: name.to_owned(),
        error,
    })?;
    if stored.parse::<u64>().ok() != Some(policy.generation()) {
        return Err(unreadable(
            name,
            value,
            &format!(
                "filed under generation {stored}, but its spec is generation {}",
                policy.generation()
            ),
        ));
    }
    Ok(policy)
}

/// Whether a `HELLO` reply (a map over RESP3, a flat list over RESP2) has `mode` `cluster`.
fn says_cluster(reply: &Value) -> bool {
    fn text(v: &Value) -> Option<&[u8]> {
        match v {
            Value::BulkString(b) => Some(b.as_slice()),
            Value::SimpleString(s) => Some(s.as_bytes()),
            _ => None,
        }
    }
    let is_mode = |k: &Value, v: &Value| {
        text(k) == Some(b"mode".as_slice()) && text(v) == Some(b"cluster".as_slice())
    };
    match reply {
        Value::Map(pairs) => pairs.iter().any(|(k, v)| is_mode(k, v)),
        Value::Array(items) => items
            .chunks(2)
            .any(|kv| kv.len() == 2 && is_mode(&kv[0], &kv[1])),
        _ => false,
    }
}

impl RedisRegistry {
    /// Connects to the registry at `url` under the key prefix `prefix` (the store's prefix,
    /// e.g. [`crate::DEFAULT_PREFIX`]); every call has the deadline `timeout`. A prefix the
    /// store refuses ([`RedisStoreBuilder::prefix`](crate::RedisStoreBuilder::prefix)) is
    /// refused here too, before anything is sent: [`RegistryError::Store`] with
    /// [`StoreError::InvalidKey`].
    ///
    /// On a Redis Cluster, give it any node's URL: the node says it is one (`HELLO`), and the
    /// registry's commands go over a cluster connection seeded with it, which follows the
    /// hash's slot through migrations and failovers; subscriptions stay on the URL's node and
    /// hear publications made on any. A URL names one server, and a registry connected by URL
    /// stays on it: under Sentinel, build the registry from the store's builder instead
    /// ([`RedisStoreBuilder::build_registry`](crate::RedisStoreBuilder::build_registry)),
    /// which follows the primary through failovers.
    pub async fn connect(
        url: &str,
        prefix: &str,
        timeout: Duration,
    ) -> Result<Self, RegistryError> {
        check_prefix(prefix)?;
        // The store's client (RESP3 unless the URL names a protocol): redis-rs then tells the
        // connection manager when the server closes its connection while idle, and it
        // reconnects before the next call instead of failing it.
        let client = client_for(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1);
        let conn = tokio::time::timeout(
            timeout,
            ConnectionManager::new_with_config(client.clone(), config.clone()),
        )
        .await
        .map_err(|_| StoreError::Timeout(timeout))?
        .map_err(|e| classify(&e))?;
        // A Redis Cluster node (`HELLO`'s `mode`, which every user may ask) gets a cluster
        // connection at once: the node owning the hash's slot sends no redirection, and its
        // failover would otherwise not be followed. A server that does not say keeps the plain
        // connection, and a redirection still switches it (`call`).
        let mut hello = conn.clone();
        let clustered = tokio::time::timeout(
            timeout,
            redis::cmd("HELLO").query_async::<Value>(&mut hello),
        )
        .await
        .is_ok_and(|reply| reply.is_ok_and(|v| says_cluster(&v)));
        let registry = Self {
            origin: Origin::Url { client, config },
            conn: Arc::new(ArcSwap::from_pointee(RegistryConn::Single(conn))),
            key: format!("{prefix}registry"),
            timeout,
        };
        if clustered {
            tokio::time::timeout(timeout, registry.to_cluster())
                .await
                .map_err(|_| StoreError::Timeout(timeout))?
                .map_err(|e| classify(&e))?;
        }
        Ok(registry)
    }

    /// A registry on the primary the sentinels behind `conn` name (database `db`), under the
    /// key prefix `prefix` (checked by the caller), with call deadline `timeout`: its commands
    /// follow failovers as the Sentinel store's do, and each subscription goes to the primary
    /// named when it is made. Connects on first use.
    pub(crate) fn on_sentinel(
        conn: Arc<SentinelConn>,
        db: i64,
        prefix: &str,
        timeout: Duration,
    ) -> Self {
        Self {
            origin: Origin::Sentinel(Arc::clone(&conn)),
            conn: Arc::new(ArcSwap::from_pointee(RegistryConn::Sentinel(conn, db))),
            key: format!("{prefix}registry"),
            timeout,
        }
    }

    /// The shared connection.
    fn conn(&self) -> RegistryConn {
        RegistryConn::clone(&self.conn.load())
    }

    /// The deadline of every call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The hash holding the entries, which is also the notification channel.
    pub fn key(&self) -> &str {
        &self.key
    }

    async fn deadline<T>(
        &self,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, RegistryError> {
        let error = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) if !e.is_timeout() => return Err(RegistryError::Store(classify(&e))),
            Ok(Err(e)) => classify(&e),
            Err(_) => StoreError::Timeout(self.timeout),
        };
        self.replace_silent();
        Err(RegistryError::Store(error))
    }

    /// After silence (the connection's own response timeout, or a deadline): the next call
    /// goes over a new connection, to the URL's server made when first used (the settings
    /// made the first one, so they make this one), or on a Cluster a new cluster connection
    /// seeded with it, made in the background (the old connection serves until the new one is
    /// made, and stays if it cannot be). Under Sentinel the connection watches itself: a call
    /// abandoned after a silent wait has it probed, and dropped if the probe gets no answer
    /// (as the store's).
    fn replace_silent(&self) {
        match (&*self.conn.load_full(), &self.origin) {
            (RegistryConn::Cluster(_), _) => {
                let registry = self.clone();
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(registry.timeout, registry.to_cluster()).await;
                });
            }
            (RegistryConn::Single(_), Origin::Url { client, config }) => {
                if let Ok(fresh) =
                    ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                {
                    self.conn.store(Arc::new(RegistryConn::Single(fresh)));
                }
            }
            _ => {}
        }
    }

    /// Runs a command on the shared connection within the deadline. Every registry command is
    /// safe to repeat — a read; a publication's compare-and-set, which a repeat finds stored
    /// (`Unchanged`); an announcement, which a follower acts on twice as once — so one that
    /// finds its connection dropped (the server closed it while idle, and the close had not
    /// been heard when the command went out) is sent once more, within the same deadline, on
    /// the connection the manager makes in its place (under Sentinel, on the primary the
    /// sentinels name then). On one server, so is one that has no answer within half the
    /// deadline, on a new connection: a command that went out as the server closed the
    /// connection can be left unanswered rather than failed (redis-rs, seen in
    /// `a_registry_call_racing_the_servers_close_is_sent_again`: 4 runs in 20 failed so).
    async fn call<T, F>(&self, run: impl Fn(RegistryConn) -> F) -> Result<T, RegistryError>
    where
        F: Future<Output = redis::RedisResult<T>>,
    {
        self.deadline(async {
            let conn = self.conn();
            let first = if matches!(conn, RegistryConn::Single(_)) {
                let Ok(first) = tokio::time::timeout(self.timeout / 2, run(conn)).await else {
                    self.replace_silent();
                    return run(self.conn()).await;
                };
                first
            } else {
                run(conn).await
            };
            match first {
                Err(e) if e.is_connection_dropped() => run(self.conn()).await,
                Err(e) if e.redirect_node().is_some() => match self.to_cluster().await {
                    Ok(()) => run(self.conn()).await,
                    Err(_) => Err(e),
                },
                other => other,
            }
        })
        .await
    }

    /// The URL's server answered `MOVED` or `ASK`: it is a Redis Cluster node, and the
    /// registry's hash lives in one slot, wherever the cluster puts it. From now on the
    /// registry's commands go over a cluster connection seeded with the URL's node (its
    /// credentials, protocol and TLS), which follows redirections, slot migrations and
    /// failovers; subscriptions stay on the URL's node (Redis broadcasts `PUBLISH` over the
    /// cluster bus).
    async fn to_cluster(&self) -> redis::RedisResult<()> {
        let Origin::Url { client, .. } = &self.origin else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "a redirection under Sentinel",
            )));
        };
        let info = client.get_connection_info().clone();
        let protocol = info.redis_settings().protocol();
        let client = redis::cluster::ClusterClient::builder([info])
            .use_protocol(protocol)
            .connection_timeout(self.timeout)
            .response_timeout(self.timeout)
            .build()?;
        let conn = client.get_async_connection().await?;
        self.conn.store(Arc::new(RegistryConn::Cluster(conn)));
        Ok(())
    }

    /// `cmd` on the shared connection, as [`RedisRegistry::call`] runs it.
    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, RegistryError> {
        self.call(|mut conn| async move { cmd.query_async(&mut conn).await })
            .await
    }

    /// Publishes `policy` under `name`, atomically: refused if a higher generation is stored
    /// ([`RegistryError::Stale`]) or the same generation holds another policy
    /// ([`RegistryError::Conflict`]); otherwise stored and announced to followers.
    pub async fn publish(&self, name: &str, policy: &Policy) -> Result<Published, RegistryError> {
        check_name(name)?;
        policy.check_cost(1).map_err(StoreError::InvalidPolicy)?;
        let script = Script::new(include_str!("../scripts/registry_publish.lua"));
        let mut inv = script.key(&self.key);
        inv.arg(name)
            .arg(policy.generation())
            .arg(policy.to_spec())
            .arg(&self.key);
        let reply: Vec<i64> = self
            .call(|mut conn| {
                let inv = &inv;
                async move { inv.invoke_async(&mut conn).await }
            })
            .await?;
        let stored = |i: usize| reply.get(i).map_or(0, |&g| g.unsigned_abs());
        match reply.first() {
            Some(1) if reply.get(2) == Some(&0) => Ok(Published::Unchanged),
            Some(1) => Ok(Published::Stored),
            Some(0) => Err(RegistryError::Stale {
                name: name.to_owned(),
                stored: stored(1),
                offered: policy.generation(),
            }),
            _ => Err(RegistryError::Conflict {
                name: name.to_owned(),
                generation: stored(1),
            }),
        }
    }

    /// The policy published under `name`, if any.
    pub async fn get(&self, name: &str) -> Result<Option<Policy>, RegistryError> {
        check_name(name)?;
        let mut cmd = redis::cmd("HGET");
        cmd.arg(&self.key).arg(name);
        let value: Option<Vec<u8>> = self.query(&cmd).await?;
        value.map(|v| parse_entry(name, &v)).transpose()
    }

    /// Every published entry, by name, each with its policy or, for an entry this version
    /// cannot read ([`RegistryError::Corrupt`]: during a rolling upgrade, a newer version's
    /// algorithm; a hand-written value), why: one unreadable entry does not hide the others.
    /// A field whose name is not UTF-8 is listed, lossily, with [`RegistryError::BadName`].
    pub async fn list(
        &self,
    ) -> Result<Vec<(String, Result<Policy, RegistryError>)>, RegistryError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(&self.key);
        let entries: Vec<(Vec<u8>, Vec<u8>)> = self.query(&cmd).await?;
        let mut out: Vec<_> = entries
            .into_iter()
            .map(|(name, v)| match String::from_utf8(name) {
                Ok(name) => {
                    let policy = parse_entry(&name, &v);
                    (name, policy)
                }
                Err(e) => {
                    let name = String::from_utf8_lossy(e.as_bytes()).into_owned();
                    (name.clone(), Err(RegistryError::BadName(name)))
                }
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Announces that the bucket `key` (a [`tollgate_core::Key`]'s encoded string) of the
    /// limiters following `name` was reset, so that every follower forgets a denial of it
    /// cached in its process (a local deny cache would otherwise keep denying it until the
    /// cached deadline). Sent on the publications' channel as `<name>\n<key>`, which a
    /// follower that only knows publications ignores (it is not a name it follows). Returns
    /// how many subscribers received it.
    pub async fn announce_reset(&self, name: &str, key: &str) -> Result<u64, RegistryError> {
        check_name(name)?;
        let mut cmd = redis::cmd("PUBLISH");
        cmd.arg(&self.key).arg(format!("{name}\n{key}"));
        self.query(&cmd).await
    }

    /// Subscribes to publications: the returned [`Subscription`] yields the name of each policy
    /// published from now on (and each reset announced), until its connection drops. Under
    /// Sentinel it is made to the primary the sentinels name now, and ends as soon as they
    /// name another (a `+switch-master` heard by the registry's watches, or a resolution of its
    /// calls): a primary deposed while it stays up answers as master, and its subscribers'
    /// `PING`, until the sentinels convert it some 10 s later, and hears nothing published on
    /// the new one meanwhile. A [`PolicyFollower`](https://docs.rs/tollgate) whose
    /// subscription ended subscribes again, on the primary named then.
    pub async fn subscribe(&self) -> Result<Subscription, RegistryError> {
        let (pubsub, deposed) = match &self.origin {
            Origin::Url { client, .. } => (self.deadline(client.get_async_pubsub()).await?, None),
            Origin::Sentinel(s) => {
                self.deadline(async {
                    let client = s.primary_client().await?;
                    let deposed = s.deposed(&client);
                    Ok((client.get_async_pubsub().await?, Some(deposed)))
                })
                .await?
            }
        };
        let (mut sink, stream) = pubsub.split();
        self.deadline(sink.subscribe(&self.key)).await?;
        // Under Sentinel the stream ends once its server is deposed, and the subscription is
        // no longer alive.
        let ended = Arc::new(AtomicBool::new(false));
        let until = {
            let ended = Arc::clone(&ended);
            async move {
                match deposed {
                    Some(deposed) => deposed.await,
                    None => std::future::pending().await,
                }
                ended.store(true, Ordering::Release);
            }
        };
        Ok(Subscription {
            sink,
            timeout: self.timeout,
            ended,
            stream: Box::pin(stream.take_until(until).filter_map(|msg| async move {
                let Ok(Value::BulkString(payload)) = msg.get_payload::<Value>() else {
                    return None;
                };
                let text = String::from_utf8(payload).ok()?;
                Some(match text.split_once('\n') {
                    Some((name, key)) => Notice::Reset {
                        name: name.to_owned(),
                        key: key.to_owned(),
                    },
                    None => Notice::Published(text),
                })
            })),
        })
    }
}

/// What a [`Subscription`] hears.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Notice {
    /// A policy was published under this name.
    Published(String),
    /// The bucket `key` (an encoded [`tollgate_core::Key`]) of the limiters following `name`
    /// was reset ([`RedisRegistry::announce_reset`]).
    Reset {
        /// The followed name.
        name: String,
        /// The bucket's encoded key.
        key: String,
    },
}

/// Publications and resets announced since [`RedisRegistry::subscribe`].
pub struct Subscription {
    sink: redis::aio::PubSubSink,
    timeout: Duration,
    /// Set when its server was deposed (under Sentinel): the stream has ended.
    ended: Arc<AtomicBool>,
    stream: std::pin::Pin<Box<dyn futures_util::Stream<Item = Notice> + Send>>,
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription").finish_non_exhaustive()
    }
}

impl Subscription {
    /// The next published name (resets skipped); `None` once the subscription's connection
    /// is gone.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            if let Notice::Published(name) = self.stream.next().await? {
                return Some(name);
            }
        }
    }

    /// The next publication or reset; `None` once the subscription's connection is gone.
    pub async fn next_notice(&mut self) -> Option<Notice> {
        self.stream.next().await
    }

    /// Whether the subscription's connection still answers: a `PING` on it within the
    /// registry's timeout. A connection whose path died without a reset never ends the
    /// stream of notices, only falls silent, so a follower asks now and then. Under Sentinel,
    /// never once its server was deposed (the stream ended then).
    pub async fn alive(&mut self) -> bool {
        !self.ended.load(Ordering::Acquire)
            && matches!(
                tokio::time::timeout(self.timeout, self.sink.ping::<Value>()).await,
                Ok(Ok(_))
            )
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    /// A prefix the store refuses is refused by the registry too, before anything is sent (it
    /// was accepted: `x{y}` moves the registry's key into another hash slot, a prefix the
    /// fleet's stores cannot share). Nothing listens on the URL, so only a refusal before
    /// connecting is `InvalidKey`.
    #[tokio::test]
    async fn a_prefix_the_store_refuses_is_refused_before_connecting() {
        let url = "redis://127.0.0.1:1";
        for prefix in ["x{y}", "a b", "tollgate\n", &"p".repeat(65)] {
            let got = RedisRegistry::connect(url, prefix, Duration::from_secs(1)).await;
            assert!(
                matches!(got, Err(RegistryError::Store(StoreError::InvalidKey(_)))),
                "{prefix:?}: {got:?}"
            );
        }
        let got = RedisRegistry::connect(url, "tollgate:", Duration::from_secs(1)).await;
        assert!(
            matches!(&got, Err(RegistryError::Store(e)) if e.class() == tollgate_core::ErrorClass::Unavailable),
            "{got:?}"
        );
    }

    #[test]
    fn registry_error_messages_name_the_values() {
        let cases = [
            (
                RegistryError::BadName("Bad Name".into()),
                "policy name \"Bad Name\" must be 1-64 characters of [a-z0-9_.-]",
            ),
            (
                RegistryError::Stale {
                    name: "api".into(),
                    stored: 5,
                    offered: 3,
                },
                "policy \"api\" is already at generation 5; generation 3 would go back",
            ),
            (
                RegistryError::Conflict {
                    name: "api".into(),
                    generation: 2,
                },
                "policy \"api\" generation 2 is already published with other parameters; \
                 publish a new generation",
            ),
            (
                RegistryError::Store(StoreError::Busy("BUSY script".into())),
                "policy registry: store busy: BUSY script",
            ),
        ];
        for (error, message) in cases {
            assert_eq!(error.to_string(), message);
        }
    }

    #[test]
    fn registry_error_sources_are_the_underlying_errors() {
        let spec = "no-such-algorithm:x=1".parse::<Policy>().unwrap_err();
        let corrupt = parse_entry("api", b"1 no-such-algorithm:x=1").unwrap_err();
        assert_eq!(
            corrupt.to_string(),
            format!("the registry entry of policy \"api\" does not parse: {spec}")
        );
        assert_eq!(corrupt.source().unwrap().to_string(), spec.to_string());

        let store: RegistryError = StoreError::Timeout(Duration::from_millis(50)).into();
        assert_eq!(
            store.source().unwrap().to_string(),
            "store call timed out after 50ms"
        );
        assert!(RegistryError::BadName(String::new()).source().is_none());
    }
}
