//! A real redis-server answering a limiter's calls with an error reply rather than a broken
//! connection: `OOM` (`maxmemory` reached under `noeviction`), `READONLY` (the server made a
//! replica by `REPLICAOF`) and `LOADING` (`DEBUG RELOAD` of a dataset loaded slowly). Each is an
//! outage of the shared store (it cannot make the decision now, and will again once the state
//! clears): the operation's failure mode applies, the breaker counts it, and shared enforcement
//! resumes by itself once the server is back to normal. What the warning says is checked in
//! `oom_warning.rs`, alone in its binary (tracing's callsite interest is process-wide). Bounded
//! and loopback only.

mod common;
mod replies;

use std::time::{Duration, Instant};

use replies::{
    RECOVERY_BOUND, admin, limiter, modes, recovers, refuse_writes, refused_calls, timed,
};
use tollgate::{Enforcement, FailureMode};
use tollgate_testkit::server::RedisServer;

/// `maxmemory` reached under `noeviction`: the script's write is refused with `OOM`, under
/// each mode; `maxmemory 0` ends it.
#[tokio::test]
async fn oom_takes_the_failure_mode_and_recovers() {
    for mode in modes() {
        let server = RedisServer::start();
        let limiter = limiter(&server, mode).await;
        assert_eq!(
            timed(&limiter, "o").await.unwrap().enforcement,
            Enforcement::Shared
        );
        refuse_writes(&server);
        refused_calls(&limiter, "o", 3, "OOM").await;
        admin(&server, &["CONFIG", "SET", "maxmemory", "0"]);
        recovers(&limiter, "o", "OOM").await;
    }
}

/// A batch that repeats a key goes as one transaction, which `OOM` refuses while queueing
/// (`EXECABORT`): nothing ran, so the whole batch takes the failure mode and nothing is spent.
#[tokio::test]
async fn an_oom_batch_repeating_a_key_runs_nothing_and_takes_the_failure_mode() {
    let server = RedisServer::start();
    let limiter = limiter(&server, FailureMode::Open).await;
    let key = limiter.key(["b"]).unwrap();
    assert_eq!(timed(&limiter, "b").await.unwrap().remaining, 19);
    refuse_writes(&server);
    let out = limiter
        .check_many(&[key.clone(), key.clone()], 1)
        .await
        .unwrap();
    assert!(
        out.iter().all(|d| d
            .as_ref()
            .is_ok_and(|d| d.enforcement == Enforcement::Bypassed)),
        "{out:?}"
    );
    admin(&server, &["CONFIG", "SET", "maxmemory", "0"]);
    let d = timed(&limiter, "b").await.unwrap();
    assert_eq!(
        (d.enforcement, d.remaining),
        (Enforcement::Shared, 18),
        "nothing was spent"
    );
}

/// The server made a replica (`REPLICAOF`) while decisions run: the script's write is refused
/// with `READONLY`; `REPLICAOF NO ONE` makes it a primary again and shared enforcement resumes.
#[tokio::test]
async fn readonly_takes_the_failure_mode_and_recovers() {
    for mode in modes() {
        let server = RedisServer::start();
        let primary = RedisServer::start();
        let limiter = limiter(&server, mode).await;
        assert_eq!(
            timed(&limiter, "r").await.unwrap().enforcement,
            Enforcement::Shared
        );
        admin(
            &server,
            &["REPLICAOF", "127.0.0.1", &primary.port().to_string()],
        );
        refused_calls(&limiter, "r", 3, "READONLY").await;
        admin(&server, &["REPLICAOF", "NO", "ONE"]);
        recovers(&limiter, "r", "READONLY").await;
    }
}

/// `DEBUG RELOAD` of 20,000 keys loaded 100 µs each (`key-load-delay`), the server serving
/// other clients every 1 KiB loaded: they get `LOADING` for about 2 s, then the dataset back.
#[tokio::test]
async fn loading_takes_the_failure_mode_and_recovers() {
    for mode in modes() {
        let server = RedisServer::builder()
            .extra_args([
                "--enable-debug-command",
                "yes",
                "--loading-process-events-interval-bytes",
                "1024",
            ])
            .start();
        let limiter = limiter(&server, mode).await;
        assert_eq!(
            timed(&limiter, "l").await.unwrap().enforcement,
            Enforcement::Shared
        );
        admin(&server, &["DEBUG", "POPULATE", "20000"]);
        admin(&server, &["CONFIG", "SET", "key-load-delay", "100"]);
        let mut conn = server.client().get_connection().unwrap();
        let reload = std::thread::spawn(move || redis::cmd("DEBUG").arg("RELOAD").exec(&mut conn));
        let mut probe = server.client().get_connection().unwrap();
        let started = Instant::now();
        while !redis::cmd("PING")
            .query::<String>(&mut probe)
            .is_err_and(|e| e.code() == Some("LOADING"))
        {
            assert!(started.elapsed() < RECOVERY_BOUND, "never LOADING");
            std::thread::sleep(Duration::from_millis(2));
        }
        refused_calls(&limiter, "l", 3, "LOADING").await;
        reload.join().unwrap().expect("DEBUG RELOAD");
        admin(&server, &["CONFIG", "SET", "key-load-delay", "0"]);
        recovers(&limiter, "l", "LOADING").await;
    }
}
