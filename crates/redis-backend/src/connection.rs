//! The ways the store talks to Redis — one multiplexed connection that reconnects by itself, a
//! bb8 pool of them, the primary that Sentinel names, or a Redis Cluster — behind one pair of
//! calls: send a command, send a pipeline.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use arc_swap::ArcSwap;
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::sentinel::SentinelClient;
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, Pipeline, RedisError, RedisResult, ServerErrorKind,
    Value,
};

/// How many `MOVED`/`ASK` redirections one cluster command follows before giving up.
const MAX_REDIRECTS: usize = 5;

/// A connection to Redis.
#[derive(Clone)]
pub(crate) enum Conn {
    Multiplexed(Arc<Managed>),
    Pool(Pool),
    Sentinel(Arc<SentinelConn>),
    Cluster(Arc<Cluster>),
}

impl Conn {
    /// Sends one command. An error reply is returned as `Err`.
    ///
    /// The pool's checkout, Sentinel's and the cluster's calls are boxed: their state machines
    /// run to a kilobyte or more, and unboxed the largest of them sets the size of every
    /// decision's future (built, moved and boxed on each call, whatever the connection kind).
    /// The multiplexed connection's is a box already.
    pub(crate) async fn command(&self, cmd: &Cmd) -> RedisResult<Value> {
        let value = match self {
            Self::Multiplexed(m) => {
                m.send(async |conn| conn.req_packed_command(cmd).await)
                    .await
            }
            Self::Pool(pool) => {
                Box::pin(pool.send(async |conn| conn.req_packed_command(cmd).await)).await
            }
            Self::Sentinel(s) => Box::pin(s.command(cmd)).await,
            Self::Cluster(c) => Box::pin(cluster_command(c, cmd)).await,
        }?;
        value.extract_error()
    }

    /// Sends `pipe` (`count` commands) in one round trip (on a cluster: one per node) and
    /// returns one reply per command, an error reply as `Err`. The outer error means no reply
    /// came back at all (the connection failed). On a cluster each command goes to its own
    /// node, so some may fail while others are answered; with `cut`, a command still
    /// unanswered then fails alone (timed out) and the others keep their replies, so a node
    /// that hangs does not take the answered nodes' replies down with it. Elsewhere `cut` is
    /// unused: the caller's deadline covers the one round trip.
    pub(crate) async fn pipeline(
        &self,
        pipe: &Pipeline,
        count: usize,
        cut: Option<tokio::time::Instant>,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        self.batch(pipe, count, cut, false).await
    }

    /// The `count` commands of `pipe` (script calls, `pipe` not atomic) with each key's
    /// commands as one transaction (`MULTI` … `EXEC`) when it has several, the others plain:
    /// a key's commands all run, in order, with no other client's command between them, or
    /// none does, while other keys' commands and other clients' interleave as in any
    /// pipeline ([`keyed_transactions`]; on a cluster [`cluster_pipeline`], one transaction
    /// per key on its slot's primary). One round trip (on a cluster, one per node).
    pub(crate) async fn transaction(
        &self,
        pipe: &Pipeline,
        count: usize,
        cut: Option<tokio::time::Instant>,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        self.batch(pipe, count, cut, true).await
    }

    async fn batch(
        &self,
        pipe: &Pipeline,
        count: usize,
        cut: Option<tokio::time::Instant>,
        transaction: bool,
    ) -> RedisResult<Vec<RedisResult<Value>>> {
        if let Self::Cluster(c) = self {
            return Ok(Box::pin(cluster_pipeline(c, pipe, cut)).await);
        }
        if !transaction {
            let replies = self.packed(pipe, 0, count).await?;
            return Ok(replies.into_iter().map(Value::extract_error).collect());
        }
        keyed_transactions(pipe, count, async |wire, replies| {
            self.packed(wire, 0, replies).await
        })
        .await
    }

    /// `count` replies of `pipe` after the first `offset`, on a single-node connection.
    async fn packed(
        &self,
        pipe: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        // Boxed as in `command`.
        match self {
            Self::Multiplexed(m) => {
                m.send(async |conn| conn.req_packed_commands(pipe, offset, count).await)
                    .await
            }
            Self::Pool(pool) => {
                Box::pin(
                    pool.send(async |conn| conn.req_packed_commands(pipe, offset, count).await),
                )
                .await
            }
            Self::Sentinel(s) => Box::pin(s.pipeline(pipe, offset, count)).await,
            Self::Cluster(_) => unreachable!("a cluster's pipelines go by key"),
        }
    }

