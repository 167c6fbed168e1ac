"""The `reward_model` grader: a local sequence-classification model (loaded lazily, scored in batches)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from gspo_core.rewards.base import Grader, GraderError, RewardSpecError, register, render
from gspo_core.rewards.policy import DEFAULT_POLICY


class _Entry:
    def __init__(self, tok, model, nbytes: int) -> None:
        self.tok, self.model, self.nbytes, self.users = tok, model, nbytes, 0
        self.lock = threading.Lock()  # one batch at a time: a fast tokenizer's padding state is not thread-safe


class ModelCache:
    """Loaded reward models shared by every grader of the process (e.g. every ``/v1/rewards/run``
    request), keyed by (model, device). Each is loaded once even when requests ask at the same
    time; models no grader holds stay loaded, least recently used first out, while there are at
    most ``max_models`` of them and ``max_bytes`` in all. One on a GPU is dropped as soon as no
    grader holds it (that memory is the trainer's)."""

    def __init__(self, max_models: int = 2, max_bytes: int = 4 << 30) -> None:
        self.max_models, self.max_bytes = max_models, max_bytes
        self.loads = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._loading: dict[tuple[str, str], threading.Lock] = {}

    def _take(self, key) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.users += 1
            self._entries.move_to_end(key)
        return entry

    def acquire(self, key: tuple[str, str], load) -> _Entry:
        """The entry for ``key``, loading it with ``load() -> (tokenizer, model)`` if needed; pair with
        :meth:`release`."""
        with self._lock:
            if (entry := self._take(key)) is not None:
                return entry
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:  # concurrent first requests for one model: one loads, the others wait for it
            with self._lock:
                if (entry := self._take(key)) is not None:
                    return entry
            try:
                tok, model = load()
            finally:
                with self._lock:
                    self._loading.pop(key, None)
            nbytes = sum(tensor.numel() * tensor.element_size() for tensor in [*model.parameters(), *model.buffers()])
            with self._lock:
                self.loads += 1
                entry = self._entries[key] = _Entry(tok, model, nbytes)
                entry.users = 1
                self._evict()
            return entry

    def release(self, key: tuple[str, str]) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.users -= 1
            if entry.users <= 0 and key[1] != "cpu":
                del self._entries[key]
            self._evict()

    def _evict(self) -> None:
        """Drop unused entries, oldest first, while over either bound."""
        for key in list(self._entries):
            total = sum(e.nbytes for e in self._entries.values())
            if len(self._entries) <= self.max_models and total <= self.max_bytes:
                return
            if self._entries[key].users <= 0:
                del self._entries[key]

    def __len__(self) -> int:
        """Models loaded now."""
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        """Drop every model no grader holds."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.users <= 0]:
                del self._entries[key]


#: The process's cache of loaded reward models.
MODEL_CACHE = ModelCache()


def default_text(sample: dict, item: dict) -> str:
    """The prompt (``item.prompt``, or the ``item.messages`` contents) followed by the output."""
    prompt = item.get("prompt")
    if not isinstance(prompt, str):
        messages = item.get("messages") or []
        prompt = "\n".join(str(message.get("content", "")) for message in messages if isinstance(message, dict))
    return prompt + sample["output_text"]


@register("reward_model")
class RewardModelGrader(Grader):
    """``model``: a Hugging Face sequence-classification model directory (num_labels 1, or
    ``label`` picks the logit). Score = the logit (``activation: none``) or its sigmoid (default).
    transformers/torch are imported at the first batch, not when the spec is built, so the API can
    validate specs without them; the model comes from the process-wide :data:`MODEL_CACHE` (loaded
    once, shared with every other grader naming it; on ``device``: auto = CUDA when available)."""

    batched = True

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"model", "input", "activation", "batch_size", "max_length", "label", "device"})
        self.model_path = self.req("model", str)
        if not self.model_path.strip():
            raise RewardSpecError(self.field("model"), "must be a model directory")
        self.input = self.tmpl("input", None)
        self.activation = self.opt("activation", str, "sigmoid")
        if self.activation not in ("sigmoid", "none"):
            raise RewardSpecError(self.field("activation"), "must be sigmoid or none")
        self.batch_size = int(self.num("batch_size", 16, 1, 1024))
        self.max_length = int(self.num("max_length", 2048, 1, 1_000_000))
        self.label = int(self.num("label", 0, 0, 1000))
        self.device = self.opt("device", str, "auto")
        if self.device not in ("auto", "cpu", "cuda"):
            raise RewardSpecError(self.field("device"), "must be auto, cpu or cuda")
        self._entry: _Entry | None = None
        self._key: tuple[str, str] | None = None
        self._lock = threading.Lock()

    def local_models(self) -> dict[str, str]:
        return {self.field("model"): self.model_path}

    def _load(self) -> _Entry:
        """This grader's model, from the process-wide cache (held until :meth:`close`)."""
        with self._lock:
            if self._entry is None:
                import torch

                device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
                key = (self.model_path, device)
                self._entry, self._key = MODEL_CACHE.acquire(key, lambda: self._read(device)), key
            entry = self._entry
        if self.label >= entry.model.config.num_labels:
            raise GraderError("exception", f"label {self.label} >= num_labels {entry.model.config.num_labels}")
        return entry

    def _read(self, device: str):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model_path)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "right"
        model = AutoModelForSequenceClassification.from_pretrained(self.model_path).to(device).eval()
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tok.pad_token_id
        return tok, model

    def _texts(self, samples, items) -> list[str | GraderError]:
        out: list[str | GraderError] = []
        for sample, item in zip(samples, items, strict=True):
            try:
                out.append(render(self.input, sample, item) if self.input is not None else default_text(sample, item))
            except GraderError as exc:
                out.append(exc)
        return out

    def grade_batch(self, samples, items):
        import torch

        texts = self._texts(samples, items)
        try:
            entry = self._load()
        except GraderError as exc:
            return [exc] * len(samples)
        except Exception as exc:
            return [GraderError("exception", f"reward model: {type(exc).__name__}: {exc}"[:500])] * len(samples)
        out: list = list(texts)
        todo = [k for k, text in enumerate(texts) if isinstance(text, str)]
        tokenizer, model = entry.tok, entry.model
        with entry.lock, torch.inference_mode():
            for start in range(0, len(todo), self.batch_size):
                idx = todo[start : start + self.batch_size]
                encoded = tokenizer(
                    [texts[k] for k in idx],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                ).to(model.device)
                logits_B = model(**encoded).logits[:, self.label].float()
                scores_B = torch.sigmoid(logits_B) if self.activation == "sigmoid" else logits_B
                for k, score in zip(idx, scores_B.tolist(), strict=True):
                    out[k] = score
        return out

    def close(self):
        with self._lock:
            if self._key is not None:
                MODEL_CACHE.release(self._key)
            self._entry = self._key = None
