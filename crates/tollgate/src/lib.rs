//! The facade: a Limiter per protected operation.
