//! How a Redis error becomes a [`StoreError`]: its class decides whether a limiter applies the
//! operation's failure mode (unavailable, busy) or reports a bug (script).

use redis::{ErrorKind, RedisError, ServerErrorKind};
use tollgate_core::{PolicyError, StoreError};

/// The prefix of the error replies our scripts give for invalid arguments.
const VALIDATION_PREFIX: &str = "tollgate:";

/// Classifies a Redis error.
///
/// - connection refused, I/O, dropped connections, `LOADING`, `MASTERDOWN`, `READONLY`,
///   `CLUSTERDOWN`, `TRYAGAIN`, `MOVED`/`ASK` (a cluster re-sharding, seen only by a
///   single-server connection: the Cluster connection follows them), a missing cluster
///   node, sentinels that name no reachable primary (a failover in progress), and the
///   replies of a server that cannot accept writes now — `OOM` (`maxmemory` reached),
///   `NOREPLICAS` (fewer replicas than `min-replicas-to-write`) and `MISCONF` (the last
///   snapshot failed under `stop-writes-on-bgsave-error`) → [`StoreError::Unavailable`];
/// - `BUSY` (another script is running) → [`StoreError::Busy`];
/// - `ERR tollgate: ...` (a script refused its arguments; nothing was written) →
///   [`StoreError::InvalidPolicy`];
/// - a refused authentication — `NOAUTH` (the server needs a password and got none),
///   `WRONGPASS` or a failed `AUTH` — → [`StoreError::Script`] saying so: a misconfiguration,
///   never taken for an outage;
/// - anything else — a Lua runtime error, `WRONGTYPE`, `NOSCRIPT` that survived a reload, an
///   unparsable reply, an ACL failure (`NOPERM`) — → [`StoreError::Script`].
///
/// A `SELECT` refused while connecting to a numbered database is classified by the server's
/// text, as the reply it was (redis-rs keeps only the text: `BUSY` is busy, `NOAUTH` a refused
/// authentication, `LOADING` and `MASTERDOWN` unavailable).
///
/// A transaction the server refused while queueing (`EXECABORT`: redis-rs's
/// `TransactionAborted`) is classified by the errors its commands were refused with: an
/// outage among them (`LOADING`, `READONLY`, …) makes it unavailable, else a `BUSY` makes it
/// busy, else the first error decides. Only an abort that carries no error is a script error.
///
/// `NOSCRIPT` is handled inside the store (load and retry once) and normally never reaches here.
///
/// ```
/// use tollgate_core::ErrorClass;
/// let busy = redis::make_extension_error("BUSY".into(), Some("Redis is busy running a script".into()));
/// assert_eq!(tollgate_redis::classify(&busy).class(), ErrorClass::Busy);
/// ```
pub fn classify(err: &RedisError) -> StoreError {
    if let Some(refused) = select_refused(err) {
        return refused;
    }
    match err.kind() {
        ErrorKind::Io
        | ErrorKind::ClusterConnectionNotFound
        | ErrorKind::MasterNameNotFoundBySentinel
        | ErrorKind::NoValidReplicasFoundBySentinel
        | ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::TryAgain
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask,
        ) => unavailable(err),
        ErrorKind::Server(ServerErrorKind::ResponseError)
            if err
                .detail()
                .is_some_and(|d| d.starts_with(VALIDATION_PREFIX)) =>
        {
            StoreError::InvalidPolicy(PolicyError::Overflow(format!(
                "the Redis script refused its arguments: {}",
                err.detail().unwrap_or_default()
            )))
        }
        ErrorKind::AuthenticationFailed => auth_refused(err),
        ErrorKind::Server(ServerErrorKind::ExecAbort) => aborted(err),
        _ => match err.code() {
            Some("NOAUTH" | "WRONGPASS") => auth_refused(err),
            Some("BUSY") => StoreError::Busy(err.to_string()),
            // The server refuses writes for now (memory, replicas, persistence): an outage of
            // the shared store, not a bug in the script.
            Some("OOM" | "NOREPLICAS" | "MISCONF") => unavailable(err),
            _ if err.is_connection_dropped() || err.is_connection_refusal() || err.is_timeout() => {
                unavailable(err)
            }
            _ => StoreError::Script(err.to_string()),
        },
    }
}

