//! [`RedisStore`]: the [`Store`] whose buckets live in Redis, one key per bucket, each decision
//! one script execution on Redis time.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::FutureExt as _;
use redis::{Pipeline, RedisError, Value};
use tollgate_core::{
    Acquire, Batch, Decision, Key, MAX_EXACT, Policy, PolicyError, Store, StoreError,
    deadline_after,
};

use crate::builder::RedisStoreBuilder;
use crate::connection::Conn;
use crate::error::{classify, is_noscript};
use crate::scripts::{self, BucketKey, Call, Invocation};

/// How long before a batch's deadline a cluster command still unanswered fails on its own:
/// the margin for the other nodes' replies to be returned. A tenth of the time left, from
/// `MIN_CUT_MARGIN` (two ticks of tokio's 1 ms timer, so that the cut never fires in the
/// deadline's tick) to `CUT_MARGIN`, and never more than half the time left.
const CUT_MARGIN: Duration = Duration::from_millis(10);
const MIN_CUT_MARGIN: Duration = Duration::from_millis(2);

fn cut_margin(left: Duration) -> Duration {
    (left / 10).clamp(MIN_CUT_MARGIN, CUT_MARGIN).min(left / 2)
}

/// A [`Store`] backed by Redis.
///
/// Each bucket is one Redis STRING at `<prefix>{<key>}`, whatever its algorithm: the whole
/// [`Key`] is the hash tag, so every script touches one key in one slot and works on
/// Redis Cluster. Each call is one `EVALSHA` of the script (see [`crate::scripts`]),
/// which reads Redis `TIME`, decides, and writes the state with an expiry in one atomic step.
/// A `NOSCRIPT` reply (script cache lost to a restart, failover or `SCRIPT FLUSH`) is absorbed:
/// the call is resent once with the script's source.
///
/// Cloning is cheap; clones share the connection.
///
/// With Redis ACLs, the store's user needs `+evalsha +eval +script|load +del` and, inside the
/// scripts, `+time +get +set +pexpiretime` (`PEXPIRETIME` while a policy change under
/// `DeferUntilExpiry` is pending or starting), on the keys `~<prefix>*`; see docs/security.md.
///
/// A dropped connection fails the call in flight (and, on a multiplexed connection, the
/// calls sent before the reconnect) as [`StoreError::Unavailable`]; the store reconnects by
/// itself. It never resends a call that may have reached the server, so a decision is applied
/// at most once. A connection the server closes while no call is in flight (Redis's
/// `timeout`, `CLIENT KILL`, a load balancer's idle cut) fails nothing: the store speaks RESP3
/// by default (a URL's `?protocol=resp2` keeps RESP2), over which redis-rs reports the close,
/// and the next call goes out on a fresh connection (every connection kind: the multiplexed
/// connection, the pool, Sentinel's primary, a Cluster's node connections and its direct
/// connections to joining nodes).
///
/// ```no_run
/// # async fn demo() -> Result<(), tollgate_core::StoreError> {
/// use std::time::Duration;
/// use tollgate_core::{Key, Policy, Rate, Store};
/// use tollgate_redis::RedisStore;
///
/// let store = RedisStore::builder("redis://127.0.0.1:6379")
///     .prefix("myapp:rl:")
///     .timeout(Duration::from_millis(100))
///     .pool(16)
///     .build()
///     .await?;
/// let policy = Policy::token_bucket(10, Rate::per_second(5)).unwrap();
/// let decision = store.acquire(&Key::new("login", ["alice"])?, &policy, 1).await?;
/// println!("allowed: {}, remaining: {}", decision.allowed, decision.remaining);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) conn: Conn,
    pub(crate) prefix: Box<str>,
    pub(crate) timeout: Duration,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("connection", &self.inner.conn.kind())
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Starts configuring a store for the server at `url` (`redis://host:port/db`,
    /// `redis://user:password@host:port`, or `rediss://...` with the `tls` feature).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(url.into())
    }

    /// The Redis key that holds `key`'s bucket under `policy`.
    ///
    /// ```no_run
    /// # async fn demo(store: tollgate_redis::RedisStore) {
    /// # use std::time::Duration;
    /// # use tollgate_core::{Key, Policy};
    /// let p = Policy::fixed_window(10, Duration::from_secs(1)).unwrap();
    /// assert_eq!(store.redis_key(&Key::global("search"), &p), "tollgate:{search}");
    /// # }
    /// ```
    ///
    /// # Panics
    /// If `policy`'s algorithm has no script in this version (`Algorithm` is non-exhaustive).
    pub fn redis_key(&self, key: &Key, policy: &Policy) -> String {
        self.bucket_key(key, policy)
            .expect("an algorithm with a Redis script")
            .to_string()
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Loads every script into the server's cache (`SCRIPT LOAD`). Not needed for correctness —
    /// a missing script is reloaded on demand — but it spares the first calls after a restart
    /// or failover the extra upload.
    pub async fn load_scripts(&self) -> Result<(), StoreError> {
        self.deadline(self.load_scripts_now()).await
    }

    /// Makes every connection the store may use now, so that the calls that follow do not
    /// wait for one to be made: for a pool, all of its connections, each answering a `PING`
    /// (the pool otherwise connects on demand, when a call finds no connection idle); pooled
    /// connections found closed are replaced. The multiplexed connection and Sentinel's
    /// primary answer a `PING` (connected by [`build`](crate::RedisStoreBuilder::build)
    /// already, they connect here on a store made by
    /// [`build_lazy`](crate::RedisStoreBuilder::build_lazy)); a cluster's nodes are connected
    /// when the store is built. Bounded by the connect timeout. For benchmarks, which time
    /// calls, not connects: it is not a lasting guarantee, as the pool still retires a
    /// connection idle for 10 minutes or open for 30, and connects again on demand.
    ///
    /// # Errors
    /// A connect or `PING` that fails, classified as a call's error is (a refused connect
    /// fails this at once; a wrong password is not an outage), and `Unavailable` (timed out)
    /// if it is not done within the connect timeout.
    pub async fn connect_all(&self) -> Result<(), StoreError> {
        self.inner
            .conn
            .connect_all()
            .await
            .map_err(|e| classify(&e))
    }

    pub(crate) async fn load_scripts_now(&self) -> Result<(), StoreError> {
        let mut pipe = Pipeline::with_capacity(3);
        for s in scripts::all() {
            pipe.cmd("SCRIPT").arg("LOAD").arg(s.source());
        }
        let replies = self
            .inner
            .conn
            .pipeline(&pipe, scripts::all().len(), None)
            .await
            .map_err(|e| classify(&e))?;
        for (reply, script) in replies.into_iter().zip(scripts::all()) {
            match reply.map_err(|e| classify(&e))? {
                Value::BulkString(sha) if sha == script.sha().as_bytes() => {}
                _ => {
                    return Err(StoreError::Script(format!(
                        "SCRIPT LOAD of {} returned another SHA",
                        script.name()
                    )));
                }
            }
        }
        Ok(())
    }

    fn bucket_key<'a>(
        &'a self,
        key: &'a Key,
        policy: &Policy,
    ) -> Result<BucketKey<'a>, StoreError> {
        scripts::try_for_policy(policy).ok_or_else(|| scripts::unsupported(policy))?;
        Ok(BucketKey {
            prefix: &self.inner.prefix,
            key: key.as_str(),
        })
    }

    /// `call` bounded by the store's deadline. Not an `async fn`: that would hold `call` in its
    /// state beside the `Timeout` it is moved into, so the future every decision builds, moves
    /// and boxes would carry the call twice (976 bytes against 664 today; 3,592 for a
    /// 1,728-byte call before the connection arms were boxed).
    fn deadline<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> impl Future<Output = Result<T, StoreError>> {
        let limit = self.inner.timeout;
        tokio::time::timeout(limit, call).map(move |r| r.unwrap_or(Err(StoreError::Timeout(limit))))
    }

    /// `error` as the caller should see it: a `MOVED` or `ASK` reply to a store configured for
    /// one server (or a Sentinel primary) is no outage but a misconfiguration — the server is
    /// a Redis Cluster node, and only the keys of its own slots could be decided — so it is
    /// reported as [`StoreError::Script`], loudly, instead of an unavailability that a failure
    /// mode would quietly answer for ever (fail open: every key of another slot admitted).
    /// A Cluster store follows redirections itself; one still redirected after its 5 is an
    /// outage, as [`classify`] has it.
    fn misrouted(&self, error: StoreError) -> StoreError {
        use redis::{ErrorKind, ServerErrorKind};
        if matches!(self.inner.conn, Conn::Cluster(_)) {
            return error;
        }
        let redirected = match &error {
            StoreError::Unavailable {
                source: Some(source),
                ..
            } => source.downcast_ref::<RedisError>().is_some_and(|e| {
                matches!(
                    e.kind(),
                    ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask)
                )
            }),
            _ => false,
        };
        if !redirected {
            return error;
        }
        StoreError::Script(format!(
            "the Redis server redirected the call ({error}): it is a Redis Cluster node, and \
             this store is configured for a single server (or a Sentinel primary); build it \
             with RedisStore::cluster"
        ))
    }

    async fn invoke(
        &self,
        key: &Key,
        policy: &Policy,
        cost: u64,
        commit: bool,
    ) -> Result<Decision, StoreError> {
        policy.check_cost(cost)?;
        let inv = Invocation::new(&self.inner.prefix, key.as_str(), policy, cost, commit)?;
        self.deadline(async {
            let reply = match self.inner.conn.command(&inv.evalsha()).await {
                Err(e) if is_noscript(&e) => self.inner.conn.command(&inv.cmd(Call::Eval)).await,
                other => other,
            };
            decision(reply, inv.cost, inv.limit)
        })
        .await
    }

    async fn invoke_many(
        &self,
        requests: &[Acquire<'_>],
        cut: tokio::time::Instant,
    ) -> Result<Batch, StoreError> {
        let invs: Vec<Invocation<'_>> = requests
            .iter()
            .map(|r| Invocation::new(&self.inner.prefix, r.key.as_str(), r.policy, r.cost, true))
            .collect::<Result<_, _>>()?;
        let mut pipe = Pipeline::with_capacity(invs.len());
        for inv in &invs {
            pipe.add_command(inv.cmd(Call::EvalSha));
        }
        // A key's requests apply in the batch's order. In a plain pipeline, a script cache lost
        // and reloaded (another instance's retry) while the server works through it would
        // refuse a stretch with NOSCRIPT and run a later stretch: resent, the refused requests
        // would run after later ones on the same key. In a transaction the script is there for
        // every command or for none, so a key the batch repeats sends its requests as one
        // (that key's alone: `Conn::transaction`).
        let repeats = requests.len() > 1 && {
            let mut seen = std::collections::HashSet::with_capacity(requests.len());
            !requests.iter().all(|r| seen.insert(r.key))
        };
        let sent = if repeats {
            self.inner
                .conn
                .transaction(&pipe, invs.len(), Some(cut))
                .await
        } else {
            self.inner.conn.pipeline(&pipe, invs.len(), Some(cut)).await
        };
        let mut replies = sent.map_err(|e| classify(&e))?;
        if replies.len() != invs.len() {
            return Err(StoreError::Script(format!(
                "pipeline of {} scripts returned {} replies",
                invs.len(),
                replies.len()
            )));
        }
        // Only the commands refused with NOSCRIPT did not run (in a transaction, all or none);
        // resend exactly those, with source, in order (EVAL is never refused with NOSCRIPT).
        let missing: Vec<usize> = (0..replies.len())
            .filter(|&i| matches!(&replies[i], Err(e) if is_noscript(e)))
            .collect();
        if !missing.is_empty() {
            let mut retry = Pipeline::with_capacity(missing.len());
            for &i in &missing {
                retry.add_command(invs[i].cmd(Call::Eval));
            }
            match self
                .inner
                .conn
                .pipeline(&retry, missing.len(), Some(cut))
                .await
            {
                Ok(again) if again.len() == missing.len() => {
                    for (i, reply) in missing.into_iter().zip(again) {
                        replies[i] = reply;
                    }
                }
                // The resent requests fail; the ones already decided keep their decisions.
                Ok(_) => {
                    for i in missing {
                        replies[i] = Err(RedisError::from((
                            redis::ErrorKind::Parse,
                            "NOSCRIPT retry returned the wrong number of replies",
                        )));
                    }
                }
                Err(e) => {
                    for i in missing {
                        replies[i] = Err(e.clone());
                    }
                }
            }
        }
        Ok(replies
            .into_iter()
            .zip(&invs)
            .map(|(reply, inv)| decision(reply, inv.cost, inv.limit))
            .collect())
    }
}

