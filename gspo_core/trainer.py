"""The GSPO training loop: wires data, policy, rollout engine, rewards and updates to callbacks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gspo_core import gspo_loop, loop
from gspo_core import step as phases
from gspo_core.agents import build_toolbox
from gspo_core.callbacks import Callbacks
from gspo_core.config import JobSpec
from gspo_core.data import DataError, check_row_tools, render_prompt
from gspo_core.distributed import (
    Ranks,
    broadcast,
    join_group,
    lead_writer,
    local_device,
    shard,
)
from gspo_core.environments.verifiers_env import verifiers_spec
from gspo_core.episode_setup import env_runner, episode_settings, job_rows
from gspo_core.loop import TrainResult
from gspo_core.platform import RuntimeOptions, after_startup
from gspo_core.policy import Policy, autocast_dtype, load_policy, sampler_dtype
from gspo_core.primitives.sampling import SamplingSession
from gspo_core.registry import ADVANTAGES, LOSSES
from gspo_core.rewards import DEFAULT_POLICY, GraderPolicy, build_reward
from gspo_core.rollout import RolloutEngine, engine_kind, make_engine
from gspo_core.schedule import batch_indices, make_optimizer, seed_everything  # noqa: F401  (tests read it here)
from gspo_core.sft import SFTTrainer
from gspo_core.stopping import NEVER, StopCheck

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.agents.remote import AgentEndpoint


class Trainer:
    """Owns the run's objects (built, closed); its step and evaluation are `gspo_core.gspo_loop`'s functions over
    them (:meth:`parts`).

    An SPMD program: every rank of the job (torchrun's, or this process alone as a 1-rank group) runs it.
    The policy is sharded over the ranks (FSDP2); rank 0 samples with its engine (through its
    `SamplingSession`, ``sampler``: a given ``engine``, or one built for the job), scores, and hands the
    rollout and rewards to every rank; each rank trains on its share of every mini-batch; rank 0 pushes the
    gathered weights to its engine, reports through the callbacks and writes checkpoints.

    ``runtime``: the operator's options (rollout engine, vLLM memory share); the process owner has already
    applied the process-wide ones (`gspo_core.platform.prepare_process`).
    ``sampler_trusted``: False once a check of the sampler's log-probs failed (``old_logprobs=auto``): the
    later steps recompute them (the config stays as the job gave it).
    """

    def __init__(
        self,
        spec: JobSpec,
        callbacks: Callbacks | None,
        engine: RolloutEngine | None = None,
        grader_policy: GraderPolicy = DEFAULT_POLICY,
        runtime: RuntimeOptions | None = None,
    ) -> None:
        self.spec, self.cfg = spec, spec.hyperparameters
        self.runtime = runtime or RuntimeOptions()
        # A config made without validation (model_copy) may still name an unknown one: fail before any loading.
        LOSSES.get(self.cfg.loss), ADVANTAGES.get(self.cfg.advantage)
        seed_everything(self.cfg.seed)
        self.device = local_device()
        self.ranks: Ranks = join_group(self.device, self.runtime.rank_timeout_s)
        self.callbacks = loop.job_callbacks(self.ranks, callbacks)
        self.writer = lead_writer(self.ranks)  # rank 0 writes the checkpoints' own files
        self.env_runner = env_runner(spec, self.ranks, self.runtime)
        self.rows, self.val_rows = job_rows(spec, self.env_runner, self.ranks)
        # Rank 0 alone scores and runs tools: a grader or a tool runs once per sample whatever the number of ranks.
        self.reward_fn = self.ranks.lead(lambda: build_reward(spec.reward, grader_policy))
        self.toolbox = None
        self.agent_endpoint: AgentEndpoint | None = None
        try:
            self.toolbox = self.ranks.lead(lambda: build_toolbox(spec.tools, grader_policy))
            self.ranks.lead(self._check_row_tools)  # rows naming a tool the job lacks (an MCP server's: known now)
            model, tokenizer = load_policy(spec.model, self.cfg, self.device)
            self.tokenizer: PreTrainedTokenizerBase = tokenizer
            amp = autocast_dtype(self.cfg, self.device)
            self.sharded = shard(model, self.device, amp, self.ranks)
            optimizer, scheduler = make_optimizer(model, self.cfg)
            self.scheduler = scheduler
            self.policy = phases.PolicyState(
                model, optimizer, scheduler, amp, self.tokenizer.pad_token_id, self.sharded, self.ranks
            )
            #: Rank 0's sampling session over its engine (the given one, or one built for the job); None elsewhere.
            self.sampler = self.ranks.lead(lambda: SamplingSession(engine or self._make_engine(), tokenizer))
            # Rank 0's engine, as every rank needs to know it (one collective): whether it samples with the
            # trainer's own (gathered) weights, so nothing is pushed, and else how it is pushed to.
            facts = (self.sampler.engine.shares_weights, self.sampler.engine.push_backend) if self.sampler else None
            self.engine_shares_weights, self.push_backend = broadcast(facts, self.ranks)
            #: Ranks 1..N-1's side of rank 0's pushes, where the transport takes every rank's copy.
            self.peer = self._peer()
            self.agent, self.agent_endpoint = episode_settings(
                spec, tokenizer, self.ranks, self.toolbox, self.env_runner, grader_policy, self.runtime
            )
        except BaseException:
            self.close_graders()  # its grader threads/processes must not outlive a failed start
            raise
        after_startup()  # what loading freed is not kept (vLLM's start-up: ~0.2 GB on a 135M model, docs/bench.md)
        self.step = 0
        self.sampler_trusted = True
        #: What ends the step in flight early (rank 0's; `begin_step` renews it).
        self.stop: StopCheck = NEVER
        self.saved: tuple[int, str] | None = None  # (step, dir) of the newest checkpoint

    def _peer(self) -> SamplingSession | None:
        """On the ranks with no engine (1..N-1), where the transport takes every rank's copy of the weights (CUDA
        IPC): a session over their side of rank 0's pushes (`PeerEngine`), which pushes as rank 0's does.
        Elsewhere rank 0 sends what was gathered to it, and the other ranks have no part beyond the gather."""
        if self.sampler is not None or not self.push_backend:
            return None
        from gspo_core.rollout.weight_push import PeerEngine, every_rank_sends

        if not every_rank_sends(self.push_backend):
            return None
        return SamplingSession(PeerEngine(self.push_backend, self.ranks.rank, self.ranks.world), self.tokenizer)

    def _check_row_tools(self) -> None:
        names = set(self.toolbox.tools) if self.toolbox else set()
        for what, rows in (("training_file", self.rows), ("validation_file", self.val_rows)):
            try:
                check_row_tools(enumerate(rows, 1), names)
            except DataError as exc:
                raise DataError(None, exc.field, f"{what}: row {exc.line}: {exc.message}") from None

    @property
    def model(self) -> Policy:
        return self.policy.model

    def _make_engine(self) -> RolloutEngine:
        kind, cfg = engine_kind(self.runtime.rollout_engine), self.cfg
        # Only vLLM sizes anything by these; the transformers engine is spared the scan of the data.
        max_model_len, max_num_seqs = (
            self.sampling_bounds() if kind == "vllm" else (cfg.max_prompt_tokens + cfg.max_new_tokens, None)
        )
        return make_engine(
            kind,
            model_dir=self.spec.model,
            policy=self.model,
            tokenizer=self.tokenizer,
            seed=cfg.seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=self.runtime.vllm_gpu_memory_utilization,
            dtype=sampler_dtype(self.policy.amp),
            plain_sampling=cfg.temperature == 1.0 and cfg.top_p == 1.0,
            max_new_tokens=cfg.max_new_tokens,
            # Every device of the job serves rollouts: vLLM's tensor parallelism over them (docs/scaling.md).
            tensor_parallel_size=self.ranks.world,
        )

    def sampling_bounds(self) -> tuple[int, int]:
        """``(max_model_len, max_num_seqs)`` of this job's sampling: its longest prompt (as sampled:
        truncated to ``max_prompt_tokens``) + ``max_new_tokens``, and the most sequences one call asks
        for (a step's B x G, or an evaluation's prompts). vLLM on CPU sizes its KV cache to them."""
        cfg = self.cfg
        evals = self.val_rows[: cfg.eval_prompts]  # evaluated before and after training, eval_every or not
        rows = self.rows + evals
        agent = any(tool.get("type") == "agent" for tool in self.spec.tools)
        env_type = (self.spec.environment or {}).get("type")
        agent = agent or env_type == "openenv" or verifiers_spec(self.spec.environment) is not None
        longest = cfg.max_prompt_tokens if agent else 1  # an agent's (a server's) prompts are its own: the bound
        # One batched tokenizer call per chunk (memory stays bounded): about what the job's first epoch
        # spends tokenizing them anyway.
        for i in range(0, len(rows), 4096):
            if longest >= cfg.max_prompt_tokens:
                break
            prompts = [render_prompt(row, self.tokenizer, self.tool_schemas) for row in rows[i : i + 4096]]
            longest = max(longest, *map(len, phases.prompt_token_ids(self.tokenizer, prompts, cfg.max_prompt_tokens)))
        return longest + cfg.max_new_tokens, max(cfg.prompts_per_step * cfg.group_size, len(evals))

    def resume(self, ckpt_dir: str) -> None:
        """The job's state from a checkpoint (`gspo_core.loop.resume`), its weights pushed to the engine."""
        loop.resume(self, ckpt_dir)
        self.push_weights()
        loop.resumed(self, ckpt_dir)

    def parts(self) -> gspo_loop.GSPORun:
        """What this rank's step runs against now (its sampler's engine as it is: a test may wrap it after start)."""
        return gspo_loop.GSPORun(
            cfg=self.cfg,
            policy=self.policy,
            sharded=self.sharded,
            tokenizer=self.tokenizer,
            sampler=self.sampler,
            reward_fn=self.reward_fn,
            agent=self.agent,
            tool_schemas=self.tool_schemas,
            engine_shares_weights=self.engine_shares_weights,
            push_backend=self.push_backend,
            push_to=self.sampler or self.peer,
            stop=self.stop,
        )

    def push_weights(self) -> None:
        """The current weights into rank 0's sampler (`gspo_core.gspo_loop.push_weights`)."""
        gspo_loop.push_weights(self.parts())

    def begin_step(self) -> bool:
        """Whether the run goes on (rank 0's callbacks decide for every rank); if so, the step about to run
        gets its stop check: the callbacks' deadline and their ``should_stop``, asked while rank 0's part of
        it waits (`gspo_core.gspo_loop.shared` hands its stop to every rank)."""
        if self.should_stop():
            return False
        self.stop = StopCheck(self.callbacks.should_stop, self.callbacks.deadline())
        return True

    def run_step(self, step: int) -> tuple[dict, list[dict]]:
        """One GSPO step (`gspo_core.gspo_loop.gspo_step`); a failed check of the sampler's log-probs is kept
        as the job's decision for the later steps."""
        outcome = gspo_loop.gspo_step(self.parts(), self.rows, step, self.sampler_trusted)
        if outcome.sampler_rejected_err is not None:
            self._stop_trusting_sampler(outcome.sampler_rejected_err)
        return outcome.metrics, outcome.samples

    def _stop_trusting_sampler(self, err: float) -> None:
        """``old_logprobs=auto`` failed its check (the sampler does not compute in the trainer's
        precision, e.g. bf16 vLLM): the later steps recompute old logprobs up front."""
        self.sampler_trusted = False
        loop.log(
            self,
            f"old_logprobs=auto: the sampler's logprobs are off by up to {err:.2e} in a sequence's "
            f"log-ratio (tolerance {self.cfg.sampler_tolerance():.0e}); recomputing them from now on",
        )

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation (`gspo_core.gspo_loop.evaluate`)."""
        return gspo_loop.evaluate(self.parts(), self.val_rows)

    @property
    def tool_schemas(self) -> list[dict] | None:
        """The job's tools as the chat template's ``tools=`` (None: no tools)."""
        return self.toolbox.schemas if self.toolbox else None

    def should_stop(self) -> bool:
        """Rank 0's callbacks decide for every rank (the others' do nothing: their answer is not sent)."""
        return broadcast(self.callbacks.should_stop(), self.ranks)

    def close_graders(self) -> None:
        """Stop the graders' and the tools' threads and processes."""
        if self.reward_fn is not None:
            self.reward_fn.close()
        if self.toolbox is not None:
            self.toolbox.close()
        if self.agent_endpoint is not None:
            self.agent_endpoint.close()
            self.agent_endpoint = None
        if self.env_runner is not None:  # closed with its endpoint, or alone when the endpoint never opened
            self.env_runner.close()

    def close(self, engine: bool = True) -> None:
        self.close_graders()
        if engine and self.sampler is not None:
            self.sampler.close()
        if self.peer is not None:
            self.peer.close()


def train(
    spec: JobSpec,
    callbacks: Callbacks | None = None,
    *,
    resume_from: str | None = None,
    engine: RolloutEngine | None = None,
    grader_policy: GraderPolicy = DEFAULT_POLICY,
    runtime: RuntimeOptions | None = None,
) -> TrainResult:
    """Run (or resume) a GSPO job (a supervised one: `gspo_core.sft`) to its last step or until
    ``callbacks.should_stop()``; the job's graders obey the operator's ``grader_policy``, and its engine the
    operator's ``runtime`` options (the process owner calls `gspo_core.platform.prepare_process` with them first)."""
    trainer: Trainer | SFTTrainer
    if spec.hyperparameters.method == "supervised":
        trainer = SFTTrainer(spec, callbacks, runtime)
    else:
        trainer = Trainer(spec, callbacks, engine, grader_policy, runtime)
    try:
        if resume_from:
            trainer.resume(resume_from)
        return loop.run(trainer)
    finally:
        trainer.close(engine=engine is None)
