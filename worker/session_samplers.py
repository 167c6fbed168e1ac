"""A session worker's sampling engines: one per session and base model for the session's life. A sampler id's
weights go into it by a push (a sampler checkpoint the worker just exported) or from its export on disk (an
older sampler used after a newer push), and a batch of queued ``asample`` requests is one engine call."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gspo_core import primitives as prim

log = logging.getLogger(__name__)
#: The fewest sequences an engine's KV cache is sized for (vLLM on CPU sizes it to max_num_seqs x max_model_len):
#: a client's first call may be one of many concurrent ones still arriving.
MIN_ENGINE_SEQS = 64


@dataclass(frozen=True)
class SampleCall:
    """One ``asample`` request: its prompt, samples, parameters, and whether it wants the prompt's log-probs."""

    tokens: list[int]
    n: int
    params: prim.SamplingParams
    prompt_logprobs: bool

    @classmethod
    def of(cls, payload: dict[str, Any]) -> SampleCall:
        params = payload["params"]
        stop = params.get("stop")
        sampling = prim.SamplingParams(
            max_tokens=int(params.get("max_tokens") or 16),
            temperature=float(params["temperature"]),
            top_p=float(params["top_p"]),
            top_k=int(params["top_k"]),
            seed=params.get("seed"),
            stop=[stop] if isinstance(stop, str) else stop,
        )
        return cls(
            [int(t) for t in payload["tokens"]], int(payload["n"]), sampling, bool(payload.get("prompt_logprobs"))
        )

    def batch_key(self) -> str:
        """Calls with the same key share one ``sample_many`` call (one ``n`` and one set of parameters)."""
        return json.dumps([self.n, asdict(self.params)], sort_keys=True)


@dataclass
class Engine:
    """A sampling session and the export directory whose weights it holds now."""

    session: prim.SamplingSession
    weights: str


@dataclass
class SamplerEngines:
    """The engines of the sessions a worker holds, by (session id, base model directory)."""

    engine_kind: str
    engines: dict[tuple[str, str], Engine] = field(default_factory=dict)
    started: int = 0  # engines started by this worker (logged; the tests read it)
    reloads: int = 0  # older samplers' weights read back from disk

    def pushed(self, session_id: str, base: str, directory: str, trainer: prim.TrainingSession) -> None:
        """A sampler checkpoint was exported from ``trainer``: its weights go into the session's engine at once
        (the push), so its sampler needs no new engine; no engine yet: the first sample starts one from disk."""
        engine = self.engines.get((session_id, base))
        if engine is not None:
            engine.session.take_weights(trainer)
            engine.weights = str(Path(directory))

    def engine(self, session_id: str, base: str, weights: str, seqs: int, max_tokens: int) -> prim.SamplingSession:
        """The session's engine holding ``weights`` (a sampler's export, or the base model's directory)."""
        weights = str(Path(weights))
        engine = self.engines.get((session_id, base))
        if engine is None:
            session = prim.SamplingSession.create(
                weights, engine=self.engine_kind, max_num_seqs=max(seqs, MIN_ENGINE_SEQS), max_new_tokens=max_tokens
            )
            engine = self.engines[(session_id, base)] = Engine(session, weights)
            self.started += 1
            log.info("sampling engine %d started for session %s (%s)", self.started, session_id, base)
        elif engine.weights != weights:
            engine.session.load_weights(weights)
            engine.weights = weights
            self.reloads += 1
            log.info("sampling engine of session %s reloaded %s (%d reloads)", session_id, weights, self.reloads)
        return engine.session

    def release(self, session_id: str) -> None:
        for key in [key for key in self.engines if key[0] == session_id]:
            self.engines.pop(key).session.close()

    def sessions(self) -> set[str]:
        return {session_id for session_id, _ in self.engines}


def sample_calls(sampler: prim.SamplingSession, calls: list[SampleCall]) -> list[dict[str, Any]]:
    """Each call's result (the SDK's sample response as JSON), calls with equal parameters sampled together in
    one ``sample_many``."""
    results: list[dict[str, Any] | None] = [None] * len(calls)
    groups: dict[str, list[int]] = {}
    for index, call in enumerate(calls):
        groups.setdefault(call.batch_key(), []).append(index)
    for indexes in groups.values():
        first = calls[indexes[0]]
        sampled = sampler.sample_many([calls[i].tokens for i in indexes], first.n, first.params)
        for index, seqs in zip(indexes, sampled, strict=True):
            results[index] = {
                "sequences": [{"tokens": q.tokens, "logprobs": q.logprobs, "stop_reason": q.stop_reason} for q in seqs]
            }
    for index, call in enumerate(calls):
        if call.prompt_logprobs:
            results[index]["prompt_logprobs"] = sampler.compute_logprobs(call.tokens)  # type: ignore[index]
    return [result for result in results if result is not None]