    /// Makes every connection this may use now ([`Pool::connect_all`]). The multiplexed
    /// connection and Sentinel's primary are connected by a `PING` (within the connect
    /// timeout): `build` connected them already, but a store built lazily connects them on
    /// its first call. A cluster's nodes are connected when the store is built, lazily or not.
    pub(crate) async fn connect_all(&self) -> RedisResult<()> {
        let (limit, what) = match self {
            Self::Pool(pool) => return pool.connect_all().await,
            Self::Cluster(_) => return Ok(()),
            Self::Multiplexed(m) => (m.probe_limit, "connecting"),
            Self::Sentinel(s) => (s.resolve_timeout, "connecting to the primary"),
        };
        tokio::time::timeout(limit, self.command(&redis::cmd("PING")))
            .await
            .unwrap_or_else(|_| Err(timed_out(what)))
            .map(drop)
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Multiplexed(_) => "multiplexed",
            Self::Pool(_) => "pool",
            Self::Sentinel(_) => "sentinel",
            Self::Cluster(_) => "cluster",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Stalls

/// How long a call must have waited, with no reply on its connection since it was sent, for
/// its abandonment to raise a suspicion. Shorter waits are taken for the caller going away (a
/// cancelled request), which says nothing of the connection.
const STALL_FLOOR_US: u64 = 10_000;

/// Microseconds since the first call of the process.
fn now_us() -> u64 {
    static EPOCH: std::sync::LazyLock<std::time::Instant> =
        std::sync::LazyLock::new(std::time::Instant::now);
    u64::try_from(EPOCH.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// What a connection's calls tell of it: the latest send time of a call that got its answer,
/// whether a probe of it is running, and whether it must be replaced.
///
/// A path that died without a reset (a NAT or firewall that dropped its state) fails no call
/// and drops nothing: calls are only abandoned at their deadlines, until the kernel gives up
/// on the connection some fifteen minutes later, while a new connection works at once. A
/// connection that is only slow looks the same from one call. So a call abandoned after
/// [`STALL_FLOOR_US`] with nothing back on the connection since it was sent raises a
/// suspicion, and a `PING` on the connection settles it, in the background, within the connect
/// timeout: a `PONG` clears it (the connection is slow, not dead, and is kept), silence
/// replaces the connection.
#[derive(Default)]
pub(crate) struct Health {
    /// The latest send time ([`now_us`]) of a call answered on the connection: any answer to
    /// a call sent at or after a moment shows the connection answered after it. (A call sent
    /// earlier and answered later is not counted, which can only raise a suspicion that the
    /// probe then clears.) The send time, so an answer costs no second reading of the clock.
    last_reply_us: AtomicU64,
    /// A suspicion was raised and its probe has not finished.
    probing: AtomicBool,
    broken: AtomicBool,
}

impl Health {
    /// A call sent at `sent_us` and abandoned now waited at least [`STALL_FLOOR_US`] with
    /// nothing back on the connection meanwhile.
    fn silent_since(&self, sent_us: u64) -> bool {
        now_us().saturating_sub(sent_us) >= STALL_FLOOR_US
            && self.last_reply_us.load(Ordering::Acquire) < sent_us
    }

    /// [`Health::silent_since`], and no probe running yet (this one starts it).
    fn suspect(&self, sent_us: u64) -> bool {
        self.silent_since(sent_us) && !self.probing.swap(true, Ordering::AcqRel)
    }

    /// A call sent at `sent_us` got its answer.
    fn replied(&self, sent_us: u64) {
        if self.last_reply_us.load(Ordering::Relaxed) < sent_us {
            self.last_reply_us.fetch_max(sent_us, Ordering::AcqRel);
        }
    }
}

/// A probe under way on a connection with this health: ends it however it ends (a runtime
/// shutting down cancels its task), so the connection can be suspected again.
struct Probing(Arc<Health>);

impl Drop for Probing {
    fn drop(&mut self) {
        self.0.probing.store(false, Ordering::Release);
    }
}

/// Probes a suspected connection (`PING` within `limit`) on a task of its own; `on_dead` runs
/// if no `PONG` comes back. Outside a tokio runtime, where nothing can be spawned, the
/// connection is taken for dead at once.
fn probe(
    mut conn: impl ConnectionLike + Send + 'static,
    health: Arc<Health>,
    limit: Duration,
    on_dead: impl FnOnce() + Send + 'static,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        on_dead();
        return;
    };
    runtime.spawn(async move {
        let probing = Probing(health);
        let ping = redis::cmd("PING");
        let sent = now_us();
        let pong = tokio::time::timeout(limit, conn.req_packed_command(&ping)).await;
        if matches!(pong, Ok(Ok(_))) {
            probing.0.replied(sent);
        } else {
            on_dead();
        }
    });
}

/// A push sender for a RESP3 connection that flags `health` broken when redis-rs reports the
/// connection closed (`PushKind::Disconnection`: the server closed it while idle — its
/// `timeout`, `CLIENT KILL`, a load balancer's idle cut — or it failed), so the next call takes
/// another connection instead of failing on this one as if Redis were down.
fn flag_broken_on_disconnect(health: &Arc<Health>) -> impl redis::aio::AsyncPushSender {
    let health = Arc::downgrade(health);
    move |info: redis::PushInfo| {
        if info.kind == redis::PushKind::Disconnection
            && let Some(health) = health.upgrade()
        {
            health.broken.store(true, Ordering::Release);
        }
        Ok::<(), std::convert::Infallible>(())
    }
}

/// Whether `client` speaks RESP3 (push senders need it).
fn speaks_resp3(client: &redis::Client) -> bool {
    client.get_connection_info().redis_settings().protocol() == redis::ProtocolVersion::RESP3
}

/// `config` for a connection of `client` that flags `health` broken when it closes
/// ([`flag_broken_on_disconnect`]), where the protocol can tell (RESP3); `config` as it is over
/// RESP2.
fn watching_close(
    config: AsyncConnectionConfig,
    client: &redis::Client,
    health: &Arc<Health>,
) -> AsyncConnectionConfig {
    if speaks_resp3(client) {
        config.set_push_sender(flag_broken_on_disconnect(health))
    } else {
        config
    }
}

/// One call in flight on a connection with `health`: runs `on_suspect` if dropped before
/// [`InFlight::done`] and the drop raises a suspicion ([`Health`]).
struct InFlight<'a, F: FnOnce()> {
    health: &'a Health,
    sent_us: u64,
    on_suspect: Option<F>,
}

impl<'a, F: FnOnce()> InFlight<'a, F> {
    fn new(health: &'a Health, on_suspect: F) -> Self {
        Self {
            health,
            sent_us: now_us(),
            on_suspect: Some(on_suspect),
        }
    }

    /// The call has its answer: a reply (`replied`) or an error.
    fn done(mut self, replied: bool) {
        self.on_suspect = None;
        if replied {
            self.health.replied(self.sent_us);
        }
    }
}

impl<F: FnOnce()> Drop for InFlight<'_, F> {
    fn drop(&mut self) {
        if let Some(on_suspect) = self.on_suspect.take()
            && self.health.suspect(self.sent_us)
        {
            on_suspect();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Multiplexed

/// One multiplexed connection that reconnects by itself (redis-rs's `ConnectionManager`, which
/// reconnects when the connection fails or drops), and that is replaced by a fresh one when it
/// stalls ([`Health`]). Calls already sent on the old connection finish or time out on it; it
/// is closed when the last of them lets go.
pub(crate) struct Managed {
    current: ArcSwap<Tracked>,
    client: redis::Client,
    config: ConnectionManagerConfig,
    probe_limit: Duration,
}

/// A connection manager and its health.
struct Tracked {
    manager: ConnectionManager,
    health: Arc<Health>,
}

impl Managed {
    /// `probe_limit` bounds the `PING` that settles a suspected stall (the connect timeout).
    pub(crate) fn new(
        manager: ConnectionManager,
        client: redis::Client,
        config: ConnectionManagerConfig,
        probe_limit: Duration,
    ) -> Self {
        Self {
            current: ArcSwap::from_pointee(Tracked {
                manager,
                health: Arc::default(),
            }),
            client,
            config,
            probe_limit,
        }
    }

    /// Runs `call` on the current connection, watched for a stall.
    async fn send<T>(
        self: &Arc<Self>,
        call: impl AsyncFnOnce(&mut ConnectionManager) -> RedisResult<T>,
    ) -> RedisResult<T> {
        let conn = self.current.load();
        let mut manager = conn.manager.clone();
        let flight = InFlight::new(&conn.health, || self.suspect(&conn));
        let result = call(&mut manager).await;
        flight.done(result.is_ok());
        result
    }

    /// Probes `conn`, and replaces it if the probe gets no answer.
    fn suspect(self: &Arc<Self>, conn: &Arc<Tracked>) {
        if !Arc::ptr_eq(&self.current.load(), conn) {
            // Replaced already: a call still in flight on the old one says nothing new.
            conn.health.probing.store(false, Ordering::Release);
            return;
        }
        let (this, stale) = (Arc::clone(self), Arc::clone(conn));
        probe(
            conn.manager.clone(),
            Arc::clone(&conn.health),
            self.probe_limit,
            move || this.replace(&stale),
        );
    }

    /// Replaces `stale` by a fresh connection (made on first use), unless it was replaced
    /// already.
    fn replace(&self, stale: &Arc<Tracked>) {
        if !Arc::ptr_eq(&self.current.load(), stale) {
            return;
        }
        let Ok(manager) =
            ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone())
        else {
            return; // the settings built the first one; keep it rather than none
        };
        let fresh = Arc::new(Tracked {
            manager,
            health: Arc::default(),
        });
        self.current.compare_and_swap(stale, fresh);
    }
}

// ---------------------------------------------------------------------------------------------
// Pool

/// A bb8 pool of multiplexed connections, and the connect errors its background connects meet.
#[derive(Clone)]
pub(crate) struct Pool {
    connections: bb8::Pool<PoolManager>,
    /// Most connections the pool holds.
    size: u32,
    errors: ConnectErrors,
    /// Bounds the `PING` that settles a suspected stall ([`Health`]): the connect timeout.
    probe_limit: Duration,
}

impl Pool {
    /// A pool of up to `size` connections to `client`'s server; nothing connects until the
    /// first call.
    pub(crate) fn new(client: redis::Client, size: u32, connect_timeout: Duration) -> Self {
        let errors = ConnectErrors::default();
        let pool = bb8::Pool::builder()
            .max_size(size)
            .test_on_check_out(false)
            // a failed connect is reported at once (below), not retried until the checkout
            // times out
            .retry_connection(false)
            .error_sink(Box::new(errors.clone()))
            .queue_strategy(bb8::QueueStrategy::Fifo)
            // bb8 asserts a non-zero timeout; a zero connect timeout (every connect times out)
            // is kept by the connect itself (`PoolManager`) and by `build`'s own deadline
            .connection_timeout(connect_timeout.max(Duration::from_millis(1)))
            .build_unchecked(PoolManager::new(client, connect_timeout));
        Self {
            connections: pool,
            size,
            errors,
            probe_limit: connect_timeout,
        }
    }

    /// Makes every connection the pool may hold now, and has each answer a `PING`, within the
    /// connect timeout. The pool otherwise connects on demand: a connection is made only when
    /// a call finds none idle, so the first calls under concurrency wait for connects (and a
    /// single-threaded caller, which always finds the one connection idle again, never makes
    /// a second).
    ///
    /// A connect that fails fails this at once with its error, as it fails a waiting call
    /// ([`checkout`]). A pooled connection found dead (flagged broken, or failing its `PING`
    /// with an error that needs a reconnect: closed by the server while idle) is flagged,
    /// dropped by the pool when it goes back, and replaced in a second round; one that is
    /// dead in that round too fails this with its error.
    pub(crate) async fn connect_all(&self) -> RedisResult<()> {
        let all = async {
            for round in 1..=CONNECT_ALL_ROUNDS {
                let held = self.hold_all().await?;
                // flagged broken already (a close heard while idle): not worth a `PING`
                let broken: Vec<bool> = held
                    .iter()
                    .map(|pooled| pooled.health.broken.load(Ordering::Relaxed))
                    .collect();
                let pings = futures_util::future::join_all(held.iter().zip(&broken).map(
                    |(pooled, &broken)| {
                        let mut conn = pooled.conn.clone();
                        async move {
                            if broken {
                                return Err(RedisError::from(io::Error::new(
                                    io::ErrorKind::NotConnected,
                                    "a pooled connection was closed",
                                )));
                            }
                            redis::cmd("PING").query_async::<String>(&mut conn).await
                        }
                    },
                ))
                .await;
                let mut dead = None;
                for ((pooled, ping), broken) in held.iter().zip(pings).zip(broken) {
                    match ping {
                        Ok(_) => {}
                        Err(e) if broken || e.is_unrecoverable_error() => {
                            // dropped by the pool when `held` goes back (`has_broken`)
                            pooled.health.broken.store(true, Ordering::Relaxed);
                            dead.get_or_insert(e);
                        }
                        Err(e) => return Err(e),
                    }
                }
                match dead {
                    None => return Ok(()),
                    Some(e) if round == CONNECT_ALL_ROUNDS => return Err(e),
                    Some(_) => {}
                }
            }
            unreachable!("the last round returns")
        };
        tokio::time::timeout(self.probe_limit, all)
            .await
            .unwrap_or_else(|_| Err(timed_out("connecting every pooled connection")))
    }

    /// Checks out every connection the pool may hold, all held together, so that each `get`
    /// past the idle ones makes a connection. A connect that fails meanwhile fails this at
    /// once with its error (bb8 would only tell the error sink, and the waiting `get`s would
    /// time out: [`ConnectErrors`]).
    async fn hold_all(&self) -> RedisResult<Vec<bb8::PooledConnection<'_, PoolManager>>> {
        let failures = self.errors.count();
        let failed = self.errors.0.failed.notified();
        tokio::pin!(failed);
        failed.as_mut().enable();
        if self.errors.count() != failures {
            return Err(self.errors.last());
        }
        let gets =
            futures_util::future::try_join_all((0..self.size).map(|_| self.connections.get()));
        tokio::select! {
            biased;
            () = &mut failed => Err(self.errors.last()),
            got = gets => got.map_err(|e| {
                if self.errors.count() == failures {
                    pool_error(e)
                } else {
                    self.errors.last()
                }
            }),
        }
    }
}

/// Rounds of [`Pool::connect_all`]: one, and one more to replace the connections it found dead.
const CONNECT_ALL_ROUNDS: u32 = 2;

/// bb8 makes connections in the background and, when one fails, only tells its error sink;
/// a caller waiting for a connection would wait until its deadline and learn nothing. This
/// sink keeps the error, counts it, and wakes the waiting callers, who fail with it at once:
/// refused (unavailable, fast) or a wrong password (a loud misconfiguration, not an outage).
#[derive(Clone, Default)]
struct ConnectErrors(Arc<ConnectErrorsInner>);

#[derive(Default)]
struct ConnectErrorsInner {
    last: Mutex<Option<RedisError>>,
    /// Connect failures so far: a caller that saw it change while it set up its wait missed
    /// the wake-up, and fails with the error all the same.
    count: AtomicU64,
    failed: tokio::sync::Notify,
}

impl ConnectErrors {
    fn count(&self) -> u64 {
        self.0.count.load(Ordering::Acquire)
    }

    fn last(&self) -> RedisError {
        let last = self.0.last.lock().unwrap_or_else(PoisonError::into_inner);
        last.clone().unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::NotConnected, "connecting to Redis failed").into()
        })
    }
}

