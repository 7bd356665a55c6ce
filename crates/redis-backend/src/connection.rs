//! The two ways the store talks to Redis — one multiplexed connection that reconnects by
//! itself, or a bb8 pool of them — behind one pair of calls: send a command, send a pipeline.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisError, RedisResult, Value};

/// A connection to one Redis server.
#[derive(Clone)]
pub(crate) enum Conn {
    Multiplexed(ConnectionManager),
    Pool(bb8::Pool<PoolManager>),
}

impl Conn {
    /// Sends one command. An error reply is returned as `Err`.
    pub(crate) async fn command(&self, cmd: &Cmd) -> RedisResult<Value> {
        let value = match self {
            Self::Multiplexed(m) => m.clone().req_packed_command(cmd).await,
            Self::Pool(pool) => {
                let (mut conn, broken) = checkout(pool).await?;
                let result = conn.req_packed_command(cmd).await;
                mark_if_broken(&broken, &result);
                result
            }
        }?;
        value.extract_error()
    }

    /// Sends a pipeline in one round trip. Error replies stay in place as
    /// [`Value::ServerError`], so the caller sees which commands failed.
    pub(crate) async fn pipeline(&self, pipe: &Pipeline, count: usize) -> RedisResult<Vec<Value>> {
        match self {
            Self::Multiplexed(m) => m.clone().req_packed_commands(pipe, 0, count).await,
            Self::Pool(pool) => {
                let (mut conn, broken) = checkout(pool).await?;
                let result = conn.req_packed_commands(pipe, 0, count).await;
                mark_if_broken(&broken, &result);
                result
            }
        }
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Multiplexed(_) => "multiplexed",
            Self::Pool(_) => "pool",
        }
    }
}

/// Takes a connection from the pool and returns it at once, keeping a clone: a multiplexed
/// connection is shared safely, so no call waits for another's round trip to finish, and the
/// pool hands its connections out in turn. Connections flagged broken are dropped on the way.
async fn checkout(
    pool: &bb8::Pool<PoolManager>,
) -> RedisResult<(MultiplexedConnection, Arc<AtomicBool>)> {
    loop {
        let pooled = pool.get().await.map_err(|e| match e {
            bb8::RunError::User(e) => e,
            bb8::RunError::TimedOut => RedisError::from(io::Error::new(
                io::ErrorKind::TimedOut,
                "timed out waiting for a pooled Redis connection",
            )),
        })?;
        // A broken connection goes back now, and bb8 drops it (`has_broken`).
        if !pooled.broken.load(Ordering::Relaxed) {
            return Ok((pooled.conn.clone(), pooled.broken.clone()));
        }
    }
}

fn mark_if_broken<T>(broken: &AtomicBool, result: &RedisResult<T>) {
    if let Err(e) = result
        && e.is_unrecoverable_error()
    {
        broken.store(true, Ordering::Relaxed);
    }
}

/// `bb8_redis::RedisConnectionManager` plus a broken flag. The pool does not test a connection
/// on checkout (that would cost a PING round trip per decision); instead a connection that
/// failed with an error that needs a reconnect is flagged, and bb8 drops it when it next
/// comes back.
#[derive(Debug, Clone)]
pub(crate) struct PoolManager(pub(crate) bb8_redis::RedisConnectionManager);

/// A pooled connection and whether it must be replaced.
pub(crate) struct PooledConn {
    conn: MultiplexedConnection,
    broken: Arc<AtomicBool>,
}

impl bb8::ManageConnection for PoolManager {
    type Connection = PooledConn;
    type Error = RedisError;

    async fn connect(&self) -> Result<PooledConn, RedisError> {
        Ok(PooledConn {
            conn: self.0.connect().await?,
            broken: Arc::new(AtomicBool::new(false)),
        })
    }

    async fn is_valid(&self, conn: &mut PooledConn) -> Result<(), RedisError> {
        self.0.is_valid(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut PooledConn) -> bool {
        conn.broken.load(Ordering::Relaxed)
    }
}
