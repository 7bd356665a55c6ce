//! A global allocator that counts this thread's allocations, for tests that pin what a path
//! allocates (none on the local store's hot path; at most one more than redis-rs's own for a
//! Redis decision).
//!
//! ```
//! use tollgate_testkit::alloc::{Counting, allocations};
//!
//! #[global_allocator]
//! static GLOBAL: Counting = Counting;
//!
//! let before = allocations();
//! let boxed = Box::new(42_u64);
//! assert_eq!(allocations() - before, 1);
//! # drop(boxed);
//! ```

// A counting global allocator needs `unsafe impl GlobalAlloc`; it only forwards to `System`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// Forwards every call to the system allocator and counts the allocations each thread makes
/// (reallocations and frees are not counted). Install it in a test binary with
/// `#[global_allocator]`; read the count with [`allocations`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Counting;

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // `try_with`: an allocation while the thread's locals are torn down is not counted.
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocations this thread has made through [`Counting`] so far (0 if it is not the global
/// allocator).
pub fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}