impl std::fmt::Debug for ConnectErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConnectErrors")
    }
}

impl bb8::ErrorSink<RedisError> for ConnectErrors {
    fn sink(&self, error: RedisError) {
        *self.0.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(error);
        self.0.count.fetch_add(1, Ordering::Release);
        self.0.failed.notify_waiters();
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<RedisError>> {
        Box::new(self.clone())
    }
}

fn pool_error(e: bb8::RunError<RedisError>) -> RedisError {
    match e {
        bb8::RunError::User(e) => e,
        bb8::RunError::TimedOut => RedisError::from(io::Error::new(
            io::ErrorKind::TimedOut,
            "timed out waiting for a pooled Redis connection",
        )),
    }
}

/// Takes a connection from the pool and returns it at once, keeping a clone: a multiplexed
/// connection is shared safely, so no call waits for another's round trip to finish, and the
/// pool hands its connections out in turn. Connections flagged broken are dropped on the way.
///
/// The usual case — an idle connection, handed out on the first poll — costs one atomic load
/// more than `get()`. Only a call that has to wait for a connection registers for the
/// connect-failure wake-up, and fails with that error if a connect fails meanwhile.
async fn checkout(pool: &Pool) -> RedisResult<(MultiplexedConnection, Arc<Health>)> {
    loop {
        let failures = pool.errors.count();
        let get = pool.connections.get();
        tokio::pin!(get);
        let first = std::future::poll_fn(|cx| Poll::Ready(get.as_mut().poll(cx))).await;
        let pooled = match first {
            Poll::Ready(got) => got.map_err(pool_error)?,
            Poll::Pending => {
                let failed = pool.errors.0.failed.notified();
                tokio::pin!(failed);
                failed.as_mut().enable();
                if pool.errors.count() != failures {
                    return Err(pool.errors.last());
                }
                tokio::select! {
                    got = &mut get => got.map_err(pool_error)?,
                    () = &mut failed => return Err(pool.errors.last()),
                }
            }
        };
        let health = &pooled.health;
        // A broken connection goes back now, and bb8 drops it (`has_broken`).
        if !health.broken.load(Ordering::Relaxed) {
            return Ok((pooled.conn.clone(), Arc::clone(health)));
        }
    }
}

impl Pool {
    /// Checks a connection out, runs `call` on it, and flags the connection broken if the call
    /// failed with an error that needs a reconnect, or stalled ([`Health`]: abandoned after a
    /// wait with nothing back on the connection, and then silent to a `PING`, sent at once);
    /// the next checkout then drops it and bb8 makes a new one.
    async fn send<T>(
        &self,
        call: impl AsyncFnOnce(&mut MultiplexedConnection) -> RedisResult<T>,
    ) -> RedisResult<T> {
        let (conn, health) = checkout(self).await?;
        let mut flight = PooledCall {
            conn,
            health,
            sent_us: now_us(),
            probe_limit: self.probe_limit,
            answered: false,
        };
        let result = call(&mut flight.conn).await;
        flight.answered = true;
        if result.is_ok() {
            flight.health.replied(flight.sent_us);
        } else if let Err(e) = &result
            && e.is_unrecoverable_error()
        {
            flight.health.broken.store(true, Ordering::Relaxed);
        }
        result
    }
}

/// One call on a pooled connection ([`InFlight`] for the pool, which holds the connection so
/// that a call abandoned on a suspected stall probes it at once): dropped unanswered, it probes
/// the connection if the drop raises a suspicion ([`Health`]), and the probe's silence flags
/// the connection broken. (The probe waited for the connection's next checkout before, so
/// that checkout's call went to the dead path too.)
struct PooledCall {
    conn: MultiplexedConnection,
    health: Arc<Health>,
    sent_us: u64,
    probe_limit: Duration,
    answered: bool,
}

impl Drop for PooledCall {
    fn drop(&mut self) {
        if !self.answered && self.health.suspect(self.sent_us) {
            let suspect = Arc::clone(&self.health);
            probe(
                self.conn.clone(),
                Arc::clone(&self.health),
                self.probe_limit,
                move || suspect.broken.store(true, Ordering::Release),
            );
        }
    }
}

/// Makes the pool's multiplexed connections, each with a broken flag. The pool does not test a
/// connection on checkout (that would cost a PING round trip per decision); instead a
/// connection that failed with an error that needs a reconnect is flagged, and bb8 drops it
/// when it next comes back.
///
/// Not `bb8_redis::RedisConnectionManager`: that one connects with redis-rs's defaults, whose
/// 500 ms response timeout would cut short any call the store gives longer. These connections
/// have no response timeout of their own; the store's deadline bounds every call.
#[derive(Debug, Clone)]
pub(crate) struct PoolManager {
    client: redis::Client,
    config: AsyncConnectionConfig,
    connect_timeout: Duration,
}

impl PoolManager {
    /// Connections to `client`'s server, each connect (and validity check) bounded by
    /// `connect_timeout`.
    pub(crate) fn new(client: redis::Client, connect_timeout: Duration) -> Self {
        Self {
            client,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(connect_timeout))
                .set_response_timeout(None),
            connect_timeout,
        }
    }
}

/// A pooled connection and whether it must be replaced.
pub(crate) struct PooledConn {
    conn: MultiplexedConnection,
    health: Arc<Health>,
}

