"""Rollouts with transformers `generate` on the trainer's own policy (the fallback without vLLM)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, cast

import torch

from gspo_core.policy import Policy, base_model
from gspo_core.rollout.base import Completion, SamplingSpec

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedTokenizerBase

#: Sampler precision -> the autocast dtype its forwards run under (None: the weights' own fp32).
AUTOCAST: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}


def top_p_mask(scores_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set the logits outside the nucleus of mass ``top_p`` to -inf (vLLM's and HF's rule: drop the
    smallest tokens whose cumulative probability stays <= 1 - top_p, always keep the largest)."""
    if top_p >= 1.0:
        return scores_BV
    sorted_BV, idx_BV = scores_BV.sort(dim=-1, descending=False)
    cum_BV = sorted_BV.softmax(dim=-1).cumsum(dim=-1)
    drop_BV = cum_BV <= 1 - top_p
    drop_BV[:, -1] = False
    return scores_BV.masked_fill(drop_BV.scatter(1, idx_BV, drop_BV), float("-inf"))


class SampledLogprobs:
    """A logits processor that applies temperature and top-p itself and records, step by step, the
    log-probability of each sampled token under that processed distribution.

    At step t the ids already hold the token sampled at step t-1, so only one ``[B, V]`` tensor of
    log-probs is kept at a time (never ``[B, T, V]``); :meth:`finish` reads the last step's token.
    """

    def __init__(self, temperature: float, top_p: float) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.prev_logp_BV: torch.Tensor | None = None
        self.cols: list[torch.Tensor] = []

    def __call__(self, input_ids_BL: torch.Tensor, scores_BV: torch.Tensor) -> torch.Tensor:
        scores_BV = top_p_mask(scores_BV.float() / self.temperature, self.top_p)
        if self.prev_logp_BV is not None:
            self._take(self.prev_logp_BV, input_ids_BL[:, -1])
        self.prev_logp_BV = scores_BV.log_softmax(dim=-1)
        return scores_BV

    def _take(self, logp_BV: torch.Tensor, token_B: torch.Tensor) -> None:
        self.cols.append(logp_BV.gather(1, token_B.unsqueeze(1)).squeeze(1))

    def finish(self, new_BT: torch.Tensor) -> torch.Tensor:
        """Log-probs ``[B, T]`` of the ``T`` generated tokens ``new_BT``."""
        if len(self.cols) < new_BT.shape[1] and self.prev_logp_BV is not None:
            self._take(self.prev_logp_BV, new_BT[:, -1])
        return torch.stack(self.cols, dim=1)


def _eos_ids(policy: Policy, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation-config EOS."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_eos = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
    ids |= (
        set(config_eos)
        if isinstance(config_eos, (list, tuple))
        else ({config_eos} if config_eos is not None else set())
    )
    return ids


@contextlib.contextmanager
def _clean_generation_config(policy: Policy, eos_ids: list[int] | None, pad_id: int) -> Iterator[None]:
    """Generate under a neutral config: a model's own defaults (repetition penalty, top-k, ...)
    must not change what is sampled, as vLLM ignores them too once sampling params are given."""
    from transformers import GenerationConfig

    base = base_model(policy)
    saved = base.generation_config
    base.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=getattr(saved, "bos_token_id", None)
    )
    try:
        yield
    finally:
        base.generation_config = saved


