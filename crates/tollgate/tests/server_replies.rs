//! A real redis-server answering a limiter's calls with an error reply rather than a broken
//! connection: `OOM` (`maxmemory` reached under `noeviction`), `READONLY` (the server made a
//! replica by `REPLICAOF`) and `LOADING` (`DEBUG RELOAD` of a dataset loaded slowly). Each is an
//! outage of the shared store (it cannot make the decision now, and will again once the state
//! clears): the operation's failure mode applies, the breaker counts it, and shared enforcement
//! resumes by itself once the server is back to normal. What the warning says is checked in
//! `oom_warning.rs`, alone in its binary (tracing's callsite interest is process-wide). Bounded
//! and loopback only. Also a `SELECT` refused while connecting to a numbered database (`BUSY`,
//! `NOAUTH`), which redis-rs reports without the reply's code.

mod common;
mod replies;

use std::sync::Arc;
use std::time::{Duration, Instant};

use replies::{
    RECOVERY_BOUND, admin, limiter, modes, recovers, refuse_writes, refused_calls, timed,
};
use tollgate::redis::RedisStore;
use tollgate::{Enforcement, Error, FailureMode, Limiter, Policy, Rate};
use tollgate_testkit::busy::BusyScript;
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

/// A batch that repeats a key sends that key's requests as one transaction, which `OOM` refuses while queueing
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

/// A fail-open limiter on a store at `url` (300 ms per call), for the `SELECT` tests below.
async fn select_limiter(url: String, name: &str) -> Limiter {
    let store = RedisStore::builder(url)
        .timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    Limiter::builder(name, Policy::token_bucket(20, Rate::per_second(1)).unwrap())
        .store(Arc::new(store))
        .failure_mode(FailureMode::Open)
        .build()
        .unwrap()
}

/// A store whose URL names database 1 (a documented URL form: `redis://host:port/db`) makes
/// a connection while another client's script runs past `busy-reply-threshold` (the pool grows
/// under load, or replaces a connection the server closed while idle). redis-rs sends `SELECT 1`
/// on connect, the server refuses it with `BUSY`, and redis-rs reports "Redis server refused to
/// switch database" as a plain `ERR` reply. DESIGN: BUSY → busy, which triggers the failure
/// mode; it was classified as a script error (a bug, reported loudly), so a fail-open limiter
/// returned `Error::Store` instead of admitting the request as bypassed.
#[tokio::test]
async fn busy_met_while_connecting_to_a_numbered_db_takes_the_failure_mode() {
    for db in [0, 1] {
        let server = RedisServer::builder()
            .extra_args(["--busy-reply-threshold", "50"])
            .start();
        let limiter = select_limiter(format!("{}/{db}", server.url()), "busy").await;
        assert_eq!(
            limiter.check(["k"], 1).await.unwrap().enforcement,
            Enforcement::Shared
        );
        // The server closes the store's idle connections; over RESP3 the store hears of it and
        // makes a fresh one for the next call.
        server.kill_clients();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let busy = BusyScript::start(&server.client());
        let out = limiter.check(["k"], 1).await;
        busy.stop();
        match out {
            Ok(d) => assert_eq!(d.enforcement, Enforcement::Bypassed, "db {db}: {d:?}"),
            Err(Error::Store(e)) => panic!(
                "db {db}: a busy server met while connecting is a script error ({:?}), not busy: {e}",
                e.class()
            ),
            Err(e) => panic!("db {db}: {e}"),
        }
    }
}

/// docs/failure-modes.md: a refused or missing password (`NOAUTH`, …) is a script error whose
/// "message says the authentication failed". Over RESP2 (`?protocol=resp2`, documented) with a
/// database in the URL, redis-rs sends no AUTH (no password) and `SELECT 1`, which the server
/// refuses with `NOAUTH`; redis-rs reports it as "Redis server refused to switch database", and
/// the store's message never says authentication failed nor where the credentials go.
#[tokio::test]
async fn a_missing_password_met_by_select_says_the_authentication_failed() {
    let server = RedisServer::start();
    let limiter = select_limiter(format!("{}/1?protocol=resp2", server.url()), "auth").await;
    assert!(limiter.check(["k"], 1).await.unwrap().allowed);
    let mut admin = server.client().get_connection().unwrap();
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("sekret")
        .query(&mut admin)
        .unwrap();
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query(&mut admin)
        .unwrap();
    // Over RESP2 the store cannot hear of the close: the first call may fail as a dropped
    // connection; the ones after it reconnect and meet the missing password.
    let mut last = None;
    for _ in 0..5 {
        last = Some(limiter.check(["k"], 1).await);
        if matches!(last, Some(Err(Error::Store(_)))) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match last.unwrap() {
        Err(Error::Store(e)) => {
            let message = e.to_string();
            assert!(
                message.contains("authentication failed"),
                "a missing password is reported without saying so: {message}"
            );
        }
        other => panic!("expected a loud store error, got {other:?}"),
    }
}
