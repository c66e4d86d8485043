r"""PyTorch reference for bapo's learner step, for throughput and memory
comparison on one GPU.

Why: bapo's Rust learner is measured against what a plain PyTorch +
transformers (+ peft) implementation of the same step achieves on the same
card, shapes and data. Nothing is downloaded: the model is built from a
Hugging Face `config.json` (scripts/device/configs/) with random weights.

What one training step is (the same as bapo's learner):
  * batch = groups * group_size sequences of prompt + response random token
    ids (seeded), split into micro-batches of --micro-batch-seqs sequences
    (gradient accumulation);
  * per micro-batch: forward under autocast (--dtype; master weights stay
    f32), logits of the response positions cast to f32 and log_softmax'ed in
    f32, the next-token log-probs of the realised tokens, the per-token
    entropy (detached, a metric only), and the token-mean PPO clipped-ratio
    loss  -mean(min(r*A, clip(r, 0.8, 1.28)*A))  with r = exp(lp - lp_old),
    lp_old = -ln(vocab) for every token (the behaviour policy of random
    data is uniform) and advantages +1/-1 alternating per sequence; the loss
    is scaled by the micro-batch's share of the sequences, then backward;
  * clip_grad_norm_(1.0) and AdamW(lr 1e-6, betas (0.9, 0.999), wd 0.01),
    torch's default (foreach) implementation. With f16 a GradScaler is used;
    with f32 matmuls run in TF32.

Measurement: one untimed warm-up step, then --steps timed steps, each
bracketed by torch.cuda.synchronize() and time.perf_counter().
  * tokens_per_s = (prompt + response) * sequences / mean step seconds;
  * peak_mem_gb / reserved_gb = torch.cuda.max_memory_allocated() /
    max_memory_reserved() over the timed steps (stats reset after warm-up),
    in GB of 1e9 bytes (the byte counts are printed too);
  * mfu = model FLOPs per second / peak FLOPs per second. Model FLOPs per
    token = 6 * N_trainable + 4 * N_frozen + 12 * L * (heads * head_dim) * T,
    where N_* count the weights of every matmul (nn.Linear: the decoder's
    projections and the LM head, whether tied or not; embedding lookup,
    norms and biases excluded), split by requires_grad. So full fine-tuning
    is the usual 6N (forward 2N, backward 4N); LoRA is 4 * N_frozen (forward
    2N plus the activation gradient 2N, no weight gradient) + 6 * N_lora.
    The attention term is the PaLM paper's (appendix B) 12 * L * H * Q * T,
    NOT halved for the causal mask (T = prompt + response). Peak defaults
    to H100 SXM dense: 989.4 TFLOP/s for bf16/f16, 494.7 for f32 (TF32);
    --peak-tflops overrides.

Output: ONE JSON line on stdout. A CUDA out-of-memory error prints the same
line with "error": "oom" and exits 0, so that a sweep goes on.

Usage:
  python3 scripts/device/torch_learner.py \
      --config scripts/device/configs/qwen2.5-0.5b.json --mode full \
      --dtype bf16 [--groups 8 --group-size 8 --prompt 16 --response 256 \
      --micro-batch-seqs 8 --steps 3 --attn sdpa --grad-checkpointing \
      --device cuda --seed 0 --peak-tflops 989.4]
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

CLIP_LOW, CLIP_HIGH = 0.8, 1.28
LORA_TARGETS = [
    "q_proj", "k_proj", "v_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj",
]
PEAK_TFLOPS = {"bf16": 989.4, "f16": 989.4, "f32": 494.7}
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
OOM_TYPES = tuple(
    e for e in (getattr(torch, "OutOfMemoryError", None),
                getattr(torch.cuda, "OutOfMemoryError", None))
    if e is not None
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True,
                   help="HF config.json (or a directory holding one)")
    p.add_argument("--mode", choices=["full", "lora"], default="full")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--micro-batch-seqs", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--attn", default="sdpa",
                   help="transformers attn_implementation (sdpa, eager, ...)")
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s for MFU (default: H100 SXM)")
    args = p.parse_args(argv)
    if min(args.groups, args.group_size, args.prompt, args.response,
           args.micro_batch_seqs, args.steps) < 1:
        p.error("sizes and --steps must be positive")
    return args


def config_name(path):
    p = Path(path)
    return p.parent.name if p.name == "config.json" else p.stem


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def enable_checkpointing(model):
    """Non-reentrant activation checkpointing of every decoder layer.
    transformers 5.x renamed the method; both names are tried."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=kwargs)


def build_model(args, device):
    """Random-init model from config.json, f32 master weights on `device`;
    LoRA wraps it with peft and freezes the base."""
    cfg = AutoConfig.from_pretrained(args.config)
    cfg.use_cache = False
    torch.manual_seed(args.seed)
    with device:
        model = AutoModelForCausalLM.from_config(
            cfg, attn_implementation=args.attn, dtype=torch.float32)
    model.to(device)
    if args.grad_checkpointing:
        enable_checkpointing(model)
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                          target_modules=LORA_TARGETS, bias="none",
                          task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    model.train()
    return model, cfg


def make_batch(cfg, args, device):
    """Seeded random token ids [S, P+R] and advantages +1/-1 per sequence.
    Generated on the CPU so the data do not depend on the device."""
    n_seqs = args.groups * args.group_size
    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, cfg.vocab_size,
                           (n_seqs, args.prompt + args.response),
                           generator=gen, dtype=torch.long)
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n_seqs)])
    return tokens.to(device), adv.to(device)


def micro_batches(tokens, adv, size):
    return list(zip(tokens.split(size), adv.split(size)))


