//! The learner's weights into the engine: each version the subscription
//! delivers is written as an HF safetensors directory (atomically: a
//! temporary directory renamed into place), then the engine pauses,
//! reloads it, relabels the tokens it makes from then on, and resumes.
//!
//! A whole model arrives as the stream's payload, never decoded into a
//! Burn model (`subscription::Form::Wire`): `bapo_policy::hf_layout`
//! reads it as the HF checkpoint it stands for. Once the engine holds a
//! version of ours, the next ones go through vLLM's weight-transfer API
//! instead of a reload (bapo's `bapo_shm` engine,
//! `actor/vllm/bapo_vllm_ext.py`): the elements whose bits changed
//! between the two payloads (`bapo_policy::hf_patch`) as one file,
//! written into the engine's parameters in place. The file reload stays
//! for the first load, after a server restart, for LoRA, and whenever a
//! patch fails or would not be smaller than the weights.
//!
//! The directory holds what a load needs and no more: before a version
//! is written, every other version of bapo's there goes (the engine keeps
//! what it loaded in memory; under LoRA the serving adapter and the one
//! before it stay, as vLLM may read them again), so reloads that keep
//! failing while new versions arrive write over one copy, not one each.
//!
//! The slots see a version only once the engine holds it: `ready` carries
//! the version the engine serves, or `None` while it is down, restarting,
//! or in an unknown state. Before a reload the engine's label is set to
//! [`UNKNOWN`], so if the reload fails half-way no token made by the
//! half-loaded weights carries a version: such tokens are refused when
//! the group is read (`group.rs`) and the group is generated again.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use bapo_policy::{hf_layout::Layout, hf_patch::Patch};
use metrics::{counter, histogram};
use tokio::sync::watch;

use super::{
    api::{Api, Pause},
    group::{UNKNOWN, label},
    weights_dir,
};
use crate::{
    backoff::Backoff,
    metrics as names,
    subscription::{PolicyCell, Versioned, Weights},
    update_mode::UpdateMode,
};

/// What the loader needs besides the channels.
pub struct Loader {
    pub api: Api,
    pub weights_dir: PathBuf,
    pub mode: UpdateMode,
    pub reload_timeout: Duration,
    /// `actor.vllm.lora_rank`: the adapters' rank the engine was set up
    /// for (0: full weights only).
    pub lora_rank: usize,
    /// Under LoRA: what the engine holds since it last came up.
    pub lora: LoraState,
    /// The weight-transfer path: what the engine holds, as its payload.
    pub transfer: Transfer,
    /// `actor.vllm.weight_transfer`: false, every version is reloaded.
    pub weight_transfer: bool,
}

/// How a version's weights get into the engine.
enum Load<'a> {
    /// Reloaded whole from an HF directory.
    Reload(&'a Path),
    /// Written in place from a patch file, by the transfer engine.
    Patch(&'a Path),
}

/// What the weight-transfer path knows of the engine since it came up.
#[derive(Debug, Default)]
pub struct Transfer {
    /// Whether the server's `bapo_shm` engine is set up; `None` until
    /// asked (once per server start).
    ready: Option<bool>,
    /// The version the engine holds, as its payload (the base a patch
    /// is made against); `None` after a failure or a restart.
    held: Option<Arc<Versioned>>,
}

/// The base and adapters a server holds (LoRA only).
#[derive(Debug, Default)]
pub struct LoraState {
    /// Fingerprint of the base reloaded into it.
    base: Option<u64>,
    /// The adapter it serves and the one before (kept for requests that
    /// picked it just before the swap).
    serving: Option<String>,
    previous: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(
        "the vLLM server's model does not match the learner's: {0} \
         (start it from the learner's model directory)"
    )]
    ModelMismatch(String),
    /// The stream carries LoRA adapters the engine was not set up for:
    /// every load would fail, so the actor stops instead of retrying.
    #[error(
        "the learner publishes LoRA adapters of rank {rank}, but actor.vllm.lora_rank = \
         {configured}: set it to {rank} (bapo run does; a sidecar server also needs \
         --enable-lora --max-lora-rank {rank} or more)"
    )]
    Lora { rank: usize, configured: usize },
}

