"""``python``: the model runs Python in a sandbox before it answers.

Reset: one user message, the request's ``prompt`` (required; this
environment draws no problems of its own). The reference answer is the
request's ``answer`` (an integer, see ``answer.py``), or none.

Each model turn is either

* a program: the turn's last ```` ```python ```` block (also ``py``,
  ``python3``), run once in the reference reward server's sandbox
  (``examples/reward-server/verifiers/code.py``: a uid of its own, its
  own process tree and working directory, limits on the program as a
  whole, network isolation, every process gone when it ends; its README
  says what that does and does not protect against). The observation is
  one ``tool`` message with the program's stdout, then ``[stderr]`` and its
  stderr, then ``[timed out after T s]``, ``[stopped: WHY]`` (a memory,
  file or disk limit) or ``[exit status N]`` when it did not exit 0
  (``[no output]`` when there is nothing to say); each stream keeps its
  last ``max_output`` bytes, after a ``[... N bytes cut]`` line. Reward 0,
  not done, info ``tool_call``, ``exit_code``, ``timeout`` (and ``limit``,
  the limit's name, when one stopped it);
* or, without a block, the final answer, graded by ``answer.grade``
  (without a reference answer: reward 0, info ``no_answer``).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import List, Optional, Tuple

from . import BadRequest, Environment, Message, Problem, StepResult, Turn
from .answer import grade, reference_integer

# The sandbox is the reward server's, imported rather than copied, so a fix
# to one is a fix to both.
_REWARD_SERVER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "reward-server")
if _REWARD_SERVER not in sys.path:
    sys.path.append(_REWARD_SERVER)

from verifiers.code import CodeVerifier, RunOutcome, python_block  # noqa: E402


class PythonSandbox(Environment):
    min_reward = 0.0
    max_reward = 1.0

    def __init__(self, max_turns: int = 4, max_output: int = 2048, workers: Optional[int] = None,
                 **sandbox):
        """`sandbox`: CodeVerifier's options (timeout_s, memory_mb,
        max_procs, max_files, max_disk_mb, isolation, allow_network,
        python, sandbox_user, allow_same_user)."""
        self.max_turns = max_turns
        self.max_output = int(max_output)
        workers = workers or os.cpu_count() or 2
        # One sandbox identity per program running at once.
        self.sandbox = CodeVerifier(slots=workers, **sandbox)
        self.name = f"python-sandbox[{self.sandbox.isolation}]"
        # Programs at once, across all episodes: each may take a CPU and
        # --memory-mb for --timeout seconds.
        self.slots = threading.BoundedSemaphore(workers)

    def close(self) -> None:
        self.sandbox.close()

    def reset(self, problem: Problem) -> Tuple[Optional[int], List[Message]]:
        if not problem.prompt:
            raise BadRequest("the python environment needs a prompt (it draws no problems)")
        answer = None
        if problem.answer:
            answer = reference_integer(problem.answer)
            if answer is None:
                raise BadRequest(f"answer {problem.answer[-80:]!r} is not an integer")
        return answer, [Message("user", problem.prompt)]

    def step(self, answer: Optional[int], turn: Turn) -> StepResult:
        program = python_block(turn.message)
        if program is None:
            return grade(turn, answer)
        with self.slots:
            out = self.sandbox.run(program, "", output_bytes=self.max_output)
        info = {"tool_call": "1", "exit_code": str(out.exit_code),
                "timeout": "1" if out.timed_out else "0"}
        if out.limit:
            info["limit"] = out.limit
        return StepResult(messages=[Message("tool", self.render(out))], info=info)

    def render(self, out: RunOutcome) -> str:
        """What the model sees of a run (the module's docstring)."""
        parts = []
        if out.stdout_bytes:
            parts.append(self._cut(out.stdout, out.stdout_bytes))
        if out.stderr_bytes:
            parts.append("[stderr]\n" + self._cut(out.stderr_tail, out.stderr_bytes))
        if out.timed_out:
            parts.append(f"[timed out after {self.sandbox.timeout_s:g} s]")
        elif out.limit:
            parts.append(f"[stopped: {out.limit_detail or out.limit}]")
        elif out.exit_code:
            parts.append(f"[exit status {out.exit_code}]")
        return "\n".join(parts) or "[no output]"

    def _cut(self, text: str, total: int) -> str:
        text = text.rstrip("\n")
        if total > self.max_output:
            return f"[... {total - self.max_output} bytes cut]\n{text}"
        return text
