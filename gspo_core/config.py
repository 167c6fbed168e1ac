"""The one documented configuration of a GSPO run (algorithm + job), validated with field names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

#: Losses and advantage estimators a job may name: those registered in gspo_core.losses and
#: gspo_core.advantages (tests/core/test_losses.py checks the two lists agree). Named here, not looked up
#: in the registries, so validating a job needs no torch (the API validates jobs too).
LossName = Literal["gspo", "gspo_token", "grpo"]
AdvantageName = Literal["group_norm"]

#: Keys earlier versions stored in a job's hyperparameters that are no longer the tenant's: the operator's
#: settings (rollout engine, vLLM memory share, heap policy, CPU GEMM library) and fields that could take
#: only one value or were read nowhere (beta, lora_dropout, save_merged). `GSPOConfig.from_stored` drops them.
RETIRED_FIELDS = frozenset(
    {
        "rollout_engine",
        "vllm_gpu_memory_utilization",
        "keep_freed_memory",
        "cpu_gemm",
        "beta",
        "lora_dropout",
        "save_merged",
    }
)


#: The most `GSPOConfig.sampler_tolerance` defaults to, whatever the clip range: a sampler off by more
#: (bf16's ~1e-3) is another policy's numbers, not rounding.
MAX_DEFAULT_SAMPLER_TOL = 1e-4


class GSPOConfig(BaseModel):
    """Hyperparameters of one GSPO run. Defaults follow Zheng et al. 2025 (GSPO).

    Each optimizer *step* samples ``prompts_per_step`` prompts, ``group_size`` completions each,
    scores them, computes group-normalised advantages, then makes ``mini_batches`` optimizer
    updates over that rollout batch (so later updates are off-policy and the ratio matters), then
    pushes the new weights into the rollout engine.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # --- method ---
    method: Literal["gspo", "supervised"] = Field(
        default="gspo",
        description="gspo: reinforcement learning with the GSPO loop (sampling, rewards, updates). supervised: "
        "next-token loss on the assistant turns of `messages` rows (a message's `weight` 0 leaves it out); "
        "each step is one optimizer update over prompts_per_step rows; no sampling, no reward, and the "
        "rollout, objective and LoRA-free sampling fields are not used (gspo_core/sft.py).",
    )

    # --- rollout ---
    steps: int = Field(default=20, ge=1, le=1_000_000, description="Rollout+update rounds to run.")
    prompts_per_step: int = Field(default=8, ge=1, le=4096, description="Prompts sampled per step (P).")
    group_size: int = Field(default=8, ge=2, le=256, description="Completions per prompt (G).")
    max_new_tokens: int = Field(default=64, ge=1, le=32768, description="Completion length cap.")
    max_prompt_tokens: int = Field(default=512, ge=8, le=131072, description="Prompts longer are left-truncated.")
    temperature: float = Field(
        default=1.0,
        gt=0.0,
        le=5.0,
        description="Sampling temperature; the loss scores the same log_softmax(logits / temperature).",
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (1 = the full distribution).")
    ignore_eos: bool = Field(default=False, description="Always generate max_new_tokens (benchmarks).")
    max_turns: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Model turns of an episode: with tools, a turn that ends with tool calls is followed by "
        "their results and another turn, up to this many. max_new_tokens bounds all turns and tool results "
        "together.",
    )
    max_turn_tokens: int = Field(
        default=0, ge=0, le=32768, description="Most tokens one turn samples (0 = only the max_new_tokens total)."
    )
    tool_format: Literal["auto", "hermes", "toy"] = Field(
        default="auto",
        description="How tool calls are parsed from a turn: hermes = <tool_call>{json}</tool_call> (Qwen, "
        "Hermes); toy = {name:value} (the toy model); auto = hermes where the chat template speaks of <tool_call>.",
    )

    response_format: dict[str, Any] | None = Field(
        default=None,
        description="OpenAI's response_format, {'type': 'json_schema', 'json_schema': {'name', 'schema', "
        "'strict'}}: the schema the answer is expected to follow. Graders read the answer parsed as "
        "sample.output_json (for every job); decoding is not constrained, because the sampler's log-probs must "
        "be the policy's own: a json_schema grader with this schema is how the policy learns it.",
    )

    # --- objective ---
    loss: LossName = Field(
        default="gspo",
        description="gspo: sequence-level ratio and clip (GSPO); gspo_token: GSPO with "
        "per-token advantages allowed; grpo: token-level ratio and clip (baseline).",
    )
    advantage: AdvantageName = Field(
        default="group_norm",
        description="group_norm: each reward minus its group's mean, divided by the group's std when scale_rewards.",
    )
    scale_rewards: bool = Field(default=True, description="Divide group-centred rewards by the group std.")
    clip_eps_low: float = Field(default=3e-4, ge=0.0, le=1.0, description="Clip range below 1 of the importance ratio.")
    clip_eps_high: float = Field(
        default=4e-4, ge=0.0, le=10.0, description="Clip range above 1 of the importance ratio."
    )
    mini_batches: int = Field(default=4, ge=1, le=1024, description="Optimizer updates per rollout batch.")
    minibatch_order: Literal["length", "group", "random"] = Field(
        default="length",
        description="length = rows of similar length share a mini-batch (less padding; ties keep "
        "a group's rows together, see share_prompts; batch order still random); group = whole groups, in "
        "random order; random = a random split.",
    )
    share_prompts: bool = Field(
        default=True,
        description="In the trainer's forwards, run each prompt once for all its rows in a mini-batch "
        "(its KV cache indexed out to them) instead of once per row; same values, fewer FLOPs (the prompt "
        "share of tokens x (G-1)/G). Off with gradient_checkpointing.",
    )
    old_logprobs: Literal["auto", "recompute", "rollout"] = Field(
        default="auto",
        description="Old-policy logprobs. recompute: a trainer forward before the updates. rollout: the "
        "sampler's, unchecked. auto: the sampler's, checked every step against the first update's own on-policy "
        "forward; a step where some sequence's mean logprob differs by more than rollout_logprob_tol recomputes "
        "them before its first optimizer step, and the later steps recompute.",
    )
    rollout_logprob_tol: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="old_logprobs=auto: the largest accepted |mean over a sequence's tokens of (trainer - "
        "sampler) logprob|, i.e. error in log s_i. Default (null): a tenth of the smaller clip range, at most "
        "1e-4 (3e-5 at GSPO's 3e-4): such an error moves a sequence's ratio by 1/10 of the clip range at most. "
        "fp32 samplers measure 1e-7 (toy) to 1.2e-5 (49k vocabulary), bf16 ones ~1e-3 (docs/algorithm.md).",
    )
    logprob_gap_every: int = Field(
        default=10,
        ge=0,
        le=1_000_000,
        description="With old_logprobs=recompute, ask the sampler for its logprobs on "
        "step 1 and every N steps to report logprob_gap/* (a stale or broken weight push shows there); 0 = never. "
        "Asking slows vLLM sampling.",
    )

    # --- optimisation ---
    learning_rate: float = Field(default=1e-5, gt=0.0, le=1.0, description="AdamW's peak learning rate.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        default="constant", description="After warmup: constant, or a cosine decay to 0 over the remaining updates."
    )
    warmup_steps: int = Field(
        default=0, ge=0, le=1_000_000, description="Steps of linear warmup (each of mini_batches updates)."
    )
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0, description="AdamW's decoupled weight decay.")
    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0, description="AdamW's first-moment decay.")
    adam_beta2: float = Field(default=0.99, ge=0.0, lt=1.0, description="AdamW's second-moment decay.")
    max_grad_norm: float = Field(default=1.0, gt=0.0, le=1e6, description="Gradients are clipped to this global norm.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto", description="auto = bf16 autocast on GPU, fp32 on CPU."
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward: less memory, more time."
    )
    # Unset: 1,024 tokens on CPU, where a real vocabulary's (49k, SmolLM2) logits over every row of mini-batch 0
    # set the job's peak memory; 16,384 on a GPU, where forwards of a row or two leave it idle (ten times slower
    # on an H200; docs/algorithm.md, Real models, and docs/bench.md, GPU).
    micro_batch_tokens: int | None = Field(
        default=None,
        ge=0,
        le=10_000_000,
        description="Most tokens (prompt + completion) one forward + backward holds: a "
        "mini-batch over it runs as micro-batches whose gradients add up to the same update (gradient "
        "accumulation), so memory, not the number of optimizer updates, is what it trades. 0 = the whole "
        "mini-batch at once; a row longer than the budget runs alone. Unset: 1,024 on CPU, 16,384 on GPU.",
    )

    # --- LoRA (full fine-tuning when lora_rank == 0) ---
    lora_rank: int = Field(default=0, ge=0, le=1024, description="LoRA rank; 0 = full fine-tuning.")
    lora_alpha: float = Field(
        default=32.0, gt=0.0, le=4096.0, description="LoRA scaling numerator (scale = alpha / rank)."
    )
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        max_length=64,
        description="Module names LoRA adapts. No LoRA dropout: GSPO compares two forwards' log-probs within "
        "its clip range, and a random mask would make that ratio noise (the model's own dropout is off too). "
        "Checkpoints hold the adapter and the merged full model.",
    )

    # --- bookkeeping ---
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Seeds data order, sampling and mini-batch splits.")
    save_every: int = Field(
        default=0, ge=0, le=1_000_000, description="Checkpoint every N steps (0 = only at the end)."
    )
    keep_best_checkpoints: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="Checkpoint retention (the service's): besides the newest checkpoint, keep the k best by "
        "validation (eval/reward/mean; eval/loss for supervised), newest first where there is none; the "
        "others are deleted as newer ones arrive.",
    )
    eval_every: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="Evaluate on the validation set every N steps (0: only before the first step and after the last, "
        "which every job with a validation set gets).",
    )
    eval_prompts: int = Field(
        default=32,
        ge=1,
        le=100_000,
        description="Validation prompts an evaluation samples (one greedy and one sampled completion each).",
    )
    samples_per_step: int = Field(default=4, ge=0, le=4096, description="Prompts whose rollouts are stored per step.")
    shuffle: bool = Field(default=True, description="Shuffle the training rows each epoch (else file order).")

    @field_validator("*", mode="before")
    @classmethod
    def _strict_kinds(cls, value: Any, info: ValidationInfo) -> Any:
        """A boolean is not a number (``"steps": true`` is not 1), and a switch takes only true or false."""
        kind = cls.model_fields[cast(str, info.field_name)].annotation  # a field validator is always given one
        if kind in (int, float) and isinstance(value, bool):
            raise ValueError(f"expected a number, got {str(value).lower()}")
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value

    @field_validator("response_format")
    @classmethod
    def _json_schema_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None or value.get("type") == "text":
            return None
        spec = value.get("json_schema")
        if value.get("type") != "json_schema" or not isinstance(spec, dict):
            raise ValueError("expected {'type': 'json_schema', 'json_schema': {'name', 'schema'}} or {'type': 'text'}")
        if not isinstance(spec.get("name"), str) or not 0 < len(spec["name"]) <= 64:
            raise ValueError("json_schema.name: a name of 1 to 64 characters")
        if not isinstance(spec.get("schema"), dict):
            raise ValueError("json_schema.schema: a JSON schema object")
        return value

    def sampler_tolerance(self) -> float:
        """``old_logprobs=auto``'s tolerance on the error in ``log s_i`` (`rollout_logprob_tol`, or its default).

        Why the clip range and not the sequence length or the vocabulary: the check already measures the
        sequence's mean over tokens, the very quantity in GSPO's ratio ``s_i = exp(mean log-ratio)``, so an
        error ``d`` there scales ``s_i`` by ``exp(-d)``: the gradient's weight moves by ``d`` (relative) and
        the clip boundaries by ``d`` in log-ratio, a share ``d / clip`` of the clip range. A tenth keeps the
        sampler's log-probs where a fp32 sampler's rounding lies (1.2e-5 at a 49k vocabulary) and turns
        bf16's ~1e-3 to the recompute; the 1e-4 cap keeps that so for GRPO's token-level 0.2.
        """
        if self.rollout_logprob_tol is not None:
            return self.rollout_logprob_tol
        return min(min(self.clip_eps_low, self.clip_eps_high) / 10, MAX_DEFAULT_SAMPLER_TOL)

    @classmethod
    def from_stored(cls, values: Mapping[str, Any]) -> GSPOConfig:
        """A job's stored hyperparameters, less the `RETIRED_FIELDS` an earlier version stored with them."""
        return cls(**{k: v for k, v in values.items() if k not in RETIRED_FIELDS})

    @model_validator(mode="after")
    def _check(self) -> GSPOConfig:
        total = self.prompts_per_step * self.group_size
        if total % self.mini_batches != 0:
            raise ValueError(f"mini_batches ({self.mini_batches}) must divide prompts_per_step*group_size ({total})")
        if self.old_logprobs == "rollout" and self.top_p < 1.0:
            # The sampler's log-probs are of the nucleus renormalised, the trainer's of the full softmax:
            # unchecked, every ratio would start below 1 and clip the negative-advantage rows.
            raise ValueError(
                f"old_logprobs='rollout' needs top_p == 1 (got {self.top_p}): with top-p the "
                f"sampler's log-probs are of another distribution; use 'auto' or 'recompute'"
            )
        return self


