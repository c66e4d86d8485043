"""Tests of the reference reward server: `scripts/reward-server.sh test`.

Stdlib unittest. The server tests need the generated stubs (the script sets
BAPO_REWARD_STUBS); the verifier tests need only the standard library. The
last line is `reward-server: N passed, N failed, N skipped`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import logging
import unittest
from fractions import Fraction

# The refused TLS handshakes of the client-authentication tests: not logged.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pki_for_tests  # noqa: E402
from counting_str import CountingStr  # noqa: E402
from verifiers import Item, MalformedItem, Result, Verifier  # noqa: E402
from verifiers.code import CodeVerifier, extract_program, fenced_blocks, python_block  # noqa: E402
from verifiers.math import (  # noqa: E402
    MathVerifier,
    extract_final_number,
    numbers_close,
    reference_value,
)

TIMEOUT = 1.5  # the code tests' wall-clock limit, seconds

# The tests provoke verifier failures on purpose: keep their logs short.
logging.basicConfig(level=logging.CRITICAL)


class MathExtractionTest(unittest.TestCase):
    CASES = [
        ("#### 42", Fraction(42), True),
        ("so she has 5 + 3 = 8 apples.\n#### 8", Fraction(8), True),
        ("The answer is 42.", Fraction(42), True),
        ("ANSWER: 17", Fraction(17), True),
        ("Thus \\boxed{42}.", Fraction(42), True),
        ("first 7, then \\boxed{1,234} and later 9", Fraction(1234), True),
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4), True),
        ("\\boxed{-\\dfrac{1}{2}}", Fraction(-1, 2), True),
        ("The total is 1,234,567 dollars", Fraction(1234567), False),
        ("He owes -$5 now", Fraction(-5), False),
        ("it is \u22127", Fraction(-7), False),
        ("x is 16-3 = 13", Fraction(13), False),
        ("the temperature is -3", Fraction(-3), False),
        ("16-3", Fraction(3), False),  # a subtraction: the last number is 3
        ("pi is about 3.14159", Fraction("3.14159"), False),
        ("it costs $0.50.", Fraction(1, 2), False),
        ("only .5 left", Fraction(1, 2), False),
        ("she ate 3/4 of the pie", Fraction(3, 4), False),
        ("3 / 4", Fraction(3, 4), False),
        ("The answer is 50%.", Fraction(50), True),
        ("1,2345", Fraction(2345), False),  # not a thousands separator
        ("It was 1,234, then", Fraction(1234), False),
        ("answer is 12 and the boxed is \\boxed{13}", Fraction(13), True),
        ("#### 7\nThe answer is 9", Fraction(7), True),  # #### beats "answer is"
        ("no digits here", None, False),
        ("", None, False),
    ]

    def test_extraction(self):
        for text, value, explicit in self.CASES:
            with self.subTest(text=text):
                self.assertEqual(extract_final_number(text), (value, explicit) if value is not None else (None, False))

    def test_reference(self):
        self.assertEqual(reference_value("Natalia sold 48/2 = 24 clips.\n#### 72"), 72)
        self.assertEqual(reference_value(" 1,234.50 "), Fraction("1234.5"))
        self.assertEqual(reference_value("-3/4"), Fraction(-3, 4))
        self.assertEqual(reference_value("+8."), 8)
        self.assertIsNone(reference_value("seven"))
        self.assertIsNone(reference_value("3 apples"))
        self.assertIsNone(reference_value(""))

    def test_tolerance(self):
        self.assertTrue(numbers_close(Fraction(1, 3), Fraction("0.3333333")))
        self.assertTrue(numbers_close(Fraction(0), Fraction(0)))
        self.assertFalse(numbers_close(Fraction(100), Fraction("100.001")))
        self.assertFalse(numbers_close(Fraction(0), Fraction("1e-9")))

    def test_score(self):
        v = MathVerifier()
        r = v.score(Item(completion="so 0.75 of it. The answer is 3/4", answer="0.75"))
        self.assertEqual((r.reward, r.sub_scores), (1.0, {"correct": 1.0, "format": 1.0}))
        r = v.score(Item(completion="I think it is 71", answer="#### 72"))
        self.assertEqual((r.reward, r.sub_scores), (0.0, {"correct": 0.0, "format": 0.0}))
        r = v.score(Item(completion="no idea", answer="72"))
        self.assertEqual(r.reward, 0.0)
        with self.assertRaises(MalformedItem):
            v.score(Item(completion="42", answer="forty-two"))


def _make_code_verifier(**kw):
    """The code verifier with real isolation, or None (and why). Where
    this process cannot switch users (not root, no CAP_SETUID), programs
    run as its own user (allow_same_user)."""
    try:
        return CodeVerifier(timeout_s=TIMEOUT, allow_same_user=_SAME_USER, **kw), None
    except RuntimeError as e:
        return None, str(e)


def _can_switch_users() -> bool:
    from verifiers.code import can_switch_user

    return can_switch_user()


_SAME_USER = not _can_switch_users()

# What the fence expression was before fenced_blocks: the reference for
# its blocks (quadratic: only on short texts here).
OLD_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)


class ExtractionTest(unittest.TestCase):
    def test_same_blocks_as_the_old_expression(self):
        pieces = ["`", "``", "```", "\n", " ", "\t", "python", "py", "Python3", "x", "-", "é",
                  "```python\n", "```py \n", "``` \n", "print(1)\n"]
        rng = random.Random(53)
        for _ in range(20000):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 16)))
            with self.subTest(text=text):
                self.assertEqual(list(fenced_blocks(text)), OLD_FENCE.findall(text))
                blocks = OLD_FENCE.findall(text)
                python = [b for lang, b in blocks if lang.lower() in ("python", "py", "python3")]
                plain = [b for lang, b in blocks if not lang]
                self.assertEqual(python_block(text), python[-1] if python else None)
                self.assertEqual(extract_program(text),
                                 python[-1] if python else plain[-1] if plain else text)

    def test_adversarial_texts_are_scanned_in_linear_time(self):
        # Texts that made the old expression quadratic (40 KB of backticks:
        # 1 s), at 1 MiB: each character is looked at a bounded number of
        # times (counted, not timed).
        n = 1 << 20
        cases = [
            ("`" * n, None),
            ("```a" * (n // 4), None),
            ("```" * (n // 3) + "\n", None),
            ("```python\n" * (n // 10), ""),  # each fence closes the one before
            ("```python\nx = 1\n```" + "`" * n, "x = 1\n"),
            ("```py\n" + "`" * n + "\n```", ""),
        ]
        for text, block in cases:
            with self.subTest(text=text[:24], length=len(text)):
                CountingStr.looked = 0
                self.assertEqual(python_block(CountingStr(text)), block)
                self.assertGreater(CountingStr.looked, 0)  # it did count
                self.assertLessEqual(CountingStr.looked, 2 * len(text) + 16)
        self.assertIsNone(python_block("`" * n))
        self.assertEqual(extract_program("`" * n), "`" * n)


class CodeVerifierTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.isolated, cls.why = _make_code_verifier()
        # Without isolation the remaining tests still run, network-free.
        cls.v = cls.isolated or CodeVerifier(timeout_s=TIMEOUT, allow_network=True, isolation="none",
                                             allow_same_user=_SAME_USER)
        print(f"\n[code verifier: {cls.v.name}{'' if cls.isolated else ' - ' + cls.why}]",
              file=sys.stderr)

    def score(self, completion, answer, **metadata):
        return self.v.score(Item(completion=completion, answer=answer, metadata=metadata))

    def test_extract_program(self):
        self.assertEqual(extract_program("```python3\na\n```\n```\nb\n```"), "a\n")
        self.assertEqual(extract_program("```text\na\n```"), "```text\na\n```")
        text = "Here:\n```python\nx = 1\n```\nbetter:\n```python\nx = 2\n```\nDone."
        self.assertEqual(extract_program(text), "x = 2\n")
        self.assertEqual(extract_program("```\ny = 3\n```"), "y = 3\n")
        self.assertEqual(extract_program("```py\nz = 4\n```\n```\nplain\n```"), "z = 4\n")
        self.assertEqual(extract_program("def f(): pass"), "def f(): pass")
        self.assertEqual(python_block("```py\nz = 4\n```\n```\nplain\n```"), "z = 4\n")
        self.assertIsNone(python_block("```\nplain\n```"))

    def test_program_output(self):
        # The program's own output, without the harness's lines (the
        # environment server shows it to the model).
        out = self.v.run("import sys\nprint('hi')\nprint('oops', file=sys.stderr)", "")
        self.assertTrue(out.passed)
        self.assertEqual((out.stdout, out.stdout_bytes, out.stderr_bytes), ("hi\n", 3, 5))
        out = self.v.run("print('x' * 100, end='')\nraise SystemExit(2)", "", output_bytes=10)
        self.assertEqual((out.stdout, out.stdout_bytes, out.exit_code), ("x" * 10, 100, 2))

    def test_passing_program(self):
        completion = "Sure.\n```python\ndef add(a, b):\n    return a + b\n```\n"
        r = self.score(completion, "", tests="assert add(2, 3) == 5\nassert add(-1, 1) == 0")
        self.assertEqual((r.reward, r.sub_scores), (1.0, {"passed": 1.0, "timeout": 0.0}))

    def test_tests_from_answer(self):
        r = self.score("def sq(x): return x * x", "assert sq(3) == 9")
        self.assertEqual(r.reward, 1.0)

    def test_failing_assert(self):
        r = self.score("def add(a, b):\n    return a - b", "assert add(2, 3) == 5")
        self.assertEqual((r.reward, r.sub_scores), (0.0, {"passed": 0.0, "timeout": 0.0}))

    def test_syntax_error(self):
        self.assertEqual(self.score("def broken(:", "assert True").reward, 0.0)

    def test_early_exit_does_not_pass(self):
        for exit_call in ("import sys; sys.exit(0)", "import os; os._exit(0)"):
            with self.subTest(exit_call=exit_call):
                self.assertEqual(self.score(exit_call, "assert False").reward, 0.0)

    def test_infinite_loop_times_out(self):
        start = time.monotonic()
        r = self.score("while True:\n    pass", "assert True")
        self.assertEqual((r.reward, r.sub_scores["timeout"]), (0.0, 1.0))
        self.assertLess(time.monotonic() - start, TIMEOUT + 3)

    def test_memory_bomb_is_stopped(self):
        start = time.monotonic()
        out = self.v.run("x = bytearray(4 << 30)\nblocks = [bytearray(64 << 20) for _ in range(64)]", "")
        self.assertFalse(out.passed)
        self.assertFalse(out.timed_out)
        self.assertIn("MemoryError", out.stderr_tail)
        self.assertLess(time.monotonic() - start, TIMEOUT)

    def test_fork_bomb_is_limited(self):
        out = self.v.run("import os\nfor _ in range(1000):\n    os.fork()", "")
        self.assertFalse(out.passed)

    def test_background_child_is_killed(self):
        # A daemonized child must not outlive the run: it would create a
        # file in a directory we watch after the run ends.
        watch = tempfile.mkdtemp(prefix="bapo-watch-")
        os.chmod(watch, 0o777)
        try:
            program = (
                "import os, time\n"
                "if os.fork() == 0:\n"
                "    os.setsid()\n"
                "    time.sleep(1.0)\n"
                f"    open({os.path.join(watch, 'alive')!r}, 'w').close()\n"
                "    os._exit(0)\n"
            )
            self.v.run(program, "")
            time.sleep(1.5)
            if self.v.isolation == "none":
                self.skipTest("no PID namespace without isolation: setsid escapes the group")
            self.assertEqual(os.listdir(watch), [])
        finally:
            shutil.rmtree(watch, ignore_errors=True)

    def test_same_user_needs_consent(self):
        if os.geteuid() == 0:
            # Programs would run as root: refused, consent or not.
            for consent in (False, True):
                with self.assertRaisesRegex(RuntimeError, "runs as root"):
                    CodeVerifier(timeout_s=TIMEOUT, sandbox_user="none", allow_same_user=consent,
                                 allow_network=True, isolation="none")
            return
        with self.assertRaisesRegex(RuntimeError, "--allow-same-user"):
            CodeVerifier(timeout_s=TIMEOUT, sandbox_user="none", allow_network=True)
        v = CodeVerifier(timeout_s=TIMEOUT, sandbox_user="none", allow_same_user=True,
                         allow_network=True, isolation="none")
        self.addCleanup(v.close)
        self.assertTrue(v.users.same_user)
        self.assertTrue(v.run("print(1)", "").passed)

    def test_refuses_without_isolation(self):
        # No bwrap or unshare on PATH: refuse unless the network is allowed.
        empty = tempfile.mkdtemp(prefix="bapo-empty-path-")
        saved = os.environ.get("PATH")
        os.environ["PATH"] = empty
        try:
            kw = {"timeout_s": TIMEOUT, "allow_same_user": _SAME_USER}
            with self.assertRaisesRegex(RuntimeError, "--allow-network"):
                CodeVerifier(**kw)
            with self.assertRaisesRegex(RuntimeError, "unshare: not installed"):
                CodeVerifier(isolation="unshare", **kw)
            v = CodeVerifier(allow_network=True, **kw)
            v.close()
            self.assertEqual(v.name, "code-exec[none]")
        finally:
            os.environ["PATH"] = saved
            os.rmdir(empty)

    def test_no_tests_is_malformed(self):
        with self.assertRaises(MalformedItem):
            self.score("x = 1", "")

    def test_network_is_cut_off(self):
        if self.isolated is None:
            self.skipTest(f"no network isolation on this machine: {self.why}")
        # A listener on the host's loopback: reachable from the host, not
        # from a sandbox with its own network namespace. (Loopback only: no
        # traffic leaves this machine even if isolation were broken.)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        program = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
        )
        try:
            out = self.isolated.run(program, "")
            self.assertFalse(out.passed, "the sandbox reached the host's loopback")
            self.assertRegex(out.stderr_tail, r"(ConnectionRefused|OSError|Network is unreachable)")
            # The control: the same program without isolation does connect.
            open_v = CodeVerifier(timeout_s=TIMEOUT, isolation="none", allow_network=True,
                                  allow_same_user=_SAME_USER)
            self.addCleanup(open_v.close)
            self.assertTrue(open_v.run(program, "").passed)
            # No name resolution, no route anywhere: DNS cannot carry data out.
            dns = (
                "import errno, socket\n"
                "try:\n"
                "    socket.getaddrinfo('example.com', 443)\n"
                "except socket.gaierror:\n"
                "    pass\n"
                "else:\n"
                "    raise SystemExit('resolved')\n"
                "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                "try:\n"
                "    s.sendto(b'x', ('8.8.8.8', 53))\n"
                "except OSError as e:\n"
                "    assert e.errno == errno.ENETUNREACH, e\n"
                "else:\n"
                "    raise SystemExit('sent a datagram out')\n"
            )
            out = self.isolated.run(dns, "")
            self.assertTrue(out.passed, out.stderr_tail + out.stdout_tail)
        finally:
            listener.close()


MODES = ("bwrap", "unshare", "none")


def _unique() -> str:
    return f"{random.randrange(10**6, 10**7)}.{random.randrange(10, 99)}"


def _processes_with(marker: str):
    """Pids whose command line holds `marker`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


