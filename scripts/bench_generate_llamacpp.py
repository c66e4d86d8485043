"""Batched generation throughput of llama.cpp on the CPU, for comparison
with bapo's own SmolLM2 figure (scripts/bench-llamacpp.sh runs it).

    python bench_generate_llamacpp.py --gguf MODEL.gguf [--batches 8,64]
        [--prompt 16] [--new-tokens 112] [--threads 2] [--sampler numpy]
    python bench_generate_llamacpp.py --convert-f32 Q4_1.gguf OUT.F32.gguf

For each batch size B: one context with n_seq_max = B and
n_ctx = B * (prompt + new), one sequence per seq_id, the same fixed prompt
in each. Prefill is one llama_decode of all B * prompt tokens (timed on its
own); then every step samples one token per sequence and decodes all B of
them in ONE llama_batch against the KV cache. tokens_per_s is
B * new_tokens / wall seconds of that loop (sampling included). EOS is
ignored: every sequence gets exactly new_tokens. A shorter warm-up run
comes first in the same context, whose KV cache is then cleared.

Sampling is at temperature 1: by default in numpy from the logits
(softmax, cumulative sum, one uniform per row: inverse-CDF), or with
--sampler llama, a llama.cpp chain (temp 1, dist) per sequence, which
sorts the whole vocabulary per token (~3.5 ms each here: slower than the
decode at batch 8).

This llama.cpp (b4965) has one unified KV cache: every token of a step
attends over all sequences' cells, masked, so attention costs grow with
batch * length, and at batch 64 outweigh the weights' matmuls (compare
warmup_tokens_per_s, the first steps, with tokens_per_s).

Needs only numpy, cffi and the llama-cpp-cffi wheel, whose CPU extension
`llama/_llama_cpp_cpu*.so` is loaded directly: the package's __init__
imports transformers, jinja2 and more, and probes for CUDA. --convert-f32
also needs gguf.

bapo's policy runs in f32 with weights dequantised from the Q4_1 GGUF;
--convert-f32 writes those same dequantised weights as an all-F32 GGUF,
metadata (architecture, hyperparameters, tokenizer) copied, so llama.cpp
runs the same numbers in the same precision.
"""

import argparse
import ctypes
import glob
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

SANITY_PROMPT = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Any fixed text: its first --prompt tokens (cycled if too short) are the
# benchmark prompt of every sequence.
BENCH_TEXT = (
    "<|im_start|>user\nTell me a long story about a brave little robot who "
    "lives in a big city and dreams of the sea.<|im_end|>\n<|im_start|>assistant\n"
)
FILE_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 7: "q8_0", 32: "bf16"}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- F32 GGUF


