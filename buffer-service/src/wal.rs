//! The write-ahead log behind `--data-dir`.
//!
//! One file, `wal.log`: an 8-byte magic, then frames of
//! `[payload length: u32 LE][crc32 of payload: u32 LE][bapo.wal.v1.Record]`.
//! Records are idempotent (absolute use counts, versions, id-keyed rollouts),
//! so replaying a compacted snapshot followed by records that were already
//! reflected in it gives the same state.
//!
//! One writer thread owns the file. Callers hand it encoded frames over an
//! unbounded channel (never blocking a hot path on disk), and wait for a
//! *barrier* only where an ack promises durability: at the end of a push
//! stream and before a sampled batch leaves the buffer. The writer drains
//! everything queued, writes it, fsyncs once (group commit) and then answers
//! every barrier of that round, so the fsync cost is shared by all pushers.
//!
//! A kill -9 can leave a torn frame at the end; on open the log is read up to
//! the last whole, checksummed frame and truncated there. Anything after it
//! was never acknowledged.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, BufReader, BufWriter, Read, Write},
    path::{Path, PathBuf},
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use bapo_proto::wal::Record;
use parking_lot::Mutex;
use prost::Message;
use tokio::sync::{mpsc, oneshot};

use crate::config::FsyncPolicy;

const MAGIC: &[u8; 8] = b"BAPOWAL\x01";
const LOG_NAME: &str = "wal.log";
/// A frame longer than this is corruption, not data.
const MAX_FRAME: u32 = 1 << 30;
/// Frames written between checks of the channel, to bound barrier latency.
const MAX_ROUND: usize = 4096;

/// Builds the records of a compacted log: the live state of the buffer, or
/// a refusal when that state is gone (a dropped buffer): an empty snapshot
/// would replace the log and lose everything in it.
pub type Snapshot = Box<dyn Fn() -> Result<Vec<Record>, SnapshotRefused> + Send + Sync>;

/// Why a snapshot could not be taken; the log is then left as it is.
#[derive(Debug, Clone, thiserror::Error)]
#[error("no snapshot for compaction: {0}")]
pub struct SnapshotRefused(pub String);

/// A failed log: every later barrier reports it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("write-ahead log {path}: {message}")]
pub struct WalError {
    pub path: String,
    pub message: String,
}

enum Msg {
    Frame(Vec<u8>),
    Barrier(oneshot::Sender<Result<(), WalError>>),
    Compact,
    Close(oneshot::Sender<Result<(), WalError>>),
}

/// Handle to the log; cheap to share behind the buffer.
pub struct Wal {
    tx: mpsc::UnboundedSender<Msg>,
    snapshot: Arc<Mutex<Option<Snapshot>>>,
    thread: Mutex<Option<thread::JoinHandle<()>>>,
    path: PathBuf,
}

/// What `open` found.
pub struct Recovered {
    pub records: Vec<Record>,
    /// Bytes cut from a torn or corrupt tail.
    pub truncated_bytes: u64,
}

/// Encodes one record as a frame.
pub fn frame(record: &Record) -> Vec<u8> {
    let len = record.encoded_len();
    let mut buf = Vec::with_capacity(8 + len);
    buf.extend_from_slice(&[0; 8]);
    record
        .encode(&mut buf)
        .expect("a Vec grows to fit any message");
    let crc = crc32fast::hash(&buf[8..]);
    buf[0..4].copy_from_slice(&(len as u32).to_le_bytes());
    buf[4..8].copy_from_slice(&crc.to_le_bytes());
    buf
}