class SandboxBoundsTest(unittest.TestCase):
    """The program as a whole is bounded and ends with its run: in each
    isolation that works on this machine."""

    @classmethod
    def setUpClass(cls):
        cls.sandboxes, cls.why = {}, {}
        for mode in MODES:
            try:
                cls.sandboxes[mode] = CodeVerifier(
                    timeout_s=20, isolation=mode, allow_network=True, memory_mb=256,
                    max_files=2000, max_disk_mb=8, slots=1, allow_same_user=_SAME_USER)
            except RuntimeError as e:
                cls.why[mode] = str(e)
        print(f"\n[sandbox modes: {sorted(cls.sandboxes)}; not here: {cls.why}]", file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        for v in cls.sandboxes.values():
            v.close()

    def each(self):
        """(mode, verifier) of each isolation that works here."""
        if not self.sandboxes:
            self.skipTest(f"no sandbox works here: {self.why}")
        return list(self.sandboxes.items())

    def test_memory_is_bounded_as_a_whole(self):
        # Six processes of 96 MiB each: each within the per-process cap
        # (256 MiB), together over the program's 256 MiB.
        program = (
            "import os, time\n"
            "kids = []\n"
            "for _ in range(6):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        block = bytearray(96 << 20)\n"
            "        time.sleep(10)\n"
            "        os._exit(0)\n"
            "    kids.append(pid)\n"
            "for pid in kids:\n"
            "    os.waitpid(pid, 0)\n"
            "print('all held')\n"
        )
        for mode, v in self.each():
            with self.subTest(mode=mode):
                out = v.run(program, "")
                self.assertEqual(out.limit, "memory", out)
                self.assertIn("memory limit 256 MiB", out.limit_detail)
                self.assertFalse(out.passed)
                self.assertNotIn("all held", out.stdout)

    def test_many_files_are_stopped(self):
        program = (
            "for i in range(100000):\n"
            "    open(f'f{i}', 'w').close()\n"
            "    if i % 500 == 0:\n"
            "        print(i, flush=True)\n"
        )
        for mode, v in self.each():
            with self.subTest(mode=mode):
                out = v.run(program, "")
                self.assertEqual(out.limit, "files", out)
                self.assertFalse(out.passed)
                last = int(out.stdout.split()[-1])
                self.assertLess(last, 100000)
                self.assertGreaterEqual(last, 1000)  # it did start

    def test_disk_space_is_bounded(self):
        program = (
            "import time\n"
            "for i in range(4):\n"
            "    with open(f'big{i}', 'wb') as f:\n"
            "        f.write(b'x' * (4 << 20))\n"
            "time.sleep(10)\n"
        )
        for mode, v in self.each():
            with self.subTest(mode=mode):
                out = v.run(program, "")
                self.assertEqual(out.limit, "disk", out)
                self.assertIn("disk limit 8 MiB", out.limit_detail)

    def test_what_a_program_leaves_in_shared_directories_is_counted_and_removed(self):
        if _SAME_USER:
            self.skipTest("programs run as this process's user: theirs cannot be told apart")
        marker = _unique()
        program = (
            "import os\n"
            "d = '/tmp/bapo-left-%s'\n"
            "os.makedirs(d)\n"
            "for i in range(20):\n"
            "    open(os.path.join(d, str(i)), 'w').write('x')\n"
            "os.makedirs(os.path.join(d, 'hidden'))\n"
            "os.chmod(os.path.join(d, 'hidden'), 0)\n"
            "if os.path.isdir('/dev/shm'):\n"
            "    open('/dev/shm/bapo-shm-%s', 'wb').write(b'y' * 4096)\n"
            "print('left')\n"
        ) % (marker, marker)
        for mode, v in self.each():
            with self.subTest(mode=mode):
                out = v.run(program, "")
                self.assertTrue(out.passed, out)
                for path in (f"/tmp/bapo-left-{marker}", f"/dev/shm/bapo-shm-{marker}"):
                    self.assertFalse(os.path.exists(path), f"{mode}: {path} outlived the run")
        # Counted while it runs: 3000 files in /tmp are over the limit.
        flood = (
            "import os\n"
            "d = '/tmp/bapo-flood-%s'\n"
            "os.makedirs(d)\n"
            "for i in range(100000):\n"
            "    open(os.path.join(d, str(i)), 'w').close()\n"
        ) % marker
        for mode, v in self.each():
            with self.subTest(mode=mode):
                if mode == "bwrap":
                    continue  # its /tmp is the working directory: counted above
                out = v.run(flood, "")
                self.assertEqual(out.limit, "files", out)
                self.assertFalse(os.path.exists(f"/tmp/bapo-flood-{marker}"))

    def test_processes_that_left_the_session_end_with_the_run(self):
        # A daemon: setsid, then a double fork into `sleep`. When run()
        # returns, nothing of it may be left (no waiting).
        for mode, v in self.each():
            with self.subTest(mode=mode):
                marker = _unique()
                program = (
                    "import os\n"
                    "if os.fork() == 0:\n"
                    "    os.setsid()\n"
                    "    if os.fork() == 0:\n"
                    f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
                    "    os._exit(0)\n"
                    "import time\n"
                    "time.sleep(0.3)\n"
                    "print('parent done')\n"
                )
                out = v.run(program, "")
                self.assertTrue(out.passed, out)
                self.assertEqual(_processes_with(marker), [], f"{mode}: the daemon outlived its run")

    def test_a_fork_bomb_is_bounded_and_ends(self):
        marker = _unique()
        program = (
            "import os, time\n"
            "while True:\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            f"            os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
            "    except OSError:\n"
            "        break\n"
            "print('capped', flush=True)\n"
            "time.sleep(10)\n"
        )
        for mode, v in self.each():
            with self.subTest(mode=mode):
                if v.users.same_user and os.geteuid() == 0:
                    continue  # root ignores RLIMIT_NPROC
                out = v.run(program.replace("time.sleep(10)", "pass"), "")
                self.assertIn("capped", out.stdout, out)
                self.assertEqual(_processes_with(marker), [], f"{mode}: processes outlived the run")


# A server that is not root but holds CAP_SETUID/CAP_SETGID, as the Helm
# chart runs it: started as root, it drops to SERVER_UID with
# privileges.drop_privileges (--server-user), keeping a supplementary group
# (the chart's fsGroup), then runs one program and reports as JSON.
SERVER_UID, FS_GROUP, PLAIN_UID = 59990, 59995, 59991
SERVER_HELPER = r"""
import json, os, sys
sys.path.insert(0, %(here)r)
import privileges
if sys.argv[1]:
    privileges.drop_privileges(sys.argv[1])
from verifiers.code import CodeVerifier
cfg = json.loads(sys.argv[2])
status = {}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "CapAmb", "CapBnd"):
        status[key] = value.split()
reads = []
for path in cfg.get("keys", []):
    try:
        reads.append(open(path).read())
    except OSError as e:
        reads.append(str(e))
try:
    v = CodeVerifier(timeout_s=10, isolation=cfg["mode"], allow_network=True,
                     allow_same_user=cfg.get("allow_same_user", False))
except RuntimeError as e:
    print(json.dumps({"refused": str(e), "status": status}))
    sys.exit(0)
out = v.run(cfg["program"].replace("SERVER_PID", str(os.getpid())), "")
v.close()
print(json.dumps({"status": status, "reads": reads, "passed": out.passed, "stdout": out.stdout,
                  "stderr": out.stderr_tail, "users": v.users.describe()}))
"""


class NonRootServerTest(unittest.TestCase):
    """The sandbox under a non-root server with CAP_SETUID/CAP_SETGID (the
    Helm chart's): its programs cannot read its key, signal it or keep a
    capability. Needs root (to start such a server) and setpriv."""

    @classmethod
    def setUpClass(cls):
        cls.python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
        cls.skip = None
        if os.geteuid() != 0 or shutil.which("setpriv") is None or cls.python is None:
            cls.skip = "needs root, setpriv and a system python3"
            return
        cls.dir = tempfile.mkdtemp(prefix="bapo-nonroot-")
        os.chmod(cls.dir, 0o755)
        cls.helper = os.path.join(cls.dir, "helper.py")
        with open(cls.helper, "w") as f:
            f.write(SERVER_HELPER % {"here": HERE})
        os.chmod(cls.helper, 0o644)
        # Can that user reach this directory and import the sandbox?
        probe = subprocess.run(
            ["setpriv", f"--reuid={PLAIN_UID}", f"--regid={PLAIN_UID}", "--clear-groups", "--",
             cls.python, "-c", f"import sys; sys.path.insert(0, {HERE!r}); import verifiers.code"],
            capture_output=True, text=True)
        if probe.returncode != 0:
            cls.skip = f"uid {PLAIN_UID} cannot import {HERE}: {probe.stderr.strip()[-200:]}"
        # The server's secrets: a key of its own (0600) and one readable
        # through its group (0440, root:group: a Kubernetes Secret volume
        # with fsGroup). Outside /tmp, which bwrap replaces.
        parent = "/var/tmp" if os.path.isdir("/var/tmp") else None
        cls.keys = tempfile.mkdtemp(prefix="bapo-keys-", dir=parent)
        os.chown(cls.keys, SERVER_UID, SERVER_UID)
        os.chmod(cls.keys, 0o711)
        cls.own_key = os.path.join(cls.keys, "tls.key")
        cls.group_key = os.path.join(cls.keys, "token")
        for path, owner, group, mode, text in ((cls.own_key, SERVER_UID, SERVER_UID, 0o600, "OWN-SECRET"),
                                               (cls.group_key, 0, FS_GROUP, 0o440, "GROUP-SECRET")):
            with open(path, "w") as f:
                f.write(text)
            os.chown(path, owner, group)
            os.chmod(path, mode)

    @classmethod
    def tearDownClass(cls):
        for d in ("dir", "keys"):
            if hasattr(cls, d):
                shutil.rmtree(getattr(cls, d), ignore_errors=True)
        # The helper server's lock directory for its sandbox uids.
        shutil.rmtree(os.path.join(tempfile.gettempdir(), f"bapo-sandbox-uids-{SERVER_UID}"),
                      ignore_errors=True)

    def setUp(self):
        if self.skip:
            self.skipTest(self.skip)

    def server(self, program, mode, drop=f"{SERVER_UID}:{SERVER_UID}", prefix=None, **cfg):
        """Runs `program` through a helper server; its report."""
        prefix = prefix or ["setpriv", f"--groups={FS_GROUP}", "--"]  # root, with the group
        cfg = {"mode": mode, "program": program, "keys": [self.own_key, self.group_key], **cfg}
        proc = subprocess.run([*prefix, self.python, self.helper, drop, json.dumps(cfg)],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 0, f"the server died: {proc.returncode}; {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


    def test_the_server_keeps_only_setuid_and_setgid(self):
        report = self.server("print(1)", "none")
        self.assertEqual(report["status"]["Uid"], [str(SERVER_UID)] * 4)
        self.assertEqual(report["status"]["Groups"], [str(FS_GROUP)])
        self.assertEqual(int(report["status"]["CapEff"][0], 16), 0xC0)  # CAP_SETGID, CAP_SETUID
        self.assertEqual(int(report["status"]["CapBnd"][0], 16), 0xC0)
        self.assertEqual(report["reads"], ["OWN-SECRET", "GROUP-SECRET"])  # it reads its own
        self.assertTrue(report["passed"], report)

    def test_programs_cannot_read_the_servers_secrets(self):
        program = (
            f"for path in ({self.own_key!r}, {self.group_key!r}):\n"
            "    try:\n"
            "        print(open(path).read())\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__)\n"
        )
        for mode in MODES:
            with self.subTest(mode=mode):
                report = self.server(program, mode)
                if "refused" in report:
                    continue  # this isolation does not work here
                self.assertNotIn("SECRET", report["stdout"])
                self.assertEqual(report["stdout"].split(), ["PermissionError"] * 2, report)

    def test_programs_cannot_signal_the_server(self):
        program = (
            "import os, signal\n"
            "for target in (SERVER_PID, os.getppid(), -1):\n"
            "    try:\n"
            "        os.kill(target, signal.SIGKILL)\n"
            "    except OSError:\n"
            "        pass\n"
        )
        for mode in MODES:
            with self.subTest(mode=mode):
                report = self.server(program, mode)  # asserts that it lived
                self.assertIn("users", report)

    def test_programs_run_as_another_user_without_capabilities(self):
        program = (
            "import os\n"
            "print(os.getuid(), os.getgid(), os.getgroups())\n"
            "for line in open('/proc/self/status'):\n"
            "    if line.startswith(('CapEff', 'CapPrm', 'CapAmb', 'CapInh')):\n"
            "        print(line.split()[1])\n"
        )
        report = self.server(program, "none")
        ids, *caps = report["stdout"].splitlines()
        uid, gid, groups = ids.split()
        self.assertNotIn(int(uid), (0, SERVER_UID))
        self.assertEqual((gid, groups), (uid, "[]"))
        self.assertEqual([int(c, 16) for c in caps], [0, 0, 0, 0], report)

    def test_a_server_that_cannot_switch_users_refuses(self):
        plain = ["setpriv", f"--reuid={PLAIN_UID}", f"--regid={PLAIN_UID}", "--clear-groups", "--"]
        report = self.server("print(1)", "none", drop="", prefix=plain)
        self.assertIn("--allow-same-user", report.get("refused", ""), report)

    def test_same_user_programs_still_end_with_their_run(self):
        # Told --allow-same-user, a server that cannot switch users runs
        # programs as itself; their daemons still go (its descendants).
        plain = ["setpriv", f"--reuid={PLAIN_UID}", f"--regid={PLAIN_UID}", "--clear-groups", "--"]
        marker = _unique()
        program = (
            "import os\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
            "    os._exit(0)\n"
            "print(os.getuid())\n"
        )
        report = self.server(program, "none", drop="", prefix=plain, allow_same_user=True)
        self.assertEqual(report["stdout"].split(), [str(PLAIN_UID)], report)
        self.assertEqual(_processes_with(marker), [])


ACTOR_TOKEN = "actor-secret-0123456789"
LEARNER_TOKEN = "learner-secret-0123456789"
ADMIN_TOKEN = "admin-secret-0123456789"


def _token_file_text() -> str:
    import hashlib

    digest = hashlib.sha256(LEARNER_TOKEN.encode()).hexdigest()
    return (f"# tokens\nactor {ACTOR_TOKEN}\n\nlearner sha256:{digest}  # digest only\n"
            f"admin {ADMIN_TOKEN}\n")


def _stubs_importable():
    try:
        import serving  # noqa: F401  (grpc)
        return True
    except ImportError:
        return False


@unittest.skipUnless(_stubs_importable(), "no grpc: run via scripts/reward-server.sh test")
class TokenFileTest(unittest.TestCase):
    """bapo's token-file format (proto/src/tls/token.rs), as serving.py reads it."""

    def test_each_token_has_its_role_and_nothing_else_has_one(self):
        from serving import TokenFile

        f = TokenFile.parse(_token_file_text())
        self.assertEqual(f.verify(ACTOR_TOKEN), "actor")
        self.assertEqual(f.verify(LEARNER_TOKEN), "learner")  # by its digest
        self.assertEqual(f.verify(ADMIN_TOKEN), "admin")
        for wrong in (ACTOR_TOKEN[:-1], ACTOR_TOKEN + "x", "", "sha256:" + "0" * 64):
            self.assertIsNone(f.verify(wrong), wrong)
        self.assertNotIn(ACTOR_TOKEN, repr(f))

    def test_bad_lines_are_named_without_their_secret(self):
        from serving import TokenFile, TokenFileError

        for text, why in [
            ("actor short\n", "at least 16"),
            (f"judge {ACTOR_TOKEN}\n", "unknown role 'judge'"),
            ("actor\n", "expected `<role> <secret>`"),
            (f"actor {ACTOR_TOKEN} extra\n", "expected"),
            ("learner sha256:abc\n", "64 hexadecimal"),
            ("learner sha256:" + "g" * 64 + "\n", "64 hexadecimal"),
            (f"actor {ACTOR_TOKEN[:8]}\u00e9{ACTOR_TOKEN[8:]}\n", "visible ASCII"),
            ("# nothing\n\n", "no token"),
        ]:
            with self.subTest(text=text):
                with self.assertRaises(TokenFileError) as ctx:
                    TokenFile.parse("# first line\n" + text, "tokens.txt")
                message = str(ctx.exception)
                self.assertIn(why, message)
                self.assertNotIn(ACTOR_TOKEN[:8], message)
                if why != "no token":
                    self.assertIn("tokens.txt:2", message)

    def test_bearer(self):
        from serving import bearer

        self.assertEqual(bearer(f"Bearer {ACTOR_TOKEN}"), ACTOR_TOKEN)
        self.assertEqual(bearer(f"bearer  {ACTOR_TOKEN} "), ACTOR_TOKEN)
        self.assertIsNone(bearer(f"Basic {ACTOR_TOKEN}"))
        self.assertIsNone(bearer(ACTOR_TOKEN))


class RaisingVerifier(Verifier):
    """For the server tests: fails, misbehaves or echoes on request."""

    name = "test-verifier"
    min_reward = -1.0
    max_reward = 1.0

    def score(self, item):
        if item.completion == "raise":
            raise KeyError("boom")
        if item.completion == "out of range":
            return Result(reward=2.0)
        if item.completion == "nan":
            return Result(reward=float("nan"))
        if item.completion == "bad answer":
            raise MalformedItem("no answer")
        if item.completion_tokens is not None:
            return Result(reward=-0.5, token_rewards=[t / 2 for t in item.completion_tokens])
        return Result(reward=0.25, sub_scores={"n": len(item.completion)})


def _stubs_available():
    try:
        import server  # noqa: F401
        return True
    except (SystemExit, ImportError):  # no stubs, or no grpc at all
        return False


@unittest.skipUnless(_stubs_available(), "no generated stubs: run via scripts/reward-server.sh test")
class ServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import grpc

        import server

        cls.grpc, cls.server_mod = grpc, server
        cls.pb, cls.pb_grpc = server.pb, server.pb_grpc
        cls.servers = []

    @classmethod
    def tearDownClass(cls):
        for srv, service in cls.servers:
            srv.stop(None)
            service.close()

    def start(self, verifier, tls=None, rpc_threads=16, **kw):
        srv, service, address = self.server_mod.build_server(
            verifier, "127.0.0.1:0", workers=4, tls=tls, rpc_threads=rpc_threads, **kw)
        srv.start()
        self.servers.append((srv, service))
        self.assertRegex(address, r"^127\.0\.0\.1:[1-9]\d*$")
        return address

    def stub(self, address):
        channel = self.grpc.insecure_channel(address)
        self.addCleanup(channel.close)
        return self.pb_grpc.RewardServiceStub(channel)

    def item(self, completion, answer="", **kw):
        return self.pb.ScoreItem(problem_id=f"p-{completion}", task="t", completion=completion,
                                 answer=answer, **kw)

    def test_math_round_trip(self):
        stub = self.stub(self.start(MathVerifier()))
        info = stub.Describe(self.pb.DescribeRequest(), timeout=10)
        self.assertEqual((info.name, info.min_reward, info.max_reward), ("math-final-number", 0.0, 1.0))

        items = [self.item("The answer is 72", "72"), self.item("#### 71", "72"), self.item("hmm", "72")]
        resp = stub.Score(self.pb.ScoreRequest(items=items, request_id="r1"), timeout=10)
        self.assertEqual(resp.request_id, "r1")
        self.assertEqual([s.reward for s in resp.scores], [1.0, 0.0, 0.0])
        self.assertEqual(dict(resp.scores[0].sub_scores), {"correct": 1.0, "format": 1.0})
        self.assertEqual(dict(resp.scores[2].sub_scores), {"correct": 0.0, "format": 0.0})

        requests = [
            self.pb.ScoreRequest(items=[self.item(f"#### {n}", str(n if n % 2 else n + 1))],
                                 request_id=f"s{n}")
            for n in range(20)
        ]
        answers = list(stub.ScoreStream(iter(requests), timeout=20))
        self.assertEqual([a.request_id for a in answers], [f"s{n}" for n in range(20)])
        self.assertEqual([a.scores[0].reward for a in answers], [float(n % 2) for n in range(20)])

        empty = stub.Score(self.pb.ScoreRequest(request_id="empty"), timeout=10)
        self.assertEqual((len(empty.scores), empty.request_id), (0, "empty"))

    def test_errors_name_the_item(self):
        stub = self.stub(self.start(MathVerifier()))
        code = self.grpc.StatusCode
        cases = [
            # token bytes not a multiple of 4
            ([self.item("#### 1", "1"), self.item("#### 1", "1", completion_tokens=b"\x01\x00\x00")],
             code.INVALID_ARGUMENT, "item 1"),
            # a reference answer that is not a number
            ([self.item("#### 1", "1"), self.item("#### 1", "1"), self.item("#### 1", "one")],
             code.INVALID_ARGUMENT, "item 2"),
        ]
        for items, status, where in cases:
            with self.subTest(where=where):
                with self.assertRaises(self.grpc.RpcError) as ctx:
                    stub.Score(self.pb.ScoreRequest(items=items), timeout=10)
                self.assertEqual(ctx.exception.code(), status)
                self.assertIn(where, ctx.exception.details())

    def test_verifier_failures_are_internal(self):
        stub = self.stub(self.start(RaisingVerifier()))
        code = self.grpc.StatusCode
        for completion, status, text in [
            ("raise", code.INTERNAL, "KeyError"),
            ("out of range", code.INTERNAL, "outside [-1.0, 1.0]"),
            ("nan", code.INTERNAL, "reward nan"),
            ("bad answer", code.INVALID_ARGUMENT, "no answer"),
        ]:
            with self.subTest(completion=completion):
                items = [self.item("fine"), self.item(completion)]
                with self.assertRaises(self.grpc.RpcError) as ctx:
                    stub.Score(self.pb.ScoreRequest(items=items), timeout=10)
                self.assertEqual(ctx.exception.code(), status)
                self.assertIn("item 1", ctx.exception.details())
                self.assertIn(text, ctx.exception.details())

    def test_tokens_and_token_rewards(self):
        stub = self.stub(self.start(RaisingVerifier()))
        tokens = struct.pack("<3I", 2, 4, 70000)
        resp = stub.Score(self.pb.ScoreRequest(items=[self.item("x", completion_tokens=tokens),
                                                      self.item("plain")]), timeout=10)
        self.assertEqual(resp.scores[0].reward, -0.5)
        self.assertEqual(struct.unpack("<3f", resp.scores[0].token_rewards), (1.0, 2.0, 35000.0))
        self.assertEqual((resp.scores[1].reward, resp.scores[1].token_rewards), (0.25, b""))
        self.assertEqual(dict(resp.scores[1].sub_scores), {"n": 5.0})

    def test_stream_error_after_answers(self):
        stub = self.stub(self.start(RaisingVerifier()))
        requests = [
            self.pb.ScoreRequest(items=[self.item("ok")], request_id="a"),
            self.pb.ScoreRequest(items=[self.item("ok"), self.item("raise")], request_id="b"),
            self.pb.ScoreRequest(items=[self.item("ok")], request_id="c"),
        ]
        got = []
        with self.assertRaises(self.grpc.RpcError) as ctx:
            for answer in stub.ScoreStream(iter(requests), timeout=10):
                got.append(answer.request_id)
        self.assertEqual(got, ["a"])
        self.assertEqual(ctx.exception.code(), self.grpc.StatusCode.INTERNAL)
        self.assertIn("request 'b'", ctx.exception.details())
        self.assertIn("item 1", ctx.exception.details())

    def test_abandoned_streams_free_their_threads(self):
        # Two handler threads; streams cancelled or past their deadline
        # must give theirs back, or the third call would hang.
        stub = self.stub(self.start(RaisingVerifier(), rpc_threads=2))

        def endless():
            for n in range(100000):
                yield self.pb.ScoreRequest(items=[self.item("x")] * 2, request_id=str(n))

        for _ in range(4):
            call = stub.ScoreStream(endless())
            self.assertEqual(next(call).request_id, "0")
            call.cancel()
            with self.assertRaises(self.grpc.RpcError):
                for _ in stub.ScoreStream(endless(), timeout=0.2):
                    pass
        resp = stub.Score(self.pb.ScoreRequest(items=[self.item("y")]), timeout=5)
        self.assertEqual(resp.scores[0].reward, 0.25)

    def test_long_completions_are_refused_by_name(self):
        stub = self.stub(self.start(MathVerifier(), max_completion_bytes=1000))
        fits = self.item("#### 7".rjust(1000), "7")
        resp = stub.Score(self.pb.ScoreRequest(items=[fits]), timeout=10)
        self.assertEqual(resp.scores[0].reward, 1.0)
        for completion in ("#### 7".rjust(1001), "\u00e9" * 501, "`" * (1 << 20)):
            with self.subTest(length=len(completion)):
                with self.assertRaises(self.grpc.RpcError) as ctx:
                    stub.Score(self.pb.ScoreRequest(items=[fits, self.item(completion, "7")]), timeout=10)
                self.assertEqual(ctx.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn("item 1", ctx.exception.details())
                self.assertIn("over this server's limit of 1000 bytes (--max-completion-bytes)",
                              ctx.exception.details())

    def test_adversarial_completion_is_scored(self):
        # 1 MiB of backticks froze the old extraction for minutes; now it
        # is a program like any other (a syntax error: reward 0).
        verifier, _ = _make_code_verifier()
        if verifier is None:
            verifier = CodeVerifier(timeout_s=TIMEOUT, isolation="none", allow_network=True,
                                    allow_same_user=_SAME_USER)
        stub = self.stub(self.start(verifier))
        item = self.pb.ScoreItem(problem_id="ticks", completion="`" * ((1 << 20) - 16),
                                 answer="assert True")
        resp = stub.Score(self.pb.ScoreRequest(items=[item]), timeout=60)
        self.assertEqual(resp.scores[0].reward, 0.0)

    def test_token_authentication(self):
        if not pki_for_tests.available():
            self.skipTest("no openssl to make test certificates")
        import serving

        pki = self.pki()
        cert, key = pki.leaf("ca", "server", server=True)
        tokens = serving.TokenFile.parse(_token_file_text())
        address = self.start(MathVerifier(), tls=(cert, key), tokens=tokens)
        creds = self.grpc.ssl_channel_credentials(pki.ca_pem)
        channel = self.grpc.secure_channel(address, creds)
        self.addCleanup(channel.close)
        stub = self.pb_grpc.RewardServiceStub(channel)
        request = self.pb.ScoreRequest(items=[self.item("#### 3", "3")])
        code = self.grpc.StatusCode
        for metadata, want, text in [
            ((), code.UNAUTHENTICATED, "no bearer token"),
            ((("authorization", "Bearer wrong-secret-0123456789"),), code.UNAUTHENTICATED, "matches no token"),
            ((("authorization", f"Basic {ACTOR_TOKEN}"),), code.UNAUTHENTICATED, "no bearer token"),
            ((("authorization", f"Bearer {LEARNER_TOKEN}"),), code.PERMISSION_DENIED, "role learner"),
        ]:
            with self.subTest(metadata=metadata):
                with self.assertRaises(self.grpc.RpcError) as ctx:
                    stub.Score(request, metadata=metadata, timeout=10)
                self.assertEqual(ctx.exception.code(), want)
                self.assertIn(text, ctx.exception.details())
                self.assertNotIn("secret-0123456789", ctx.exception.details())
        resp = stub.Score(request, metadata=(("authorization", f"Bearer {ACTOR_TOKEN}"),), timeout=10)
        self.assertEqual(resp.scores[0].reward, 1.0)

    def test_client_certificates(self):
        if not pki_for_tests.available():
            self.skipTest("no openssl to make test certificates")
        pki = self.pki()
        cert, key = pki.leaf("ca", "server", server=True)
        address = self.start(MathVerifier(), tls=(cert, key), client_ca=pki.ca_pem)
        request = self.pb.DescribeRequest()
        pki.ca("other")
        for name, issuer, spiffe, ok in [
            ("actor", "ca", "spiffe://bapo.test/actor/a-0", True),
            ("plain", "ca", None, True),
            ("learner", "ca", "spiffe://bapo.test/learner", False),
            ("stranger", "other", "spiffe://bapo.test/actor/x", False),
            ("none", None, None, False),
        ]:
            with self.subTest(client=name):
                client = pki.leaf(issuer, name, spiffe=spiffe) if issuer else (None, None)
                creds = self.grpc.ssl_channel_credentials(pki.ca_pem, private_key=client[1],
                                                          certificate_chain=client[0])
                channel = self.grpc.secure_channel(address, creds)
                self.addCleanup(channel.close)
                stub = self.pb_grpc.RewardServiceStub(channel)
                if ok:
                    self.assertEqual(stub.Describe(request, timeout=10).name, "math-final-number")
                else:
                    with self.assertRaises(self.grpc.RpcError) as ctx:
                        stub.Describe(request, timeout=10)
                    self.assertIn(ctx.exception.code(), (self.grpc.StatusCode.UNAVAILABLE,
                                                         self.grpc.StatusCode.PERMISSION_DENIED))

    def test_code_verifier_needs_client_authentication(self):
        for args, refused in [
            (["--verifier", "code"], "refusing to serve without client authentication"),
            (["--verifier", "math", "--token-file", "t"], "--token-file needs --tls-cert"),
            (["--verifier", "math", "--client-ca", "c"], "--client-ca needs --tls-cert"),
        ]:
            with self.subTest(args=args):
                proc = subprocess.run([sys.executable, os.path.join(HERE, "server.py"), *args],
                                      capture_output=True, text=True, timeout=30)
                self.assertEqual(proc.returncode, 2, proc.stderr)
                self.assertIn(refused, proc.stderr)
                if "refusing" in refused:
                    for flag in ("--client-ca", "--token-file", "--allow-unauthenticated"):
                        self.assertIn(flag, proc.stderr)

    def pki(self):
        d = tempfile.mkdtemp(prefix="bapo-pki-")
        self.addCleanup(shutil.rmtree, d, True)
        pki = pki_for_tests.Pki(d)
        pki.ca_pem = pki.ca("ca")
        return pki

    def test_code_round_trip(self):
        verifier, why = _make_code_verifier()
        if verifier is None:
            verifier = CodeVerifier(timeout_s=TIMEOUT, isolation="none", allow_network=True)
        stub = self.stub(self.start(verifier))
        info = stub.Describe(self.pb.DescribeRequest(), timeout=10)
        self.assertTrue(info.name.startswith("code-exec["), info.name)
        items = [
            self.item("```python\ndef f(x):\n    return 2 * x\n```", "assert f(2) == 4"),
            self.item("def f(x):\n    return x", "assert f(2) == 4"),
            self.pb.ScoreItem(completion="def f(x): return x", metadata={"tests": "assert f(3) == 3"}),
        ]
        resp = stub.Score(self.pb.ScoreRequest(items=items), timeout=30)
        self.assertEqual([s.reward for s in resp.scores], [1.0, 0.0, 1.0])

    def test_tls(self):
        if shutil.which("openssl") is None:
            self.skipTest("no openssl to make a test certificate")
        d = tempfile.mkdtemp(prefix="bapo-tls-")
        self.addCleanup(shutil.rmtree, d, True)
        cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", key, "-out", cert,
             "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
            check=True, capture_output=True)
        with open(cert, "rb") as c, open(key, "rb") as k:
            pem_cert, pem_key = c.read(), k.read()
        address = self.start(MathVerifier(), tls=(pem_cert, pem_key))
        channel = self.grpc.secure_channel(address, self.grpc.ssl_channel_credentials(pem_cert))
        self.addCleanup(channel.close)
        info = self.pb_grpc.RewardServiceStub(channel).Describe(self.pb.DescribeRequest(), timeout=10)
        self.assertEqual(info.name, "math-final-number")

    def test_process_prints_address_and_stops_on_sigterm(self):
        proc = subprocess.Popen(
            [sys.executable, "-u", os.path.join(HERE, "server.py"), "--listen", "127.0.0.1:0",
             "--verifier", "math", "--grace", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            m = re.fullmatch(r"listening on 127\.0\.0\.1:(\d+)\n", line)
            self.assertIsNotNone(m, f"first stdout line: {line!r}; stderr: {proc.stderr.read()[:2000] if proc.poll() is not None else ''}")
            stub = self.stub(f"127.0.0.1:{m.group(1)}")
            resp = stub.Score(self.pb.ScoreRequest(items=[self.item("#### 3", "3")], request_id="x"),
                              timeout=10)
            self.assertEqual(resp.scores[0].reward, 1.0)
            proc.send_signal(signal.SIGTERM)
            self.assertEqual(proc.wait(timeout=15), 0)
            self.assertEqual(proc.stdout.read(), "", "only one line goes to stdout")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()

    def test_bad_listen_address_exits_2(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            port = taken.getsockname()[1]
            proc = subprocess.run(
                [sys.executable, os.path.join(HERE, "server.py"), "--listen", f"127.0.0.1:{port}"],
                capture_output=True, text=True, timeout=30)
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertEqual(proc.stdout, "")
        self.assertIn("cannot listen", proc.stderr)


if __name__ == "__main__":
    program = unittest.main(exit=False, verbosity=2)
    r = program.result
    failed = len(r.failures) + len(r.errors) + len(r.unexpectedSuccesses)
    skipped = len(r.skipped)
    passed = r.testsRun - failed - skipped - len(r.expectedFailures)
    print(f"reward-server: {passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(0 if r.wasSuccessful() else 1)
