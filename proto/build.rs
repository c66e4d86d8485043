//! Generates the `bapo.v1` types and services.
//!
//! protoc comes from `protoc-bin-vendored`, so a fresh machine needs nothing
//! installed; an explicit `PROTOC` in the environment still wins.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded; nothing reads the
        // environment concurrently.
        unsafe { env::set_var("PROTOC", protoc) };
    }
    let out = PathBuf::from(env::var("OUT_DIR")?);
    println!("cargo:rerun-if-changed=bapo.proto");
    println!("cargo:rerun-if-changed=wal.proto");
    println!("cargo:rerun-if-changed=reward.proto");
    println!("cargo:rerun-if-changed=environment.proto");
    tonic_prost_build::configure()
        // `bytes` fields as `bytes::Bytes`: decoded without copying out of
        // the receive buffer, cloned by reference count.
        .bytes(".")
        .file_descriptor_set_path(out.join("bapo_descriptor.bin"))
        .compile_protos(
            &[
                "bapo.proto",
                "wal.proto",
                "reward.proto",
                "environment.proto",
            ],
            &["."],
        )?;
    Ok(())
}
