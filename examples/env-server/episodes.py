"""The server's side of the protocol's episode rules, without gRPC.

Environments only answer turns; everything that makes an episode safe to
call over a network that loses answers lives here, once for all of them:

* every episode has a random id, the actor's proposal when it sends one
  (so it can close an episode whose Reset answer it never got); an
  unknown (closed, expired, never opened, or lost to a restart) id is
  NOT_FOUND, which the actor takes as "drop the episode, do not retry".
  A Close that arrives while its Reset is still running is remembered
  (the last ``capacity`` such ids), and that Reset then opens nothing and
  answers ABORTED;
* turns are numbered from 0. A repeat of the latest answered turn gets the
  very same answer again without calling the environment (a retry after a
  lost answer must not act twice); a turn that skips ahead, an older one,
  or any new turn after the episode ended is FAILED_PRECONDITION. One
  episode's turns are served one at a time, so a retry that arrives while
  its original is still running waits for it and gets its answer;
* a step whose turn is the episode's last allowed one (``max_turns``) and
  that does not end the episode is cut: ``truncated``, its observation
  dropped. A step that ends the episode sends no observation;
* rewards must be finite and inside the environment's declared range, else
  INTERNAL: nothing is clamped or made up;
* at most ``capacity`` episodes are open (RESOURCE_EXHAUSTED beyond), and
  one idle for ``ttl_s`` seconds is dropped (actors that die never close
  theirs). A step must take less than the TTL.

Errors are ``EpisodeError`` with the name of a gRPC status code, which the
server passes on with the message.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from envs import BadRequest, Environment, Message, Problem, StepResult, Turn

log = logging.getLogger("bapo.env.episodes")

# The longest episode id an actor may propose.
MAX_EPISODE_ID = 64


class EpisodeError(Exception):
    """A refused call: `code` names a grpc.StatusCode (e.g. "NOT_FOUND")."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class _Episode:
    state: Any
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_turn: int = 0
    last: Optional[StepResult] = None  # the answer to turn next_turn - 1
    ended: bool = False
    closed: bool = False


class Episodes:
    def __init__(self, env: Environment, capacity: int = 1024, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.env = env
        self.lo, self.hi = float(env.min_reward), float(env.max_reward)
        if not (math.isfinite(self.lo) and math.isfinite(self.hi) and self.lo <= self.hi):
            raise ValueError(f"environment range [{self.lo}, {self.hi}] is not a finite interval")
        self.max_turns = int(env.max_turns)
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._open: Dict[str, _Episode] = {}
        # Ids closed before they were open: their Reset is still running.
        self._closed_early: "OrderedDict[str, None]" = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    # --- the three calls --------------------------------------------------

    def reset(self, problem: Problem, episode_id: str = "") -> Tuple[str, List[Message]]:
        """Opens an episode under `episode_id` (the actor's proposal) or
        a random id when none is proposed."""
        if len(episode_id) > MAX_EPISODE_ID or not episode_id.isprintable():
            raise EpisodeError("INVALID_ARGUMENT",
                               f"episode_id of {len(episode_id)} characters: at most "
                               f"{MAX_EPISODE_ID} printable ones")
        self._make_room(episode_id)
        state, messages = self._call(self.env.reset, problem)
        messages = [_message(m) for m in messages]
        with self._lock:
            if episode_id and self._closed_early.pop(episode_id, False) is None:
                raise EpisodeError("ABORTED", f"episode {episode_id!r} was closed before it started")
            self._make_room_locked(episode_id)
            while not episode_id or episode_id in self._open:
                episode_id = secrets.token_hex(12)
            self._open[episode_id] = _Episode(state, self.clock())
        return episode_id, messages

    def step(self, episode_id: str, turn: Turn) -> StepResult:
        episode = self._get(episode_id)
        with episode.lock:
            if episode.closed:
                raise EpisodeError("NOT_FOUND", f"episode {episode_id!r} was closed")
            episode.last_used = self.clock()
            if episode.last is not None and turn.number == episode.next_turn - 1:
                return episode.last  # a retry: the same answer, nothing acts twice
            if episode.ended:
                raise EpisodeError(
                    "FAILED_PRECONDITION",
                    f"episode {episode_id!r} ended at turn {episode.next_turn - 1}; "
                    f"got turn {turn.number}")
            if turn.number != episode.next_turn:
                raise EpisodeError(
                    "FAILED_PRECONDITION",
                    f"episode {episode_id!r} expects turn {episode.next_turn}, got turn {turn.number}")
            result = self._checked(self._call(self.env.step, episode.state, turn), turn.number)
            episode.last = result
            episode.next_turn += 1
            episode.ended = result.done or result.truncated
            episode.last_used = self.clock()
            return result

    def close(self, episode_id: str) -> None:
        """Frees the episode; an unknown id is fine (closing is idempotent)."""
        with self._lock:
            episode = self._open.pop(episode_id, None)
            if episode is None and episode_id:
                self._closed_early[episode_id] = None
                while len(self._closed_early) > self.capacity:
                    self._closed_early.popitem(last=False)
        if episode is not None:
            episode.closed = True

    # --- helpers ----------------------------------------------------------

    def _get(self, episode_id: str) -> _Episode:
        with self._lock:
            episode = self._open.get(episode_id)
            if episode is not None and self.clock() - episode.last_used > self.ttl_s:
                del self._open[episode_id]
                episode = None
        if episode is None:
            raise EpisodeError("NOT_FOUND", f"no open episode {episode_id!r} "
                               "(closed, idle too long, or the server restarted)")
        return episode

    def _make_room(self, episode_id: str = "") -> None:
        with self._lock:
            self._make_room_locked(episode_id)

    def _make_room_locked(self, episode_id: str = "") -> None:
        if episode_id in self._open:
            raise EpisodeError("ALREADY_EXISTS", f"episode {episode_id!r} is open already")
        now = self.clock()
        for episode_id in [k for k, e in self._open.items() if now - e.last_used > self.ttl_s]:
            del self._open[episode_id]
        if len(self._open) >= self.capacity:
            raise EpisodeError("RESOURCE_EXHAUSTED",
                               f"{len(self._open)} episodes open, the limit (--max-episodes)")

    @staticmethod
    def _call(fn, *args):
        try:
            return fn(*args)
        except BadRequest as e:
            raise EpisodeError("INVALID_ARGUMENT", str(e)) from e
        except EpisodeError:
            raise
        except Exception as e:
            log.exception("the environment failed")
            raise EpisodeError("INTERNAL", f"the environment raised {type(e).__name__}: {e}") from e

    def _checked(self, result: StepResult, turn: int) -> StepResult:
        """A copy of the environment's answer that keeps the protocol."""
        try:
            reward = float(result.reward)
        except (TypeError, ValueError) as e:
            raise EpisodeError("INTERNAL", f"the environment returned reward {result.reward!r}") from e
        if not (math.isfinite(reward) and self.lo <= reward <= self.hi):
            raise EpisodeError("INTERNAL",
                               f"the environment returned reward {reward}, outside [{self.lo}, {self.hi}]")
        done = bool(result.done)
        truncated = bool(result.truncated) or (
            not done and self.max_turns > 0 and turn + 1 >= self.max_turns)
        messages = [] if done or truncated else [_message(m) for m in result.messages]
        info = {str(k): str(v) for k, v in (result.info or {}).items()}
        return StepResult(messages=messages, reward=reward, done=done, truncated=truncated, info=info)


def _message(m) -> Message:
    if not isinstance(m, Message):
        raise EpisodeError("INTERNAL", f"the environment returned {type(m).__name__}, not a Message")
    return Message(str(m.role), str(m.content))
