#!/usr/bin/env python3
"""bapo reference reward server: `bapo.v1.RewardService` over gRPC.

Start it with `scripts/reward-server.sh serve --verifier math` (which sets
up a virtual environment and the generated stubs). Once it listens it prints
exactly one line to stdout, `listening on HOST:PORT` (the real port, also
when `--listen` asks for port 0); logs go to stderr.

Every answer is the verifier's: a malformed item is refused with
INVALID_ARGUMENT, a failing verifier with INTERNAL, both naming the item;
the server never substitutes a reward.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import queue
import signal
import struct
import sys
import threading
from concurrent import futures
from typing import List, Optional

# Sandboxed programs are started with fork+exec; gRPC's fork handlers are
# not needed for that (and log noise when other threads use gRPC).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import privileges  # noqa: E402
import serving  # noqa: E402
import verifiers  # noqa: E402
from verifiers import Item, MalformedItem  # noqa: E402

log = logging.getLogger("bapo.reward")

# The callers a token or a certificate's SPIFFE role may name.
CLIENT_ROLES = ("actor",)


def _import_stubs():
    stubs = os.environ.get("BAPO_REWARD_STUBS")
    if stubs and stubs not in sys.path:
        sys.path.insert(0, stubs)
    try:
        import reward_pb2
        import reward_pb2_grpc
    except ImportError as e:
        raise SystemExit(
            f"cannot import the generated stubs ({e}). Run the server with "
            "`scripts/reward-server.sh serve`, or run `scripts/reward-server.sh setup` "
            "and set BAPO_REWARD_STUBS to the directory holding reward_pb2.py."
        ) from e
    return reward_pb2, reward_pb2_grpc


pb, pb_grpc = _import_stubs()


class ItemError(Exception):
    """A failed item: the status code and a message naming the item."""

    def __init__(self, code: grpc.StatusCode, index: int, problem_id: str, message: str):
        # A status message travels as a header: a long id is cut.
        shown = repr(problem_id) if len(problem_id) <= 80 else repr(problem_id[:80]) + "..."
        super().__init__(f"item {index} (problem_id {shown}): {message}")
        self.code = code


def decode_item(index: int, msg, max_completion_bytes: Optional[int] = None) -> Item:
    if max_completion_bytes is not None:
        # Before any verifier (and its regular expressions) sees it.
        size = len(msg.completion.encode("utf-8"))
        if size > max_completion_bytes:
            raise ItemError(grpc.StatusCode.INVALID_ARGUMENT, index, msg.problem_id,
                            f"the completion is {size} bytes, over this server's limit of "
                            f"{max_completion_bytes} bytes (--max-completion-bytes)")
    tokens = None
    raw = msg.completion_tokens
    if raw:
        if len(raw) % 4:
            raise ItemError(grpc.StatusCode.INVALID_ARGUMENT, index, msg.problem_id,
                            f"completion_tokens has {len(raw)} bytes, not a multiple of 4")
        tokens = struct.unpack(f"<{len(raw) // 4}I", raw)
    return Item(
        problem_id=msg.problem_id,
        task=msg.task,
        prompt=msg.prompt,
        completion=msg.completion,
        answer=msg.answer,
        metadata=dict(msg.metadata),
        completion_tokens=tokens,
        truncated=msg.truncated,
    )


class RewardService(pb_grpc.RewardServiceServicer):
    def __init__(self, verifier, workers: int, stream_window: int = 16,
                 max_completion_bytes: int = 1 << 20):
        self.verifier = verifier
        self.max_completion_bytes = max_completion_bytes
        self.lo = float(verifier.min_reward)
        self.hi = float(verifier.max_reward)
        if not (math.isfinite(self.lo) and math.isfinite(self.hi) and self.lo <= self.hi):
            raise ValueError(f"verifier range [{self.lo}, {self.hi}] is not a finite interval")
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")
        self.stream_window = stream_window

    # --- one item -----------------------------------------------------------

    def _score_one(self, index: int, item: Item):
        fail = lambda code, msg: ItemError(code, index, item.problem_id, msg)  # noqa: E731
        try:
            result = self.verifier.score(item)
        except MalformedItem as e:
            raise fail(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        except Exception as e:
            log.exception("verifier failed on item %d (problem_id %r)", index, item.problem_id)
            raise fail(grpc.StatusCode.INTERNAL, f"verifier raised {type(e).__name__}: {e}") from e
        internal = grpc.StatusCode.INTERNAL
        try:
            reward = float(result.reward)
        except (TypeError, ValueError) as e:
            raise fail(internal, f"verifier returned a non-number reward {result.reward!r}") from e
        if not (math.isfinite(reward) and self.lo <= reward <= self.hi):
            raise fail(internal, f"verifier returned reward {reward}, outside [{self.lo}, {self.hi}]")
        sub_scores = {}
        for name, value in (result.sub_scores or {}).items():
            value = float(value)
            if not math.isfinite(value):
                raise fail(internal, f"sub_score {name!r} is {value}")
            sub_scores[str(name)] = value
        token_rewards = b""
        if result.token_rewards is not None:
            n = len(item.completion_tokens or ())
            values = [float(v) for v in result.token_rewards]
            if len(values) != n:
                raise fail(internal, f"{len(values)} token rewards for {n} completion tokens")
            if not all(math.isfinite(v) for v in values):
                raise fail(internal, "a token reward is not finite")
            token_rewards = struct.pack(f"<{n}f", *values)
        return pb.ItemScore(reward=reward, token_rewards=token_rewards, sub_scores=sub_scores)

    # --- one request --------------------------------------------------------

    def _submit(self, request) -> List[futures.Future]:
        """Decodes every item (all or nothing), then queues them for scoring."""
        items = [decode_item(i, m, self.max_completion_bytes) for i, m in enumerate(request.items)]
        return [self.pool.submit(self._score_one, i, item) for i, item in enumerate(items)]

    @staticmethod
    def _collect(work: List[futures.Future]):
        """The scores in item order; the first failing item's error."""
        try:
            return [f.result() for f in work]
        finally:
            RewardService._cancel(work)  # after a failure: skip the rest

    # --- RPCs ---------------------------------------------------------------

    def Score(self, request, context):
        try:
            work = self._submit(request)
            # A cancelled call or a passed deadline: skip what has not started.
            context.add_callback(lambda: RewardService._cancel(work))
            scores = self._collect(work)
        except ItemError as e:
            context.abort(e.code, str(e))
        return pb.ScoreResponse(scores=scores, request_id=request.request_id)

    def ScoreStream(self, request_iterator, context):
        # A reader thread decodes and queues each request as it arrives, so
        # several batches of one stream are scored at once; answers leave in
        # request order. The queue bounds how far the reader runs ahead.
        pending: "queue.Queue" = queue.Queue(maxsize=self.stream_window)
        done = threading.Event()
        end = object()

        def drain():  # cancel what was queued but not answered
            while True:
                try:
                    entry = pending.get_nowait()
                except queue.Empty:
                    return
                if isinstance(entry, tuple) and isinstance(entry[1], list):
                    RewardService._cancel(entry[1])

        def put(entry) -> bool:
            while not done.is_set():
                try:
                    pending.put(entry, timeout=0.2)
                    return True
                except queue.Full:
                    continue
            if isinstance(entry, tuple) and isinstance(entry[1], list):
                RewardService._cancel(entry[1])
            return False

        def on_rpc_done():  # also on cancellation and passed deadlines
            done.set()
            drain()

        context.add_callback(on_rpc_done)

        def reader():
            try:
                for request in request_iterator:
                    try:
                        work = self._submit(request)
                    except ItemError as e:
                        put((request.request_id, e))
                        return
                    if not put((request.request_id, work)):
                        return
            except Exception as e:  # the client went away: nothing to answer
                log.debug("ScoreStream reader stopped: %s", e)
            finally:
                put(end)

        threading.Thread(target=reader, name="score-stream", daemon=True).start()
        try:
            while True:
                try:
                    entry = pending.get(timeout=0.5)
                except queue.Empty:
                    if done.is_set():  # the call ended (cancelled, deadline)
                        return
                    continue
                if entry is end:
                    return
                request_id, work = entry
                if isinstance(work, ItemError):
                    context.abort(work.code, f"request {request_id!r}: {work}")
                try:
                    scores = self._collect(work)
                except ItemError as e:
                    context.abort(e.code, f"request {request_id!r}: {e}")
                yield pb.ScoreResponse(scores=scores, request_id=request_id)
        finally:
            on_rpc_done()

    @staticmethod
    def _cancel(work):
        for f in work:
            f.cancel()

    def Describe(self, request, context):
        return pb.RewardInfo(name=self.verifier.name, min_reward=self.lo, max_reward=self.hi)

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.verifier, "close", None)
        if close:
            close()