class Resources(BaseModel):
    """What a job needs of the machine that runs it: ``devices`` ranks of its SPMD trainer (one per GPU;
    on CPU, one process each). A worker takes only jobs that fit its devices."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    devices: int = Field(default=1, ge=1, le=1024, strict=True, description="Devices (trainer ranks) the job runs on.")


class JobSpec(BaseModel):
    """What one training job is: the same fields for `gspo train job.yaml` and `POST /v1/jobs`.

    ``training_file`` / ``validation_file`` are local JSONL paths here; the service resolves its
    file ids to paths before building a JobSpec.
    """

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., min_length=1, description="HF id or local directory of a causal LM.")
    training_file: str | None = Field(None, min_length=1, description="Required unless `environment` is given.")
    validation_file: str | None = None
    environment: dict[str, Any] | None = Field(
        None,
        description="Where prompts and rewards come from instead of files: {'type': 'reasoning_gym', 'tasks': "
        "[...], 'seed', 'size', 'validation_size'} or {'type': 'openenv', 'url', 'headers', 'max_turns', ...} "
        "(gspo_core.environments, docs/environments.md).",
    )
    reward: dict[str, Any] = Field(..., description="Grader spec (see gspo_core.rewards).")
    tools: list[dict[str, Any]] = Field(
        default_factory=list, max_length=64, description="Tools the model may call (see gspo_core.agents.tools)."
    )
    hyperparameters: GSPOConfig = Field(default_factory=GSPOConfig)
    resources: Resources = Field(default_factory=Resources)
    output_dir: str = "runs/job"
    name: str | None = None

    @model_validator(mode="after")
    def _data_source(self) -> JobSpec:
        """Prompts come from files or from an environment, not both (its held-out split is its validation set)."""
        if self.environment is None and self.training_file is None:
            raise ValueError("training_file: required unless an environment is given")
        if self.environment is not None and (self.training_file or self.validation_file):
            field = "training_file" if self.training_file else "validation_file"
            raise ValueError(f"{field}: give files or an environment, not both (the environment makes its own split)")
        return self
