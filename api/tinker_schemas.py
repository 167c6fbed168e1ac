"""Request bodies of the Tinker-compatible routes, as the `tinker` SDK 0.38 sends them (unknown fields ignored)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: Bounds of the SDK's counters and seeds: far above what a session reaches, below what overflows a BIGINT.
SEQ_MAX = 2**53
SEED_MAX = 2**63 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(_Body):
    tags: list[str] = Field(default_factory=list, max_length=64)
    sdk_version: str = ""


class SessionRef(_Body):
    session_id: str = Field(max_length=64)


class FinishReason(_Body):
    type: Literal["success", "errored", "interrupted"]


class FinishSession(_Body):
    """`ServiceClient.close` (and leaving its `with` block): how the client's work on the session ended."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"reason": {"type": "success"}, "detail": "training complete"}]}
    )

    reason: FinishReason
    detail: str | None = Field(None, max_length=1000)


class LoraConfig(_Body):
    rank: int = Field(ge=1, le=512)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(_Body):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"session_id": "ses_1", "model_seq_id": 0, "base_model": "toy", "lora_config": {"rank": 8, "seed": 0}}
            ]
        }
    )

    session_id: str = Field(max_length=64)
    model_seq_id: int = Field(0, ge=0, le=SEQ_MAX)
    base_model: str = Field(min_length=1, max_length=512)
    lora_config: LoraConfig | None = None


class ModelRef(_Body):
    model_id: str = Field(max_length=64)


class AdamParams(_Body):
    learning_rate: float = Field(1e-4, ge=0, le=1)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    grad_clip_norm: float = Field(0.0, ge=0, le=1e6)


class OptimStep(_Body):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model_id": "ses_1:train:0", "adam_params": {"learning_rate": 1e-4}, "seq_id": 1}]
        }
    )

    model_id: str = Field(max_length=64)
    adam_params: AdamParams = Field(default_factory=AdamParams)
    seq_id: int | None = Field(None, ge=0, le=SEQ_MAX)


class SaveWeights(_Body):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model_id": "ses_1:train:0", "path": "step-1", "seq_id": 2, "sampling_session_seq_id": 0}]
        }
    )

    model_id: str = Field(max_length=64)
    path: str | None = Field(None, max_length=100)
    seq_id: int | None = Field(None, ge=0, le=SEQ_MAX)
    sampling_session_seq_id: int | None = Field(None, ge=0, le=SEQ_MAX)


class LoadWeights(_Body):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model_id": "ses_1:train:0",
                    "path": "tinker://ses_1:train:0/weights/step-1",
                    "seq_id": 3,
                    "model_seq_id": 0,
                }
            ]
        }
    )

    model_id: str | None = Field(None, max_length=64)
    path: str = Field(max_length=400)
    optimizer: bool = False
    seq_id: int | None = Field(None, ge=0, le=SEQ_MAX)
    session_id: str | None = Field(None, max_length=64)
    model_seq_id: int | None = Field(None, ge=0, le=SEQ_MAX)
    base_model: str | None = Field(None, max_length=512)


class CreateSamplingSession(_Body):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"session_id": "ses_1", "sampling_session_seq_id": 0, "base_model": "toy"}]}
    )

    session_id: str = Field(max_length=64)
    sampling_session_seq_id: int = Field(0, ge=0, le=SEQ_MAX)
    base_model: str | None = Field(None, max_length=512)
    model_path: str | None = Field(None, max_length=400)


class SamplingParams(_Body):
    max_tokens: int | None = Field(None, ge=1, le=32768)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    # Stop strings and/or token ids (the SDK sends one string or either list; one string is read as a list).
    stop: list[str | Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(None, max_length=64)
    temperature: float = Field(1.0, ge=0, le=10)
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    top_p: float = Field(1.0, gt=0, le=1)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class Sample(_Body):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "num_samples": 1,
                    "prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
                    "sampling_params": {"max_tokens": 8, "seed": 0, "stop": [2], "top_k": -1},
                    "sampling_session_id": "ses_1:sample:0",
                    "seq_id": 4,
                }
            ]
        }
    )

    num_samples: int = Field(1, ge=1, le=256)
    prompt: dict[str, Any]
    sampling_params: SamplingParams
    sampling_session_id: str | None = Field(None, max_length=64)
    base_model: str | None = None
    model_path: str | None = None
    seq_id: int | None = Field(None, ge=0, le=SEQ_MAX)
    prompt_logprobs: bool | None = None


class RetrieveFuture(_Body):
    request_id: str = Field(max_length=64)
    allow_metadata_only: bool = False
