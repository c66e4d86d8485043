"""``calculator``: arithmetic with a tool, the multi-turn hello world.

Reset: one user message, the request's ``prompt``, or when that is empty a
problem drawn from ``seed`` (``draw``). The answer is the request's
``answer`` when given (its integer, see ``answer.py``), else the drawn
problem's; a prompt without an answer is INVALID_ARGUMENT.

Each model turn is either

* a tool call: the first ``<call>EXPR</call>`` in the turn. The step's
  observation is one ``tool`` message, ``<result>VALUE</result>`` or
  ``<result>error: WHY</result>`` (see ``expr.py``), reward 0, not done,
  info ``{"tool_call": "1"}``;
* or, without a call, the final answer: graded by ``answer.grade``
  (reward 1 or 0, done, info ``{"correct": "1"|"0"}``).

The server ends an episode whose last allowed turn (``max_turns``) is
still a call: truncated, reward 0.
"""

from __future__ import annotations

from typing import List, Tuple

from . import BadRequest, Environment, Message, Problem, StepResult, Turn
from .answer import grade, reference_integer
from .expr import ExprError, evaluate

PROMPT = (
    "What is {a} * {b} {op} {c}?\n"
    "You may use a calculator: write <call>EXPRESSION</call> (integers, + - * / and "
    "parentheses) and its value comes back as <result>VALUE</result>. "
    "Give the final answer after ####."
)

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """splitmix64's finaliser (as in bapo's tasks crate), on u64 values."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def draw(seed: int) -> Tuple[str, int]:
    """The problem of `seed`: ``a * b + c`` or ``a * b - c`` with a, b in
    10..=99 and c in 1..=99 (answers 1..=9900), from the words
    ``w(i) = splitmix64(splitmix64(seed) ^ i)`` (the tasks crate's
    ``StableHasher::new(seed).word(i)``): a = 10 + w(0) % 90,
    b = 10 + w(1) % 90, c = 1 + w(2) % 99, "+" when w(3) is even."""
    key = splitmix64(seed & _MASK)
    w = [splitmix64(key ^ i) for i in range(4)]
    a, b, c = 10 + w[0] % 90, 10 + w[1] % 90, 1 + w[2] % 99
    plus = w[3] % 2 == 0
    prompt = PROMPT.format(a=a, b=b, op="+" if plus else "-", c=c)
    return prompt, a * b + c if plus else a * b - c


def first_call(message: str):
    """The text of the turn's first ``<call>...</call>``, or None: what
    ``re.search(r"<call>(.*?)</call>", message, re.S)`` finds, in linear
    time (that expression takes quadratic time on many unclosed
    ``<call>``: 3.6 s for 64 KB)."""
    start = message.find("<call>")
    if start < 0:
        return None
    end = message.find("</call>", start + len("<call>"))
    if end < 0:
        return None  # no later <call> has a close either
    return message[start + len("<call>"):end]


def tool_result(message: str):
    """The value of the turn's first ``<call>``, as the tool's reply, or
    None when the turn makes no call."""
    call = first_call(message)
    if call is None:
        return None
    try:
        value = str(evaluate(call))
    except ExprError as e:
        value = f"error: {e}"
    return f"<result>{value}</result>"


class Calculator(Environment):
    name = "calculator"
    min_reward = 0.0
    max_reward = 1.0

    def __init__(self, max_turns: int = 4):
        self.max_turns = max_turns

    def reset(self, problem: Problem) -> Tuple[int, List[Message]]:
        prompt, own = (problem.prompt, None) if problem.prompt else draw(problem.seed)
        if problem.answer:
            answer = reference_integer(problem.answer)
            if answer is None:
                raise BadRequest(f"answer {problem.answer[-80:]!r} is not an integer")
        elif own is not None:
            answer = own
        else:
            raise BadRequest("a prompt without an answer: the calculator cannot grade it")
        return answer, [Message("user", prompt)]

    def step(self, answer: int, turn: Turn) -> StepResult:
        result = tool_result(turn.message)
        if result is None:
            return grade(turn, answer)
        return StepResult(messages=[Message("tool", result)], info={"tool_call": "1"})
