//! The in-process store: the core maths on a sharded map, one bucket per [`Key`], each
//! decision atomic per key. Used alone for single-process limits, and by the `tollgate`
//! facade as the fallback when the shared Redis store cannot answer.
//!
//! # Per-process state: degraded enforcement as a fallback
//!
//! A [`LocalStore`] holds its buckets in this process only. When it stands in for the shared
//! Redis store, every instance of a service enforces the quota on its own, so the fleet as a
//! whole can admit up to N× the quota with N instances (or, if the quota is divided by an
//! expected instance count, less than the quota when fewer instances take traffic). That is
//! *degraded* enforcement. This crate labels nothing itself: its decisions carry the core's
//! default label, and the facade relabels them
//! [`Enforcement::Degraded`](tollgate_core::Enforcement::Degraded) when it uses a `LocalStore`
//! as a fallback.
//!
//! # Same semantics as the shared store
//!
//! Decisions come from [`tollgate_core::algorithm::apply`], the same maths the Redis scripts
//! implement, and expiry follows Redis to the millisecond, so a `LocalStore` and a Redis server
//! on the same clock decide alike (a differential test holds them to it). Both pass the
//! conformance suite in `tollgate-testkit`. Buckets are keyed by [`Key`] alone: a policy
//! passed to [`Store::reset`](tollgate_core::Store::reset) does not select among buckets. Each
//! bucket is a [`Record`](tollgate_core::algorithm::Record) of the generation and parameters that
//! last wrote it, as in Redis, so policy changes (docs/policy-changes.md) behave alike.
//!
//! Time comes from a [`Clock`](tollgate_core::Clock): [`MonotonicClock`](tollgate_core::MonotonicClock)
//! (wall time advanced by a fast monotonic counter) by default, a
//! [`ManualClock`](tollgate_core::ManualClock) in tests.
//!
//! ```
//! use std::time::Duration;
//! use tollgate_core::{Key, Policy, Rate, Store};
//! use tollgate_local::LocalStore;
//!
//! # async fn demo() -> Result<(), tollgate_core::StoreError> {
//! let store = LocalStore::new();
//! let policy = Policy::token_bucket(10, Rate::per_second(5)).unwrap();
//! let key = Key::new("api", ["tenant-7"]).unwrap();
//!
//! let decision = store.acquire(&key, &policy, 3).await?; // the async Store trait
//! assert!(decision.allowed);
//! let decision = store.acquire_now(&key, &policy, 1)?; // the same, synchronously
//! assert!(decision.remaining <= 6);
//! # Ok(())
//! # }
//! ```
//!
//! [`Key`]: tollgate_core::Key

mod bucket;
mod lent;
#[cfg(test)]
mod stale_takeover;
mod store;

pub use store::{
    CAP_SWEEP_GAP_MS, DEFAULT_MAX_KEYS, DEFAULT_SWEEP_EVERY, LocalStore, LocalStoreBuilder,
    SWEEP_GAP_MS,
};
