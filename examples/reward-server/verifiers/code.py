"""A code-execution verifier: runs the completion's Python against tests.

The program is the last fenced ```python block of the completion (else the
last unlabeled ``` block, else the whole text), found by one linear scan
(``fenced_blocks``: no regular expression that backtracks). The tests are
the item's ``metadata["tests"]`` (Python code, usually asserts), else its
``answer``. Reward 1.0 when program + tests run to the end and exit 0
within the limits, else 0.0. Sub-scores: ``passed`` and ``timeout`` (0/1).

Each run is a fresh process tree, in a fresh working directory, started
and watched by a supervisor process of its own (``sandbox_supervisor.py``,
which says how), under:

* **another identity.** Each program running at once gets a uid (and gid)
  of its own from a pool (``sandbox_user``: by default free uids from
  60000-60999; never the server's, never root), with no supplementary
  groups, no capabilities and ``no_new_privs``. It cannot read the
  server's files (its TLS key, its token file: mode 0600/0440, owned by the
  server or root with the server's group), cannot signal the server or
  other programs, and every process it leaves can be found by its uid.
  Switching users needs root or CAP_SETUID + CAP_SETGID (the Helm chart
  starts the server as root with only those two, and the server drops to
  its own uid keeping them: ``--server-user``). A server without them
  refuses to run programs unless told ``allow_same_user`` (programs then
  run as the server: they can read what it reads and kill it);
* **bounds on the program as a whole**, not per process: its processes
  (RLIMIT_NPROC, which counts per uid: the uid is the program's alone),
  its memory (the resident sets of all its processes, summed by the
  supervisor every 20 ms; the whole program is killed above
  ``memory_mb``; RLIMIT_AS caps each process at ``memory_mb`` in between,
  and ``oom_score_adj`` 1000 makes the kernel's OOM killer take programs
  before the server), its files and bytes on disk (its working directory,
  and its entries in the shared temporary directories, counted every
  100 ms; ``max_files``, ``max_disk_mb``; RLIMIT_FSIZE caps each file),
  CPU seconds (RLIMIT_CPU) and wall-clock time (``timeout_s``). cgroups
  would bound memory exactly, but a Kubernetes pod that is not privileged
  cannot write its cgroup, so the bounds do not rely on one;
* **an end.** When the program's main process exits (or a limit is hit),
  every process of its uid is killed with ``kill(-1, SIGKILL)`` issued as
  that uid (atomic with respect to fork; daemons that called ``setsid`` and
  double-forked included), reaped by the supervisor (a child subreaper),
  and what it wrote is removed;
* **network isolation**, chosen at start by running a probe through it:
  ``bwrap`` (bubblewrap: new network, PID, IPC, UTS namespaces, a
  read-only view of /, the working directory bound at /tmp and /dev/shm)
  or ``unshare --net --pid --fork --kill-child --map-root-user``
  (util-linux: new network and PID namespaces). The probe checks that only
  a loopback interface exists and that the host's loopback is unreachable.
  When neither works the verifier refuses to start unless
  ``allow_network=True`` (isolation "none": then only the network fence
  around the server, e.g. the Helm chart's NetworkPolicy, holds);
* ``python3 -I`` (isolated mode: no PYTHON* variables, no user site) with a
  minimal environment (PATH, HOME/TMPDIR = the working directory, LANG).

A program that exits early (``sys.exit(0)``, ``os._exit(0)``) does not pass:
the harness prints a per-run random token only after the tests have run.
See README.md for what this does NOT protect against.
"""

from __future__ import annotations

import fcntl
import grp
import json
import logging
import math as _math
import os
import pwd
import queue
import re
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

from . import Item, MalformedItem, Result, Verifier

log = logging.getLogger("bapo.reward.code")

SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_supervisor.py")
# The uids `sandbox_user="auto"` takes programs' identities from.
AUTO_UIDS = range(60000, 61000)
# Directories anyone may write to: a program's entries there count against
# its disk limits and are removed after it.
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")

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

