"""What a session worker holds: each session's training sessions and sampling engines (gspo_core.primitives), and the
one function per request kind that calls them; every computation is a primitive's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo_core import primitives as prim
from store.model_refs import resolve_model
from store.objects import ObjectStore, put_dir
from store.private import private_dir
from store.settings import Settings
from store.tinker_files import checkpoint_prefix, object_key
from worker.checkpoint_files import CheckpointFiles, unstamp
from worker.session_samplers import SampleCall, SamplerEngines, sample_calls


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


@dataclass(frozen=True)
class SavedState:
    """A training checkpoint to load: its ``tinker://`` path, a local directory holding it
    (``CheckpointFiles.local_dir``), and whether its optimizer state is loaded too."""

    path: str
    directory: str
    optimizer: bool


@dataclass
class SessionHost:
    """The models of the sessions this worker holds, by model (or sampler) id."""

    settings: Settings
    objects: ObjectStore
    trainers: dict[str, prim.TrainingSession] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)  # model id -> session id
    bases: dict[str, str] = field(default_factory=dict)  # model id -> its base model's directory
    engines: SamplerEngines = field(init=False)
    files: CheckpointFiles = field(init=False)

    def __post_init__(self) -> None:
        self.engines = SamplerEngines(self.settings.rollout_engine)
        self.files = CheckpointFiles(self.objects, Path(self.settings.data_dir).resolve())

    def trainer(self, model_id: str) -> prim.TrainingSession:
        trainer = self.trainers.get(model_id)
        if trainer is None:
            raise SessionRequestError(f"model {model_id} is not loaded (it was unloaded)")
        return trainer

    def holds(self, model_id: str) -> bool:
        return model_id in self.trainers

    def restore(self, session_id: str, model_id: str, model: dict, state: SavedState | None) -> None:
        """Rebuild a training model another worker held: ``create_model``'s payload, then ``load_weights``'s of its
        saved ``state`` (None: the model as it was made); nothing is kept if either fails."""
        self.create_model(session_id, model_id, model)
        if state is None:
            return
        try:
            self.load(model_id, state)
        except FileNotFoundError as exc:  # the checkpoint was deleted since
            self._drop(model_id)
            raise SessionRequestError(f"model {model_id}: its last saved state {state.path} is gone") from exc
        except BaseException:
            self._drop(model_id)
            raise

    def create_model(self, session_id: str, model_id: str, payload: dict) -> Outcome:
        lora = payload.get("lora")
        spec = None
        if lora:  # Tinker's parts, on unless the SDK's LoraConfig turned one off
            parts = {part: bool(lora.get(f"train_{part}", True)) for part in ("attn", "mlp", "unembed")}
            spec = prim.LoraSpec.of_parts(
                int(lora["rank"]), attention=parts["attn"], mlp=parts["mlp"], unembed=parts["unembed"]
            )
        seed = int(lora.get("seed") or 0) if lora else 0
        path = resolve_model(self.settings.models_dir, payload["base_model"])
        self.trainers[model_id] = prim.TrainingSession.create(path, lora=spec, seed=seed)
        self.owners[model_id], self.bases[model_id] = session_id, path
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

    def save(self, tenant_id: str, model_id: str, payload: dict) -> tuple[Outcome, Saved]:
        """Write a checkpoint under this worker's data directory and upload it; the caller records it, then stamps
        the directory (``worker.sessions``)."""
        trainer = self.trainer(model_id)
        prefix = checkpoint_prefix(tenant_id, model_id, payload["kind"], payload["name"])
        directory = self.files.save_dir(prefix)
        private_dir(directory)
        unstamp(directory)  # stamped once recorded (worker.sessions), so no reader takes a save half written
        if payload["kind"] == "training":
            trainer.save_state(str(directory), optimizer=True)
        else:
            trainer.export_hf(str(directory))
        size = put_dir(self.objects, object_key(prefix, payload["kind"]), directory)
        if payload["kind"] == "sampler":
            self.engines.pushed(self.owners[model_id], self.bases[model_id], str(directory), trainer)
        kind = "save_weights" if payload["kind"] == "training" else "save_weights_for_sampler"
        result = {"type": kind, "path": payload["path"]}
        if payload.get("sampling_session_id"):
            result["sampling_session_id"] = payload["sampling_session_id"]
        return Outcome(result), Saved(payload["kind"], payload["name"], str(directory), prefix, size)

    def load(self, model_id: str, state: SavedState) -> Outcome:
        self.trainer(model_id).load_state(state.directory, optimizer=state.optimizer)
        return Outcome({"type": "load_weights", "path": state.path})

    def sample(self, session_id: str, base: str, weights_dir: str, payloads: list[dict]) -> list[Outcome]:
        """Queued ``asample`` requests of one sampler, in one engine call where their parameters agree; the
        session's engine for ``base`` takes the sampler's weights first if it holds others."""
        calls = [SampleCall.of(payload) for payload in payloads]
        seqs = sum(call.n for call in calls)
        sampler = self.engines.engine(session_id, base, weights_dir, seqs, max(c.params.max_tokens for c in calls))
        results = sample_calls(sampler, calls)
        return [Outcome(r, sampled=sum(len(q["tokens"]) for q in r["sequences"])) for r in results]

    def unload(self, model_id: str) -> Outcome:
        self._drop(model_id)
        return Outcome({"type": "unload_model", "model_id": model_id})

    def release(self, session_id: str) -> None:
        """Free every model of a session (closed, idle or lost)."""
        for model_id in [m for m, owner in self.owners.items() if owner == session_id]:
            self._drop(model_id)
        self.engines.release(session_id)

    def _drop(self, model_id: str) -> None:
        """Free a training model (a sampler id holds nothing of its own: its session's engine stays)."""
        self.owners.pop(model_id, None)
        self.bases.pop(model_id, None)
        held = self.trainers.pop(model_id, None)
        if held is not None:
            held.close()

    def sessions(self) -> set[str]:
        return set(self.owners.values()) | self.engines.sessions()


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
