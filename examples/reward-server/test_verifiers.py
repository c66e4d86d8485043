"""Tests of the reference reward server: `scripts/reward-server.sh test`.

Stdlib unittest. The server tests need the generated stubs (the script sets
BAPO_REWARD_STUBS); the verifier tests need only the standard library. The
last line is `reward-server: N passed, N failed, N skipped`.
"""

from __future__ import annotations

import os
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from verifiers import Item, MalformedItem, Result, Verifier  # noqa: E402
from verifiers.code import CodeVerifier, extract_program, python_block  # noqa: E402
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
    """The code verifier with real isolation, or None (and why)."""
    try:
        return CodeVerifier(timeout_s=TIMEOUT, **kw), None
    except RuntimeError as e:
        return None, str(e)


class CodeVerifierTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.isolated, cls.why = _make_code_verifier()
        # Without isolation the remaining tests still run, network-free.
        cls.v = cls.isolated or CodeVerifier(timeout_s=TIMEOUT, allow_network=True, isolation="none")
        print(f"\n[code verifier: {cls.v.name}{'' if cls.isolated else ' - ' + cls.why}]",
              file=sys.stderr)

    def score(self, completion, answer, **metadata):
        return self.v.score(Item(completion=completion, answer=answer, metadata=metadata))

    def test_extract_program(self):
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

    def test_refuses_without_isolation(self):
        # No bwrap or unshare on PATH: refuse unless the network is allowed.
        empty = tempfile.mkdtemp(prefix="bapo-empty-path-")
        saved = os.environ.get("PATH")
        os.environ["PATH"] = empty
        try:
            with self.assertRaisesRegex(RuntimeError, "--allow-network"):
                CodeVerifier(timeout_s=TIMEOUT)
            with self.assertRaisesRegex(RuntimeError, "unshare: not installed"):
                CodeVerifier(timeout_s=TIMEOUT, isolation="unshare")
            self.assertEqual(CodeVerifier(timeout_s=TIMEOUT, allow_network=True).name, "code-exec[none]")
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
            open_v = CodeVerifier(timeout_s=TIMEOUT, isolation="none", allow_network=True)
            self.assertTrue(open_v.run(program, "").passed)
        finally:
            listener.close()


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
    except SystemExit:
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

    def start(self, verifier, tls=None, rpc_threads=16):
        srv, service, address = self.server_mod.build_server(
            verifier, "127.0.0.1:0", workers=4, tls=tls, rpc_threads=rpc_threads)
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
