"""Tests of the reference environment server: `scripts/env-server.sh test`.

Stdlib unittest. The server tests need the generated stubs (the script sets
BAPO_ENV_STUBS); the environment and episode tests need only the standard
library. The last line is `env-server: N passed, N failed, N skipped`.
"""

from __future__ import annotations

import hashlib
import logging
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
import unittest

# The refused TLS handshakes of the client-authentication tests: not logged.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REWARD_SERVER = os.path.join(os.path.dirname(HERE), "reward-server")
sys.path.append(REWARD_SERVER)

from envs import BadRequest, Environment, Message, Problem, StepResult, Turn  # noqa: E402
from envs.answer import final_integer, reference_integer  # noqa: E402
from envs.calculator import Calculator, draw, first_call  # noqa: E402
from envs.expr import ExprError, evaluate  # noqa: E402
from episodes import EpisodeError, Episodes  # noqa: E402

import pki_for_tests  # noqa: E402  (../reward-server)
from counting_str import CountingStr  # noqa: E402
from verifiers.code import can_switch_user  # noqa: E402

# Programs run as this process's own user where it cannot switch users.
SAME_USER = not can_switch_user()

TIMEOUT = 1.5  # the python environment's per-program limit, seconds

# The tests provoke environment failures on purpose: keep their logs short.
logging.basicConfig(level=logging.CRITICAL)


class ExprTest(unittest.TestCase):
    def test_values(self):
        for text, value in [
            ("37 * 48 + 19", 1795), ("2+3*4", 14), ("(2 + 3) * 4", 20), ("10 - 2 - 3", 5),
            ("8 / 4 / 2", 1), ("-3 - -4", 1), ("-(2+3)", -5), ("+7", 7), (" \n 42\t", 42),
            ("100/4*3", 75), ("-12 / 4", -3), ("007", 7), ("1000000000 * 1000000000", 10**18),
        ]:
            with self.subTest(text=text):
                self.assertEqual(evaluate(text), value)

    def test_errors(self):
        for text, message in [
            ("", "empty expression"),
            ("1 / 0", "division by zero"),
            ("7 / 2", "7 / 2 is not a whole number"),
            ("2 ** 3", "unexpected '*'"),
            ("__import__('os')", "unexpected character '_'"),
            ("3.5", "unexpected character '.'"),
            ("(1 + 2", "unexpected end of expression"),
            ("1 + 2)", "unexpected ')'"),
            ("1 2", "unexpected '2'"),
            ("(1 2)", "expected ')'"),
            ("1000000000000000001", "number too large"),
            ("1000000000 * 1000000000 + 1", "number too large"),
            ("1" * 257, "expression longer than 256 characters"),
            ("\u0663", "unexpected character '\u0663'"),  # a non-ASCII digit
        ]:
            with self.subTest(text=text):
                with self.assertRaises(ExprError) as ctx:
                    evaluate(text)
                self.assertEqual(str(ctx.exception), message)

    def test_deep_nesting_is_bounded(self):
        self.assertEqual(evaluate("(" * 127 + "1" + ")" * 127), 1)
        self.assertEqual(evaluate("-" * 255 + "1"), -1)


