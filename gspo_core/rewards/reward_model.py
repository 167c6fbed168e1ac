"""The `reward_model` grader: a local sequence-classification model (loaded lazily, scored in batches)."""

from __future__ import annotations

import threading

from gspo_core.rewards.base import Grader, GraderError, RewardSpecError, register, render
from gspo_core.rewards.policy import DEFAULT_POLICY


def default_text(sample: dict, item: dict) -> str:
    """The prompt (``item.prompt``, or the ``item.messages`` contents) followed by the output."""
    prompt = item.get("prompt")
    if not isinstance(prompt, str):
        msgs = item.get("messages") or []
        prompt = "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
    return prompt + sample["output_text"]


@register("reward_model")
class RewardModelGrader(Grader):
    """``model``: a Hugging Face sequence-classification model directory (num_labels 1, or
    ``label`` picks the logit). Score = the logit (``activation: none``) or its sigmoid (default).
    transformers/torch are imported at the first batch, not when the spec is built, so the API can
    validate specs without them; the model is loaded once and reused (on ``device``: auto = CUDA
    when available)."""

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
        self._model = self._tok = None
        self._lock = threading.Lock()

    def local_models(self) -> dict[str, str]:
        return {self.field("model"): self.model_path}

    def _load(self):
        with self._lock:
            if self._model is None:
                import torch
                from transformers import AutoModelForSequenceClassification, AutoTokenizer

                tok = AutoTokenizer.from_pretrained(self.model_path)
                if tok.pad_token is None:
                    tok.pad_token = tok.eos_token
                tok.padding_side = "right"
                device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
                model = AutoModelForSequenceClassification.from_pretrained(self.model_path).to(device).eval()
                if model.config.pad_token_id is None:
                    model.config.pad_token_id = tok.pad_token_id
                if self.label >= model.config.num_labels:
                    raise GraderError("exception", f"label {self.label} >= num_labels {model.config.num_labels}")
                self._tok, self._model = tok, model
            return self._tok, self._model

    def _texts(self, samples, items) -> list[str | GraderError]:
        out: list[str | GraderError] = []
        for s, it in zip(samples, items):
            try:
                out.append(render(self.input, s, it) if self.input is not None else default_text(s, it))
            except GraderError as exc:
                out.append(exc)
        return out

    def grade_batch(self, samples, items):
        import torch

        texts = self._texts(samples, items)
        try:
            tok, model = self._load()
        except GraderError as exc:
            return [exc] * len(samples)
        except Exception as exc:
            return [GraderError("exception", f"reward model: {type(exc).__name__}: {exc}"[:500])] * len(samples)
        out: list = list(texts)
        todo = [k for k, t in enumerate(texts) if isinstance(t, str)]
        with torch.inference_mode():
            for b in range(0, len(todo), self.batch_size):
                idx = todo[b:b + self.batch_size]
                enc = tok([texts[k] for k in idx], return_tensors="pt", padding=True, truncation=True,
                          max_length=self.max_length).to(model.device)
                logits_B = model(**enc).logits[:, self.label].float()
                scores_B = torch.sigmoid(logits_B) if self.activation == "sigmoid" else logits_B
                for k, v in zip(idx, scores_B.tolist()):
                    out[k] = v
        return out

    def close(self):
        with self._lock:
            self._model = self._tok = None
