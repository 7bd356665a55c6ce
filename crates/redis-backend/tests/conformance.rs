//! The conformance suite against RedisStore, on a redis-server whose clock the harness
//! freezes and moves.

mod common;

use async_trait::async_trait;
use common::Server;
use tollgate_redis::RedisStore;
use tollgate_testkit::conformance::{self, Harness};

struct RedisHarness {
    server: Server,
    store: RedisStore,
}

impl RedisHarness {
    async fn start() -> Self {
        let server = Server::start_with_clock();
        server.set_time(conformance::T0);
        let store = server.multiplexed().await;
        Self { server, store }
    }

    async fn start_pooled() -> Self {
        let server = Server::start_with_clock();
        server.set_time(conformance::T0);
        let store = server.pooled(4).await;
        Self { server, store }
    }
}

#[async_trait]
impl Harness for RedisHarness {
    type Store = RedisStore;

    fn store(&self) -> &RedisStore {
        &self.store
    }

    async fn set_time(&self, micros: u64) {
        self.server.set_time(micros);
    }
}

tollgate_testkit::conformance_tests!(RedisHarness::start());

/// Every case, in turn, on one pooled store: the namespaces keep them apart.
#[tokio::test]
async fn all_cases_share_one_pooled_store() {
    let h = RedisHarness::start_pooled().await;
    conformance::run_all(&h).await;
}
