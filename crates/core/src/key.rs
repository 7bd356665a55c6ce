//! Keys: the identity of one quota. User-supplied parts are escaped, or hashed when long, so
//! they can never change a Redis hash slot, collide with another namespace, or grow unbounded.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// Largest user-supplied part accepted, in bytes. Longer input is refused rather than hashed,
/// so a hostile caller cannot make the limiter hash megabytes per request.
pub const MAX_KEY_PART_BYTES: usize = 64 * 1024;

/// Escaped parts longer than this are replaced by a hash.
const MAX_ENCODED_PART: usize = 128;

const MAX_NAMESPACE: usize = 64;

/// Why a key could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The namespace was empty, too long, or used a character outside `[a-z0-9_.-]`.
    #[error("namespace {0:?} must be 1-64 characters of [a-z0-9_.-]")]
    BadNamespace(String),
    /// A user-supplied part was empty.
    #[error("key part {index} is empty")]
    EmptyPart {
        /// Position of the part.
        index: usize,
    },
    /// A user-supplied part was longer than [`MAX_KEY_PART_BYTES`].
    #[error("key part {index} is {len} bytes, above the limit of {max}")]
    PartTooLong {
        /// Position of the part.
        index: usize,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// The identity of one quota bucket: a namespace chosen by the program and zero or more
/// user-supplied parts (user id, IP address, tenant, route, ...).
///
/// The encoded form uses only `[A-Za-z0-9._%~:-]` plus the separator `:`. Bytes outside
/// `[A-Za-z0-9._-]` are percent-escaped, so no part can contain `{`, `}`, `:` or control
/// bytes; parts whose escaped form exceeds 128 bytes become `~` and 32 hex digits of their
/// SHA-256. Distinct part lists give distinct keys.
///
/// ```
/// use tollgate_core::Key;
/// let k = Key::new("login", ["alice@example.com"]).unwrap();
/// assert_eq!(k.as_str(), "login:alice%40example.com");
/// let hostile = Key::new("login", ["a}{b:c\r\n"]).unwrap();
/// assert_eq!(hostile.as_str(), "login:a%7D%7Bb%3Ac%0D%0A");
/// assert_eq!(Key::global("search").as_str(), "search");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(Arc<str>);

impl Key {
    /// A key in `namespace` identified by `parts`, each arbitrary bytes.
    pub fn new<I, P>(namespace: &str, parts: I) -> Result<Self, KeyError>
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        check_namespace(namespace)?;
        let mut out = String::with_capacity(namespace.len() + 32);
        out.push_str(namespace);
        for (index, part) in parts.into_iter().enumerate() {
            let part = part.as_ref();
            if part.is_empty() {
                return Err(KeyError::EmptyPart { index });
            }
            if part.len() > MAX_KEY_PART_BYTES {
                return Err(KeyError::PartTooLong {
                    index,
                    len: part.len(),
                    max: MAX_KEY_PART_BYTES,
                });
            }
            out.push(':');
            encode_part(part, &mut out);
        }
        Ok(Self(out.into()))
    }

    /// The one global bucket of a namespace.
    ///
    /// # Panics
    /// If `namespace` is not valid (see [`KeyError::BadNamespace`]); use [`Key::new`] with no
    /// parts for a fallible version.
    pub fn global(namespace: &str) -> Self {
        Self::new(namespace, std::iter::empty::<&[u8]>()).expect("valid namespace")
    }

    /// The encoded key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.0)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn check_namespace(ns: &str) -> Result<(), KeyError> {
    let ok = !ns.is_empty()
        && ns.len() <= MAX_NAMESPACE
        && ns.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'.' | b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(KeyError::BadNamespace(ns.to_owned()))
    }
}

fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

fn encode_part(part: &[u8], out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let escaped_len: usize = part.iter().map(|&b| if is_plain(b) { 1 } else { 3 }).sum();
    if escaped_len > MAX_ENCODED_PART {
        let digest = Sha256::digest(part);
        out.push('~');
        for b in &digest[..16] {
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0xf)] as char);
        }
        return;
    }
    for &b in part {
        if is_plain(b) {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0xf)] as char);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_slot_and_separator_characters() {
        let k = Key::new("api", [b"{x}:\0\xff".as_slice()]).unwrap();
        assert_eq!(k.as_str(), "api:%7Bx%7D%3A%00%FF");
    }

    #[test]
    fn separates_parts_unambiguously() {
        let a = Key::new("ns", ["a:b"]).unwrap();
        let b = Key::new("ns", ["a", "b"]).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn hashes_long_parts_and_refuses_huge_ones() {
        let long = "x".repeat(500);
        let k = Key::new("ns", [&long]).unwrap();
        assert_eq!(k.as_str().len(), "ns:~".len() + 32);
        let huge = vec![b'a'; MAX_KEY_PART_BYTES + 1];
        assert!(matches!(
            Key::new("ns", [&huge]),
            Err(KeyError::PartTooLong { .. })
        ));
        assert!(matches!(
            Key::new("ns", [""]),
            Err(KeyError::EmptyPart { index: 0 })
        ));
        assert!(matches!(
            Key::new("Bad{ns}", ["a"]),
            Err(KeyError::BadNamespace(_))
        ));
    }
}