/// A `SELECT` refused while connecting to a numbered database (`redis://host:port/1`), by
/// what the server said. redis-rs reports every such refusal as a plain `ERR` "Redis server
/// refused to switch database" carrying only the reply's text, its code lost; classified by
/// that code it would be a script error whatever the cause. The texts are Redis's own for the
/// replies `SELECT` can meet on connect: `BUSY` (another client's script ran past
/// `busy-reply-threshold`), `NOAUTH` (a password the connection did not give), `LOADING` and
/// `MASTERDOWN`. Anything else (an ACL user without `SELECT`, a database out of range) stays
/// a script error: a misconfiguration.
fn select_refused(err: &RedisError) -> Option<StoreError> {
    if err.kind() != ErrorKind::Server(ServerErrorKind::ResponseError)
        || !err.to_string().contains("refused to switch database")
    {
        return None;
    }
    let said = err.detail()?;
    if said.starts_with("Redis is busy running a script") {
        Some(StoreError::Busy(err.to_string()))
    } else if said.starts_with("Authentication required") {
        Some(auth_refused(err))
    } else if said.starts_with("Redis is loading the dataset")
        || said.starts_with("Link with MASTER is down")
    {
        Some(unavailable(err))
    } else {
        None
    }
}

/// A refused transaction, by the errors its queued commands met (see [`classify`]).
fn aborted(err: &RedisError) -> StoreError {
    use tollgate_core::ErrorClass;
    let inner: Vec<RedisError> = err
        .clone()
        .into_server_errors()
        .map(|errors| {
            errors
                .iter()
                // a plain EXECABORT reply lists itself: classified by its own code below
                .filter(|(_, e)| e.kind() != Some(ServerErrorKind::ExecAbort))
                .map(|(_, e)| e.clone().into())
                .collect()
        })
        .unwrap_or_default();
    match telling(&inner) {
        // the whole abort's text: every refused command
        Some(e) if classify(e).class() == ErrorClass::Busy => StoreError::Busy(err.to_string()),
        Some(e) => classify(e),
        None => StoreError::Script(err.to_string()),
    }
}

/// Of the errors a refused transaction's commands met, the one that tells why it was refused:
/// an outage, else a busy server, else the first.
pub(crate) fn telling(errors: &[RedisError]) -> Option<&RedisError> {
    use tollgate_core::ErrorClass;
    let of_class = |class| errors.iter().find(|e| classify(e).class() == class);
    of_class(ErrorClass::Unavailable)
        .or_else(|| of_class(ErrorClass::Busy))
        .or(errors.first())
}

