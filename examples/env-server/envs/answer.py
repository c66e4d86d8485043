"""Final answers: the model's integer, and the reference it is graded by.

Kept deliberately simple (integers only) so another implementation can
match it exactly:

* An *integer* in free text is a run of ASCII digits, optionally with
  thousands separators (``1,795``: commas followed by exactly three digits
  and then no further digit), optionally preceded by ``-`` when the
  character before the ``-`` is not a digit (``= -3`` is minus three,
  ``16-3`` is sixteen and three).
* The model's answer (``final_integer``) is the first integer after the
  last ``####`` when there is one there (as bapo's built-in verifiers
  read ``####``), else the last integer in the whole text; None when the
  text has none.
* A reference answer (``reference_integer``) is the text after its last
  ``####`` (GSM8K's solutions end in ``#### 72``), else the whole text,
  which, trimmed and without thousands separators, must be one integer.
"""

from __future__ import annotations

import re
from typing import Optional

_INTEGER = re.compile(r"(?:(?<![0-9])-)?[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|(?:(?<![0-9])-)?[0-9]+")
_REFERENCE = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)")

MARKER = "####"


def final_integer(text: str) -> Optional[int]:
    """The model's final answer: see the module's docstring."""
    _, marker, tail = text.rpartition(MARKER)
    after = _INTEGER.search(tail) if marker else None
    if after is not None:
        return int(after.group().replace(",", ""))
    found = _INTEGER.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def reference_integer(answer: str) -> Optional[int]:
    """The reference answer as an integer, or None when it is not one."""
    text = answer.rpartition(MARKER)[2].strip()
    if not _REFERENCE.fullmatch(text):
        return None
    return int(text.replace(",", ""))


def grade(turn, answer: Optional[int]):
    """The step that ends an episode on the model's final answer: reward 1
    when its integer equals `answer`, else 0. A turn cut off by the token
    cap states no answer (reward 0), and without a reference answer there
    is nothing to be right about (reward 0, info ``no_answer``)."""
    from . import StepResult

    if answer is None:
        return StepResult(reward=0.0, done=True, info={"correct": "0", "no_answer": "1"})
    correct = not turn.truncated and final_integer(turn.message) == answer
    return StepResult(reward=1.0 if correct else 0.0, done=True,
                      info={"correct": "1" if correct else "0"})
