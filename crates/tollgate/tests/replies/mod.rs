//! Shared by the tests of a real redis-server's error replies (`server_replies.rs`,
//! `oom_warning.rs`): a limiter on a store of a testkit server, and how its calls are checked.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use tollgate::redis::RedisStore;
use tollgate::{
    BreakerState, Decision, Enforcement, Error, ErrorClass, FailureMode, Limiter, Policy, Rate,
};
use tollgate_testkit::server::RedisServer;

use crate::common::limiter_with_breaker;

pub const DEADLINE: Duration = Duration::from_millis(300);
/// A call takes its deadline plus scheduling slack on a loaded 2-core machine, never more.
pub const CALL_BOUND: Duration = Duration::from_secs(2);
/// How long the server may take to serve again once its state is cleared.
pub const RECOVERY_BOUND: Duration = Duration::from_secs(10);

pub fn policy() -> Policy {
    Policy::token_bucket(20, Rate::new(1, Duration::from_secs(3600))).unwrap()
}

pub fn modes() -> [FailureMode; 3] {
    [
        FailureMode::Open,
        FailureMode::Closed,
        FailureMode::degraded(4),
    ]
}

pub async fn limiter(server: &RedisServer, mode: FailureMode) -> Limiter {
    let store = RedisStore::builder(server.url())
        .timeout(DEADLINE)
        .build()
        .await
        .expect("store");
    limiter_with_breaker("replies", policy(), store, mode, DEADLINE)
}

pub fn admin(server: &RedisServer, args: &[&str]) {
    redis::cmd(args[0])
        .arg(&args[1..])
        .exec(&mut server.client().get_connection().unwrap())
        .unwrap();
}

/// Makes `server` refuse writes with `OOM`: `maxmemory` 1 byte under `noeviction`.
pub fn refuse_writes(server: &RedisServer) {
    admin(server, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    admin(server, &["CONFIG", "SET", "maxmemory", "1"]);
}

pub async fn timed(limiter: &Limiter, who: &str) -> Result<Decision, Error> {
    crate::common::timed_within(limiter, who, CALL_BOUND).await
}

/// `n` calls while the server refuses: each is the failure mode's answer (never a shared
/// denial, never a script error), and the breaker is open after them.
pub async fn refused_calls(limiter: &Limiter, who: &str, n: usize, label: &str) {
    let mode = limiter.failure_mode().as_str();
    for i in 0..n {
        let out = timed(limiter, who).await;
        match (mode, &out) {
            ("open", Ok(d)) if d.allowed && d.enforcement == Enforcement::Bypassed => {}
            ("closed", Err(Error::Unavailable { source, .. }))
                if source.class() == ErrorClass::Unavailable => {}
            ("degraded", Ok(d)) if d.enforcement == Enforcement::Degraded => {}
            _ => panic!("{label}, {mode}, call {i}: {out:?}"),
        }
    }
    assert_eq!(
        limiter.breaker_state(),
        BreakerState::Open,
        "{label}, {mode}"
    );
}

/// Polls (every 20 ms, at most `RECOVERY_BOUND`) until a call is decided by the shared store.
pub async fn recovers(limiter: &Limiter, who: &str, label: &str) {
    let started = Instant::now();
    for _ in 0..500 {
        if let Ok(d) = timed(limiter, who).await
            && d.enforcement == Enforcement::Shared
        {
            assert_eq!(limiter.breaker_state(), BreakerState::Closed, "{label}");
            return;
        }
        assert!(
            started.elapsed() < RECOVERY_BOUND,
            "{label}: no shared decision"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{label}: no shared decision in 500 calls");
}
