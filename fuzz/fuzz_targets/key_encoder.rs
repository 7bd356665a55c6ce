//! `Key::new` on arbitrary namespaces and part lists. Properties:
//! - refusals are exactly the documented ones (bad namespace, then the first empty or
//!   over-long part, by index);
//! - an accepted key holds only `[A-Za-z0-9._%~:-]` (no `{`, `}`, control or non-ASCII bytes),
//!   is at most 1024 bytes and at most namespace + 129 bytes per part long; either it has one
//!   `:`-separated segment per part, each decoding back to its part or being `~` and 32 hex
//!   digits (a long part's hash), or (an encoding that would pass 1024 bytes) it is the
//!   namespace, `:~~` and 32 hex digits (the whole key's hash);
//! - distinct inputs never meet in one key, within the input and across the whole run.
#![no_main]

use std::collections::HashMap;
use std::sync::Mutex;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tollgate_core::{Key, KeyError, MAX_KEY_PART_BYTES};

#[derive(Arbitrary, Debug)]
struct Input {
    namespace: String,
    parts: Vec<Vec<u8>>,
    other: Vec<Vec<u8>>,
    /// Appends a part of `len % (MAX + 2)` copies of one byte: reaches the size limits, which
    /// libFuzzer's input length never would.
    big: Option<(u8, u32)>,
}

/// Every key seen in this run and the input that made it (cleared when it grows large).
static SEEN: Mutex<Option<HashMap<String, (String, Vec<Vec<u8>>)>>> = Mutex::new(None);

fn namespace_ok(ns: &str) -> bool {
    !ns.is_empty()
        && ns.len() <= 64
        && ns.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'.' | b'-')
        })
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Decodes one escaped segment; `None` if it is not a valid escape.
fn decode(segment: &str) -> Option<Vec<u8>> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = hex(*bytes.get(i + 1)?)?;
            let lo = hex(*bytes.get(i + 2)?)?;
            out.push(hi << 4 | lo);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

fn check(ns: &str, parts: &[Vec<u8>]) -> Option<Key> {
    let first_bad = parts
        .iter()
        .position(|p| p.is_empty() || p.len() > MAX_KEY_PART_BYTES);
    match Key::new(ns, parts) {
        Err(KeyError::BadNamespace(n)) => {
            assert!(!namespace_ok(ns) && n == ns);
            None
        }
        Err(KeyError::EmptyPart { index }) => {
            assert!(namespace_ok(ns) && first_bad == Some(index) && parts[index].is_empty());
            None
        }
        Err(KeyError::PartTooLong { index, len, max }) => {
            assert!(namespace_ok(ns) && first_bad == Some(index));
            assert_eq!((len, max), (parts[index].len(), MAX_KEY_PART_BYTES));
            None
        }
        Err(e) => panic!("undocumented key error {e:?}"),
        Ok(key) => {
            assert!(namespace_ok(ns) && first_bad.is_none());
            let s = key.as_str();
            assert!(
                s.bytes().all(|b| b.is_ascii_alphanumeric()
                    || matches!(b, b'.' | b'_' | b'%' | b'~' | b':' | b'-')),
                "{s:?}"
            );
            assert!(s.len() <= ns.len() + parts.len() * 129, "{} bytes", s.len());
            assert!(s.len() <= 1024, "{} bytes", s.len());
            if let Some(digest) = s.strip_prefix(ns).and_then(|r| r.strip_prefix(":~~")) {
                // the whole key hashed: only when its encoding would pass 1024 bytes
                assert_eq!(digest.len(), 32, "{s:?}");
                assert!(digest.bytes().all(|b| hex(b).is_some()), "{s:?}");
                // each segment is at most 128 bytes and at most 3 per input byte (escapes)
                let most: usize = parts.iter().map(|p| 1 + (3 * p.len()).min(128)).sum();
                assert!(ns.len() + most > 1024, "{s:?} from {} parts", parts.len());
                return Some(key);
            }
            let segments: Vec<&str> = s.split(':').collect();
            assert_eq!(segments.len(), parts.len() + 1, "{s:?}");
            assert_eq!(segments[0], ns);
            for (segment, part) in segments[1..].iter().zip(parts) {
                assert!(segment.len() <= 128, "{segment:?}");
                if let Some(digest) = segment.strip_prefix('~') {
                    assert_eq!(digest.len(), 32, "{segment:?}");
                    assert!(digest.bytes().all(|b| hex(b).is_some()), "{segment:?}");
                } else {
                    assert_eq!(
                        decode(segment).as_deref(),
                        Some(part.as_slice()),
                        "{segment:?}"
                    );
                }
            }
            Some(key)
        }
    }
}

fn remember(key: &Key, ns: &str, parts: &[Vec<u8>]) {
    let mut seen = SEEN.lock().unwrap();
    let map = seen.get_or_insert_with(HashMap::new);
    if map.len() > 1 << 20 {
        map.clear();
    }
    match map.get(key.as_str()) {
        Some((n, p)) => assert!(
            n == ns && p.as_slice() == parts,
            "{key:?} made from both {n:?} {p:?} and {ns:?} {parts:?}"
        ),
        None => {
            map.insert(key.as_str().to_owned(), (ns.to_owned(), parts.to_vec()));
        }
    }
}

fuzz_target!(|input: Input| {
    let mut parts = input.parts;
    if let Some((byte, len)) = input.big {
        let len = len as usize % (MAX_KEY_PART_BYTES + 2);
        parts.push(vec![byte; len]);
    }
    let a = check(&input.namespace, &parts);
    let b = check(&input.namespace, &input.other);
    if let (Some(a), Some(b)) = (&a, &b) {
        assert_eq!(parts == input.other, a == b, "{a:?} {b:?}");
    }
    // Only small inputs are remembered, to keep the run's memory bounded.
    if let Some(a) = &a
        && parts.iter().map(Vec::len).sum::<usize>() <= 4096
    {
        remember(a, &input.namespace, &parts);
    }
    if let Some(b) = &b {
        remember(b, &input.namespace, &input.other);
    }
});
