//! The `Limiter`: one protected operation's policy, store, deadline and failure mode.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use tollgate_core::{
    Acquire, Algorithm, Decision, Enforcement, ErrorClass, Key, KeyError, MAX_DURATION, MAX_EXACT,
    Policy, PolicyError, Rate, Store, StoreError, TokenBucket, deadline_after,
};
use tollgate_local::LocalStore;

use crate::breaker::{Breaker, BreakerConfig, BreakerState, Permit, Transition};
use crate::deny_cache::DenyCache;
use crate::fallback::{DecideNow, LocalFallback};
use crate::log_throttle::LogThrottle;
use crate::meters::Meters;

/// Default deadline for one store call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// A line that traffic can repeat on every request — the store at its key cap refusing a new
/// key, or the degraded mode's local store failing too (at its own cap, during an outage) — is
/// written at most once per this interval, each line counting the occurrences held back since
/// the previous one: a flood of new keys must not flood the log. The metrics count every one.
const REPEATED_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// What an operation does when its store cannot answer (unavailable or busy). Chosen
/// explicitly for every [`Limiter`]; there is no default.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum FailureMode {
    /// Admit the request, labelled [`Enforcement::Bypassed`]. Nothing is enforced.
    Open,
    /// Refuse with [`Error::Unavailable`] — a limiter failure, never a quota denial.
    Closed,
    /// Decide on a per-process local store, labelled [`Enforcement::Degraded`].
    Degraded {
        /// The local store used while the shared one is unavailable, on the clock of the
        /// caller's choosing ([`FailureMode::degraded`] builds one on the real monotonic clock,
        /// [`FailureMode::degraded_with`] takes one; `Arc<LocalStore<C>>` converts with
        /// `.into()`).
        local: LocalFallback,
        /// Expected number of instances sharing the quota; the local quota is the shared one
        /// divided by it (at least 1). Approximate by nature. A token bucket's refill rate is
        /// divided exactly where the result can be expressed; where it cannot (its period
        /// would pass [`MAX_DURATION`]), the local share refills more slowly, never faster,
        /// and the limiter logs a warning when it takes the policy.
        expected_instances: u32,
    },
}

impl FailureMode {
    /// Degrade to a fresh local store, dividing the quota by `expected_instances`.
    pub fn degraded(expected_instances: u32) -> Self {
        Self::degraded_with(Arc::new(LocalStore::new()), expected_instances)
    }

    /// Degrade to `local`, a local store on a clock of the caller's choosing, dividing the
    /// quota by `expected_instances`. With a [`ManualClock`](tollgate_core::ManualClock), a
    /// test moves degraded enforcement's time by hand:
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use tollgate::{FailureMode, LocalStore, ManualClock};
    ///
    /// let clock = ManualClock::new(1_700_000_000_000_000);
    /// let local = Arc::new(LocalStore::with_clock(clock.clone()));
    /// let mode = FailureMode::degraded_with(local, 2);
    /// assert_eq!(mode.as_str(), "degraded");
    /// clock.advance(Duration::from_secs(1)); // degraded decisions see the second pass
    /// ```
    pub fn degraded_with<C: tollgate_core::Clock>(
        local: Arc<LocalStore<C>>,
        expected_instances: u32,
    ) -> Self {
        Self::Degraded {
            local: LocalFallback::new(local),
            expected_instances,
        }
    }

    /// A stable lower-case name for logs and metrics labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Closed => "closed",
            Self::Degraded { .. } => "degraded",
        }
    }

    /// The expected instance count of a degraded mode.
    fn expected_instances(&self) -> Option<u32> {
        match self {
            Self::Degraded {
                expected_instances, ..
            } => Some(*expected_instances),
            Self::Open | Self::Closed => None,
        }
    }
}

/// Why a limiter could not decide.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request was invalid (cost 0 or above the policy's limit, or a bad key). A client
    /// error: never a denial, and no `Retry-After`.
    /// Shown as the store's error, which names the request's fault ("invalid request: …",
    /// "invalid key: …").
    #[error(transparent)]
    Invalid(StoreError),
    /// The store could not answer and the operation fails closed.
    #[error("rate limiter for {operation:?} unavailable ({}): {source}", source.class().as_str())]
    Unavailable {
        /// The operation.
        operation: Arc<str>,
        /// What the store reported.
        #[source]
        source: StoreError,
    },
    /// The store answered with an unexpected error: a bug, reported loudly rather than
    /// handled by the failure mode.
    #[error("rate limiter store error: {0}")]
    Store(#[source] StoreError),
    /// The store answered a batch with another number of results than it was given requests
    /// (a bug in the [`Store`] implementation). Results cannot be matched to keys by position
    /// then, so none is used; the decisions the store made may have consumed allowance.
    #[error(
        "rate limiter store for {operation:?} answered a batch of {requested} requests with {returned} results (a store bug)"
    )]
    BatchMismatch {
        /// The operation.
        operation: Arc<str>,
        /// Requests sent.
        requested: usize,
        /// Results returned.
        returned: usize,
    },
    /// The limiter was built without a store or a failure mode.
    #[error("limiter {operation:?} needs {missing}")]
    Incomplete {
        /// The operation.
        operation: String,
        /// What is missing.
        missing: &'static str,
    },
}

impl From<PolicyError> for Error {
    fn from(e: PolicyError) -> Self {
        Self::Invalid(StoreError::InvalidPolicy(e))
    }
}

impl From<KeyError> for Error {
    fn from(e: KeyError) -> Self {
        Self::Invalid(StoreError::InvalidKey(e))
    }
}

/// Builds a [`Limiter`]; see [`Limiter::builder`].
#[must_use]
pub struct LimiterBuilder {
    operation: String,
    policy: Policy,
    store: Option<Arc<dyn Store>>,
    failure_mode: Option<FailureMode>,
    timeout: Duration,
    breaker: BreakerConfig,
    deny_cache: Option<usize>,
}

