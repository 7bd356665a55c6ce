//! `Policy::from_str` on arbitrary text: every input is either a valid policy or a typed
//! `SpecError`; never a panic. Whatever parses is usable: its limit is within the exact range,
//! the cost checks agree with it, and a fresh bucket admits the whole limit at once.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate_core::{MAX_EXACT, Policy, algorithm};

/// Redis `TIME` in 2023, in microseconds.
const NOW: u64 = 1_700_000_000_000_000;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match text.parse::<Policy>() {
        Ok(p) => {
            let limit = p.limit();
            assert!((1..=MAX_EXACT).contains(&limit), "{text:?} -> {p}");
            assert!(p.check_cost(0).is_err());
            assert!(p.check_cost(limit).is_ok());
            assert!(p.check_cost(limit + 1).is_err());
            assert_eq!(
                p.fingerprint(),
                p.with_generation(p.generation() ^ 1).fingerprint(),
                "the fingerprint ignores the generation"
            );
            assert!(!p.to_string().is_empty());
            let mut state = None;
            let out = algorithm::apply(&mut state, &p, NOW, limit, true).expect("valid cost");
            assert!(out.decision.allowed, "{p}: a fresh bucket admits its limit");
            assert_eq!(out.decision.remaining, 0, "{p}");
            assert!(out.ttl_micros.is_some_and(|t| t > 0), "{p}: {out:?}");
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
