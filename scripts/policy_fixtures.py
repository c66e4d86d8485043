"""Writes tiny HF reference models for bapo's parity tests (see
make-policy-fixtures.sh)."""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "12 + 34 = 46. 7 * 8 = 56. 100 - 1 = 99.",
    "Question: what is 2 + 2? Answer: 4. #### 4",
    "A quick brown fox jumps over the lazy dog.",
]
PROMPT = "The capital of France is"
VOCAB = 300


def tokenizer():
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def write(name, model, tok, out):
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(d)
    for extra in ["generation_config.json", "tokenizer_config.json", "special_tokens_map.json"]:
        (d / extra).unlink(missing_ok=True)
    ids = tok.encode(PROMPT).ids
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits[0]
        greedy = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=16,
            pad_token_id=0,
            eos_token_id=None,
        )[0, len(ids):]
    ref = {
        "prompt": PROMPT,
        "input_ids": ids,
        "logits": [[round(float(v), 7) for v in row] for row in logits],
        "greedy": greedy.tolist(),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    }
    (d / "reference.json").write_text(json.dumps(ref))
    print(name, sum(p.numel() for p in model.parameters()), "params,", len(ids), "prompt tokens")


def main(out):
    out = Path(out)
    torch.manual_seed(0)
    tok = tokenizer()
    vocab = tok.get_vocab_size()
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        # Peaky distributions, so greedy decoding has no near-ties.
        initializer_range=0.2,
        torch_dtype="float32",
    )
    llama = LlamaForCausalLM(
        LlamaConfig(**common, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    ).eval()
    write("llama", llama, tok, out)
    qwen = Qwen2ForCausalLM(
        Qwen2Config(**common, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    ).eval()
    write("qwen2", qwen, tok, out)
    # The same Qwen2 weights as a sharded checkpoint (index + shards).
    sharded = out / "qwen2-sharded"
    sharded.mkdir(parents=True, exist_ok=True)
    qwen.save_pretrained(sharded, safe_serialization=True, max_shard_size="150KB")
    (sharded / "generation_config.json").unlink(missing_ok=True)
    print("qwen2-sharded", sorted(p.name for p in sharded.iterdir()))


if __name__ == "__main__":
    main(sys.argv[1])
