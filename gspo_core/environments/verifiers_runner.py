"""The environment runner: run by path in the environments venv, it plays a verifiers environment's episodes.

Not imported by the service (its imports are verifiers' and the environment's, which live only in that venv):
`gspo_core.environments.verifiers_episodes` starts it as ``<envs python> -I verifiers_runner.py [dir ...]``
(each ``dir``: where the operator's environment modules may also be imported from) and speaks JSON lines:

* ``{"n", "op": "load", "id", "args", "limit"}``: the environment (verifiers' task-centric contract: the taskset
  ``id`` with ``args`` as its config, in verifiers' own ``Env`` for it) is built and serves; the answer is its
  first ``limit`` tasks as rows ``{"messages", "task", "answer", "info": {"idx", "key"}}``.
* ``{"n", "op": "rollout", "row", "base_url", "api_key", "timeout_s"}``: one episode of the row's task whose
  model is the job's chat endpoint at ``base_url``; the answer is ``{"n", "reward", "metrics"}`` (the traces'
  weighted rubric sum, each ``@vf.reward`` score and ``@vf.metric`` by name) or ``{"n", "error", "kind"}``.

Rollouts run concurrently on one event loop; answers come as each finishes. End of input ends the runner.
The environment's agents play with this module's in-process chat harness (every model call goes through
verifiers' interception to ``base_url``: nothing is installed or launched per episode) unless its taskset
ships a harness of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types
from typing import Any

import verifiers.v1 as vf  # only in the environments venv (not the service's: mypy sees Any)
from verifiers.v1.runtimes import ProgramResult

HARNESS_ID = "gspo_chat"
#: The variable the endpoint's client config reads its key from (the session's URL is its secret).
KEY_VAR = "GSPO_ENDPOINT_KEY"


class GspoChatConfig(vf.HarnessConfig):
    id: str = HARNESS_ID


class GspoChat(vf.Harness[GspoChatConfig]):
    """One model turn on the task's prompt, in-process, through the interception ``endpoint``."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        from openai import AsyncOpenAI

        system, prompt = self.resolve_prompt(data)
        messages: list[Any] = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _wire(prompt or [])
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


def _wire(messages: list) -> list[dict]:
    from verifiers.v1.dialects.chat import message_to_wire

    return [message_to_wire(m) if not isinstance(m, dict) else m for m in messages]


def _register_harness() -> None:
    """Our harness as the plugin module verifiers imports by id (no package on disk, nothing installed)."""
    module = types.ModuleType(HARNESS_ID)
    module.GspoChat, module.GspoChatConfig = GspoChat, GspoChatConfig  # type: ignore[attr-defined]
    module.__all__ = ["GspoChat", "GspoChatConfig"]  # type: ignore[attr-defined]
    sys.modules[HARNESS_ID] = module


class Runner:
    """The loaded environment, its tasks by index, and the answers' writer."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.env: Any = None
        self.tasks: dict[int, Any] = {}
        self.serving: Any = None

    def answer(self, obj: dict) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    async def load(self, req: dict) -> dict:
        env_cls, config_cls = vf.environment_class(req["id"]), vf.env_config_type(req["id"])
        # Only the taskset's own fields: verifiers' shared ones plug in code and files (the worker checked too).
        own = set(vf.taskset_config_type(req["id"]).model_fields) - set(vf.TasksetConfig.model_fields)
        if unknown := sorted(set(req["args"]) - own):
            known = ", ".join(sorted(own)) or "none"
            return {"error": f"args: {unknown[0]!r} is not a config field of {req['id']} (known: {known})"}
        roles = {name for name, f in config_cls.model_fields.items() if isinstance(f.default, vf.AgentConfig)}
        default = vf.default_harness_id(req["id"])
        harness = {"id": HARNESS_ID} if default == "bash" else {"id": default}
        agent = {"harness": harness, "runtime": {"type": "subprocess"}}
        config = config_cls.model_validate({"taskset": {**req["args"], "id": req["id"]}, **dict.fromkeys(roles, agent)})
        self.env = env_cls(config)
        self.serving = self.env.serving()
        await self.serving.__aenter__()
        rows = []
        for task in self.env.taskset.take(int(req["limit"])):
            self.tasks[task.data.idx] = task
            rows.append(_row(req["id"], task))
        return {"rows": rows}

    async def rollout(self, req: dict) -> dict:
        task = self.tasks[int(req["row"]["info"]["idx"])]
        client = vf.EvalClientConfig(base_url=req["base_url"], api_key_var=KEY_VAR)
        ctx = vf.ModelContext(model="policy", client=client)
        async with asyncio.timeout(float(req["timeout_s"])):
            (slot,) = self.env.slots(task, 1)
            episode = await self.env.run_slot(slot, ctx)
        if not episode.traces:
            return {"error": "; ".join(e.message for e in episode.errors)[-500:], "kind": "no_trace"}
        metrics: dict[str, float] = {}
        for trace in episode.traces:
            for name, r in trace.rewards.items():
                if r is not None:
                    metrics[name] = metrics.get(name, 0.0) + float(r.score)
            for name, value in trace.metrics.items():
                if isinstance(value, (int, float)):
                    metrics[name] = metrics.get(name, 0.0) + float(value)
        if not episode.ok:  # an episode that broke anywhere is not trained on (the worker drops and counts it)
            errors = [e.message for e in episode.errors] + [e.message for t in episode.traces for e in t.errors]
            return {"error": "; ".join(errors)[-500:] or "episode failed", "kind": "episode_error"}
        return {"reward": sum(t.reward for t in episode.traces), "metrics": metrics}

    async def handle(self, req: dict) -> None:
        try:
            out = await (self.load(req) if req.get("op") == "load" else self.rollout(req))
        except TimeoutError:
            out = {"error": "the episode ran past its timeout", "kind": "timeout"}
        except Exception as exc:  # one episode's failure is its answer, never the runner's end
            out = {"error": f"{type(exc).__name__}: {exc}"[-500:], "kind": "environment_error"}
        self.answer({**out, "n": req.get("n")})


def _row(taskset: str, task: Any) -> dict:
    """A task as our item: its prompt as chat messages, its answer where it has one, its index to find it again."""
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    prompt = data.prompt
    messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _wire(prompt or [])
    answer = getattr(data, "answer", None)
    return {
        "messages": messages,
        "task": taskset,
        "answer": answer if isinstance(answer, (str, int, float)) or answer is None else str(answer),
        "info": {"idx": data.idx, "key": task.key},
    }


async def main(runner: Runner) -> None:
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task] = set()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        try:
            req = json.loads(line)
        except ValueError:
            continue
        if req.get("op") == "load":
            await runner.handle(req)  # rollouts need the environment: load first, alone
            continue
        job = asyncio.ensure_future(runner.handle(req))
        pending.add(job)
        job.add_done_callback(pending.discard)
    for job in list(pending):
        job.cancel()
    if runner.serving is not None:
        await runner.serving.__aexit__(None, None, None)


if __name__ == "__main__":
    sys.path[:0] = sys.argv[1:]  # the operator's environment directories (GSPO_ENVS_PATH)
    os.environ[KEY_VAR] = "session"
    _register_harness()
    # The answers get the real stdout alone: whatever the libraries print goes to stderr (the worker's log tail).
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    asyncio.run(main(Runner(answers)))
