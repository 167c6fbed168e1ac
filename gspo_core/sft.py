"""Supervised fine-tuning on chat rows: exact assistant-turn token masks, and a job the loop runs beside GSPO's."""

from __future__ import annotations

import re
import time
import weakref
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from gspo_core import loop
from gspo_core import step as phases
from gspo_core.batching import micro_batch_budget
from gspo_core.callbacks import Callbacks
from gspo_core.config import GSPOConfig, JobSpec
from gspo_core.data import DataError, check_sft_row, spec_rows
from gspo_core.distributed import broadcast, join_group, lead_writer, local_device
from gspo_core.packing import pack
from gspo_core.platform import RuntimeOptions
from gspo_core.policy import Policy, autocast_dtype, completion_logprobs, load_policy, one_tied_gradient
from gspo_core.primitives.core import PolicyState, optimizer_update
from gspo_core.schedule import batch_indices, make_optimizer, seed_everything

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], prompt: bool) -> str:
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        tokenize=False,
        add_generation_prompt=prompt,
    )
    return cast(str, text)  # tokenize=False: the rendered text


def prefix_pieces(messages: list[dict], tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, int]]:
    """The definition of :func:`chat_pieces`, rendering every prefix (time quadratic in the turns): an assistant
    piece is what rendering the conversation up to it adds to the rendering up to its generation prompt.
    Refuses a template that does not render a conversation prefix by prefix (then no exact mask exists)."""
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


#: An assistant message's generated text as the template frames it: ``before`` + content + ``after`` (ChatML:
#: "" and "<|im_end|>\n"), learnt once per tokenizer from a probe conversation by :func:`prefix_pieces`.
_FRAMES: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, tuple[object, tuple[str, str] | None]] = (
    weakref.WeakKeyDictionary()
)
_PROBE = "gspo probe answer"
#: Stand-ins for assistant contents in the one marked render (private-use characters: no template spells them).
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


def _frame(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str] | None:
    template = tokenizer.chat_template  # may be set on a loaded tokenizer: the frame is the template's
    known = _FRAMES.get(tokenizer)
    if known is None or known[0] != template:
        probe = [{"role": "user", "content": "gspo probe question"}, {"role": "assistant", "content": _PROBE}]
        try:
            generated = prefix_pieces(probe, tokenizer)[1][0]
        except Exception:  # a template the probe does not fit: every row takes the prefix renders
            generated = ""
        before, found, after = generated.partition(_PROBE)
        known = _FRAMES[tokenizer] = (template, (before, after) if found else None)
    return known[1]


def _spans(messages: list[dict], tokenizer: PreTrainedTokenizerBase) -> tuple[str, list[tuple[int, int]]] | None:
    """The rendered conversation and each assistant content's ``(start, end)`` in it, from two renders: the
    conversation, and the same with each assistant content replaced by a mark. None unless the template put
    every content in verbatim (the marked render with the contents put back is the real one)."""
    if any(_MARK_OPEN in m["content"] for m in messages):
        return None
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    marked = [
        {**m, "content": f"{_MARK_OPEN}{i}{_MARK_CLOSE}"} if m["role"] == "assistant" else m
        for i, m in enumerate(messages)
    ]
    whole, parts = _render(tokenizer, messages, False), _MARK.split(_render(tokenizer, marked, False))
    if [int(i) for i in parts[1::2]] != assistants:
        return None
    spans, rebuilt, at = [], [], 0
    for k, text in enumerate(parts):
        text = messages[int(text)]["content"] if k % 2 else text
        if k % 2:
            spans.append((at, at + len(text)))
        rebuilt.append(text)
        at += len(text)
    return (whole, spans) if "".join(rebuilt) == whole else None


