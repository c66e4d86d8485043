"""Verifiers for the bapo reference reward server.

A verifier is an object with a ``name``, a declared reward range
(``min_reward``/``max_reward``) and one method, ``score(item) -> Result``.
It sees plain Python values (``Item``), never protobuf messages, so it can be
unit-tested without gRPC. The server calls ``score`` from several threads at
once: keep it free of shared mutable state (or lock it).

Raise ``MalformedItem`` when the *input* is unusable (no reference answer,
bad metadata): the server answers INVALID_ARGUMENT naming the item. Any other
exception is a verifier failure: the server answers INTERNAL. Either way no
reward is made up; the actor retries, then drops the group.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence


class MalformedItem(ValueError):
    """The item cannot be judged as sent (a client error, not a wrong answer)."""


@dataclass(frozen=True)
class Item:
    """One completion to judge (mirrors ``bapo.v1.ScoreItem``)."""

    problem_id: str = ""
    task: str = ""
    prompt: str = ""
    completion: str = ""
    answer: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    # Token ids decoded from ``completion_tokens`` (u32 LE); None when the
    # actor did not send them (``[reward] send_tokens = false``).
    completion_tokens: Optional[Sequence[int]] = None
    truncated: bool = False


@dataclass
class Result:
    """A verifier's judgement of one item (mirrors ``bapo.v1.ItemScore``)."""

    reward: float
    # Named parts of the reward, exported by the actor as per-name means.
    sub_scores: dict = field(default_factory=dict)
    # Optional per-token rewards: None, or one per completion token (needs
    # the tokens, i.e. ``send_tokens = true`` on the actor).
    token_rewards: Optional[Sequence[float]] = None


class Verifier:
    """Base class: set the three attributes and implement ``score``."""

    name: str = "verifier"
    min_reward: float = 0.0
    max_reward: float = 1.0

    def score(self, item: Item) -> Result:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        """Called once when the server stops."""


def load(spec: str, **options) -> Verifier:
    """Builds a verifier from ``--verifier``: ``math``, ``code``, or
    ``some.module:factory`` (a class or function returning a Verifier,
    called with no arguments)."""
    if spec == "math":
        from .math import MathVerifier

        return MathVerifier()
    if spec == "code":
        from .code import CodeVerifier

        return CodeVerifier(**options)
    if ":" in spec:
        module, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        verifier = factory()
        for needed in ("name", "min_reward", "max_reward", "score"):
            if not hasattr(verifier, needed):
                raise TypeError(f"{spec}: the verifier has no {needed!r}")
        return verifier
    raise ValueError(f"unknown verifier {spec!r}: use math, code or module:factory")
