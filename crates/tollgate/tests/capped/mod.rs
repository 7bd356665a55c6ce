//! The limiter of the key-cap tests: a local store that holds at most [`CAP`] keys, used as
//! the primary store of a fixed window of 3 per hour.

use std::sync::Arc;
use std::time::Duration;

use tollgate::{FailureMode, Limiter, LocalStore, Policy};

/// The keys the store holds.
pub const CAP: usize = 4;

/// The limiter, failing by `mode`.
pub fn limiter(mode: FailureMode) -> Limiter {
    let store = LocalStore::builder().max_keys(CAP).build();
    Limiter::builder(
        "capped",
        Policy::fixed_window(3, Duration::from_secs(3600)).unwrap(),
    )
    .store(Arc::new(store))
    .failure_mode(mode)
    .build()
    .unwrap()
}