def convert_f32(src, dst):
    """Every tensor of src dequantised to F32, all metadata copied."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    tmp = dst + ".tmp"
    w = gguf.GGUFWriter(tmp, arch)  # writes general.architecture itself
    for f in r.fields.values():
        # GGUF.* are the reader's virtual header fields.
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        val = f.contents()
        if f.name == gguf.Keys.General.FILE_TYPE:
            val = int(gguf.LlamaFileType.ALL_F32)
        w.add_key_value(f.name, val, vtype, sub_type=sub)
    for t in r.tensors:
        # dequantize returns numpy order (rows, ne0), which add_tensor
        # turns back into the GGUF shape; names are kept as they are.
        a = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        want = tuple(int(x) for x in reversed(t.shape))
        if a.shape != want:
            raise SystemExit(f"{t.name}: dequantised shape {a.shape}, expected {want}")
        w.add_tensor(t.name, a, raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)
    log(f"wrote {dst}: {len(r.tensors)} tensors, F32, {os.path.getsize(dst) / 1e6:.0f} MB")


# ------------------------------------------------------------ llama.cpp


# llama-cpp-cffi's extension is built with GCC 14, whose code calls
# __cxa_call_terminate (new in libstdc++ 14, GLIBCXX 3.4.33) when an
# exception leaves a noexcept function. Older systems' libstdc++ (Debian 12:
# GCC 12) lacks it and the import fails; the fatal-path-only symbol is
# supplied by a three-line shim, compiled once with the system's cc and
# loaded RTLD_GLOBAL before the extension.
SHIM_C = r"""
void *__cxa_begin_catch(void *);
void _ZSt9terminatev(void) __attribute__((noreturn)); /* std::terminate */
void __cxa_call_terminate(void *ue) { if (ue) __cxa_begin_catch(ue); _ZSt9terminatev(); }
"""


def cxa_shim():
    h = hashlib.sha256(SHIM_C.encode()).hexdigest()[:12]
    for d in (os.path.join(sys.prefix, "lib"), tempfile.gettempdir()):
        path = os.path.join(d, f"bapo-cxa-call-terminate-{h}.so")
        if os.path.exists(path):
            return path
        if os.access(d, os.W_OK):
            break
    src = path[:-3] + ".c"
    with open(src, "w") as f:
        f.write(SHIM_C)
    cc = os.environ.get("CC", "cc")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", path + ".tmp", src, "-l:libstdc++.so.6"],
        check=True,
    )
    os.replace(path + ".tmp", path)
    return path


def load_llama():
    spec = importlib.util.find_spec("llama")  # does not run llama/__init__
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llama-cpp-cffi is not installed")
    sos = glob.glob(os.path.join(spec.submodule_search_locations[0], "_llama_cpp_cpu.*.so"))
    if not sos:
        raise SystemExit("llama-cpp-cffi has no _llama_cpp_cpu extension")
    so = sos[0]

    def load():
        loader = importlib.machinery.ExtensionFileLoader("_llama_cpp_cpu", so)
        s = importlib.util.spec_from_file_location("_llama_cpp_cpu", so, loader=loader)
        m = importlib.util.module_from_spec(s)
        loader.exec_module(m)
        return m

    shim = None
    try:
        m = load()
    except ImportError as e:
        if "__cxa_call_terminate" not in str(e):
            raise
        shim = cxa_shim()
        ctypes.CDLL(shim, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
        m = load()
    # The build's identity: data symbols that the cffi cdef leaves out.
    h = ctypes.CDLL(so)
    build = {
        "build_number": ctypes.c_int.in_dll(h, "LLAMA_BUILD_NUMBER").value,
        "commit": ctypes.c_char_p.in_dll(h, "LLAMA_COMMIT").value.decode(),
        "target": ctypes.c_char_p.in_dll(h, "LLAMA_BUILD_TARGET").value.decode(),
    }
    with open(so, "rb") as f:
        data = f.read()
    i = data.find(b"GCC: (")
    if i >= 0:
        build["compiler"] = data[i : data.index(b"\0", i)].decode(errors="replace")
    build["extension"] = os.path.basename(so)
    build["cxa_shim"] = shim is not None
    return m.lib, m.ffi, build


class Llama:
    def __init__(self, path, threads, verbose):
        lib, ffi, self.build = load_llama()
        self.lib, self.ffi = lib, ffi

        # The extension declares this extern "Python" callback; without
        # one, llama.cpp logs every tensor to stderr.
        @ffi.def_extern(name="llama_cpp_cffi_ggml_log_callback")
        def _log(level, text, user):
            if verbose or level >= lib.GGML_LOG_LEVEL_ERROR:
                sys.stderr.write(ffi.string(text).decode(errors="replace"))

        lib.llama_log_set(lib.llama_cpp_cffi_ggml_log_callback, ffi.NULL)
        lib.llama_backend_init()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        if not verbose:
            # Without a callback the loader prints a line of dots.
            self._progress = ffi.callback("bool(float, void *)", lambda p, u: True)
            mp.progress_callback = self._progress
        self.model = lib.llama_model_load_from_file(path.encode(), mp)
        if self.model == ffi.NULL:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.threads = threads
        buf = ffi.new("char[256]")
        lib.llama_model_desc(self.model, buf, 256)
        self.desc = ffi.string(buf).decode()
        n = lib.llama_model_meta_val_str(self.model, b"general.file_type", buf, 256)
        ft = int(ffi.string(buf)) if n > 0 else None
        self.file_type = FILE_TYPES.get(ft, f"file_type {ft}")
        self.system_info = ffi.string(lib.llama_print_system_info()).decode().strip()

    def context(self, n_ctx, n_batch, n_seq):
        lib = self.lib
        cp = lib.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = min(n_batch, 512)  # llama.cpp's default micro-batch
        cp.n_seq_max = n_seq
        cp.n_threads = self.threads
        cp.n_threads_batch = self.threads
        ctx = lib.llama_init_from_model(self.model, cp)
        if ctx == self.ffi.NULL:
            raise SystemExit(f"llama.cpp could not make a context (n_ctx {n_ctx})")
        return ctx

    def tokenize(self, text):
        ffi = self.ffi
        b = text.encode()
        out = ffi.new("int32_t[]", len(b) + 8)
        # add_special: BOS only if the vocab asks; parse_special: <|im_*|>.
        n = self.lib.llama_tokenize(self.vocab, b, len(b), out, len(b) + 8, True, True)
        if n < 0:
            raise SystemExit("llama_tokenize failed")
        return [out[i] for i in range(n)]

    def piece(self, tok):
        buf = self.ffi.new("char[64]")
        n = self.lib.llama_token_to_piece(self.vocab, tok, buf, 64, 0, False)
        return self.ffi.buffer(buf, max(n, 0))[:]

    def logits(self, ctx, rows):
        """The last decode's logits, rows x n_vocab, a view (no copy)."""
        p = self.lib.llama_get_logits(ctx)
        return np.frombuffer(self.ffi.buffer(p, rows * self.n_vocab * 4), np.float32).reshape(
            rows, self.n_vocab
        )


