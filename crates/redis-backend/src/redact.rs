//! Passwords out of error messages, logs and `Debug` output.

use std::fmt;

/// `url` with its password, if any, replaced by `***`: fit for an error message or a log line.
///
/// The password of `user:password@` is replaced (up to the last `@`, so an unescaped `@` or
/// `/` in the password is hidden too), and so is a `pass=` query parameter (as in
/// `redis+unix:///path?pass=...`). A string that is not a URL comes back as it is.
///
/// ```
/// use tollgate_redis::redact_url;
///
/// assert_eq!(
///     redact_url("redis://limiter:s3cret@10.0.0.1:6379/0"),
///     "redis://limiter:***@10.0.0.1:6379/0"
/// );
/// assert_eq!(redact_url("redis://10.0.0.1:6379"), "redis://10.0.0.1:6379");
/// ```
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let rest = match rest.rsplit_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{user}:***@{host}")
        }
        _ => rest.to_owned(),
    };
    let rest = match rest.split_once('?') {
        Some((path, query)) => {
            let query: Vec<&str> = query
                .split('&')
                .map(|pair| {
                    if pair.starts_with("pass=") {
                        "pass=***"
                    } else {
                        pair
                    }
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => rest,
    };
    format!("{scheme}://{rest}")
}

/// URLs whose `Debug` output shows them through [`redact_url`].
#[derive(Clone, Default, PartialEq, Eq)]
pub(crate) struct RedactedUrls(pub(crate) Vec<String>);

impl fmt::Debug for RedactedUrls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|url| redact_url(url)))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact_url("redis://limiter:s3cret@127.0.0.1:6379/0"),
            "redis://limiter:***@127.0.0.1:6379/0"
        );
        assert_eq!(
            redact_url("rediss://:s3cret@host:6380"),
            "rediss://:***@host:6380"
        );
        assert_eq!(
            redact_url("redis://u:p@ss@host:1/2"),
            "redis://u:***@host:1/2"
        );
        assert_eq!(
            redact_url("redis://u:pa/ss@host:1/2"),
            "redis://u:***@host:1/2"
        );
        assert_eq!(
            redact_url("redis+unix:///tmp/redis.sock?db=1&pass=s3cret&user=u"),
            "redis+unix:///tmp/redis.sock?db=1&pass=***&user=u"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(redact_url("redis://user@host"), "redis://user@host");
        assert_eq!(redact_url("not a url"), "not a url");
        let urls = RedactedUrls(vec![
            "redis://:s3cret@127.0.0.1:26379".to_owned(),
            "redis://127.0.0.1:26380".to_owned(),
        ]);
        let shown = format!("{urls:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("127.0.0.1:26380"), "{shown}");
    }
}
