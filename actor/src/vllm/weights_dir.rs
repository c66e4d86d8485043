//! The directory where the vLLM actor writes each version for the engine
//! to load (`actor.vllm.weights_dir`), and what bapo may delete there.
//!
//! Why a marker: the actor prunes old versions as new ones load, and a
//! directory it does not own (a user's cache, the vLLM venv beside it)
//! must never be pruned. So bapo takes a directory only if it is new,
//! empty, or already marked as bapo's (`.bapo-weights`), creates it
//! private (0700: the weights are the learner's), and deletes only the
//! names it writes: version labels `I.V`, LoRA bases `base-<hex>`, and
//! their `.tmp-` forms while being written.
//!
//! Without `weights_dir`, an actor writes into a temporary directory of
//! its own (`bapo-vllm-*`), removed when it exits. One killed cannot
//! remove it, so each records its owner (pid and start time, [`OWNER`]),
//! and an actor starting removes those whose owner is gone.

use std::path::Path;

/// The file that marks a directory as bapo's weights directory.
pub const MARKER: &str = ".bapo-weights";
/// In an actor's own temporary directory: `<pid> <start time>` of the
/// actor (the start time tells a reused pid apart).
pub const OWNER: &str = ".bapo-owner";
/// The name prefix of an actor's own temporary directory.
pub const OWN_PREFIX: &str = "bapo-vllm-";

#[derive(Debug, thiserror::Error)]
pub enum WeightsDirError {
    #[error(
        "actor.vllm.weights_dir {0}: not empty and not bapo's (no {MARKER} file); bapo prunes \
         old versions there, so give it an empty or new directory"
    )]
    NotOurs(String),
    #[error("actor.vllm.weights_dir {0}: {1}")]
    Io(String, std::io::Error),
}

/// Takes `dir` for bapo's versions: created private if missing, refused
/// if it holds anything but bapo's own, marked.
pub fn claim(dir: &Path) -> Result<(), WeightsDirError> {
    let io = |e| WeightsDirError::Io(dir.display().to_string(), e);
    if !dir.exists() {
        create_private(dir).map_err(io)?;
    }
    let marked = dir.join(MARKER).exists();
    let empty = std::fs::read_dir(dir).map_err(io)?.next().is_none();
    if !marked && !empty {
        return Err(WeightsDirError::NotOurs(dir.display().to_string()));
    }
    std::fs::write(
        dir.join(MARKER),
        "bapo's vLLM weight versions; pruned as new ones load\n",
    )
    .map_err(io)
}

#[cfg(unix)]
fn create_private(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

#[cfg(not(unix))]
fn create_private(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)
}

/// Whether `name` is one bapo writes in its weights directory.
pub fn is_ours(name: &str) -> bool {
    let name = name.strip_prefix(".tmp-").unwrap_or(name);
    let is_label = name
        .split_once('.')
        .is_some_and(|(i, v)| is_digits(i) && is_digits(v));
    let is_base = name
        .strip_prefix("base-")
        .is_some_and(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_hexdigit()));
    is_label || is_base
}

fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_digit())
}

/// Removes bapo's version directories in `dir` that `keep` does not
/// name; anything else there is left alone.
pub fn prune(dir: &Path, keep: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if is_ours(&name) && !keep(&name) && e.path().is_dir() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A process's identity: its pid and start time (clock ticks after boot,
/// `/proc/<pid>/stat`); `None` once it is gone or a zombie.
fn identity(pid: u32) -> Option<(u32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    if rest.first() == Some(&"Z") {
        return None;
    }
    Some((pid, rest.get(19)?.parse().ok()?))
}

/// A new private temporary directory for this actor's versions, marked
/// as bapo's and as this process's; first removes those of actors that
/// are gone (killed before they could remove their own).
pub fn own_temporary() -> std::io::Result<tempfile::TempDir> {
    sweep(&std::env::temp_dir());
    let mut builder = tempfile::Builder::new();
    builder.prefix(OWN_PREFIX);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o700));
    }
    let dir = builder.tempdir()?;
    std::fs::write(dir.path().join(MARKER), "bapo's vLLM weight versions\n")?;
    if let Some((pid, start)) = identity(std::process::id()) {
        std::fs::write(dir.path().join(OWNER), format!("{pid} {start}\n"))?;
    }
    Ok(dir)
}

