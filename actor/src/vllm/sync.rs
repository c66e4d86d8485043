//! The learner's weights into the engine: each version the subscription
//! delivers is written as an HF safetensors directory (atomically: a
//! temporary directory renamed into place), then the engine pauses,
//! reloads it, relabels the tokens it makes from then on, and resumes.
//!
//! Once the engine holds a whole-model version the actor exported, the
//! next ones go through vLLM's weight-transfer API instead (bapo's
//! `bapo_shm` engine, `actor/vllm/bapo_vllm_ext.py`): the elements that
//! changed since (`bapo_policy::hf_patch`) as one file, written into the
//! engine's parameters in place. The file reload stays for the first
//! load, after a server restart, for LoRA, and whenever a patch fails.
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
    subscription::{PolicyCell, Versioned},
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
    /// The weight-transfer path: what the engine holds, as exported.
    pub transfer: Transfer,
}

/// Whether a version went in as a patch; if not, the export made on
/// the way, for the file reload to write.
enum Patched {
    Yes,
    No(Option<Vec<u8>>),
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
    /// The safetensors export of the version the engine holds (the base a
    /// patch is made against); `None` after a failure or a restart.
    held: Option<Vec<u8>>,
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
        match &v.policy.model.lora {
            Some(adapters) => {
                if self.lora.base != Some(adapters.base) {
                    self.load_base(v).await?;
                    self.lora.base = Some(adapters.base);
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
        let mut base = v.policy.model.clone();
        base.lora = None;
        let base = Arc::new(Versioned {
            version: 0,
            incarnation: v.incarnation,
            policy: bapo_policy::Policy::with_model(
                v.policy.config.clone(),
                base,
                &v.policy.device(),
            ),
        });
        let name = format!(
            "base-{:016x}",
            v.policy.model.lora.as_ref().map_or(0, |a| a.base)
        );
        weights_dir::prune(&self.weights_dir, |n| n == name);
        let (dir, _) = self.write(&base, &name, None).await?;
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
            let adapters = v.policy.model.lora.as_ref().expect("a LoRA version");
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
            Ok(Patched::Yes) => "transfer",
            Ok(Patched::No(export)) => {
                self.reload_full(v, &name, export).await?;
                "reload"
            }
            Err(e) => {
                if self.transfer.ready == Some(true) {
                    counter!(names::ENGINE_TRANSFER_FALLBACKS).increment(1);
                    tracing::warn!("weights {name} as a patch: {e:#}; reloading from a file");
                }
                self.reload_full(v, &name, None).await?;
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

    /// `v` into the engine from an HF directory (from `export` when it
    /// was made already); the export is kept for the patches that follow,
    /// unless the server has no transfer engine.
    async fn reload_full(
        &mut self,
        v: &Arc<Versioned>,
        name: &str,
        export: Option<Vec<u8>>,
    ) -> anyhow::Result<()> {
        self.transfer.held = None;
        weights_dir::prune(&self.weights_dir, |n| n == name);
        let (dir, export) = self.write(v, name, export).await?;
        self.swap(Load::Reload(&dir), name).await?;
        if self.transfer.ready != Some(false) {
            self.transfer.held = Some(export);
        }
        Ok(())
    }

    /// `v` as the elements that changed since the version the engine
    /// holds, through the transfer engine; [`Patched::No`] when a patch
    /// would not pay (no engine, nothing held, or most elements changed:
    /// f32 broadcasts under AdamW) and the file reload is the way. Any
    /// error leaves the patch path until the next file reload (the
    /// engine's weights are then unknown to the actor: the reload sets
    /// them).
    async fn patch(&mut self, v: &Arc<Versioned>, name: &str) -> anyhow::Result<Patched> {
        let Some(held) = self.transfer.held.take() else {
            return Ok(Patched::No(None));
        };
        if self.transfer.ready.is_none() {
            let ready = self.api.init_transfer(self.reload_timeout).await;
            if let Err(e) = &ready {
                tracing::info!(
                    "no weight-transfer engine on this server ({e}); reloading from files"
                );
            }
            self.transfer.ready = Some(ready.is_ok());
        }
        if self.transfer.ready != Some(true) {
            return Ok(Patched::No(None));
        }
        let (policy, dir) = (v.clone(), self.weights_dir.join(format!(".tmp-{name}")));
        let file = std::path::absolute(dir.join("patch.safetensors"))?;
        let (f, d) = (file.clone(), dir.clone());
        let (export, patch) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let export =
                bapo_policy::hf::to_safetensors(&policy.policy).map_err(anyhow::Error::msg)?;
            let patch = bapo_policy::hf_patch::diff(&held, &export)?;
            // Indices and values of most elements: larger than the weights.
            let pays = patch.bytes.len() < export.len();
            if pays {
                let _ = std::fs::remove_dir_all(&d);
                std::fs::create_dir_all(&d)?;
                std::fs::write(&f, &patch.bytes)?;
            }
            Ok((export, pays.then_some(patch)))
        })
        .await??;
        let Some(patch) = patch else {
            return Ok(Patched::No(Some(export)));
        };
        counter!(names::ENGINE_PATCH_BYTES).increment(patch.bytes.len() as u64);
        let applied = self.swap(Load::Patch(&file), name).await;
        let _ = std::fs::remove_dir_all(&dir);
        applied?;
        tracing::debug!(
            "weights {name} as a patch: {} of {} elements, {} bytes",
            patch.changed,
            patch.total,
            patch.bytes.len()
        );
        self.transfer.held = Some(export);
        Ok(Patched::Yes)
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

    /// Writes `v` to `<weights_dir>/<name>` (over anything there), from
    /// `export` when it was made already, and returns the directory and
    /// the safetensors export written.
    async fn write(
        &self,
        v: &Arc<Versioned>,
        name: &str,
        export: Option<Vec<u8>>,
    ) -> anyhow::Result<(PathBuf, Vec<u8>)> {
        let dir = self.weights_dir.join(name);
        let tmp = self.weights_dir.join(format!(".tmp-{name}"));
        let (v, t, d) = (v.clone(), tmp.clone(), dir.clone());
        let export = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<u8>> {
            let export = match export {
                Some(e) => e,
                None => bapo_policy::hf::to_safetensors(&v.policy).map_err(anyhow::Error::msg)?,
            };
            let _ = std::fs::remove_dir_all(&t);
            let _ = std::fs::remove_dir_all(&d);
            bapo_policy::hf::save_bytes(&v.policy, &t, &export)?;
            std::fs::rename(&t, &d)?;
            Ok(export)
        })
        .await??;
        Ok((dir, export))
    }
}

/// Refuses adapters the engine cannot load: LoRA versions into an engine
/// set up without LoRA, or of a rank above the one it was set up for.
fn check_lora(configured: usize, v: &Versioned) -> Result<(), SyncError> {
    let Some(adapters) = &v.policy.model.lora else {
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
    let c = &v.policy.config;
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
        Arc::new(Versioned {
            version: v,
            incarnation: 1,
            policy: bapo_policy::testing::tiny_policy(v),
        })
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
        let v = Arc::new(Versioned {
            version: 1,
            incarnation: 1,
            policy: bapo_policy::Policy::with_model(p.config.clone(), model, &device),
        });
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