_PYTHON_LANGS = ("python", "py", "python3")
# What follows the opening ``` of a block: blanks, then its language.
_INFO = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")


def fenced_blocks(text: str) -> Iterator[Tuple[str, str]]:
    r"""Yields (language, body) of each fenced block, in order.

    A block opens with ``` (the rest of that line is its info string, whose
    leading word is the language) and closes at the next ``` after that
    line; the next block is looked for after the close. These are exactly
    the blocks ``re.findall(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```",
    text, re.S)`` returns, found in one pass: each character is looked at
    a bounded number of times, where that expression takes quadratic time
    on text such as ``"`" * n`` (1 s for 40 KB).
    """
    pos = 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return
        newline = text.find("\n", start + 3)
        if newline < 0:
            return  # no later opening has a line end either
        end = text.find("```", newline + 1)
        if end < 0:
            return  # nor a close
        yield _INFO.match(text, start + 3, newline).group(1), text[newline + 1:end]
        pos = end + 3


def python_block(text: str) -> Optional[str]:
    """The last ```python (or ```py, ```python3) block, or None."""
    last = None
    for lang, body in fenced_blocks(text):
        if lang.lower() in _PYTHON_LANGS:
            last = body
    return last


def extract_program(completion: str) -> str:
    """The last ```python block, else the last unlabeled ``` block, else
    the whole text."""
    python = plain = None
    for lang, body in fenced_blocks(completion):
        if lang.lower() in _PYTHON_LANGS:
            python = body
        elif not lang:
            plain = body
    if python is not None:
        return python
    if plain is not None:
        return plain
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
    # The limit that ended it ("memory", "files", "disk"; "watch" and
    # "server" when the sandbox ended it for its own reasons), or None; and
    # what the supervisor said about it.
    limit: Optional[str] = None
    limit_detail: str = ""


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