/// Keeps the engine on the newest weights of `weights` until `stop`;
/// publishes what it serves into `ready`. Returns an error only for a
/// server that can never serve these weights.
pub async fn follow(
    mut loader: Loader,
    mut weights: PolicyCell,
    mut up: watch::Receiver<bool>,
    ready: watch::Sender<Option<Arc<Versioned>>>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), SyncError> {
    // (version, incarnation) the engine holds since it last came up.
    let mut loaded: Option<(u64, u64)> = None;
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
    let mut retry_at: Option<tokio::time::Instant> = None;
    loop {
        let is_up = *up.borrow_and_update();
        let newest = weights.borrow_and_update().clone();
        if !is_up {
            loaded = None;
            loader.lora = LoraState::default();
            loader.transfer = Transfer::default();
            let _ = ready.send(None);
        } else if let Some(v) = newest
            && loaded != Some((v.version, v.incarnation))
            && retry_at.is_none_or(|t| t <= tokio::time::Instant::now())
        {
            check_lora(loader.lora_rank, &v)?;
            if loaded.is_none() {
                check_model(&loader.api, &v).await?;
            }
            match loader.load(&v).await {
                Ok(()) => {
                    loaded = Some((v.version, v.incarnation));
                    retry_at = None;
                    backoff.reset();
                    let _ = ready.send(Some(v));
                }
                Err(e) => {
                    counter!(names::ENGINE_RELOAD_FAILURES).increment(1);
                    tracing::warn!("weights v{} into vLLM: {e:#}", v.version);
                    loaded = None;
                    let _ = ready.send(None);
                    retry_at = Some(tokio::time::Instant::now() + backoff.next_delay());
                }
            }
        }
        let retry = async {
            match retry_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = weights.changed() => if r.is_err() { return Ok(()) },
            r = up.changed() => if r.is_err() { return Ok(()) },
            _ = retry => {}
            _ = stop.wait_for(|s| *s) => return Ok(()),
        }
    }
}

impl Loader {
    /// One version into the engine: adapters beside the base under LoRA,
    /// else the whole model.
    async fn load(&mut self, v: &Arc<Versioned>) -> anyhow::Result<()> {
        match v.lora().map(|a| a.base) {
            Some(base) => {
                if self.lora.base != Some(base) {
                    self.load_base(v).await?;
                    self.lora.base = Some(base);
                }
                self.load_adapter(v).await
            }
            None => self.load_full(v).await,
        }
    }

    /// The frozen base of a LoRA version, reloaded in place as a whole
    /// model (once per base and server start): the server may have
    /// started from another directory than the learner's base.
    async fn load_base(&self, v: &Arc<Versioned>) -> anyhow::Result<()> {
        let policy = v.policy().context("a LoRA version is loaded as a model")?;
        let mut base = policy.model.clone();
        base.lora = None;
        let base = Arc::new(Versioned::new(
            0,
            v.incarnation,
            bapo_policy::Policy::with_model(policy.config.clone(), base, &policy.device()),
        ));
        let name = format!("base-{:016x}", v.lora().map_or(0, |a| a.base));
        weights_dir::prune(&self.weights_dir, |n| n == name);
        let dir = self.write(&base, &name).await?;
        self.swap(Load::Reload(&dir), UNKNOWN).await
    }

    /// A LoRA version: its adapter written in PEFT's format and loaded
    /// under its label; the one before the serving one unloaded.
    async fn load_adapter(&mut self, v: &Arc<Versioned>) -> anyhow::Result<()> {
        let t0 = Instant::now();
        let name = label(v.incarnation, v.version);
        self.prune_adapters(&name);
        let dir = self.write_adapter(v, &name).await?;
        let short = Duration::from_secs(30);
        let restart = self.mode == UpdateMode::Restart;
        if restart {
            self.api.pause(Pause::Abort, short).await?;
        }
        // A retry after a load whose answer was lost: vLLM refuses a name
        // it holds, so drop it first (an unknown name is refused: ignored).
        let _ = self.api.unload_lora(&name, short).await;
        let loaded = self
            .api
            .load_lora(&name, &dir.display().to_string(), self.reload_timeout)
            .await;
        if restart {
            self.api.resume(short).await?;
        }
        loaded?;
        if let Some(old) = self.lora.previous.take() {
            // Best effort: a failure leaves an adapter in vLLM's cache.
            if let Err(e) = self.api.unload_lora(&old, short).await {
                tracing::debug!("unloading adapter {old}: {e}");
            }
        }
        self.lora.previous = self.lora.serving.replace(name.clone());
        histogram!(names::ENGINE_RELOAD_SECONDS).record(t0.elapsed().as_secs_f64());
        tracing::info!(
            version = v.version,
            "vLLM serves LoRA adapter {name} ({:.2} s)",
            t0.elapsed().as_secs_f64()
        );
        self.prune_adapters(&name);
        Ok(())
    }

