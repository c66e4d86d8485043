#!/usr/bin/env python3
"""A minimal real OpenEnv server (openenv-core) for bapo's OpenEnv adapter.

The environment, `arith`, asks one arithmetic question per episode:

* reset (seed?, episode_id?) -> observation `text` = the question
  ("What is 37 + 58? Answer with an integer."), reward null, done false;
* step {"message": "..."}: the LAST integer in the message is the answer.
  Right: reward 1.0, done true. Wrong: reward 0.0 and "Incorrect, try
  again. ..." (done false), until the third wrong attempt, which ends the
  episode (reward 0.0, done true, the text gives the answer).
* a step before the first reset, or after the episode ended, is an error
  (the server answers an EXECUTION_ERROR frame; the session stays open).

It is served by openenv-core's own FastAPI app (`create_fastapi_app`), so
the wire is OpenEnv's: WebSocket `/ws` (one environment per connection),
plus HTTP `/health`, `/schema`, `/metadata`, `/state`, `/reset`, `/step`
(stateless: a fresh env per request) and `/mcp`.

Start it with `scripts/openenv-server.sh serve [--listen HOST:PORT]`. Once
`/health` answers it prints exactly one line to stdout,
`listening on HOST:PORT` (the real port, also for `--listen 127.0.0.1:0`);
logs, access logs included, go to stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import re
import socket
import sys
import threading
import time
import urllib.request
from typing import Any, Optional
from uuid import uuid4

from pydantic import Field

from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import (
    Action,
    ConcurrencyConfig,
    EnvironmentMetadata,
    Observation,
    State,
)

log = logging.getLogger("bapo.openenv")

MAX_ATTEMPTS = 3


class SlowResets:
    """Fault injection for tests: the first `count` resets, server-wide,
    take `delay_s` longer (a container environment booting)."""

    count = 0
    delay_s = 0.0
    _lock = threading.Lock()

    @classmethod
    def wait(cls) -> None:
        with cls._lock:
            slow = cls.count > 0
            cls.count -= int(slow)
        if slow:
            time.sleep(cls.delay_s)
_INT = re.compile(r"-?\d+")


class ArithAction(Action):
    """What the agent says; the last integer in it is its answer."""

    message: str = Field(..., description="The agent's reply; its last integer is the answer")


class ArithObservation(Observation):
    """What the agent is shown (`done`, `reward`, `metadata` come from Observation)."""

    text: str = Field(default="", description="The question, or the verdict on the last answer")
    attempt: int = Field(default=0, ge=0, description="Answers given so far in this episode")
    max_attempts: int = Field(default=MAX_ATTEMPTS, description="Answers allowed per episode")


class ArithState(State):
    """episode_id and step_count (from State), and the episode's progress."""

    question: str = ""
    attempts: int = 0
    solved: bool = False
    done: bool = False


def last_int(message: str) -> Optional[int]:
    found = _INT.findall(message)
    return int(found[-1]) if found else None


class ArithEnvironment(Environment[ArithAction, ArithObservation, ArithState]):
    """One question per episode; up to MAX_ATTEMPTS answers."""

    # Each WebSocket session gets its own instance and nothing is shared,
    # so the server may run several at once (--max-concurrent-envs).
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = ArithState()
        self._answer: Optional[int] = None
        self._started = False

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              **kwargs: Any) -> ArithObservation:
        SlowResets.wait()
        rng = random.Random(seed)
        op = rng.choice("+-*")
        if op == "*":
            a, b = rng.randint(2, 12), rng.randint(2, 12)
        else:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
        self._answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        question = f"What is {a} {op} {b}? Answer with an integer."
        self._state = ArithState(episode_id=episode_id or str(uuid4()), step_count=0,
                                 question=question)
        self._started = True
        return ArithObservation(text=question, attempt=0, done=False, reward=None)

    def step(self, action: ArithAction, timeout_s: Optional[float] = None,
             **kwargs: Any) -> ArithObservation:
        if not self._started:
            raise RuntimeError("no episode: send reset first")
        if self._state.done:
            raise RuntimeError("the episode is over: send reset to start another")
        st = self._state
        st.step_count += 1
        st.attempts += 1
        given = last_int(action.message)
        if given is not None and given == self._answer:
            st.solved = st.done = True
            return ArithObservation(text="Correct!", attempt=st.attempts, done=True, reward=1.0,
                                    metadata={"answer": self._answer, "given": given})
        if st.attempts >= MAX_ATTEMPTS:
            st.done = True
            return ArithObservation(
                text=f"Incorrect. The answer was {self._answer}.",
                attempt=st.attempts, done=True, reward=0.0,
                metadata={"answer": self._answer, "given": given})
        left = MAX_ATTEMPTS - st.attempts
        return ArithObservation(
            text=f"Incorrect, try again ({left} attempt{'s' if left > 1 else ''} left). {st.question}",
            attempt=st.attempts, done=False, reward=0.0, metadata={"given": given})

    @property
    def state(self) -> ArithState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="arith",
            description="One arithmetic question per episode; the last integer of a "
                        f"message is the answer; reward 1 if right, {MAX_ATTEMPTS} attempts.",
            version="1.0.0",
            author="bapo",
        )