impl LimiterBuilder {
    /// Opt in to a local cache of denials holding up to `max_entries` keys: a key the store
    /// denied until a known instant is then denied locally, with zero round trips, until that
    /// instant (for requests of the same cost: a larger one is denied at least as long, but its
    /// exact wait is the store's to compute, so it goes to the store). Exact for every algorithm — between
    /// a denial and its `retry_after` other instances can only consume — and invalidated by
    /// this limiter's [`Limiter::reset`] and by any policy change it follows (fingerprint or
    /// generation).
    ///
    /// [`Limiter::check_many`] consults it too: keys it answers are left out of the batch, and
    /// the batch's denials are cached.
    ///
    /// The cache is per `Limiter` (clones share it; two limiters built for one operation each
    /// have their own, and a reset through one does not clear the other's). A reset reaches
    /// every instance's cache when it is made
    /// through [`crate::registry::PolicyFollower::reset`] (announced over the policy registry, within a
    /// pub/sub round trip); one made only through another instance's [`Limiter::reset`] does
    /// not, and neither does a policy that instance follows before this one does (until this
    /// one follows it too), so this instance keeps denying the key until the cached
    /// `retry_after` at the latest. The deadline runs on this process's monotonic clock,
    /// while the store decides on its own (Redis `TIME`): exact while both advance together;
    /// if Redis's clock is stepped forward, the store may admit the key before the cached
    /// deadline, which this cache still denies until then. Likewise if the store loses its
    /// buckets (a Redis restarted without persistence, a failover dropping unreplicated
    /// writes, `FLUSHDB`, eviction): the cache denies as if the lost bucket were still there,
    /// until the cached deadline at the latest. A cached answer's `remaining` is that of the
    /// denial it repeats: the store may hold more by then (a refill) or less (other instances
    /// consumed). Each cached answer counts in the `tollgate_deny_cache_answers_total`
    /// metric.
    pub fn deny_cache(mut self, max_entries: usize) -> Self {
        self.deny_cache = Some(max_entries);
        self
    }

    /// Circuit breaker settings (default: open after 5 consecutive failures, probe every
    /// 500 ms).
    pub fn breaker(mut self, config: BreakerConfig) -> Self {
        self.breaker = config;
        self
    }

    /// The store holding the buckets.
    pub fn store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(store);
        self
    }

    /// What to do when the store cannot answer. Required.
    pub fn failure_mode(mut self, mode: FailureMode) -> Self {
        self.failure_mode = Some(mode);
        self
    }

    /// Deadline for one store call (default 250 ms). Keep it shorter than any deadline of the
    /// callers: a call dropped before it fires has no outcome, and the circuit breaker cannot
    /// count what it never saw (see `docs/failure-modes.md`).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Builds the limiter; fails if the operation name is not a valid key namespace, or the
    /// store or failure mode was not given.
    pub fn build(self) -> Result<Limiter, Error> {
        Key::new(&self.operation, std::iter::empty::<&[u8]>())?;
        let store = self.store.ok_or_else(|| Error::Incomplete {
            operation: self.operation.clone(),
            missing: "a store",
        })?;
        let failure_mode = self.failure_mode.ok_or_else(|| Error::Incomplete {
            operation: self.operation.clone(),
            missing: "an explicit failure mode (Open, Closed or Degraded)",
        })?;
        let meters = Meters::new(&self.operation);
        let breaker = Breaker::new(self.breaker);
        // The gauge is the operation's, not this limiter's: one built to replace another
        // (a store rebuilt after an outage, a policy file read again) would otherwise leave the
        // old one's last state — open — standing until its own breaker next moved, which a
        // healthy store never makes it do (found by a review).
        meters.breaker.set(breaker.state().as_gauge());
        let policy = Active::new(&self.operation, self.policy, &failure_mode);
        Ok(Limiter {
            inner: Arc::new(Inner {
                operation: self.operation.into(),
                policy: ArcSwap::from_pointee(policy),
                store,
                failure_mode,
                timeout: self.timeout,
                breaker,
                gauge_order: Mutex::new(()),
                deny_cache: self.deny_cache.map(DenyCache::new),
                meters,
                capacity_log: LogThrottle::new(REPEATED_LOG_INTERVAL),
                outage_log: [
                    LogThrottle::new(REPEATED_LOG_INTERVAL),
                    LogThrottle::new(REPEATED_LOG_INTERVAL),
                ],
                fallback_log: LogThrottle::new(REPEATED_LOG_INTERVAL),
            }),
        })
    }
}

/// The quota of one protected operation. Cheap to clone; clones share everything.
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

struct Inner {
    operation: Arc<str>,
    /// Swapped as a whole when the limiter follows a newly published policy.
    policy: ArcSwap<Active>,
    store: Arc<dyn Store>,
    failure_mode: FailureMode,
    timeout: Duration,
    breaker: Breaker,
    /// Orders the breaker gauge's writes: see [`Limiter::report`].
    gauge_order: Mutex<()>,
    deny_cache: Option<DenyCache>,
    meters: Meters,
    /// Thins the key-cap warning.
    capacity_log: LogThrottle,
    /// Thin the outage warnings, one per class (unavailable, busy): the breaker bounds a
    /// full outage, but a partial one (a Cluster shard down, a flaky link: answers between
    /// the failures) never opens it, and would otherwise write a line per failed request.
    outage_log: [LogThrottle; 2],
    /// Thins the error that the degraded mode's local store failed too.
    fallback_log: LogThrottle,
}

/// The policy in force and its scaled-down local form (under [`FailureMode::Degraded`]).
/// Freed once no call in flight holds it after a switch: a limiter that follows a new
/// publication every minute for weeks keeps only the one in force.
struct Active {
    policy: Policy,
    degraded: Option<Policy>,
}

impl Active {
    fn new(operation: &str, policy: Policy, failure_mode: &FailureMode) -> Self {
        let degraded = failure_mode
            .expected_instances()
            .and_then(|expected_instances| {
                let n = u64::from(expected_instances.max(1));
                let Some(share) = scale_down(&policy, n) else {
                    // An algorithm this version cannot divide (none so far).
                    tracing::warn!(
                        operation,
                        policy = %policy.to_spec(),
                        expected_instances = n,
                        "cannot divide this policy by the expected instances; degraded \
                         enforcement uses the whole quota on each instance"
                    );
                    return None;
                };
                if !share.approximations.is_empty() {
                    tracing::warn!(
                        operation,
                        policy = %policy.to_spec(),
                        expected_instances = n,
                        local = %share.policy.to_spec(),
                        approximation = %share.approximations.join("; "),
                        "cannot divide this policy exactly by the expected instances; degraded \
                         enforcement uses an approximate share on each instance"
                    );
                }
                Some(share.policy)
            });
        Self { policy, degraded }
    }
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("operation", &self.inner.operation)
            .field("policy", &self.policy())
            .field("failure_mode", &self.inner.failure_mode.as_str())
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

impl Limiter {
    /// Starts a limiter for `operation` (also the key namespace: `[a-z0-9_.-]`, 1-64
    /// characters) under `policy`.
    pub fn builder(operation: impl Into<String>, policy: Policy) -> LimiterBuilder {
        LimiterBuilder {
            operation: operation.into(),
            policy,
            store: None,
            failure_mode: None,
            timeout: DEFAULT_TIMEOUT,
            breaker: BreakerConfig::default(),
            deny_cache: None,
        }
    }

    /// The operation's name.
    pub fn operation(&self) -> &str {
        &self.inner.operation
    }

