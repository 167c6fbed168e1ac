"""What a GSPO job's episodes run against: its verifiers environment's runner and rows, the per-job chat
endpoint (a verifiers environment's or a user's agent), and the `EpisodeSettings` the rollouts use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gspo_core.agents import pick_format
from gspo_core.agents.episodes import EpisodeSettings
from gspo_core.agents.tools import Toolbox, agent_spec
from gspo_core.config import JobSpec
from gspo_core.data import spec_rows
from gspo_core.distributed import Ranks, broadcast
from gspo_core.environments import episode_environment
from gspo_core.environments.verifiers_env import verifiers_spec
from gspo_core.platform import RuntimeOptions
from gspo_core.rewards import GraderPolicy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo_core.agents.remote import AgentEndpoint
    from gspo_core.environments.verifiers_episodes import VerifiersRunner


def env_runner(spec: JobSpec, ranks: Ranks, runtime: RuntimeOptions) -> VerifiersRunner | None:
    """Rank 0's runner of the job's verifiers environment (None for any other job)."""
    env = verifiers_spec(spec.environment)
    if env is None:
        return None
    from gspo_core.environments.verifiers_episodes import VerifiersRunner

    return ranks.lead(lambda: VerifiersRunner(env, runtime))


def job_rows(spec: JobSpec, runner: VerifiersRunner | None, ranks: Ranks) -> tuple[list[dict], list[dict]]:
    """The job's ``(training rows, validation rows)``: a verifiers environment's from its runner (rank 0's,
    to every rank; the runner is closed if that fails), else its files' or its environment's
    (`gspo_core.data.spec_rows`)."""
    if verifiers_spec(spec.environment) is None:
        return spec_rows(spec)
    try:
        return broadcast(runner.rows() if runner is not None else None, ranks)
    except BaseException:
        if runner is not None:
            runner.close()
        raise


def episode_settings(
    spec: JobSpec,
    tokenizer: PreTrainedTokenizerBase,
    ranks: Ranks,
    toolbox: Toolbox | None,
    runner: VerifiersRunner | None,
    grader_policy: GraderPolicy,
    runtime: RuntimeOptions,
) -> tuple[EpisodeSettings, AgentEndpoint | None]:
    """How the job's episodes run, and the chat endpoint they are played against (rank 0's; None: none). An
    environment whose episodes run in it (an OpenEnv server) is the rollouts' environment, its max_turns the
    episodes' bound. The endpoint is closed if what follows its start fails."""
    cfg = spec.hyperparameters
    parser = pick_format(cfg.tool_format, tokenizer)
    agent = ranks.lead(lambda: agent_spec(spec.tools, grader_policy))
    endpoint_args = (
        grader_policy,
        parser,
        cfg.max_prompt_tokens,
        runtime.agent_endpoint_host,
        runtime.agent_endpoint_port,
        runtime.agent_endpoint_url,
    )
    endpoint: AgentEndpoint | None = None
    if runner is not None:  # a verifiers environment plays the episodes against the endpoint
        from gspo_core.environments.verifiers_episodes import VerifiersEndpoint

        endpoint = VerifiersEndpoint(runner, *endpoint_args)
    try:
        if agent is not None:
            from gspo_core.agents.remote import AgentEndpoint

            endpoint = AgentEndpoint(agent, *endpoint_args)
        episodes = episode_environment(spec.environment, grader_policy, cfg.max_prompt_tokens, spec.tools)
    except BaseException:
        if endpoint is not None:
            endpoint.close()
        raise
    settings = EpisodeSettings(
        episodes.env.max_turns if episodes else cfg.max_turns,
        cfg.max_turn_tokens,
        parser,
        toolbox,
        ranks.lead(lambda: episodes) or endpoint,
    )
    return settings, endpoint