impl Wal {
    /// Opens (or creates) the log in `dir`, returning its records and a
    /// handle whose writer appends after them.
    pub fn open(
        dir: &Path,
        fsync: FsyncPolicy,
        fsync_interval: Duration,
        compact_bytes: u64,
    ) -> anyhow::Result<(Wal, Recovered)> {
        use anyhow::Context;
        fs::create_dir_all(dir).with_context(|| format!("creating data dir {}", dir.display()))?;
        let path = dir.join(LOG_NAME);
        let recovered = if path.exists() {
            read_log(&path).with_context(|| format!("reading {}", path.display()))?
        } else {
            write_fresh(&path, &[]).with_context(|| format!("creating {}", path.display()))?;
            Recovered {
                records: Vec::new(),
                truncated_bytes: 0,
            }
        };
        let file = OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {} for append", path.display()))?;
        let len = file.metadata()?.len();
        let (tx, rx) = mpsc::unbounded_channel();
        let snapshot: Arc<Mutex<Option<Snapshot>>> = Arc::default();
        let writer = Writer {
            path: path.clone(),
            file: BufWriter::with_capacity(1 << 20, file),
            bytes: len,
            compact_at: compact_bytes.max(len.saturating_mul(2)),
            compact_bytes,
            fsync,
            fsync_interval,
            last_sync: Instant::now(),
            dirty: false,
            failed: None,
            snapshot: snapshot.clone(),
        };
        let thread = thread::Builder::new()
            .name("bapo-wal".into())
            .spawn(move || writer.run(rx))
            .context("spawning the WAL writer thread")?;
        Ok((
            Wal {
                tx,
                snapshot,
                thread: Mutex::new(Some(thread)),
                path,
            },
            recovered,
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Installs the function compaction calls for the live state.
    pub fn set_snapshot(&self, f: Snapshot) {
        *self.snapshot.lock() = Some(f);
    }

    /// Queues a frame made by [`frame`]. Never blocks.
    pub fn append(&self, frame: Vec<u8>) {
        // A closed writer means shutdown is under way; the barrier of the
        // caller reports it.
        let _ = self.tx.send(Msg::Frame(frame));
    }

    pub fn append_record(&self, record: &Record) {
        self.append(frame(record));
    }

    /// Resolves once every frame queued before this call is written (and
    /// fsynced, under `FsyncPolicy::Always`).
    pub async fn barrier(&self) -> Result<(), WalError> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Msg::Barrier(tx)).map_err(|_| self.closed())?;
        rx.await.map_err(|_| self.closed())?
    }

    /// Rewrites the log from the snapshot now.
    pub fn compact(&self) {
        let _ = self.tx.send(Msg::Compact);
    }

    /// Writes and fsyncs everything queued, then stops the writer.
    pub async fn close(&self) -> Result<(), WalError> {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Close(tx)).is_err() {
            return Ok(());
        }
        let res = rx.await.map_err(|_| self.closed())?;
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        res
    }

    fn closed(&self) -> WalError {
        WalError {
            path: self.path.display().to_string(),
            message: "the log is closed (shutting down)".into(),
        }
    }
}

struct Writer {
    path: PathBuf,
    file: BufWriter<File>,
    bytes: u64,
    compact_at: u64,
    compact_bytes: u64,
    fsync: FsyncPolicy,
    fsync_interval: Duration,
    last_sync: Instant,
    dirty: bool,
    failed: Option<WalError>,
    snapshot: Arc<Mutex<Option<Snapshot>>>,
}