def chat_pieces(messages: list[dict], tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, int]]:
    """The rendered conversation as ``(text, weight)`` pieces: each assistant message's own text (weight 1,
    or its ``weight``) between the template's other text (weight 0), its end-of-turn included, so the mask
    is exactly the tokens the model generates there. The same pieces as :func:`prefix_pieces` in time linear
    in the row: the conversation is rendered once, the assistant contents found in it by a marked render, and
    each framed by the text the template puts around a generated answer; a template that alters contents or
    frames answers unlike its probe takes the prefix renders."""
    frame, found = _frame(tokenizer), _spans(messages, tokenizer)
    if frame is None or found is None:
        return prefix_pieces(messages, tokenizer)
    (before, after), (whole, spans) = frame, found
    pieces: list[tuple[str, int]] = []
    done = 0
    weights = [int(m.get("weight", 1)) for m in messages if m["role"] == "assistant"]
    for (start, end), weight in zip(spans, weights, strict=True):
        first, last = start - len(before), end + len(after)
        if first < done or not (whole.startswith(before, first) and whole.startswith(after, end)):
            return prefix_pieces(messages, tokenizer)
        pieces += [(whole[done:first], 0), (whole[first:last], weight)]
        done = last
    return [*pieces, (whole[done:], 0)]


def encode_chat(
    messages: list[dict], tokenizer: PreTrainedTokenizerBase, max_tokens: int
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation (each piece tokenized on its own, so no token straddles a mask boundary)
    and each token's loss weight; cut to ``max_tokens``."""
    pieces = [(text, weight) for text, weight in chat_pieces(messages, tokenizer) if text]
    ids: list[int] = []
    weights: list[int] = []
    if pieces:
        encoded = tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
        for piece, (_, weight) in zip(encoded, pieces, strict=True):
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


class SFTTrainer:
    """A supervised job (`gspo_core.loop.Job`, a peer of `gspo_core.trainer.Trainer`): the loop's steps,
    evaluations, checkpoints and resume (`gspo_core.loop`) over the same policy, optimizer and update
    (`gspo_core.primitives.core.optimizer_update`), with no rollout engine and no reward. A step is one optimizer
    update on ``prompts_per_step`` rows: the mean negative log-likelihood over their trained tokens."""

    def __init__(self, spec: JobSpec, callbacks: Callbacks | None, runtime: RuntimeOptions | None = None) -> None:
        self.spec, self.cfg = spec, spec.hyperparameters
        self.runtime = runtime or RuntimeOptions()
        seed_everything(self.cfg.seed)
        self.device = local_device()
        self.ranks = join_group(self.device)
        self.callbacks = loop.job_callbacks(self.ranks, callbacks)
        self.writer = lead_writer(self.ranks)  # rank 0 writes the checkpoints' own files
        if self.ranks.world > 1:
            raise ValueError("supervised jobs run on one device (resources.devices 1)")
        self.rows, self.val_rows = spec_rows(spec)
        for line, row in enumerate([*self.rows, *self.val_rows], 1):
            check_sft_row(row, line)
        model, self.tokenizer = load_policy(spec.model, self.cfg, self.device)
        one_tied_gradient(model)  # one device: a tied embedding's gradient in one buffer
        # One update per step: the LR schedule counts steps, not GSPO's mini-batches.
        optimizer, scheduler = make_optimizer(model, self.cfg.model_copy(update={"mini_batches": 1}))
        amp = autocast_dtype(self.cfg, self.device)
        self.scheduler = scheduler
        self.policy = phases.PolicyState(
            model, optimizer, scheduler, amp, self.tokenizer.pad_token_id, None, self.ranks
        )
        self.step = 0
        self.saved: tuple[int, str] | None = None
        self._encoded: dict[tuple[str, int], tuple[array, bytes]] = {}

    @property
    def model(self) -> Policy:
        return self.policy.model

    def resume(self, ckpt_dir: str) -> None:
        """The job's state from a checkpoint (`gspo_core.loop.resume`; no sampler holds a copy of the weights)."""
        loop.resume(self, ckpt_dir)
        loop.resumed(self, ckpt_dir)

    def begin_step(self) -> bool:
        """Whether the run goes on (rank 0's callbacks' ``should_stop``, for every rank; a step is not cut short
        once begun)."""
        return not broadcast(self.callbacks.should_stop(), self.ranks)

    def close(self, engine: bool = True) -> None:
        """Nothing outlives the run."""

    def example(self, split: str, index: int) -> Example:
        """Row ``index`` of the training (``split`` "train") or validation rows encoded: once per job, kept
        packed (5 bytes a token), since every epoch and evaluation trains on the same tokens."""
        key = (split, index)
        if key not in self._encoded:
            rows = self.rows if split == "train" else self.val_rows
            ids, weights = encode_chat(
                rows[index]["messages"], self.tokenizer, self.cfg.max_prompt_tokens + self.cfg.max_new_tokens
            )
            self._encoded[key] = (array("i", ids), bytes(weights))
        ids_packed, weights_packed = self._encoded[key]
        return Example(ids_packed.tolist(), list(weights_packed))

    def run_step(self, step: int) -> tuple[dict, list[dict]]:
        """One supervised step (:func:`sft_step`) on step ``step``'s rows; no samples to report."""
        cfg = self.cfg
        picked = batch_indices(len(self.rows), step, cfg.prompts_per_step, cfg.seed, cfg.shuffle)
        return sft_step(self.policy, [self.example("train", i) for i in picked], cfg, step), []

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation (:func:`sft_evaluate`) on the first ``eval_prompts`` validation rows."""
        examples = [self.example("val", i) for i in range(min(len(self.val_rows), self.cfg.eval_prompts))]
        return sft_evaluate(self.policy, examples, self.cfg)


def nll_sum(policy: PolicyState, batch: list[Example]) -> torch.Tensor:
    """Summed negative log-likelihood of the batch's weighted tokens (token t predicted from tokens < t)."""
    packed = pack([e.ids[:1] for e in batch], [e.ids[1:] for e in batch], policy.pad_id)
    weight_BT = torch.zeros_like(packed.mask_BT)
    for row, e in enumerate(batch):
        weight_BT[row, : len(e.weights) - 1] = torch.tensor(e.weights[1:], dtype=weight_BT.dtype)
    packed.mask_BT = weight_BT
    logp_BT = completion_logprobs(policy.model, packed.to(policy.device), 1.0, policy.amp)
    return -logp_BT.sum()


def sft_step(policy: PolicyState, examples: list[Example], cfg: GSPOConfig, step: int) -> dict[str, float]:
    """One supervised step: the mean negative log-likelihood over the examples' trained tokens, its gradient
    a micro-batch at a time, one optimizer update and the LR schedule's step; returns the step's metrics."""
    start = time.perf_counter()
    trained = max(1, sum(sum(e.weights[1:]) for e in examples))
    policy.optimizer.zero_grad(set_to_none=True)
    nll = 0.0
    for batch in micro_batches(examples, micro_batch_budget(cfg.micro_batch_tokens, policy.device)):
        loss = nll_sum(policy, batch) / trained  # micro-batches add up to the step's token mean
        loss.backward()
        nll += float(loss.detach())
    lr = policy.optimizer.param_groups[0]["lr"]
    grad_norm = optimizer_update(policy, cfg.max_grad_norm)
    assert policy.scheduler is not None, "a supervised job's policy has its LR schedule"
    policy.scheduler.step()
    tokens = sum(len(e.ids) for e in examples)
    elapsed = time.perf_counter() - start
    return {
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


@torch.no_grad()
def sft_evaluate(policy: PolicyState, examples: list[Example], cfg: GSPOConfig) -> dict[str, float]:
    """Mean loss per trained token over the held-out ``examples``."""
    trained = max(1, sum(sum(e.weights[1:]) for e in examples))
    budget = micro_batch_budget(cfg.micro_batch_tokens, policy.device)
    nll = sum(float(nll_sum(policy, batch)) for batch in micro_batches(examples, budget))
    return {"eval/loss": nll / trained}
