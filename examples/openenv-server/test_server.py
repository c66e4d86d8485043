"""Tests of the example OpenEnv server: `scripts/openenv-server.sh test`.

Stdlib unittest. The environment is tested in-process; the wire tests start
`server.py --listen 127.0.0.1:0` as a subprocess (as a Rust test would),
read its `listening on HOST:PORT` line and speak raw JSON over `/ws`, plus
one episode through openenv-core's own `GenericEnvClient`. The last line is
`openenv-server: N passed, N failed, N skipped`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import unittest
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from websockets.exceptions import ConnectionClosed  # noqa: E402

from client import Session  # noqa: E402
from server import ArithAction, ArithEnvironment, last_int  # noqa: E402


class Quiet:
    def write(self, _):
        pass

    def flush(self):
        pass


def answer_of(text: str) -> int:
    a, op, b = re.search(r"What is (-?\d+) ([-+*]) (-?\d+)\?", text).groups()
    a, b = int(a), int(b)
    return {"+": a + b, "-": a - b, "*": a * b}[op]


class EnvironmentTests(unittest.TestCase):
    def test_last_int(self):
        self.assertEqual(last_int("37 + 58 = 95"), 95)
        self.assertEqual(last_int("it is -31."), -31)
        self.assertIsNone(last_int("no idea"))

    def test_seed_is_deterministic(self):
        a, b = ArithEnvironment(), ArithEnvironment()
        self.assertEqual(a.reset(seed=5).text, b.reset(seed=5).text)

    def test_right_answer(self):
        env = ArithEnvironment()
        q = env.reset(seed=1, episode_id="e")
        self.assertFalse(q.done)
        self.assertIsNone(q.reward)
        obs = env.step(ArithAction(message=f"so {answer_of(q.text)}"))
        self.assertTrue(obs.done)
        self.assertEqual(obs.reward, 1.0)
        self.assertTrue(env.state.solved)
        self.assertEqual(env.state.episode_id, "e")

    def test_three_wrong_answers(self):
        env = ArithEnvironment()
        q = env.reset(seed=1)
        wrong = str(answer_of(q.text) + 1)
        for i in range(3):
            obs = env.step(ArithAction(message=wrong))
            self.assertEqual(obs.reward, 0.0)
            self.assertEqual(obs.done, i == 2)
        env.reset(seed=1)
        self.assertIn("try again", env.step(ArithAction(message="x")).text)

    def test_step_outside_an_episode_fails(self):
        env = ArithEnvironment()
        with self.assertRaises(RuntimeError):
            env.step(ArithAction(message="1"))
        q = env.reset(seed=2)
        env.step(ArithAction(message=str(answer_of(q.text))))
        with self.assertRaises(RuntimeError):
            env.step(ArithAction(message="1"))


class WireTests(unittest.TestCase):
    proc: subprocess.Popen
    base: str

    @classmethod
    def setUpClass(cls):
        cls.proc = subprocess.Popen(
            [sys.executable, "-u", os.path.join(HERE, "server.py"),
             "--listen", "127.0.0.1:0", "--max-concurrent-envs", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = cls.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            cls.proc.kill()
            raise RuntimeError(f"unexpected first line {line!r}")
        cls.base = line.removeprefix("listening on ")

    @classmethod
    def tearDownClass(cls):
        cls.proc.terminate()
        try:
            cls.proc.wait(10)
        except subprocess.TimeoutExpired:
            cls.proc.kill()
            cls.proc.wait()
        cls.proc.stdout.close()

    def session(self) -> Session:
        return Session(self.base, out=Quiet(), timeout=10)

    def get(self, path):
        with urllib.request.urlopen(f"http://{self.base}{path}", timeout=10) as r:
            return r.status, json.load(r)

    def test_health_and_schema(self):
        self.assertEqual(self.get("/health"), (200, {"status": "healthy"}))
        status, schema = self.get("/schema")
        self.assertEqual(status, 200)
        # openenv 0.10 adds "reset_observation"
        self.assertLessEqual({"action", "observation", "state"}, set(schema))
        self.assertEqual(schema["action"]["required"], ["message"])
        self.assertEqual(schema["action"]["properties"]["message"]["type"], "string")
        self.assertIn("text", schema["observation"]["properties"])

    def test_solved_episode(self):
        s = self.session()
        r = s.call({"type": "reset", "data": {"seed": 7, "episode_id": "ep-1"}})
        self.assertEqual(r["type"], "observation")
        # openenv 0.10 adds "metadata" when the observation has any
        self.assertLessEqual({"observation", "reward", "done"}, set(r["data"]))
        self.assertIsNone(r["data"]["reward"])
        self.assertFalse(r["data"]["done"])
        text = r["data"]["observation"]["text"]
        r = s.call({"type": "step", "data": {"message": "12"}})
        self.assertEqual((r["data"]["reward"], r["data"]["done"]), (0.0, False))
        self.assertIn("try again", r["data"]["observation"]["text"])
        r = s.call({"type": "step", "data": {"message": f"It is {answer_of(text)}."}})
        self.assertEqual((r["data"]["reward"], r["data"]["done"]), (1.0, True))
        r = s.call({"type": "state"})
        self.assertEqual(r["type"], "state")
        self.assertEqual(r["data"]["episode_id"], "ep-1")
        self.assertEqual(r["data"]["step_count"], 2)
        s.close()
        self.assertEqual(s.ws.close_code, 1000)

    def test_three_wrong_then_done(self):
        s = self.session()
        s.call({"type": "reset", "data": {"seed": 3}})
        dones = [s.call({"type": "step", "data": {"message": "no"}})["data"]["done"] for _ in range(3)]
        self.assertEqual(dones, [False, False, True])
        r = s.call({"type": "step", "data": {"message": "1"}})
        self.assertEqual((r["type"], r["data"]["code"]), ("error", "EXECUTION_ERROR"))
        # The session survives errors: a new episode on the same connection.
        self.assertEqual(s.call({"type": "reset"})["type"], "observation")
        s.close()

    def test_error_frames(self):
        s = self.session()
        cases = [
            ({"type": "step", "data": {"message": "1"}}, "EXECUTION_ERROR"),  # before reset
            ("not json", "INVALID_JSON"),
            ({"type": "bogus"}, "UNKNOWN_TYPE"),
            ({"type": "step", "data": {"msg": "1"}}, "VALIDATION_ERROR"),
            ({"type": "step", "action": {"message": "1"}}, "VALIDATION_ERROR"),
            ({"type": "state", "data": {}}, "VALIDATION_ERROR"),
        ]
        for frame, code in cases:
            r = s.call(frame)
            self.assertEqual(r["type"], "error", frame)
            self.assertEqual(r["data"]["code"], code, frame)
            self.assertIsInstance(r["data"]["message"], str)
        s.close()

    def test_capacity(self):
        a, b = self.session(), self.session()
        for x in (a, b):
            x.call({"type": "reset"})
        c = self.session()
        r = c.recv()  # unsolicited: the server refuses right after the handshake
        self.assertEqual(r["type"], "error")
        self.assertEqual(r["data"]["code"], "CAPACITY_REACHED")
        self.assertEqual((r["data"]["active_sessions"], r["data"]["max_sessions"]), (2, 2))
        with self.assertRaises(ConnectionClosed):
            c.recv()
        self.assertEqual(c.ws.close_code, 1000)
        a.close()
        # The slot is free once the server has closed A's socket.
        d = self.session()
        self.assertEqual(d.call({"type": "reset"})["type"], "observation")
        d.close()
        b.close()

    def test_openenv_generic_client(self):
        from openenv.core.generic_client import GenericEnvClient

        async def episode():
            async with GenericEnvClient(base_url=f"http://{self.base}") as env:
                r = await env.reset(seed=11)
                r = await env.step({"message": str(answer_of(r.observation["text"]))})
                return r.reward, r.done, await env.state()

        reward, done, state = asyncio.run(episode())
        self.assertEqual((reward, done), (1.0, True))
        self.assertTrue(state["solved"])


if __name__ == "__main__":
    t = time.time()
    result = unittest.main(exit=False, verbosity=2, argv=[sys.argv[0], *sys.argv[1:]]).result
    failed = len(result.failures) + len(result.errors)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped
    print(f"openenv-server: {passed} passed, {failed} failed, {skipped} skipped ({time.time() - t:.1f} s)")
    sys.exit(1 if failed else 0)
