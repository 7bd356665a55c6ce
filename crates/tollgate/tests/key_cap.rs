//! A local store used as the primary store, at its key cap: a flood of new keys must not switch
//! limiting off for the keys already held. The cap refuses only the new key (its request takes
//! the failure mode), and the circuit breaker does not count it as an outage.

mod capped;

use tollgate::{BreakerState, Enforcement, Error, ErrorClass, FailureMode};

use capped::{CAP, limiter};

#[tokio::test]
async fn a_key_rotation_flood_does_not_bypass_held_keys() {
    let limiter = limiter(FailureMode::Open);
    for i in 0..CAP {
        limiter.check([format!("held{i}")], 1).await.unwrap();
    }
    for i in 0..100 {
        let d = limiter.check([format!("new{i}")], 1).await.unwrap();
        assert_eq!(d.enforcement, Enforcement::Bypassed, "the new key alone");
    }
    assert_eq!(limiter.breaker_state(), BreakerState::Closed);
    // The victim is still limited by the shared (primary) store.
    for _ in 0..2 {
        let d = limiter.check(["held0"], 1).await.unwrap();
        assert!(d.allowed && d.enforcement == Enforcement::Shared, "{d:?}");
    }
    let d = limiter.check(["held0"], 1).await.unwrap();
    assert!(!d.allowed && d.enforcement == Enforcement::Shared, "{d:?}");
}

#[tokio::test]
async fn closed_refuses_the_new_key_and_batches_keep_their_decisions() {
    let limiter = limiter(FailureMode::Closed);
    let held: Vec<_> = (0..CAP)
        .map(|i| limiter.key([format!("held{i}")]).unwrap())
        .collect();
    for k in &held {
        limiter.check_key(k, 1).await.unwrap();
    }
    match limiter.check(["new"], 1).await {
        Err(Error::Unavailable { source, .. }) => {
            assert_eq!(source.class(), ErrorClass::Capacity);
        }
        other => panic!("expected the new key refused, got {other:?}"),
    }
    // A batch with a new key among held ones: only the new key fails.
    let batch = [
        held[0].clone(),
        limiter.key(["other"]).unwrap(),
        held[1].clone(),
    ];
    let got = limiter.check_many(&batch, 2).await.unwrap();
    assert!(
        got[0].as_ref().is_ok_and(|d| d.allowed && d.remaining == 0),
        "{got:?}"
    );
    assert!(matches!(got[1], Err(Error::Unavailable { .. })), "{got:?}");
    assert!(
        got[2].as_ref().is_ok_and(|d| d.allowed && d.remaining == 0),
        "{got:?}"
    );
    assert_eq!(limiter.breaker_state(), BreakerState::Closed);
}
