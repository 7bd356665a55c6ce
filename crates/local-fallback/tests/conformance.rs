//! The conformance suite against `LocalStore` on a `ManualClock`.

use tollgate_core::ManualClock;
use tollgate_local::LocalStore;
use tollgate_testkit::conformance::{self, Harness};

struct LocalHarness {
    clock: ManualClock,
    store: LocalStore<ManualClock>,
}

impl LocalHarness {
    fn new() -> Self {
        let clock = ManualClock::new(conformance::T0);
        Self {
            store: LocalStore::with_clock(clock.clone()),
            clock,
        }
    }
}

#[async_trait::async_trait]
impl Harness for LocalHarness {
    type Store = LocalStore<ManualClock>;

    fn store(&self) -> &Self::Store {
        &self.store
    }

    async fn set_time(&self, micros: u64) {
        self.clock.set(micros);
    }
}

tollgate_testkit::conformance_tests!(async { LocalHarness::new() });

/// Every case, in turn, on one shared store: the namespaces keep them apart.
#[tokio::test]
async fn all_cases_share_one_store() {
    let h = LocalHarness::new();
    conformance::run_all(&h).await;
    assert!(!h.store.is_empty());
}
