#!/usr/bin/env python3
"""bapo reference environment server: `bapo.v1.EnvironmentService` over gRPC.

Start it with `scripts/env-server.sh serve --env calculator` (which sets up
the virtual environment and the generated stubs). Once it listens it prints
exactly one line to stdout, `listening on HOST:PORT` (the real port, also
when `--listen` asks for port 0); logs go to stderr.

This file is the gRPC glue only: the episode rules (turn numbers, retries,
NOT_FOUND, capacity, expiry) are in episodes.py, the environments in envs/.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import signal
import struct
import sys
import threading
import time
from concurrent import futures
from typing import Optional

# Sandboxed programs are started with fork+exec; gRPC's fork handlers are
# not needed for that (and log noise when other threads use gRPC).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
# Client authentication and --server-user are the reward server's (shared,
# as its code sandbox is): serving.py beside it.
REWARD_SERVER = os.path.join(os.path.dirname(HERE), "reward-server")
if REWARD_SERVER not in sys.path:
    sys.path.append(REWARD_SERVER)

import envs  # noqa: E402
import privileges  # noqa: E402
import serving  # noqa: E402
from envs import Message, Problem, StepResult, Turn  # noqa: E402
from episodes import EpisodeError, Episodes  # noqa: E402

log = logging.getLogger("bapo.env")

# The callers a token or a certificate's SPIFFE role may name: the actors,
# and the learner, whose held-out evaluation plays episodes too.
CLIENT_ROLES = ("actor", "learner")


def _import_stubs():
    stubs = os.environ.get("BAPO_ENV_STUBS")
    if stubs and stubs not in sys.path:
        sys.path.insert(0, stubs)
    try:
        import environment_pb2
        import environment_pb2_grpc
    except ImportError as e:
        raise SystemExit(
            f"cannot import the generated stubs ({e}). Run the server with "
            "`scripts/env-server.sh serve`, or run `scripts/env-server.sh setup` "
            "and set BAPO_ENV_STUBS to the directory holding environment_pb2.py."
        ) from e
    return environment_pb2, environment_pb2_grpc


pb, pb_grpc = _import_stubs()


def _observation(messages):
    return pb.Observation(messages=[pb.EnvMessage(role=m.role, content=m.content) for m in messages])


class Faults:
    """Test-only fault injection (--fail-every, --delay-ms, --slow-resets),
    so a client's retries and deadlines can be exercised against the real
    server."""

    def __init__(self, fail_every: int = 0, delay_ms: int = 0, slow_resets: int = 0,
                 reset_delay_ms: int = 0):
        self.fail_every = fail_every
        self.delay_s = delay_ms / 1000.0
        self.slow_resets = slow_resets
        self.reset_delay_s = reset_delay_ms / 1000.0
        self._steps = itertools.count(1)
        self._lock = threading.Lock()

    def before_step(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)

    def before_reset(self) -> None:
        """The first --slow-resets Resets take --reset-delay-ms longer (an
        environment booting)."""
        with self._lock:
            slow = self.slow_resets > 0
            self.slow_resets -= int(slow)
        if slow:
            time.sleep(self.reset_delay_s)

    def lose_answer(self) -> bool:
        """Whether this Step's answer is to be lost: every Nth Step acts,
        then fails with UNAVAILABLE, as if the connection dropped."""
        if not self.fail_every:
            return False
        with self._lock:
            return next(self._steps) % self.fail_every == 0


class EnvironmentService(pb_grpc.EnvironmentServiceServicer):
    def __init__(self, env, episodes: Episodes, faults: Optional[Faults] = None,
                 max_message_bytes: int = 64 << 10):
        self.env = env
        self.episodes = episodes
        self.faults = faults or Faults()
        self.max_message_bytes = max_message_bytes

    @staticmethod
    def _abort(context, e: EpisodeError):
        context.abort(grpc.StatusCode[e.code], str(e))

    def Describe(self, request, context):
        return pb.EnvInfo(name=self.env.name, max_turns=self.episodes.max_turns,
                          min_reward=self.episodes.lo, max_reward=self.episodes.hi)

    def Reset(self, request, context):
        problem = Problem(task=request.task, problem_id=request.problem_id, prompt=request.prompt,
                          answer=request.answer, metadata=dict(request.metadata), seed=request.seed)
        self.faults.before_reset()
        try:
            episode_id, messages = self.episodes.reset(problem, request.episode_id)
        except EpisodeError as e:
            self._abort(context, e)
        if not context.is_active():
            # The caller gave up (its deadline, a dropped call): nobody will
            # ever name this episode, so it must not hold a slot.
            self.episodes.close(episode_id)
            context.abort(grpc.StatusCode.CANCELLED, "the caller left before its episode started")
        return pb.ResetResponse(episode_id=episode_id, observation=_observation(messages))

    def Step(self, request, context):
        # Before anything looks at it: what an environment does with a
        # turn may grow with its length.
        size = len(request.message.encode("utf-8"))
        if size > self.max_message_bytes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the turn's message is {size} bytes, over this server's limit of "
                          f"{self.max_message_bytes} bytes (--max-message-bytes)")
        self.faults.before_step()
        raw = request.token_ids
        if len(raw) % 4:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"token_ids has {len(raw)} bytes, not a multiple of 4")
        turn = Turn(message=request.message, number=request.turn, truncated=request.truncated,
                    token_ids=struct.unpack(f"<{len(raw) // 4}I", raw) if raw else None)
        try:
            result: StepResult = self.episodes.step(request.episode_id, turn)
        except EpisodeError as e:
            self._abort(context, e)
        if self.faults.lose_answer():
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected failure (--fail-every)")
        return pb.StepResponse(observation=_observation(result.messages), reward=result.reward,
                               done=result.done, truncated=result.truncated, info=result.info)

    def Close(self, request, context):
        self.episodes.close(request.episode_id)
        return pb.CloseResponse()


def build_server(env, listen: str = "127.0.0.1:0", max_episodes: int = 1024,
                 episode_ttl_s: float = 600.0, rpc_threads: int = 16,
                 tls: Optional[tuple] = None, faults: Optional[Faults] = None,
                 max_message_bytes: int = 64 << 10, client_ca: Optional[bytes] = None,
                 tokens: Optional["serving.TokenFile"] = None, max_grpc_bytes: int = 64 << 20):
    """A ready server (not started) bound to `listen`.

    Returns (server, service, "HOST:PORT" with the real port). `tls` is
    (cert_chain_pem_bytes, private_key_pem_bytes) or None; `client_ca`
    (PEM, needs `tls`) requires client certificates it issued; `tokens`
    requires a bearer token of an actor or the learner (serving.py).
    `max_message_bytes` bounds a Step's message (UTF-8)."""
    if (client_ca or tokens) and not tls:
        raise ValueError("client certificates and bearer tokens need TLS")
    service = EnvironmentService(env, Episodes(env, max_episodes, episode_ttl_s), faults,
                                 max_message_bytes)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=rpc_threads, thread_name_prefix="rpc"),
        interceptors=serving.interceptors(CLIENT_ROLES, client_ca, tokens),
        options=[
            ("grpc.max_receive_message_length", max_grpc_bytes),
            ("grpc.max_send_message_length", max_grpc_bytes),
            # Fail when the port is taken instead of silently sharing it.
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_EnvironmentServiceServicer_to_server(service, server)
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--listen {listen!r}: expected HOST:PORT")
    try:
        if tls:
            bound = server.add_secure_port(listen, serving.credentials(tls, client_ca))
        else:
            bound = server.add_insecure_port(listen)
    except RuntimeError as e:  # newer grpcio raises instead of returning 0
        raise OSError(f"cannot listen on {listen}: {e}") from e
    if not bound:
        raise OSError(f"cannot listen on {listen}")
    return server, service, f"{host}:{bound}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="bapo reference environment server (bapo.v1.EnvironmentService)")
    p.add_argument("--listen", default="127.0.0.1:50071",
                   help="HOST:PORT to listen on; port 0 picks a free port (default %(default)s)")
    p.add_argument("--env", default="calculator",
                   help="calculator, python, or module:factory for your own (default %(default)s)")
    p.add_argument("--max-turns", type=int,
                   help="model turns per episode, 0: no limit (default: the environment's, 4)")
    p.add_argument("--max-episodes", type=int, default=1024,
                   help="open episodes at most; Reset beyond is RESOURCE_EXHAUSTED (default %(default)s)")
    p.add_argument("--episode-ttl", type=float, default=600.0,
                   help="seconds an idle episode is kept (default %(default)s)")
    p.add_argument("--rpc-threads", type=int, default=16,
                   help="gRPC handler threads = concurrent calls (default %(default)s)")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (needs --tls-key)")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--max-message-bytes", type=int, default=64 << 10, metavar="N",
                   help="longest turn message (UTF-8 bytes) a Step may carry; longer ones are "
                        "INVALID_ARGUMENT (default %(default)s)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds in-flight calls get on SIGTERM/SIGINT (default %(default)s)")
    p.add_argument("--log-level", default="INFO")
    serving.add_arguments(p, "serve callers without client authentication: anyone who reaches "
                             "the port may play episodes (and with --env python run code)")
    py = p.add_argument_group("python environment (the reward server's sandbox)")
    py.add_argument("--timeout", type=float, default=5.0,
                    help="wall-clock seconds per program (default %(default)s)")
    py.add_argument("--memory-mb", type=int, default=512,
                    help="memory of a program, all its processes together (default %(default)s)")
    py.add_argument("--max-procs", type=int, default=64,
                    help="processes of a program at once (default %(default)s)")
    py.add_argument("--max-files", type=int, default=1000,
                    help="files and directories a program may keep (default %(default)s)")
    py.add_argument("--max-disk-mb", type=int, default=64,
                    help="disk space a program may use (default %(default)s)")
    py.add_argument("--max-output", type=int, default=2048,
                    help="bytes of stdout and of stderr shown, their ends (default %(default)s)")
    py.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                    help="programs run at once (default: the number of CPUs, %(default)s)")
    py.add_argument("--isolation", choices=["auto", "bwrap", "unshare", "none"], default="auto",
                    help="network isolation; auto tries bwrap, then unshare (default %(default)s)")
    py.add_argument("--allow-network", action="store_true",
                    help="run programs even when no network isolation works")
    py.add_argument("--sandbox-user", default="auto",
                    help="uids programs run as, one per program at once: auto (free uids of "
                         "60000-60999), FIRST-LAST, a uid or a name (dedicated to this server: "
                         "each is cleared of processes after every program), or none (the "
                         "server's own, needs --allow-same-user)")
    py.add_argument("--allow-same-user", action="store_true",
                    help="run programs as the server's own user when it cannot switch users "
                         "(they can then read its key and token file, and kill it)")
    py.add_argument("--sandbox-python", help="interpreter for programs (default: python3 on /usr/bin)")
    test = p.add_argument_group("fault injection, for tests only")
    test.add_argument("--fail-every", type=int, default=0, metavar="N",
                      help="every Nth answered Step acts, then fails with UNAVAILABLE (its answer is lost)")
    test.add_argument("--delay-ms", type=int, default=0, metavar="MS",
                      help="every Step sleeps MS milliseconds first")
    test.add_argument("--slow-resets", type=int, default=0, metavar="N",
                      help="the first N Resets sleep --reset-delay-ms first")
    test.add_argument("--reset-delay-ms", type=int, default=0, metavar="MS")
    args = p.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if min(args.rpc_threads, args.workers, args.max_episodes, args.max_output, args.max_message_bytes,
           args.max_files, args.max_disk_mb, args.max_procs, args.memory_mb) < 1:
        p.error("--rpc-threads, --workers, --max-episodes, --max-output, --max-message-bytes, "
                "--max-files, --max-disk-mb, --max-procs and --memory-mb must be at least 1")
    if min(args.fail_every, args.delay_ms, args.slow_resets, args.reset_delay_ms) < 0 \
            or (args.max_turns or 0) < 0:
        p.error("--fail-every, --delay-ms, --slow-resets, --reset-delay-ms and --max-turns "
                "cannot be negative")
    if args.episode_ttl <= 0:
        p.error("--episode-ttl must be positive")
    if args.isolation == "none" and not args.allow_network:
        p.error("--isolation none needs --allow-network")
    serving.check_arguments(
        p, args, "anyone who reaches the port could play episodes and, with --env python, "
                 "run code on this machine")
    return args


