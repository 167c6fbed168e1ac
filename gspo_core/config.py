"""The one documented configuration of a GSPO run (algorithm + job), validated with field names."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GSPOConfig(BaseModel):
    """Hyperparameters of one GSPO run. Defaults follow Zheng et al. 2025 (GSPO).

    Each optimizer *step* samples ``prompts_per_step`` prompts, ``group_size`` completions each,
    scores them, computes group-normalised advantages, then makes ``mini_batches`` optimizer
    updates over that rollout batch (so later updates are off-policy and the ratio matters), then
    pushes the new weights into the rollout engine.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- rollout ---
    steps: int = Field(20, ge=1, le=1_000_000, description="Rollout+update rounds to run.")
    prompts_per_step: int = Field(8, ge=1, le=4096, description="Prompts sampled per step (B).")
    group_size: int = Field(8, ge=2, le=256, description="Completions per prompt (G).")
    max_new_tokens: int = Field(64, ge=1, le=32768, description="Completion length cap.")
    max_prompt_tokens: int = Field(512, ge=8, le=131072, description="Prompts longer are left-truncated.")
    temperature: float = Field(1.0, gt=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    ignore_eos: bool = Field(False, description="Always generate max_new_tokens (benchmarks).")
    rollout_engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="auto = vLLM when installed, else transformers generate."
    )
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0.0, le=0.95)

    # --- objective ---
    loss: str = Field("gspo", description="Registered loss name: gspo | gspo_token | grpo.")
    advantage: str = Field("group_norm", description="Registered advantage estimator name.")
    scale_rewards: bool = Field(True, description="Divide group-centred rewards by the group std.")
    clip_eps_low: float = Field(3e-4, ge=0.0, le=1.0)
    clip_eps_high: float = Field(4e-4, ge=0.0, le=10.0)
    beta: float = Field(0.0, ge=0.0, le=0.0, description="KL coefficient; GSPO uses none (must be 0).")
    mini_batches: int = Field(4, ge=1, le=1024, description="Optimizer updates per rollout batch.")
    minibatch_order: Literal["length", "group", "random"] = Field(
        "length", description="length = rows of similar length share a mini-batch (less padding; ties keep "
        "a group's rows together, see share_prompts; batch order still random); group = whole groups, in "
        "random order; random = a random split.")
    share_prompts: bool = Field(
        True, description="In the trainer's forwards, run each prompt once for all its rows in a mini-batch "
        "(its KV cache indexed out to them) instead of once per row; same values, fewer FLOPs (the prompt "
        "share of tokens x (G-1)/G). Off with gradient_checkpointing.")
    old_logprobs: Literal["auto", "recompute", "rollout"] = Field(
        "auto", description="Old-policy logprobs. recompute: a trainer forward before the updates. rollout: the "
        "sampler's, unchecked. auto: the sampler's, checked every step against the first update's own on-policy "
        "forward; a step where some sequence's mean logprob differs by more than rollout_logprob_tol recomputes "
        "them before its first optimizer step, and the later steps recompute.")
    rollout_logprob_tol: float = Field(
        1e-5, ge=0.0, le=1.0, description="old_logprobs=auto: the largest accepted |mean over a sequence's "
        "tokens of (trainer - sampler) logprob|, i.e. error in log s_i; 30x under the 3e-4 clip range. Same-"
        "precision (fp32) samplers measure ~1e-7, bf16 ones ~1e-3.")
    logprob_gap_every: int = Field(
        10, ge=0, le=1_000_000, description="With old_logprobs=recompute, ask the sampler for its logprobs on "
        "step 1 and every N steps to report logprob_gap/* (a stale or broken weight push shows there); 0 = never. "
        "Asking slows vLLM sampling.")

    # --- optimisation ---
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0, le=1_000_000)
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.99, ge=0.0, lt=1.0)
    max_grad_norm: float = Field(1.0, gt=0.0, le=1e6)
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="auto = bf16 autocast on GPU, fp32 on CPU.")
    gradient_checkpointing: bool = False
    micro_batch_tokens: int = Field(
        0, ge=0, le=10_000_000, description="Most tokens (prompt + completion) one forward + backward holds: a "
        "mini-batch over it runs as micro-batches whose gradients add up to the same update (gradient "
        "accumulation), so memory, not the number of optimizer updates, is what it trades. 0 = the whole "
        "mini-batch at once.")
    keep_freed_memory: bool = Field(
        True, description="CPU training: from the first step on, keep freed memory in the process's heap (glibc) "
        "instead of unmapping it, so each step's large tensors reuse warm pages instead of page-faulting new "
        "ones (~15 % of a CPU mini-batch); the process's RSS then stays at its high-water mark.")
    cpu_gemm: Literal["auto", "onednn", "blas"] = Field(
        "auto", description="CPU, fp32: the products of the policy's Linear layers and LM head. onednn: "
        "oneDNN (2x torch's default on AMD CPUs with AVX-512, where MKL runs its AVX2 kernels); blas: "
        "torch's default (MKL; ~10 % faster than oneDNN on an Intel Xeon); auto: onednn on AMD, else blas.")

    # --- LoRA (full fine-tuning when lora_rank == 0) ---
    lora_rank: int = Field(0, ge=0, le=1024)
    lora_alpha: float = Field(32.0, gt=0.0, le=4096.0)
    lora_dropout: float = Field(
        0.0, ge=0.0, le=0.0, description="Must be 0: GSPO compares two forwards' log-probs within its clip range "
        "(3e-4), and a random dropout mask makes that ratio noise; the model's own dropout is turned off too.")
    lora_target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    save_merged: bool = Field(True, description="With LoRA, also save a merged full model.")

    # --- bookkeeping ---
    seed: int = Field(0, ge=0, le=2**31 - 1)
    save_every: int = Field(0, ge=0, le=1_000_000, description="Checkpoint every N steps (0 = only at the end).")
    eval_every: int = Field(0, ge=0, le=1_000_000, description="Evaluate on the validation set every N steps.")
    eval_prompts: int = Field(32, ge=1, le=100_000)
    samples_per_step: int = Field(4, ge=0, le=4096, description="Prompts whose rollouts are stored per step.")
    shuffle: bool = True

    @model_validator(mode="after")
    def _check(self) -> "GSPOConfig":
        total = self.prompts_per_step * self.group_size
        if total % self.mini_batches != 0:
            raise ValueError(
                f"mini_batches ({self.mini_batches}) must divide prompts_per_step*group_size ({total})"
            )
        if self.old_logprobs == "rollout" and self.top_p < 1.0:
            # The sampler's log-probs are of the nucleus renormalised, the trainer's of the full softmax:
            # unchecked, every ratio would start below 1 and clip the negative-advantage rows.
            raise ValueError(f"old_logprobs='rollout' needs top_p == 1 (got {self.top_p}): with top-p the "
                             f"sampler's log-probs are of another distribution; use 'auto' or 'recompute'")
        return self


class JobSpec(BaseModel):
    """What one training job is: the same fields for `gspo train job.yaml` and `POST /v1/jobs`.

    ``training_file`` / ``validation_file`` are local JSONL paths here; the service resolves its
    file ids to paths before building a JobSpec.
    """

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., min_length=1, description="HF id or local directory of a causal LM.")
    training_file: str = Field(..., min_length=1)
    validation_file: str | None = None
    reward: dict[str, Any] = Field(..., description="Grader spec (see gspo_core.rewards).")
    hyperparameters: GSPOConfig = Field(default_factory=GSPOConfig)
    output_dir: str = "runs/job"
    name: str | None = None