    /// The policy in force now (it changes when the limiter follows a registry; see
    /// [`Limiter::set_policy`]).
    pub fn policy(&self) -> Policy {
        self.inner.policy.load().policy
    }

    /// Switches to `policy` for every later decision (calls in flight finish under the one
    /// they started with). Buckets move to it by its [`Transition`](tollgate_core::Transition)
    /// rule the first time it meets them; see `docs/policy-changes.md`.
    pub fn set_policy(&self, policy: Policy) {
        let active = Active::new(&self.inner.operation, policy, &self.inner.failure_mode);
        self.inner.policy.store(Arc::new(active));
        self.switched();
    }

    /// Switches to `policy` if `replace` holds for the policy in force, as one step: a switch
    /// made meanwhile (by [`Limiter::set_policy`], or by another follower) is put to
    /// `replace` again, never overwritten unseen. Whether it switched.
    pub(crate) fn set_policy_if(
        &self,
        policy: Policy,
        mut replace: impl FnMut(&Policy) -> bool,
    ) -> bool {
        let mut current = self.inner.policy.load_full();
        let mut active = None;
        loop {
            if !replace(&current.policy) {
                return false;
            }
            let new = active.get_or_insert_with(|| {
                Arc::new(Active::new(
                    &self.inner.operation,
                    policy,
                    &self.inner.failure_mode,
                ))
            });
            let previous = self
                .inner
                .policy
                .compare_and_swap(&current, Arc::clone(new));
            if Arc::ptr_eq(&previous, &current) {
                break;
            }
            current = arc_swap::Guard::into_inner(previous);
        }
        self.switched();
        true
    }

    /// After a switch of the policy: the deny cache forgets the old one's denials.
    fn switched(&self) {
        if let Some(cache) = &self.inner.deny_cache {
            // after the store: a check that read the old policy and is denied under it finds
            // the epoch moved and caches nothing
            cache.clear();
        }
    }

    /// The failure mode.
    pub fn failure_mode(&self) -> &FailureMode {
        &self.inner.failure_mode
    }

    /// The key of the bucket identified by `parts` within this operation's namespace. Parts
    /// are arbitrary user-supplied bytes; they are escaped or hashed (see [`Key`]).
    pub fn key<I, P>(&self, parts: I) -> Result<Key, Error>
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        Ok(Key::new(&self.inner.operation, parts)?)
    }

