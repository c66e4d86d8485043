r"""f32 PyTorch reference values for checking bapo's Rust forward and
backward against transformers on the same weights and tokens.

Why: a throughput comparison means little unless both sides compute the
same function. This script builds a model from a Hugging Face config.json
(scripts/device/configs/) with seeded random weights, saves it as a HF
directory (config.json + model.safetensors, f32) that bapo's loader reads,
and writes the expected outputs for a fixed batch next to it.

What it computes, in f32 with no autocast and TF32 off:
  * tokens [B, T]: seeded random ids (CPU generator, device-independent);
  * logits [B, T, V] of the forward pass;
  * next_logprobs [B, T-1]: log_softmax(logits)[b, t, tokens[b, t+1]];
  * the gradient of objective = sum over b and t = 0..T-2 of next_logprobs
    with respect to model.embed_tokens.weight,
    model.layers.0.self_attn.q_proj.weight,
    model.layers.0.mlp.down_proj.weight and model.norm.weight. With tied
    embeddings the embedding gradient includes the LM head's share (they
    are one tensor).

out_dir/ref.safetensors holds: tokens (int32 [B, T]), logits_tail (f32
[B, 8, V], the last 8 positions, to keep the file small), logits_absmax,
logits_sum, objective (f32 [1] each), next_logprobs (f32 [B, T-1]) and
grad.<HF name> (f32) for each weight above. One JSON line on stdout names
the files and gives sums of each stored tensor.

Usage:
  python3 scripts/device/torch_parity.py \
      --config scripts/device/configs/smollm2-135m.json --out-dir OUT \
      [--seed 0 --batch 2 --seq 64 --device cuda|cpu --attn sdpa]
"""

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

GRAD_WEIGHTS = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
]
TAIL = 8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True,
                   help="HF config.json (or a directory holding one)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--attn", default="sdpa",
                   help="transformers attn_implementation")
    args = p.parse_args(argv)
    if args.batch < 1 or args.seq < 2:
        p.error("--batch must be >= 1 and --seq >= 2")
    return args


def strict_f32():
    """No reduced-precision matmuls anywhere."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def build_model(args, device):
    cfg = AutoConfig.from_pretrained(args.config)
    cfg.use_cache = False
    torch.manual_seed(args.seed)
    with device:
        model = AutoModelForCausalLM.from_config(
            cfg, attn_implementation=args.attn, dtype=torch.float32)
    return model.to(device).train()


def save_model(model, out_dir):
    """HF directory in f32 safetensors (transformers 5 always writes
    safetensors and has no safe_serialization argument)."""
    kwargs = {}
    params = inspect.signature(model.save_pretrained).parameters
    if "safe_serialization" in params:
        kwargs["safe_serialization"] = True
    model.save_pretrained(out_dir, **kwargs)
    files = sorted(p.name for p in Path(out_dir).glob("*.safetensors"))
    return [str(Path(out_dir) / f) for f in files]


def make_tokens(vocab, args):
    gen = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, vocab, (args.batch, args.seq), generator=gen,
                         dtype=torch.long)


def forward_backward(model, tokens):
    """Logits, next-token log-probs, their sum and its gradients."""
    named = dict(model.named_parameters())
    missing = [n for n in GRAD_WEIGHTS if n not in named]
    if missing:
        raise SystemExit(f"weights not in the model: {missing}")
    logits = model(input_ids=tokens, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    next_lp = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    objective = next_lp.sum()
    grads = torch.autograd.grad(objective, [named[n] for n in GRAD_WEIGHTS])
    return logits.detach(), next_lp.detach(), objective.detach(), grads


def reference_tensors(tokens, logits, next_lp, objective, grads):
    def host(t):
        return t.detach().to("cpu", torch.float32).contiguous()

    out = {
        "tokens": tokens.to("cpu", torch.int32).contiguous(),
        "logits_tail": host(logits[:, -TAIL:]),
        "logits_absmax": host(logits.abs().max().reshape(1)),
        "logits_sum": host(logits.double().sum().reshape(1)),
        "objective": host(objective.reshape(1)),
        "next_logprobs": host(next_lp),
    }
    for name, g in zip(GRAD_WEIGHTS, grads):
        out[f"grad.{name}"] = host(g)
    return out


def main(argv=None):
    args = parse_args(argv)
    strict_f32()
    device = torch.device(args.device)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(args, device)
    weight_files = save_model(model, out_dir)
    tokens = make_tokens(model.config.vocab_size, args).to(device)
    logits, next_lp, objective, grads = forward_backward(model, tokens)
    tensors = reference_tensors(tokens, logits, next_lp, objective, grads)
    ref_path = out_dir / "ref.safetensors"
    save_file(tensors, str(ref_path))
    print(json.dumps({
        "impl": "torch",
        "config": args.config,
        "out_dir": str(out_dir),
        "weights": weight_files,
        "ref": str(ref_path),
        "seed": args.seed,
        "batch": args.batch,
        "seq": args.seq,
        "device": str(device),
        "attn": args.attn,
        "objective": float(objective),
        "sums": {k: float(v.double().sum()) for k, v in tensors.items()},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