def fill(lib, batch, toks, pos, seqs, logits):
    batch.n_tokens = len(toks)
    for i, (t, p, s, o) in enumerate(zip(toks, pos, seqs, logits)):
        batch.token[i] = t
        batch.pos[i] = p
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = s
        batch.logits[i] = o


def decode(L, ctx, batch):
    rc = L.lib.llama_decode(ctx, batch)
    if rc != 0:
        raise SystemExit(f"llama_decode returned {rc}")


def sanity(L, max_new=24):
    """Greedy reply to a chat question: the converted model must still
    know that Paris is the capital of France."""
    lib = L.lib
    toks = L.tokenize(SANITY_PROMPT)
    ctx = L.context(512, 512, 1)
    batch = lib.llama_batch_init(512, 0, 1)
    try:
        n = len(toks)
        fill(lib, batch, toks, range(n), [0] * n, [0] * (n - 1) + [1])
        decode(L, ctx, batch)
        out = []
        for i in range(max_new):
            t = int(np.argmax(L.logits(ctx, 1)[0]))
            if lib.llama_vocab_is_eog(L.vocab, t):
                break
            out.append(t)
            fill(lib, batch, [t], [n + i], [0], [1])
            decode(L, ctx, batch)
        return b"".join(L.piece(t) for t in out).decode(errors="replace")
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)


class NumpySampler:
    """Temperature 1 over the full vocabulary: softmax, cumulative sum, one
    uniform per row, binary search (inverse CDF)."""

    name = "numpy inverse-CDF over the full softmax (temperature 1), in Python between decodes"

    def __init__(self, L, n_seq, seed):
        self.L = L
        self.rng = np.random.default_rng(seed)
        self.buf = np.empty((n_seq, L.n_vocab), np.float32)

    def __call__(self, ctx, idx):
        rows = len(idx)
        lg = self.L.logits(ctx, rows)  # outputs come in batch order
        b = self.buf[:rows]
        np.subtract(lg, lg.max(axis=1, keepdims=True), out=b)
        np.exp(b, out=b)
        np.cumsum(b, axis=1, out=b)
        u = self.rng.random(rows) * b[:, -1]
        last = self.L.n_vocab - 1
        return [min(int(np.searchsorted(b[i], u[i], side="right")), last) for i in range(rows)]

    def free(self):
        pass


