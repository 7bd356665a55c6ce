//! Real redis-server processes for tests, and the conformance suite every Store must pass.