def response_logprobs(model, ids, prompt_len):
    """f32 log-softmax over the positions that predict the response tokens
    (prompt_len-1 .. T-2), the realised tokens' log-probs [B, R] and the
    detached per-token entropy [B, R]."""
    logits = model(input_ids=ids, use_cache=False).logits
    logp = torch.log_softmax(logits[:, prompt_len - 1:-1].float(), dim=-1)
    targets = ids[:, prompt_len:]
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def ppo_loss(lp, lp_old, adv):
    """Token-mean clipped-ratio surrogate, negated for minimisation."""
    ratio = torch.exp(lp - lp_old)
    a = adv.unsqueeze(-1)
    surrogate = torch.minimum(ratio * a,
                              ratio.clamp(CLIP_LOW, CLIP_HIGH) * a)
    return -surrogate.mean()


def autocast_ctx(device, dtype_name):
    if dtype_name == "f32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype_name])


def train_step(model, opt, scaler, batches, n_seqs, lp_old, args, device):
    """One optimiser step over all micro-batches; returns (loss, entropy)
    as 0-d tensors (no host sync inside the step)."""
    opt.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=device)
    ent_sum = torch.zeros((), device=device)
    for ids, adv in batches:
        share = ids.shape[0] / n_seqs
        with autocast_ctx(device, args.dtype):
            lp, entropy = response_logprobs(model, ids, args.prompt)
            loss = ppo_loss(lp, lp_old, adv) * share
        (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += loss.detach()
        ent_sum += entropy.mean() * share
    params = [p for p in model.parameters() if p.requires_grad]
    if scaler:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return loss_sum, ent_sum


def make_optimizer(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.999),
                             weight_decay=0.01)


def matmul_params(model):
    """(trainable, frozen) weight counts of every nn.Linear; a tied LM head
    is counted as a matmul (it is one), once per module."""
    trainable = frozen = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            n = module.weight.numel()
            if module.weight.requires_grad:
                trainable += n
            else:
                frozen += n
    return trainable, frozen


def flops_per_token(model, cfg, seq_len):
    """6*N_trainable + 4*N_frozen + PaLM attention 12*L*H*Q*T (not halved
    for causality); see the module docstring."""
    n_train, n_frozen = matmul_params(model)
    head_dim = getattr(cfg, "head_dim", None) or (
        cfg.hidden_size // cfg.num_attention_heads)
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads \
        * head_dim * seq_len
    return 6 * n_train + 4 * n_frozen + attn


def param_counts(model):
    params = list(model.parameters())  # unique: a tied head counts once
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return total, trainable


def run(args, record):
    device = torch.device(args.device)
    if args.dtype == "f32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if device.type == "cuda":
        record["device_name"] = torch.cuda.get_device_name(device)
    model, cfg = build_model(args, device)
    record["params"], record["trainable"] = param_counts(model)
    tokens, adv = make_batch(cfg, args, device)
    n_seqs = tokens.shape[0]
    batches = micro_batches(tokens, adv, args.micro_batch_seqs)
    lp_old = -math.log(cfg.vocab_size)
    opt = make_optimizer(model)
    scaler = torch.amp.GradScaler(device.type) if args.dtype == "f16" \
        else None
    step = (model, opt, scaler, batches, n_seqs, lp_old, args, device)

    train_step(*step)  # warm-up: allocator, kernels, optimiser state
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        loss, entropy = train_step(*step)
        sync(device)
        times.append(time.perf_counter() - t0)
    fill_results(record, args, model, cfg, device, times)
    record["loss"] = float(loss)
    record["entropy"] = float(entropy)


def fill_results(record, args, model, cfg, device, times):
    seq_len = args.prompt + args.response
    tokens_per_step = seq_len * args.groups * args.group_size
    step_s = statistics.mean(times)
    fpt = flops_per_token(model, cfg, seq_len)
    peak = (args.peak_tflops or PEAK_TFLOPS[args.dtype]) * 1e12
    record.update({
        "tokens_per_step": tokens_per_step,
        "step_s": [round(t, 6) for t in times],
        "tokens_per_s": tokens_per_step / step_s,
        "flops_per_token": fpt,
        "mfu": fpt * tokens_per_step / step_s / peak,
        "peak_tflops": peak / 1e12,
    })
    if device.type == "cuda":
        alloc = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        record.update({
            "peak_mem_gb": alloc / 1e9, "reserved_gb": reserved / 1e9,
            "peak_mem_bytes": alloc, "reserved_bytes": reserved,
        })


def base_record(args):
    return {
        "impl": "torch",
        "config": config_name(args.config),
        "mode": args.mode,
        "dtype": args.dtype,
        "attn": args.attn,
        "grad_checkpointing": args.grad_checkpointing,
        "groups": args.groups,
        "group_size": args.group_size,
        "prompt": args.prompt,
        "response": args.response,
        "micro_batch_seqs": args.micro_batch_seqs,
        "steps": args.steps,
        "attn_flops": "palm_12LHQT_not_causal_halved",
        "device_name": None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def is_oom(err):
    """CUDA OOM, including allocation failures that cuBLAS/cuDNN report as
    a plain RuntimeError."""
    return isinstance(err, OOM_TYPES) or "out of memory" in str(err).lower()


def main(argv=None):
    args = parse_args(argv)
    record = base_record(args)
    try:
        run(args, record)
    except RuntimeError as err:  # OutOfMemoryError is a RuntimeError
        if not is_oom(err):
            raise
        record["error"] = "oom"
        record["message"] = (str(err).splitlines() or [""])[0][:300]
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