/// Turns a script's reply ([`scripts::reply`]: allowed, remaining, retry_after_us,
/// reset_after_us, limit; `own_limit` completes an integer reply) into a decision; `allowed`
/// -1 means `cost` is above the governing limit.
fn decision(
    reply: Result<Value, RedisError>,
    cost: u64,
    own_limit: u64,
) -> Result<Decision, StoreError> {
    let reply = reply.map_err(|e| classify(&e))?;
    let bad = || StoreError::Script(format!("unexpected script reply: {reply:?}"));
    let Some([allowed, remaining, retry, reset, limit]) = scripts::reply(&reply, own_limit) else {
        return Err(bad());
    };
    let limit = match u64::try_from(limit) {
        Ok(l) if (1..=MAX_EXACT).contains(&l) => l,
        _ => return Err(bad()),
    };
    if allowed == -1 && cost > limit {
        return Err(StoreError::InvalidPolicy(PolicyError::CostAboveCapacity {
            cost,
            max: limit,
        }));
    }
    let (remaining, reset) = match (u64::try_from(remaining), u64::try_from(reset)) {
        (Ok(m), Ok(r)) if m <= limit => (m, r),
        _ => return Err(bad()),
    };
    match (allowed, retry) {
        (1, -1) => Ok(Decision::shared(true, limit, remaining, None, reset)),
        (0, r) if r >= 0 => Ok(Decision::shared(
            false,
            limit,
            remaining,
            Some(r.unsigned_abs()),
            reset,
        )),
        _ => Err(bad()),
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn acquire(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.invoke(key, policy, cost, true)
            .await
            .map_err(|e| self.misrouted(e))
    }

    /// All requests go in one pipeline (one round trip; each request is atomic on its own, in
    /// order; a batch that repeats a key goes as one transaction, so that a key's requests keep
    /// their order even if the server's script cache is lost and reloaded meanwhile). Nothing
    /// is sent if any request is invalid. If the server lost the scripts, the requests it
    /// refused with NOSCRIPT — and only those — are resent.
    /// Each request has its own result: one refused or failed request does not discard the
    /// decisions made for the others.
    async fn acquire_many(&self, requests: &[Acquire<'_>]) -> Result<Batch, StoreError> {
        // tokio's clock, as the deadline is compared with it (they differ when a test pauses it)
        let deadline = deadline_after(tokio::time::Instant::now().into_std(), self.inner.timeout);
        self.acquire_many_by(requests, deadline).await
    }

    /// As [`RedisStore::acquire_many`], ending by the earlier of `deadline` and the store's
    /// own. On a cluster each command is also cut a little before then (a tenth of the time
    /// left, from 2 ms to 10 ms and at most half of it), so that the commands a hung node holds fail alone and the other
    /// nodes' replies are returned before either deadline would discard them all.
    async fn acquire_many_by(
        &self,
        requests: &[Acquire<'_>],
        deadline: std::time::Instant,
    ) -> Result<Batch, StoreError> {
        for r in requests {
            r.policy.check_cost(r.cost)?;
        }
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let now = tokio::time::Instant::now();
        let at = tokio::time::Instant::from_std(
            deadline_after(now.into_std(), self.inner.timeout).min(deadline),
        );
        let left = at.saturating_duration_since(now);
        if left.is_zero() {
            // Past the deadline already: refused before anything is sent (`timeout_at` polls
            // the call once before it looks at the clock, which sends the pipeline), so a
            // batch reported as timed out never ran.
            return Err(StoreError::Timeout(left));
        }
        let cut = at - cut_margin(left);
        match tokio::time::timeout_at(at, self.invoke_many(requests, cut)).await {
            Ok(Ok(batch)) => Ok(batch
                .into_iter()
                .map(|r| r.map_err(|e| self.misrouted(e)))
                .collect()),
            Ok(Err(e)) => Err(self.misrouted(e)),
            Err(_) => Err(StoreError::Timeout(left)),
        }
    }

    async fn peek(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.invoke(key, policy, cost, false)
            .await
            .map_err(|e| self.misrouted(e))
    }

    async fn reset(&self, key: &Key, policy: &Policy) -> Result<(), StoreError> {
        let mut cmd = redis::Cmd::new();
        cmd.arg("DEL").arg(self.bucket_key(key, policy)?);
        self.deadline(async {
            self.inner
                .conn
                .command(&cmd)
                .await
                .map(drop)
                .map_err(|e| classify(&e))
        })
        .await
        .map_err(|e| self.misrouted(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cut_leaves_two_timer_ticks_and_at_most_half_the_time() {
        let ms = Duration::from_millis;
        assert_eq!(cut_margin(ms(300)), ms(10));
        assert_eq!(cut_margin(ms(50)), ms(5));
        assert_eq!(cut_margin(ms(8)), ms(2));
        assert_eq!(cut_margin(ms(2)), ms(1));
        assert_eq!(cut_margin(Duration::ZERO), Duration::ZERO);
    }

    /// Every decision builds this future, moves it and boxes it (`async_trait`). It used to be
    /// 4,288 bytes (the cluster's and Sentinel's calls inline, and the argument of an `async
    /// fn deadline` held beside the `Timeout` it went into): moving it was ~4 % of the load
    /// tool's CPU (`perf`, 64 tasks on a pool of 4). 664 bytes when this was written; the bound
    /// catches each regression measured then: `deadline` as an `async fn` again (976), the
    /// Sentinel arm unboxed (824), the pool's (1,568) or the cluster's (2,312). The size is the
    /// type's, the same whatever connection kind the store uses.
    #[tokio::test]
    async fn a_decision_future_stays_small() {
        let server = tollgate_testkit::server::RedisServer::start();
        let policy = Policy::token_bucket(10, tollgate_core::Rate::per_second(1)).unwrap();
        let key = Key::new("size", ["k"]).unwrap();
        let store = RedisStore::builder(server.url()).build().await.unwrap();
        let call = store.invoke(&key, &policy, 1, true);
        let size = size_of_val(&call);
        assert!(size <= 768, "{size} bytes");
        assert!(call.await.unwrap().allowed);
    }

    #[allow(clippy::unnecessary_wraps)]
    fn arr(v: [i64; 5]) -> Result<Value, RedisError> {
        Ok(Value::BulkString(
            v.iter().flat_map(|i| i.to_le_bytes()).collect(),
        ))
    }

    #[test]
    fn decodes_allowed_and_denied_replies() {
        let d = decision(arr([1, 3, -1, 3_500_000, 10]), 1, 10).unwrap();
        assert_eq!(d, Decision::shared(true, 10, 3, None, 3_500_000));
        let d = decision(arr([0, 0, 1_400_000, 5_000_000, 10]), 3, 10).unwrap();
        assert_eq!(
            d,
            Decision::shared(false, 10, 0, Some(1_400_000), 5_000_000)
        );
        // an admission under the caller's own policy, as one integer: remaining * 2^37 + reset
        let d = decision(Ok(Value::Int((3 << 37) + 3_500_000)), 1, 10).unwrap();
        assert_eq!(d, Decision::shared(true, 10, 3, None, 3_500_000));
        let d = decision(Ok(Value::Int(0)), 10, 10).unwrap();
        assert_eq!(d, Decision::shared(true, 10, 0, None, 0));
        // a newer stored policy governs with a smaller limit than the caller's cost
        assert!(matches!(
            decision(arr([-1, 0, -1, 0, 4]), 5, 10),
            Err(StoreError::InvalidPolicy(PolicyError::CostAboveCapacity {
                cost: 5,
                max: 4
            }))
        ));
    }

    #[test]
    fn refuses_malformed_replies_as_script_errors() {
        for bad in [
            [2, 0, -1, 0, 10],
            [1, 11, -1, 0, 10],
            [1, 0, 5, 0, 10],
            [0, 0, -1, 0, 10],
            [1, -1, -1, 0, 10],
            [1, 0, -1, -5, 10],
            [1, 0, -1, 0, 0],
            [-1, 0, -1, 0, 10],
        ] {
            assert!(
                matches!(decision(arr(bad), 10, 10), Err(StoreError::Script(_))),
                "{bad:?}"
            );
        }
        // an integer reply: negative, or more remaining than the caller's limit
        for bad in [-1, 11 << 37] {
            assert!(
                matches!(
                    decision(Ok(Value::Int(bad)), 1, 10),
                    Err(StoreError::Script(_))
                ),
                "{bad}"
            );
        }
        assert!(matches!(
            decision(Ok(Value::Nil), 10, 10),
            Err(StoreError::Script(_))
        ));
        assert!(matches!(
            decision(Ok(Value::Array(vec![Value::Int(1)])), 10, 10),
            Err(StoreError::Script(_))
        ));
        assert!(matches!(
            decision(Ok(Value::BulkString(vec![0; 39])), 10, 10),
            Err(StoreError::Script(_))
        ));
    }
}
