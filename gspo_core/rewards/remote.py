"""Graders that call a server: `http` (a reward endpoint) and `score_model` (an LLM judge)."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

from gspo_core.rewards.base import MAX_SPEC_NUMBER, Grader, GraderError, RewardSpecError, as_score, register, render
from gspo_core.rewards.policy import DEFAULT_POLICY, GraderPolicy

if TYPE_CHECKING:
    from gspo_core.egress_client import EgressClient

RETRYABLE = {408, 425, 429, 500, 502, 503, 504}
_SSL = None
_SSL_LOCK = threading.Lock()


def _ssl_context():
    """One TLS context for every grader's client (building one per client costs CPU on every call)."""
    global _SSL
    with _SSL_LOCK:
        if _SSL is None:
            import ssl

            _SSL = ssl.create_default_context()
        return _SSL


class _HttpCaller:
    """One egress client per grader (thread-safe; see gspo_core.egress_client), created on first use: POST
    JSON with a timeout, retries with exponential backoff on connection errors, timeouts, 429 and 5xx.
    Error texts never carry the remote body."""

    def __init__(self, timeout: float, retries: int, backoff: float, headers: dict, policy: GraderPolicy) -> None:
        self.timeout, self.retries, self.backoff, self.headers = timeout, retries, backoff, headers
        self.allow = policy.egress_allow
        self._client: EgressClient | None = None
        self._lock = threading.Lock()

    def client(self) -> EgressClient:
        with self._lock:
            if self._client is None:
                from gspo_core.egress import EgressPolicy
                from gspo_core.egress_client import EgressClient

                self._client = EgressClient(
                    EgressPolicy(self.allow), self.timeout, headers=self.headers, verify=_ssl_context()
                )
            return self._client

    def post(self, url: str, body: dict) -> Any:
        """The endpoint's JSON answer (any JSON value: the caller checks its shape)."""
        from gspo_core.egress import EgressRefused
        from gspo_core.egress_client import EgressError

        last = GraderError("http_error", "no attempt made")
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(5.0, self.backoff * 2 ** (attempt - 1)))
            try:
                status, data = self.client().request("POST", url, json=body)
            except EgressRefused as exc:
                raise GraderError("egress_refused", f"{url}: {exc}") from None
            except EgressError as exc:
                last = GraderError(exc.kind, str(exc))
                if exc.kind == "invalid_output":
                    raise last from None
                continue
            if status in RETRYABLE:
                last = GraderError("http_error", f"HTTP {status} from {url}")
                continue
            if status >= 300:
                raise GraderError("http_error", f"HTTP {status} from {url}")
            try:
                return json.loads(data)
            except ValueError:
                raise GraderError("invalid_output", f"{url} did not answer JSON") from None
        raise last

    def budget_s(self) -> float:
        backoff = sum(min(5.0, self.backoff * 2**k) for k in range(self.retries))
        return (self.retries + 1) * (self.timeout + 1) + backoff + 5

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _url(grader: Grader, key: str) -> str:
    """An http(s) URL; one whose host is a refused address literal (any spelling) or a loopback name
    is a spec error naming the field (other names are checked when resolved, per request)."""
    from gspo_core.egress import UserUrlError, check_user_url

    try:
        return check_user_url(grader.req(key, str), grader.policy.egress_allow)
    except UserUrlError as exc:
        raise RewardSpecError(grader.field(key), str(exc)) from None


def _caller(grader: Grader, headers: dict, default_timeout: float) -> _HttpCaller:
    from gspo_core.egress import header_refusal

    for name, value in headers.items():
        if why := header_refusal(name, value):
            raise RewardSpecError(grader.field(f"headers.{name}"), why)
    return _HttpCaller(
        timeout=float(grader.num("timeout_s", default_timeout, 0.01, 600)),
        retries=int(grader.num("retries", 2, 0, 10)),
        backoff=float(grader.num("backoff_s", 0.2, 0, 10)),
        headers=headers,
        policy=grader.policy,
    )


@register("http")
class HttpGrader(Grader):
    """POSTs ``{"sample": ..., "item": ...}`` as JSON to ``url``; the answer is a number or
    ``{"reward": number}``."""

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys({"url", "headers", "timeout_s", "retries", "backoff_s"})
        self.url = _url(self, "url")
        self.http = _caller(self, self.opt("headers", dict, {}), 10.0)

    def grade(self, sample, item):
        return as_score(self.http.post(self.url, {"sample": sample, "item": item}))

    def budget_s(self, n):
        return self.http.budget_s()

    def close(self):
        self.http.close()


