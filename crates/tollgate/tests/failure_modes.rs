//! Each failure mode against real redis-server failures: killed, restarted, paused, busy, and a
//! script error that must surface loudly instead of switching modes. Bounded and loopback only.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::limiter_with_breaker;
use tollgate::redis::RedisStore;
use tollgate::{
    BreakerConfig, BreakerState, Enforcement, Error, ErrorClass, FailureMode, Limiter, LocalStore,
    ManualClock, Policy, Rate,
};
use tollgate_testkit::proxy::FaultProxy;
use tollgate_testkit::server::RedisServer;

const DEADLINE: Duration = Duration::from_millis(150);
/// A call may take its deadline plus scheduling slack on a loaded 2-core machine, never more.
const CALL_BOUND: Duration = Duration::from_millis(1_000);

fn policy() -> Policy {
    Policy::token_bucket(20, Rate::per_second(1)).unwrap()
}

async fn limiter(server: &RedisServer, mode: FailureMode) -> Limiter {
    let store = RedisStore::builder(server.url())
        .timeout(DEADLINE)
        .build()
        .await
        .expect("store");
    limiter_with_breaker("fault", policy(), store, mode, DEADLINE)
}

/// Calls `check` once, asserting it returns within the bound.
async fn timed(limiter: &Limiter, who: &str) -> Result<tollgate::Decision, Error> {
    common::timed_within(limiter, who, CALL_BOUND).await
}

