"""Loads a `bapo run --lora` export with Hugging Face transformers and
PEFT: the warm start (the frozen base) plus final/adapter through
PeftModel, against final/ (bapo's merged export) loaded plainly. Prints
the largest logit difference; exits non-zero above 1e-4.

  python scripts/check_peft_export.py RUN_DIR

Needs torch, transformers and peft (scripts/make-policy-fixtures.sh's
venv has them)."""

import sys
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def main(run: Path) -> None:
    ids = torch.tensor([[5, 17, 30, 41, 12, 60, 7, 88, 3]])
    base = AutoModelForCausalLM.from_pretrained(run / "sft", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, run / "final" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval()
    with torch.no_grad():
        a = adapted(ids).logits
        m = merged(ids).logits
        with adapted.disable_adapter():
            b = adapted(ids).logits
    diff = (a - m).abs().max().item()
    moved = (a - b).abs().max().item()
    print(f"PEFT(base + bapo adapter) vs bapo's merged export: max |d logit| {diff:.2e}; "
          f"the adapter moves logits by up to {moved:.3f}")
    sys.exit(0 if diff < 1e-4 and moved > 1e-3 else 1)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
