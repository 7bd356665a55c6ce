//! Building a [`RedisStore`]: URL, key prefix, per-call timeout and the connection kind.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tollgate_core::{KeyError, StoreError};

use crate::connection::{Conn, PoolManager};
use crate::error::classify;
use crate::store::{Inner, RedisStore};

/// The key prefix used unless [`RedisStoreBuilder::prefix`] sets another.
pub const DEFAULT_PREFIX: &str = "tollgate:";

/// The per-call timeout used unless [`RedisStoreBuilder::timeout`] sets another.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// The connect timeout used unless [`RedisStoreBuilder::connect_timeout`] sets another.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest key prefix accepted, in bytes.
pub const MAX_PREFIX_LEN: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Multiplexed,
    Pool(u32),
}

/// Configures and connects a [`RedisStore`]; see [`RedisStore::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisStoreBuilder {
    url: String,
    prefix: String,
    timeout: Duration,
    connect_timeout: Duration,
    kind: Kind,
}

impl RedisStoreBuilder {
    pub(crate) fn new(url: String) -> Self {
        Self {
            url,
            prefix: DEFAULT_PREFIX.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            kind: Kind::Multiplexed,
        }
    }

    /// The prefix of every key the store writes (default [`DEFAULT_PREFIX`]): up to 64 bytes of
    /// `[A-Za-z0-9:_.-]`. Braces are refused, since they would change the hash slot.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The deadline of each store call, including a NOSCRIPT reload and a pool checkout
    /// (default [`DEFAULT_TIMEOUT`]). A call that misses it fails with
    /// [`StoreError::Timeout`]. A timed-out call may still be applied by the server later (the
    /// command was sent); the store never retries it, so it is applied at most once.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The deadline for connecting (in [`build`](Self::build) and on reconnects; default
    /// [`DEFAULT_CONNECT_TIMEOUT`]).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Uses one multiplexed connection that reconnects by itself (the default). Every clone of
    /// the store shares it; concurrent calls are pipelined on it.
    pub fn multiplexed(mut self) -> Self {
        self.kind = Kind::Multiplexed;
        self
    }

    /// Uses a bb8 pool of up to `size` multiplexed connections (at least 1). Calls take the
    /// connections in turn and share them (a call holds none while it waits for its reply), so
    /// a pool spreads load over `size` sockets without ever queueing a call behind another.
    pub fn pool(mut self, size: u32) -> Self {
        self.kind = Kind::Pool(size.max(1));
        self
    }

    /// Validates the configuration, connects, and loads the scripts into the server's cache.
    ///
    /// Fails with [`StoreError::InvalidKey`] for a bad prefix, and with
    /// [`StoreError::Unavailable`] for an unparsable URL (`redis://`, `rediss://` with the
    /// `tls` feature, `redis://user:password@host:port/db`) or a server that cannot be reached
    /// within the connect timeout.
    pub async fn build(self) -> Result<RedisStore, StoreError> {
        check_prefix(&self.prefix)?;
        let client = redis::Client::open(self.url.as_str())
            .map_err(|e| StoreError::unavailable(format!("invalid Redis URL: {e}"), e))?;
        let connect = async {
            match self.kind {
                Kind::Multiplexed => {
                    let config = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(self.connect_timeout))
                        .set_number_of_retries(2)
                        .set_max_delay(Duration::from_millis(500));
                    ConnectionManager::new_with_config(client, config)
                        .await
                        .map(Conn::Multiplexed)
                        .map_err(|e| classify(&e))
                }
                Kind::Pool(size) => {
                    let manager = bb8_redis::RedisConnectionManager::new(self.url.as_str())
                        .map_err(|e| classify(&e))?;
                    let pool = bb8::Pool::builder()
                        .max_size(size)
                        .test_on_check_out(false)
                        .queue_strategy(bb8::QueueStrategy::Fifo)
                        .connection_timeout(self.connect_timeout)
                        .build_unchecked(PoolManager(manager));
                    Ok(Conn::Pool(pool))
                }
            }
        };
        let store = async {
            let conn = connect.await?;
            let store = RedisStore {
                inner: Arc::new(Inner {
                    conn,
                    prefix: self.prefix.into(),
                    timeout: self.timeout,
                }),
            };
            store.load_scripts_now().await?;
            Ok(store)
        };
        tokio::time::timeout(self.connect_timeout, store)
            .await
            .map_err(|_| StoreError::Timeout(self.connect_timeout))?
    }
}

/// Checks a key prefix: at most [`MAX_PREFIX_LEN`] bytes of `[A-Za-z0-9:_.-]`.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), StoreError> {
    let ok = prefix.len() <= MAX_PREFIX_LEN
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b':' | b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(KeyError::BadNamespace(prefix.to_owned()).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_refuses_braces_and_odd_bytes() {
        assert!(check_prefix("tollgate:").is_ok());
        assert!(check_prefix("").is_ok());
        assert!(check_prefix("App-1.rl_v2:").is_ok());
        for bad in ["{x}:", "a}", "a b", "a\n", "ünï", &"x".repeat(65)] {
            assert!(
                matches!(check_prefix(bad), Err(StoreError::InvalidKey(_))),
                "{bad:?}"
            );
        }
    }
}