def make_app(max_concurrent_envs: int = 4, session_timeout: Optional[float] = None):
    return create_fastapi_app(
        ArithEnvironment, ArithAction, ArithObservation,
        concurrency_config=ConcurrencyConfig(max_concurrent_envs=max_concurrent_envs,
                                             session_timeout=session_timeout),
    )


def bind(listen: str) -> tuple[socket.socket, str, int]:
    """A listening socket on HOST:PORT (port 0: a free one); the real address."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--listen wants HOST:PORT, got {listen!r}")
    host = host.strip("[]") or "127.0.0.1"
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(128)
    sock.set_inheritable(True)
    bound = sock.getsockname()[1]
    return sock, host, bound


def fmt_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def announce_when_healthy(server, host: str, port: int, deadline_s: float = 60.0) -> None:
    """Print `listening on HOST:PORT` once GET /health answers 200."""
    probe = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    url = f"http://{fmt_addr(probe, port)}/health"
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and not server.should_exit:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200 and json.load(r).get("status") == "healthy":
                    print(f"listening on {fmt_addr(host, port)}", flush=True)
                    return
        except Exception:
            pass
        time.sleep(0.05)
    log.error("GET %s did not answer within %.0fs", url, deadline_s)
    server.should_exit = True


def log_config() -> dict:
    """uvicorn's logging, all of it on stderr (stdout carries only the address line)."""
    from uvicorn.config import LOGGING_CONFIG
    cfg = copy.deepcopy(LOGGING_CONFIG)
    for h in cfg["handlers"].values():
        h["stream"] = "ext://sys.stderr"
    cfg["loggers"]["bapo.openenv"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return cfg


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="bapo example OpenEnv server (arith)")
    p.add_argument("--listen", default="127.0.0.1:8000",
                   help="HOST:PORT to listen on; port 0 picks a free port (default %(default)s)")
    p.add_argument("--max-concurrent-envs", type=int, default=4,
                   help="WebSocket sessions at once; more get CAPACITY_REACHED (default %(default)s)")
    p.add_argument("--session-timeout", type=float, default=None,
                   help="seconds an idle session lives (default: forever)")
    p.add_argument("--ws-max-size", type=int, default=16 * 1024 * 1024,
                   help="largest frame the server accepts, bytes (uvicorn; default %(default)s)")
    p.add_argument("--ws-ping-interval", type=float, default=20.0,
                   help="server pings every N s; 0 disables (uvicorn; default %(default)s)")
    p.add_argument("--access-log", action="store_true", help="log every request (to stderr)")
    p.add_argument("--log-level", default="info")
    test = p.add_argument_group("fault injection, for tests only")
    test.add_argument("--slow-resets", type=int, default=0, metavar="N",
                      help="the first N resets take --reset-delay-ms longer")
    test.add_argument("--reset-delay-ms", type=int, default=0, metavar="MS")
    args = p.parse_args(argv)
    if args.max_concurrent_envs < 1:
        p.error("--max-concurrent-envs must be at least 1")
    return args


def main(argv=None) -> int:
    import uvicorn

    args = parse_args(argv)
    try:
        sock, host, port = bind(args.listen)
    except (OSError, ValueError) as e:
        print(f"openenv-server: error: cannot listen on {args.listen}: {e}", file=sys.stderr)
        return 2
    SlowResets.count, SlowResets.delay_s = args.slow_resets, args.reset_delay_ms / 1000
    app = make_app(args.max_concurrent_envs, args.session_timeout)
    ping = args.ws_ping_interval or None
    config = uvicorn.Config(
        app, log_config=log_config(), log_level=args.log_level.lower(), access_log=args.access_log,
        ws_max_size=args.ws_max_size, ws_ping_interval=ping, ws_ping_timeout=ping,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    threading.Thread(target=announce_when_healthy, args=(server, host, port), daemon=True).start()
    server.run(sockets=[sock])  # handles SIGINT/SIGTERM itself
    return 0


if __name__ == "__main__":
    sys.exit(main())