    /// Applies `cost` to the bucket identified by `parts` (see [`Limiter::key`]).
    pub async fn check<I, P>(&self, parts: I, cost: u64) -> Result<Decision, Error>
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        match self.key(parts) {
            Ok(key) => self.check_key(&key, cost).await,
            Err(e) => {
                let outcome = Err(e);
                self.inner.meters.record(&outcome, Instant::now());
                outcome
            }
        }
    }

    /// Applies `cost` to `key`. Invalid input is refused before the store is touched. When the
    /// store is unavailable or busy (or the circuit breaker is open), the failure mode decides;
    /// it decides too when a store at its key cap cannot hold `key` as a new key
    /// ([`ErrorClass::Capacity`]: only that request is affected, and the breaker does not count
    /// it).
    pub async fn check_key(&self, key: &Key, cost: u64) -> Result<Decision, Error> {
        let started = Instant::now();
        let outcome = self.decide(key, cost, started).await;
        self.inner.meters.record(&outcome, started);
        outcome
    }

    async fn decide(&self, key: &Key, cost: u64, started: Instant) -> Result<Decision, Error> {
        let inner = &*self.inner;
        // Held to the end of the call, which decides under the policy it started with. An
        // `arc_swap` guard: one of the thread's few debt slots, or, once calls in flight on
        // this thread hold them all (many tasks awaiting Redis), a reference count. Measured
        // level with the leaked `&'static` it replaced: `benches/scripts/ab.sh`, 64 tasks on
        // Redis, and `tollgate load` on the local store, 1 and 2 threads (BENCHMARKS.md).
        let active = inner.policy.load();
        active.policy.check_cost(cost)?;
        if let Some(cache) = &inner.deny_cache
            && let Some(decision) = cache.lookup(key, &active.policy, cost, started)
        {
            inner.meters.deny_cached();
            return Ok(decision);
        }
        let (permit, transition) = inner.breaker.permit();
        self.report(transition);
        if permit == Permit::Skip {
            return self.fail_over(&active, key, cost, breaker_open());
        }
        let ticket = Ticket::new(self, permit);
        let epoch = inner.deny_cache.as_ref().map(DenyCache::epoch);
        let call = inner.store.acquire(key, &active.policy, cost);
        let result = match tokio::time::timeout(inner.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(inner.timeout)),
        };
        match result {
            Ok(decision) => {
                ticket.settle(true);
                if let (Some(cache), Some(epoch)) = (&inner.deny_cache, epoch) {
                    cache.record(key, &active.policy, cost, &decision, (started, epoch));
                }
                Ok(decision)
            }
            Err(e) => {
                ticket.settle(!is_outage(e.class()));
                self.on_store_error(&active, key, cost, e, None)
            }
        }
    }

    /// Applies `cost` to each of `keys` (each atomically, in order), in one round trip where the
    /// store can batch (Redis pipelines the scripts). Returns one result per key, in order, each
    /// as [`Limiter::check_key`] would have returned it: a request the store could not decide
    /// takes the failure mode on its own, and the decisions the store did make are kept (the
    /// allowance they consumed is spent). The outer error is for invalid input (a cost above
    /// the limit, refused before anything is written) or a store error that is a bug,
    /// including a batch answered with the wrong number of results
    /// ([`Error::BatchMismatch`]).
    ///
    /// The limiter's timeout bounds the whole batch, not each request: a batch too large to be
    /// sent and answered within it (on loopback, a debug build took ~170 ms for 10,000 keys and
    /// missed a 250 ms timeout with 100,000) times out as a whole, and each request takes the
    /// failure mode. Split large batches, or give the limiter a timeout that fits them.
    pub async fn check_many(
        &self,
        keys: &[Key],
        cost: u64,
    ) -> Result<Vec<Result<Decision, Error>>, Error> {
        let inner = &*self.inner;
        let started = Instant::now();
        // Held to the end of the call, as in `decide`: the failure mode answers under it too.
        let active = inner.policy.load();
        let policy = &active.policy;
        if keys.is_empty() {
            // Nothing to decide, and no store answer: it must not settle the breaker.
            return policy
                .check_cost(cost)
                .map(|()| Vec::new())
                .map_err(Error::from);
        }
        if let Err(e) = policy.check_cost(cost) {
            return Err(self.refuse_batch(keys.len(), Error::from(e), started));
        }
        // Keys the deny cache answers are not sent; the others go to the store as one batch.
        if let Some(cache) = &inner.deny_cache {
            let cached: Vec<Option<Decision>> = keys
                .iter()
                .map(|key| cache.lookup(key, policy, cost, started))
                .collect();
            if cached.iter().any(Option::is_some) {
                let ask: Vec<Key> = keys
                    .iter()
                    .zip(&cached)
                    .filter(|(_, hit)| hit.is_none())
                    .map(|(key, _)| key.clone())
                    .collect();
                let mut asked = if ask.is_empty() {
                    Vec::new()
                } else {
                    match Box::pin(self.decide_many(&ask, cost, &active, started)).await {
                        Ok(asked) => asked,
                        // The whole call fails: the cached answers are refused with the rest
                        // (decide_many recorded those it was given).
                        Err(e) => {
                            return Err(self.refuse_batch(keys.len() - ask.len(), e, started));
                        }
                    }
                }
                .into_iter();
                return Ok(cached
                    .into_iter()
                    .map(|hit| match hit {
                        Some(d) => {
                            inner.meters.deny_cached();
                            let outcome = Ok(d);
                            inner.meters.record(&outcome, started);
                            outcome
                        }
                        None => asked.next().expect("one result per key asked"),
                    })
                    .collect());
            }
        }
        self.decide_many(keys, cost, &active, started).await
    }

    /// [`Limiter::check_many`] for `keys` the deny cache did not answer (every key when there
    /// is none), with the cost checked under `active` (the policy the call started with);
    /// shared denials are cached.
    async fn decide_many(
        &self,
        keys: &[Key],
        cost: u64,
        active: &Active,
        started: Instant,
    ) -> Result<Vec<Result<Decision, Error>>, Error> {
        let inner = &*self.inner;
        let policy = &active.policy;
        let epoch = inner.deny_cache.as_ref().map(DenyCache::epoch);
        let (permit, transition) = inner.breaker.permit();
        self.report(transition);
        let results: Vec<Result<Decision, StoreError>> = if permit == Permit::Skip {
            keys.iter().map(|_| Err(breaker_open())).collect()
        } else {
            let ticket = Ticket::new(self, permit);
            let requests: Vec<Acquire<'_>> = keys
                .iter()
                .map(|key| Acquire { key, policy, cost })
                .collect();
            // The store is told the deadline, so that a batch it spreads over several servers
            // returns the decisions made by then rather than losing them all to this timeout.
            let deadline = tokio::time::Instant::from_std(deadline_after(
                tokio::time::Instant::now().into_std(),
                inner.timeout,
            ));
            let call = inner.store.acquire_many_by(&requests, deadline.into_std());
            let batch = match tokio::time::timeout_at(deadline, call).await {
                // The store was told this deadline and reports missing it by the time it had
                // left when it started (a hair under this timeout); a single call missing it
                // is told this timeout, and so is each request of the batch.
                Ok(Err(StoreError::Timeout(_))) if tokio::time::Instant::now() >= deadline => {
                    Err(StoreError::Timeout(inner.timeout))
                }
                Ok(r) => r,
                Err(_) => Err(StoreError::Timeout(inner.timeout)),
            };
            match batch {
                Ok(results) if results.len() != keys.len() => {
                    // Answered, so the store is there: not an outage for the breaker.
                    ticket.settle(true);
                    inner.meters.store_error(ErrorClass::Script);
                    let error = Error::BatchMismatch {
                        operation: inner.operation.clone(),
                        requested: keys.len(),
                        returned: results.len(),
                    };
                    tracing::error!(operation = %inner.operation, %error, "rate limiter store error (bug)");
                    return Err(self.refuse_batch(keys.len(), error, started));
                }
                Ok(results) => {
                    // One answer is enough to show the store is there.
                    ticket.settle(results.iter().any(answered));
                    results
                }
                Err(e) => {
                    let class = e.class();
                    ticket.settle(!is_outage(class));
                    inner.meters.store_error(class);
                    let error = match class {
                        ErrorClass::Invalid => Error::Invalid(e),
                        // A store that cannot hold the batch's new keys refuses them as it
                        // refuses one: each request takes the failure mode, and the breaker
                        // does not count it (settled above).
                        ErrorClass::Unavailable | ErrorClass::Busy | ErrorClass::Capacity => {
                            self.warn_outage(class, &e, keys.len());
                            let failure = BatchFailure::new(e);
                            return Ok(keys
                                .iter()
                                .map(|key| {
                                    let outcome = self.fail_over(active, key, cost, failure.copy());
                                    inner.meters.record(&outcome, started);
                                    outcome
                                })
                                .collect());
                        }
                        _ => {
                            tracing::error!(operation = %inner.operation, error = %e, "rate limiter store error (bug)");
                            Error::Store(e)
                        }
                    };
                    return Err(self.refuse_batch(keys.len(), error, started));
                }
            }
        };
        let mut failed = Vec::new();
        let out = keys
            .iter()
            .zip(results)
            .map(|(key, result)| {
                let outcome = match result {
                    Ok(d) => {
                        if let (Some(cache), Some(epoch)) = (&inner.deny_cache, epoch) {
                            cache.record(key, policy, cost, &d, (started, epoch));
                        }
                        Ok(d)
                    }
                    Err(e) if permit == Permit::Skip => self.fail_over(active, key, cost, e),
                    Err(e) => self.on_store_error(active, key, cost, e, Some(&mut failed)),
                };
                inner.meters.record(&outcome, started);
                outcome
            })
            .collect();
        for (class, error, n) in failed {
            self.warn_outage(class, &error, n);
        }
        Ok(out)
    }

    /// Records `n` requests refused by `error` and returns it.
    fn refuse_batch(&self, n: usize, error: Error, started: Instant) -> Error {
        let outcome = Err(error);
        for _ in 0..n {
            self.inner.meters.record(&outcome, started);
        }
        match outcome {
            Err(e) => e,
            Ok(_) => unreachable!(),
        }
    }

    /// Forgets what this limiter holds of the key encoded as `key`, as [`Limiter::reset`]
    /// does before it resets the store: a cached denial (and any in flight) and the degraded
    /// local bucket. For a reset announced by another process
    /// ([`crate::registry::PolicyFollower`]).
    pub(crate) fn forget_reset_key(&self, key: &str) {
        if let Some(cache) = &self.inner.deny_cache {
            cache.remove_encoded(key);
        }
        self.forget_local(key);
    }

    /// Forgets the bucket identified by `parts` in the store (and any cached denial of it, or
    /// one in flight, and its degraded local bucket): the next check sees a fresh bucket. Other
    /// instances do not hear of it; [`crate::registry::PolicyFollower::reset`] tells them too.
    ///
    /// A reset the store cannot answer is [`Error::Unavailable`] (whatever the failure mode:
    /// there is nothing to fall back to, and the breaker does not count it). While the circuit
    /// breaker is open (or its probe is in flight) the store is not called: the reset fails at
    /// once, [`Error::Unavailable`] saying the breaker is open, uncounted in the metrics as no
    /// round trip was made (this limiter's cached denial and degraded bucket are forgotten all
    /// the same). A reset that comes when the probe is due is the probe: its answer closes the
    /// breaker, its failure keeps it open for another interval. One the store refuses as
    /// a bug (a script-class error, such as an ACL refusing `DEL`) is [`Error::Store`], logged
    /// at error level as a decision's would be. Each failed round trip counts once in
    /// `tollgate_store_errors_total`, by class.
    pub async fn reset<I, P>(&self, parts: I) -> Result<(), Error>
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        self.reset_key(&self.key(parts)?).await
    }

    /// [`Limiter::reset`] for a key built by [`Limiter::key`].
    pub async fn reset_key(&self, key: &Key) -> Result<(), Error> {
        let inner = &*self.inner;
        self.forget_reset_key(key.as_str());
        let (permit, transition) = inner.breaker.permit();
        self.report(transition);
        if permit == Permit::Skip {
            // The breaker is open: the store is not called, as for a decision (a reset would
            // wait out its deadline on a store known to be down), and the reset fails now.
            return Err(Error::Unavailable {
                operation: inner.operation.clone(),
                source: breaker_open(),
            });
        }
        let ticket = Ticket::new(self, permit);
        let policy = self.policy();
        let call = inner.store.reset(key, &policy);
        let result = match tokio::time::timeout(inner.timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(inner.timeout)),
        };
        if permit == Permit::Probe {
            // The breaker's probe settles it; any other reset is not counted.
            ticket.settle(answered(&result));
        }
        if let Some(cache) = &inner.deny_cache {
            // Again once the store has forgotten the bucket: a request sent during the reset's
            // round trip read the epoch bumped above and may have met the bucket before it went.
            cache.remove(key);
        }
        // A failed reset is a failed store round trip like a decision's: counted by class, and
        // one that is not an outage (a script error, an ACL refusal) logged as a bug.
        let Err(e) = result else { return Ok(()) };
        inner.meters.store_error(e.class());
        if is_outage(e.class()) {
            return Err(Error::Unavailable {
                operation: inner.operation.clone(),
                source: e,
            });
        }
        Err(self.classify(key, e))
    }

    /// The circuit breaker's current state.
    pub fn breaker_state(&self) -> BreakerState {
        self.inner.breaker.state()
    }

    fn report(&self, transition: Transition) {
        if let Some((from, to)) = transition {
            let inner = &*self.inner;
            tracing::warn!(
                operation = %inner.operation,
                from = from.as_str(),
                to = to.as_str(),
                mode = inner.failure_mode.as_str(),
                "rate limiter circuit breaker changed state"
            );
            // The gauge is set to the breaker's state as it is now, not to this transition's
            // `to`: transitions race with their reports (the caller that opened the breaker
            // may be held up writing the line above while another's probe closes it), and a
            // delayed `to` written last would leave the gauge wrong for good — open while the
            // breaker is closed, or closed through an outage. Under the lock each report reads
            // the state after its own transition, so the last write reads it after the last
            // transition. Transitions are rare; decisions never take the lock.
            let _order = inner
                .gauge_order
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            inner.meters.breaker.set(inner.breaker.state().as_gauge());
        }
    }

    fn warn_outage(&self, class: ErrorClass, error: &dyn std::fmt::Display, requests: usize) {
        let inner = &*self.inner;
        if class == ErrorClass::Capacity {
            // The breaker does not count these, so nothing else bounds them.
            let Some(suppressed) = inner.capacity_log.hit(Instant::now(), requests as u64) else {
                return;
            };
            tracing::warn!(
                operation = %inner.operation,
                mode = inner.failure_mode.as_str(),
                requests,
                suppressed,
                error = %error,
                "rate limiter store cannot hold a new key; applying failure mode to it alone"
            );
        } else {
            let log = &inner.outage_log[usize::from(class == ErrorClass::Busy)];
            let Some(suppressed) = log.hit(Instant::now(), requests as u64) else {
                return;
            };
            tracing::warn!(
                operation = %inner.operation,
                mode = inner.failure_mode.as_str(),
                class = class.as_str(),
                requests,
                suppressed,
                error = %error,
                "rate limiter store unavailable; applying failure mode"
            );
        }
    }

    /// The answer to a store error (the breaker already settled), under `active`, the policy
    /// the call started with.
    /// `batch`: within a batch, per class of failure, the first one's message and their
    /// count, for one warning per class after the batch (each class thinned on its own: one
    /// class must not label or hide the other); `None` warns now.
    fn on_store_error(
        &self,
        active: &Active,
        key: &Key,
        cost: u64,
        error: StoreError,
        batch: Option<&mut Vec<(ErrorClass, String, usize)>>,
    ) -> Result<Decision, Error> {
        let class = error.class();
        self.inner.meters.store_error(class);
        if is_outage(class) || class == ErrorClass::Capacity {
            match batch {
                Some(failed) => match failed.iter_mut().find(|(c, ..)| *c == class) {
                    Some((.., n)) => *n += 1,
                    None => failed.push((class, error.to_string(), 1)),
                },
                None => self.warn_outage(class, &error, 1),
            }
            return self.fail_over(active, key, cost, error);
        }
        Err(self.classify(key, error))
    }

    /// A store error that the failure mode does not handle: invalid input, or a bug (logged).
    fn classify(&self, key: &Key, error: StoreError) -> Error {
        if error.class() == ErrorClass::Invalid {
            return Error::Invalid(error);
        }
        tracing::error!(operation = %self.inner.operation, %key, error = %error, "rate limiter store error (bug)");
        Error::Store(error)
    }

    /// The failure mode's answer for `key` under `active` (the policy the call started with:
    /// calls in flight finish under it, see [`Limiter::set_policy`]), or
    /// [`Error::Unavailable`] when it fails closed.
    fn fail_over(
        &self,
        active: &Active,
        key: &Key,
        cost: u64,
        error: StoreError,
    ) -> Result<Decision, Error> {
        self.apply_failure_mode(active, key, cost, &error)
            .map_err(|()| Error::Unavailable {
                operation: self.inner.operation.clone(),
                source: error,
            })
    }

    /// The failure mode's answer under `active`; `Err(())` means fail closed.
    fn apply_failure_mode(
        &self,
        active: &Active,
        key: &Key,
        cost: u64,
        error: &StoreError,
    ) -> Result<Decision, ()> {
        let inner = &*self.inner;
        match &inner.failure_mode {
            FailureMode::Open => {
                // The call's policy, not the one in force now: a switch meanwhile must not
                // answer a call checked against one limit with another (below its cost).
                let limit = active.policy.limit();
                Ok(Decision {
                    allowed: true,
                    limit,
                    remaining: limit,
                    retry_after: None,
                    reset_after: Duration::ZERO,
                    enforcement: Enforcement::Bypassed,
                })
            }
            FailureMode::Closed => Err(()),
            FailureMode::Degraded { local, .. } => {
                self.decide_locally(active, local.decider(), key, cost, error)
            }
        }
    }

    /// Drops `key`'s degraded bucket (a reset). A shared answer does not: local buckets last
    /// until they expire, across outages, so that a store flapping between up and down cannot
    /// grant an instance its local share again at every outage (`chaos_soak` bounds degraded
    /// admissions per instance and key by the share per local window).
    fn forget_local(&self, key: &str) {
        if let FailureMode::Degraded { local, .. } = &self.inner.failure_mode {
            local.decider().forget(key);
        }
    }

    /// A degraded failure mode's answer, from `local` under this instance's share of
    /// `active` (the policy the call started with); `Err(())` when the local store fails too.
    fn decide_locally(
        &self,
        active: &Active,
        local: &dyn DecideNow,
        key: &Key,
        cost: u64,
        error: &StoreError,
    ) -> Result<Decision, ()> {
        let inner = &*self.inner;
        let policy = active.degraded.as_ref().unwrap_or(&active.policy);
        let retry = inner.breaker.probe_interval().max(MIN_RETRY);
        // More than this instance's share can ever hold. Charging less than the cost would let
        // the fleet admit more than its quota, so it is denied until shared enforcement can
        // decide it; what is left comes from a peek of the whole share.
        let local_decision = if cost > policy.limit() {
            deny_until_shared(local, key, policy, policy.limit(), retry)
        } else {
            local.acquire_now(key, policy, cost)
        };
        // A local bucket that older, smaller parameters govern for good (a policy shrunk by a
        // newer generation) refuses a cost, or a peek of the share, above its own limit (under
        // a deferral it denies it until it expires instead): the request is valid under the
        // policy in force, and the local limiter has not failed. Denied likewise; a peek of 1,
        // which any bucket holds, says what is left.
        let local_decision = match local_decision {
            Err(StoreError::InvalidPolicy(PolicyError::CostAboveCapacity { .. })) => {
                deny_until_shared(local, key, policy, 1, retry)
            }
            other => other,
        };
        match local_decision {
            Ok(d) => Ok(d.with_enforcement(Enforcement::Degraded)),
            Err(local_error) => {
                inner.meters.fallback_error(local_error.class());
                if let Some(suppressed) = inner.fallback_log.hit(Instant::now(), 1) {
                    tracing::error!(operation = %inner.operation, shared = %error, local = %local_error, suppressed, "degraded local limiter failed too");
                }
                Err(())
            }
        }
    }
}

