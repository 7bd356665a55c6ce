//! The in-process store: dashmap and the core maths; degraded enforcement when it stands in for Redis.