impl Writer {
    fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>) {
        let mut barriers = Vec::new();
        let mut close = None;
        while let Some(first) = rx.blocking_recv() {
            let mut next = Some(first);
            let mut n = 0;
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Frame(f) => self.write(&f),
                    Msg::Barrier(b) => barriers.push(b),
                    // In order: frames queued after the request must land
                    // after the snapshot.
                    Msg::Compact => {
                        self.flush(false);
                        self.compact();
                    }
                    Msg::Close(c) => close = Some(c),
                }
                n += 1;
                if close.is_none() && n < MAX_ROUND {
                    next = rx.try_recv().ok();
                }
            }
            let must_sync = close.is_some()
                || match self.fsync {
                    FsyncPolicy::Always => true,
                    FsyncPolicy::Interval => self.last_sync.elapsed() >= self.fsync_interval,
                    FsyncPolicy::Never => false,
                };
            self.flush(must_sync);
            if self.bytes > self.compact_at {
                self.compact();
            }
            let result = match &self.failed {
                Some(e) => Err(e.clone()),
                None => Ok(()),
            };
            for b in barriers.drain(..) {
                let _ = b.send(result.clone());
            }
            if let Some(c) = close.take() {
                let _ = c.send(result);
                return;
            }
        }
        self.flush(true);
    }

    fn fail(&mut self, what: &str, e: io::Error) {
        if self.failed.is_none() {
            tracing::error!(path = %self.path.display(), "write-ahead log {what} failed: {e}");
            self.failed = Some(WalError {
                path: self.path.display().to_string(),
                message: format!("{what}: {e}"),
            });
        }
    }

    fn write(&mut self, frame: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        match self.file.write_all(frame) {
            Ok(()) => {
                self.bytes += frame.len() as u64;
                self.dirty = true;
            }
            Err(e) => self.fail("write", e),
        }
    }

    fn flush(&mut self, sync: bool) {
        if self.failed.is_some() {
            return;
        }
        if let Err(e) = self.file.flush() {
            return self.fail("write", e);
        }
        if sync && self.dirty {
            let t = Instant::now();
            if let Err(e) = self.file.get_ref().sync_data() {
                return self.fail("fsync", e);
            }
            metrics::histogram!(crate::metrics::WAL_FSYNC_SECONDS)
                .record(t.elapsed().as_secs_f64());
            self.last_sync = Instant::now();
            self.dirty = false;
        }
        metrics::gauge!(crate::metrics::WAL_BYTES).set(self.bytes as f64);
    }

    /// Replaces the log by a snapshot of the live state. Frames queued while
    /// this runs are appended to the new file afterwards.
    fn compact(&mut self) {
        if self.failed.is_some() {
            return;
        }
        let records = match self.snapshot.lock().as_ref().map(|f| f()) {
            Some(Ok(records)) => records,
            Some(Err(e)) => {
                tracing::warn!(path = %self.path.display(), "{e}; keeping the log as it is");
                self.compact_at = self.compact_bytes.max(self.bytes.saturating_mul(2));
                return;
            }
            None => return,
        };
        let t = Instant::now();
        let before = self.bytes;
        let tmp = self.path.with_extension("log.tmp");
        let res = write_fresh(&tmp, &records)
            .and_then(|_| fs::rename(&tmp, &self.path))
            .and_then(|_| sync_dir(&self.path))
            .and_then(|_| OpenOptions::new().append(true).open(&self.path));
        match res {
            Ok(file) => {
                self.bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
                self.file = BufWriter::with_capacity(1 << 20, file);
                self.compact_at = self.compact_bytes.max(self.bytes.saturating_mul(2));
                self.dirty = false;
                tracing::info!(
                    before,
                    after = self.bytes,
                    records = records.len(),
                    ms = t.elapsed().as_millis() as u64,
                    "compacted write-ahead log"
                );
            }
            Err(e) => self.fail("compaction", e),
        }
    }
}

fn sync_dir(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) => File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

/// Writes a complete log (magic + records) and fsyncs it.
fn write_fresh(path: &Path, records: &[Record]) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(1 << 20, File::create(path)?);
    w.write_all(MAGIC)?;
    for r in records {
        w.write_all(&frame(r))?;
    }
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    sync_dir(path)
}

