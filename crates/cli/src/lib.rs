//! The tollgate command-line tool.
