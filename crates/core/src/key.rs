//! Keys: the identity of one quota. User-supplied parts are escaped, or hashed when long (and
//! the whole key is hashed when it has too many parts), so they can never change a Redis hash
//! slot, collide with another namespace, or grow unbounded.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// Largest user-supplied part accepted, in bytes. Longer input is refused rather than hashed,
/// so a hostile caller cannot make the limiter hash megabytes per request.
pub const MAX_KEY_PART_BYTES: usize = 64 * 1024;

/// Escaped parts longer than this are replaced by a hash.
const MAX_ENCODED_PART: usize = 128;

/// Encoded keys longer than this (namespace, separators and encoded parts) are replaced by the
/// namespace, `:~~` and a hash of the whole encoding, so the number of parts cannot make a key
/// unbounded. Every key of up to 7 parts of at most 128 escaped bytes stays below it.
const MAX_ENCODED_KEY: usize = 1024;

const HEX: &[u8; 16] = b"0123456789ABCDEF";

const MAX_NAMESPACE: usize = 64;

/// Why a key could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The namespace was empty, too long, or used a character outside `[a-z0-9_.-]`.
    #[error("namespace {0:?} must be 1-64 characters of [a-z0-9_.-]")]
    BadNamespace(String),
    /// A store's key prefix was too long, or used a character outside `[A-Za-z0-9:_.-]` (a
    /// brace would open a Cluster hash tag).
    #[error("key prefix {0:?} must be at most 64 bytes of [A-Za-z0-9:_.-]")]
    BadPrefix(String),
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
/// SHA-256. A key whose encoding (namespace, separators and encoded parts) would exceed 1024
/// bytes — many parts — becomes the namespace, `:~~` and 32 hex digits of the SHA-256 of that
/// whole encoding, so no key is longer than 1024 bytes. Distinct part lists give distinct keys.
///
/// ```
/// use tollgate_core::Key;
/// let k = Key::new("login", ["alice@example.com"]).unwrap();
/// assert_eq!(k.as_str(), "login:alice%40example.com");
/// let hostile = Key::new("login", ["a}{b:c\r\n"]).unwrap();
/// assert_eq!(hostile.as_str(), "login:a%7D%7Bb%3Ac%0D%0A");
/// assert_eq!(Key::global("search").as_str(), "search");
/// let many = Key::new("path", ["seg"; 1000]).unwrap();
/// assert_eq!(many.as_str().len(), "path:~~".len() + 32);
/// ```
#[derive(Clone, Eq, PartialOrd, Ord)]
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
        // Set once the encoding has grown past `MAX_ENCODED_KEY`: from then on it is hashed as
        // it goes, and `out` only holds the part being encoded.
        let mut overflow: Option<Sha256> = None;
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
            if let Some(hasher) = &mut overflow {
                out.clear();
                out.push(':');
                encode_part(part, &mut out);
                hasher.update(out.as_bytes());
            } else {
                out.push(':');
                encode_part(part, &mut out);
                if out.len() > MAX_ENCODED_KEY {
                    let mut hasher = Sha256::new();
                    hasher.update(out.as_bytes());
                    overflow = Some(hasher);
                }
            }
        }
        if let Some(hasher) = overflow {
            out.clear();
            out.push_str(namespace);
            // No encoded part starts with `~~` (a plain `~` is escaped, a hashed part is `~`
            // and hex), so this cannot meet a key of fewer parts.
            out.push_str(":~~");
            push_hex(&hasher.finalize()[..16], &mut out);
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

/// Equal encoded strings; a clone of the same `Key` is equal without reading the string (map
/// lookups with the caller's own `Key` values skip the comparison).
impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

/// Hashes the encoded string, as the derived implementation did (consistent with `Eq`).
impl std::hash::Hash for Key {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

/// A map keyed by `Key` can be searched by the encoded string (as a key announced by another
/// process arrives): `Key` hashes and compares as that string.
impl std::borrow::Borrow<str> for Key {
    fn borrow(&self) -> &str {
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

/// Appends `bytes` as upper-case hex digits.
fn push_hex(bytes: &[u8], out: &mut String) {
    for b in bytes {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
}

fn encode_part(part: &[u8], out: &mut String) {
    let escaped_len: usize = part.iter().map(|&b| if is_plain(b) { 1 } else { 3 }).sum();
    if escaped_len > MAX_ENCODED_PART {
        let digest = Sha256::digest(part);
        out.push('~');
        push_hex(&digest[..16], out);
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

    #[test]
    fn keeps_keys_up_to_the_bound_and_hashes_longer_ones_whole() {
        // "ns" + 300 × ":ab" + ":" + 121 bytes = 1024 bytes: kept as is.
        let mut parts = vec!["ab"; 300];
        let last = "c".repeat(121);
        parts.push(&last);
        let k = Key::new("ns", &parts).unwrap();
        assert_eq!(k.as_str().len(), MAX_ENCODED_KEY);
        assert_eq!(k.as_str().split(':').count(), parts.len() + 1);
        // One byte more: hashed whole.
        let longer = format!("{last}c");
        *parts.last_mut().unwrap() = &longer;
        let k = Key::new("ns", &parts).unwrap();
        let digest = k.as_str().strip_prefix("ns:~~").expect("hashed whole");
        assert_eq!(digest.len(), 32);
        assert!(digest.bytes().all(|b| HEX.contains(&b)));
    }

    #[test]
    fn bounds_keys_of_any_number_of_parts_and_keeps_them_distinct() {
        let huge = vec![b'{'; MAX_KEY_PART_BYTES];
        let cases: Vec<(&str, Vec<&[u8]>)> = vec![
            ("ns", vec![b"x"; 100_000]),
            ("ns", vec![b"x"; 100_001]),
            ("ns", vec![b"y"; 100_000]),
            ("other", vec![b"x"; 100_000]),
            ("ns", vec![b"x:x"; 50_000]),
            ("ns", vec![huge.as_slice(); 40]),
            ("ns", vec![huge.as_slice(); 41]),
        ];
        let mut seen = std::collections::HashSet::new();
        for (ns, parts) in &cases {
            let k = Key::new(ns, parts).unwrap();
            assert_eq!(k.as_str().len(), ns.len() + ":~~".len() + 32, "{k:?}");
            assert!(k.as_str().starts_with(&format!("{ns}:~~")), "{k:?}");
            assert!(seen.insert(k), "{ns} {} parts", parts.len());
        }
        // Refusals still name the offending part, however many come before it.
        let mut parts = vec![b"x".as_slice(); 10_000];
        parts.push(b"");
        assert_eq!(
            Key::new("ns", &parts),
            Err(KeyError::EmptyPart { index: 10_000 })
        );
    }

    #[test]
    fn a_whole_key_hash_never_meets_a_hashed_or_escaped_part() {
        let many = Key::new("ns", vec!["x"; 1000]).unwrap();
        let digest = many.as_str().strip_prefix("ns:~~").unwrap();
        // A part that looks like the hash is escaped, so it cannot give the same key.
        let look_alike = Key::new("ns", [format!("~~{digest}")]).unwrap();
        assert_eq!(look_alike.as_str(), format!("ns:%7E%7E{digest}"));
        // The whole-key hash covers the same bytes as the key it replaces.
        let mut encoded = String::from("ns");
        for _ in 0..1000 {
            encoded.push_str(":x");
        }
        let mut want = String::new();
        push_hex(&Sha256::digest(encoded.as_bytes())[..16], &mut want);
        assert_eq!(digest, want);
    }
}