/// A degraded denial of a request `local`'s bucket for `key` cannot take (its cost is above the
/// share, or above the limit of older parameters still governing the bucket), told to retry
/// in `retry` (when shared enforcement may decide it). What is left comes from a peek of
/// `probe` units, which spends nothing: denied, it says what is left; admitted, the bucket
/// holds what the peek would leave plus `probe`, and is full again when the peek says unless
/// it is full now. The peek's reset is after spending `probe`, so it is one unit's refill late
/// at most when `probe` is 1 and otherwise asked again with 1 (a peek cannot ask more than the
/// share, and only a request the bucket cannot hold is decided without spending).
fn deny_until_shared(
    local: &dyn DecideNow,
    key: &Key,
    policy: &Policy,
    probe: u64,
    retry: Duration,
) -> Result<Decision, StoreError> {
    let d = local.peek_now(key, policy, probe)?;
    let held = if d.allowed {
        d.remaining.saturating_add(probe).min(d.limit)
    } else {
        d.remaining
    };
    let reset_after = if !d.allowed {
        d.reset_after
    } else if held == d.limit {
        Duration::ZERO
    } else if probe == 1 {
        d.reset_after
    } else {
        local.peek_now(key, policy, 1)?.reset_after
    };
    Ok(Decision {
        allowed: false,
        remaining: held,
        retry_after: Some(retry),
        reset_after,
        ..d
    })
}