impl bb8::ManageConnection for PoolManager {
    type Connection = PooledConn;
    type Error = RedisError;

    /// Over RESP3 (the store's default) the connection flags itself broken when it closes
    /// ([`flag_broken_on_disconnect`]), so [`checkout`] drops it before a call meets it.
    async fn connect(&self) -> Result<PooledConn, RedisError> {
        let health = Arc::default();
        let config = watching_close(self.config.clone(), &self.client, &health);
        Ok(PooledConn {
            conn: self
                .client
                .get_multiplexed_async_connection_with_config(&config)
                .await?,
            health,
        })
    }

    /// A `PING` answered `PONG` within the connect timeout (the connection has no response
    /// timeout of its own). Not used by the store's pool, which does not test on checkout.
    async fn is_valid(&self, conn: &mut PooledConn) -> Result<(), RedisError> {
        let ping = redis::cmd("PING");
        let pong = ping.query_async::<String>(&mut conn.conn);
        match tokio::time::timeout(self.connect_timeout, pong).await {
            Ok(Ok(pong)) if pong == "PONG" => Ok(()),
            Ok(Ok(_)) => Err((ErrorKind::Extension, "ping request").into()),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(timed_out("checking a pooled connection")),
        }
    }

    fn has_broken(&self, conn: &mut PooledConn) -> bool {
        conn.health.broken.load(Ordering::Relaxed)
    }
}

// ---------------------------------------------------------------------------------------------
// Sentinel

/// A multiplexed connection to the primary the sentinels name, re-resolved after a failover.
///
/// The connection is dropped — and the next call asks the sentinels again — when a call fails
/// in a way that says this may no longer be the primary: an I/O error or dropped connection (it
/// died), `READONLY` (it was demoted), `MASTERDOWN`, or a stall ([`Health`]: a call abandoned
/// after a silent wait, then a `PING` unanswered within the resolve timeout: it hangs, and may
/// have been failed over from; a caller that gave up sooner, or a primary that is only slow,
/// says nothing of the connection). A failed call is never resent, so a decision is
/// applied at most once. Only one resolution runs at a time; it runs on its own task, so a
/// caller's deadline cannot abandon it half done. It asks every sentinel at once
/// ([`first_primary`]).
///
/// A primary deposed while it stays up (`SENTINEL FAILOVER`, or a primary cut off and back)
/// keeps answering as master, and would keep this connection, until the sentinels convert it
/// to a replica some 10 s later; what it decides meanwhile is lost when it resyncs, while
/// other instances decide on the promoted replica. So each sentinel is watched on a task of
/// its own ([`watch_switches`]): its `+switch-master` announcements, and its answer to
/// `SENTINEL GET-MASTER-ADDR-BY-NAME` each time the watch (re)subscribes, drop the connection
/// when they name another server for the master ([`depose`]); the next call resolves afresh.
/// Nothing is resent and no call waits on a watch. The watches end when this is dropped.
pub(crate) struct SentinelConn {
    /// One client per sentinel.
    clients: Arc<tokio::sync::Mutex<Vec<SentinelClient>>>,
    current: Arc<Mutex<Current>>,
    config: AsyncConnectionConfig,
    resolve_timeout: Duration,
    /// The sentinel watches ([`watch_switches`]), aborted on drop.
    watches: Vec<tokio::task::AbortHandle>,
}

#[derive(Default)]
struct Current {
    /// Bumped at every resolution, so a stale failure cannot drop a newer connection.
    generation: u64,
    conn: Option<MultiplexedConnection>,
    /// The current connection's server (host and port, as the sentinels name it).
    addr: Option<(String, u16)>,
    /// The current connection's.
    health: Arc<Health>,
    /// The primary the sentinels named last: by a resolution, or by a watch (a
    /// `+switch-master`, or the catch-up question when it subscribes). What a registry's
    /// subscription compares its own server with ([`SentinelConn::deposed`]).
    named: tokio::sync::watch::Sender<Option<(String, u16)>>,
}

impl Current {
    /// Records `primary` as the one the sentinels name now.
    fn name(&self, primary: &(String, u16)) {
        self.named.send_if_modified(|named| {
            let changed = named.as_ref() != Some(primary);
            if changed {
                *named = Some(primary.clone());
            }
            changed
        });
    }
}

impl Drop for SentinelConn {
    fn drop(&mut self) {
        for watch in &self.watches {
            watch.abort();
        }
    }
}

