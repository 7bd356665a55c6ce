//! The Redis store: one atomic Lua script per algorithm on Redis time.