/// Reads every whole frame; cuts the file after the last good one.
fn read_log(path: &Path) -> anyhow::Result<Recovered> {
    let file = File::open(path)?;
    let total = file.metadata()?.len();
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut magic = [0u8; 8];
    if r.read_exact(&mut magic).is_err() || &magic != MAGIC {
        anyhow::bail!(
            "not a bapo write-ahead log (bad magic); refusing to touch it: move it away to start empty"
        );
    }
    let mut good = MAGIC.len() as u64;
    let mut records = Vec::new();
    let mut header = [0u8; 8];
    let mut payload = Vec::new();
    loop {
        if r.read_exact(&mut header).is_err() {
            break;
        }
        let len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        // A length past the end of the file is a torn frame (or a damaged
        // header): cut it rather than allocate for it.
        if len > MAX_FRAME || good + 8 + u64::from(len) > total {
            break;
        }
        payload.resize(len as usize, 0);
        if r.read_exact(&mut payload).is_err() || crc32fast::hash(&payload) != crc {
            break;
        }
        match Record::decode(payload.as_slice()) {
            Ok(rec) => records.push(rec),
            Err(_) => break,
        }
        good += 8 + len as u64;
    }
    let truncated_bytes = total - good;
    if truncated_bytes > 0 {
        tracing::warn!(
            path = %path.display(),
            truncated_bytes,
            kept_records = records.len(),
            "write-ahead log had a torn or corrupt tail; cut it (never acknowledged)"
        );
        OpenOptions::new().write(true).open(path)?.set_len(good)?;
    }
    Ok(Recovered {
        records,
        truncated_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bapo_proto::wal::{Version, record::Kind};

    fn version(v: u64) -> Record {
        Record {
            kind: Some(Kind::Version(Version {
                version: v,
                ..Default::default()
            })),
        }
    }

    fn versions(recs: &[Record]) -> Vec<u64> {
        recs.iter()
            .map(|r| match &r.kind {
                Some(Kind::Version(v)) => v.version,
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[tokio::test]
    async fn records_survive_reopen_and_torn_tail_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, rec) =
            Wal::open(dir.path(), FsyncPolicy::Always, Duration::ZERO, 1 << 30).unwrap();
        assert!(rec.records.is_empty());
        for v in 1..=3 {
            wal.append_record(&version(v));
        }
        wal.barrier().await.unwrap();
        wal.close().await.unwrap();

        // Simulate a crash in the middle of a frame.
        let path = dir.path().join(LOG_NAME);
        let mut bytes = fs::read(&path).unwrap();
        let whole = bytes.len();
        bytes.extend_from_slice(&frame(&version(4))[..5]);
        fs::write(&path, &bytes).unwrap();

        let (wal, rec) =
            Wal::open(dir.path(), FsyncPolicy::Always, Duration::ZERO, 1 << 30).unwrap();
        assert_eq!(versions(&rec.records), vec![1, 2, 3]);
        assert_eq!(rec.truncated_bytes, 5);
        assert_eq!(fs::metadata(&path).unwrap().len() as usize, whole);
        wal.append_record(&version(5));
        wal.close().await.unwrap();
        let (_, rec) = Wal::open(dir.path(), FsyncPolicy::Never, Duration::ZERO, 1 << 30).unwrap();
        assert_eq!(versions(&rec.records), vec![1, 2, 3, 5]);
    }

    #[tokio::test]
    async fn a_flipped_bit_ends_the_log_there() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, _) = Wal::open(dir.path(), FsyncPolicy::Never, Duration::ZERO, 1 << 30).unwrap();
        for v in 1..=3 {
            wal.append_record(&version(v));
        }
        wal.close().await.unwrap();
        let path = dir.path().join(LOG_NAME);
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        fs::write(&path, &bytes).unwrap();
        let (_, rec) = Wal::open(dir.path(), FsyncPolicy::Never, Duration::ZERO, 1 << 30).unwrap();
        assert_eq!(versions(&rec.records), vec![1, 2]);
    }

    #[tokio::test]
    async fn compaction_replaces_the_log_with_the_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, _) = Wal::open(dir.path(), FsyncPolicy::Always, Duration::ZERO, 1 << 30).unwrap();
        for v in 1..=100 {
            wal.append_record(&version(v));
        }
        wal.set_snapshot(Box::new(|| Ok(vec![version(100)])));
        wal.compact();
        wal.append_record(&version(101));
        wal.close().await.unwrap();
        let (_, rec) = Wal::open(dir.path(), FsyncPolicy::Always, Duration::ZERO, 1 << 30).unwrap();
        assert_eq!(versions(&rec.records), vec![100, 101]);
    }

    #[test]
    fn foreign_file_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(LOG_NAME), b"hello world").unwrap();
        let err = Wal::open(dir.path(), FsyncPolicy::Never, Duration::ZERO, 1 << 30)
            .err()
            .unwrap();
        assert!(format!("{err:#}").contains("bad magic"), "{err:#}");
    }
}
