//! `Limiter::check_many` pairs the store's results with the requested keys by position. A
//! store that answers a batch with another number of results (a bug in a custom `Store`) must
//! be a clear error, never a shorter or longer list whose decisions may belong to other keys;
//! and a batch the store refuses as a whole is handled as its refusal says. The store here is
//! a real `LocalStore` behind a deliberately odd `acquire_many`.

// Its log and metrics capture; the flood checks are not used here.
#[allow(dead_code)]
mod flood;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tollgate::{
    Acquire, Batch, Decision, Error, FailureMode, Key, Limiter, LocalStore, Policy, Rate, Store,
    StoreError,
};

/// What [`OddBatches`] does with a batch; single calls always go to its `LocalStore`.
enum Batches {
    /// Answers with this many more results than asked for (or fewer, when negative).
    Miscount(isize),
    /// Refuses it whole for want of room (a store at its key cap that decides a batch all or
    /// nothing).
    Full,
    /// Fails it whole with a script error (a bug).
    Broken,
}

/// A `LocalStore` whose `acquire_many` misbehaves as told.
struct OddBatches {
    inner: LocalStore,
    batches: Batches,
}

impl OddBatches {
    fn new(batches: Batches) -> Self {
        Self {
            inner: LocalStore::new(),
            batches,
        }
    }
}

#[async_trait]
impl Store for OddBatches {
    async fn acquire(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.inner.acquire(key, policy, cost).await
    }

