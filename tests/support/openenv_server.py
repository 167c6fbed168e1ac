"""A small OpenEnv server for tests/core/test_openenv.py and tests/api/test_environments.py, built from the
`openenv` package's own server classes (`Environment`, `Action`, `Observation`, `create_app`); run by
.venv-openenv's Python (scripts/openenv-env.sh), never imported by the service's venv: ``python openenv_server.py
PORT [--host H] [--die-on-step N] [--token T] [--one-environment]``.

The game: the reset observation asks for a word (its seed in the prompt); each step's reward is 1.0 when the
model's text has an even number of characters, else 0.25; the episode is done after ``STEPS`` steps. With
``--die-on-step N`` the whole process exits at the N-th step of any episode (a server dying mid-episode).
With ``--token T`` a WebSocket handshake without ``Authorization: Bearer T`` is refused. With
``--one-environment`` every HTTP call (and session) uses one environment, so ``/reset`` and ``/step`` play an
episode over HTTP (openenv's HTTP routes otherwise build a fresh environment per call).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

STEPS = 2


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str
    turn: int


def step_reward(message: str) -> float:
    return 1.0 if len(message) % 2 == 0 else 0.25


def make_env_class(die_on_step: int):
    class GuessEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            self._state = State(step_count=0)
            self.seed = 0

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
            self.seed = seed or 0
            self._state = State(step_count=0)
            return GuessObservation(prompt=f"word {self.seed}?", turn=0, done=False, reward=None)

        def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
            self._state.step_count += 1
            if die_on_step and self._state.step_count >= die_on_step:
                os._exit(3)
            turn = self._state.step_count
            return GuessObservation(
                prompt=f"again {self.seed}.{turn}?",
                turn=turn,
                done=turn >= STEPS,
                reward=step_reward(action.message),
            )

        @property
        def state(self) -> State:
            return self._state

    return GuessEnvironment


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--die-on-step", type=int, default=0)
    parser.add_argument("--token", default="")
    parser.add_argument("--one-environment", action="store_true", help="every call and session shares one")
    args = parser.parse_args()
    env_class = make_env_class(args.die_on_step)
    factory = env_class
    if args.one_environment:  # HTTP /reset and /step then play one episode (each call asks the factory)
        shared = env_class()
        factory = lambda: shared  # noqa: E731
    app = create_app(factory, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)
    server = app
    if args.token:

        async def server(scope, receive, send):  # the WebSocket handshake needs the tenant's header
            if scope["type"] == "websocket":
                headers = dict(scope.get("headers") or [])
                if headers.get(b"authorization") != f"Bearer {args.token}".encode():
                    await send({"type": "websocket.close", "code": 4401})
                    return
            await app(scope, receive, send)

    uvicorn.run(server, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
