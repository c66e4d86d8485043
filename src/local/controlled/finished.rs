//! Finished runs kept on disk, one file each, so a study killed after
//! hours loses only the runs it had in flight: the rerun with the same
//! flags reads the finished ones back and makes the rest. A study can also
//! grow (more seeds, more arms, more warm starts) without redoing what it
//! already has.
//!
//! A run is reused only under the same fingerprint: a hash of everything
//! that changes its numbers (the setting as the study records it, the
//! arm, and the bytes of its warm start). Anything else is run again and
//! overwritten. The code is not in the fingerprint (a fix to the report
//! must not redo a day of runs): each file records the commit it was made
//! at, and `study.json.gz` lists them all, so mixed commits are visible.
//!
//! Files are gzip'd JSON (`.json.gz`; `zcat` or Python's `gzip` reads
//! them): a study's every update of every run is tens of megabytes of
//! text, and the tree must stay small enough to travel. Plain `.json`
//! files of older studies are still read.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use sha2::{Digest, Sha256};

use super::episode::ArmRun;

/// The directory of finished runs and the fingerprints they must match.
pub struct Finished {
    dir: PathBuf,
    /// Hash of the setting every run shares.
    setting: String,
    /// Hash of each warm start's files, by index.
    warm: Vec<String>,
    commit: Option<String>,
}

/// One finished run (or measurement) as stored.
#[derive(Serialize, Deserialize)]
struct Stored<T> {
    fingerprint: String,
    commit: Option<String>,
    run: T,
}

/// Where measurements made before any run are kept, inside the directory
/// of finished runs (so it travels with them).
const BEFORE_RUNS: &str = "before-runs";

impl Finished {
    /// `setting`: what every run shares, as the study records it;
    /// `inits`: the warm starts' directories.
    pub fn open(
        dir: PathBuf,
        setting: &serde_json::Value,
        inits: &[PathBuf],
        commit: Option<String>,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let warm = inits
            .iter()
            .map(|d| hash_dir(d))
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            dir,
            setting: hex(&Sha256::digest(setting.to_string())),
            warm,
            commit,
        })
    }

    /// The run of `arm` (its definition serialised) from warm start `warm`
    /// on `seed`, if one finished under the same fingerprint.
    pub fn load(&self, arm: &impl Serialize, arm_id: &str, warm: u64, seed: u64) -> Option<ArmRun> {
        self.read(&self.path(arm_id, warm, seed), arm, warm)
    }

    /// Keeps `run` (written aside, then renamed: a kill mid-write leaves
    /// the old file or none, never half of one).
    pub fn save(&self, arm: &impl Serialize, run: &ArmRun) -> anyhow::Result<()> {
        let path = self.path(&run.arm, run.warm, run.seed);
        self.write(&path, arm, run.warm, run)
    }

    /// A measurement of warm start `warm` made before any run (its own
    /// row, Gate 0), if one was kept under the same fingerprint: `key`
    /// holds whatever besides the setting changes it. A study restarted in
    /// every session of a multi-session study would otherwise measure the
    /// same warm starts again, on one core, before its runs.
    pub fn load_measure<T: DeserializeOwned>(
        &self,
        name: &str,
        key: &impl Serialize,
        warm: u64,
    ) -> Option<T> {
        self.read(&self.measure_path(name, warm), key, warm)
    }

    /// Keeps a measurement of warm start `warm` as [`Self::load_measure`]
    /// reads it back.
    pub fn save_measure<T: Serialize>(
        &self,
        name: &str,
        key: &impl Serialize,
        warm: u64,
        value: &T,
    ) -> anyhow::Result<()> {
        let path = self.measure_path(name, warm);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        self.write(&path, key, warm, value)
    }

    fn read<T: DeserializeOwned>(&self, path: &Path, key: &impl Serialize, warm: u64) -> Option<T> {
        let text = read_text(path).ok()?;
        let stored: Stored<T> = match serde_json::from_str(&text) {
            Ok(s) => s,
            Err(e) => {
                eprintln!(
                    "study: {} unreadable ({e}); running it again",
                    path.display()
                );
                return None;
            }
        };
        if stored.fingerprint != self.fingerprint(key, warm).ok()? {
            eprintln!(
                "study: {} was made under another setting; running it again",
                path.display()
            );
            return None;
        }
        Some(stored.run)
    }

    fn write<T: Serialize>(
        &self,
        path: &Path,
        key: &impl Serialize,
        warm: u64,
        value: &T,
    ) -> anyhow::Result<()> {
        let stored = Stored {
            fingerprint: self.fingerprint(key, warm)?,
            commit: self.commit.clone(),
            run: value,
        };
        write_gz_aside(path, serde_json::to_string(&stored)?)
    }

    /// The commits the finished runs of `keys` were made at, each once.
    pub fn commits(&self, keys: &[(String, u64, u64)]) -> Vec<String> {
        let mut out: Vec<String> = keys
            .iter()
            .filter_map(|(arm, w, s)| read_text(&self.path(arm, *w, *s)).ok())
            .filter_map(|t| serde_json::from_str::<Stored<ArmRun>>(&t).ok()?.commit)
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The files of the runs of `keys`, relative to the study's directory
    /// (what `study.json.gz` lists).
    pub fn files(&self, keys: &[(String, u64, u64)]) -> Vec<String> {
        let parent = self.dir.parent().unwrap_or(Path::new(""));
        keys.iter()
            .map(|(arm, w, s)| {
                let path = self.path(arm, *w, *s);
                let rel = path.strip_prefix(parent).unwrap_or(&path);
                rel.to_string_lossy().into_owned()
            })
            .collect()
    }

    fn fingerprint(&self, arm: &impl Serialize, warm: u64) -> anyhow::Result<String> {
        let warm = self
            .warm
            .get(warm as usize)
            .with_context(|| format!("no warm start {warm}"))?;
        let arm = serde_json::to_string(arm)?;
        Ok(hex(&Sha256::digest(format!(
            "{}\n{arm}\n{warm}",
            self.setting
        ))))
    }

    fn path(&self, arm: &str, warm: u64, seed: u64) -> PathBuf {
        self.dir.join(format!("{arm}-w{warm}-s{seed}.json.gz"))
    }

    fn measure_path(&self, name: &str, warm: u64) -> PathBuf {
        self.dir
            .join(BEFORE_RUNS)
            .join(format!("{name}-w{warm}.json.gz"))
    }
}

