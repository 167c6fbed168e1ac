"""A ``verifiers`` environment's episodes: a runner subprocess in the environments venv plays them against the job's
own chat endpoint.

Only the worker starts the runner (`gspo_core/environments/verifiers_runner.py`, invoked by path with the
operator's interpreter, so the environment's imports never enter this process). It speaks JSON lines over its
stdin/stdout: ``load`` answers the environment's tasks (our rows), ``rollout`` plays one episode against the
job's chat endpoint (`gspo_core.agents.remote`: every trained token is a sampled one, with its provenance) and
answers its rubric's reward and metrics.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from gspo_core.agents.remote import AgentEndpoint, _Session
from gspo_core.agents.remote_episodes import AgentEnvironment
from gspo_core.environments.verifiers_env import VerifiersEnvironment, check_allowed
from gspo_core.rollout.base import EnvironmentScore, EpisodeOutcome
from gspo_core.stopping import NEVER, StopCheck

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.agents.formats import Parser
    from gspo_core.platform import RuntimeOptions
    from gspo_core.rewards.policy import GraderPolicy

#: The runner, run by path in the environments venv.
RUNNER = Path(__file__).with_name("verifiers_runner.py")
#: What the runner inherits of the worker's environment (no credentials, no service settings).
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


class RunnerError(RuntimeError):
    """The runner could not start, load the environment, or died."""


@dataclass
class EpisodeResult:
    """One episode's outcome: the rubric's ``reward`` (None: none), its named scores and metrics, an error kind."""

    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class VerifiersRunner:
    """The runner subprocess of one job: started with the operator's interpreter, fed requests by many threads,
    answered out of order (one reader thread hands each answer to its waiter)."""

    def __init__(self, env: VerifiersEnvironment, runtime: RuntimeOptions) -> None:
        check_allowed(env, runtime.verifiers_environments)
        if not runtime.envs_python or not Path(runtime.envs_python).exists():
            raise RunnerError(f"the environments venv is missing ({runtime.envs_python or 'GSPO_ENVS_PYTHON unset'})")
        self.env = env
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115  (the runner's lifetime; closed by close())
        passed = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        self.proc = subprocess.Popen(
            [runtime.envs_python, "-I", str(RUNNER), *runtime.envs_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env={**passed, "PYTHONUNBUFFERED": "1"},
            cwd=tempfile.gettempdir(),
        )
        self.lock = threading.Lock()
        self.waiting: dict[int, tuple[threading.Event, list[dict]]] = {}
        self.next_id = 0
        self.reader = threading.Thread(target=self._read, name="verifiers-runner", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                waiter = self.waiting.pop(answer.get("n"), None)
            if waiter is not None:
                waiter[1].append(answer)
                waiter[0].set()
        with self.lock:  # the runner is gone: every waiter learns it now
            for event, _ in self.waiting.values():
                event.set()
            self.waiting.clear()

    def ask(self, request: dict, timeout_s: float) -> dict:
        """Send one request and wait for its answer; :class:`RunnerError` when the runner died or is silent."""
        event, box = threading.Event(), cast(list[dict], [])
        with self.lock:
            self.next_id += 1
            n = self.next_id
            self.waiting[n] = (event, box)
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write((json.dumps({**request, "n": n}) + "\n").encode())
                self.proc.stdin.flush()
            except OSError:
                self.waiting.pop(n, None)
                raise RunnerError(f"the environment runner died: {self.tail()}") from None
        if not event.wait(timeout_s):
            with self.lock:
                self.waiting.pop(n, None)
            raise RunnerError("the environment runner did not answer in time")
        if not box:
            raise RunnerError(f"the environment runner died: {self.tail()}")
        return box[0]

    def tail(self) -> str:
        """The runner's last words (its stderr's end)."""
        self.stderr.seek(0, os.SEEK_END)
        size = self.stderr.tell()
        self.stderr.seek(max(size - 1500, 0))
        return self.stderr.read().decode(errors="replace").strip() or f"exit {self.proc.poll()}"

    def rows(self) -> tuple[list[dict], list[dict]]:
        """``(training rows, held-out rows)``: the taskset's first ``size`` tasks, then ``validation_size`` more."""
        env = self.env
        total = env.size + env.validation_size
        answer = self.ask({"op": "load", "id": env.id, "args": env.args, "limit": total}, 600.0)
        if answer.get("error"):
            raise RunnerError(f"environment {env.id!r} did not load: {answer['error']}")
        rows = answer["rows"]
        if not rows:
            raise RunnerError(f"environment {env.id!r} has no tasks")
        return rows[: env.size], rows[env.size : total]

    def rollout(self, row: dict, base_url: str, api_key: str, timeout_s: float) -> EpisodeResult:
        """One episode of ``row``'s task through ``base_url``: its reward, scores and metrics, or an error kind."""
        request = {"op": "rollout", "row": row, "base_url": base_url, "api_key": api_key, "timeout_s": timeout_s}
        try:
            answer = self.ask(request, timeout_s + 30.0)
        except RunnerError:
            return EpisodeResult(error="runner_error")
        if answer.get("error"):
            return EpisodeResult(error=str(answer.get("kind") or "environment_error"))
        reward = answer.get("reward")
        value = float(reward) if isinstance(reward, (int, float)) and math.isfinite(reward) else None
        metrics = {
            str(k): float(v)
            for k, v in (answer.get("metrics") or {}).items()
            if isinstance(v, (int, float)) and math.isfinite(v)
        }
        return EpisodeResult(value, metrics, None if value is not None else "no_reward")

    def close(self) -> None:
        if self.stderr.closed:
            return
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # end of input: the runner exits
                self.proc.wait(30)  # its interpreter's shutdown took over 10 s on a loaded 2-core machine
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


