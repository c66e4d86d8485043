"""A math verifier for GSM8K-style and arithmetic problems.

The completion's final number is compared with the item's ``answer``.
The final number is, in order of preference (the same order as bapo's
built-in verifier, ``tasks/src/numeric.rs``):

1. the last number inside the last ``\\boxed{...}``;
2. the first number after the last ``####``;
3. the first number after the last "answer is" / "answer:" (any case);
4. else the last number anywhere in the text.

Numbers may carry thousands separators (``1,234``), a sign (``-3``, with
U+2212 too; ``16-3`` is a subtraction, not ``-3``), a ``$``, decimals
(``3.50``, ``.5``), and be simple fractions (``3/4``, ``\\frac{3}{4}``).
They are parsed exactly (``fractions.Fraction``) and equal when they differ
by at most 1e-6 relative.

Reward 1.0 when correct, else 0.0. Sub-scores: ``correct`` (0/1) and
``format`` (1 when the completion states its answer explicitly, cases 1-3).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional, Tuple

from . import Item, MalformedItem, Result, Verifier

REL_TOL = 1e-6

# A number: optional sign and dollar, an integer part (thousands groups only
# after 1-3 leading digits and only as exact groups of three), an optional
# decimal part, and optionally "/ denominator" for a simple fraction.
_NUMBER = re.compile(
    r"(?P<sign>[-\u2212])?\$?"
    r"(?P<int>\d{1,3}(?:,\d{3}(?!\d))+|\d+|(?=\.\d))"
    r"(?P<frac>\.\d+)?"
    r"(?:[ \t]*/[ \t]*(?P<den>\d+)(?![\d.,]))?"
)
# \frac{3}{4}, \dfrac{-3}{4}, \tfrac{3}{4} -> 3/4 (before scanning).
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([-\u2212]?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
# A minus sign right after one of these is a subtraction ("16-3", "x-1").
_OPERAND_END = set(")]}._")


def _prepare(text: str) -> str:
    return _LATEX_FRAC.sub(r"\1/\2", text)


def _numbers(text: str, start: int = 0, end: Optional[int] = None):
    """Yields (value, span) for each number in text[start:end]."""
    end = len(text) if end is None else end
    pos = start
    while True:
        m = _NUMBER.search(text, pos, end)
        if m is None:
            return
        if m.end() == m.start():  # cannot happen (a digit is required); be safe
            pos = m.end() + 1
            continue
        pos = m.end()
        sign = m.group("sign")
        negative = False
        if sign:
            before = text[m.start() - 1] if m.start() > 0 else " "
            negative = not (before.isalnum() or before in _OPERAND_END)
        int_part = (m.group("int") or "").replace(",", "") or "0"
        value = Fraction(int_part + (m.group("frac") or ""))
        den = m.group("den")
        if den is not None and not m.group("frac") and int(den) != 0:
            value /= int(den)
        yield (-value if negative else value), m.span()


def _first(text: str, start: int, end: Optional[int] = None) -> Optional[Fraction]:
    for value, _ in _numbers(text, start, end):
        return value
    return None


def _last(text: str, start: int = 0, end: Optional[int] = None) -> Optional[Fraction]:
    last = None
    for value, _ in _numbers(text, start, end):
        last = value
    return last


def _boxed(text: str) -> Optional[Fraction]:
    """The last number inside the last \\boxed{...} (braces balanced; an
    unclosed box runs to the end of the text)."""
    at = text.rfind("\\boxed{")
    if at < 0:
        return None
    start = at + len("\\boxed{")
    depth, end = 1, len(text)
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                end = i
                break
    return _last(text, start, end)


def _after_marker(text: str, markers) -> Optional[Fraction]:
    at = max((text.rfind(m) + len(m) if m in text else -1) for m in markers)
    return None if at < 0 else _first(text, at)


def explicit_final_number(text: str) -> Optional[Fraction]:
    """The number the text explicitly states as its answer, or None."""
    text = _prepare(text)
    for found in (
        lambda: _boxed(text),
        lambda: _after_marker(text, ["####"]),
        lambda: _after_marker(text.lower(), ["answer is", "answer:"]),
    ):
        value = found()
        if value is not None:
            return value
    return None


def extract_final_number(text: str) -> Tuple[Optional[Fraction], bool]:
    """(the final number or None, whether it was stated explicitly)."""
    value = explicit_final_number(text)
    if value is not None:
        return value, True
    return _last(_prepare(text)), False


def parse_number(text: str) -> Optional[Fraction]:
    """A text that is one number and nothing else (tolerating whitespace, a
    leading +, a trailing period or %), or None."""
    t = _prepare(text).strip()
    t = t[:-1] if t.endswith(".") else t
    t = t[:-1].rstrip() if t.endswith("%") else t
    t = t[1:] if t.startswith("+") else t
    found = list(_numbers(t))
    if len(found) == 1 and found[0][1] == (0, len(t)):
        return found[0][0]
    return None


def reference_value(answer: str) -> Optional[Fraction]:
    """The reference answer: GSM8K's full solution ("... #### 72") or a bare
    number ("72", "-3/4", "1,234.5")."""
    if "####" in answer or "\\boxed{" in answer:
        return explicit_final_number(answer)
    return parse_number(answer)


def numbers_close(a: Fraction, b: Fraction, rel_tol: float = REL_TOL) -> bool:
    if a == b:
        return True
    return abs(a - b) <= Fraction(rel_tol) * max(abs(a), abs(b))


class MathVerifier(Verifier):
    name = "math-final-number"
    min_reward = 0.0
    max_reward = 1.0

    def score(self, item: Item) -> Result:
        expected = reference_value(item.answer)
        if expected is None:
            raise MalformedItem(f"answer {item.answer[:80]!r} is not a number")
        got, explicit = extract_final_number(item.completion)
        correct = got is not None and numbers_close(got, expected)
        return Result(
            reward=1.0 if correct else 0.0,
            sub_scores={"correct": float(correct), "format": float(explicit)},
        )
