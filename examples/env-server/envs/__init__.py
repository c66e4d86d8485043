"""Environments for the bapo reference environment server.

An environment is an object with a ``name``, a turn limit (``max_turns``,
0 for none), a declared reward range (``min_reward``/``max_reward``) and
two methods:

* ``reset(problem) -> (state, messages)``: starts an episode. ``state`` is
  the environment's own per-episode value (the server keeps it and hands it
  back to ``step``); ``messages`` is the first observation.
* ``step(state, turn) -> StepResult``: answers one model turn.

It sees plain Python values, never protobuf messages, so it can be
unit-tested without gRPC. Episode ids, turn numbers, retries, the turn
limit, capacity and expiry are the server's (``episodes.py``): ``step`` is
called once per turn, in order, never twice at once for one episode, but
for different episodes from several threads at once, so keep shared state
out of the environment object (or lock it).

Raise ``BadRequest`` when the *input* is unusable (a reference answer that
is not a number, a missing prompt): the server answers INVALID_ARGUMENT.
Any other exception is the environment's failure: INTERNAL. Either way no
observation or reward is made up.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Sequence, Tuple


class BadRequest(ValueError):
    """The request cannot be served as sent (a client error, not a bad turn)."""


@dataclass(frozen=True)
class Message:
    """One chat message (mirrors ``bapo.v1.EnvMessage``)."""

    role: str
    content: str


@dataclass(frozen=True)
class Problem:
    """What an episode starts from (mirrors ``bapo.v1.ResetRequest``)."""

    task: str = ""
    problem_id: str = ""
    prompt: str = ""
    answer: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    seed: int = 0


@dataclass(frozen=True)
class Turn:
    """One model turn (mirrors ``bapo.v1.StepRequest``)."""

    message: str
    number: int = 0
    # Decoded from ``token_ids`` (u32 LE); None when the actor sent none.
    token_ids: Optional[Sequence[int]] = None
    # Cut off by the actor's per-turn token cap.
    truncated: bool = False


@dataclass
class StepResult:
    """An environment's answer to one turn (mirrors ``bapo.v1.StepResponse``).

    ``messages`` is what the model sees next; the server drops it when the
    step ends the episode (``done`` or ``truncated``), as the protocol says.
    """

    messages: List[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    info: dict = field(default_factory=dict)


class Environment:
    """Base class: set the four attributes and implement both methods."""

    name: str = "environment"
    max_turns: int = 0
    min_reward: float = 0.0
    max_reward: float = 1.0

    def reset(self, problem: Problem) -> Tuple[Any, List[Message]]:  # pragma: no cover
        raise NotImplementedError

    def step(self, state: Any, turn: Turn) -> StepResult:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Called once when the server stops."""


def load(spec: str, **options) -> Environment:
    """Builds an environment from ``--env``: ``calculator``, ``python``, or
    ``some.module:factory`` (a class or function returning an Environment,
    called with no arguments)."""
    if spec == "calculator":
        from .calculator import Calculator

        return Calculator(**options)
    if spec == "python":
        from .python_sandbox import PythonSandbox

        return PythonSandbox(**options)
    if ":" in spec:
        module, _, attr = spec.partition(":")
        env = getattr(importlib.import_module(module), attr)()
        for needed in ("name", "max_turns", "min_reward", "max_reward", "reset", "step"):
            if not hasattr(env, needed):
                raise TypeError(f"{spec}: the environment has no {needed!r}")
        return env
    raise ValueError(f"unknown environment {spec!r}: use calculator, python or module:factory")