class VerifiersEndpoint(AgentEndpoint):
    """The job's chat endpoint with the runner as its agent: each session's episode is played by the runner."""

    def __init__(
        self,
        runner: VerifiersRunner,
        policy: GraderPolicy,
        parser: Parser,
        max_prompt_tokens: int,
        host: str = "127.0.0.1",
        port: int = 0,
        url: str = "",
    ) -> None:
        spec = {"server_url": "", "timeout_s": runner.env.timeout_s}
        super().__init__(spec, policy, parser, max_prompt_tokens, host, port, url)
        self.runner = runner

    def environment(
        self, tokenizer: PreTrainedTokenizerBase, rows: list[dict], stop: StopCheck = NEVER
    ) -> AgentEnvironment:
        return VerifiersSessions(self, tokenizer, rows, stop)

    def close(self) -> None:
        super().close()
        self.runner.close()


class VerifiersSessions(AgentEnvironment):
    """One rollout's episodes, each played by the runner; the rubric's reward is each episode's
    ``environment_reward`` (the ``verifiers`` grader's score), its metrics the step's ``verifiers/<name>/mean``."""

    ep: VerifiersEndpoint

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.results: dict[str, EpisodeResult] = {}

    def _run(self, s: _Session) -> None:
        base_url = f"{self.ep.base}/s/{s.id}/v1"
        result = self.ep.runner.rollout(s.item, base_url, s.id, self.ep.timeout_s)
        with self.ep.cv:
            self.results[s.id] = result
            s.finished, s.error = True, s.error or result.error
            self.ep.cv.notify_all()

    def close(self, episodes: list) -> None:
        super().close(episodes)
        sums: dict[str, list[float]] = {}
        for result in self.results.values():
            for name, value in result.metrics.items():
                sums.setdefault(name, []).append(value)
        for name, values in sums.items():
            self.metrics[f"verifiers/{name}/mean"] = sum(values) / len(values)

    def _outcome(self, s: _Session) -> None:
        super()._outcome(s)
        result = self.results.get(s.id, EpisodeResult())
        outcome = cast(EpisodeOutcome, s.episode.outcome)
        s.episode.outcome = replace(outcome, score=EnvironmentScore(result.reward, result.metrics))
