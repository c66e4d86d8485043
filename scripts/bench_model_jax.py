"""JAX (CPU, jit) reference for `bapo bench model`: the same architecture
and shapes as bapo's policy (Llama family: RMSNorm, rotate-half RoPE,
grouped-query attention, SwiGLU, tied head), the same training step
(forward, next-token log-probs, mean, backward, AdamW) and the same cached
generation (preallocated KV cache, categorical sampling at temperature 1,
sampled ids read on the host every step). Prints one JSON object.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax


def init(cfg, key):
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    keys = iter(jax.random.split(key, 8 * cfg["num_hidden_layers"] + 2))
    n = lambda shape: 0.02 * jax.random.normal(next(keys), shape, jnp.float32)
    layers = []
    for _ in range(cfg["num_hidden_layers"]):
        layers.append(
            dict(
                ln1=jnp.ones(h), wq=n((h, nh * hd)), wk=n((h, nkv * hd)), wv=n((h, nkv * hd)),
                wo=n((nh * hd, h)), ln2=jnp.ones(h), wg=n((h, f)), wu=n((h, f)), wd=n((f, h)),
            )
        )
    return dict(embed=n((v, h)), layers=layers, norm=jnp.ones(h))


def rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def rope_tables(hd, theta, max_pos):
    inv = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    ang = jnp.arange(max_pos, dtype=jnp.float32)[:, None] * inv[None, :]
    ang = jnp.concatenate([ang, ang], -1)
    return jnp.cos(ang), jnp.sin(ang)


def rope(x, cos, sin):  # x [B, H, T, D], cos/sin [T, D]
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def attend(q, k, v, mask):  # q [B,H,T,D], k/v [B,H,S,D], mask [T,S] True = keep
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) / jnp.sqrt(q.shape[-1])
    s = jnp.where(mask, s, -jnp.inf)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)


def block(cfg, p, x, cos, sin, kv=None, pos=None):
    b, t, h = x.shape
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    eps = cfg["rms_norm_eps"]
    y = rms(x, p["ln1"], eps)
    heads = lambda z, n: z.reshape(b, t, n, hd).transpose(0, 2, 1, 3)
    q = rope(heads(y @ p["wq"], nh), cos, sin)
    k = rope(heads(y @ p["wk"], nkv), cos, sin)
    v = heads(y @ p["wv"], nkv)
    if kv is None:
        mask = jnp.tril(jnp.ones((t, t), bool))
        new_kv = (k, v)
    else:
        ck, cv = kv
        ck = jax.lax.dynamic_update_slice(ck, k, (0, 0, pos, 0))
        cv = jax.lax.dynamic_update_slice(cv, v, (0, 0, pos, 0))
        k, v, new_kv = ck, cv, (ck, cv)
        mask = (jnp.arange(ck.shape[2]) <= pos + jnp.arange(t)[:, None])
    rep = nh // nkv
    k, v = jnp.repeat(k, rep, 1), jnp.repeat(v, rep, 1)
    o = attend(q, k, v, mask).transpose(0, 2, 1, 3).reshape(b, t, nh * hd)
    x = x + o @ p["wo"]
    y = rms(x, p["ln2"], eps)
    x = x + (jax.nn.silu(y @ p["wg"]) * (y @ p["wu"])) @ p["wd"]
    return x, new_kv


def forward(cfg, params, tokens, tables):
    cos, sin = tables
    t = tokens.shape[1]
    x = params["embed"][tokens]
    for p in params["layers"]:
        x, _ = block(cfg, p, x, cos[:t], sin[:t])
    return rms(x, params["norm"], cfg["rms_norm_eps"]) @ params["embed"].T


def bench_train(cfg, batch, seq, steps, warmup):
    key = jax.random.PRNGKey(0)
    params = init(cfg, key)
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    tables = rope_tables(hd, cfg["rope_theta"], seq)
    opt = optax.adamw(1e-4)
    state = opt.init(params)
    tokens = jax.random.randint(key, (batch, seq), 0, cfg["vocab_size"])

    def loss_fn(p, tok):
        logp = jax.nn.log_softmax(forward(cfg, p, tok, tables)[:, :-1], -1)
        lp = jnp.take_along_axis(logp, tok[:, 1:, None], -1)[..., 0]
        return -lp.mean()

    @jax.jit
    def step(p, s, tok):
        loss, g = jax.value_and_grad(loss_fn)(p, tok)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    t0 = time.perf_counter()
    params, state, loss = step(params, state, tokens)
    loss.block_until_ready()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        params, state, loss = step(params, state, tokens)
    loss.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps):
        params, state, loss = step(params, state, tokens)
    loss.block_until_ready()
    per = (time.perf_counter() - t0) / steps
    return dict(s_per_step=per, tokens_per_s=batch * seq / per, first_step_s=first)


def bench_generate(cfg, batch, prompt_len, new_tokens):
    key = jax.random.PRNGKey(1)
    params = init(cfg, key)
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    nkv = cfg["num_key_value_heads"]
    max_len = prompt_len + new_tokens
    cos, sin = rope_tables(hd, cfg["rope_theta"], max_len)
    zeros = lambda: jnp.zeros((batch, nkv, max_len, hd), jnp.float32)

    @jax.jit
    def decode(params, cache, tok, pos, key):  # tok [B, t]
        t = tok.shape[1]
        x = params["embed"][tok]
        c = jax.lax.dynamic_slice_in_dim(cos, pos, t)
        s = jax.lax.dynamic_slice_in_dim(sin, pos, t)
        new = []
        for p, kv in zip(params["layers"], cache):
            x, kv = block(cfg, p, x, c, s, kv, pos)
            new.append(kv)
        logits = rms(x[:, -1], params["norm"], cfg["rms_norm_eps"]) @ params["embed"].T
        nxt = jax.random.categorical(key, logits)
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits), nxt[:, None], -1)[:, 0]
        return new, nxt, lp

    def run():
        cache = [(zeros(), zeros()) for _ in params["layers"]]
        prompt = jnp.ones((batch, prompt_len), jnp.int32)
        k = jax.random.PRNGKey(2)
        cache, nxt, _ = decode(params, cache, prompt, 0, k)
        for i in range(new_tokens - 1):
            k, sub = jax.random.split(k)
            cache, nxt, lp = decode(params, cache, nxt[:, None], prompt_len + i, sub)
            np.asarray(nxt)  # the host reads the sampled ids every step

    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    run()
    dt = time.perf_counter() - t0
    return dict(tokens_per_s=batch * new_tokens / dt, seconds=dt, first_run_s=first)


def bench_matmul(n=1024, reps=10):
    a = jax.random.normal(jax.random.PRNGKey(3), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        y = f(a)
    y.block_until_ready()
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
    a = ap.parse_args()
    cfg = json.loads(a.config)
    out = dict(
        jax=jax.__version__,
        devices=[str(d) for d in jax.devices()],
        sgemm_gflops=bench_matmul(),
        train=bench_train(cfg, a.batch, a.seq, a.steps, a.warmup),
        generate={
            b: bench_generate(cfg, int(b), a.prompt, a.new_tokens) for b in a.gen_batches.split(",")
        },
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