#: The judge's numeric sampling parameters and their bounds (OpenAI's), checked before anything converts them.
SAMPLING_BOUNDS: dict[str, tuple[type | tuple[type, ...], float, float]] = {
    "temperature": ((int, float), 0, 2),
    "top_p": ((int, float), 0, 1),
    "max_tokens": (int, 1, 1_000_000),
    "max_completion_tokens": (int, 1, 1_000_000),
    "seed": (int, -(2**63), 2**63 - 1),
}


def _sampling_ok(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return False
    if key == "stop":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    kind, lo, hi = SAMPLING_BOUNDS[key]
    return isinstance(value, kind) and lo <= value <= hi  # type: ignore[operator]


_NUM = re.compile(r"-?\d+(?:\.\d+)?")


@register("score_model")
class ScoreModelGrader(Grader):
    """LLM judge on any OpenAI-compatible ``{base_url}/chat/completions`` endpoint. ``input`` is a
    list of chat messages whose contents are templates; the first number in the reply, clipped to
    ``range`` [lo, hi], is mapped onto [0, 1]. ``sampling_params`` go into the request as they are."""

    SAMPLING_KEYS: ClassVar[dict[str, str]] = {
        "temperature": "must be a number in [0, 2]",
        "top_p": "must be a number in [0, 1]",
        "max_tokens": "must be an integer in [1, 1000000]",
        "max_completion_tokens": "must be an integer in [1, 1000000]",
        "seed": "must be a 64-bit integer",
        "stop": "must be a string or a list of strings",
    }

    def __init__(self, spec, path, policy=DEFAULT_POLICY):
        super().__init__(spec, path, policy)
        self.check_keys(
            {"base_url", "model", "input", "api_key", "range", "timeout_s", "retries", "backoff_s", "sampling_params"}
        )
        self.base_url = _url(self, "base_url").rstrip("/")
        self.model = self.req("model", str)
        self.messages = self.req("input", list)
        if not self.messages:
            raise RewardSpecError(self.field("input"), "needs at least one message")
        for i, message in enumerate(self.messages):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise RewardSpecError(self.field(f"input[{i}]"), "each message needs string role and content")
            self.add_template(message["content"], f"input[{i}].content")
        rng = self.opt("range", list, [0, 1])
        if (
            len(rng) != 2
            or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) <= MAX_SPEC_NUMBER for x in rng
            )
            or rng[0] >= rng[1]
        ):
            raise RewardSpecError(
                self.field("range"), f"must be [low, high] with low < high, each within ±{MAX_SPEC_NUMBER:g}"
            )
        self.lo, self.hi = float(rng[0]), float(rng[1])
        self.sampling = self.opt("sampling_params", dict, {"temperature": 0.0})
        for key, value in self.sampling.items():
            if key not in self.SAMPLING_KEYS:
                raise RewardSpecError(
                    self.field(f"sampling_params.{key}"), f"unknown; allowed: {', '.join(sorted(self.SAMPLING_KEYS))}"
                )
            if not _sampling_ok(key, value):
                raise RewardSpecError(self.field(f"sampling_params.{key}"), self.SAMPLING_KEYS[key])
        from gspo_core.egress import header_refusal

        api_key = self.opt("api_key", str, None)
        if api_key is not None and header_refusal("Authorization", api_key):
            raise RewardSpecError(self.field("api_key"), "may not contain line breaks or NUL")
        self.http = _caller(self, {"Authorization": f"Bearer {api_key}"} if api_key else {}, 60.0)

    def grade(self, sample, item):
        messages = [
            {"role": message["role"], "content": render(message["content"], sample, item)} for message in self.messages
        ]
        reply = self.http.post(
            f"{self.base_url}/chat/completions", {"model": self.model, "messages": messages, **self.sampling}
        )
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise GraderError("invalid_output", "judge reply has no choices[0].message.content") from None
        number = _NUM.search(text if isinstance(text, str) else "")
        if not number:
            raise GraderError("invalid_output", "judge reply has no number")
        value = min(max(float(number.group()), self.lo), self.hi)
        return (value - self.lo) / (self.hi - self.lo)

    def budget_s(self, n):
        return self.http.budget_s()

    def close(self):
        self.http.close()