    /// Removes every adapter but `name` and the two the engine may still
    /// read (serving and previous); bases stay.
    fn prune_adapters(&self, name: &str) {
        let keep = [
            Some(name),
            self.lora.serving.as_deref(),
            self.lora.previous.as_deref(),
        ];
        weights_dir::prune(&self.weights_dir, |n| {
            keep.contains(&Some(n)) || n.starts_with("base-")
        });
    }

    /// Writes `v`'s adapters to `<weights_dir>/<name>` (PEFT's format).
    async fn write_adapter(&self, v: &Arc<Versioned>, name: &str) -> anyhow::Result<PathBuf> {
        let dir = self.weights_dir.join(name);
        let tmp = self.weights_dir.join(format!(".tmp-{name}"));
        let (v, t, d) = (v.clone(), tmp.clone(), dir.clone());
        tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
            let adapters = v.lora().context("a LoRA version")?;
            let meta = bapo_policy::peft::AdapterMeta {
                alpha: adapters.scale * adapters.rank() as f64,
                base: adapters.base,
            };
            let _ = std::fs::remove_dir_all(&t);
            let _ = std::fs::remove_dir_all(&d);
            bapo_policy::peft::write_dir(&t, adapters, meta, "base")?;
            std::fs::rename(&t, &d)?;
            Ok(())
        })
        .await??;
        // vLLM reads a relative path as a Hub id.
        Ok(std::path::absolute(&dir)?)
    }

    /// One whole-model version into the engine: as a patch through the
    /// transfer engine when it holds a version of ours, else write, pause,
    /// reload, relabel, resume.
    async fn load_full(&mut self, v: &Arc<Versioned>) -> anyhow::Result<()> {
        let t0 = Instant::now();
        let name = label(v.incarnation, v.version);
        let path = match self.patch(v, &name).await {
            Ok(true) => "transfer",
            Ok(false) => {
                self.reload_full(v, &name).await?;
                "reload"
            }
            Err(e) => {
                if self.transfer.ready == Some(true) {
                    counter!(names::ENGINE_TRANSFER_FALLBACKS).increment(1);
                    tracing::warn!("weights {name} as a patch: {e:#}; reloading from a file");
                }
                self.reload_full(v, &name).await?;
                "reload"
            }
        };
        histogram!(names::ENGINE_RELOAD_SECONDS, "path" => path).record(t0.elapsed().as_secs_f64());
        tracing::info!(
            version = v.version,
            incarnation = v.incarnation,
            "vLLM serves weights {name} by {path} ({:.2} s)",
            t0.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// `v` into the engine from an HF directory; a payload is kept for
    /// the patches that follow, unless the server has no transfer engine.
    async fn reload_full(&mut self, v: &Arc<Versioned>, name: &str) -> anyhow::Result<()> {
        self.transfer.held = None;
        weights_dir::prune(&self.weights_dir, |n| n == name);
        let dir = self.write(v, name).await?;
        self.swap(Load::Reload(&dir), name).await?;
        let engine = self.weight_transfer && self.transfer.ready != Some(false);
        if engine && matches!(v.weights, Weights::Wire(_)) {
            self.transfer.held = Some(v.clone());
        }
        Ok(())
    }

    /// `v` as the elements that changed since the version the engine
    /// holds, through the transfer engine; `false` when a patch would not
    /// pay (no engine, nothing held, or most elements changed: f32
    /// broadcasts under AdamW) and the file reload is the way. Any error
    /// leaves the patch path until the next file reload (the engine's
    /// weights are then unknown to the actor: the reload sets them).
    async fn patch(&mut self, v: &Arc<Versioned>, name: &str) -> anyhow::Result<bool> {
        let Some(held) = self.transfer.held.take() else {
            return Ok(false);
        };
        if !self.transfer_ready().await {
            return Ok(false);
        }
        let dir = self.weights_dir.join(format!(".tmp-{name}"));
        let file = std::path::absolute(dir.join("patch.safetensors"))?;
        let (f, d, new) = (file.clone(), dir.clone(), v.clone());
        // A compare of two payloads and a file write: off the runtime.
        let patch = tokio::task::spawn_blocking(move || -> anyhow::Result<Option<Patch>> {
            let (Weights::Wire(old), Weights::Wire(new)) = (&held.weights, &new.weights) else {
                return Ok(None);
            };
            let patch = Layout::read(&new.payload)?.patch(&old.payload, &new.payload)?;
            // Indices and values of most elements: larger than the weights.
            if patch.bytes.len() >= new.payload.len() {
                return Ok(None);
            }
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d)?;
            std::fs::write(&f, &patch.bytes)?;
            Ok(Some(patch))
        })
        .await??;
        let Some(patch) = patch else {
            return Ok(false);
        };
        let size = patch.bytes.len();
        counter!(names::ENGINE_PATCH_BYTES).increment(size as u64);
        let applied = self.swap(Load::Patch(&file), name).await;
        let _ = std::fs::remove_dir_all(&dir);
        applied?;
        tracing::debug!(
            "weights {name} as a patch: {} of {} elements, {size} bytes",
            patch.changed,
            patch.total,
        );
        self.transfer.held = Some(v.clone());
        Ok(true)
    }

    /// Whether the server's transfer engine is set up (asked once per
    /// server start).
    async fn transfer_ready(&mut self) -> bool {
        if !self.weight_transfer {
            return false;
        }
        if self.transfer.ready.is_none() {
            let ready = self.api.init_transfer(self.reload_timeout).await;
            if let Err(e) = &ready {
                tracing::info!(
                    "no weight-transfer engine on this server ({e}); reloading from files"
                );
            }
            self.transfer.ready = Some(ready.is_ok());
        }
        self.transfer.ready == Some(true)
    }

    /// Pause, load in place, label what follows `name`, resume.
    async fn swap(&self, load: Load<'_>, name: &str) -> anyhow::Result<()> {
        let short = Duration::from_secs(30);
        let pause = match self.mode {
            UpdateMode::Partial => Pause::Keep,
            UpdateMode::Restart => Pause::Abort,
        };
        self.api.pause(pause, short).await?;
        let swapped = async {
            self.api.set_version(UNKNOWN, short).await?;
            match load {
                Load::Reload(dir) => {
                    let dir = dir.display().to_string();
                    self.api.reload(&dir, self.reload_timeout).await?
                }
                Load::Patch(file) => {
                    let file = file.display().to_string();
                    self.api.transfer(&file, name, self.reload_timeout).await?
                }
            }
            self.api.set_version(name, short).await?;
            self.api.reset_prefix_cache(short).await
        }
        .await;
        // Resume whatever happened: tokens made meanwhile are labelled
        // with the new version, or with UNKNOWN and never trained on.
        let resumed = self.api.resume(short).await;
        swapped?;
        resumed?;
        Ok(())
    }

    /// Writes `v` to `<weights_dir>/<name>` (over anything there) and
    /// returns the directory.
    async fn write(&self, v: &Arc<Versioned>, name: &str) -> anyhow::Result<PathBuf> {
        let dir = self.weights_dir.join(name);
        let tmp = self.weights_dir.join(format!(".tmp-{name}"));
        let (v, t, d) = (v.clone(), tmp.clone(), dir.clone());
        tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
            let export = match &v.weights {
                Weights::Wire(w) => Layout::read(&w.payload)?.export(&w.payload)?,
                Weights::Model(p) => {
                    bapo_policy::hf::to_safetensors(p).map_err(anyhow::Error::msg)?
                }
            };
            let _ = std::fs::remove_dir_all(&t);
            let _ = std::fs::remove_dir_all(&d);
            bapo_policy::hf::save_bytes(v.config(), &t, &export)?;
            std::fs::rename(&t, &d)?;
            Ok(())
        })
        .await??;
        Ok(dir)
    }
}