/// The shortest `retry_after` of a degraded denial that no local bucket can ever admit.
const MIN_RETRY: Duration = Duration::from_millis(1);

/// Whether the error means the store cannot answer now (the breaker counts it).
fn is_outage(class: ErrorClass) -> bool {
    matches!(class, ErrorClass::Unavailable | ErrorClass::Busy)
}

/// Whether the store answered `result` (any answer, even an error that is not an outage): what
/// the breaker is told ([`Ticket::settle`]).
fn answered<T>(result: &Result<T, StoreError>) -> bool {
    result
        .as_ref()
        .map_or_else(|e| !is_outage(e.class()), |_| true)
}

fn breaker_open() -> StoreError {
    StoreError::Unavailable {
        message: "circuit breaker open; store not called".into(),
        source: None,
    }
}

/// A store error that failed a whole batch, standing for it on each of the batch's requests
/// ([`BatchFailure::copy`]): the error's cause (its source, which cannot be cloned) is shared,
/// so each request's error names it as a single call's does.
struct BatchFailure {
    /// The error, its source taken out into `cause`.
    error: StoreError,
    cause: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl BatchFailure {
    fn new(mut error: StoreError) -> Self {
        let cause = match &mut error {
            StoreError::Unavailable { source, .. } => source.take().map(Arc::from),
            _ => None,
        };
        Self { error, cause }
    }

    /// An error of the batch error's class for one request, saying what it says, down to its
    /// cause.
    fn copy(&self) -> StoreError {
        let mut copy = same_class(&self.error);
        if let (StoreError::Unavailable { source, .. }, Some(cause)) = (&mut copy, &self.cause) {
            *source = Some(Box::new(SharedCause(Arc::clone(cause))));
        }
        copy
    }
}

/// A batch error's cause, shared by that error's copies on each request: it reads as the
/// cause itself (its text and its own sources).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct SharedCause(Arc<dyn std::error::Error + Send + Sync>);

/// An error of `e`'s class standing for it on one request of a batch that failed as a whole,
/// saying what `e` says (its source aside: [`BatchFailure::copy`] shares it).
fn same_class(e: &StoreError) -> StoreError {
    match e {
        StoreError::Busy(m) => StoreError::Busy(m.clone()),
        StoreError::Timeout(d) => StoreError::Timeout(*d),
        StoreError::KeyCapReached { cap } => StoreError::KeyCapReached { cap: *cap },
        // Its message, not its whole text: the text is this variant's prefix and the
        // message, so the copy would say "store unavailable: " twice.
        StoreError::Unavailable { message, .. } => StoreError::Unavailable {
            message: message.clone(),
            source: None,
        },
        other => StoreError::Unavailable {
            message: other.to_string(),
            source: None,
        },
    }
}

/// One call's standing with the circuit breaker, settled once with the store's answer. A
/// probe dropped unsettled (its future abandoned) hands the probe on rather than leaving the
/// breaker half-open with nobody probing.
struct Ticket<'a> {
    limiter: &'a Limiter,
    permit: Permit,
    settled: bool,
}