impl SentinelConn {
    /// `resolve_timeout` bounds one resolution (sentinel queries, the primary's role check and
    /// the connect), and each step of a sentinel watch. `watched` holds one client per
    /// sentinel (over RESP3, which lets a subscribed connection also run commands), watched
    /// for failovers of `master` ([`watch_switches`]) on the current runtime; none outside one.
    pub(crate) fn new(
        clients: Vec<SentinelClient>,
        master: &str,
        watched: Vec<redis::Client>,
        resolve_timeout: Duration,
    ) -> Self {
        let current = Arc::new(Mutex::new(Current::default()));
        let watches = match tokio::runtime::Handle::try_current() {
            Ok(runtime) => watched
                .into_iter()
                .map(|sentinel| {
                    let watch = watch_switches(
                        sentinel,
                        master.to_owned(),
                        Arc::downgrade(&current),
                        resolve_timeout,
                    );
                    runtime.spawn(watch).abort_handle()
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        Self {
            clients: Arc::new(tokio::sync::Mutex::new(clients)),
            current,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(resolve_timeout))
                .set_response_timeout(None),
            resolve_timeout,
            watches,
        }
    }

    /// The current connection, unless it closed ([`flag_broken_on_disconnect`]: then it is
    /// dropped, and the caller asks the sentinels again).
    fn cached(&self) -> Option<(u64, MultiplexedConnection, Arc<Health>)> {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if current.health.broken.load(Ordering::Acquire) {
            current.conn = None;
        }
        current
            .conn
            .clone()
            .map(|c| (current.generation, c, Arc::clone(&current.health)))
    }

    fn invalidate(&self, generation: u64) {
        invalidate(&self.current, generation);
    }

    /// Probes the connection of `generation` ([`Health`]), and drops it if the probe gets no
    /// answer; nothing if it was replaced already.
    fn suspect(&self, generation: u64, health: &Arc<Health>) {
        let conn = {
            let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
            current
                .conn
                .clone()
                .filter(|_| current.generation == generation)
        };
        let Some(conn) = conn else {
            health.probing.store(false, Ordering::Release);
            return;
        };
        let current = Arc::clone(&self.current);
        probe(conn, Arc::clone(health), self.resolve_timeout, move || {
            invalidate(&current, generation);
        });
    }

    /// The current primary's connection, asking the sentinels for it if there is none.
    async fn connection(&self) -> RedisResult<(u64, MultiplexedConnection, Arc<Health>)> {
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let clients = Arc::clone(&self.clients).lock_owned().await;
        if let Some(c) = self.cached() {
            return Ok(c);
        }
        let (current, config, limit) = (
            Arc::clone(&self.current),
            self.config.clone(),
            self.resolve_timeout,
        );
        let resolve = tokio::spawn(async move {
            let mut clients = clients;
            let health = Arc::default();
            let connect = async {
                let primary = first_primary(&mut clients).await?;
                let config = watching_close(config, &primary, &health);
                let addr = host_port(primary.get_connection_info().addr());
                primary
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map(|conn| (conn, addr))
            };
            let (conn, addr) = tokio::time::timeout(limit, connect)
                .await
                .map_err(|_| timed_out("resolving the primary through Sentinel"))??;
            let mut current = current.lock().unwrap_or_else(PoisonError::into_inner);
            current.generation += 1;
            current.conn = Some(conn.clone());
            if let Some(addr) = &addr {
                current.name(addr);
            }
            current.addr = addr;
            current.health = health;
            Ok((current.generation, conn, Arc::clone(&current.health)))
        });
        resolve.await.map_err(|e| {
            RedisError::from(io::Error::other(format!("Sentinel resolution failed: {e}")))
        })?
    }

    /// A client for the primary the sentinels name now (its `ROLE` checked), asked within the
    /// resolve timeout, for a connection of the caller's own: the policy registry subscribes
    /// through it. The store's connection is not touched.
    pub(crate) async fn primary_client(&self) -> RedisResult<redis::Client> {
        let mut clients = self.clients.lock().await;
        tokio::time::timeout(self.resolve_timeout, first_primary(&mut clients))
            .await
            .map_err(|_| timed_out("resolving the primary through Sentinel"))?
    }

    /// Resolves once the sentinels name a primary other than `client`'s server (at once if
    /// they do already; never for a client without a host and port): a connection of the
    /// caller's own on that server is on a deposed primary, which may stay up and answer as
    /// master until the sentinels convert it, some 10 s later. Named by this connection's
    /// resolutions and its watches; a watch that ended (this connection dropped) names no
    /// one again, and this never resolves.
    pub(crate) fn deposed(
        &self,
        client: &redis::Client,
    ) -> impl Future<Output = ()> + Send + 'static + use<> {
        let own = host_port(client.get_connection_info().addr());
        let mut named = self
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .named
            .subscribe();
        async move {
            let Some(own) = own else {
                return std::future::pending().await;
            };
            loop {
                if named
                    .borrow_and_update()
                    .as_ref()
                    .is_some_and(|n| *n != own)
                {
                    return;
                }
                if named.changed().await.is_err() {
                    return std::future::pending().await;
                }
            }
        }
    }

    pub(crate) async fn command(&self, cmd: &Cmd) -> RedisResult<Value> {
        self.send(
            async |conn| conn.req_packed_command(cmd).await,
            |result| match result {
                Err(e) => not_the_primary(e),
                Ok(Value::ServerError(e)) => server_error_not_the_primary(e.code()),
                Ok(_) => false,
            },
        )
        .await
    }

    pub(crate) async fn pipeline(
        &self,
        pipe: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        self.send(
            async |conn| conn.req_packed_commands(pipe, offset, count).await,
            |result| match result {
                Err(e) => not_the_primary(e),
                // a transaction's errors are inside EXEC's array
                Ok(values) => values.iter().any(|v| match v {
                    Value::ServerError(e) => server_error_not_the_primary(e.code()),
                    Value::Array(inner) => inner.iter().any(
                        |v| matches!(v, Value::ServerError(e) if server_error_not_the_primary(e.code())),
                    ),
                    _ => false,
                }),
            },
        )
        .await
    }

    /// Runs `call` on the primary's connection, watched for a stall, and drops the connection
    /// if the answer says the server may no longer be the primary (`not_the_primary`).
    async fn send<T>(
        &self,
        call: impl AsyncFnOnce(&mut MultiplexedConnection) -> RedisResult<T>,
        not_the_primary: impl FnOnce(&RedisResult<T>) -> bool,
    ) -> RedisResult<T> {
        let (generation, mut conn, health) = self.connection().await?;
        let flight = InFlight::new(&health, || self.suspect(generation, &health));
        let result = call(&mut conn).await;
        let gone = not_the_primary(&result);
        flight.done(!gone);
        if gone {
            self.invalidate(generation);
        }
        result
    }
}

/// Asks every sentinel at once for the primary (each lookup checks that the server its
/// sentinel names answers `ROLE` as master) and takes the first found. A sentinel that is down
/// fails its lookup at once; one that hangs (a frozen process, a host that drops packets) only
/// after redis-rs's own timeouts, about a second: asked in order, every resolution waited for it
/// and, within a connect timeout of a second or less, never got to the next sentinel. Without a
/// primary from any of them, the last error.
async fn first_primary(sentinels: &mut [SentinelClient]) -> RedisResult<redis::Client> {
    use futures_util::StreamExt as _;
    let mut lookups: futures_util::stream::FuturesUnordered<_> = sentinels
        .iter_mut()
        .map(SentinelClient::async_get_client)
        .collect();
    let mut last = None;
    while let Some(lookup) = lookups.next().await {
        match lookup {
            Ok(primary) => return Ok(primary),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| RedisError::from((ErrorKind::EmptySentinelList, "no sentinels"))))
}

/// The channel on which a sentinel announces a failover's outcome:
/// `<master name> <old ip> <old port> <new ip> <new port>`.
const SWITCH_MASTER: &str = "+switch-master";

/// How often a sentinel watch checks with a `PING` that its sentinel still answers (a
/// connection whose peer vanished without a reset says nothing otherwise).
const WATCH_PING_EVERY: Duration = Duration::from_secs(5);

/// The longest wait before a sentinel watch connects again after losing its sentinel.
const WATCH_RETRY_MAX: Duration = Duration::from_secs(5);

/// Watches one sentinel for failovers of `master` until `current` is gone: subscribes to
/// [`SWITCH_MASTER`], then asks `SENTINEL GET-MASTER-ADDR-BY-NAME` (a switch announced while
/// the watch was not subscribed), and [`depose`]s the current connection whenever either names
/// another server. Each step is bounded by `limit`, and a sentinel that stops answering a
/// `PING` every [`WATCH_PING_EVERY`] is connected to afresh, after a back-off that doubles up
/// to [`WATCH_RETRY_MAX`]. One task per sentinel, so a sentinel that is down or hangs holds up
/// only its own watch.
async fn watch_switches(
    sentinel: redis::Client,
    master: String,
    current: std::sync::Weak<Mutex<Current>>,
    limit: Duration,
) {
    let mut retry = Duration::from_millis(100);
    while current.strong_count() > 0 {
        let subscribed = watch_once(&sentinel, &master, &current, limit).await;
        retry = if subscribed {
            Duration::from_millis(100)
        } else {
            (retry * 2).min(WATCH_RETRY_MAX)
        };
        tokio::time::sleep(retry).await;
    }
}

/// One connection's worth of [`watch_switches`]: whether it got as far as subscribing.
async fn watch_once(
    sentinel: &redis::Client,
    master: &str,
    current: &std::sync::Weak<Mutex<Current>>,
    limit: Duration,
) -> bool {
    let (pushes, mut pushed) = tokio::sync::mpsc::unbounded_channel();
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(limit))
        .set_response_timeout(None)
        .set_push_sender(pushes);
    let subscribe = async {
        let mut conn = sentinel
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        conn.subscribe(SWITCH_MASTER).await?;
        Ok::<_, RedisError>(conn)
    };
    let Ok(Ok(mut conn)) = tokio::time::timeout(limit, subscribe).await else {
        return false;
    };
    let mut ask = redis::cmd("SENTINEL");
    ask.arg("GET-MASTER-ADDR-BY-NAME").arg(master);
    // A refusal (a sentinel-side user without the right) or no answer leaves the catch-up
    // undone, not the watch: the subscription stands, and a sentinel that stopped answering
    // fails the next `PING`. (Taken for a lost connection, a refusal reconnected every 100 ms.)
    if let Ok(Ok(Some(primary))) =
        tokio::time::timeout(limit, ask.query_async::<Option<(String, u16)>>(&mut conn)).await
    {
        depose(current, &primary);
    }
    let mut ping_at = tokio::time::Instant::now() + WATCH_PING_EVERY;
    loop {
        tokio::select! {
            push = pushed.recv() => match push {
                Some(push) if push.kind == redis::PushKind::Message => {
                    if let Some(primary) = switched_to(&push.data, master) {
                        depose(current, &primary);
                    }
                }
                Some(push) if push.kind != redis::PushKind::Disconnection => {}
                _ => return true,
            },
            () = tokio::time::sleep_until(ping_at) => {
                let ping = redis::cmd("PING");
                let pong = tokio::time::timeout(limit, ping.query_async::<Value>(&mut conn)).await;
                if !matches!(pong, Ok(Ok(_))) {
                    return true;
                }
                ping_at = tokio::time::Instant::now() + WATCH_PING_EVERY;
            }
        }
        if current.strong_count() == 0 {
            return true;
        }
    }
}

/// The new primary a [`SWITCH_MASTER`] message (`data`: channel, payload) names for `master`.
fn switched_to(data: &[Value], master: &str) -> Option<(String, u16)> {
    let [channel, payload] = data else {
        return None;
    };
    let channel: String = redis::from_redis_value(channel.clone()).ok()?;
    let payload: String = redis::from_redis_value(payload.clone()).ok()?;
    if channel != SWITCH_MASTER {
        return None;
    }
    match payload.split_whitespace().collect::<Vec<_>>()[..] {
        [name, _, _, host, port] if name == master => Some((host.to_owned(), port.parse().ok()?)),
        _ => None,
    }
}

