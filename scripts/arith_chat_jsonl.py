#!/usr/bin/env python3
"""Writes two-digit addition questions in GSM8K's JSONL shape for the
`jsonl` task: {"question": "What is 27 + 82?", "answer": "#### 109"}.

Deterministic (its own seeded generator), each pair of operands once, so
the held-out split (a hash of the question) is the same on every machine.

    python3 scripts/arith_chat_jsonl.py OUT.jsonl [LINES]   # default 4000
"""
import json
import random
import sys


def main() -> None:
    out = sys.argv[1]
    lines = int(sys.argv[2]) if len(sys.argv) > 2 else 4000
    if not 0 < lines <= 90 * 90:
        sys.exit(f"arith_chat_jsonl: LINES must be 1..=8100 (distinct pairs), got {lines}")
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(20261126).shuffle(pairs)
    with open(out, "w") as f:
        for a, b in pairs[:lines]:
            f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"}) + "\n")


if __name__ == "__main__":
    main()