/// Refuses adapters the engine cannot load: LoRA versions into an engine
/// set up without LoRA, or of a rank above the one it was set up for.
fn check_lora(configured: usize, v: &Versioned) -> Result<(), SyncError> {
    let Some(adapters) = v.lora() else {
        return Ok(());
    };
    let rank = adapters.rank();
    let max = super::config::vllm_max_lora_rank(configured).unwrap_or(0);
    if configured == 0 || rank > max {
        return Err(SyncError::Lora { rank, configured });
    }
    Ok(())
}

/// Refuses a server whose model is not the learner's architecture (its
/// reload would fail on every version, or worse, load into other shapes).
async fn check_model(api: &Api, v: &Versioned) -> Result<(), SyncError> {
    let served = match api.describe(Duration::from_secs(30)).await {
        Ok(d) => d,
        Err(e) => {
            // Checked again when the engine next comes up and loads.
            tracing::warn!("could not ask vLLM for its model ({e}); not checked");
            return Ok(());
        }
    };
    let c = v.config();
    let want = [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("num_hidden_layers", c.num_hidden_layers),
        ("num_attention_heads", c.num_attention_heads),
        (
            "num_key_value_heads",
            c.num_key_value_heads.unwrap_or(c.num_attention_heads),
        ),
        ("intermediate_size", c.intermediate_size),
    ];
    let wrong: Vec<String> = want
        .iter()
        .filter_map(|(k, w)| {
            let got = served.get(*k).and_then(|x| x.as_u64());
            (got != Some(*w as u64)).then(|| format!("{k} {got:?} where the learner has {w}"))
        })
        .collect();
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(SyncError::ModelMismatch(wrong.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version(v: u64) -> Arc<Versioned> {
        Arc::new(Versioned::new(v, 1, bapo_policy::testing::tiny_policy(v)))
    }

    fn versions_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| weights_dir::is_ours(n))
            .collect();
        names.sort();
        names
    }

    /// A loader for an engine that never answers (no socket), without LoRA.
    fn unanswered(dir: &Path) -> Loader {
        Loader {
            api: Api::unix(&dir.join("nobody.sock"), "bapo"),
            weights_dir: dir.to_path_buf(),
            mode: UpdateMode::Partial,
            reload_timeout: Duration::from_secs(1),
            lora_rank: 0,
            lora: LoraState::default(),
            transfer: Transfer::default(),
            weight_transfer: true,
        }
    }

    /// An engine that never answers: every load fails after its write.
    /// New versions keep arriving, and the directory keeps one copy.
    #[tokio::test]
    async fn failing_reloads_do_not_pile_up_copies() {
        let dir = tempfile::tempdir().unwrap();
        let mut loader = unanswered(dir.path());
        for v in 1..=4 {
            assert!(loader.load_full(&version(v)).await.is_err());
            assert_eq!(versions_in(dir.path()), [label(1, v)], "after v{v}");
        }
    }

    /// An actor killed while a patch was being written or applied leaves
    /// its `.tmp-<label>/patch.safetensors`; the restarted actor's first
    /// load (from a file) removes it.
    #[tokio::test]
    async fn a_patch_left_by_a_killed_actor_goes_at_the_next_load() {
        let dir = tempfile::tempdir().unwrap();
        let left = dir.path().join(format!(".tmp-{}", label(1, 9)));
        std::fs::create_dir_all(&left).unwrap();
        std::fs::write(left.join("patch.safetensors"), b"half").unwrap();
        let mut loader = unanswered(dir.path());
        assert!(loader.load_full(&version(10)).await.is_err());
        assert_eq!(versions_in(dir.path()), [label(1, 10)]);
    }

    /// An actor started alone without `lora_rank` (or with a smaller
    /// one) stops on the first LoRA version, naming the setting, instead
    /// of retrying adapter loads forever while it looks healthy.
    #[tokio::test]
    async fn lora_versions_into_an_engine_without_lora_stop_the_actor() {
        let p = bapo_policy::testing::tiny_policy(1);
        let lora = bapo_policy::lora::LoraConfig {
            rank: 16,
            ..Default::default()
        };
        let model = bapo_policy::lora::attach(p.model.clone(), &p.config, &lora);
        let device = p.device();
        let v = Arc::new(Versioned::new(
            1,
            1,
            bapo_policy::Policy::with_model(p.config.clone(), model, &device),
        ));
        for configured in [0, 4] {
            let e = check_lora(configured, &v).unwrap_err().to_string();
            assert!(
                e.contains(&format!("actor.vllm.lora_rank = {configured}")),
                "{e}"
            );
        }
        check_lora(16, &v).unwrap(); // also 9: vLLM's next bucket is 16
        check_lora(9, &v).unwrap();
        check_lora(0, &version(1)).unwrap();

        let dir = tempfile::tempdir().unwrap();
        let loader = unanswered(dir.path());
        let (_w_tx, weights) = watch::channel(Some(v));
        let (_up_tx, up) = watch::channel(true);
        let (ready, _) = watch::channel(None);
        let (_stop_tx, stop) = watch::channel(false);
        let run = follow(loader, weights, up, ready, stop);
        let r = tokio::time::timeout(Duration::from_secs(30), run).await;
        assert!(
            matches!(r, Ok(Err(SyncError::Lora { rank: 16, .. }))),
            "{r:?}"
        );
    }
}