def build_server(verifier, listen: str = "127.0.0.1:0", workers: int = 4,
                 rpc_threads: int = 16, tls: Optional[tuple] = None,
                 max_message_bytes: int = 64 << 20, client_ca: Optional[bytes] = None,
                 tokens: Optional["serving.TokenFile"] = None,
                 max_completion_bytes: int = 1 << 20):
    """A started-ready server (not started) bound to `listen`.

    Returns (server, service, "HOST:PORT" with the real port). `tls` is
    (cert_chain_pem_bytes, private_key_pem_bytes) or None; `client_ca`
    (PEM, needs `tls`) requires client certificates it issued; `tokens`
    requires an actor's bearer token (serving.py). A completion longer than
    `max_completion_bytes` (UTF-8) is INVALID_ARGUMENT."""
    if (client_ca or tokens) and not tls:
        raise ValueError("client certificates and bearer tokens need TLS")
    service = RewardService(verifier, workers=workers, max_completion_bytes=max_completion_bytes)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=rpc_threads, thread_name_prefix="rpc"),
        interceptors=serving.interceptors(CLIENT_ROLES, client_ca, tokens),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Fail when the port is taken instead of silently sharing it.
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_RewardServiceServicer_to_server(service, server)
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
    p = argparse.ArgumentParser(description="bapo reference reward server (bapo.v1.RewardService)")
    p.add_argument("--listen", default="127.0.0.1:50061",
                   help="HOST:PORT to listen on; port 0 picks a free port (default %(default)s)")
    p.add_argument("--verifier", default="math",
                   help="math, code, or module:factory for your own (default %(default)s)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                   help="items scored at once (default: the number of CPUs, %(default)s)")
    p.add_argument("--rpc-threads", type=int, default=16,
                   help="gRPC handler threads = concurrent calls/streams (default %(default)s)")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (needs --tls-key)")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--max-completion-bytes", type=int, default=1 << 20, metavar="N",
                   help="longest completion (UTF-8 bytes) an item may carry; longer ones are "
                        "INVALID_ARGUMENT (default %(default)s)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds in-flight calls get on SIGTERM/SIGINT (default %(default)s)")
    p.add_argument("--log-level", default="INFO")
    serving.add_arguments(p, "serve callers without client authentication (needed for "
                             "--verifier code without --client-ca or --token-file)")
    code = p.add_argument_group("code verifier")
    code.add_argument("--timeout", type=float, default=5.0,
                      help="wall-clock seconds per program (default %(default)s)")
    code.add_argument("--memory-mb", type=int, default=512,
                      help="memory of a program, all its processes together (default %(default)s)")
    code.add_argument("--max-procs", type=int, default=64,
                      help="processes of a program at once (default %(default)s)")
    code.add_argument("--max-files", type=int, default=1000,
                      help="files and directories a program may keep (default %(default)s)")
    code.add_argument("--max-disk-mb", type=int, default=64,
                      help="disk space a program may use (default %(default)s)")
    code.add_argument("--isolation", choices=["auto", "bwrap", "unshare", "none"], default="auto",
                      help="network isolation; auto tries bwrap, then unshare (default %(default)s)")
    code.add_argument("--allow-network", action="store_true",
                      help="run programs even when no network isolation works")
    code.add_argument("--sandbox-user", default="auto",
                      help="uids programs run as, one per program at once: auto (free uids of "
                           "60000-60999), FIRST-LAST, a uid or a name (dedicated to this server: "
                           "each is cleared of processes after every program), or none (the "
                           "server's own, needs --allow-same-user)")
    code.add_argument("--allow-same-user", action="store_true",
                      help="run programs as the server's own user when it cannot switch users "
                           "(they can then read its key and token file, and kill it)")
    code.add_argument("--sandbox-python", help="interpreter for programs (default: python3 on /usr/bin)")
    args = p.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if min(args.workers, args.rpc_threads, args.max_completion_bytes, args.max_files,
           args.max_disk_mb, args.max_procs, args.memory_mb) < 1:
        p.error("--workers, --rpc-threads, --max-completion-bytes, --max-files, --max-disk-mb, "
                "--max-procs and --memory-mb must be at least 1")
    if args.isolation == "none" and not args.allow_network:
        p.error("--isolation none needs --allow-network")
    # The code verifier runs callers' programs: it needs to know who calls.
    serving.check_arguments(
        p, args, "--verifier code runs the programs callers send, and anyone who reaches the "
                 "port could send them" if args.verifier == "code" else None)
    return args


