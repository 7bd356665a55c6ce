//! Real redis-server processes for tests.
