"""What a session worker holds: each session's training and sampling sessions (gspo_core.primitives), and the
one function per request kind that calls them; every computation is a primitive's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo_core import primitives as prim
from store.model_refs import resolve_model
from store.objects import ObjectStore, put_dir
from store.settings import Settings


class SessionRequestError(ValueError):
    """A request the session cannot run (the tenant's to fix): reported as a user error."""


@dataclass(frozen=True)
class Outcome:
    """A request's result (JSON) and the tokens it sampled and trained on (usage)."""

    result: dict[str, Any]
    sampled: int = 0
    trained: int = 0


@dataclass(frozen=True)
class Saved:
    """A checkpoint the worker wrote: where, and its copy in object storage."""

    kind: str
    name: str
    directory: str
    object_prefix: str
    size: int


@dataclass
class SessionHost:
    """The models of the sessions this worker holds, by model (or sampler) id."""

    settings: Settings
    objects: ObjectStore
    trainers: dict[str, prim.TrainingSession] = field(default_factory=dict)
    samplers: dict[str, prim.SamplingSession] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)  # model or sampler id -> session id

    def trainer(self, model_id: str) -> prim.TrainingSession:
        trainer = self.trainers.get(model_id)
        if trainer is None:
            raise SessionRequestError(
                f"model {model_id} is not loaded (its worker stopped or it was unloaded); create a model and "
                "load_weights from its last saved state"
            )
        return trainer

    def create_model(self, session_id: str, model_id: str, payload: dict) -> Outcome:
        lora = payload.get("lora")
        spec = prim.LoraSpec(rank=int(lora["rank"])) if lora else None
        seed = int(lora.get("seed") or 0) if lora else 0
        path = resolve_model(self.settings.models_dir, payload["base_model"])
        self.trainers[model_id] = prim.TrainingSession.create(path, lora=spec, seed=seed)
        self.owners[model_id] = session_id
        return Outcome({"type": "create_model", "model_id": model_id})

    def forward_backward(self, model_id: str, payload: dict, backward: bool) -> Outcome:
        data = [_datum(i, row) for i, row in enumerate(payload["data"])]
        trainer = self.trainer(model_id)
        run = trainer.forward_backward if backward else trainer.forward
        out = run(data, payload["loss"], payload.get("loss_config") or None)
        trained = sum(len(d.tokens) for d in data) if backward else 0
        return Outcome({"logprobs": out.logprobs, "metrics": out.metrics}, trained=trained)

    def optim_step(self, model_id: str, payload: dict) -> Outcome:
        adam = payload["adam"]
        params = prim.AdamParams(
            learning_rate=adam["learning_rate"],
            beta1=adam["beta1"],
            beta2=adam["beta2"],
            eps=adam["eps"],
            weight_decay=adam["weight_decay"],
            grad_clip_norm=adam["grad_clip_norm"],
        )
        return Outcome({"type": "optim_step", "metrics": self.trainer(model_id).optim_step(params)})

    def save(self, model_id: str, payload: dict) -> tuple[Outcome, Saved]:
        trainer, directory = self.trainer(model_id), Path(payload["directory"])
        directory.mkdir(parents=True, exist_ok=True)
        prefix = "tinker/" + "/".join(directory.parts[-4:])  # <tenant>/<model>/<kind>/<name>
        if payload["kind"] == "training":
            trainer.save_state(str(directory), optimizer=True)
            size = put_dir(self.objects, f"{prefix}/state", directory)
        else:
            trainer.export_hf(str(directory))
            size = put_dir(self.objects, f"{prefix}/model", directory)
        kind = "save_weights" if payload["kind"] == "training" else "save_weights_for_sampler"
        result = {"type": kind, "path": payload["path"]}
        if payload.get("sampling_session_id"):
            result["sampling_session_id"] = payload["sampling_session_id"]
        return Outcome(result), Saved(payload["kind"], payload["name"], str(directory), prefix, size)

    def load(self, model_id: str, payload: dict) -> Outcome:
        self.trainer(model_id).load_state(payload["directory"], optimizer=bool(payload["optimizer"]))
        return Outcome({"type": "load_weights", "path": payload["path"]})

    def sample(self, session_id: str, sampler_id: str, weights_dir: str, payload: dict) -> Outcome:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            engine = self.settings.rollout_engine
            sampler = self.samplers[sampler_id] = prim.SamplingSession.create(weights_dir, engine=engine)
            self.owners[sampler_id] = session_id
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
        tokens = payload["tokens"]
        seqs = sampler.sample(tokens, int(payload["n"]), sampling)
        result: dict[str, Any] = {
            "sequences": [{"tokens": q.tokens, "logprobs": q.logprobs, "stop_reason": q.stop_reason} for q in seqs]
        }
        if payload.get("prompt_logprobs"):
            result["prompt_logprobs"] = sampler.compute_logprobs(tokens)
        return Outcome(result, sampled=sum(len(q.tokens) for q in seqs))

    def unload(self, model_id: str) -> Outcome:
        self._drop(model_id)
        return Outcome({"type": "unload_model", "model_id": model_id})

    def release(self, session_id: str) -> None:
        """Free every model of a session (closed, idle or lost)."""
        for model_id in [m for m, owner in self.owners.items() if owner == session_id]:
            self._drop(model_id)

    def _drop(self, model_id: str) -> None:
        self.owners.pop(model_id, None)
        for table in (self.trainers, self.samplers):
            held = table.pop(model_id, None)
            if held is not None:
                held.close()

    def sessions(self) -> set[str]:
        return set(self.owners.values())


def _datum(index: int, row: dict) -> prim.Datum:
    inputs = row["inputs"]
    unknown = set(inputs) - {"target_tokens", "weights", "logprobs", "advantages", "mask", "sequence_ratio_mask"}
    if unknown:
        raise SessionRequestError(f"data[{index}].loss_fn_inputs: unknown inputs {sorted(unknown)}")
    n = len(row["tokens"])
    for name, values in inputs.items():
        if len(values) != n:
            raise SessionRequestError(f"data[{index}].loss_fn_inputs.{name}: {len(values)} values for {n} tokens")
    return prim.Datum(
        tokens=[int(t) for t in row["tokens"]],
        target_tokens=[int(t) for t in inputs["target_tokens"]],
        weights=inputs.get("weights"),
        logprobs=inputs.get("logprobs"),
        advantages=inputs.get("advantages"),
        mask=inputs.get("sequence_ratio_mask", inputs.get("mask")),  # Tinker's name, or ours
    )
