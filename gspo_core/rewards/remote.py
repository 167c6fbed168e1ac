"""Graders that call out: `python` (sandboxed user code), `http` (reward endpoint), `score_model` (LLM judge)."""

from __future__ import annotations

import re
import time

from gspo_core.rewards.base import Grader, GraderError, RewardSpecError, as_score, register, render
from gspo_core.rewards.sandbox import SandboxLimits, run_sandboxed


@register("python")
class PythonGrader(Grader):
    """User source defining ``grade(sample, item) -> float``, run in the sandbox (see sandbox.py)."""

    def __init__(self, spec, path):
        super().__init__(spec, path)
        self.check_keys({"source", "timeout_s", "memory_mb"})
        self.source = self.req("source", str)
        try:
            compile(self.source, "<grader>", "exec")
        except SyntaxError as exc:
            raise RewardSpecError(self.field("source"), f"syntax error line {exc.lineno}: {exc.msg}") from None
        if "def grade" not in self.source:
            raise RewardSpecError(self.field("source"), "must define grade(sample, item)")
        timeout = self.opt("timeout_s", (int, float), 2.0)
        memory = self.opt("memory_mb", int, 512)
        if not 0 < timeout <= 60:
            raise RewardSpecError(self.field("timeout_s"), "must be in (0, 60]")
        if not 64 <= memory <= 8192:
            raise RewardSpecError(self.field("memory_mb"), "must be in [64, 8192]")
        self.limits = SandboxLimits(timeout_s=float(timeout), memory_mb=memory)

    def grade_batch(self, samples, items):
        raw = run_sandboxed(self.source, [{"sample": s, "item": i} for s, i in zip(samples, items)], self.limits)
        out = []
        for r in raw:
            if isinstance(r, GraderError):
                out.append(r)
            else:
                try:
                    out.append(as_score(r))
                except GraderError as exc:
                    out.append(exc)
        return out


def _post_json(url: str, body: dict, headers: dict, timeout: float, retries: int) -> object:
    import httpx

    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            resp = httpx.post(url, json=body, headers=headers, timeout=timeout)
            if resp.status_code >= 500 or resp.status_code == 429:
                raise GraderError("http_error", f"HTTP {resp.status_code} from {url}")
            if resp.status_code >= 400:
                raise GraderError("http_error", f"HTTP {resp.status_code} from {url}: {resp.text[:200]}")
            return resp.json()
        except httpx.TimeoutException:
            last = GraderError("timeout", f"no answer from {url} within {timeout:g} s")
        except httpx.HTTPError as exc:
            last = GraderError("http_error", f"{type(exc).__name__}: {exc}")
        except GraderError as exc:
            if "HTTP 4" in str(exc) and "429" not in str(exc):
                raise
            last = exc
        except ValueError:
            raise GraderError("invalid_output", f"{url} did not answer JSON") from None
        if attempt < retries:
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
    raise last  # type: ignore[misc]


def _check_url(grader: Grader, key: str) -> str:
    url = grader.req(key, str)
    if not re.match(r"^https?://", url):
        raise RewardSpecError(grader.field(key), "must be an http(s) URL")
    return url


@register("http")
class HttpGrader(Grader):
    """POSTs ``{"sample": ..., "item": ...}`` to ``url``; reads a number or ``{"reward": number}``."""

    def __init__(self, spec, path):
        super().__init__(spec, path)
        self.check_keys({"url", "headers", "timeout_s", "retries"})
        self.url = _check_url(self, "url")
        self.headers = self.opt("headers", dict, {})
        self.timeout = float(self.opt("timeout_s", (int, float), 10.0))
        self.retries = self.opt("retries", int, 2)

    def grade(self, sample, item):
        return as_score(_post_json(self.url, {"sample": sample, "item": item}, self.headers,
                                   self.timeout, self.retries))


_NUM = re.compile(r"-?\d+(?:\.\d+)?")


@register("score_model")
class ScoreModelGrader(Grader):
    """LLM judge on an OpenAI-compatible ``/chat/completions`` endpoint; the reply's first number,
    mapped from ``range`` [lo, hi] onto [0, 1]."""

    def __init__(self, spec, path):
        super().__init__(spec, path)
        self.check_keys({"base_url", "model", "input", "api_key", "range", "timeout_s", "retries",
                         "temperature"})
        self.base_url = _check_url(self, "base_url").rstrip("/")
        self.model = self.req("model", str)
        self.messages = self.req("input", list)
        for i, m in enumerate(self.messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise RewardSpecError(self.field(f"input[{i}]"), "each message needs string role and content")
        rng = self.opt("range", list, [0, 1])
        if len(rng) != 2 or not all(isinstance(x, (int, float)) for x in rng) or rng[0] >= rng[1]:
            raise RewardSpecError(self.field("range"), "must be [low, high] with low < high")
        self.lo, self.hi = float(rng[0]), float(rng[1])
        self.api_key = self.opt("api_key", str, None)
        self.timeout = float(self.opt("timeout_s", (int, float), 30.0))
        self.retries = self.opt("retries", int, 2)
        self.temperature = float(self.opt("temperature", (int, float), 0.0))

    def grade(self, sample, item):
        msgs = [{"role": m["role"], "content": render(m["content"], sample, item)} for m in self.messages]
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "messages": msgs, "temperature": self.temperature}
        reply = _post_json(f"{self.base_url}/chat/completions", body, headers, self.timeout, self.retries)
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise GraderError("invalid_output", "judge reply has no choices[0].message.content") from None
        m = _NUM.search(text or "")
        if not m:
            raise GraderError("invalid_output", f"judge reply has no number: {text[:100]!r}")
        value = min(max(float(m.group()), self.lo), self.hi)
        return (value - self.lo) / (self.hi - self.lo)


@register("reward_model")
class RewardModelGrader(Grader):
    """A local sequence-classification model scoring ``prompt + output`` (logit or sigmoid)."""

    def __init__(self, spec, path):
        super().__init__(spec, path)
        self.check_keys({"model", "input", "activation", "batch_size"})
        self.model_path = self.req("model", str)
        self.input = self.opt("input", str, "{{item.prompt}}{{sample.output_text}}")
        self.activation = self.opt("activation", str, "sigmoid")
        if self.activation not in ("sigmoid", "none"):
            raise RewardSpecError(self.field("activation"), "must be sigmoid or none")
        self.batch_size = self.opt("batch_size", int, 16)
        self._model = None

    def _load(self):
        if self._model is None:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.model_path)
            if self._tok.pad_token is None:
                self._tok.pad_token = self._tok.eos_token
            self._model = AutoModelForSequenceClassification.from_pretrained(self.model_path).eval()
        return self._model

    def grade_batch(self, samples, items):
        import torch

        try:
            model = self._load()
            texts = [render(self.input, s, i) for s, i in zip(samples, items)]
        except GraderError as exc:
            return [exc] * len(samples)
        except Exception as exc:
            return [GraderError("exception", f"reward model: {type(exc).__name__}: {exc}")] * len(samples)
        out: list = []
        with torch.inference_mode():
            for k in range(0, len(texts), self.batch_size):
                enc = self._tok(texts[k:k + self.batch_size], return_tensors="pt", padding=True, truncation=True)
                logits_B = model(**enc).logits[:, 0].float()
                scores_B = torch.sigmoid(logits_B) if self.activation == "sigmoid" else logits_B
                out += [float(x) for x in scores_B]
        return out
