"""A code-execution verifier: runs the completion's Python against tests.

The program is the last fenced ```python block of the completion (else the
last unlabeled ``` block, else the whole text). The tests are the item's
``metadata["tests"]`` (Python code, usually asserts), else its ``answer``.
Reward 1.0 when program + tests run to the end and exit 0 within the limits,
else 0.0. Sub-scores: ``passed`` and ``timeout`` (0/1).

Each run is a fresh process tree, in a fresh temporary directory, under:

* ``python3 -I`` (isolated mode: no PYTHON* variables, no user site) with a
  minimal environment (PATH, HOME/TMPDIR = the temporary directory, LANG);
* resource limits set by ``prlimit`` (util-linux): address space, CPU
  seconds, processes, file size, open files, no core dumps;
* a wall-clock timeout, after which the whole process group is SIGKILLed;
* a network isolation, chosen at start by running a probe through it:
  ``bwrap`` (bubblewrap: new network, PID, IPC, UTS namespaces, read-only
  view of /, private /tmp) or ``unshare --net --pid --fork --kill-child
  --map-root-user`` (util-linux: new network and PID namespaces). The probe
  checks that only a loopback interface exists and that the host's loopback
  is unreachable. When neither works the verifier refuses to start unless
  ``allow_network=True`` (isolation "none");
* when the server runs as root, the program runs as ``nobody`` (uid 65534)
  so that the process limit means something and host files are protected by
  ordinary permissions.

A program that exits early (``sys.exit(0)``, ``os._exit(0)``) does not pass:
the harness prints a per-run random token only after the tests have run.
See README.md for what this does NOT protect against.
"""

from __future__ import annotations

import logging
import math as _math
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional

from . import Item, MalformedItem, Result, Verifier

log = logging.getLogger("bapo.reward.code")

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
STARTED = b"bapo-harness-started\n"

# Runs solution.py, then tests.py, in one namespace as __main__, then prints
# the run's token (read from stdin) last. Exiting early skips the token.
HARNESS = r'''
import sys
def _bapo_run():
    token = sys.stdin.readline().strip()
    sys.stdout.write("bapo-harness-started\n")
    sys.stdout.flush()
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    for name in ("solution.py", "tests.py"):
        with open(name, encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, name, "exec"), ns)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout.write("\n" + token + "\n")
    sys.stdout.flush()
_bapo_run()
'''

# The isolation probe: only a loopback interface, and the host's loopback
# (where the verifier listens on PORT) cannot be reached.
PROBE = r'''
import socket
names = [n for _, n in socket.if_nameindex()]
assert names == ["lo"], f"network interfaces visible: {names}"
s = socket.socket()
s.settimeout(2)
try:
    s.connect(("127.0.0.1", PORT))
except OSError:
    pass
else:
    raise SystemExit("the host's loopback is reachable")
with open("probe.txt", "w") as f:
    f.write("written")
'''

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
_PYTHON_LANGS = ("python", "py", "python3")


def python_block(text: str) -> Optional[str]:
    """The last ```python (or ```py, ```python3) block, or None."""
    python = [body for lang, body in _FENCE.findall(text) if lang.lower() in _PYTHON_LANGS]
    return python[-1] if python else None


def extract_program(completion: str) -> str:
    """The last ```python block, else the last unlabeled ``` block, else
    the whole text."""
    python = python_block(completion)
    if python is not None:
        return python
    plain = [body for lang, body in _FENCE.findall(completion) if not lang]
    if plain:
        return plain[-1]
    return completion


@dataclass
class RunOutcome:
    passed: bool
    timed_out: bool
    exit_code: Optional[int]
    elapsed_s: float
    stdout_tail: str
    stderr_tail: str
    # The program's own stdout (the harness's lines removed), its last
    # `output_bytes`, and the full sizes of both streams: for callers that
    # show a program its output (the environment server's python sandbox).
    stdout: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0


class SandboxError(RuntimeError):
    """The sandbox itself failed (the program never started): not a score."""


def _tail(path: str, n: int = 2048) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read()
    except OSError:
        return b""


def _slice(path: str, start: int, end: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))
    except OSError:
        return b""


