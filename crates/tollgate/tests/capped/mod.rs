//! The limiter of the key-cap tests: a local store that holds at most [`CAP`] keys, used as
//! the primary store of a token bucket of 3, refilling one token an hour. (A fixed window of 3
//! per hour, used before, is aligned to the epoch on the store's real clock: it restarted at
//! the top of the hour, freeing the held keys and their counts in a run that crossed it.)

use std::sync::Arc;
use std::time::Duration;

use tollgate::{FailureMode, Limiter, LocalStore, Policy, Rate};

/// The keys the store holds.
pub const CAP: usize = 4;

/// The limiter, failing by `mode`.
pub fn limiter(mode: FailureMode) -> Limiter {
    let store = LocalStore::builder().max_keys(CAP).build();
    Limiter::builder(
        "capped",
        Policy::token_bucket(3, Rate::new(1, Duration::from_secs(3600))).unwrap(),
    )
    .store(Arc::new(store))
    .failure_mode(mode)
    .build()
    .unwrap()
}