/// Whether `err` is a `NOSCRIPT` reply: the server's script cache lost the script.
pub(crate) fn is_noscript(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// Redis refused the store's credentials (or needs some): loud, and says where they go.
fn auth_refused(err: &RedisError) -> StoreError {
    StoreError::Script(format!(
        "Redis authentication failed ({err}): check the username and password the store \
         connects with (the URL's user:password@; for the primary behind Sentinel, \
         RedisStoreBuilder::primary_password or primary_credentials)"
    ))
}

/// An outage, its message naming what Redis said: redis-rs's category for the replies it
/// knows (`LOADING` is "busy loading", `READONLY` "read-only"), the reply's own code for the
/// others (`OOM`, `NOREPLICAS`, `MISCONF`), which redis-rs lumps together as "extension error".
fn unavailable(err: &RedisError) -> StoreError {
    let what = match (err.kind(), err.code()) {
        (ErrorKind::Extension, Some(code)) => code,
        _ => err.category(),
    };
    StoreError::unavailable(format!("Redis: {what}"), err.clone())
}

#[cfg(test)]
mod tests {
    use std::io;

    use tollgate_core::ErrorClass;

    use super::*;

    fn reply(line: &str) -> RedisError {
        redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
            .unwrap()
            .extract_error()
            .unwrap_err()
    }

    fn class(err: &RedisError) -> ErrorClass {
        classify(err).class()
    }

    /// A `SELECT` refused on connect, as redis-rs reports it (a plain `ERR` with the reply's
    /// text only): classified by that text, as the reply itself would be.
    #[test]
    fn a_select_refused_on_connect_is_classified_by_what_the_server_said() {
        let refused = |said: &str| {
            RedisError::from((
                ErrorKind::Server(ServerErrorKind::ResponseError),
                "Redis server refused to switch database",
                said.to_owned(),
            ))
        };
        let busy = refused(
            "Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        );
        assert_eq!(class(&busy), ErrorClass::Busy);
        let auth = classify(&refused("Authentication required."));
        assert_eq!(auth.class(), ErrorClass::Script);
        assert!(auth.to_string().contains("authentication failed"), "{auth}");
        for said in [
            "Redis is loading the dataset in memory",
            "Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        ] {
            assert_eq!(class(&refused(said)), ErrorClass::Unavailable, "{said}");
        }
        for said in [
            "DB index is out of range",
            "User u has no permissions to run the 'select' command",
        ] {
            assert_eq!(class(&refused(said)), ErrorClass::Script, "{said}");
        }
    }

    /// A plain `EXECABORT` reply (EXEC's own, no queued errors with it) lists itself as its
    /// inner error: classified as a script error, never recursing (it overflowed the stack).
    #[test]
    fn a_plain_execabort_reply_is_a_script_error() {
        let err = reply("EXECABORT Transaction discarded because of previous errors.");
        assert_eq!(err.kind(), ErrorKind::Server(ServerErrorKind::ExecAbort));
        let class = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || class(&err))
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(class, ErrorClass::Script);
    }

    #[test]
    fn io_and_connection_failures_are_unavailable() {
        for kind in [
            io::ErrorKind::ConnectionRefused,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::TimedOut,
            io::ErrorKind::UnexpectedEof,
            io::ErrorKind::Other,
        ] {
            let err = RedisError::from(io::Error::new(kind, "boom"));
            assert_eq!(class(&err), ErrorClass::Unavailable, "{kind:?}");
        }
        let dropped = RedisError::from((ErrorKind::Io, "Connection dropped"));
        assert_eq!(class(&dropped), ErrorClass::Unavailable);
    }

    #[test]
    fn sentinels_without_a_primary_mean_a_failover_is_in_progress() {
        for kind in [
            ErrorKind::MasterNameNotFoundBySentinel,
            ErrorKind::NoValidReplicasFoundBySentinel,
        ] {
            let err = RedisError::from((kind, "no primary"));
            assert_eq!(class(&err), ErrorClass::Unavailable, "{kind:?}");
        }
    }

    #[test]
    fn server_states_that_pass_are_unavailable() {
        for line in [
            "LOADING Redis is loading the dataset in memory",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "READONLY You can't write against a read only replica.",
            "CLUSTERDOWN The cluster is down",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "MOVED 3999 127.0.0.1:6381",
            "ASK 3999 127.0.0.1:6381",
            "OOM command not allowed when used memory > 'maxmemory'.",
            // as redis-server 7.0 words them from inside a script
            "NOREPLICAS Not enough good replicas to write. script: edfb0b9e13f4845e7d148d8539b7a6bdc5c42c15, on @user_script:1.",
            "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk. Commands that may modify the data set are disabled, because this instance is configured to report errors during writes if RDB snapshotting fails (stop-writes-on-bgsave-error option). Please check the Redis logs for details about the RDB error. script: edfb0b9e13f4845e7d148d8539b7a6bdc5c42c15, on @user_script:1.",
        ] {
            assert_eq!(class(&reply(line)), ErrorClass::Unavailable, "{line}");
        }
    }

    /// The message is what a limiter's warning shows (`error = store unavailable: …`): it
    /// names the reply, so that an operator can tell memory from persistence from replicas.
    #[test]
    fn refused_writes_name_the_reply_in_the_message() {
        for (line, message) in [
            (
                "OOM command not allowed when used memory > 'maxmemory'. script: 5dfa, on @user_script:902.",
                "store unavailable: Redis: OOM",
            ),
            (
                "NOREPLICAS Not enough good replicas to write.",
                "store unavailable: Redis: NOREPLICAS",
            ),
            (
                "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
                "store unavailable: Redis: MISCONF",
            ),
            (
                "LOADING Redis is loading the dataset in memory",
                "store unavailable: Redis: busy loading",
            ),
            (
                "READONLY You can't write against a read only replica.",
                "store unavailable: Redis: read-only",
            ),
        ] {
            assert_eq!(classify(&reply(line)).to_string(), message, "{line}");
        }
    }

    #[test]
    fn busy_is_busy() {
        let err = reply(
            "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        );
        assert!(matches!(classify(&err), StoreError::Busy(m) if m.contains("BUSY")));
    }

    #[test]
    fn our_validation_replies_are_invalid_input() {
        let err = reply("ERR tollgate: cost exceeds capacity");
        assert_eq!(class(&err), ErrorClass::Invalid);
        assert!(classify(&err).to_string().contains("cost exceeds capacity"));
    }

    #[test]
    fn refused_authentication_is_a_loud_error_that_says_so() {
        for err in [
            reply("NOAUTH Authentication required."),
            reply("WRONGPASS invalid username-password pair or user is disabled."),
            RedisError::from((
                ErrorKind::AuthenticationFailed,
                "Password authentication failed",
            )),
        ] {
            let store_err = classify(&err);
            assert_eq!(store_err.class(), ErrorClass::Script, "{err}");
            let message = store_err.to_string();
            assert!(
                message.contains("authentication failed") && message.contains("primary_password"),
                "{message}"
            );
        }
    }

    #[test]
    fn other_replies_are_script_errors_and_not_noscript() {
        for line in [
            "ERR user_script:12: Script attempted to access nonexistent global variable 'x'",
            "WRONGTYPE Operation against a key holding the wrong kind of value",
            "NOPERM this user has no permissions to run the 'evalsha' command",
            "NOSCRIPT No matching script. Please use EVAL.",
        ] {
            let err = reply(line);
            assert_eq!(class(&err), ErrorClass::Script, "{line}");
            assert_eq!(is_noscript(&err), line.starts_with("NOSCRIPT"), "{line}");
        }
        let parse = RedisError::from((ErrorKind::Parse, "bad reply"));
        assert_eq!(class(&parse), ErrorClass::Script);
        assert!(!is_noscript(&parse));
    }
}
