//! The conformance suite: one set of tests, generic over any `Store`.