/// Hash of a warm start: its files' names and bytes, in name order.
fn hash_dir(dir: &Path) -> anyhow::Result<String> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    names.sort();
    let mut h = Sha256::new();
    for path in names.iter().filter(|p| p.is_file()) {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        h.update(
            path.file_name()
                .map(|n| n.as_encoded_bytes())
                .unwrap_or_default(),
        );
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `path` aside (`<path>.partial`), then renames it into place: a
/// kill mid-write leaves the old file or none, never half of one that a
/// rerun or a reader would take for the whole.
pub fn write_aside(path: &std::path::Path, text: impl AsRef<[u8]>) -> anyhow::Result<()> {
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("moving {}", path.display()))
}

/// [`write_aside`] of `text` gzip'd (best compression: written once,
/// read rarely, carried often).
pub fn write_gz_aside(path: &Path, text: String) -> anyhow::Result<()> {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(text.as_bytes())?;
    write_aside(path, gz.finish()?)
}

/// The text of `path`, gunzipped when it ends in `.gz`; a `.json.gz` that
/// is missing falls back to the plain `.json` an older study wrote.
pub fn read_text(path: &Path) -> anyhow::Result<String> {
    use std::io::Read;
    let is_gz = path.extension().is_some_and(|e| e == "gz");
    if !is_gz || (!path.exists() && path.with_extension("").exists()) {
        let plain = if is_gz {
            path.with_extension("")
        } else {
            path.to_path_buf()
        };
        return std::fs::read_to_string(&plain)
            .with_context(|| format!("reading {}", plain.display()));
    }
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .with_context(|| format!("decompressing {}", path.display()))?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::controlled::episode::{Probe, StepRow};

    fn run() -> ArmRun {
        ArmRun {
            arm: "p2".into(),
            warm: 0,
            seed: 3,
            probes: vec![Probe {
                step: 0,
                entropy: 0.1 + 0.2,
                val_accuracy: 1.0 / 3.0,
                sampled_accuracy: Some(0.7),
            }],
            steps: vec![StepRow {
                step: 0,
                update: 1,
                reward: std::f64::consts::PI,
                pos_fraction: Some(0.352),
                ..StepRow::default()
            }],
            test_accuracy: 0.076,
            test_pass_at_k: None,
            seconds: 191.5,
        }
    }

    /// A warm start directory with one file of the given bytes.
    fn warm(root: &Path, bytes: &[u8]) -> PathBuf {
        let dir = root.join("warm");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
        dir
    }

    fn open(root: &Path, setting: serde_json::Value) -> Finished {
        let inits = [root.join("warm")];
        Finished::open(
            root.join("finished"),
            &setting,
            &inits,
            Some("abc1234".into()),
        )
        .unwrap()
    }

    #[test]
    fn a_finished_run_reads_back_to_the_same_bits_under_its_fingerprint() {
        let root = tempfile::tempdir().unwrap();
        warm(root.path(), b"weights");
        let setting = serde_json::json!({"steps": 60, "lr": 1e-4});
        let arm = serde_json::json!({"id": "p2", "updates": 2});
        let store = open(root.path(), setting.clone());
        assert_eq!(store.load(&arm, "p2", 0, 3), None, "nothing finished yet");
        store.save(&arm, &run()).unwrap();
        // A rerun (a new process) opens the same directory.
        let again = open(root.path(), setting);
        assert_eq!(again.load(&arm, "p2", 0, 3), Some(run()));
        assert_eq!(again.load(&arm, "p2", 0, 4), None, "another seed");
        assert_eq!(
            again.commits(&[("p2".into(), 0, 3), ("p2".into(), 0, 4)]),
            ["abc1234"]
        );
    }

    #[test]
    fn a_run_made_under_anything_else_is_not_reused() {
        let root = tempfile::tempdir().unwrap();
        warm(root.path(), b"weights");
        let setting = serde_json::json!({"steps": 60});
        let arm = serde_json::json!({"id": "p2", "updates": 2});
        open(root.path(), setting.clone())
            .save(&arm, &run())
            .unwrap();

        let other_setting = open(root.path(), serde_json::json!({"steps": 61}));
        assert_eq!(other_setting.load(&arm, "p2", 0, 3), None);
        let other_arm = serde_json::json!({"id": "p2", "updates": 4});
        assert_eq!(
            open(root.path(), setting.clone()).load(&other_arm, "p2", 0, 3),
            None
        );
        warm(root.path(), b"other weights");
        assert_eq!(open(root.path(), setting).load(&arm, "p2", 0, 3), None);
    }

    #[test]
    fn a_measurement_before_runs_is_kept_under_its_own_key() {
        let root = tempfile::tempdir().unwrap();
        warm(root.path(), b"weights");
        let key = serde_json::json!({"groups": 256});
        let store = open(root.path(), serde_json::json!({"steps": 60}));
        assert_eq!(store.load_measure::<f64>("gate0", &key, 0), None);
        store.save_measure("gate0", &key, 0, &0.356).unwrap();
        let again = open(root.path(), serde_json::json!({"steps": 60}));
        assert_eq!(again.load_measure::<f64>("gate0", &key, 0), Some(0.356));
        let fewer = serde_json::json!({"groups": 64});
        assert_eq!(again.load_measure::<f64>("gate0", &fewer, 0), None);
        assert_eq!(again.load_measure::<f64>("warm-row", &key, 0), None);
        // Not a run: the finished runs' directory lists none.
        assert_eq!(again.load(&key, "gate0", 0, 0), None);
        warm(root.path(), b"other weights");
        let other = open(root.path(), serde_json::json!({"steps": 60}));
        assert_eq!(other.load_measure::<f64>("gate0", &key, 0), None);
    }

    #[test]
    fn a_write_aside_replaces_the_whole_file_and_clears_a_killed_one() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("study.json");
        // What a write killed midway leaves: half a file aside.
        std::fs::write(path.with_extension("partial"), "{\"half\": ").unwrap();
        write_aside(&path, "{\"long\": \"first version\"}").unwrap();
        write_aside(&path, "{}").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{}");
        assert!(!path.with_extension("partial").exists());
    }

    #[test]
    fn a_run_an_older_study_kept_as_plain_json_is_still_reused() {
        let root = tempfile::tempdir().unwrap();
        warm(root.path(), b"weights");
        let arm = serde_json::json!({"id": "p2"});
        let store = open(root.path(), serde_json::json!({}));
        store.save(&arm, &run()).unwrap();
        let gz = root.path().join("finished/p2-w0-s3.json.gz");
        let text = read_text(&gz).unwrap();
        assert!(text.starts_with("{\"fingerprint\""), "{text:.40}");
        std::fs::remove_file(&gz).unwrap();
        std::fs::write(gz.with_extension(""), text).unwrap();
        assert_eq!(store.load(&arm, "p2", 0, 3), Some(run()));
    }

    #[test]
    fn a_damaged_file_is_run_again_not_an_error() {
        let root = tempfile::tempdir().unwrap();
        warm(root.path(), b"weights");
        let arm = serde_json::json!({"id": "p2"});
        let store = open(root.path(), serde_json::json!({}));
        store.save(&arm, &run()).unwrap();
        let path = root.path().join("finished/p2-w0-s3.json.gz");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        assert_eq!(store.load(&arm, "p2", 0, 3), None);
        store.save(&arm, &run()).unwrap();
        assert_eq!(store.load(&arm, "p2", 0, 3), Some(run()));
    }
}