class LlamaSampler:
    """One llama.cpp chain (temp 1, dist) per sequence."""

    name = "llama.cpp sampler chain per sequence: temp(1.0) + dist"

    def __init__(self, L, n_seq, seed):
        lib = self.lib = L.lib
        self.chains = []
        for s in range(n_seq):
            c = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
            lib.llama_sampler_chain_add(c, lib.llama_sampler_init_temp(1.0))
            lib.llama_sampler_chain_add(c, lib.llama_sampler_init_dist(seed + s))
            self.chains.append(c)

    def __call__(self, ctx, idx):
        return [self.lib.llama_sampler_sample(c, ctx, i) for c, i in zip(self.chains, idx)]

    def free(self):
        for c in self.chains:
            self.lib.llama_sampler_free(c)


def generate(L, ctx, batch, sampler, prompt, n_seq, n_new):
    """One run: prefill all sequences, then n_new batched decode steps.
    Returns timings and the sampled tokens (n_seq x n_new)."""
    lib = L.lib
    P = len(prompt)
    lib.llama_kv_self_clear(ctx)
    fill(
        lib,
        batch,
        prompt * n_seq,
        list(range(P)) * n_seq,
        [s for s in range(n_seq) for _ in range(P)],
        ([0] * (P - 1) + [1]) * n_seq,
    )
    t0 = time.perf_counter()
    decode(L, ctx, batch)
    lib.llama_synchronize(ctx)
    prefill_s = time.perf_counter() - t0

    seqs = list(range(n_seq))
    ones = [1] * n_seq
    # Where each sequence's logits are, as batch indices (for the llama
    # sampler); after prefill, the last prompt token of each.
    idx = [s * P + P - 1 for s in seqs]
    out = []
    t_dec = t_smp = 0.0
    t0 = time.perf_counter()
    for step in range(n_new):
        a = time.perf_counter()
        toks = sampler(ctx, idx)
        b = time.perf_counter()
        fill(lib, batch, toks, [P + step] * n_seq, seqs, ones)
        decode(L, ctx, batch)
        lib.llama_synchronize(ctx)
        t_dec += time.perf_counter() - b
        t_smp += b - a
        idx = seqs
        out.append(toks)
    wall = time.perf_counter() - t0
    return {
        "prefill_s": prefill_s,
        "decode_loop_s": wall,
        "llama_decode_s": t_dec,
        "sample_s": t_smp,
        "tokens": np.array(out).T,
    }


