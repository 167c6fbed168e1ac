"""Rollouts with transformers `generate` on the trainer's own policy (the fallback without vLLM)."""

from __future__ import annotations

from typing import Iterable

import torch

from gspo_core.rollout.base import Completion, SamplingSpec


class TransformersEngine:
    """Samples with the policy module itself, so no second copy of the weights exists.

    Logprobs are those of the temperature-scaled distribution ``log_softmax(logits / T)`` of the
    sampled tokens (the same quantity the trainer computes), read from the generation logits.
    """

    name = "transformers"
    shares_weights = True

    def __init__(self, policy: torch.nn.Module, tokenizer, *, seed: int = 0, batch_size: int = 256) -> None:
        self.policy, self.tokenizer = policy, tokenizer
        self.seed, self.batch_size = seed, batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        flat = [(p, ids) for p, ids in enumerate(prompt_ids) for _ in range(sampling.n)]
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        outs: list[Completion] = []
        was_training = self.policy.training
        self.policy.eval()
        try:
            for k in range(0, len(flat), self.batch_size):
                outs += self._generate_batch(flat[k:k + self.batch_size], sampling, gen)
        finally:
            self.policy.train(was_training)
        grouped: list[list[Completion]] = [[] for _ in prompt_ids]
        for c in outs:
            grouped[c.prompt_index].append(c)
        return grouped

    @torch.inference_mode()
    def _generate_batch(self, batch, sampling: SamplingSpec, gen) -> list[Completion]:
        device = next(self.policy.parameters()).device
        width = max(len(ids) for _, ids in batch)
        input_BP = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attn_BP = torch.zeros((len(batch), width), dtype=torch.long)
        for b, (_, ids) in enumerate(batch):  # left padding, so every row ends at the same column
            input_BP[b, width - len(ids):] = torch.tensor(ids)
            attn_BP[b, width - len(ids):] = 1
        if gen is not None:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        out = self.policy.generate(
            input_ids=input_BP.to(device), attention_mask=attn_BP.to(device), do_sample=True,
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
            max_new_tokens=sampling.max_tokens,
            min_new_tokens=sampling.max_tokens if sampling.ignore_eos else 0,
            eos_token_id=None if sampling.ignore_eos else self.eos_id, pad_token_id=self.pad_id,
            return_dict_in_generate=True, output_logits=True,
        )
        new_BT = out.sequences[:, width:].cpu()
        logits_BTV = torch.stack(out.logits, dim=1).float().cpu() / sampling.temperature
        logp_BT = torch.log_softmax(logits_BTV, -1).gather(-1, new_BT.unsqueeze(-1)).squeeze(-1)
        return [self._completion(p, ids, new_BT[b], logp_BT[b], sampling) for b, (p, ids) in enumerate(batch)]

    def _completion(self, p: int, ids: list[int], new_T, logp_T, sampling: SamplingSpec) -> Completion:
        toks = new_T.tolist()
        n = len(toks)
        finish = "length"
        if not sampling.ignore_eos and self.eos_id in toks:
            n = toks.index(self.eos_id) + 1  # keep EOS: the policy must learn to stop
            finish = "stop"
        toks = toks[:n]
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        return Completion(prompt_index=p, prompt_ids=list(ids), completion_ids=toks,
                          logprobs=logp_T[:n].tolist(), text=text, finish_reason=finish)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to copy: this engine samples with the trainer's live weights."""
        for _ in named_tensors:
            pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass
