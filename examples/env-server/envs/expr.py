"""The calculator's safe evaluator: integer arithmetic, nothing else.

The model's expression is untrusted text, so it is parsed by hand (no
``eval``, no ``ast``) with a grammar small enough to mirror exactly in
another language:

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := ("+" | "-") factor | INTEGER | "(" expr ")"

INTEGER is a run of ASCII digits; spaces, tabs and newlines between tokens
are ignored. ``/`` is exact division: a quotient that is not a whole number
is an error, not a rounding. Every value, literals included, must stay
within +-10**18 (it fits a signed 64-bit integer), and an expression is at
most 256 characters, which also bounds the parser's recursion.
"""

from __future__ import annotations

from typing import List

MAX_LEN = 256
LIMIT = 10**18

_DIGITS = "0123456789"
_SPACE = " \t\r\n"
_OPERATORS = "+-*/()"


class ExprError(ValueError):
    """Why an expression has no value; the message is shown to the model."""


def evaluate(text: str) -> int:
    """The value of `text`, or ExprError saying why it has none."""
    text = text.strip(_SPACE)
    if not text:
        raise ExprError("empty expression")
    if len(text) > MAX_LEN:
        raise ExprError(f"expression longer than {MAX_LEN} characters")
    parser = _Parser(_tokens(text))
    value = parser.expr()
    if parser.pos < len(parser.tokens):
        raise ExprError(f"unexpected {parser.tokens[parser.pos]!r}")
    return value


def _tokens(text: str) -> List[str]:
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c in _SPACE:
            i += 1
        elif c in _OPERATORS:
            out.append(c)
            i += 1
        elif c in _DIGITS:
            j = i
            while j < len(text) and text[j] in _DIGITS:
                j += 1
            out.append(text[i:j])
            i = j
        else:
            raise ExprError(f"unexpected character {c!r}")
    return out


def _checked(value: int) -> int:
    if abs(value) > LIMIT:
        raise ExprError("number too large")
    return value


class _Parser:
    def __init__(self, tokens: List[str]):
        self.tokens = tokens
        self.pos = 0

    def _peek(self) -> str:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ""

    def _next(self) -> str:
        token = self._peek()
        if not token:
            raise ExprError("unexpected end of expression")
        self.pos += 1
        return token

    def expr(self) -> int:
        value = self.term()
        while self._peek() in ("+", "-"):
            op = self._next()
            rhs = self.term()
            value = _checked(value + rhs if op == "+" else value - rhs)
        return value

    def term(self) -> int:
        value = self.factor()
        while self._peek() in ("*", "/"):
            op = self._next()
            rhs = self.factor()
            if op == "*":
                value = _checked(value * rhs)
            elif rhs == 0:
                raise ExprError("division by zero")
            elif value % rhs:
                raise ExprError(f"{value} / {rhs} is not a whole number")
            else:
                value = value // rhs
        return value

    def factor(self) -> int:
        token = self._next()
        if token == "-":
            return -self.factor()
        if token == "+":
            return self.factor()
        if token == "(":
            value = self.expr()
            if self._next() != ")":
                raise ExprError("expected ')'")
            return value
        if token[0] in _DIGITS:
            return _checked(int(token))
        raise ExprError(f"unexpected {token!r}")