/// Drops the current connection if its server is not `primary`, the one a sentinel names now
/// (a connection being made meanwhile is checked by the next announcement or re-subscription).
fn depose(current: &std::sync::Weak<Mutex<Current>>, primary: &(String, u16)) {
    let Some(current) = current.upgrade() else {
        return;
    };
    let mut current = current.lock().unwrap_or_else(PoisonError::into_inner);
    current.name(primary);
    if current.conn.is_some() && current.addr.as_ref().is_some_and(|addr| addr != primary) {
        current.conn = None;
        current.addr = None;
    }
}

/// A server's host and port, as the sentinels name it; `None` for a Unix socket.
fn host_port(addr: &redis::ConnectionAddr) -> Option<(String, u16)> {
    match addr {
        redis::ConnectionAddr::Tcp(host, port)
        | redis::ConnectionAddr::TcpTls { host, port, .. } => Some((host.clone(), *port)),
        _ => None,
    }
}

/// Drops the connection of `generation`, unless a newer one replaced it.
fn invalidate(current: &Mutex<Current>, generation: u64) {
    let mut current = current.lock().unwrap_or_else(PoisonError::into_inner);
    if current.generation == generation {
        current.conn = None;
    }
}

fn not_the_primary(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Io | ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
    ) || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        // a transaction refused while queueing (EXECABORT) carries its commands' errors
        || (e.kind() == ErrorKind::Server(ServerErrorKind::ExecAbort)
            && e.clone().into_server_errors().is_some_and(|errors| {
                errors
                    .iter()
                    .any(|(_, e)| server_error_not_the_primary(e.code()))
            }))
}

fn server_error_not_the_primary(code: &str) -> bool {
    matches!(code, "READONLY" | "MASTERDOWN")
}

fn timed_out(what: &str) -> RedisError {
    RedisError::from(io::Error::new(
        io::ErrorKind::TimedOut,
        format!("timed out {what}"),
    ))
}

// ---------------------------------------------------------------------------------------------
// Cluster

/// A Redis Cluster: redis-rs's cluster connection, replaced when the path to one of its nodes
/// stalls, and direct connections to the nodes that redirections name but that the cluster
/// connection does not know.
///
/// - **Stalls** ([`Health`]): a keyed call abandoned after [`STALL_FLOOR_US`] has its slot's
///   primary probed with a `PING` on the same connection, in the background, within the
///   connect timeout. Silence replaces the whole cluster connection (a fresh one reads the slot
///   map and connects to every node again); calls already sent on the old one finish or time
///   out on it. The cluster connection does not reconnect a node whose path died without a
///   reset, and answers from the other nodes say nothing of that one, so every abandoned call
///   counts (one probe at a time).
/// - **Unknown nodes**: a slot resharded to a node that joined after the slot map was read
///   (it owns no slot until the move ends, so no slot map lists it) is answered with `ASK` or
///   `MOVED` naming that node. The cluster connection only routes to nodes it has a
///   connection to, so such a redirection is followed on a direct connection made with the
///   first initial node's settings (credentials, TLS, timeouts), kept for the next calls.
pub(crate) struct Cluster {
    current: ArcSwap<TrackedCluster>,
    client: redis::cluster::ClusterClient,
    /// Bounds a probe's `PING` and a replacement's connect (the connect timeout).
    probe_limit: Duration,
    /// How to reach a node by address: the first initial node's settings.
    node_info: redis::ConnectionInfo,
    node_config: AsyncConnectionConfig,
    /// Connections to nodes reached directly, by address, each watched for a stall as the
    /// other connection kinds are ([`Health`]: silence to a probe forgets it, and the next call
    /// connects afresh).
    direct: Mutex<std::collections::HashMap<(String, u16), DirectConn>>,
}

/// A cluster connection and its health (only its probe flag is used: see [`Cluster`]).
struct TrackedCluster {
    conn: ClusterConnection,
    health: Arc<Health>,
}

/// A direct connection to a cluster node and its health.
type DirectConn = (MultiplexedConnection, Arc<Health>);

/// The most nodes reached directly that are remembered at once (they are nodes that joined
/// while a slot moves to them, so a handful at most; the map is cleared when full).
const MAX_DIRECT_NODES: usize = 64;

impl Cluster {
    pub(crate) fn new(
        conn: ClusterConnection,
        client: redis::cluster::ClusterClient,
        probe_limit: Duration,
        node_info: redis::ConnectionInfo,
        node_config: AsyncConnectionConfig,
    ) -> Self {
        Self {
            current: ArcSwap::from_pointee(TrackedCluster {
                conn,
                health: Arc::default(),
            }),
            client,
            probe_limit,
            node_info,
            node_config,
            direct: Mutex::default(),
        }
    }

    /// Runs `call` on the current cluster connection; if the caller abandons it after
    /// [`STALL_FLOOR_US`], the primary of `key`'s slot is probed.
    async fn send<T>(
        self: &Arc<Self>,
        key: Option<&[u8]>,
        call: impl AsyncFnOnce(&mut ClusterConnection) -> RedisResult<T>,
    ) -> RedisResult<T> {
        let tracked = self.current.load_full();
        let mut conn = tracked.conn.clone();
        let flight = key.map(|key| InFlight::new(&tracked.health, || self.suspect(&tracked, key)));
        let result = call(&mut conn).await;
        if let Some(flight) = flight {
            // never `replied`: another node's answers say nothing of this one's path
            flight.done(false);
        }
        result
    }

    /// Probes the primary of `key`'s slot on `tracked`, and replaces `tracked` if the probe
    /// gets no answer.
    fn suspect(self: &Arc<Self>, tracked: &Arc<TrackedCluster>, key: &[u8]) {
        let probing = Probing(Arc::clone(&tracked.health));
        if !Arc::ptr_eq(&self.current.load(), tracked) {
            return; // replaced already
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::with_key(
            key,
            SlotAddr::Master,
        )));
        let (this, stale) = (Arc::clone(self), Arc::clone(tracked));
        runtime.spawn(async move {
            let _probing = probing;
            let mut conn = stale.conn.clone();
            let pong = tokio::time::timeout(
                this.probe_limit,
                conn.route_command(redis::cmd("PING"), route),
            )
            .await;
            if matches!(pong, Ok(Ok(_))) {
                return;
            }
            if let Ok(Ok(fresh)) =
                tokio::time::timeout(this.probe_limit, this.client.get_async_connection()).await
            {
                let fresh = Arc::new(TrackedCluster {
                    conn: fresh,
                    health: Arc::default(),
                });
                this.current.compare_and_swap(&stale, fresh);
            }
        });
    }

    /// The host of the node a request routed by the cluster connection went to, as far as a
    /// redirection naming no host needs it ([`redirect_target`]): the first initial node's. A
    /// node names no host when its endpoint is unknown to the cluster, and then `CLUSTER SLOTS`
    /// names none either: redis-rs gives every node of its slot map the host of the node that
    /// answered it, an initial node, so the nodes are reached through one host (a load
    /// balancer or one machine, the setup that option is for).
    fn sender_host(&self) -> Option<String> {
        match self.node_info.addr() {
            redis::ConnectionAddr::Tcp(host, _) | redis::ConnectionAddr::TcpTls { host, .. } => {
                Some(host.clone())
            }
            _ => None,
        }
    }

    /// A direct connection to `node`, with the first initial node's settings, remembered.
    async fn connect_to(&self, node: &(String, u16)) -> RedisResult<DirectConn> {
        let client = client_at(&self.node_info, node)?;
        // Over RESP3 the connection flags itself broken when the node closes it
        // ([`flag_broken_on_disconnect`]), and [`Cluster::direct`] connects afresh.
        let health = Arc::default();
        let config = watching_close(self.node_config.clone(), &client, &health);
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let held = (conn, health);
        let mut direct = self.direct.lock().unwrap_or_else(PoisonError::into_inner);
        if direct.len() >= MAX_DIRECT_NODES {
            direct.clear();
        }
        direct.insert(node.clone(), held.clone());
        Ok(held)
    }

    /// Forgets the direct connection to `node` if it is still the one with `health`.
    fn forget_direct(&self, node: &(String, u16), health: &Arc<Health>) {
        let mut direct = self.direct.lock().unwrap_or_else(PoisonError::into_inner);
        if direct
            .get(node)
            .is_some_and(|(_, h)| Arc::ptr_eq(h, health))
        {
            direct.remove(node);
        }
    }

    /// Sends `cmd` to the node at `host:port` on a direct connection (preceded by `ASKING`
    /// for `ask`), made on first use. A failed connection is forgotten; so is one that a call
    /// abandoned after [`STALL_FLOOR_US`] suspects and a `PING` does not clear ([`Health`]),
    /// and one the node closed while idle (heard over RESP3).
    async fn direct(
        self: &Arc<Self>,
        host: &str,
        port: u16,
        cmd: &Cmd,
        ask: bool,
    ) -> RedisResult<Value> {
        let node = (host.to_owned(), port);
        // one the node closed is dropped here (the connection flagged itself broken)
        let held = {
            let mut direct = self.direct.lock().unwrap_or_else(PoisonError::into_inner);
            if direct
                .get(&node)
                .is_some_and(|(_, health)| health.broken.load(Ordering::Acquire))
            {
                direct.remove(&node);
            }
            direct.get(&node).cloned()
        };
        let (mut conn, health) = if let Some(held) = held {
            held
        } else {
            self.connect_to(&node).await?
        };
        let watched = conn.clone();
        let flight = InFlight::new(&health, || {
            let (this, node, stale) = (Arc::clone(self), node.clone(), Arc::clone(&health));
            probe(watched, Arc::clone(&health), self.probe_limit, move || {
                this.forget_direct(&node, &stale);
            });
        });
        let reply = if ask {
            let mut pipe = Pipeline::with_capacity(2);
            pipe.cmd("ASKING").add_command(cmd.clone());
            conn.req_packed_commands(&pipe, 1, 1)
                .await
                .and_then(|mut replies| {
                    replies.pop().ok_or_else(|| {
                        RedisError::from((ErrorKind::Parse, "no reply after ASKING"))
                    })
                })
        } else {
            conn.req_packed_command(cmd).await
        };
        let failed = reply.as_ref().is_err_and(|e| {
            e.is_io_error()
                || e.is_connection_dropped()
                || e.is_timeout()
                || e.kind() == ErrorKind::Io
        });
        flight.done(!failed);
        if failed {
            self.forget_direct(&node, &health);
        }
        reply.and_then(Value::extract_error)
    }
}