    async fn acquire_many(&self, requests: &[Acquire<'_>]) -> Result<Batch, StoreError> {
        let extra = match self.batches {
            Batches::Miscount(extra) => extra,
            Batches::Full => return Err(StoreError::KeyCapReached { cap: 4 }),
            Batches::Broken => return Err(StoreError::Script("boom".into())),
        };
        let mut out = self.inner.acquire_many(requests).await?;
        match usize::try_from(extra) {
            Ok(more) => {
                for _ in 0..more {
                    out.push(out[0].as_ref().map(Clone::clone).map_err(|_| {
                        StoreError::Script("unreachable: the first request failed".into())
                    }));
                }
            }
            Err(_) => out.truncate(requests.len().saturating_sub(extra.unsigned_abs())),
        }
        Ok(out)
    }

    async fn peek(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.inner.peek(key, policy, cost).await
    }

    async fn reset(&self, key: &Key, policy: &Policy) -> Result<(), StoreError> {
        self.inner.reset(key, policy).await
    }
}

fn limiter(extra: isize, mode: FailureMode) -> Limiter {
    let policy = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
    Limiter::builder("batch", policy)
        .store(Arc::new(OddBatches::new(Batches::Miscount(extra))))
        .failure_mode(mode)
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_batch_answered_with_the_wrong_number_of_results_is_an_error() {
    for extra in [-1, -3, 1] {
        // Whatever the failure mode: a miscount is a store bug, not an outage.
        for mode in [
            FailureMode::Open,
            FailureMode::Closed,
            FailureMode::degraded(2),
        ] {
            let what = format!("{extra:+} results, {}", mode.as_str());
            let limiter = limiter(extra, mode);
            let keys: Vec<Key> = ["a", "b", "c"]
                .iter()
                .map(|k| limiter.key([k]).unwrap())
                .collect();
            let out = limiter.check_many(&keys, 1).await;
            eprintln!("{what}: {out:?}");
            assert!(
                matches!(
                    out,
                    Err(Error::BatchMismatch {
                        requested: 3,
                        returned,
                        ..
                    }) if returned == 3usize.checked_add_signed(extra).unwrap()
                ),
                "{what}: {out:?}"
            );
            // A correct single call still works: the limiter itself is fine.
            assert!(limiter.check(["a"], 1).await.unwrap().allowed, "{what}");
        }
    }
}

/// A batch refused as a whole by a store at its key cap is that refusal for each request: each
/// takes the failure mode, as a single request refused by the cap does, and the breaker counts
/// none of it (a flood of new keys must not switch limiting off for the keys already held).
#[tokio::test]
async fn a_batch_refused_whole_at_the_key_cap_takes_the_failure_mode_per_request() {
    let policy = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
    for mode in [FailureMode::Open, FailureMode::Closed] {
        let what = mode.as_str();
        let limiter = Limiter::builder("full", policy)
            .store(Arc::new(OddBatches::new(Batches::Full)))
            .failure_mode(mode.clone())
            .build()
            .unwrap();
        let keys: Vec<Key> = ["a", "b", "c"]
            .iter()
            .map(|k| limiter.key([k]).unwrap())
            .collect();
        // Far more refused batches than the breaker's threshold of failures in a row.
        for _ in 0..20 {
            let out = limiter
                .check_many(&keys, 1)
                .await
                .expect("per-request results");
            assert_eq!(out.len(), 3, "{what}");
            for r in &out {
                match (&mode, r) {
                    (FailureMode::Open, Ok(d)) => {
                        assert!(d.allowed, "{what}: {d:?}");
                        assert_eq!(d.enforcement, tollgate::Enforcement::Bypassed, "{what}");
                    }
                    (FailureMode::Closed, Err(Error::Unavailable { source, .. })) => {
                        assert_eq!(source.class(), tollgate::ErrorClass::Capacity, "{what}");
                    }
                    _ => panic!("{what}: {r:?}"),
                }
            }
        }
        assert_eq!(
            limiter.breaker_state(),
            tollgate::BreakerState::Closed,
            "{what}"
        );
        // The store itself answers single calls: limiting is still on.
        let d = limiter.check(["a"], 1).await.unwrap();
        assert_eq!(d.enforcement, tollgate::Enforcement::Shared, "{what}");
    }
}

/// A timeout of `Duration::MAX` (no timeout, as `tokio::time::timeout` takes it) serves a
/// batch as it serves a single call, rather than overflowing the deadline.
#[tokio::test]
async fn a_batch_takes_an_unbounded_timeout() {
    let policy = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
    let limiter = Limiter::builder("unbounded", policy)
        .store(Arc::new(LocalStore::new()))
        .timeout(Duration::MAX)
        .failure_mode(FailureMode::Closed)
        .build()
        .unwrap();
    assert!(limiter.check(["a"], 1).await.unwrap().allowed);
    let keys: Vec<Key> = ["a", "b"]
        .iter()
        .map(|k| limiter.key([k]).unwrap())
        .collect();
    let out = limiter.check_many(&keys, 1).await.unwrap();
    assert!(out.iter().all(|r| r.as_ref().unwrap().allowed), "{out:?}");
}

/// A batch that fails as a whole counts every key it was asked for in the decision metrics,
/// including keys the deny cache would have answered (they are refused with the rest).
#[test]
fn a_batch_failing_whole_counts_every_key_even_the_cached_ones() {
    let (_, snapshotter, _) = flood::run(|| async {
        // A token bucket refilling one token an hour: the second check is denied whatever the
        // time (an hour's fixed window, aligned to the epoch on the local store's real clock,
        // restarted at the top of the hour and admitted it in a run that crossed it).
        let policy = Policy::token_bucket(1, Rate::new(1, Duration::from_secs(3600))).unwrap();
        let limiter = Limiter::builder("broken", policy)
            .store(Arc::new(OddBatches::new(Batches::Broken)))
            .failure_mode(FailureMode::Closed)
            .deny_cache(10)
            .build()
            .unwrap();
        assert!(limiter.check(["a"], 1).await.unwrap().allowed);
        assert!(
            !limiter.check(["a"], 1).await.unwrap().allowed,
            "now cached"
        );
        let keys: Vec<Key> = ["a", "b", "c"]
            .iter()
            .map(|k| limiter.key([k]).unwrap())
            .collect();
        let out = limiter.check_many(&keys, 1).await;
        assert!(matches!(out, Err(Error::Store(_))), "{out:?}");
    });
    let counter = flood::counters(&snapshotter);
    assert_eq!(
        counter("tollgate_decisions_total", ("outcome", "error")),
        Some(3),
        "one per key asked for"
    );
}

/// A batch that the store answers in part — some requests decided, the others failing as
/// unavailable (one cluster node down) — shows the store is there: "one answer is enough"
/// (limiter.rs, `decide_many`). The breaker must not count such batches as outages, else a
/// single dead node opens the breaker and every key, on the healthy nodes too, loses shared
/// enforcement.
mod partly_answered_batches {

    use std::sync::Arc;
    use std::time::Duration;

    use async_trait::async_trait;
    use tollgate::{
        Acquire, Batch, BreakerState, Decision, Enforcement, FailureMode, Key, Limiter, LocalStore,
        Policy, Rate, Store, StoreError,
    };

    /// A `LocalStore` whose batches decide the first request and fail every other one as
    /// unavailable.
    struct HalfDown(LocalStore);

    #[async_trait]
    impl Store for HalfDown {
        async fn acquire(
            &self,
            key: &Key,
            policy: &Policy,
            cost: u64,
        ) -> Result<Decision, StoreError> {
            self.0.acquire(key, policy, cost).await
        }

        async fn acquire_many(&self, requests: &[Acquire<'_>]) -> Result<Batch, StoreError> {
            let mut out = self.0.acquire_many(&requests[..1]).await?;
            for _ in 1..requests.len() {
                out.push(Err(StoreError::Unavailable {
                    message: "node down".into(),
                    source: None,
                }));
            }
            Ok(out)
        }

        async fn peek(
            &self,
            key: &Key,
            policy: &Policy,
            cost: u64,
        ) -> Result<Decision, StoreError> {
            self.0.peek(key, policy, cost).await
        }

        async fn reset(&self, key: &Key, policy: &Policy) -> Result<(), StoreError> {
            self.0.reset(key, policy).await
        }
    }

    #[tokio::test]
    async fn a_partly_answered_batch_does_not_open_the_breaker() {
        let policy = Policy::token_bucket(100, Rate::new(1, Duration::from_secs(3600))).unwrap();
        let limiter = Limiter::builder("half-down", policy)
            .store(Arc::new(HalfDown(LocalStore::new())))
            .failure_mode(FailureMode::Open)
            .build()
            .unwrap();
        let keys = [limiter.key(["up"]).unwrap(), limiter.key(["down"]).unwrap()];
        // Twice the default failure threshold (5) of consecutive partly answered batches.
        for i in 0..10 {
            let got = limiter.check_many(&keys, 1).await.unwrap();
            let up = got[0].as_ref().unwrap();
            assert_eq!(
                up.enforcement,
                Enforcement::Shared,
                "batch {i}: the answered key keeps shared enforcement: {got:?}"
            );
            assert_eq!(up.remaining, 99 - i, "batch {i}");
            assert_eq!(got[1].as_ref().unwrap().enforcement, Enforcement::Bypassed);
            assert_eq!(limiter.breaker_state(), BreakerState::Closed, "batch {i}");
        }
    }
}
