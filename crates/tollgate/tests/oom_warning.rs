//! The warning a limiter writes when a real redis-server refuses its write with `OOM`
//! (`maxmemory` reached under `noeviction`) names the reply. Alone in its test binary: a
//! thread-scoped subscriber misses events whose callsite another test's thread registers first
//! (tracing's callsite interest is process-wide).

mod common;
mod replies;

use replies::{admin, limiter, modes, recovers, refuse_writes, refused_calls, timed};
use tollgate::Enforcement;
use tollgate_testkit::server::RedisServer;

/// `maxmemory` reached under `noeviction`: the script's write is refused with `OOM`. Before,
/// the warning said only "store unavailable: Redis: extension error" (redis-rs's category for
/// a reply code it does not know), so an operator could not tell an out-of-memory Redis from a
/// failed snapshot (`MISCONF`) or missing replicas (`NOREPLICAS`).
#[tokio::test]
async fn the_warning_for_an_oom_reply_names_it() {
    let (logs, _guard) = tollgate_testkit::logs::capture();
    for mode in modes() {
        let server = RedisServer::start();
        let limiter = limiter(&server, mode).await;
        let label = limiter.failure_mode().as_str();
        assert_eq!(
            timed(&limiter, "o").await.unwrap().enforcement,
            Enforcement::Shared
        );
        refuse_writes(&server);
        refused_calls(&limiter, "o", 3, "OOM").await;
        let lines = logs.matching(&[
            "rate limiter store unavailable; applying failure mode",
            &format!("mode=\"{label}\""),
            "class=\"unavailable\"",
        ]);
        assert!(!lines.is_empty(), "{label}: no warning in {}", logs.text());
        assert!(
            lines.iter().all(|l| l.contains("OOM")),
            "{label}: the warning names the server's reply: {lines:#?}"
        );
        admin(&server, &["CONFIG", "SET", "maxmemory", "0"]);
        recovers(&limiter, "o", "OOM").await;
    }
}