def bench(args):
    L = Llama(args.gguf, args.threads, args.verbose)
    build = L.build
    log(f"llama.cpp b{build['build_number']} ({build['commit']}), {L.desc}")
    log(L.system_info)
    reply = sanity(L)
    log(f"sanity (greedy): {SANITY_PROMPT!r} -> {reply!r}")
    if "paris" not in reply.lower():
        log("WARNING: the greedy reply does not mention Paris")

    base = L.tokenize(BENCH_TEXT)
    prompt = (base * (args.prompt // len(base) + 1))[: args.prompt]
    Sampler = NumpySampler if args.sampler == "numpy" else LlamaSampler
    lib = L.lib
    results = {}
    for B in args.batches:
        n_batch = max(B * args.prompt, B)
        ctx = L.context(B * (args.prompt + args.new_tokens), n_batch, B)
        batch = lib.llama_batch_init(n_batch, 0, 1)
        sampler = Sampler(L, B, args.seed)
        try:
            # Warm-up: same shapes, fewer steps; checks, once, that
            # llama_get_logits' rows are the batch's outputs in order.
            w = generate(L, ctx, batch, sampler, prompt, B, args.warmup_steps)
            lg = L.logits(ctx, B)
            for i in (0, B - 1):
                p = lib.llama_get_logits_ith(ctx, i)
                row = np.frombuffer(L.ffi.buffer(p, L.n_vocab * 4), np.float32)
                assert np.array_equal(row, lg[i]), "logits rows out of order"
            runs = [generate(L, ctx, batch, sampler, prompt, B, args.new_tokens) for _ in range(args.repeats)]
        finally:
            sampler.free()
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)
        n = B * args.new_tokens
        tps = [n / r["decode_loop_s"] for r in runs]
        r = runs[int(np.argsort(tps)[len(tps) // 2])]  # the median run
        results[str(B)] = {
            "tokens_per_s": round(n / r["decode_loop_s"], 2),
            "decode_loop_s": round(r["decode_loop_s"], 3),
            "decode_only_tokens_per_s": round(n / r["llama_decode_s"], 2),
            "sample_s": round(r["sample_s"], 3),
            "prefill_s": round(r["prefill_s"], 3),
            "prefill_tokens_per_s": round(B * args.prompt / r["prefill_s"], 1),
            "warmup_tokens_per_s": round(B * args.warmup_steps / w["decode_loop_s"], 2),
            "runs_tokens_per_s": [round(x, 2) for x in tps],
            "n_ctx": B * (args.prompt + args.new_tokens),
            "distinct_first_tokens": int(len(set(r["tokens"][:, 0].tolist()))),
        }
        log(f"batch {B}: {results[str(B)]}")
        sample_text = b"".join(L.piece(int(t)) for t in r["tokens"][0][:40])
        log(f"  seq 0 continues: {sample_text.decode(errors='replace')!r}")

    lib.llama_model_free(L.model)
    try:
        pkg = importlib.metadata.version("llama-cpp-cffi")
    except importlib.metadata.PackageNotFoundError:
        pkg = "?"
    print(
        json.dumps(
            {
                "llamacpp": f"b{build['build_number']} ({build['commit']}), "
                f"llama-cpp-cffi {pkg} {build['extension']}, {build.get('compiler', '?')}",
                "system_info": L.system_info,
                "libstdcxx_shim": build["cxa_shim"],
                "model": L.desc,
                "threads": args.threads,
                "prompt": args.prompt,
                "new_tokens": args.new_tokens,
                "sampler": Sampler.name,
                "seed": args.seed,
                "warmup_steps": args.warmup_steps,
                "repeats": args.repeats,
                "generate": results,
                "gguf": L.file_type,
                "gguf_path": os.path.abspath(args.gguf),
                "sanity_reply": reply,
            }
        ),
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="the model to benchmark")
    ap.add_argument("--batches", default="8,64", help="comma-separated batch sizes")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=112)
    ap.add_argument("--threads", type=int, default=2, help="n_threads and n_threads_batch")
    ap.add_argument("--sampler", choices=("numpy", "llama"), default="numpy")
    ap.add_argument("--warmup-steps", type=int, default=16, help="decode steps of the warm-up run")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per batch size (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="llama.cpp's own log on stderr")
    ap.add_argument(
        "--convert-f32",
        nargs=2,
        metavar=("SRC", "DST"),
        help="write SRC's weights dequantised as an all-F32 GGUF DST, and exit",
    )
    args = ap.parse_args()
    if args.convert_f32:
        convert_f32(*args.convert_f32)
        return
    if not args.gguf:
        ap.error("--gguf is required")
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.prompt < 1 or args.new_tokens < 1 or not args.batches:
        ap.error("--prompt, --new-tokens and --batches must be positive")
    bench(args)


if __name__ == "__main__":
    main()
