//! The `Store` trait every backend implements, and the errors a store reports.

use std::time::Duration;

use async_trait::async_trait;

use crate::{Decision, Key, KeyError, Policy, PolicyError};

/// One request in a batch.
#[derive(Debug, Clone, Copy)]
pub struct Acquire<'a> {
    /// The bucket.
    pub key: &'a Key,
    /// The policy governing it.
    pub policy: &'a Policy,
    /// The request's cost (at least 1, at most the policy's limit).
    pub cost: u64,
}

impl<'a> Acquire<'a> {
    /// A request for `cost` units of `key`'s bucket under `policy`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate_core::{Acquire, Key, Policy};
    /// let key = Key::global("search");
    /// let policy = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
    /// let request = Acquire::new(&key, &policy, 2);
    /// assert_eq!(request.cost, 2);
    /// ```
    #[must_use]
    pub const fn new(key: &'a Key, policy: &'a Policy, cost: u64) -> Self {
        Self { key, policy, cost }
    }
}

/// The results of [`Store::acquire_many`]: one per request, in order.
pub type Batch = Vec<Result<Decision, StoreError>>;

/// The class of a store error, which decides what a limiter does about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorClass {
    /// The request itself was invalid; nothing was written. A caller bug or hostile input.
    Invalid,
    /// The store could not be reached or cannot serve writes now (connect, I/O, timeout,
    /// LOADING, MASTERDOWN, READONLY, CLUSTERDOWN, TRYAGAIN). The operation's failure mode
    /// applies, and a limiter's circuit breaker counts it.
    Unavailable,
    /// The store is healthy but cannot hold one more key now (a local store at its key cap).
    /// Only the request for the new key is affected: keys already held are decided as usual,
    /// so a limiter applies its failure mode to that request alone and its circuit breaker does
    /// not count it (a flood of new keys must not switch limiting off for every key).
    Capacity,
    /// The store is busy running another script (BUSY). The failure mode applies.
    Busy,
    /// The store answered with an error the limiter did not expect: a bug, reported loudly.
    Script,
}

impl ErrorClass {
    /// A stable lower-case name for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Invalid => "invalid",
            Self::Unavailable => "unavailable",
            Self::Busy => "busy",
            Self::Capacity => "capacity",
            Self::Script => "script",
        }
    }
}

/// An error from a [`Store`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The policy or cost was invalid; nothing was written.
    #[error("invalid request: {0}")]
    InvalidPolicy(#[from] PolicyError),
    /// The key was invalid; nothing was written.
    #[error("invalid key: {0}")]
    InvalidKey(#[from] KeyError),
    /// The store could not be reached or cannot serve now.
    #[error("store unavailable: {message}")]
    Unavailable {
        /// What went wrong.
        message: String,
        /// The underlying error, if any.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The call did not complete within its deadline.
    #[error("store call timed out after {0:?}")]
    Timeout(Duration),
    /// The store is busy (a long-running script).
    #[error("store busy: {0}")]
    Busy(String),
    /// The local store reached its key cap and could not admit a new key.
    #[error("local store is at its cap of {cap} keys")]
    KeyCapReached {
        /// The configured cap.
        cap: usize,
    },
    /// The store answered with an unexpected error (a script error is a bug).
    #[error("store script error: {0}")]
    Script(String),
}

impl StoreError {
    /// An unavailable error with a message and source.
    pub fn unavailable(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::Unavailable {
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// The class of this error.
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::InvalidPolicy(_) | Self::InvalidKey(_) => ErrorClass::Invalid,
            Self::Unavailable { .. } | Self::Timeout(_) => ErrorClass::Unavailable,
            Self::KeyCapReached { .. } => ErrorClass::Capacity,
            Self::Busy(_) => ErrorClass::Busy,
            Self::Script(_) => ErrorClass::Script,
        }
    }
}

/// Where buckets live. One atomic operation is the whole contract.
///
/// # Contract
///
/// `acquire` reads the bucket, brings it up to the store's current time (refill, window roll,
/// log pruning), decides, writes the new state with an expiry, and computes `remaining`,
/// `retry_after` and `reset_after` — **all as one atomic step** with respect to every other
/// call on the same key, from every process sharing the store. Two calls can never both spend
/// the same allowance. Time comes from the store's own clock (Redis `TIME`, or the local
/// store's [`Clock`](crate::Clock)), never from the caller.
///
/// A missing bucket is a fresh one (a full token bucket, an empty window or log). Every bucket
/// written carries an expiry after which it is equivalent to a missing one, so idle keys vanish.
///
/// Invalid input (cost 0 or above the policy's limit) is refused with
/// [`StoreError::InvalidPolicy`] before anything is read or written.
#[async_trait]
pub trait Store: Send + Sync {
    /// Applies `cost` to `key` under `policy` and returns the decision.
    async fn acquire(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError>;

    /// Applies each request in order, each atomically, returning one result per request, in
    /// order. Stores that can should do this in one round trip.
    ///
    /// The outer error is for the batch as a whole: if any request is invalid, nothing is
    /// applied and that request's error is returned; if the store could not be reached at all,
    /// its unavailability is returned. Otherwise each request has its own result: the store may
    /// decide some and fail others (a Redis Cluster shard down, a local store at its key cap
    /// for a new key), and the decisions it made — the allowance they consumed — are never
    /// discarded because a neighbour failed.
    async fn acquire_many(&self, requests: &[Acquire<'_>]) -> Result<Batch, StoreError> {
        for r in requests {
            r.policy.check_cost(r.cost)?;
        }
        let mut out = Vec::with_capacity(requests.len());
        for r in requests {
            out.push(self.acquire(r.key, r.policy, r.cost).await);
        }
        Ok(out)
    }

    /// [`Store::acquire_many`] for a caller that gives up at `deadline`. A store that spreads
    /// a batch over several servers (Redis Cluster) answers by then with what it has: each
    /// request still unanswered fails alone (timed out, class unavailable) and the decisions
    /// already made are returned, where the caller's own timeout would discard them all although
    /// they consumed allowance. The default ignores `deadline` and calls `acquire_many`: the
    /// caller's timeout bounds it.
    async fn acquire_many_by(
        &self,
        requests: &[Acquire<'_>],
        deadline: std::time::Instant,
    ) -> Result<Batch, StoreError> {
        let _ = deadline;
        self.acquire_many(requests).await
    }

    /// What `acquire` would decide for `cost` now, without consuming anything.
    async fn peek(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError>;

    /// Forgets the bucket of `key` under `policy`: the next call sees a fresh bucket.
    async fn reset(&self, key: &Key, policy: &Policy) -> Result<(), StoreError>;
}