/// Removes the actors' own directories in `tmp` whose owner is gone; one
/// without an owner record (being made, or made elsewhere) is left.
pub fn sweep(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if !e.file_name().to_string_lossy().starts_with(OWN_PREFIX) {
            continue;
        }
        let Ok(owner) = std::fs::read_to_string(path.join(OWNER)) else {
            continue;
        };
        let mut it = owner.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(pid)), Some(Ok(start))) = (it.next(), it.next()) else {
            continue;
        };
        let gone = u32::try_from(pid).map_or(true, |pid| identity(pid) != Some((pid, start)));
        if gone && path.join(MARKER).exists() {
            tracing::info!("removing {} (its actor is gone)", path.display());
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bapo_names_are_ours() {
        for ours in ["0.1", "12.345", ".tmp-3.4", "base-00ff", ".tmp-base-abc"] {
            assert!(is_ours(ours), "{ours}");
        }
        for theirs in [
            "ext", "venv", ".venv", "hub", "1.", ".1", "1.2.3", "base-", "base-xyz",
        ] {
            assert!(!is_ours(theirs), "{theirs}");
        }
    }

    /// Pointed at a directory that holds someone else's files (a cache,
    /// a venv), the actor refuses it and deletes nothing; in its own it
    /// prunes only its versions.
    #[test]
    fn a_foreign_directory_is_refused_and_nothing_but_versions_pruned() {
        let root = tempfile::tempdir().unwrap();
        let cache = root.path().join("cache");
        std::fs::create_dir_all(cache.join("vllm-venv")).unwrap();
        let e = claim(&cache).unwrap_err().to_string();
        assert!(e.contains("not bapo's") && e.contains(MARKER), "{e}");
        assert!(cache.join("vllm-venv").exists());

        let own = root.path().join("weights");
        claim(&own).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&own).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
        }
        for d in ["1.1", "1.2", ".tmp-1.3", "base-0a", "ext", "notes"] {
            std::fs::create_dir_all(own.join(d)).unwrap();
        }
        claim(&own).unwrap(); // marked: taken again after a restart
        prune(&own, |n| n == "1.2" || n.starts_with("base-"));
        let mut left: Vec<String> = std::fs::read_dir(&own)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, [MARKER, "1.2", "base-0a", "ext", "notes"]);
    }

    /// A directory whose actor was killed (a real process, SIGKILL) is
    /// removed by the next actor; a living actor's, and one without an
    /// owner record, are not.
    #[test]
    fn the_directory_of_a_killed_actor_is_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let own = |name: &str, owner: Option<String>| {
            let d = tmp.path().join(format!("{OWN_PREFIX}{name}"));
            std::fs::create_dir_all(d.join("1.2")).unwrap();
            std::fs::write(d.join(MARKER), "").unwrap();
            if let Some(o) = owner {
                std::fs::write(d.join(OWNER), o).unwrap();
            }
            d
        };
        let mut killed = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let (pid, start) = identity(killed.id()).unwrap();
        killed.kill().unwrap();
        killed.wait().unwrap();
        let dead = own("dead", Some(format!("{pid} {start}")));
        let (me, my_start) = identity(std::process::id()).unwrap();
        let alive = own("alive", Some(format!("{me} {my_start}")));
        let reused = own("reused", Some(format!("{me} {}", my_start + 1)));
        let unowned = own("unowned", None);
        sweep(tmp.path());
        assert!(!dead.exists() && !reused.exists());
        assert!(alive.exists() && unowned.exists());
    }
}
