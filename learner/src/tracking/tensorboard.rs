//! A run's numbers as TensorBoard event files: one file per process
//! start in the run's `tensorboard/` directory (TensorBoard reads a
//! directory's files in name order, so each name starts with its time).

use std::{
    fs::File,
    io::{BufWriter, Write},
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Context;

use super::tfevents::{Event, record};

pub struct TensorBoard {
    out: BufWriter<File>,
    path: PathBuf,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl TensorBoard {
    /// A new event file in `dir`. `resumed_at`: the steps a resumed
    /// learner already has, so that readers drop what an earlier file
    /// logged past them (the steps this incarnation will log again).
    pub fn create(dir: &Path, resumed_at: u64) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating TensorBoard directory {}", dir.display()))?;
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let name = format!(
            "events.out.tfevents.{:010}.{:09}.bapo.{}",
            t.as_secs(),
            t.subsec_nanos(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut tb = Self {
            out: BufWriter::new(file),
            path,
        };
        tb.write(&Event::file_version(now(), "bapo"))?;
        if resumed_at > 0 {
            tb.write(&Event::session_start(now(), resumed_at + 1))?;
        }
        Ok(tb)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Finite `values` as scalars at `step`, each tag `prefix/key`.
    pub fn scalars<'a>(
        &mut self,
        step: u64,
        prefix: &str,
        values: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> anyhow::Result<()> {
        let values: Vec<(String, f32)> = values
            .into_iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(k, v)| (format!("{prefix}/{k}"), v as f32))
            .collect();
        if values.is_empty() {
            return Ok(());
        }
        self.write(&Event::scalars(now(), step, values))
    }

    /// A table of Markdown cells at `step` (first row the header).
    pub fn table(&mut self, step: u64, tag: &str, rows: &[Vec<String>]) -> anyhow::Result<()> {
        self.write(&Event::text_table(now(), step, tag, rows))
    }

    /// Appends and flushes: a killed process leaves whole records (and at
    /// worst a cut last one, which readers skip).
    fn write(&mut self, e: &Event) -> anyhow::Result<()> {
        self.out
            .write_all(&record(e))
            .and_then(|()| self.out.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}
