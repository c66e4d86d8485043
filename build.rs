//! Records the commit the `bapo` binary is built from (`BAPO_BUILD_COMMIT`,
//! `-dirty` when tracked files differ from it): a study run from a copied
//! binary then names the code it ran, not whatever the tree holds by the
//! time it runs. Empty outside a git checkout.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    // A commit moves HEAD's branch (refs, or packed-refs after a gc) and
    // rewrites the index; an edit touches a crate's sources.
    for path in [
        ".git/HEAD",
        ".git/index",
        ".git/refs/heads",
        ".git/packed-refs",
        "Cargo.lock",
        "src",
        "proto",
        "tasks/src",
        "policy/src",
        "actor/src",
        "buffer-service/src",
        "learner/src",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
    let commit = git(&["rev-parse", "--short", "HEAD"]).map(|head| {
        let dirty =
            git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        if dirty { format!("{head}-dirty") } else { head }
    });
    println!(
        "cargo:rustc-env=BAPO_BUILD_COMMIT={}",
        commit.unwrap_or_default()
    );
}