def _head(path: str, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _rmtree(path: str) -> None:
    def fix(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


class CodeVerifier(Verifier):
    min_reward = 0.0
    max_reward = 1.0

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        max_procs: int = 64,
        max_file_mb: int = 16,
        isolation: str = "auto",
        allow_network: bool = False,
        python: Optional[str] = None,
        sandbox_user: str = "auto",
    ):
        self.timeout_s = float(timeout_s)
        self.memory_bytes = int(memory_mb) << 20
        self.max_procs = int(max_procs)
        self.file_bytes = int(max_file_mb) << 20
        self.python = python or shutil.which("python3", path=SAFE_PATH) or sys.executable
        self.uid, self.gid = self._sandbox_ids(sandbox_user)
        self.prlimit = shutil.which("prlimit", path=SAFE_PATH)
        self.isolation = self._choose_isolation(isolation, allow_network)
        self.name = f"code-exec[{self.isolation}]"
        user = "self" if self.uid is None else f"uid {self.uid}"
        log.info(
            "code verifier: isolation=%s (%s), user=%s, python=%s, timeout=%.1fs, "
            "memory=%d MiB, procs=%d",
            self.isolation,
            "NO network isolation" if self.isolation == "none" else "network isolated",
            user, self.python, self.timeout_s, self.memory_bytes >> 20, self.max_procs,
        )

    # --- set-up -----------------------------------------------------------

    @staticmethod
    def _sandbox_ids(spec: str):
        if spec == "none" or (spec == "auto" and os.geteuid() != 0):
            return None, None
        name = "nobody" if spec == "auto" else spec
        if name.isdigit():
            return int(name), int(name)
        entry = pwd.getpwnam(name)
        return entry.pw_uid, entry.pw_gid

    def _isolation_prefix(self, mode: str, workdir: str) -> List[str]:
        if mode == "bwrap":
            return [
                shutil.which("bwrap", path=os.environ.get("PATH", SAFE_PATH)) or "bwrap",
                "--unshare-all", "--die-with-parent", "--new-session",
                "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                "--tmpfs", "/tmp", "--bind", workdir, workdir, "--chdir", workdir,
                "--",
            ]
        if mode == "unshare":
            return [
                shutil.which("unshare", path=os.environ.get("PATH", SAFE_PATH)) or "unshare",
                "--net", "--pid", "--fork", "--kill-child", "--map-root-user", "--",
            ]
        return []

    def _choose_isolation(self, requested: str, allow_network: bool) -> str:
        candidates = ["bwrap", "unshare"] if requested == "auto" else [requested]
        failures = []
        for mode in candidates:
            if mode == "none":
                break
            if shutil.which(mode, path=os.environ.get("PATH", SAFE_PATH)) is None:
                failures.append(f"{mode}: not installed")
                continue
            problem = self._probe(mode)
            if problem is None:
                return mode
            failures.append(f"{mode}: {problem}")
        if requested not in ("auto", "none") and failures:
            raise RuntimeError(f"isolation {requested} does not work here: {failures[0]}")
        if not allow_network:
            raise RuntimeError(
                "no network isolation works on this machine ("
                + "; ".join(failures)
                + "); refusing to run untrusted code. Pass --allow-network to run it "
                "anyway without network isolation."
            )
        log.warning("code verifier: NO network isolation (%s)", "; ".join(failures) or "requested")
        problem = self._probe("none")
        if problem is not None:
            raise RuntimeError(f"the sandbox cannot run programs: {problem}")
        return "none"

    def _probe(self, mode: str) -> Optional[str]:
        """None when `mode` runs a program with the network cut off, else why not."""
        listener = socket.socket()
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)
            port = listener.getsockname()[1]
            code = PROBE.replace("PORT", str(port)) if mode != "none" else "pass"
            try:
                outcome = self.run(code, "", mode=mode, timeout_s=max(self.timeout_s, 10.0))
            except SandboxError as e:
                return str(e)
            if not outcome.passed:
                detail = (outcome.stderr_tail or outcome.stdout_tail).strip().splitlines()
                why = detail[-1] if detail else f"exit code {outcome.exit_code}"
                return f"probe failed: {why}"
            return None
        finally:
            listener.close()

    # --- running ------------------------------------------------------------

    def _limits(self) -> List[str]:
        cpu = int(_math.ceil(self.timeout_s)) + 1
        return [
            f"--as={self.memory_bytes}",
            f"--cpu={cpu}:{cpu + 1}",
            f"--nproc={self.max_procs}",
            f"--fsize={self.file_bytes}",
            "--core=0",
            "--nofile=256",
        ]

    def _preexec(self):
        # Only used when prlimit is missing: preexec_fn is not safe in a
        # threaded process (the gRPC server), so prlimit is preferred.
        import resource

        cpu = int(_math.ceil(self.timeout_s)) + 1
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_NPROC, (self.max_procs, self.max_procs))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_bytes, self.file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    def run(self, program: str, tests: str, mode: Optional[str] = None,
            timeout_s: Optional[float] = None, output_bytes: int = 2048) -> RunOutcome:
        """Runs program + tests once in the sandbox. `output_bytes`: how
        much of the end of stderr (and of the program's stdout) to keep."""
        mode = mode or self.isolation
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        workdir = tempfile.mkdtemp(prefix="bapo-code-")
        try:
            for name, text in (("_bapo_harness.py", HARNESS), ("solution.py", program),
                               ("tests.py", tests)):
                path = os.path.join(workdir, name)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
                os.chmod(path, 0o644)
            out_path = os.path.join(workdir, "stdout")
            err_path = os.path.join(workdir, "stderr")
            if self.uid is not None:
                os.chown(workdir, self.uid, self.gid)
            cmd = []
            if self.prlimit:
                cmd += [self.prlimit, *self._limits(), "--"]
            cmd += self._isolation_prefix(mode, workdir)
            cmd += [self.python, "-I", "_bapo_harness.py"]
            env = {"PATH": SAFE_PATH, "HOME": workdir, "TMPDIR": workdir,
                   "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
            extra = {}
            if self.uid is not None:
                extra = {"user": self.uid, "group": self.gid, "extra_groups": []}
            token = secrets.token_hex(16)
            start = time.monotonic()
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                try:
                    proc = subprocess.Popen(
                        cmd, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=out,
                        stderr=err, start_new_session=True, close_fds=True,
                        preexec_fn=None if self.prlimit else self._preexec, **extra,
                    )
                except OSError as e:
                    raise SandboxError(f"cannot start {cmd[0]}: {e}") from e
            timed_out = False
            try:
                proc.communicate((token + "\n").encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # The whole group: the program's children too (and, with a
                # PID namespace, everything in it dies with its init).
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
            elapsed = time.monotonic() - start
            head = _head(out_path, len(STARTED))
            stdout_tail = _tail(out_path)
            stderr_tail = _tail(err_path, output_bytes)
            if head != STARTED and not timed_out:
                raise SandboxError(
                    f"{mode} sandbox did not start the program (exit {proc.returncode}): "
                    + stderr_tail.decode("utf-8", "replace").strip()[-500:]
                )
            passed = (
                not timed_out
                and proc.returncode == 0
                and stdout_tail.rstrip(b"\n").endswith(b"\n" + token.encode())
            )
            # The program's stdout lies between the harness's start line and,
            # once the tests ran to the end, its "\n" + token + "\n".
            token_line = b"\n" + token.encode() + b"\n"
            first = len(STARTED) if head == STARTED else 0
            end = _size(out_path) - (len(token_line) if stdout_tail.endswith(token_line) else 0)
            return RunOutcome(
                passed=passed,
                timed_out=timed_out,
                exit_code=proc.returncode,
                elapsed_s=elapsed,
                stdout_tail=stdout_tail.decode("utf-8", "replace"),
                stderr_tail=stderr_tail.decode("utf-8", "replace"),
                stdout=_slice(out_path, max(first, end - output_bytes), end).decode("utf-8", "replace"),
                stdout_bytes=max(0, end - first),
                stderr_bytes=_size(err_path),
            )
        finally:
            _rmtree(workdir)

    def score(self, item: Item) -> Result:
        tests = item.metadata.get("tests") or item.answer
        if not tests.strip():
            raise MalformedItem("no tests: metadata['tests'] and answer are both empty")
        outcome = self.run(extract_program(item.completion), tests)
        return Result(
            reward=1.0 if outcome.passed else 0.0,
            sub_scores={"passed": float(outcome.passed), "timeout": float(outcome.timed_out)},
        )