def make_verifier(args):
    if args.verifier != "code":
        return verifiers.load(args.verifier)
    return verifiers.load(
        "code",
        timeout_s=args.timeout,
        memory_mb=args.memory_mb,
        max_procs=args.max_procs,
        isolation=args.isolation,
        allow_network=args.allow_network,
        python=args.sandbox_python,
        sandbox_user=args.sandbox_user,
        allow_same_user=args.allow_same_user,
        slots=args.workers,
        max_files=args.max_files,
        max_disk_mb=args.max_disk_mb,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    privileges.drop_privileges(args.server_user)  # re-executes as that user
    verifier = None
    try:
        tls = None
        if args.tls_cert:
            with open(args.tls_cert, "rb") as c, open(args.tls_key, "rb") as k:
                tls = (c.read(), k.read())
        client_ca, tokens = serving.authentication(args)
        verifier = make_verifier(args)
        server, service, address = build_server(
            verifier, args.listen, workers=args.workers, rpc_threads=args.rpc_threads, tls=tls,
            client_ca=client_ca, tokens=tokens, max_completion_bytes=args.max_completion_bytes)
    except Exception as e:
        print(f"reward-server: error: {e}", file=sys.stderr)
        if verifier is not None and getattr(verifier, "close", None):
            verifier.close()
        return 2
    if not (client_ca or tokens):
        log.warning("serving without client authentication: anyone who reaches %s may call it",
                    address)

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
    log.info("serving %s (reward range [%g, %g]) over %s, %s, %d workers",
             verifier.name, service.lo, service.hi, "TLS" if tls else "plaintext",
             serving.describe(client_ca, tokens), args.workers)
    print(f"listening on {address}", flush=True)
    server.wait_for_termination()
    service.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
