"""Supervised fine-tuning on chat rows: exact assistant-turn token masks, and a trainer on the GSPO loop's rails."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from gspo_core import step as phases
from gspo_core.callbacks import Callbacks
from gspo_core.config import JobSpec
from gspo_core.data import DataError, check_sft_row, spec_rows
from gspo_core.distributed import join_group, local_device
from gspo_core.packing import pack
from gspo_core.platform import RuntimeOptions
from gspo_core.policy import autocast_dtype, completion_logprobs, load_policy
from gspo_core.trainer import Trainer, batch_indices, make_optimizer, seed_everything

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], prompt: bool) -> str:
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        tokenize=False,
        add_generation_prompt=prompt,
    )
    return cast(str, text)  # tokenize=False: the rendered text


def chat_pieces(messages: list[dict], tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, int]]:
    """The rendered conversation as ``(text, weight)`` pieces: each assistant message's own text (weight 1,
    or its ``weight``) between the template's other text (weight 0). An assistant piece is what rendering
    the conversation up to it adds to the rendering up to its generation prompt, so the mask is exactly the
    tokens the model generates there (its end-of-turn token included). Refuses a template that does not
    render a conversation prefix by prefix (then no exact mask exists)."""
    pieces: list[tuple[str, int]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, upto = _render(tokenizer, messages[:i], True), _render(tokenizer, messages[: i + 1], False)
        if not (prompt.startswith(done) and upto.startswith(prompt)):
            raise DataError(
                None, f"messages[{i}]", "the chat template does not render this conversation prefix by prefix"
            )
        pieces += [(prompt[len(done) :], 0), (upto[len(prompt) :], int(message.get("weight", 1)))]
        done = upto
    whole = _render(tokenizer, messages, False)
    if not whole.startswith(done):
        raise DataError(None, "messages", "the chat template does not render this conversation prefix by prefix")
    return [*pieces, (whole[len(done) :], 0)]


def encode_chat(
    messages: list[dict], tokenizer: PreTrainedTokenizerBase, max_tokens: int
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation (each piece tokenized on its own, so no token straddles a mask boundary)
    and each token's loss weight; cut to ``max_tokens``."""
    ids: list[int] = []
    weights: list[int] = []
    for text, weight in chat_pieces(messages, tokenizer):
        if text:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            weights += [weight] * len(piece)
    return ids[:max_tokens], weights[:max_tokens]


@dataclass(frozen=True)
class Example:
    ids: list[int]
    weights: list[int]


def micro_batches(examples: list[Example], budget: int) -> Iterator[list[Example]]:
    """Consecutive examples of at most ``budget`` tokens each (one example alone when longer; 0: all)."""
    batch: list[Example] = []
    for example in examples:
        if batch and budget and sum(len(e.ids) for e in batch) + len(example.ids) > budget:
            yield batch
            batch = []
        batch.append(example)
    if batch:
        yield batch


class SFTTrainer(Trainer):
    """Supervised fine-tuning through the GSPO trainer's loop, checkpoints and resume (`gspo_core.trainer._loop`):
    its own set-up (no rollout engine, no reward), step and evaluation. A step is one optimizer update on
    ``prompts_per_step`` rows: the mean negative log-likelihood over their trained tokens."""

    def __init__(self, spec: JobSpec, callbacks: Callbacks | None, runtime: RuntimeOptions | None = None) -> None:
        self.spec, self.cfg = spec, spec.hyperparameters
        self.runtime = runtime or RuntimeOptions()
        self.callbacks = callbacks or Callbacks()
        seed_everything(self.cfg.seed)
        self.device = local_device()
        self.ranks = join_group(self.device)
        if self.ranks.world > 1:
            raise ValueError("supervised jobs run on one device (resources.devices 1)")
        self.rows, self.val_rows = spec_rows(spec)
        for line, row in enumerate([*self.rows, *self.val_rows], 1):
            check_sft_row(row, line)
        model, self.tokenizer = load_policy(spec.model, self.cfg, self.device)
        # One update per step: the LR schedule counts steps, not GSPO's mini-batches.
        optimizer, scheduler = make_optimizer(model, self.cfg.model_copy(update={"mini_batches": 1}))
        amp = autocast_dtype(self.cfg, self.device)
        self.policy = phases.PolicyState(
            model, optimizer, scheduler, amp, self.tokenizer.pad_token_id, None, self.ranks
        )
        self.reward_fn, self.toolbox, self.engine, self.engine_shares_weights = None, None, None, True
        self.step = 0
        self.sampler_trusted = True
        self.saved: tuple[int, str] | None = None

    def push_weights(self) -> None:
        """No sampler holds a copy of the weights."""

    def close(self, engine: bool = True) -> None:
        """Nothing outlives the run."""

    def example(self, row: dict) -> Example:
        ids, weights = encode_chat(
            row["messages"], self.tokenizer, self.cfg.max_prompt_tokens + self.cfg.max_new_tokens
        )
        return Example(ids, weights)

    def _nll(self, batch: list[Example]) -> torch.Tensor:
        """Summed negative log-likelihood of the batch's weighted tokens (token t predicted from tokens < t)."""
        packed = pack([e.ids[:1] for e in batch], [e.ids[1:] for e in batch], self.policy.pad_id)
        weight_BT = torch.zeros_like(packed.mask_BT)
        for row, e in enumerate(batch):
            weight_BT[row, : len(e.weights) - 1] = torch.tensor(e.weights[1:], dtype=weight_BT.dtype)
        packed.mask_BT = weight_BT
        logp_BT = completion_logprobs(self.model, packed.to(self.policy.device), 1.0, self.policy.amp)
        return -logp_BT.sum()

    def run_step(self, step: int) -> tuple[dict, list[dict]]:
        cfg, policy, start = self.cfg, self.policy, time.perf_counter()
        rows = [self.rows[i] for i in batch_indices(len(self.rows), step, cfg.prompts_per_step, cfg.seed, cfg.shuffle)]
        examples = [self.example(row) for row in rows]
        trained = max(1, sum(sum(e.weights[1:]) for e in examples))
        policy.optimizer.zero_grad(set_to_none=True)
        nll = 0.0
        for batch in micro_batches(examples, cfg.micro_batch_tokens):
            loss = self._nll(batch) / trained  # micro-batches add up to the step's token mean
            loss.backward()
            nll += float(loss.detach())
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        lr = policy.optimizer.param_groups[0]["lr"]
        policy.optimizer.step()
        policy.scheduler.step()
        tokens = sum(len(e.ids) for e in examples)
        elapsed = time.perf_counter() - start
        metrics = {
            "loss": nll,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "time/step": elapsed,
            "step": float(step),
            "total_steps": float(cfg.steps),
            "tokens/sampled": 0.0,
            "tokens/trained": float(tokens),
            "throughput/tokens_per_s": tokens / max(elapsed, 1e-9),
        }
        return metrics, []

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss per trained token over the first ``eval_prompts`` validation rows."""
        examples = [self.example(row) for row in self.val_rows[: self.cfg.eval_prompts]]
        trained = max(1, sum(sum(e.weights[1:]) for e in examples))
        nll = sum(float(self._nll(batch)) for batch in micro_batches(examples, self.cfg.micro_batch_tokens))
        return {"eval/loss": nll / trained}
