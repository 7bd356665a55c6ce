//! Builds the clock shim (`shim/clockshim.c`) as an LD_PRELOAD shared object and exposes
//! its path as `env!("TOLLGATE_CLOCKSHIM")`.
//!
//! `cc` builds static archives; a preload library must be a `.so`, so the compiler `cc`
//! finds is invoked directly with `-shared -fPIC`.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=shim/clockshim.c");
    println!("cargo:rerun-if-changed=build.rs");

    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os != "linux" {
        // The shim relies on Linux syscalls; clock control reports itself unavailable.
        println!("cargo:rustc-env=TOLLGATE_CLOCKSHIM=");
        return;
    }

    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let source = manifest_dir.join("shim").join("clockshim.c");
    let shared_object = out_dir.join("libtollgate_clockshim.so");

    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    let mut command: Command = compiler.to_command();
    command
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-o"])
        .arg(&shared_object)
        .arg(&source);
    let output = command
        .output()
        .unwrap_or_else(|err| panic!("failed to run the C compiler ({command:?}): {err}"));
    assert!(
        output.status.success(),
        "compiling the clock shim failed ({command:?}): {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    if !output.stderr.is_empty() {
        println!(
            "cargo:warning=clock shim compiler output: {}",
            String::from_utf8_lossy(&output.stderr).replace('\n', " ")
        );
    }

    println!(
        "cargo:rustc-env=TOLLGATE_CLOCKSHIM={}",
        shared_object.display()
    );
}