/// Sends one command on the cluster, following `MOVED` and `ASK` itself.
///
/// The cluster connection is built with no retries of its own: it would resend a request
/// after its connection dropped, when the script may already have run. A redirection, in
/// contrast, means the node did not run the command, so following it keeps every decision
/// applied at most once. `MOVED` goes to the named node (the connection refreshes its slot map
/// meanwhile); `ASK` goes to the importing node preceded by `ASKING`, in one round trip.
async fn cluster_command(cluster: &Arc<Cluster>, cmd: &Cmd) -> RedisResult<Value> {
    cluster
        .send(script_key(cmd), async |conn| {
            follow_redirects(cluster, conn, cmd).await
        })
        .await
}

/// [`cluster_command`] on `conn`.
async fn follow_redirects(
    cluster: &Arc<Cluster>,
    conn: &mut ClusterConnection,
    cmd: &Cmd,
) -> RedisResult<Value> {
    let mut result = conn.req_packed_command(cmd).await;
    // The host of the node the last attempt went to: a redirection that names no host points
    // to another port there. The first attempt went wherever the cluster connection routes the
    // key; its host is taken to be the first initial node's (see `Cluster::sender_host`).
    let mut sender = None;
    for _ in 0..MAX_REDIRECTS {
        let Err(err) = &result else {
            return result;
        };
        let Some((host, port)) =
            redirect_target(err, || sender.clone().or_else(|| cluster.sender_host()))
        else {
            return result;
        };
        sender = Some(host.clone());
        let ask = err.kind() == ErrorKind::Server(ServerErrorKind::Ask);
        let node = SingleNodeRoutingInfo::ByAddress {
            host: host.clone(),
            port,
        };
        result = if ask {
            let mut pipe = Pipeline::with_capacity(2);
            pipe.cmd("ASKING").add_command(cmd.clone());
            conn.route_pipeline(pipe, 0, 2, node)
                .await
                .and_then(|replies| {
                    let mut replies = replies.into_iter();
                    // A reply that needs action (another redirection) already came back as Err.
                    match (replies.next(), replies.next()) {
                        (Some(Value::ServerError(e)), _) => Err(e.into()),
                        (Some(_), Some(reply)) => Ok(reply),
                        _ => Err(RedisError::from((
                            ErrorKind::Parse,
                            "ASKING pipeline returned too few replies",
                        ))),
                    }
                })
        } else {
            conn.route_command(cmd.clone(), RoutingInfo::SingleNode(node))
                .await
        };
        // A node the cluster connection has no connection to (see `Cluster`): directly.
        if result
            .as_ref()
            .is_err_and(|e| e.kind() == ErrorKind::ClusterConnectionNotFound)
        {
            result = cluster.direct(&host, port, cmd, ask).await;
        }
    }
    result
}

/// A client for `node` with `like`'s settings (credentials, protocol, TLS).
fn client_at(like: &redis::ConnectionInfo, node: &(String, u16)) -> RedisResult<redis::Client> {
    let addr = match like.addr() {
        redis::ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => redis::ConnectionAddr::TcpTls {
            host: node.0.clone(),
            port: node.1,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => redis::ConnectionAddr::Tcp(node.0.clone(), node.1),
    };
    redis::Client::open(like.clone().set_addr(addr))
}

/// The node a `MOVED` or `ASK` error points to. A node with an unknown endpoint
/// (`cluster-preferred-endpoint-type unknown-endpoint`) names only a port (`-MOVED 3999 :6380`):
/// per the Redis Cluster spec that port is on the host the redirected request was sent to,
/// which `sender` gives (`None`: not known, and the redirection is not followed).
fn redirect_target(
    err: &RedisError,
    sender: impl FnOnce() -> Option<String>,
) -> Option<(String, u16)> {
    let (addr, _slot) = err.redirect_node()?;
    let (host, port) = addr.rsplit_once(':')?;
    let port = port.parse().ok()?;
    let host = if host.is_empty() {
        sender()?
    } else {
        host.to_owned()
    };
    Some((host, port))
}

/// Sends the commands of `pipe` to their keys' nodes, all keys at once: concurrent commands
/// share each node's multiplexed connection, so a batch costs one round trip per node (the
/// nodes in parallel). A key's commands stay in the batch's order, since concurrent commands
/// on one node are not bound to arrive in the order they were issued and a batch applies its
/// requests in order: a key with one command sends it alone, following `MOVED` and `ASK`
/// ([`cluster_command`]); a key with several sends them as one transaction to its slot's
/// primary, in order, in one round trip ([`key_pipeline`]). Commands are not sent as one cluster pipeline across keys,
/// because a redirection of one command would fail the whole pipeline, losing the others'
/// replies. Plain error replies (`NOSCRIPT`, a script error) stay in place; a connection
/// failure, or a cluster state that outlasts the redirections (`CLUSTERDOWN`, `TRYAGAIN`),
/// fails that command alone (a key's transaction lost with its connection fails all of its
/// commands). A command not answered by `cut` fails alone as timed out (an I/O error, class
/// unavailable): it may have run, as any call that times out.
async fn cluster_pipeline(
    cluster: &Arc<Cluster>,
    pipe: &Pipeline,
    cut: Option<tokio::time::Instant>,
) -> Vec<RedisResult<Value>> {
    let cmds: Vec<&Cmd> = pipe.cmd_iter().collect();
    let chains = chains_by_key(&cmds);
    let runs = chains.iter().map(|(key, chain)| {
        let cmds = &cmds;
        async move {
            if let (Some(key), [_, _, ..]) = (key, chain.as_slice()) {
                key_pipeline(cluster, cmds, key, chain, cut).await
            } else {
                one_by_one(cluster, cmds, chain, cut).await
            }
        }
    });
    let mut out: Vec<Option<RedisResult<Value>>> = (0..cmds.len()).map(|_| None).collect();
    for (i, reply) in futures_util::future::join_all(runs)
        .await
        .into_iter()
        .flatten()
    {
        out[i] = Some(reply);
    }
    out.into_iter()
        .map(|reply| reply.expect("every command is in one chain"))
        .collect()
}

/// `call`'s result, or a timeout error if `cut` passes first (or has passed: then `call` is
/// not started).
async fn by_cut<T>(
    cut: Option<tokio::time::Instant>,
    call: impl Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    let timed_out = || {
        RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no reply from the key's node before the batch's deadline",
        ))
    };
    match cut {
        Some(at) if tokio::time::Instant::now() >= at => Err(timed_out()),
        Some(at) => tokio::time::timeout_at(at, call)
            .await
            .unwrap_or_else(|_| Err(timed_out())),
        None => call.await,
    }
}