class ToolCallTest(unittest.TestCase):
    OLD_CALL = re.compile(r"<call>(.*?)</call>", re.S)  # quadratic: short texts only

    def test_the_first_call_as_the_old_expression_found_it(self):
        pieces = ["<call>", "</call>", "<", ">", "/", "call", "<cal", "l>", "1+2", "\n", " "]
        rng = random.Random(53)
        for _ in range(20000):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
            m = self.OLD_CALL.search(text)
            self.assertEqual(first_call(text), m.group(1) if m else None, text)

    def test_unclosed_calls_are_scanned_in_linear_time(self):
        # 64 KB of "<call>" took the old expression 3.6 s; at 1 MiB each
        # character is looked at a bounded number of times (counted).
        n = 1 << 20
        for text, call in [("<call>" * (n // 6), None), ("<call>" * (n // 6) + "</call>", "<call>" * (n // 6 - 1)),
                           ("x" * n + "<call>1+1</call>", "1+1")]:
            with self.subTest(length=len(text)):
                CountingStr.looked = 0
                self.assertEqual(first_call(CountingStr(text)), call)
                self.assertGreater(CountingStr.looked, 0)
                self.assertLessEqual(CountingStr.looked, len(text) + 16)


class AnswerTest(unittest.TestCase):
    def test_final_integer(self):
        for text, value in [
            ("#### 42", 42), ("so 37 * 48 + 19 = 1795.\n#### 1795", 1795),
            ("#### 1,795", 1795), ("It is 1,795", 1795), ("1,2345", 2345), ("1,23", 23),
            ("x = -3", -3), ("16-3", 3), ("#### 42 apples, 3 left", 42), ("####-5", -5),
            ("#### 7\nmore text 9", 7), ("5 and then ####", 5), ("12 #### none", 12),
            ("no number", None), ("", None), ("3.5", 5),
        ]:
            with self.subTest(text=text):
                self.assertEqual(final_integer(text), value)

    def test_reference_integer(self):
        for text, value in [
            ("72", 72), (" -8 ", -8), ("1,234", 1234), ("48/2 = 24 clips.\n#### 72", 72),
            ("3.5", None), ("seven", None), ("72.", None), ("", None), ("1,23", None),
        ]:
            with self.subTest(text=text):
                self.assertEqual(reference_integer(text), value)


def turn(message, number=0, truncated=False):
    return Turn(message=message, number=number, truncated=truncated)


class CalculatorTest(unittest.TestCase):
    def setUp(self):
        self.env = Calculator()

    def test_draw_is_pinned(self):
        # The Rust twin must draw the same problems: pinned values.
        self.assertEqual(draw(0)[0].splitlines()[0], "What is 55 * 80 - 38?")
        self.assertEqual(draw(0)[1], 4362)
        self.assertEqual(draw(42)[0].splitlines()[0], "What is 78 * 43 + 16?")
        self.assertEqual(draw(2**64 - 1)[1], 37 * 35 - 92)
        answers = {draw(seed)[1] for seed in range(200)}
        self.assertGreater(len(answers), 150)
        self.assertTrue(all(1 <= a <= 9900 for a in answers))

    def test_reset(self):
        answer, messages = self.env.reset(Problem(seed=0))
        self.assertEqual(answer, 4362)
        self.assertEqual([m.role for m in messages], ["user"])
        self.assertTrue(messages[0].content.startswith("What is 55 * 80 - 38?\n"))
        self.assertIn("<call>EXPRESSION</call>", messages[0].content)
        answer, messages = self.env.reset(Problem(prompt="What is 6 * 7?", answer="#### 42"))
        self.assertEqual((answer, messages), (42, [Message("user", "What is 6 * 7?")]))
        # A given answer wins over the drawn one.
        self.assertEqual(self.env.reset(Problem(seed=0, answer="5"))[0], 5)
        with self.assertRaisesRegex(BadRequest, "without an answer"):
            self.env.reset(Problem(prompt="What is 6 * 7?"))
        with self.assertRaisesRegex(BadRequest, "not an integer"):
            self.env.reset(Problem(prompt="q", answer="forty-two"))

    def test_tool_call(self):
        r = self.env.step(1795, turn("Let me compute. <call> 37 * 48 + 19 </call>"))
        self.assertEqual(r, StepResult(messages=[Message("tool", "<result>1795</result>")],
                                       reward=0.0, done=False, info={"tool_call": "1"}))
        r = self.env.step(1795, turn("<call>1/0</call> and <call>2+2</call>"))
        self.assertEqual(r.messages, [Message("tool", "<result>error: division by zero</result>")])
        r = self.env.step(1795, turn("<call>\n(2 +\n 3)\n</call>"))
        self.assertEqual(r.messages[0].content, "<result>5</result>")

    def test_final_answer(self):
        for message, truncated, reward in [
            ("The result was 1795.\n#### 1795", False, 1.0),
            ("#### 1,795", False, 1.0),
            ("I think 1794", False, 0.0),
            ("no idea", False, 0.0),
            ("<call>37 * 48 + 19", False, 0.0),  # an unclosed call is no call
            ("#### 1795", True, 0.0),  # cut off by the token cap
        ]:
            with self.subTest(message=message, truncated=truncated):
                r = self.env.step(1795, turn(message, truncated=truncated))
                self.assertEqual((r.reward, r.done, r.messages), (reward, True, []))
                self.assertEqual(r.info, {"correct": "1" if reward else "0"})


def _python_env(**kw):
    """The python environment with real isolation, else without (and why)."""
    from envs.python_sandbox import PythonSandbox

    kw = {"timeout_s": TIMEOUT, "allow_same_user": SAME_USER, **kw}
    try:
        return PythonSandbox(**kw), None
    except RuntimeError as e:
        return PythonSandbox(isolation="none", allow_network=True, **kw), str(e)


class PythonSandboxTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.env, why = _python_env(max_output=100)
        print(f"\n[python environment: {cls.env.name}{' - ' + why if why else ''}]", file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.env.close()

    def run_code(self, code):
        r = self.env.step(None, turn(f"Let me check.\n```python\n{code}\n```\n"))
        self.assertEqual((r.reward, r.done, len(r.messages), r.messages[0].role), (0.0, False, 1, "tool"))
        return r

    def test_stdout(self):
        r = self.run_code("print(6 * 7)\nprint('done')")
        self.assertEqual(r.messages[0].content, "42\ndone")
        self.assertEqual(r.info, {"tool_call": "1", "exit_code": "0", "timeout": "0"})

    def test_stderr_and_exit_status(self):
        content = self.run_code("print('before')\n1 / 0").messages[0].content
        self.assertTrue(content.startswith("before\n[stderr]\n"), content)
        self.assertIn("ZeroDivisionError", content)
        self.assertTrue(content.endswith("\n[exit status 1]"), content)
        self.assertEqual(self.run_code("import sys; sys.exit(3)").messages[0].content, "[exit status 3]")

    def test_no_output(self):
        self.assertEqual(self.run_code("x = 1").messages[0].content, "[no output]")

    def test_output_is_cut_to_its_end(self):
        content = self.run_code("print('a' * 5000 + 'END')").messages[0].content
        self.assertEqual(content, "[... 4904 bytes cut]\n" + "a" * 96 + "END")

    def test_timeout(self):
        start = time.monotonic()
        r = self.run_code("print('spinning', flush=True)\nwhile True:\n    pass")
        self.assertEqual(r.messages[0].content, f"spinning\n[timed out after {TIMEOUT:g} s]")
        self.assertEqual(r.info["timeout"], "1")
        self.assertLess(time.monotonic() - start, TIMEOUT + 3)

    def test_final_answer(self):
        answer, messages = self.env.reset(Problem(prompt="Sum 1..100?", answer="5050"))
        self.assertEqual((answer, messages), (5050, [Message("user", "Sum 1..100?")]))
        r = self.env.step(answer, turn("It is 5050.", 1))
        self.assertEqual((r.reward, r.done, r.info), (1.0, True, {"correct": "1"}))
        # An unlabeled block is not a program: it is the final answer.
        r = self.env.step(answer, turn("```\nprint(5050)\n```", 1))
        self.assertEqual((r.reward, r.done), (1.0, True))
        answer, _ = self.env.reset(Problem(prompt="Say something."))
        r = self.env.step(answer, turn("#### 1"))
        self.assertEqual((r.reward, r.done, r.info), (0.0, True, {"correct": "0", "no_answer": "1"}))
        with self.assertRaisesRegex(BadRequest, "needs a prompt"):
            self.env.reset(Problem(seed=3))

    def test_adversarial_fences_are_a_final_answer(self):
        # 64 KiB of backticks (the old extraction: seconds under the GIL)
        # hold no block: the turn is a final answer.
        r = self.env.step(42, turn("`" * (64 << 10) + " 42"))
        self.assertEqual((r.reward, r.done, r.info), (1.0, True, {"correct": "1"}))

    def test_a_limit_that_stops_a_program_is_named(self):
        env, _ = _python_env(memory_mb=128, max_output=200)
        self.addCleanup(env.close)
        program = ("import os, time\n"
                   "for _ in range(4):\n"
                   "    if os.fork() == 0:\n"
                   "        b = bytearray(64 << 20)\n"
                   "        time.sleep(5)\n"
                   "        os._exit(0)\n"
                   "time.sleep(5)")
        r = env.step(None, turn(f"```python\n{program}\n```"))
        self.assertEqual(r.info["limit"], "memory", r)
        self.assertIn("[stopped: memory limit 128 MiB exceeded", r.messages[0].content)


class Scripted(Environment):
    """For the episode tests: counts its calls; turns say what to do."""

    name = "scripted"
    max_turns = 0
    min_reward = -1.0
    max_reward = 1.0

    def __init__(self):
        self.calls = 0
        self.lock = threading.Lock()

    def reset(self, problem):
        if problem.prompt == "bad":
            raise BadRequest("bad prompt")
        return {"turns": []}, [Message("user", problem.prompt or "hi")]

    def step(self, state, turn):
        with self.lock:
            self.calls += 1
        state["turns"].append(turn.number)
        if turn.message == "slow":
            time.sleep(0.3)
        if turn.message == "raise":
            raise KeyError("boom")
        if turn.message == "too much":
            return StepResult(reward=2.0)
        if turn.message == "end":
            return StepResult(messages=[Message("user", "dropped")], reward=1.0, done=True)
        return StepResult(messages=[Message("user", f"seen {turn.message}")], reward=-0.5,
                          info={"n": len(state["turns"])})


class EpisodesTest(unittest.TestCase):
    def setUp(self):
        self.now = 0.0
        self.env = Scripted()
        self.episodes = Episodes(self.env, capacity=3, ttl_s=60.0, clock=lambda: self.now)

    def assertRefused(self, code, fn, *args):
        with self.assertRaises(EpisodeError) as ctx:
            fn(*args)
        self.assertEqual(ctx.exception.code, code, str(ctx.exception))
        return str(ctx.exception)

    def test_retry_gets_the_same_answer(self):
        eid, messages = self.episodes.reset(Problem(prompt="p"))
        self.assertEqual(messages, [Message("user", "p")])
        first = self.episodes.step(eid, turn("a", 0))
        self.assertEqual((first.messages, first.reward, first.info),
                         ([Message("user", "seen a")], -0.5, {"n": "1"}))
        self.assertIs(self.episodes.step(eid, turn("a", 0)), first)
        self.assertEqual(self.env.calls, 1)
        second = self.episodes.step(eid, turn("b", 1))
        self.assertIs(self.episodes.step(eid, turn("b", 1)), second)
        self.assertEqual(self.env.calls, 2)

    def test_turn_order(self):
        eid, _ = self.episodes.reset(Problem())
        self.assertIn("expects turn 0, got turn 1",
                      self.assertRefused("FAILED_PRECONDITION", self.episodes.step, eid, turn("a", 1)))
        self.episodes.step(eid, turn("a", 0))
        self.episodes.step(eid, turn("b", 1))
        self.assertRefused("FAILED_PRECONDITION", self.episodes.step, eid, turn("a", 0))  # older
        self.assertRefused("FAILED_PRECONDITION", self.episodes.step, eid, turn("c", 3))  # skips
        self.assertEqual(self.env.calls, 2)

    def test_after_done(self):
        eid, _ = self.episodes.reset(Problem())
        end = self.episodes.step(eid, turn("end", 0))
        self.assertEqual((end.done, end.messages, end.reward), (True, [], 1.0))
        self.assertIs(self.episodes.step(eid, turn("end", 0)), end)  # a retry still works
        self.assertIn("ended at turn 0",
                      self.assertRefused("FAILED_PRECONDITION", self.episodes.step, eid, turn("x", 1)))

    def test_unknown_and_closed(self):
        self.assertRefused("NOT_FOUND", self.episodes.step, "nope", turn("a"))
        self.episodes.close("nope")  # closing an unknown episode succeeds
        eid, _ = self.episodes.reset(Problem())
        self.episodes.close(eid)
        self.episodes.close(eid)
        self.assertRefused("NOT_FOUND", self.episodes.step, eid, turn("a"))
        self.assertEqual(len(self.episodes), 0)

    def test_proposed_ids(self):
        eid, _ = self.episodes.reset(Problem(), "a1b2")
        self.assertEqual(eid, "a1b2")
        self.assertRefused("ALREADY_EXISTS", self.episodes.reset, Problem(), "a1b2")
        self.assertIn("at most 64", self.assertRefused("INVALID_ARGUMENT", self.episodes.reset,
                                                        Problem(), "x" * 65))
        # A Close that overtakes its Reset (the actor gave up): the Reset
        # then opens nothing.
        self.episodes.close("late")
        self.assertRefused("ABORTED", self.episodes.reset, Problem(), "late")
        self.assertEqual(len(self.episodes), 1)
        self.episodes.reset(Problem(), "late")  # remembered once only

    def test_capacity(self):
        ids = [self.episodes.reset(Problem())[0] for _ in range(3)]
        self.assertEqual(len(set(ids)), 3)
        self.assertIn("3 episodes open", self.assertRefused("RESOURCE_EXHAUSTED", self.episodes.reset, Problem()))
        self.episodes.close(ids[0])
        self.episodes.reset(Problem())

    def test_idle_episodes_expire(self):
        old, _ = self.episodes.reset(Problem())
        busy, _ = self.episodes.reset(Problem())
        self.now = 50.0
        self.episodes.step(busy, turn("a", 0))
        self.now = 61.0
        self.assertRefused("NOT_FOUND", self.episodes.step, old, turn("a", 0))
        self.episodes.step(busy, turn("b", 1))
        self.episodes.reset(Problem())
        self.episodes.reset(Problem())  # room: the expired one does not count
        self.assertEqual(len(self.episodes), 3)
        self.now = 200.0
        self.episodes.reset(Problem())  # sweeps all the idle ones
        self.assertEqual(len(self.episodes), 1)

    def test_turn_limit_truncates(self):
        episodes = Episodes(Calculator(max_turns=2))
        eid, _ = episodes.reset(Problem(seed=0))
        r = episodes.step(eid, turn("<call>55*80</call>", 0))
        self.assertEqual((r.done, r.truncated, r.messages[0].content), (False, False, "<result>4400</result>"))
        r = episodes.step(eid, turn("<call>4400-38</call>", 1))
        self.assertEqual((r.done, r.truncated, r.messages, r.reward, r.info),
                         (False, True, [], 0.0, {"tool_call": "1"}))
        self.assertRefused("FAILED_PRECONDITION", episodes.step, eid, turn("#### 4362", 2))

    def test_environment_failures(self):
        eid, _ = self.episodes.reset(Problem())
        self.assertIn("KeyError", self.assertRefused("INTERNAL", self.episodes.step, eid, turn("raise", 0)))
        # A failed turn is not answered: the retry runs it again.
        self.assertIn("outside [-1.0, 1.0]",
                      self.assertRefused("INTERNAL", self.episodes.step, eid, turn("too much", 0)))
        self.episodes.step(eid, turn("fine", 0))
        self.assertRefused("INVALID_ARGUMENT", self.episodes.reset, Problem(prompt="bad"))

    def test_concurrent_retry_waits_for_the_original(self):
        eid, _ = self.episodes.reset(Problem())
        got = []
        threads = [threading.Thread(target=lambda: got.append(self.episodes.step(eid, turn("slow", 0))))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(self.env.calls, 1)
        self.assertTrue(all(r is got[0] for r in got))


def _stubs_available():
    try:
        import server  # noqa: F401
        return True
    except (SystemExit, ImportError):  # no stubs, or no grpc at all
        return False


@unittest.skipUnless(_stubs_available(), "no generated stubs: run via scripts/env-server.sh test")
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
        for srv in cls.servers:
            srv.stop(None)

    def pki(self):
        if not pki_for_tests.available():
            self.skipTest("no openssl to make test certificates")
        d = tempfile.mkdtemp(prefix="bapo-pki-")
        self.addCleanup(shutil.rmtree, d, True)
        pki = pki_for_tests.Pki(d)
        pki.ca_pem = pki.ca("ca")
        pki.server = pki.leaf("ca", "server", server=True)
        return pki

    def start(self, env=None, tls=None, **kw):
        srv, _, address = self.server_mod.build_server(env or Calculator(), "127.0.0.1:0", tls=tls, **kw)
        srv.start()
        self.servers.append(srv)
        self.assertRegex(address, r"^127\.0\.0\.1:[1-9]\d*$")
        return address

    def stub(self, address):
        channel = self.grpc.insecure_channel(address)
        self.addCleanup(channel.close)
        return self.pb_grpc.EnvironmentServiceStub(channel)

    def step(self, stub, eid, message, number, **kw):
        return stub.Step(self.pb.StepRequest(episode_id=eid, message=message, turn=number, **kw), timeout=10)

    def assertCode(self, code, fn, *args, **kw):
        with self.assertRaises(self.grpc.RpcError) as ctx:
            fn(*args, **kw)
        self.assertEqual(ctx.exception.code(), code, ctx.exception.details())
        return ctx.exception.details()

    def test_calculator_episode(self):
        stub = self.stub(self.start())
        info = stub.Describe(self.pb.DescribeEnvRequest(), timeout=10)
        self.assertEqual((info.name, info.max_turns, info.min_reward, info.max_reward), ("calculator", 4, 0.0, 1.0))
        reset = stub.Reset(self.pb.ResetRequest(task="t", seed=0), timeout=10)
        self.assertRegex(reset.episode_id, r"^[0-9a-f]{24}$")
        (first,) = reset.observation.messages
        self.assertEqual(first.role, "user")
        self.assertTrue(first.content.startswith("What is 55 * 80 - 38?"))
        eid = reset.episode_id
        tokens = struct.pack("<3I", 1, 2, 70000)
        r = self.step(stub, eid, "<call>55 * 80 - 38</call>", 0, token_ids=tokens)
        self.assertEqual([(m.role, m.content) for m in r.observation.messages], [("tool", "<result>4362</result>")])
        self.assertEqual((r.reward, r.done, r.truncated, dict(r.info)), (0.0, False, False, {"tool_call": "1"}))
        r = self.step(stub, eid, "#### 4362", 1)
        self.assertEqual((r.reward, r.done, len(r.observation.messages), dict(r.info)), (1.0, True, 0, {"correct": "1"}))
        stub.Close(self.pb.CloseRequest(episode_id=eid), timeout=10)
        self.assertCode(self.grpc.StatusCode.NOT_FOUND, self.step, stub, eid, "#### 4362", 1)
        stub.Close(self.pb.CloseRequest(episode_id="never-opened"), timeout=10)

    def test_refusals(self):
        stub = self.stub(self.start(max_episodes=1))
        code = self.grpc.StatusCode
        self.assertIn("not an integer", self.assertCode(
            code.INVALID_ARGUMENT, stub.Reset, self.pb.ResetRequest(prompt="q", answer="x"), timeout=10))
        eid = stub.Reset(self.pb.ResetRequest(prompt="What is 6 * 7?", answer="42"), timeout=10).episode_id
        self.assertCode(code.RESOURCE_EXHAUSTED, stub.Reset, self.pb.ResetRequest(seed=1), timeout=10)
        self.assertIn("multiple of 4", self.assertCode(
            code.INVALID_ARGUMENT, self.step, stub, eid, "#### 42", 0, token_ids=b"\x01\x00\x00"))
        self.assertCode(code.FAILED_PRECONDITION, self.step, stub, eid, "#### 42", 1)
        self.assertCode(code.NOT_FOUND, self.step, stub, "nope", "#### 42", 0)
        self.assertEqual(self.step(stub, eid, "#### 42", 0).reward, 1.0)
        self.assertCode(code.FAILED_PRECONDITION, self.step, stub, eid, "#### 42", 1)

    def test_lost_answers_are_retried_safely(self):
        faults = self.server_mod.Faults(fail_every=2)
        stub = self.stub(self.start(faults=faults))
        eid = stub.Reset(self.pb.ResetRequest(seed=0), timeout=10).episode_id
        first = self.step(stub, eid, "<call>55*80</call>", 0)
        self.assertIn("injected", self.assertCode(
            self.grpc.StatusCode.UNAVAILABLE, self.step, stub, eid, "<call>4400-38</call>", 1))
        retry = self.step(stub, eid, "<call>4400-38</call>", 1)  # the 3rd step: answered
        self.assertEqual(retry.observation.messages[0].content, "<result>4362</result>")
        self.assertEqual(first.observation.messages[0].content, "<result>4400</result>")

    def test_deadline_then_retry(self):
        stub = self.stub(self.start(faults=self.server_mod.Faults(delay_ms=400)))
        eid = stub.Reset(self.pb.ResetRequest(seed=0), timeout=10).episode_id
        request = self.pb.StepRequest(episode_id=eid, message="#### 4362", turn=0)
        self.assertCode(self.grpc.StatusCode.DEADLINE_EXCEEDED, stub.Step, request, timeout=0.1)
        r = stub.Step(request, timeout=10)
        self.assertEqual((r.reward, r.done), (1.0, True))

    def test_python_episode(self):
        env, _ = _python_env()
        self.addCleanup(env.close)
        stub = self.stub(self.start(env))
        self.assertTrue(stub.Describe(self.pb.DescribeEnvRequest(), timeout=10).name.startswith("python-sandbox["))
        eid = stub.Reset(self.pb.ResetRequest(prompt="2**10?", answer="1024"), timeout=10).episode_id
        r = self.step(stub, eid, "```python\nprint(2**10)\n```", 0)
        self.assertEqual(r.observation.messages[0].content, "1024")
        self.assertEqual(self.step(stub, eid, "#### 1024", 1).reward, 1.0)

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
        address = self.start(tls=(pem_cert, pem_key))
        channel = self.grpc.secure_channel(address, self.grpc.ssl_channel_credentials(pem_cert))
        self.addCleanup(channel.close)
        info = self.pb_grpc.EnvironmentServiceStub(channel).Describe(self.pb.DescribeEnvRequest(), timeout=10)
        self.assertEqual(info.name, "calculator")

    def test_client_certificates(self):
        # Mutual TLS: a certificate of the CA, naming an actor or the
        # learner (or no SPIFFE ID at all), is let in; none, another CA's,
        # or another role's is not.
        pki = self.pki()
        address = self.start(tls=pki.server, client_ca=pki.ca_pem)
        pki.ca("other")
        code = self.grpc.StatusCode
        for name, issuer, spiffe, want in [
            ("actor", "ca", "spiffe://bapo.test/actor/actor-0", None),
            ("learner", "ca", "spiffe://bapo.test/learner", None),
            ("plain", "ca", None, None),
            ("admin", "ca", "spiffe://bapo.test/admin/ops", code.PERMISSION_DENIED),
            ("stranger", "other", "spiffe://bapo.test/actor/actor-0", code.UNAVAILABLE),
            ("anonymous", None, None, code.UNAVAILABLE),
        ]:
            with self.subTest(client=name):
                cert, key = pki.leaf(issuer, name, spiffe=spiffe) if issuer else (None, None)
                creds = self.grpc.ssl_channel_credentials(pki.ca_pem, private_key=key, certificate_chain=cert)
                channel = self.grpc.secure_channel(address, creds)
                self.addCleanup(channel.close)
                stub = self.pb_grpc.EnvironmentServiceStub(channel)
                if want is None:
                    eid = stub.Reset(self.pb.ResetRequest(seed=0), timeout=10).episode_id
                    self.assertEqual(self.step(stub, eid, "#### 4362", 0).reward, 1.0)
                else:
                    details = self.assertCode(want, stub.Reset, self.pb.ResetRequest(seed=0), timeout=10)
                    if want == code.PERMISSION_DENIED:
                        self.assertIn("role admin", details)

    def test_bearer_tokens(self):
        pki = self.pki()
        actor, learner, admin = ("actor-" + "a1" * 12, "learner-" + "b2" * 12, "admin-" + "c3" * 12)
        text = (f"# tokens\nactor {actor}\n\nlearner sha256:{hashlib.sha256(learner.encode()).hexdigest()}"
                f"  # digest only\nadmin {admin}\n")
        import serving

        address = self.start(tls=pki.server, tokens=serving.TokenFile.parse(text))
        channel = self.grpc.secure_channel(address, self.grpc.ssl_channel_credentials(pki.ca_pem))
        self.addCleanup(channel.close)
        stub = self.pb_grpc.EnvironmentServiceStub(channel)
        code = self.grpc.StatusCode
        for header, want, says in [
            (None, code.UNAUTHENTICATED, "no bearer token"),
            (f"Bearer {actor}x", code.UNAUTHENTICATED, "matches no token"),
            (f"Bearer {actor[:-1]}", code.UNAUTHENTICATED, "matches no token"),
            (f"Bearer sha256:{hashlib.sha256(learner.encode()).hexdigest()}", code.UNAUTHENTICATED, "matches no token"),
            (f"Bearer {admin}", code.PERMISSION_DENIED, "role admin"),
        ]:
            with self.subTest(header=header):
                metadata = [("authorization", header)] if header else []
                details = self.assertCode(want, stub.Describe, self.pb.DescribeEnvRequest(),
                                          metadata=metadata, timeout=10)
                self.assertIn(says, details)
                for secret in (actor, learner, admin):
                    self.assertNotIn(secret[-10:], details)
        for token in (actor, learner):  # learner: through its sha256: line
            with self.subTest(token=token[:8]):
                calls = self.grpc.access_token_call_credentials(token)
                authed = self.grpc.secure_channel(address, self.grpc.composite_channel_credentials(
                    self.grpc.ssl_channel_credentials(pki.ca_pem), calls))
                self.addCleanup(authed.close)
                s = self.pb_grpc.EnvironmentServiceStub(authed)
                eid = s.Reset(self.pb.ResetRequest(seed=0), timeout=10).episode_id
                self.assertEqual(self.step(s, eid, "#### 4362", 0).reward, 1.0)

    def test_long_messages_are_refused_by_name(self):
        stub = self.stub(self.start(max_message_bytes=1000))
        eid = stub.Reset(self.pb.ResetRequest(seed=0), timeout=10).episode_id
        for message in ("#### 1".rjust(1001), "\u00e9" * 501, "`" * (1 << 20)):
            with self.subTest(length=len(message)):
                details = self.assertCode(self.grpc.StatusCode.INVALID_ARGUMENT, self.step, stub, eid, message, 0)
                self.assertIn("over this server's limit of 1000 bytes (--max-message-bytes)", details)
        self.assertEqual(self.step(stub, eid, "#### 4362".rjust(1000), 0).reward, 1.0)

    def test_serving_without_client_authentication_is_refused(self):
        server = os.path.join(HERE, "server.py")
        for args, says in [
            ([], "refusing to serve without client authentication"),
            (["--env", "python"], "refusing to serve without client authentication"),
            (["--token-file", "tokens"], "--token-file needs --tls-cert"),
            (["--client-ca", "ca.pem"], "--client-ca needs --tls-cert"),
        ]:
            with self.subTest(args=args):
                proc = subprocess.run([sys.executable, server, "--listen", "127.0.0.1:0", *args],
                                      capture_output=True, text=True, timeout=30)
                self.assertEqual(proc.returncode, 2, proc.stderr)
                self.assertEqual(proc.stdout, "")
                self.assertIn(says, proc.stderr)
                if "refusing" in says:
                    for flag in ("--client-ca", "--token-file", "--allow-unauthenticated"):
                        self.assertIn(flag, proc.stderr)

    def test_a_bad_token_file_is_named_without_its_secret(self):
        pki = self.pki()
        d = tempfile.mkdtemp(prefix="bapo-tokens-")
        self.addCleanup(shutil.rmtree, d, True)
        files = {}
        for name, data in (("cert", pki.server[0]), ("key", pki.server[1])):
            files[name] = os.path.join(d, name)
            with open(files[name], "wb") as f:
                f.write(data)
        tokens = os.path.join(d, "tokens")
        with open(tokens, "w") as f:
            f.write("actor shortsecret\n")
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "server.py"), "--listen", "127.0.0.1:0",
             "--tls-cert", files["cert"], "--tls-key", files["key"], "--token-file", tokens],
            capture_output=True, text=True, timeout=30)
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertIn(f"{tokens}:1: the actor token must be at least 16", proc.stderr)
        self.assertNotIn("shortsecret", proc.stderr)

    def test_process_prints_address_and_stops_on_sigterm(self):
        proc = subprocess.Popen(
            [sys.executable, "-u", os.path.join(HERE, "server.py"), "--listen", "127.0.0.1:0",
             "--env", "calculator", "--max-turns", "3", "--grace", "1", "--allow-unauthenticated"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            m = re.fullmatch(r"listening on 127\.0\.0\.1:(\d+)\n", line)
            self.assertIsNotNone(m, f"first stdout line: {line!r}; stderr: {proc.stderr.read()[:2000] if proc.poll() is not None else ''}")
            stub = self.stub(f"127.0.0.1:{m.group(1)}")
            self.assertEqual(stub.Describe(self.pb.DescribeEnvRequest(), timeout=10).max_turns, 3)
            eid = stub.Reset(self.pb.ResetRequest(seed=42), timeout=10).episode_id
            r = self.step(stub, eid, "<call>78 * 43 + 16</call>", 0)
            self.assertEqual(r.observation.messages[0].content, "<result>3370</result>")
            self.assertEqual(self.step(stub, eid, "So the answer is\n#### 3370", 1).reward, 1.0)
            stub.Close(self.pb.CloseRequest(episode_id=eid), timeout=10)
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
                [sys.executable, os.path.join(HERE, "server.py"), "--listen", f"127.0.0.1:{port}",
                 "--allow-unauthenticated"],
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
    print(f"env-server: {passed} passed, {failed} failed, {skipped} skipped")
    sys.exit(0 if r.wasSuccessful() else 1)