def make_env(args):
    turns = {} if args.max_turns is None else {"max_turns": args.max_turns}
    if args.env == "calculator":
        return envs.load("calculator", **turns)
    if args.env == "python":
        return envs.load(
            "python", **turns, max_output=args.max_output, workers=args.workers,
            timeout_s=args.timeout, memory_mb=args.memory_mb, max_procs=args.max_procs,
            isolation=args.isolation, allow_network=args.allow_network,
            python=args.sandbox_python, sandbox_user=args.sandbox_user,
            allow_same_user=args.allow_same_user, max_files=args.max_files,
            max_disk_mb=args.max_disk_mb)
    env = envs.load(args.env)
    if args.max_turns is not None:
        env.max_turns = args.max_turns
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    privileges.drop_privileges(args.server_user)  # re-executes as that user
    env = None
    try:
        tls = None
        if args.tls_cert:
            with open(args.tls_cert, "rb") as c, open(args.tls_key, "rb") as k:
                tls = (c.read(), k.read())
        client_ca, tokens = serving.authentication(args)
        env = make_env(args)
        faults = Faults(args.fail_every, args.delay_ms, args.slow_resets, args.reset_delay_ms)
        server, service, address = build_server(
            env, args.listen, max_episodes=args.max_episodes, episode_ttl_s=args.episode_ttl,
            rpc_threads=args.rpc_threads, tls=tls, faults=faults,
            max_message_bytes=args.max_message_bytes, client_ca=client_ca, tokens=tokens)
    except Exception as e:
        print(f"env-server: error: {e}", file=sys.stderr)
        if env is not None and getattr(env, "close", None):
            env.close()
        return 2

    stopping = threading.Event()

    def on_signal(signum, _frame):
        if stopping.is_set():  # a second signal: stop now
            server.stop(None)
            return
        stopping.set()
        log.info("%s: stopping (grace %.1fs)", signal.Signals(signum).name, args.grace)
        server.stop(args.grace)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    log.info("serving %s (max_turns %d, reward range [%g, %g]) over %s, %s%s", env.name,
             service.episodes.max_turns, service.episodes.lo, service.episodes.hi,
             "TLS" if tls else "plaintext", serving.describe(client_ca, tokens),
             f"; TEST FAULTS: fail every {args.fail_every}, delay {args.delay_ms} ms"
             if args.fail_every or args.delay_ms else "")
    print(f"listening on {address}", flush=True)
    server.wait_for_termination()
    close = getattr(env, "close", None)
    if close:
        close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