impl<'a> Ticket<'a> {
    fn new(limiter: &'a Limiter, permit: Permit) -> Self {
        Self {
            limiter,
            permit,
            settled: false,
        }
    }

    /// `answered`: the store answered (any answer, even an error that is not an outage).
    fn settle(mut self, answered: bool) {
        self.settled = true;
        let breaker = &self.limiter.inner.breaker;
        let transition = if answered {
            breaker.on_success(self.permit)
        } else {
            breaker.on_failure(self.permit)
        };
        self.limiter.report(transition);
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if !self.settled && self.permit == Permit::Probe {
            self.limiter
                .report(self.limiter.inner.breaker.abandon_probe());
        }
    }
}

/// One instance's share of a policy under [`FailureMode::Degraded`].
struct Share {
    /// The policy it enforces locally.
    policy: Policy,
    /// How the share departs from the policy divided by the instances (the floor of the
    /// divided capacity or limit aside); empty when it does not.
    approximations: Vec<&'static str>,
}

/// A limit below the instance count: each instance still admits one.
const AT_LEAST_ONE: &str = "the limit is below the expected instances, and each instance \
    admits at least 1: the fleet may admit up to one per instance";

/// A divided refill rate that no policy can express.
const SLOWER_REFILL: &str = "the divided refill rate needs a period longer than any policy \
    takes: the local share refills more slowly than its exact share, so the fleet admits less";

/// The policy one of `n` instances enforces locally: limits divided by `n` (at least 1), with
/// the policy's generation, transition rule and elapsed-time cap. A token bucket's refill rate
/// is divided exactly when the result can be expressed, and otherwise slowed further (see
/// [`divided_bucket`]): the share errs on the side of admitting less, never the whole quota.
/// `None` only for an algorithm this version does not know how to divide.
fn scale_down(policy: &Policy, n: u64) -> Option<Share> {
    if n <= 1 {
        return Some(Share {
            policy: *policy,
            approximations: Vec::new(),
        });
    }
    let mut approximations = Vec::new();
    if policy.limit() < n {
        approximations.push(AT_LEAST_ONE);
    }
    // The limit divided: never above the policy's, so every check the policy passed still holds
    // (a fixed window's or a sliding log's window is unchanged).
    let share = (policy.limit() / n).max(1);
    let scaled = match policy.algorithm() {
        Algorithm::TokenBucket(tb) => {
            let (p, exact) = divided_bucket(share, tb, n)?;
            if !exact {
                approximations.push(SLOWER_REFILL);
            }
            match tb.max_elapsed_micros {
                Some(cap) => p.with_max_elapsed(Duration::from_micros(cap)).ok()?,
                None => p,
            }
        }
        Algorithm::FixedWindow(fw) => {
            Policy::fixed_window(share, Duration::from_micros(fw.window_micros)).ok()?
        }
        Algorithm::SlidingLog(sl) => {
            Policy::sliding_log(share, Duration::from_micros(sl.window_micros)).ok()?
        }
        _ => return None,
    };
    Some(Share {
        policy: scaled
            .with_generation(policy.generation())
            .with_transition(policy.transition()),
        approximations,
    })
}

