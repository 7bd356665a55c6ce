//! A local store used as the primary store, at its key cap, meeting a flood of new keys: the
//! breaker does not count the refusals, so the limiter bounds their warning itself. Alone in
//! its test binary: a thread-scoped subscriber misses events whose callsite another test's
//! thread registers first (tracing's callsite interest is process-wide).

mod capped;
mod flood;

use tollgate::{Enforcement, FailureMode};

use capped::{CAP, limiter};

/// The breaker does not count key-cap refusals, so nothing else bounds their warning: a flood
/// of new keys gets one line per interval (10 s), not one per request, while the metrics count
/// every refusal.
#[test]
fn a_new_key_flood_at_the_cap_is_logged_boundedly_and_counted_fully() {
    const FLOOD: usize = 1000;
    let (lines, snapshotter, elapsed) = flood::run(async || {
        let limiter = limiter(FailureMode::Open);
        for i in 0..CAP {
            limiter.check([format!("held{i}")], 1).await.unwrap();
        }
        for i in 0..FLOOD {
            let d = limiter.check([format!("new{i}")], 1).await.unwrap();
            assert_eq!(d.enforcement, Enforcement::Bypassed);
        }
    });

    let logged = lines.matching(&["cannot hold a new key"]);
    flood::assert_logged_boundedly("warning", &logged, FLOOD, elapsed);

    let counter = flood::counters(&snapshotter);
    assert_eq!(
        counter("tollgate_store_errors_total", ("class", "capacity")),
        Some(FLOOD as u64)
    );
    assert_eq!(
        counter("tollgate_decisions_total", ("enforcement", "bypassed")),
        Some(FLOOD as u64)
    );
}
