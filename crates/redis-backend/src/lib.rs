//! The Redis store: one atomic Lua script per decision, on Redis time. [`RedisStore`] keeps
//! each bucket in one Redis key, whatever its algorithm, and makes every decision in one
//! script execution.
//!
//! - **Scripts** ([`scripts`]): one script, `scripts/prelude.lua` and a block per algorithm
//!   (`scripts/{token_bucket,fixed_window,sliding_log}.lua`, each the exact twin of the
//!   matching `tollgate_core::algorithm` function), embedded with `include_str!`, so a bucket
//!   written by a newer generation of another algorithm governs older callers in the same
//!   execution. They read time only from Redis `TIME`, validate every argument, and store exact
//!   integers (never through Lua's 14-digit `tostring`).
//! - **Keys**: `<prefix>{<key>}`; the hash tag is the bucket's identity, so every script is
//!   single-key and Cluster-safe.
//! - **Calls**: `EVALSHA` by precomputed SHA1; `NOSCRIPT` is absorbed by resending once with
//!   the source. Every call has a deadline. Errors are classified by [`classify`].
//! - **Registry** ([`RedisRegistry`]): named policies with generations, published atomically
//!   and announced on pub/sub, so a fleet can follow one policy.
//! - **Connections**: a bb8 pool of multiplexed connections (4 by default, the faster choice in
//!   BENCHMARKS.md), or one multiplexed connection that reconnects by itself.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tollgate_core::StoreError> {
//! use std::time::Duration;
//! use tollgate_core::{Key, Policy, Store};
//! use tollgate_redis::RedisStore;
//!
//! let store = RedisStore::builder("redis://127.0.0.1:6379").build().await?;
//! let policy = Policy::fixed_window(100, Duration::from_secs(60)).unwrap();
//! let d = store.acquire(&Key::new("api", ["tenant-7"])?, &policy, 1).await?;
//! assert!(d.allowed);
//! # Ok(()) }
//! ```

mod builder;
mod connection;
mod error;
pub mod record;
mod redact;
mod registry;
pub mod scripts;
mod store;

pub use builder::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_POOL_SIZE, DEFAULT_PREFIX, DEFAULT_TIMEOUT, MAX_PREFIX_LEN,
    RedisStoreBuilder, client_for,
};
pub use error::classify;
pub use redact::redact_url;
pub use registry::{Notice, Published, RedisRegistry, RegistryError, Subscription};
pub use store::RedisStore;