/// The commands `chain` of `cmds`, all on `key`, as one transaction (`MULTI` … `EXEC`) to the
/// primary of `key`'s slot: applied in order, one round trip. A transaction runs whole or not
/// at all, so when the server refuses it — a redirection (`MOVED`, `ASK`: the slot moved or is
/// moving), `TRYAGAIN`, `CLUSTERDOWN`, or an `EXECABORT` for any of these met while queueing —
/// none of its commands ran, and they are sent again one after another, each following its
/// redirection as a lone command does ([`cluster_command`]). The cluster connection does not
/// retry, so a transaction is sent once; one lost to the connection (an I/O error, the cut)
/// may have run, and every command of it fails as unavailable.
async fn key_pipeline(
    cluster: &Arc<Cluster>,
    cmds: &[&Cmd],
    key: &[u8],
    chain: &[usize],
    cut: Option<tokio::time::Instant>,
) -> Vec<(usize, RedisResult<Value>)> {
    let mut pipe = Pipeline::with_capacity(chain.len());
    pipe.atomic();
    for &i in chain {
        pipe.add_command(cmds[i].clone());
    }
    let route = SingleNodeRoutingInfo::SpecificNode(Route::with_key(key, SlotAddr::Master));
    // The replies: MULTI's, one `QUEUED` per command, then EXEC's array (the one kept).
    let exec = by_cut(
        cut,
        cluster.send(Some(key), async |conn| {
            conn.route_pipeline(pipe, chain.len() + 1, 1, route).await
        }),
    )
    .await;
    let lost = |e: RedisError| -> Vec<(usize, RedisResult<Value>)> {
        let e = RedisError::from(io::Error::other(format!(
            "{} requests on one key were lost with their connection and may have run: {e}",
            chain.len()
        )));
        chain.iter().map(|&i| (i, Err(e.clone()))).collect()
    };
    match exec.map(|mut replies| replies.pop()) {
        Ok(Some(Value::Array(values))) if values.len() == chain.len() => chain
            .iter()
            .zip(values)
            .map(|(&i, v)| (i, v.extract_error()))
            .collect(),
        // Refused whole by the server (EXECABORT, or a redirection of EXEC itself): none ran.
        Ok(Some(Value::ServerError(_) | Value::Nil)) => one_by_one(cluster, cmds, chain, cut).await,
        Err(e) if refused_whole(&e) => one_by_one(cluster, cmds, chain, cut).await,
        Ok(other) => lost(RedisError::from((
            ErrorKind::Parse,
            "unexpected reply to a key's transaction",
            format!("{other:?}"),
        ))),
        Err(e) => lost(e),
    }
}

/// The commands of each key in order, keys in order of first appearance (a command without a
/// key is a chain of its own).
fn chains_by_key<'c>(cmds: &[&'c Cmd]) -> Vec<(Option<&'c [u8]>, Vec<usize>)> {
    let mut chains: Vec<(Option<&[u8]>, Vec<usize>)> = Vec::new();
    let mut chain_of: std::collections::HashMap<&[u8], usize> = std::collections::HashMap::new();
    for (i, cmd) in cmds.iter().enumerate() {
        match script_key(cmd) {
            Some(key) => {
                let next = chains.len();
                let c = *chain_of.entry(key).or_insert(next);
                if c == next {
                    chains.push((Some(key), Vec::new()));
                }
                chains[c].1.push(i);
            }
            None => chains.push((None, vec![i])),
        }
    }
    chains
}

/// [`Conn::transaction`] on one server: one pipeline in which each key with several
/// commands sends them as `MULTI`, the commands, `EXEC`, and every other command goes plain
/// (`send(wire, replies)` sends it and returns every raw reply). The whole batch as one
/// transaction would hold the server for all of it (every other client waits for the `EXEC`:
/// 240 ms for 40,000 requests, found by a review), where a pipeline lets others in between
/// commands. A key's transaction the server refused (`EXECABORT`: a command refused while
/// queueing, as under `OOM` or `BUSY`) ran nothing: each of its commands gets the error its
/// queueing met (an outage before a busy server before the first), or `EXEC`'s own. If `MULTI`
/// itself was refused, the key's commands were answered one by one as they came, and their
/// replies are taken as they are.
async fn keyed_transactions(
    pipe: &Pipeline,
    count: usize,
    send: impl AsyncFnOnce(&Pipeline, usize) -> RedisResult<Vec<Value>>,
) -> RedisResult<Vec<RedisResult<Value>>> {
    let cmds: Vec<&Cmd> = pipe.cmd_iter().collect();
    let chains = chains_by_key(&cmds);
    let together = |chain: &[usize]| chain.len() > 1;
    let mut wire = Pipeline::with_capacity(count + 2 * chains.len());
    let mut replies = 0;
    for (_, chain) in &chains {
        if together(chain) {
            wire.add_command(redis::cmd("MULTI"));
        }
        for &i in chain {
            wire.add_command(cmds[i].clone());
        }
        if together(chain) {
            wire.add_command(redis::cmd("EXEC"));
            replies += 2;
        }
        replies += chain.len();
    }
    let mut raw = send(&wire, replies).await?.into_iter();
    if raw.len() != replies {
        return Err(RedisError::from((
            ErrorKind::Parse,
            "a batch's pipeline returned the wrong number of replies",
            format!("{} for {replies}", raw.len()),
        )));
    }
    let mut out: Vec<Option<RedisResult<Value>>> = (0..cmds.len()).map(|_| None).collect();
    for (_, chain) in &chains {
        if !together(chain) {
            for &i in chain {
                out[i] = raw.next().map(Value::extract_error);
            }
            continue;
        }
        let multi = raw.next();
        let queued: Vec<Value> = raw.by_ref().take(chain.len()).collect();
        let exec = raw.next();
        if matches!(multi, Some(Value::ServerError(_))) {
            // no transaction: the commands ran (or were refused) as they came
            for (&i, reply) in chain.iter().zip(queued) {
                out[i] = Some(reply.extract_error());
            }
            continue;
        }
        match exec {
            Some(Value::Array(values)) if values.len() == chain.len() => {
                for (&i, reply) in chain.iter().zip(values) {
                    out[i] = Some(reply.extract_error());
                }
            }
            other => {
                let refused: Vec<RedisError> = queued
                    .into_iter()
                    .filter_map(|v| v.extract_error().err())
                    .collect();
                let reason =
                    crate::error::telling(&refused).cloned().unwrap_or_else(|| {
                        match other.map(Value::extract_error) {
                            Some(Err(e)) => e,
                            other => RedisError::from((
                                ErrorKind::Parse,
                                "unexpected reply to a key's transaction",
                                format!("{other:?}"),
                            )),
                        }
                    });
                for &i in chain {
                    out[i] = Some(Err(reason.clone()));
                }
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|reply| reply.expect("every command is in one chain"))
        .collect())
}

/// A transaction's error that the server gave instead of running it: no command of it ran.
fn refused_whole(e: &RedisError) -> bool {
    !(e.kind() == ErrorKind::Io
        || e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal())
        && e.code().is_some()
}

/// The commands `chain` of `cmds` one after another, in order, each following its own
/// redirection ([`cluster_command`]). After a command refused with `NOSCRIPT`, the rest are not
/// sent and come back refused the same way: the store resends every refused command, in
/// order, with its source, and a later command must not run before an earlier refused one
/// (the script cache reloaded between them by another instance would let it).
async fn one_by_one(
    cluster: &Arc<Cluster>,
    cmds: &[&Cmd],
    chain: &[usize],
    cut: Option<tokio::time::Instant>,
) -> Vec<(usize, RedisResult<Value>)> {
    let mut replies = Vec::with_capacity(chain.len());
    let mut refused = false;
    for &i in chain {
        let reply = if refused {
            Err(RedisError::from((
                ErrorKind::Server(ServerErrorKind::NoScript),
                "not sent: an earlier request on its key was refused with NOSCRIPT",
            )))
        } else {
            by_cut(cut, cluster_command(cluster, cmds[i]))
                .await
                .and_then(Value::extract_error)
        };
        refused = refused || reply.as_ref().is_err_and(crate::error::is_noscript);
        replies.push((i, reply));
    }
    replies
}

/// The key of a script call (`EVALSHA`/`EVAL sha-or-source numkeys key …`): the 4th argument,
/// when there is one.
fn script_key(cmd: &Cmd) -> Option<&[u8]> {
    match cmd.args_iter().nth(3)? {
        redis::Arg::Simple(key) => Some(key),
        _ => None,
    }
}
