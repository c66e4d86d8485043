"""Writes policy/tests/fixtures/llama-lora: a LoRA adapter made by PEFT on
the tiny Llama fixture (r 4, alpha 8, all seven projections, random A and
B so it changes the outputs), saved with PEFT's own save_pretrained, and
reference.json with the adapted model's logits (see
make-policy-fixtures.sh)."""

import json
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(fixtures: Path) -> None:
    torch.manual_seed(7)
    base_dir = fixtures / "llama"
    out = fixtures / "llama-lora"
    ids = json.loads((base_dir / "reference.json").read_text())["input_ids"]
    model = LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=TARGETS,
        init_lora_weights=False,  # B random too: the adapter must matter
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, cfg)
    # Larger B than PEFT's test init, so the adapter moves logits by ~0.1+.
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(torch.tensor([ids])).logits[0]
        with peft_model.disable_adapter():
            base = peft_model(torch.tensor([ids])).logits[0]
    peft_model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model-card stub
    ref = {
        "input_ids": ids,
        "logits": adapted.tolist(),
        "max_change_from_base": float((adapted - base).abs().max()),
    }
    (out / "reference.json").write_text(json.dumps(ref))
    print(f"llama-lora: logits moved by up to {ref['max_change_from_base']:.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
