#!/usr/bin/env python3
"""Code-block extraction: the old regular expression against the linear scan.

    python3 examples/reward-server/bench_extract.py [SIZE_KB ...]

Prints, for each adversarial text and size (default 10, 40 and 160 KB),
the seconds the old expression (``re.findall`` of
r"```[ \\t]*([A-Za-z0-9_+-]*)[^\\n]*\\n(.*?)```", re.S: quadratic on these
texts) and ``verifiers.code.fenced_blocks`` (linear) take, and checks that
both find the same blocks. The old one runs once per size (it takes
seconds from 40 KB on), the new one the best of five. A benchmark, not a
test: no thresholds. Needs only the standard library.
"""

from __future__ import annotations

import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from verifiers.code import fenced_blocks  # noqa: E402

OLD = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)

# name -> the unit repeated to the size.
TEXTS = {
    "backticks": "`",              # every position starts a fence attempt
    "fences without newline": "```a",
    "fenced blocks (benign)": "```python\nx = 1\n```\n",
}


def timed(fn, text, repeat):
    best = float("inf")
    result = None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn(text)
        best = min(best, time.perf_counter() - start)
    return best, result


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main(argv) -> int:
    sizes = [int(a) for a in argv] or [10, 40, 160]
    print(f"# {cpu_name()}, Python {sys.version.split()[0]}")
    print(f"{'text':26} {'size':>8} {'old (s)':>10} {'new (s)':>10} {'old/new':>9}")
    for name, unit in TEXTS.items():
        for kb in sizes:
            text = (unit * (kb * 1024 // len(unit) + 1))[: kb * 1024]
            old_s, old = timed(OLD.findall, text, 1)
            new_s, new = timed(lambda t: list(fenced_blocks(t)), text, 5)
            if old != new:
                print(f"MISMATCH on {name} at {kb} KB", file=sys.stderr)
                return 1
            ratio = old_s / new_s if new_s > 0 else float("inf")
            print(f"{name:26} {kb:>6}KB {old_s:>10.4f} {new_s:>10.6f} {ratio:>9.3g}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
