//! A batch whose requests fail with different classes warns once per class. Alone in its test
//! binary: a thread-scoped subscriber misses events whose callsite another test's thread
//! registers first (tracing's callsite interest is process-wide).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tollgate::{
    Acquire, Batch, Decision, Error, FailureMode, Key, Limiter, LocalStore, Policy, Store,
    StoreError,
};

/// A `LocalStore` whose batches fail request by request: the first at its key cap, the others
/// unavailable (a store some of whose servers are down).
struct MixedFailures {
    inner: LocalStore,
}

#[async_trait]
impl Store for MixedFailures {
    async fn acquire(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.inner.acquire(key, policy, cost).await
    }

    async fn acquire_many(&self, requests: &[Acquire<'_>]) -> Result<Batch, StoreError> {
        Ok((0..requests.len())
            .map(|i| {
                Err(if i == 0 {
                    StoreError::KeyCapReached { cap: 1 }
                } else {
                    StoreError::Unavailable {
                        message: "node down".into(),
                        source: None,
                    }
                })
            })
            .collect())
    }

    async fn peek(&self, key: &Key, policy: &Policy, cost: u64) -> Result<Decision, StoreError> {
        self.inner.peek(key, policy, cost).await
    }

    async fn reset(&self, key: &Key, policy: &Policy) -> Result<(), StoreError> {
        self.inner.reset(key, policy).await
    }
}

/// The outage in a batch is warned about as an outage, with its own count (and its own
/// thinning), whatever failed first in it. The batch's failures were counted under the first one's class: a key-cap
/// refusal first made the two unavailable requests one "cannot hold a new key" line (requests
/// 3), and in the next batch, within the key-cap line's 10 s, no line at all.
#[test]
fn a_batch_warns_once_per_class_of_failure() {
    let (logs, _guard) = tollgate_testkit::logs::capture();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let policy = Policy::fixed_window(10, Duration::from_secs(60)).unwrap();
        let limiter = Limiter::builder("mixed", policy)
            .store(Arc::new(MixedFailures {
                inner: LocalStore::new(),
            }))
            .failure_mode(FailureMode::Closed)
            .build()
            .unwrap();
        let keys: Vec<_> = (0..3)
            .map(|i| limiter.key([format!("k{i}")]).unwrap())
            .collect();
        for _ in 0..2 {
            let results = limiter.check_many(&keys, 1).await.unwrap();
            assert_eq!(results.len(), 3);
            assert!(
                results
                    .iter()
                    .all(|r| matches!(r, Err(Error::Unavailable { .. }))),
                "{results:?}"
            );
        }
    });
    // Thinned as the key-cap line is (one per 10 s per class: a partial outage never opens
    // the breaker, `outage_logs.rs`): the first batch's line, with its own count.
    let outages = logs.matching(&["store unavailable; applying failure mode"]);
    assert_eq!(outages.len(), 1, "thinned: {}", logs.text());
    assert!(
        outages[0].contains("class=\"unavailable\"")
            && outages[0].contains("requests=2")
            && outages[0].contains("suppressed=0"),
        "{}",
        outages[0]
    );
    let capacity = logs.matching(&["cannot hold a new key"]);
    assert_eq!(capacity.len(), 1, "thinned: {}", logs.text());
    assert!(capacity[0].contains("requests=1"), "{}", capacity[0]);
}
