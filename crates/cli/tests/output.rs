//! What the `tollgate` binary writes and how it exits, as a user runs it: an error reported
//! once, a reader that closes the pipe early, a policy file that would limit nothing.

use std::process::Command;

fn tollgate() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.env("RUST_BACKTRACE", "0").env("RUST_LOG", "error");
    cmd
}

/// A cost above the policy's capacity was reported twice: `invalid request: cost 11 exceeds
/// the policy's maximum burst of 10`, then again under `Caused by:` as `cost 11 exceeds …`
/// (the store's error names its cause in its own message and returns it as its source).
#[test]
fn a_cost_above_capacity_is_reported_once() {
    let out = tollgate()
        .args([
            "check",
            "--policy",
            "token-bucket:capacity=10,rate=2",
            "--key",
            "user:1",
            "--cost",
            "11",
        ])
        .output()
        .expect("the tollgate binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(out.stdout.is_empty(), "no decision is printed");
    assert_eq!(
        stderr
            .matches("cost 11 exceeds the policy's maximum burst of 10")
            .count(),
        1,
        "{stderr}"
    );
    // nothing lost: what failed, and why
    assert!(stderr.starts_with("Error: no decision"), "{stderr}");
    assert!(stderr.contains("invalid request: cost 11"), "{stderr}");
}