def can_switch_user() -> bool:
    """Whether this process may start programs as another user: root, or
    CAP_SETUID and CAP_SETGID in its effective set."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    caps = int(line.split()[1], 16)
                    return caps & (1 << 6) != 0 and caps & (1 << 7) != 0
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def uids_in_use() -> set:
    """Every uid (real, effective, saved, fs) a process on this host has."""
    used = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        used.update(int(x) for x in line.split()[1:5])
                        break
        except (OSError, ValueError):
            continue
    return used


def _exists(lookup, ident: int) -> bool:
    try:
        lookup(ident)
        return True
    except KeyError:
        return False


class SandboxUsers:
    """Who programs run as: a pool of dedicated uids (one per program
    running at once; gid = uid), or the server's own identity.

    A uid is taken only when no process runs as it, it is not the server's
    or root's (with "auto": nor a user's or group's in the system's
    databases), and this server holds its lock (a file in a directory
    private to the server's uid), so that two servers of one user on one
    host do not share a uid. Every process of a taken uid is killed after
    each program: give a server uids that nothing else uses."""

    def __init__(self, spec: str = "auto", slots: int = 1, allow_same_user: bool = False):
        self.same_user = False
        self._locks: List = []
        self._free: "queue.Queue" = queue.Queue()
        spec = str(spec).strip()
        me = os.geteuid()
        same_user_risk = (
            f"programs would run as the server's own user (uid {me}): they could read "
            "what it reads (its TLS key, its token file) and signal it"
        )
        if spec == "none":
            if me == 0:
                raise RuntimeError("--sandbox-user none: the server runs as root, and so would "
                                   "the programs; use --sandbox-user auto")
            if not allow_same_user:
                raise RuntimeError(
                    f"--sandbox-user none: {same_user_risk}. Pass --allow-same-user to accept that.")
            self._same_user(slots)
            return
        switch = can_switch_user()
        if spec == "auto":
            if not switch:
                if not allow_same_user:
                    raise RuntimeError(
                        f"this server cannot start programs as another user (it is not root and "
                        f"lacks CAP_SETUID/CAP_SETGID), so {same_user_risk}. Start it as root "
                        "(with --server-user to drop to your uid while keeping those two "
                        "capabilities), or pass --allow-same-user to accept that.")
                log.warning("code sandbox: %s (--allow-same-user)", same_user_risk)
                self._same_user(slots)
                return
            candidates, strict = AUTO_UIDS, True
        else:
            if "-" in spec:
                first, _, last = spec.partition("-")
                try:
                    candidates = range(int(first), int(last) + 1)
                except ValueError:
                    raise RuntimeError(f"--sandbox-user {spec!r}: expected auto, none, UID, FIRST-LAST or a name") from None
            elif spec.isdigit():
                candidates = range(int(spec), int(spec) + 1)
            else:
                try:
                    uid = pwd.getpwnam(spec).pw_uid
                except KeyError:
                    raise RuntimeError(f"--sandbox-user {spec!r}: no such user") from None
                candidates = range(uid, uid + 1)
            strict = False
            if not switch:
                raise RuntimeError(
                    f"--sandbox-user {spec}: this server cannot switch users (it is not root "
                    "and lacks CAP_SETUID/CAP_SETGID)")
        if 0 in candidates or me in candidates:
            raise RuntimeError(f"--sandbox-user {spec}: the sandbox uids must not include root "
                               f"or the server's own uid {me}")
        self._pool(candidates, strict, slots, spec)

    def _same_user(self, slots: int) -> None:
        self.same_user = True
        for _ in range(max(1, slots)):
            self._free.put(None)

    def _pool(self, candidates, strict: bool, slots: int, spec: str) -> None:
        lock_dir = os.path.join(tempfile.gettempdir(), f"bapo-sandbox-uids-{os.geteuid()}")
        try:
            os.mkdir(lock_dir, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(lock_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise RuntimeError(f"{lock_dir} must be a directory of uid {os.geteuid()}, mode 0700")
        busy = uids_in_use()
        taken = []
        for uid in candidates:
            if len(taken) >= slots:
                break
            if uid in busy or (strict and (_exists(pwd.getpwuid, uid) or _exists(grp.getgrgid, uid))):
                continue
            f = open(os.path.join(lock_dir, f"{uid}.lock"), "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            self._locks.append(f)
            taken.append((uid, uid))
        if not taken:
            raise RuntimeError(
                f"--sandbox-user {spec}: no free uid in {candidates.start}-{candidates.stop - 1} "
                "(each in use by a process, a user or group, or another server)")
        if len(taken) < slots:
            log.warning("code sandbox: %d sandbox uids for %d programs at once: the rest wait",
                        len(taken), slots)
        for user in taken:
            self._free.put(user)
        self.uids = [u for u, _ in taken]

    def describe(self) -> str:
        if self.same_user:
            return f"the server's own uid {os.geteuid()} (--allow-same-user)"
        first, last = self.uids[0], self.uids[-1]
        return f"uid {first}" if first == last else f"uids {first}-{last} ({len(self.uids)})"

    def acquire(self):
        return self._free.get()

    def release(self, user) -> None:
        self._free.put(user)

    def close(self) -> None:
        for f in self._locks:
            f.close()
        self._locks = []


def _release(users: SandboxUsers, root: str) -> None:
    users.close()
    if os.path.isdir(root):
        _rmtree(root)


def _check_tmp() -> None:
    d = tempfile.gettempdir()
    try:
        mode = os.stat(d).st_mode
    except OSError:
        return
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        log.warning("%s is world-writable but not sticky: a program could rename the server's "
                    "directories there (start the server as root with --server-user, which "
                    "makes it sticky)", d)


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
        allow_same_user: bool = False,
        slots: Optional[int] = None,
        max_files: int = 1000,
        max_disk_mb: int = 64,
    ):
        self.timeout_s = float(timeout_s)
        self.memory_bytes = int(memory_mb) << 20
        self.max_procs = int(max_procs)
        self.file_bytes = int(max_file_mb) << 20
        self.max_files = int(max_files)
        self.disk_bytes = int(max_disk_mb) << 20
        self.python = python or shutil.which("python3", path=SAFE_PATH) or sys.executable
        self.users = SandboxUsers(sandbox_user, slots or os.cpu_count() or 2, allow_same_user)
        # Where the runs' directories go: not listable by the programs.
        self.root = tempfile.mkdtemp(prefix="bapo-sandbox-")
        os.chmod(self.root, 0o711)
        # The uids' locks and that directory go with the verifier.
        self._release = weakref.finalize(self, _release, self.users, self.root)
        _check_tmp()
        self.shared = sorted({tempfile.gettempdir(), *SHARED_TMP} - {self.root})
        try:
            self.isolation = self._choose_isolation(isolation, allow_network)
        except BaseException:
            self.close()
            raise
        self.name = f"code-exec[{self.isolation}]"
        log.info(
            "code verifier: isolation=%s (%s), user=%s, python=%s, timeout=%.1fs, "
            "memory=%d MiB, procs=%d, files=%d, disk=%d MiB",
            self.isolation,
            "NO network isolation" if self.isolation == "none" else "network isolated",
            self.users.describe(), self.python, self.timeout_s, self.memory_bytes >> 20,
            self.max_procs, self.max_files, self.disk_bytes >> 20,
        )

    def close(self) -> None:
        self._release()

    # --- set-up -----------------------------------------------------------

    def _isolation_prefix(self, mode: str, workdir: str) -> List[str]:
        if mode == "bwrap":
            # The working directory is also /tmp and /dev/shm (what the
            # program writes there is counted and removed); / read-only.
            return [
                self._tool("bwrap"),
                "--unshare-all", "--die-with-parent", "--new-session",
                "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                "--bind", workdir, "/tmp", "--bind", workdir, "/dev/shm", "--chdir", "/tmp",
                "--",
            ]
        if mode == "unshare":
            return [
                self._tool("unshare"),
                "--net", "--pid", "--fork", "--kill-child", "--map-root-user", "--",
            ]
        return []

    @staticmethod
    def _tool(name: str) -> str:
        found = shutil.which(name, path=os.environ.get("PATH", SAFE_PATH))
        if found is None:
            raise SandboxError(f"{name} is not installed")
        return os.path.abspath(found)

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

    def _rlimits(self) -> dict:
        cpu = int(_math.ceil(self.timeout_s)) + 1
        return {
            "AS": [self.memory_bytes, self.memory_bytes],
            "CPU": [cpu, cpu + 1],
            "NPROC": [self.max_procs, self.max_procs],
            "FSIZE": [self.file_bytes, self.file_bytes],
            "CORE": [0, 0],
            "NOFILE": [256, 256],
        }

    def _supervise(self, config: dict, timeout_s: float) -> dict:
        """Runs the supervisor on `config`; its result."""
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", SUPERVISOR], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
                start_new_session=True, cwd="/", env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"},
            )
        except OSError as e:
            raise SandboxError(f"cannot start the sandbox supervisor: {e}") from e
        try:
            out, err = proc.communicate(json.dumps(config).encode(), timeout=timeout_s + 30.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            if config.get("uid") is not None:
                self._kill_user(config["uid"], config["gid"])
            raise SandboxError("the sandbox supervisor did not finish") from None
        if proc.returncode != 0:
            raise SandboxError(f"the sandbox supervisor failed (exit {proc.returncode}): "
                               + err.decode("utf-8", "replace").strip()[-500:])
        try:
            return json.loads(out)
        except ValueError as e:
            raise SandboxError(f"the sandbox supervisor answered {out[:200]!r}") from e

    def _kill_user(self, uid: int, gid: int) -> None:
        """Emergency: every process of a sandbox uid, killed."""
        try:
            subprocess.run([sys.executable, "-I", "-S", SUPERVISOR],
                           input=json.dumps({"op": "kill", "uid": uid, "gid": gid}).encode(),
                           capture_output=True, timeout=30, cwd="/",
                           env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"})
        except (OSError, subprocess.SubprocessError) as e:
            log.error("cannot kill the processes of sandbox uid %d: %s", uid, e)

    def run(self, program: str, tests: str, mode: Optional[str] = None,
            timeout_s: Optional[float] = None, output_bytes: int = 2048) -> RunOutcome:
        """Runs program + tests once in the sandbox. `output_bytes`: how
        much of the end of stderr (and of the program's stdout) to keep."""
        mode = mode or self.isolation
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        user = self.users.acquire()
        try:
            return self._run(user, program, tests, mode, timeout_s, output_bytes)
        finally:
            self.users.release(user)

    def _run(self, user, program: str, tests: str, mode: str, timeout_s: float,
             output_bytes: int) -> RunOutcome:
        base = tempfile.mkdtemp(prefix="run-", dir=self.root)
        try:
            os.chmod(base, 0o711)
            workdir = os.path.join(base, "work")
            os.mkdir(workdir)
            # The program's own uid writes here (the server removes it).
            os.chmod(workdir, 0o700 if user is None else 0o777)
            for name, text in (("_bapo_harness.py", HARNESS), ("solution.py", program),
                               ("tests.py", tests)):
                path = os.path.join(workdir, name)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
                os.chmod(path, 0o644)
            out_path = os.path.join(base, "stdout")
            err_path = os.path.join(base, "stderr")
            inside = "/tmp" if mode == "bwrap" else workdir
            token = secrets.token_hex(16)
            config = {
                "argv": self._isolation_prefix(mode, workdir) + [self.python, "-I", "_bapo_harness.py"],
                "env": {"PATH": SAFE_PATH, "HOME": inside, "TMPDIR": inside,
                        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
                "cwd": workdir,
                "uid": None if user is None else user[0],
                "gid": None if user is None else user[1],
                "stdin": token + "\n",
                "stdout": out_path,
                "stderr": err_path,
                "timeout_s": timeout_s,
                "rlimits": self._rlimits(),
                "memory_bytes": self.memory_bytes,
                "max_files": self.max_files,
                "max_disk_bytes": self.disk_bytes,
                "watch": [workdir],
                "shared": self.shared,
            }
            result = self._supervise(config, timeout_s)
            if result.get("leftover"):
                log.error("sandbox: %d processes of the program could not be ended",
                          result["leftover"])
            returncode = result["status"]
            timed_out = bool(result["timed_out"])
            limit = result.get("limit")
            head = _head(out_path, len(STARTED))
            stdout_tail = _tail(out_path)
            stderr_tail = _tail(err_path, output_bytes)
            if head != STARTED and not timed_out and limit is None:
                raise SandboxError(
                    f"{mode} sandbox did not start the program (exit {returncode}): "
                    + stderr_tail.decode("utf-8", "replace").strip()[-500:]
                )
            passed = (
                not timed_out
                and limit is None
                and returncode == 0
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
                exit_code=returncode,
                elapsed_s=float(result["elapsed_s"]),
                stdout_tail=stdout_tail.decode("utf-8", "replace"),
                stderr_tail=stderr_tail.decode("utf-8", "replace"),
                stdout=_slice(out_path, max(first, end - output_bytes), end).decode("utf-8", "replace"),
                stdout_bytes=max(0, end - first),
                stderr_bytes=_size(err_path),
                limit=limit,
                limit_detail=result.get("detail") or "",
            )
        finally:
            _rmtree(base)

    def score(self, item: Item) -> Result:
        tests = item.metadata.get("tests") or item.answer
        if not tests.strip():
            raise MalformedItem("no tests: metadata['tests'] and answer are both empty")
        outcome = self.run(extract_program(item.completion), tests)
        return Result(
            reward=1.0 if outcome.passed else 0.0,
            sub_scores={"passed": float(outcome.passed), "timeout": float(outcome.timed_out)},
        )
