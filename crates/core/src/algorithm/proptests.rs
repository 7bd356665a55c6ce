//! Property tests of the algorithms' invariants over random request sequences.