/// Polls until the limiter answers with shared enforcement again; returns how long it took.
async fn recovery(limiter: &Limiter, who: &str, bound: Duration) -> Duration {
    let started = Instant::now();
    loop {
        if let Ok(d) = timed(limiter, who).await
            && d.enforcement == Enforcement::Shared
        {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < bound,
            "no shared enforcement within {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn killed_then_restarted_under_each_mode() {
    for mode in ["open", "closed", "degraded"] {
        let mut server = RedisServer::start();
        let failure_mode = match mode {
            "open" => FailureMode::Open,
            "closed" => FailureMode::Closed,
            _ => FailureMode::degraded(4),
        };
        let limiter = limiter(&server, failure_mode).await;
        let d = timed(&limiter, "u").await.unwrap();
        assert_eq!((d.enforcement, d.remaining), (Enforcement::Shared, 19));

        server.kill();
        let mut outcomes = Vec::new();
        for _ in 0..10 {
            outcomes.push(timed(&limiter, "u").await);
        }
        assert_eq!(
            limiter.breaker_state(),
            BreakerState::Open,
            "{mode}: breaker opened"
        );
        for out in &outcomes {
            match (mode, out) {
                ("open", Ok(d)) => assert!(d.allowed && d.enforcement == Enforcement::Bypassed),
                ("closed", Err(Error::Unavailable { source, .. })) => {
                    assert_eq!(source.class(), ErrorClass::Unavailable);
                }
                ("degraded", Ok(d)) => assert_eq!(d.enforcement, Enforcement::Degraded),
                _ => panic!("{mode}: unexpected outcome {out:?}"),
            }
        }
        if mode == "degraded" {
            // The local share is 20 / 4 = 5: the 10 calls above admitted exactly 5.
            let admitted = outcomes
                .iter()
                .filter(|o| o.as_ref().is_ok_and(|d| d.allowed))
                .count();
            assert_eq!(
                admitted, 5,
                "degraded local quota is the shared one divided by 4"
            );
        }

        // Restart: empty script cache (NOSCRIPT absorbed), shared enforcement resumes.
        server.restart();
        let took = recovery(&limiter, "u", Duration::from_secs(5)).await;
        eprintln!("{mode}: shared enforcement resumed {took:?} after restart");
        assert_eq!(limiter.breaker_state(), BreakerState::Closed);
    }
}

#[tokio::test]
async fn a_paused_server_hits_the_deadline_and_recovers() {
    let mut server = RedisServer::start();
    let limiter = limiter(&server, FailureMode::Open).await;
    assert_eq!(
        timed(&limiter, "p").await.unwrap().enforcement,
        Enforcement::Shared
    );
    server.pause();
    let started = Instant::now();
    let d = timed(&limiter, "p").await.unwrap();
    assert_eq!(d.enforcement, Enforcement::Bypassed);
    assert!(
        started.elapsed() >= DEADLINE,
        "the deadline fired, not an error"
    );
    server.resume();
    recovery(&limiter, "p", Duration::from_secs(5)).await;
}

#[tokio::test]
async fn busy_server_takes_the_failure_mode() {
    let server = RedisServer::builder()
        .extra_args(["--busy-reply-threshold", "50"])
        .start();
    let limiter = limiter(&server, FailureMode::Closed).await;
    let busy = tollgate_testkit::busy::BusyScript::start(&server.client());
    match timed(&limiter, "b").await {
        Err(Error::Unavailable { source, .. }) => assert_eq!(source.class(), ErrorClass::Busy),
        other => panic!("expected a busy store under Closed, got {other:?}"),
    }
    busy.stop();
    recovery(&limiter, "b", Duration::from_secs(5)).await;
}

#[tokio::test]
async fn a_script_error_is_loud_and_does_not_switch_modes() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().await.unwrap();
    let limiter = limiter(&server, FailureMode::Open).await;
    let key = limiter.key(["wrongtype"]).unwrap();
    // Another program wrote a hash where the bucket lives: the script fails (WRONGTYPE).
    let () = redis::cmd("HSET")
        .arg(store.redis_key(&key, &policy()))
        .arg("f")
        .arg("v")
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    for _ in 0..5 {
        match limiter.check_key(&key, 1).await {
            Err(Error::Store(e)) => assert_eq!(e.class(), ErrorClass::Script),
            other => panic!("a script error must surface, not fail open: {other:?}"),
        }
    }
    assert_eq!(
        limiter.breaker_state(),
        BreakerState::Closed,
        "a bug is not an outage"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_record_decisions_errors_and_breaker_state() {
    let mut server = RedisServer::start();
    let ((), snapshot) = recorded(async {
        let limiter = limiter(&server, FailureMode::Open).await;
        timed(&limiter, "m").await.unwrap();
        server.kill();
        for _ in 0..4 {
            timed(&limiter, "m").await.unwrap();
        }
    });
    let find = |name: &str, labels: &[(&str, &str)]| metric(&snapshot, name, labels);
    assert_eq!(
        find(
            "tollgate_decisions_total",
            &[("outcome", "allowed"), ("enforcement", "shared")]
        ),
        Some(1.0)
    );
    assert_eq!(
        find(
            "tollgate_decisions_total",
            &[("outcome", "allowed"), ("enforcement", "bypassed")]
        ),
        Some(4.0)
    );
    assert!(
        find("tollgate_store_errors_total", &[("class", "unavailable")]).is_some_and(|n| n >= 3.0)
    );
    assert_eq!(
        find("tollgate_breaker_state", &[("operation", "fault")]),
        Some(1.0)
    );
    assert_eq!(find("tollgate_decision_seconds", &[]), Some(5.0));
}

/// A limiter built for an operation whose last limiter was dropped with its breaker open (a
/// store rebuilt after an outage, a policy file read again) reports its own closed breaker. The
/// gauge is the operation's; it kept reading the old limiter's "open" (1) until the new breaker
/// moved, which a healthy store never makes it do, so an alert on it kept firing while every
/// decision was shared (found by a review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_limiters_breaker_gauge_reads_its_own_breaker() {
    let mut server = RedisServer::start();
    let ((), snapshot) = recorded(async {
        let old = one_strike_limiter(&server, Duration::from_secs(60), DEADLINE).await;
        server.kill();
        assert!(old.check(["k"], 1).await.is_err(), "fails closed");
        assert_eq!(old.breaker_state(), BreakerState::Open);
        drop(old);
        let new = Limiter::builder("strike", policy())
            .store(Arc::new(LocalStore::new()))
            .failure_mode(FailureMode::Closed)
            .build()
            .unwrap();
        let d = new.check(["k"], 1).await.unwrap();
        assert_eq!(d.enforcement, Enforcement::Shared);
        assert_eq!(new.breaker_state(), BreakerState::Closed);
    });
    assert_eq!(
        metric(
            &snapshot,
            "tollgate_breaker_state",
            &[("operation", "strike")]
        ),
        Some(0.0),
        "the only live limiter of the operation has a closed breaker"
    );
}

/// The breaker gauge ends on the breaker's state whatever order concurrent transitions are
/// reported in. The caller that opened the breaker is held up while its warning is written (a
/// slow log sink); meanwhile, on another thread, the store answers again and a probe closes
/// the breaker. Each report used to write its own transition's `to` to the gauge, so the
/// delayed one wrote "open" last: the breaker closed, the gauge at 1 for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_gauge_ends_on_the_breaker_state_when_reports_race() {
    use metrics_util::debugging::DebuggingRecorder;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tollgate::BreakerConfig;

    let server = RedisServer::start();
    let proxy = Arc::new(FaultProxy::start(server.port()));
    let store = RedisStore::builder(proxy.url())
        .timeout(DEADLINE)
        .build()
        .await
        .expect("store");
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Metric handles are registered when the limiter is built: build it under the recorder.
    let limiter = metrics::with_local_recorder(&recorder, || {
        Limiter::builder("gauge", policy())
            .store(Arc::new(store))
            .failure_mode(FailureMode::Open)
            .timeout(DEADLINE)
            .breaker(BreakerConfig {
                failure_threshold: 1,
                probe_interval: Duration::ZERO,
            })
            .build()
            .unwrap()
    });
    let d = timed(&limiter, "g").await.unwrap();
    assert_eq!(d.enforcement, Enforcement::Shared);

    let fired = Arc::new(AtomicBool::new(false));
    let closed = Arc::new(AtomicBool::new(false));
    let hook = {
        let (limiter, proxy) = (limiter.clone(), Arc::clone(&proxy));
        let (fired, closed) = (Arc::clone(&fired), Arc::clone(&closed));
        let handle = tokio::runtime::Handle::current();
        move || {
            if fired.swap(true, Ordering::SeqCst) {
                return;
            }
            // Another caller, on another thread (its log lines go elsewhere), while this one
            // waits: the store answers again and calls go on until a probe closes the breaker.
            let recovered = close_from_another_thread(&limiter, &proxy, &handle);
            closed.store(recovered, Ordering::SeqCst);
        }
    };
    let writer = HookWriter(Arc::new(hook));
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    // The store goes away: the next call fails and opens the breaker (threshold 1).
    proxy.set_refuse(true);
    proxy.cut_all();
    let started = Instant::now();
    while !fired.load(Ordering::SeqCst) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the breaker never opened"
        );
        let _ = timed(&limiter, "g").await;
    }
    assert!(
        closed.load(Ordering::SeqCst),
        "a probe closed the breaker meanwhile"
    );
    assert_eq!(limiter.breaker_state(), BreakerState::Closed);
    let snapshot = snapshotter.snapshot().into_vec();
    assert_eq!(
        metric(
            &snapshot,
            "tollgate_breaker_state",
            &[("operation", "gauge")]
        ),
        Some(BreakerState::Closed.as_gauge()),
        "the gauge says what the breaker is (closed), not the last transition reported"
    );
}

