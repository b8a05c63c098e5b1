//! Builds the shim that clones' QEMUs preload (`shim/tine-shim.c`)
//! as a shared object, embedded into the crate (`shim.rs`). The `cc`
//! crate finds the same C compiler Cargo links with, so this needs nothing
//! a Rust build on Linux does not already have.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "shim/tine-shim.c";
    println!("cargo:rerun-if-changed={src}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let so = out.join("tine-shim.so");
    let compiler = cc::Build::new()
        .cargo_metadata(false)
        .opt_level(2)
        .get_compiler();
    let status = Command::new(compiler.path())
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o"])
        .arg(&so)
        .arg(src)
        .status()
        .unwrap_or_else(|e| panic!("running {}: {e}", compiler.path().display()));
    assert!(status.success(), "compiling {src} failed: {status}");
}