class TransformersEngine:
    """Samples with the policy module itself, so no second copy of the weights exists.

    ``logprobs[t]`` is ``log_softmax(top_p_mask(logits / T))`` of the sampled token: the distribution
    actually sampled from, the same quantity the vLLM engine returns (``processed_logprobs``). With
    ``top_p == 1`` it equals the trainer's ``log_softmax(logits / T)``.
    ``dtype="bfloat16"`` samples under bf16 autocast, as a bf16 trainer computes (its weights stay fp32).
    """

    name = "transformers"
    shares_weights = True
    push_backend = ""

    def __init__(
        self,
        policy: Policy,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seed: int = 0,
        batch_size: int = 256,
        dtype: str = "float32",
    ) -> None:
        if dtype not in AUTOCAST:
            raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(AUTOCAST)}")
        self.policy, self.tokenizer = policy, tokenizer
        self.amp_dtype = AUTOCAST[dtype]
        self.seed, self.batch_size = seed, batch_size
        self.eos_ids = _eos_ids(policy, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        if any(len(ids) == 0 for ids in prompt_ids):
            raise ValueError("prompt_ids: every prompt needs at least one token")
        device = next(self.policy.parameters()).device
        was_training = self.policy.training
        completions: list[Completion] = []
        # A seeded call must not move the trainer's global RNG (exact resume depends on it).
        fork = torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else [], enabled=sampling.seed is not None
        )
        eos = None if sampling.ignore_eos else sorted(self.eos_ids | set(sampling.stop_token_ids))
        amp = torch.autocast(device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)
        try:
            self.policy.eval()
            with fork, amp, _clean_generation_config(self.policy, eos, self.pad_id):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                indexed = list(enumerate(prompt_ids))
                per_batch = max(1, self.batch_size // sampling.n)  # a prompt's group is never split
                for k in range(0, len(indexed), per_batch):
                    completions += self._generate_batch(indexed[k : k + per_batch], sampling, device)
        finally:
            self.policy.train(was_training)
        grouped: list[list[Completion]] = [[] for _ in prompt_ids]
        for completion in completions:
            grouped[completion.prompt_index].append(completion)
        return grouped

    def _prompt_cache(self, input_PL: torch.Tensor, attn_PL: torch.Tensor, n: int) -> DynamicCache | None:
        """Keys and values of every prompt but its last token, computed once and repeated for its
        ``n`` samples (generate would run each prompt ``n`` times); None when there is nothing to share."""
        if n == 1 or input_PL.size(1) < 2:
            return None
        from transformers import DynamicCache

        base = base_model(self.policy)
        trunk = base.get_decoder()
        # generate's own rule for left-padded rows: positions count real tokens only.
        pos_PL = (attn_PL.cumsum(-1) - 1).clamp(min=0)
        cache = trunk(
            input_ids=input_PL[:, :-1],
            attention_mask=attn_PL[:, :-1],
            position_ids=pos_PL[:, :-1],
            past_key_values=DynamicCache(config=base.config),
            use_cache=True,
        ).past_key_values
        cache.batch_repeat_interleave(n)
        return cache

    @torch.inference_mode()
    def _generate_batch(
        self, batch: list[tuple[int, list[int]]], sampling: SamplingSpec, device: torch.device
    ) -> list[Completion]:
        """``sampling.n`` samples of each ``(index, ids)`` prompt in ``batch``, the prompts prefilled once."""
        width = max(len(ids) for _, ids in batch)
        input_PL = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attn_PL = torch.zeros((len(batch), width), dtype=torch.long)
        for prompt, (_, ids) in enumerate(batch):  # left padding, so every row ends at the same column
            input_PL[prompt, width - len(ids) :] = torch.tensor(ids)
            attn_PL[prompt, width - len(ids) :] = 1
        input_PL, attn_PL = input_PL.to(device), attn_PL.to(device)
        from transformers import LogitsProcessorList

        recorder = SampledLogprobs(sampling.temperature, sampling.top_p)
        # The policy is a causal LM or a PEFT wrapper that forwards to one: either generates, and returns the
        # rows' token ids [prompt | completion] as one tensor (not asked for a dict). Typed here: torch types
        # an unknown module attribute as a tensor or a module.
        generate = cast("Callable[..., torch.Tensor]", self.policy.generate)
        # temperature/top-p/top-k are neutral here: the recorder applies them, once.
        seq_BL = generate(
            input_ids=input_PL.repeat_interleave(sampling.n, 0),
            attention_mask=attn_PL.repeat_interleave(sampling.n, 0),
            past_key_values=self._prompt_cache(input_PL, attn_PL, sampling.n),
            do_sample=not sampling.greedy,  # greedy: the argmax, which temperature and top-p do not move
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=sampling.max_tokens,
            use_cache=True,
            logits_processor=LogitsProcessorList([recorder]),
            # One rank samples alone with the gathered weights of a sharded policy (`gspo_core.distributed`):
            # generate would otherwise wait for the other ranks at every token.
            synced_gpus=False,
        )
        new_BT = seq_BL[:, width:]
        logp_BT = recorder.finish(new_BT).float().cpu() if sampling.logprobs else None
        new_BT = new_BT.cpu()
        rows = [(prompt_index, ids) for prompt_index, ids in batch for _ in range(sampling.n)]
        return [
            self._completion(prompt_index, ids, new_BT[row], None if logp_BT is None else logp_BT[row], sampling)
            for row, (prompt_index, ids) in enumerate(rows)
        ]

    def _completion(
        self,
        prompt_index: int,
        ids: list[int],
        new_T: torch.Tensor,
        logp_T: torch.Tensor | None,
        sampling: SamplingSpec,
    ) -> Completion:
        tokens = new_T.tolist()[: sampling.cap(prompt_index)]  # a batch samples up to its longest cap
        length, finish = len(tokens), "length"
        if not sampling.ignore_eos:
            ends = self.eos_ids | set(sampling.stop_token_ids)
            stop_at = next((i for i, token in enumerate(tokens) if token in ends), None)
            if stop_at is not None:  # keep the EOS token: the policy must learn to stop
                length, finish = stop_at + 1, "stop"
        tokens = tokens[:length]
        text = cast(str, self.tokenizer.decode(tokens, skip_special_tokens=True))  # one sequence: one string
        return Completion(
            prompt_index=prompt_index,
            prompt_ids=list(ids),
            completion_ids=tokens,
            logprobs=logp_T[:length].tolist() if logp_T is not None else [],
            text=text,
            finish_reason=finish,
        )

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to copy: this engine samples with the trainer's live weights (a LoRA policy's
        forward applies its adapter), so the iterable is left unconsumed and makes no tensor."""

    def sleep(self) -> None:
        """No-op: the weights are the trainer's own and no KV cache outlives a call."""

    def wake(self) -> None:
        """No-op (see :meth:`sleep`)."""

    def close(self) -> None:
        """Nothing to release: the policy belongs to the trainer."""