/// A token bucket holding `capacity`, refilled at `tb`'s rate divided by `n`: exactly when
/// that rate can be expressed (`true`), else at the fastest rate that can be and is no faster
/// (`false`).
///
/// The policy keeps its rate reduced: `tb.rate` tokens every `tb.unit` µs, coprime. Divided by
/// `n` and reduced again, it is `tb.rate / g` tokens every `tb.unit · n / g` µs, with `g` their
/// gcd: the shortest period the exact share can have. (Multiplying the period as given by `n`
/// refused 1,000,000 tokens every 30 days over 150 instances — 12 years, past
/// [`MAX_DURATION`] — where the share is 20,000 every 90 days.) The capacity is at most the
/// policy's divided by `n` (or 1), so it fits the exact range whenever the policy did.
///
/// When even the shortest period passes [`MAX_DURATION`], the period is capped there and the
/// tokens rounded down (at least 1: one token per [`MAX_DURATION`], the slowest rate any
/// policy has, may exceed a share slower still).
fn divided_bucket(capacity: u64, tb: &TokenBucket, n: u64) -> Option<(Policy, bool)> {
    let g = tollgate_core::algorithm::gcd(tb.rate, n);
    let (tokens, periods) = (tb.rate / g, n / g);
    let max_micros = MAX_DURATION.as_micros() as u64;
    let exact = tb
        .unit
        .checked_mul(periods)
        .filter(|&micros| micros <= max_micros)
        .and_then(|micros| {
            Policy::token_bucket(capacity, Rate::new(tokens, Duration::from_micros(micros))).ok()
        });
    if let Some(p) = exact {
        return Some((p, true));
    }
    let period = u128::from(tb.unit) * u128::from(periods);
    let per_max = (u128::from(tokens) * u128::from(max_micros) / period)
        .clamp(1, u128::from(MAX_EXACT)) as u64;
    [per_max, 1]
        .into_iter()
        .find_map(|tokens| Policy::token_bucket(capacity, Rate::new(tokens, MAX_DURATION)).ok())
        // Not reached when the policy itself was valid; still never the whole quota.
        .or_else(|| Policy::token_bucket(1, Rate::new(1, MAX_DURATION)).ok())
        .map(|p| (p, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_requires_an_explicit_failure_mode() {
        let policy = Policy::fixed_window(10, Duration::from_secs(1)).unwrap();
        let err = Limiter::builder("op", policy)
            .store(Arc::new(LocalStore::new()))
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::Incomplete { .. }), "{err}");
    }

    #[test]
    fn degraded_policy_divides_the_quota() {
        let p = Policy::token_bucket(100, Rate::per_second(10)).unwrap();
        let p = p
            .with_generation(3)
            .with_transition(tollgate_core::Transition::Reset)
            .with_max_elapsed(Duration::from_secs(2))
            .unwrap();
        let share = scale_down(&p, 4).unwrap();
        assert!(share.approximations.is_empty());
        let s = share.policy;
        assert_eq!(s.limit(), 25);
        assert_eq!(s.generation(), 3);
        assert_eq!(s.transition(), tollgate_core::Transition::Reset);
        let Algorithm::TokenBucket(tb) = s.algorithm() else {
            unreachable!()
        };
        assert!((tb.refill.as_per_second() - 2.5).abs() < 1e-9);
        assert_eq!(tb.max_elapsed_micros, Some(2_000_000), "the cap is kept");
    }

    /// The refill rate of a token bucket policy, as (tokens, µs).
    fn refill(p: &Policy) -> (u128, u128) {
        let Algorithm::TokenBucket(tb) = p.algorithm() else {
            unreachable!()
        };
        (
            u128::from(tb.refill.tokens()),
            tb.refill.period().as_micros(),
        )
    }

    /// 1,000,000 tokens every 30 days over 150 instances: 6,666 tokens refilled at exactly a
    /// 150th of the rate. The period multiplied by 150 as given (12 years) is past
    /// `MAX_DURATION`, which made each instance enforce the whole quota.
    #[test]
    fn a_long_refill_period_is_divided_exactly_once_reduced() {
        let month = Duration::from_secs(30 * 24 * 3600);
        let p = Policy::token_bucket(1_000_000, Rate::new(1_000_000, month)).unwrap();
        let share = scale_down(&p, 150).unwrap();
        assert!(
            share.approximations.is_empty(),
            "{:?}",
            share.approximations
        );
        assert_eq!(share.policy.limit(), 6_666);
        let (tokens, micros) = refill(&share.policy);
        assert_eq!(tokens * 150 * month.as_micros(), 1_000_000 * micros);
    }

    /// Over a grid of policies and instance counts, every share divides the capacity (at least
    /// 1), and refills at exactly the divided rate unless it says it cannot, and then more
    /// slowly — or at one token per `MAX_DURATION`, the slowest rate a policy has.
    #[test]
    fn every_token_bucket_share_divides_the_quota_and_never_refills_faster() {
        let periods = [
            Duration::from_millis(1),
            Duration::from_secs(1),
            Duration::from_secs(30 * 24 * 3600),
            Duration::from_secs(9 * 365 * 24 * 3600),
            MAX_DURATION,
        ];
        let mut checked = 0;
        for capacity in [1, 7, 15, 1_000, 1_000_000] {
            for tokens in [1, 3, 7, 1_000, 1_000_000] {
                for period in periods {
                    let Ok(p) = Policy::token_bucket(capacity, Rate::new(tokens, period)) else {
                        continue;
                    };
                    for n in [2, 3, 150, 10_007, u64::from(u32::MAX)] {
                        let share = scale_down(&p, n).unwrap();
                        let s = &share.policy;
                        assert_eq!(s.limit(), (capacity / n).max(1), "{p:?} / {n}");
                        assert_eq!(
                            share.approximations.contains(&AT_LEAST_ONE),
                            capacity < n,
                            "{p:?} / {n}"
                        );
                        let (t, us) = refill(s);
                        // The share's rate t/us against the exact tokens / (period · n).
                        let (share_rate, exact_rate) = (
                            t * period.as_micros() * u128::from(n),
                            u128::from(tokens) * us,
                        );
                        if share.approximations.contains(&SLOWER_REFILL) {
                            assert!(
                                share_rate < exact_rate || (t, us) == (1, MAX_DURATION.as_micros()),
                                "{p:?} / {n}: {s:?}"
                            );
                        } else {
                            assert_eq!(share_rate, exact_rate, "{p:?} / {n}: {s:?}");
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 300, "{checked}");
    }

    /// A fixed window's and a sliding log's limit is divided with the window kept, whatever
    /// the window and the instance count: nothing falls back to the whole quota.
    #[test]
    fn windows_divide_their_limit_and_keep_their_window() {
        for window in [Duration::from_millis(1), MAX_DURATION] {
            for n in [2, 150, u64::from(u32::MAX)] {
                for p in [
                    Policy::fixed_window(MAX_EXACT, window).unwrap(),
                    Policy::fixed_window(1_000, window).unwrap(),
                    Policy::sliding_log(1_000, window).unwrap(),
                ] {
                    let share = scale_down(&p.with_generation(7), n).unwrap();
                    assert_eq!(share.policy.limit(), (p.limit() / n).max(1), "{p:?} / {n}");
                    assert_eq!(share.policy.generation(), 7);
                    assert_eq!(share.approximations.is_empty(), p.limit() >= n);
                    let (Algorithm::FixedWindow(a), Algorithm::FixedWindow(b)) =
                        (p.algorithm(), share.policy.algorithm())
                    else {
                        let (Algorithm::SlidingLog(a), Algorithm::SlidingLog(b)) =
                            (p.algorithm(), share.policy.algorithm())
                        else {
                            unreachable!()
                        };
                        assert_eq!(a.window_micros, b.window_micros);
                        continue;
                    };
                    assert_eq!(a.window_micros, b.window_micros);
                }
            }
        }
    }

    /// A fail-closed limiter of 10 per second on a fresh local store.
    fn local_limiter() -> Limiter {
        let policy = Policy::fixed_window(10, Duration::from_secs(1)).unwrap();
        Limiter::builder("op", policy)
            .store(Arc::new(LocalStore::new()))
            .failure_mode(FailureMode::Closed)
            .build()
            .unwrap()
    }

    #[test]
    fn an_invalid_request_is_named_once() {
        let e = Error::Invalid(StoreError::InvalidPolicy(
            tollgate_core::PolicyError::CostAboveCapacity { cost: 5, max: 4 },
        ));
        let text = e.to_string();
        assert!(text.starts_with("invalid request: "), "{text}");
        assert_eq!(text.matches("invalid").count(), 1, "{text}");
    }

    /// Every decision builds the `check_key` future. It was 216 bytes before the breaker's
    /// ticket and the deny cache's epoch were held across the store call; 320 with them (the
    /// same whether the work around the call is split into synchronous functions or not); 328
    /// since the policy in force is held by an `arc_swap` guard (16 bytes) instead of a
    /// `&'static` to a policy leaked for the process's life (8); 344 since the breaker's permit
    /// carries its open count (a `u32`, so that stragglers of a handled outage are not counted
    /// again). The bound catches growth past that; the size is the type's, whatever the store.
    #[tokio::test]
    async fn a_decision_future_stays_small() {
        let limiter = local_limiter();
        let key = limiter.key(["k"]).unwrap();
        let call = limiter.check_key(&key, 1);
        let size = size_of_val(&call);
        assert!(size <= 344, "{size} bytes");
        assert!(call.await.unwrap().allowed);
    }

    #[tokio::test]
    async fn cost_above_capacity_is_invalid_not_a_denial() {
        let limiter = local_limiter();
        let err = limiter.check(["a"], 11).await.unwrap_err();
        assert!(matches!(
            err,
            Error::Invalid(StoreError::InvalidPolicy(
                PolicyError::CostAboveCapacity { .. }
            ))
        ));
    }
}
