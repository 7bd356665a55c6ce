//! A limiter that follows many distinct policies over its life (an automated publisher: a new
//! generation every minute for weeks) keeps no memory for the policies it no longer uses.
//! Measured with a global allocator that counts live bytes.

// A counting global allocator needs `unsafe impl GlobalAlloc`; it only forwards to `System`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use tollgate::{FailureMode, Limiter, LocalStore, Policy, Rate};

struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

fn size(layout: Layout) -> i64 {
    i64::try_from(layout.size()).unwrap_or(i64::MAX)
}

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(size(layout), Ordering::Relaxed);
        // SAFETY: same layout contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(size(layout), Ordering::Relaxed);
        // SAFETY: `ptr` came from `System.alloc` with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn generation(g: u64) -> Policy {
    Policy::token_bucket(1_000_000 + g % 7, Rate::per_second(1_000))
        .unwrap()
        .with_generation(g)
}

/// Switches `limiter` through generations `from..to`, deciding once under each.
async fn follow(limiter: &Limiter, from: u64, to: u64) {
    for g in from..to {
        limiter.set_policy(generation(g));
        assert_eq!(limiter.policy().generation(), g);
        assert!(limiter.check(["k"], 1).await.unwrap().allowed);
    }
}

#[tokio::test(flavor = "current_thread")]
async fn policies_no_longer_in_force_are_freed() {
    for mode in [FailureMode::Closed, FailureMode::degraded(3)] {
        let limiter = Limiter::builder("gen", generation(0))
            .store(Arc::new(LocalStore::new()))
            .failure_mode(mode)
            .build()
            .unwrap();
        // Warm up: the store's key, the runtime, any lazily built state.
        follow(&limiter, 1, 1_000).await;
        let before = LIVE.load(Ordering::Relaxed);
        // Two weeks of one publication a minute.
        follow(&limiter, 1_000, 21_160).await;
        let grown = LIVE.load(Ordering::Relaxed) - before;
        eprintln!(
            "{}: {grown} bytes still held after 20,160 more distinct policies",
            limiter.failure_mode().as_str()
        );
        assert!(
            grown < 16 * 1024,
            "{grown} bytes kept for policies no longer in force"
        );
    }
}