/// A log sink that runs its hook while writing the line saying the breaker opened.
#[derive(Clone)]
struct HookWriter(Arc<dyn Fn() + Send + Sync>);
impl std::io::Write for HookWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let line = String::from_utf8_lossy(buf);
        if line.contains("changed state")
            && (line.contains("to=\"open\"") || line.contains("to=open"))
        {
            (self.0)();
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// On another thread, lets `proxy` connect again and calls `limiter` (on `handle`'s runtime)
/// until its breaker is closed, for at most 5 s; whether it closed.
fn close_from_another_thread(
    limiter: &Limiter,
    proxy: &Arc<FaultProxy>,
    handle: &tokio::runtime::Handle,
) -> bool {
    let (limiter, proxy, handle) = (limiter.clone(), Arc::clone(proxy), handle.clone());
    std::thread::spawn(move || {
        proxy.set_refuse(false);
        handle.block_on(async {
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(5) {
                let _ = limiter.check(["g"], 1).await;
                if limiter.breaker_state() == BreakerState::Closed {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            false
        })
    })
    .join()
    .unwrap_or(false)
}

/// A probe whose caller goes away (its future dropped by an outer timeout, as when a client
/// disconnects) must not leave the breaker half-open with nobody probing: the next caller
/// probes, and shared enforcement resumes once the server is back.
#[tokio::test]
async fn a_cancelled_probe_does_not_wedge_the_breaker() {
    let mut server = RedisServer::start();
    let limiter = limiter(&server, FailureMode::Open).await;
    timed(&limiter, "c").await.unwrap();
    server.pause();
    for _ in 0..3 {
        assert_eq!(
            timed(&limiter, "c").await.unwrap().enforcement,
            Enforcement::Bypassed
        );
    }
    assert_eq!(limiter.breaker_state(), BreakerState::Open);
    // Past the probe interval (100 ms), the next call is the probe; its caller gives up
    // before the paused server could answer.
    let started = Instant::now();
    loop {
        let probe = tokio::time::timeout(Duration::from_millis(20), limiter.check(["c"], 1)).await;
        if probe.is_err() {
            break; // the probe was in flight, and is now dropped
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no probe was let through"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_ne!(
        limiter.breaker_state(),
        BreakerState::HalfOpen,
        "an abandoned probe hands the probe on"
    );
    server.resume();
    recovery(&limiter, "c", Duration::from_secs(5)).await;
    assert_eq!(limiter.breaker_state(), BreakerState::Closed);
}

/// Degraded enforcement divides the quota; a request costing more than an instance's share is
/// denied (labelled degraded), never admitted at a discount: charging less than the cost would
/// let the fleet admit more than its quota.
#[tokio::test]
async fn degraded_mode_never_charges_less_than_the_cost() {
    let mut server = RedisServer::start();
    // 20 tokens shared by 4 instances: 5 each while Redis is down.
    let limiter = limiter(&server, FailureMode::degraded(4)).await;
    server.kill();
    let d = limiter.check(["big"], 10).await.unwrap();
    assert_eq!(d.enforcement, Enforcement::Degraded);
    assert!(!d.allowed, "cost 10 cannot fit a local share of 5: {d:?}");
    assert!(d.retry_after.is_some_and(|r| r > Duration::ZERO), "{d:?}");
    assert_eq!(d.limit, 5);
    // It says what is left (the whole share: RateLimit's `r`), not what a request of the
    // whole share would leave.
    assert_eq!((d.remaining, d.reset_after), (5, Duration::ZERO), "{d:?}");
    // The denial charged nothing: the whole share is still there, at full cost.
    let d = limiter.check(["big"], 5).await.unwrap();
    assert!(d.allowed && d.remaining == 0, "{d:?}");
    assert_eq!(d.enforcement, Enforcement::Degraded);
    let d = limiter.check(["big"], 1).await.unwrap();
    assert!(!d.allowed, "{d:?}");
    // An empty share: what is left is 0.
    let d = limiter.check(["big"], 10).await.unwrap();
    assert!(!d.allowed && d.remaining == 0, "{d:?}");
}

/// A batch whose store is down takes the failure mode per request, and every outcome of
/// `check_many` (and an invalid request refused before the store) reaches the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_and_refusals_are_metered() {
    use metrics_util::debugging::DebuggingRecorder;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let mut server = RedisServer::start();
    let handle = tokio::runtime::Handle::current();
    let limiter = metrics::with_local_recorder(&recorder, || {
        tokio::task::block_in_place(|| handle.block_on(limiter(&server, FailureMode::Closed)))
    });
    let keys: Vec<_> = (0..4)
        .map(|i| limiter.key([format!("b{i}")]).unwrap())
        .collect();
    let run = async {
        let ok = limiter.check_many(&keys, 1).await.unwrap();
        assert!(ok.iter().all(|d| d.as_ref().is_ok_and(|d| d.allowed)));
        // Refused before the store: an invalid cost (one per key) and an invalid key.
        assert!(matches!(
            limiter.check_many(&keys, 21).await,
            Err(Error::Invalid(_))
        ));
        assert!(matches!(
            limiter.check([vec![b'x'; 100_000]], 1).await,
            Err(Error::Invalid(_))
        ));
        server.kill();
        let down = limiter.check_many(&keys, 1).await.unwrap();
        assert_eq!(down.len(), 4);
        assert!(
            down.iter()
                .all(|r| matches!(r, Err(Error::Unavailable { .. }))),
            "{down:?}"
        );
    };
    metrics::with_local_recorder(&recorder, || {
        tokio::task::block_in_place(|| handle.block_on(run));
    });
    let snapshot = snapshotter.snapshot().into_vec();
    let find = |name: &str, labels: &[(&str, &str)]| metric(&snapshot, name, labels);
    let decisions = |outcome| find("tollgate_decisions_total", &[("outcome", outcome)]);
    assert_eq!(decisions("allowed"), Some(4.0));
    assert_eq!(decisions("invalid"), Some(5.0), "4 keys of a batch, 1 key");
    assert_eq!(decisions("unavailable"), Some(4.0));
    assert_eq!(
        find("tollgate_store_errors_total", &[("class", "unavailable")]),
        Some(1.0),
        "one failed round trip"
    );
}

/// A batch that fails as a whole (the server killed) tells each request what a single call is
/// told. Each request's error was rebuilt from the batch's whole text, so its class's prefix was
/// said twice: "store unavailable: store unavailable: Redis: I/O error".
#[tokio::test]
async fn a_batch_failing_whole_says_what_a_single_call_says() {
    let mut server = RedisServer::start();
    let limiter = limiter(&server, FailureMode::Closed).await;
    server.kill();
    let single = timed(&limiter, "a").await.unwrap_err().to_string();
    assert_eq!(single.matches("store unavailable").count(), 1, "{single}");
    let keys: Vec<_> = (0..2)
        .map(|i| limiter.key([format!("b{i}")]).unwrap())
        .collect();
    let batch = limiter.check_many(&keys, 1).await.unwrap();
    assert_eq!(batch.len(), 2);
    for result in batch {
        let Err(e @ Error::Unavailable { .. }) = result else {
            panic!("{result:?}")
        };
        assert_eq!(e.to_string(), single);
    }
}

/// Each error of `e`'s source chain, outermost first.
fn chain(e: &Error) -> Vec<String> {
    let mut out = vec![e.to_string()];
    let mut next = std::error::Error::source(e);
    while let Some(cause) = next {
        out.push(cause.to_string());
        next = cause.source();
    }
    out
}

/// A batch that fails as a whole keeps the store error's cause, as a single call does: each
/// request's error was rebuilt from the message alone, so its source chain stopped at "store
/// unavailable: Redis: I/O error" where a single call's goes on to Redis's own error (what
/// the I/O error was: the connection refused, dropped, ...).
#[tokio::test]
async fn a_batch_failing_whole_keeps_the_cause_a_single_call_reports() {
    let mut server = RedisServer::start();
    let limiter = limiter(&server, FailureMode::Closed).await;
    server.kill();
    // Two failed round trips: below the breaker's threshold (3), so both reach the store.
    let single = chain(&timed(&limiter, "a").await.unwrap_err());
    assert!(
        single.len() >= 3,
        "the single call names the cause: {single:?}"
    );
    let keys: Vec<_> = (0..2)
        .map(|i| limiter.key([format!("b{i}")]).unwrap())
        .collect();
    let batch = limiter.check_many(&keys, 1).await.unwrap();
    assert_eq!(batch.len(), 2);
    for result in &batch {
        let Err(e @ Error::Unavailable { .. }) = result else {
            panic!("{result:?}")
        };
        let each = chain(e);
        // The cause itself may differ between two round trips (a dropped connection, then a
        // refused one); that one is named is what a batch lost.
        assert!(each.len() >= 3, "batch {each:?}, single {single:?}");
        assert_eq!(each[..2], single[..2], "batch {each:?}, single {single:?}");
    }
}

/// A fail-closed limiter on `server` whose breaker opens at the first failure and probes
/// after `probe_interval`; `deadline` bounds each call.
async fn one_strike_limiter(
    server: &RedisServer,
    probe_interval: Duration,
    deadline: Duration,
) -> Limiter {
    let store = RedisStore::builder(server.url())
        .timeout(deadline)
        .build()
        .await
        .expect("store");
    Limiter::builder("strike", policy())
        .store(Arc::new(store))
        .failure_mode(FailureMode::Closed)
        .timeout(deadline)
        .breaker(BreakerConfig {
            failure_threshold: 1,
            probe_interval,
        })
        .build()
        .unwrap()
}

/// While the breaker is open, a reset fails at once with `Error::Unavailable` (saying the
/// breaker is open), as a decision takes its failure mode at once: it never reaches the store.
/// It called the store regardless, and against a hung Redis each reset waited out the whole
/// deadline the breaker exists to spare callers.
#[tokio::test]
async fn an_open_breaker_fails_a_reset_at_once() {
    const SLOW: Duration = Duration::from_secs(1);
    let mut server = RedisServer::start();
    let limiter = one_strike_limiter(&server, Duration::from_secs(3600), SLOW).await;
    assert!(limiter.check(["r"], 1).await.unwrap().allowed);
    server.pause();
    let down = limiter.check(["r"], 1).await;
    assert!(matches!(down, Err(Error::Unavailable { .. })), "{down:?}");
    assert_eq!(limiter.breaker_state(), BreakerState::Open);
    for _ in 0..3 {
        let started = Instant::now();
        let reset = limiter.reset(["r"]).await;
        let took = started.elapsed();
        assert!(
            took < SLOW,
            "the reset waited {took:?} on a store the open breaker knows is down: {reset:?}"
        );
        let Err(Error::Unavailable { source, .. }) = &reset else {
            panic!("a reset the store cannot take is an error, never dropped: {reset:?}")
        };
        assert_eq!(source.class(), ErrorClass::Unavailable, "{source}");
        assert!(
            source.to_string().contains("circuit breaker open"),
            "{source}"
        );
    }
    assert_eq!(limiter.breaker_state(), BreakerState::Open);
    server.resume();
}

/// A reset that comes when the breaker's probe is due is that probe: the store answers it, the
/// breaker closes (shared enforcement for everyone) and the bucket is fresh.
#[tokio::test]
async fn a_reset_due_as_the_probe_closes_the_breaker() {
    let mut server = RedisServer::start();
    let limiter = one_strike_limiter(&server, Duration::ZERO, DEADLINE).await;
    assert!(limiter.check(["p"], 20).await.unwrap().allowed);
    server.pause();
    let down = limiter.check(["p"], 1).await;
    assert!(matches!(down, Err(Error::Unavailable { .. })), "{down:?}");
    assert_eq!(limiter.breaker_state(), BreakerState::Open);
    server.resume();
    limiter.reset(["p"]).await.unwrap();
    assert_eq!(limiter.breaker_state(), BreakerState::Closed);
    let d = limiter.check(["p"], 20).await.unwrap();
    assert!(d.allowed && d.enforcement == Enforcement::Shared, "{d:?}");
}

/// A failed reset is a failed store round trip like any other: counted by class in
/// `tollgate_store_errors_total` (a timeout as `unavailable`), and one the store refuses for a
/// reason that is not an outage — here an ACL user that may run the scripts but not `DEL` — is
/// logged as a bug at error level, as a decision's would be, not only returned.
#[tokio::test]
async fn failed_resets_are_counted_and_a_script_error_is_logged() {
    use metrics_util::debugging::DebuggingRecorder;
    let mut server = RedisServer::start();
    let () = redis::cmd("ACL")
        .arg(
            &[
                "SETUSER", "lim", "on", ">pw", "~*", "&*", "+@all", "-del", "-unlink",
            ][..],
        )
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    let store = RedisStore::builder(format!("redis://lim:pw@127.0.0.1:{}", server.port()))
        .timeout(DEADLINE)
        .build()
        .await
        .expect("store");
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let limiter = metrics::with_local_recorder(&recorder, || {
        limiter_with_breaker("resets", policy(), store, FailureMode::Open, DEADLINE)
    });
    let (logs, _guard) = tollgate_testkit::logs::capture();

    let d = timed(&limiter, "r").await.unwrap();
    assert_eq!(d.enforcement, Enforcement::Shared, "decisions still work");
    match limiter.reset(["r"]).await {
        Err(Error::Store(e)) => assert_eq!(e.class(), ErrorClass::Script, "{e}"),
        other => panic!("a refused DEL is a script-class error: {other:?}"),
    }
    // Paused: the deadline fires.
    server.pause();
    match limiter.reset(["r"]).await {
        Err(Error::Unavailable { source, .. }) => {
            assert_eq!(source.class(), ErrorClass::Unavailable, "{source}");
        }
        other => panic!("a reset past its deadline is unavailable: {other:?}"),
    }
    server.resume();
    server.kill();
    match limiter.reset(["r"]).await {
        Err(Error::Unavailable { source, .. }) => {
            assert_eq!(source.class(), ErrorClass::Unavailable, "{source}");
        }
        other => panic!("a reset on a dead server is unavailable: {other:?}"),
    }

    let bug = logs.matching(&["ERROR", "rate limiter store error (bug)", "resets"]);
    assert_eq!(
        bug.len(),
        1,
        "the script error is logged as a bug:\n{}",
        logs.text()
    );
    let snapshot = snapshotter.snapshot().into_vec();
    let errors = |class| {
        metric(
            &snapshot,
            "tollgate_store_errors_total",
            &[("operation", "resets"), ("class", class)],
        )
    };
    assert_eq!(
        (errors("script"), errors("unavailable")),
        (Some(1.0), Some(2.0)),
        "one per failed reset round trip, by class"
    );
}

/// Degraded enforcement divides a token bucket exactly whenever the divided rate can be
/// expressed: 1,000,000 tokens refilled every 30 days over 150 instances is 6,666 tokens at
/// 20,000 per 90 days each. The refill period multiplied by 150 unreduced (12.3 years) was
/// past the longest duration a policy takes (10 years), so the division was refused and each
/// instance enforced the whole quota — 150 times the quota for the fleet.
#[tokio::test]
async fn degraded_mode_divides_a_long_refill_period_exactly() {
    let mut server = RedisServer::start();
    let timeout = Duration::from_millis(100);
    let store = RedisStore::builder(server.url())
        .timeout(timeout)
        .build()
        .await
        .expect("store");
    let month = Duration::from_secs(30 * 24 * 3600);
    let policy = Policy::token_bucket(1_000_000, Rate::new(1_000_000, month)).unwrap();
    let (logs, _guard) = tollgate_testkit::logs::capture();
    let limiter = limiter_with_breaker(
        "monthly",
        policy,
        store,
        FailureMode::degraded(150),
        timeout,
    );
    server.kill();
    let d = timed(&limiter, "t").await.unwrap();
    assert_eq!(d.enforcement, Enforcement::Degraded);
    assert_eq!(
        d.limit, 6_666,
        "1,000,000 / 150 per instance, not the whole quota"
    );
    assert!(d.allowed && d.remaining == 6_665, "{d:?}");
    assert!(
        logs.matching(&["WARN", "expected_instances"]).is_empty(),
        "an exact division warns of nothing:\n{}",
        logs.text()
    );
}

/// Where the divided refill rate cannot be expressed (a period past 10 years even reduced),
/// degraded enforcement errs on the side of admitting less: the capacity is divided as usual
/// and the refill is the slowest expressible rate not faster than the divided one, with a
/// warning — never the whole quota on each instance.
#[tokio::test]
async fn degraded_mode_approximates_an_inexpressible_division_conservatively() {
    let mut server = RedisServer::start();
    let timeout = Duration::from_millis(100);
    let store = RedisStore::builder(server.url())
        .timeout(timeout)
        .build()
        .await
        .expect("store");
    // 15 tokens, 7 more every 9 years; over 2 instances the exact share refills 7 per 18 years,
    // a period no policy takes.
    let nine_years = Duration::from_secs(9 * 365 * 24 * 3600);
    let policy = Policy::token_bucket(15, Rate::new(7, nine_years)).unwrap();
    let (logs, _guard) = tollgate_testkit::logs::capture();
    let limiter = limiter_with_breaker("decade", policy, store, FailureMode::degraded(2), timeout);
    server.kill();
    for remaining in (0..7).rev() {
        let d = timed(&limiter, "t").await.unwrap();
        assert_eq!(d.enforcement, Enforcement::Degraded);
        assert_eq!(
            (d.limit, d.allowed, d.remaining),
            (7, true, remaining),
            "{d:?}"
        );
    }
    let d = timed(&limiter, "t").await.unwrap();
    assert!(!d.allowed, "the share of 15 / 2 is spent: {d:?}");
    // The exact share would give a token back after 18 / 7 years; the approximation is slower.
    let exact = nine_years * 2 / 7;
    assert!(d.retry_after.is_some_and(|r| r >= exact), "{d:?}");
    let warned = logs.matching(&["WARN", "decade", "expected_instances=2"]);
    assert_eq!(
        warned.len(),
        1,
        "the approximation is logged:\n{}",
        logs.text()
    );
}

type Snapshot = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    metrics_util::debugging::DebugValue,
)>;

/// Runs `work` with a debugging recorder installed and returns its output and the recorder's
/// snapshot. Metric handles are taken when a limiter is built and used when it records, so
/// both must happen under the recorder; `with_local_recorder` is synchronous and
/// thread-local, so the async work is driven on this thread inside it (a multi-thread
/// runtime's `block_in_place`).
fn recorded<T>(work: impl std::future::Future<Output = T>) -> (T, Snapshot) {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let handle = tokio::runtime::Handle::current();
    let out = metrics::with_local_recorder(&recorder, || {
        tokio::task::block_in_place(|| handle.block_on(work))
    });
    (out, snapshotter.snapshot().into_vec())
}

/// The counter's value, the gauge's value, or the histogram's number of samples, of the metric
/// `name` with `labels` in `snapshot`.
fn metric(snapshot: &Snapshot, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    use metrics_util::debugging::DebugValue;
    snapshot.iter().find_map(|(ck, _, _, v)| {
        let key = ck.key();
        (key.name() == name
            && labels
                .iter()
                .all(|(k, want)| key.labels().any(|l| l.key() == *k && l.value() == *want)))
        .then(|| match v {
            DebugValue::Counter(n) => *n as f64,
            DebugValue::Gauge(g) => g.into_inner(),
            DebugValue::Histogram(h) => h.len() as f64,
        })
    })
}

/// Degraded enforcement on a local store with a manual clock (`FailureMode::degraded_with`):
/// its time moves only when the test moves it, and a spent token comes back after exactly one
/// token's time under the local share, not a microsecond before.
#[tokio::test]
async fn degraded_enforcement_refills_exactly_when_its_clock_is_moved() {
    let mut server = RedisServer::start();
    let clock = ManualClock::new(1_700_000_000_000_000);
    let local = Arc::new(LocalStore::with_clock(clock.clone()));
    // 4 tokens at 2 per second over 2 instances: the local share is 2 tokens at 1 per second.
    let policy = Policy::token_bucket(4, Rate::per_second(2)).unwrap();
    let store = RedisStore::builder(server.url())
        .timeout(DEADLINE)
        .build()
        .await
        .expect("store");
    let mode = FailureMode::degraded_with(local.clone(), 2);
    assert_eq!(mode.as_str(), "degraded");
    let limiter = limiter_with_breaker("manual", policy, store, mode, DEADLINE);
    server.kill();

    let decide = async || timed(&limiter, "m").await.expect("a degraded decision");
    for remaining in [1, 0] {
        let d = decide().await;
        assert!(d.allowed, "{d:?}");
        assert_eq!(
            (d.enforcement, d.remaining),
            (Enforcement::Degraded, remaining)
        );
    }
    let d = decide().await;
    assert!(
        !d.allowed && d.enforcement == Enforcement::Degraded,
        "{d:?}"
    );
    assert_eq!(
        d.retry_after,
        Some(Duration::from_secs(1)),
        "one token's time"
    );

    clock.advance(Duration::from_secs(1) - Duration::from_micros(1));
    let d = decide().await;
    assert!(!d.allowed, "a microsecond short of one token: {d:?}");
    clock.advance_micros(1);
    let d = decide().await;
    assert!(d.allowed && d.enforcement == Enforcement::Degraded, "{d:?}");
    assert_eq!(d.remaining, 0, "exactly one token came back");
    assert!(!decide().await.allowed);
    assert_eq!(local.len(), 1, "decided on the caller's store");
}

/// Calls `check` on `who` until the shared store decides it (at most 5 s).
async fn until_shared(limiter: &Limiter, who: &str) {
    let started = Instant::now();
    loop {
        if let Ok(d) = limiter.check([who], 1).await
            && d.enforcement == Enforcement::Shared
        {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "no recovery");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A key's local bucket lasts until it expires, across outages: one that spent its local
/// share in one outage is still limited by it in the next, within the same window, so a store
/// flapping between up and down cannot grant an instance its share again at every outage
/// (dropping it at each shared answer let `chaos_soak`'s instances admit 31 per key against a
/// share of 25). A reset drops it.
#[tokio::test]
async fn local_buckets_last_across_outages_until_a_reset() {
    let mut server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .timeout(DEADLINE)
        .build()
        .await
        .unwrap();
    // 4 tokens, one more per hour; this instance's share under 2 instances: 2.
    let policy = Policy::token_bucket(4, Rate::new(1, Duration::from_secs(3600))).unwrap();
    let limiter =
        limiter_with_breaker("outages", policy, store, FailureMode::degraded(2), DEADLINE);
    let shared = limiter.check(["u"], 1).await.unwrap();
    assert_eq!(shared.enforcement, Enforcement::Shared);

    let spend_share = || async {
        let mut admitted = 0;
        for _ in 0..4 {
            let d = limiter.check(["u"], 1).await.unwrap();
            assert_eq!(d.enforcement, Enforcement::Degraded);
            admitted += usize::from(d.allowed);
        }
        admitted
    };
    // Outage 1 spends the local share.
    server.kill();
    assert_eq!(spend_share().await, 2);

    // The store answers again (restarted empty) and decides "u".
    server.restart();
    until_shared(&limiter, "probe").await;
    assert_eq!(limiter.breaker_state(), BreakerState::Closed);
    let d = limiter.check(["u"], 1).await.unwrap();
    assert!(d.allowed && d.enforcement == Enforcement::Shared, "{d:?}");

    // Outage 2, within the hour: the share spent in outage 1 still counts.
    server.kill();
    assert_eq!(
        spend_share().await,
        0,
        "the local share was spent this window"
    );

    // A reset (here while the store is down) drops the local bucket too.
    limiter.reset(["u"]).await.unwrap_err();
    assert_eq!(spend_share().await, 2, "a full local share after the reset");
}

/// A store that runs `hook` before each `acquire` and fails the call with the error it returns,
/// if any; everything else is `inner`'s.
struct BeforeAcquire<S, F> {
    inner: S,
    hook: F,
}

#[async_trait::async_trait]
impl<S, F> tollgate::Store for BeforeAcquire<S, F>
where
    S: tollgate::Store,
    F: Fn() -> Option<tollgate::StoreError> + Send + Sync,
{
    async fn acquire(
        &self,
        key: &tollgate::Key,
        policy: &Policy,
        cost: u64,
    ) -> Result<tollgate::Decision, tollgate::StoreError> {
        if let Some(e) = (self.hook)() {
            return Err(e);
        }
        self.inner.acquire(key, policy, cost).await
    }

    async fn peek(
        &self,
        key: &tollgate::Key,
        policy: &Policy,
        cost: u64,
    ) -> Result<tollgate::Decision, tollgate::StoreError> {
        self.inner.peek(key, policy, cost).await
    }

    async fn reset(
        &self,
        key: &tollgate::Key,
        policy: &Policy,
    ) -> Result<(), tollgate::StoreError> {
        self.inner.reset(key, policy).await
    }
}

/// `BreakerConfig::failure_threshold` is "Consecutive unavailable/busy results that open the
/// breaker": a store that answers between its failures (a flaky network dropping one call in
/// two) never reaches the threshold, however many failures it adds up over time.
mod consecutive_failures {

    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use tollgate::{
        BreakerConfig, BreakerState, Enforcement, FailureMode, Limiter, LocalStore, Policy, Rate,
        StoreError,
    };

    use super::BeforeAcquire;

    #[tokio::test]
    async fn failures_separated_by_answers_never_open_the_breaker() {
        let calls = AtomicU64::new(0);
        let policy = Policy::token_bucket(1_000, Rate::new(1, Duration::from_secs(3600))).unwrap();
        let limiter = Limiter::builder("flaky", policy)
            // fails every other call as unavailable
            .store(Arc::new(BeforeAcquire {
                inner: LocalStore::new(),
                hook: move || {
                    (calls.fetch_add(1, Ordering::Relaxed) % 2 == 1).then(|| {
                        StoreError::Unavailable {
                            message: "dropped".into(),
                            source: None,
                        }
                    })
                },
            }))
            .failure_mode(FailureMode::Open)
            .breaker(BreakerConfig {
                failure_threshold: 3,
                probe_interval: Duration::from_secs(60),
            })
            .build()
            .unwrap();
        // 20 failures in all, never two in a row.
        for i in 0..40 {
            let d = limiter.check(["k"], 1).await.unwrap();
            let want = if i % 2 == 0 {
                Enforcement::Shared
            } else {
                Enforcement::Bypassed
            };
            assert_eq!(d.enforcement, want, "call {i}: {d:?}");
            assert_eq!(limiter.breaker_state(), BreakerState::Closed, "call {i}");
        }
    }
}

/// A call decides under the policy it started with, as `Limiter::set_policy` says ("calls in
/// flight finish under the one they started with"), its failure mode too. The failure mode
/// read the policy again once the store had failed: a call of cost 50 started under a limit of
/// 100, in flight when the limit became 10, was bypassed with `limit` 10 (below its own cost),
/// and denied under the degraded mode by a share it had never been checked against.
mod policy_in_flight {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::sync::Notify;
    use tollgate::redis::RedisStore;
    use tollgate::{Decision, Enforcement, FailureMode, Limiter, Policy, Rate};
    use tollgate_testkit::server::RedisServer;

    use super::BeforeAcquire;

    /// Starts a call of cost 50 under a limit of 100 against a paused server, switches the
    /// policy to a limit of 10 while it waits, and returns what the failure mode answered; as a
    /// batch of one (`check_many`) if `batch`.
    async fn switched_in_flight(mode: FailureMode, batch: bool) -> Decision {
        let mut server = RedisServer::start();
        let redis = RedisStore::builder(server.url())
            .timeout(Duration::from_secs(5))
            .build()
            .await
            .unwrap();
        let entered = Arc::new(Notify::new());
        let old = Policy::token_bucket(100, Rate::new(1, Duration::from_secs(3600))).unwrap();
        let limiter = Limiter::builder("inflight", old)
            // the real Redis store, telling the test when a call has reached it
            .store(Arc::new(BeforeAcquire {
                inner: redis,
                hook: {
                    let entered = entered.clone();
                    move || {
                        entered.notify_one();
                        None
                    }
                },
            }))
            .failure_mode(mode)
            .timeout(Duration::from_millis(300))
            .build()
            .unwrap();
        server.pause();
        let call = {
            let limiter = limiter.clone();
            tokio::spawn(async move {
                if batch {
                    let key = limiter.key(["k"]).unwrap();
                    let mut results = limiter.check_many(&[key], 50).await.unwrap();
                    assert_eq!(results.len(), 1);
                    results.remove(0)
                } else {
                    limiter.check(["k"], 50).await
                }
            })
        };
        tokio::time::timeout(Duration::from_secs(5), entered.notified())
            .await
            .expect("the call reached the store");
        let new = Policy::token_bucket(10, Rate::new(1, Duration::from_secs(3600))).unwrap();
        limiter.set_policy(new.with_generation(1));
        let out = tokio::time::timeout(Duration::from_secs(5), call)
            .await
            .expect("the call returns at its deadline")
            .unwrap();
        server.resume();
        out.unwrap()
    }

    #[tokio::test]
    async fn open_answers_under_the_policy_the_call_started_with() {
        let d = switched_in_flight(FailureMode::Open, false).await;
        assert_eq!(d.enforcement, Enforcement::Bypassed);
        assert!(d.allowed);
        assert_eq!((d.limit, d.remaining), (100, 100), "{d:?}");
    }

    #[tokio::test]
    async fn degraded_decides_under_the_share_of_the_policy_the_call_started_with() {
        for batch in [false, true] {
            let d = switched_in_flight(FailureMode::degraded(1), batch).await;
            assert_eq!(d.enforcement, Enforcement::Degraded, "batch {batch}");
            assert!(
                d.allowed,
                "batch {batch}: cost 50 of a local share of 100: {d:?}"
            );
            assert_eq!((d.limit, d.remaining), (100, 50), "batch {batch}: {d:?}");
        }
    }
}

/// A degraded denial above the local share says what the local bucket holds even when the
/// bucket is governed by parameters other than the call's share: here an older generation
/// under `DeferUntilExpiry` (its share of 10, spent down to 7, governs until it expires), where
/// a peek of the new share (5) is admitted although the bucket is not untouched.
#[tokio::test]
async fn a_degraded_denial_above_the_share_says_what_a_deferred_bucket_holds() {
    let mut server = RedisServer::start();
    let clock = ManualClock::new(1_000_000_000);
    let local = Arc::new(LocalStore::with_clock(clock.clone()));
    let store = RedisStore::builder(server.url())
        .timeout(DEADLINE)
        .build()
        .await
        .expect("store");
    // 20 tokens shared by 2 instances: 10 each while Redis is down.
    let limiter = limiter_with_breaker(
        "fault",
        policy(),
        store,
        FailureMode::degraded_with(local, 2),
        DEADLINE,
    );
    server.kill();
    let d = limiter.check(["deferred"], 3).await.unwrap();
    assert_eq!(d.enforcement, Enforcement::Degraded);
    assert!(d.allowed && d.remaining == 7 && d.limit == 10, "{d:?}");
    // Generation 1 halves the quota (a share of 5) but leaves live buckets to the old one.
    limiter.set_policy(
        "token-bucket:capacity=10,rate=1,generation=1,transition=defer-until-expiry"
            .parse()
            .unwrap(),
    );
    let denied = limiter.check(["deferred"], 6).await.unwrap();
    assert!(!denied.allowed, "{denied:?}");
    // What a request of 1 sees is what the bucket holds: 7 tokens of the old share, 3 to refill.
    let one = limiter.check(["deferred"], 1).await.unwrap();
    assert!(one.allowed, "{one:?}");
    assert_eq!(
        (denied.limit, denied.remaining),
        (one.limit, one.remaining + 1),
        "denied {denied:?}, then cost 1 {one:?}"
    );
    // Not full, so not "nothing to reset"; full no later than after spending one more.
    assert!(
        denied.reset_after > Duration::ZERO && denied.reset_after <= one.reset_after,
        "denied {denied:?}, then cost 1 {one:?}"
    );
}

/// A raise under `DeferUntilExpiry` while the store is down: the instance's local bucket was
/// written under the old share (capacity 20 over 2 instances: 10) and stays governed by it
/// until it expires, while the new policy's share is 50. A request of cost 30 (within the new
/// share) or 60 (above it, within the policy) is valid; the local bucket cannot hold it. It is
/// a degraded denial: 30 until the local bucket expires (the local store's answer), 60 until
/// shared enforcement can decide, as any cost above the share. It used to take the local
/// store's refusal (a cost above the governing capacity) for a failure of the local limiter
/// and fail closed (`Error::Unavailable`, a "degraded local limiter failed too" error,
/// `tollgate_fallback_errors_total{class="invalid"}`).
mod deferred_raise_while_degraded {
    use std::sync::Arc;
    use std::time::Duration;

    use metrics_util::debugging::DebuggingRecorder;
    use tollgate::{
        BreakerConfig, Enforcement, FailureMode, Limiter, LocalStore, ManualClock, Policy,
        StoreError,
    };

    use super::{BeforeAcquire, metric};

    #[tokio::test]
    async fn a_cost_the_deferred_local_bucket_cannot_hold_is_a_degraded_denial() {
        for cost in [30, 60] {
            let recorder = DebuggingRecorder::new();
            let snapshotter = recorder.snapshotter();
            let clock = ManualClock::new(1_700_000_000_000_000);
            let local = Arc::new(LocalStore::with_clock(clock.clone()));
            let old: Policy = "token-bucket:capacity=20,rate=1,period=60s"
                .parse()
                .unwrap();
            let limiter = metrics::with_local_recorder(&recorder, || {
                Limiter::builder("deferred", old)
                    .store(Arc::new(BeforeAcquire {
                        inner: LocalStore::new(),
                        hook: || {
                            Some(StoreError::Unavailable {
                                message: "down".into(),
                                source: None,
                            })
                        },
                    }))
                    .failure_mode(FailureMode::degraded_with(local, 2))
                    .breaker(BreakerConfig {
                        failure_threshold: 100,
                        probe_interval: Duration::from_secs(5),
                    })
                    .build()
                    .unwrap()
            });
            let d = limiter.check(["k"], 1).await.unwrap();
            assert_eq!(d.enforcement, Enforcement::Degraded);
            assert_eq!((d.limit, d.remaining), (10, 9), "{d:?}");
            limiter.set_policy(
                "token-bucket:capacity=100,rate=5,period=60s,generation=1,\
                 transition=defer-until-expiry"
                    .parse()
                    .unwrap(),
            );
            let d = limiter.check(["k"], cost).await.unwrap();
            assert_eq!(d.enforcement, Enforcement::Degraded, "cost {cost}: {d:?}");
            assert!(!d.allowed, "cost {cost}: {d:?}");
            // the old share governs the bucket: its limit, what is left in it (nothing spent)
            assert_eq!((d.limit, d.remaining), (10, 9), "cost {cost}: {d:?}");
            // The local bucket expires when full again (one token, 120 s at the share's rate),
            // and a fresh one under the new share then admits a cost within it: 30 waits for
            // that; 60 is above the new share too, so it waits for shared enforcement (the
            // breaker's probe).
            let expiry = Duration::from_millis(120_001);
            let wait = if cost > 50 {
                Duration::from_secs(5)
            } else {
                expiry
            };
            assert_eq!(d.retry_after, Some(wait), "cost {cost}: {d:?}");
            assert_eq!(d.reset_after, expiry, "cost {cost}: {d:?}");
            // the bucket still serves what it can hold
            let small = limiter.check(["k"], 9).await.unwrap();
            assert!(small.allowed && small.remaining == 0, "{small:?}");
            let snapshot = snapshotter.snapshot().into_vec();
            assert_eq!(
                metric(
                    &snapshot,
                    "tollgate_fallback_errors_total",
                    &[("class", "invalid")]
                ),
                Some(0.0),
                "the local limiter did not fail"
            );
        }
    }
}
