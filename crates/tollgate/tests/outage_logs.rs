//! A partial outage — a store that answers between its failures, as a Redis Cluster with one
//! shard down answers the keys of the others — never opens the circuit breaker (its threshold
//! counts failures in a row: `failures_separated_by_answers_never_open_the_breaker`), so the
//! breaker cannot bound the outage warnings: they are thinned to one line per 10 s per class,
//! each counting the failures held back before it, while the metrics count every one. Alone
//! in its test binary (tracing's callsite interest is process-wide).

mod flood;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tollgate::{
    Decision, Enforcement, FailureMode, Key, Limiter, LocalStore, Policy, Rate, Store, StoreError,
};

/// Fails every other acquire, as unavailable or as busy in turn; the others go to a local
/// store.
struct EveryOther {
    inner: LocalStore,
    n: AtomicU64,
}

#[async_trait::async_trait]
impl Store for EveryOther {
    async fn acquire(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        match self.n.fetch_add(1, Ordering::SeqCst) % 4 {
            1 => Err(StoreError::Unavailable {
                message: "shard down".into(),
                source: None,
            }),
            3 => Err(StoreError::Busy("BUSY a script is running".into())),
            _ => self.inner.acquire(key, policy, cost).await,
        }
    }
    async fn peek(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.inner.peek(key, policy, cost).await
    }
    async fn reset(&self, key: &Key, policy: &Policy) -> Result<(), StoreError> {
        self.inner.reset(key, policy).await
    }
}

#[test]
fn a_partial_outage_is_logged_boundedly_per_class() {
    const CALLS: usize = 2_000;
    let (lines, snapshotter, elapsed) = flood::run(async || {
        let limiter = Limiter::builder(
            "partial",
            Policy::token_bucket(1_000_000, Rate::per_second(1)).unwrap(),
        )
        .store(Arc::new(EveryOther {
            inner: LocalStore::new(),
            n: AtomicU64::new(0),
        }))
        .failure_mode(FailureMode::Open)
        .build()
        .unwrap();
        for i in 0..CALLS {
            let d = limiter.check([format!("k{i}")], 1).await.unwrap();
            assert!(d.allowed);
            let want = if i % 2 == 1 {
                Enforcement::Bypassed
            } else {
                Enforcement::Shared
            };
            assert_eq!(d.enforcement, want, "call {i}");
        }
    });
    let counter = flood::counters(&snapshotter);
    for class in ["unavailable", "busy"] {
        assert_eq!(
            counter("tollgate_store_errors_total", ("class", class)),
            Some((CALLS / 4) as u64),
            "every {class} failure is counted"
        );
        let logged = lines.matching(&[
            "store unavailable; applying failure mode",
            &format!("class=\"{class}\""),
        ]);
        flood::assert_logged_boundedly(class, &logged, CALLS / 4, elapsed);
    }
}
