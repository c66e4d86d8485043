#!/usr/bin/env python3
"""Play one episode against an OpenEnv server over `/ws`, printing every raw frame.

    scripts/openenv-server.sh client 127.0.0.1:8000 --seed 7 "I think 12" "95"

Sends `reset` (with --seed / --episode-id), one `step` {"message": ...} per
answer (from the arguments, else one per line of stdin) until `done`, then
`state` and `close`. Lines starting `>>` were sent, `<<` received. Only
`websockets` is needed (openenv-core depends on it).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

from websockets.sync.client import connect


def get(base: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{base}{path}", timeout=10) as r:
        return r.read().decode()


class Session:
    """One `/ws` connection = one environment instance on the server."""

    def __init__(self, base: str, out=sys.stdout, timeout: float = 60.0):
        self.out = out
        self.timeout = timeout
        url, opts = f"ws://{base}/ws", dict(open_timeout=10, max_size=100 * 1024 * 1024)
        try:
            self.ws = connect(url, legacy=True, **opts)  # websockets >= 17.1
        except TypeError:
            self.ws = connect(url, **opts)

    def send(self, frame: dict | str) -> None:
        raw = frame if isinstance(frame, str) else json.dumps(frame)
        print(f">> {raw}", file=self.out, flush=True)
        self.ws.send(raw)

    def recv(self) -> dict:
        raw = self.ws.recv(timeout=self.timeout)
        print(f"<< {raw}", file=self.out, flush=True)
        return json.loads(raw)

    def call(self, frame: dict | str) -> dict:
        self.send(frame)
        return self.recv()

    def close(self) -> None:
        """`close` has no reply: the server ends the session and closes the socket."""
        self.send({"type": "close"})
        try:
            while True:  # drain until the server's close frame
                self.ws.recv(timeout=5)
        except Exception:
            pass
        print(f"-- closed by server: code {self.ws.close_code} reason {self.ws.close_reason!r}",
              file=self.out, flush=True)
        self.ws.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("address", help="HOST:PORT of the server")
    p.add_argument("answers", nargs="*", help="messages to send (default: lines of stdin)")
    p.add_argument("--seed", type=int)
    p.add_argument("--episode-id")
    args = p.parse_intermixed_args(argv)

    print(f"GET /health -> {get(args.address, '/health')}")
    s = Session(args.address)
    data = {k: v for k, v in (("seed", args.seed), ("episode_id", args.episode_id)) if v is not None}
    reply = s.call({"type": "reset", "data": data})
    answers = iter(args.answers) if args.answers else (line.rstrip("\n") for line in sys.stdin)
    while reply.get("type") == "observation" and not reply["data"]["done"]:
        message = next(answers, None)
        if message is None:
            break
        reply = s.call({"type": "step", "data": {"message": message}})
    s.call({"type": "state"})
    s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
