"""PyTorch (CPU, eager) reference for `bapo bench model --reference torch`:
the same architecture and shapes as bapo's policy and as the JAX reference
(Llama family: RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU,
tied head), the same training step (forward, next-token log-probs, mean,
backward, AdamW) and the same cached generation (preallocated KV cache,
categorical sampling at temperature 1, sampled ids read on the host every
step). Attention is torch's scaled_dot_product_attention, as transformers'
"sdpa" Llama uses. Prints one JSON object, as bench_model_jax.py does.
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F


def init(cfg, gen):
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh

    def n(*shape):
        return (0.02 * torch.randn(*shape, generator=gen)).requires_grad_()

    def ones(d):
        return torch.ones(d).requires_grad_()

    layers = [
        dict(
            ln1=ones(h), wq=n(h, nh * hd), wk=n(h, nkv * hd), wv=n(h, nkv * hd),
            wo=n(nh * hd, h), ln2=ones(h), wg=n(h, f), wu=n(h, f), wd=n(f, h),
        )
        for _ in range(cfg["num_hidden_layers"])
    ]
    return dict(embed=n(v, h), layers=layers, norm=ones(h))


def params_of(p):
    out = [p["embed"], p["norm"]]
    for layer in p["layers"]:
        out += list(layer.values())
    return out


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(hd, theta, max_pos):
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def rope(x, cos, sin):  # x [B, H, T, D], cos/sin [T, D]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def block(cfg, p, x, cos, sin, cache=None, pos=0):
    b, t, h = x.shape
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    y = rms(x, p["ln1"], cfg["rms_norm_eps"])
    heads = lambda z, n: z.view(b, t, n, hd).transpose(1, 2)
    q = rope(heads(y @ p["wq"], nh), cos, sin)
    k = rope(heads(y @ p["wk"], nkv), cos, sin)
    v = heads(y @ p["wv"], nkv)
    if cache is None:
        causal, mask = True, None
    else:
        ck, cv = cache
        ck[:, :, pos : pos + t] = k
        cv[:, :, pos : pos + t] = v
        k, v = ck[:, :, : pos + t], cv[:, :, : pos + t]
        causal = False
        mask = torch.arange(pos + t)[None, :] <= pos + torch.arange(t)[:, None]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=nh != nkv
    )
    x = x + o.transpose(1, 2).reshape(b, t, nh * hd) @ p["wo"]
    y = rms(x, p["ln2"], cfg["rms_norm_eps"])
    return x + (F.silu(y @ p["wg"]) * (y @ p["wu"])) @ p["wd"]


def forward(cfg, p, tokens, tables, caches=None, pos=0):
    cos, sin = tables
    t = tokens.shape[1]
    x = p["embed"][tokens]
    for i, layer in enumerate(p["layers"]):
        cache = None if caches is None else caches[i]
        x = block(cfg, layer, x, cos[pos : pos + t], sin[pos : pos + t], cache, pos)
    return rms(x, p["norm"], cfg["rms_norm_eps"]) @ p["embed"].T


def bench_train(cfg, batch, seq, steps, warmup):
    gen = torch.Generator().manual_seed(0)
    p = init(cfg, gen)
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    tables = rope_tables(hd, cfg["rope_theta"], seq)
    opt = torch.optim.AdamW(params_of(p), lr=1e-4)
    tokens = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=gen)

    def step():
        logp = F.log_softmax(forward(cfg, p, tokens, tables)[:, :-1], -1)
        loss = -logp.gather(-1, tokens[:, 1:, None]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    per = (time.perf_counter() - t0) / steps
    return dict(s_per_step=per, tokens_per_s=batch * seq / per, first_step_s=first)


@torch.inference_mode()
def bench_generate(cfg, batch, prompt_len, new_tokens):
    gen = torch.Generator().manual_seed(1)
    p = init(cfg, gen)
    p = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in p.items()}
    p["layers"] = [{k: v.detach() for k, v in l.items()} for l in p["layers"]]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // nh
    cap = prompt_len + new_tokens
    tables = rope_tables(hd, cfg["rope_theta"], cap)
    prompt = torch.randint(0, cfg["vocab_size"], (1, prompt_len), generator=gen).repeat(batch, 1)

    def run():
        caches = [
            (torch.zeros(batch, nkv, cap, hd), torch.zeros(batch, nkv, cap, hd))
            for _ in range(cfg["num_hidden_layers"])
        ]
        logits = forward(cfg, p, prompt, tables, caches, 0)[:, -1]
        pos = prompt_len
        for _ in range(new_tokens):
            tok = torch.multinomial(F.softmax(logits, -1), 1, generator=gen)
            tok.tolist()  # read on the host, as an actor does
            logits = forward(cfg, p, tok, tables, caches, pos)[:, -1]
            pos += 1

    run()
    t0 = time.perf_counter()
    run()
    s = time.perf_counter() - t0
    return dict(s=s, tokens_per_s=batch * new_tokens / s)


def bench_matmul(n=1024, reps=10):
    a = torch.randn(n, n)
    a @ a
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ a
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="JSON model config")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gen-batches", default="16,64")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=112)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = json.loads(a.config)
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    out = dict(
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        sgemm_gflops=bench_matmul(),
        train=bench_train(cfg, a.batch, a.seq, a.steps, a.warmup),
        generate={
            b: bench_generate(cfg, int(b), a.prompt, a.new_tokens) for b in a.gen_batches.split(",")
        },
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
