//! Checks shared by the tests that flood a limiter with new keys at a key cap: the line that
//! reports it is written boundedly, and the metrics count every occurrence.

use std::time::{Duration, Instant};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tollgate_testkit::logs::Captured;

/// Runs `flood` on a current-thread runtime with this thread's log lines captured and a local
/// metrics recorder: the lines, the recorder's snapshotter, and how long the flood took.
pub fn run<F: Future<Output = ()>>(flood: impl FnOnce() -> F) -> (Captured, Snapshotter, Duration) {
    let (lines, _logs) = tollgate_testkit::logs::capture();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    metrics::with_local_recorder(&recorder, || runtime.block_on(flood()));
    (lines, snapshotter, started.elapsed())
}

/// `logged` (the lines that report the flood) holds one line, plus at most one per 10 s the
/// run took, and the first counts nothing held back before it.
pub fn assert_logged_boundedly(what: &str, logged: &[String], flood: usize, elapsed: Duration) {
    eprintln!(
        "{} {what} line(s) for {flood} occurrences in {elapsed:?}",
        logged.len()
    );
    for l in logged {
        eprintln!("  {l}");
    }
    let bound = 1 + elapsed.as_secs().div_ceil(10) as usize;
    assert!(
        !logged.is_empty() && logged.len() <= bound,
        "{} lines, bound {bound}",
        logged.len()
    );
    assert!(logged[0].contains("suppressed=0"), "{}", logged[0]);
}

/// One snapshot of the recorder (taking one resets its counters), as a lookup of the counter
/// `name` with the label `label`.
pub fn counters(snapshotter: &Snapshotter) -> impl Fn(&str, (&str, &str)) -> Option<u64> {
    let snapshot = snapshotter.snapshot().into_vec();
    move |name, label| {
        snapshot.iter().find_map(|(key, _, _, value)| {
            let key = key.key();
            let matches = key.name() == name && key.labels().any(|l| (l.key(), l.value()) == label);
            match (matches, value) {
                (true, DebugValue::Counter(n)) => Some(*n),
                _ => None,
            }
        })
    }
}
