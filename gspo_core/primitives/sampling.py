"""A sampling session: token prompts in, sampled tokens with log-probs out, a training session's weights taken in."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from gspo_core.policy import Policy, disable_dropout, export_weights
from gspo_core.primitives.types import SampledSequence, SamplingParams
from gspo_core.rollout import RolloutEngine, engine_kind, make_engine
from gspo_core.rollout.base import SamplingSpec
from gspo_core.rollout.hf_engine import TransformersEngine

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from gspo_core.primitives.training import TrainingSession


class SamplingSession:
    """A rollout engine (vLLM, or transformers ``generate`` on a model of its own) over one model's weights."""

    def __init__(
        self, engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None
    ) -> None:
        #: ``model``: the transformers engine's own copy of the weights (None for vLLM, which holds its own).
        self.engine, self.tokenizer, self.model = engine, tokenizer, model

    @classmethod
    def create(
        cls,
        model_path: str,
        *,
        engine: str = "auto",
        seed: int = 0,
        max_model_len: int = 2048,
        max_num_seqs: int | None = None,
        max_new_tokens: int | None = None,
    ) -> SamplingSession:
        """An engine over ``model_path``: vLLM where installed (``engine="auto"``), else transformers.
        ``max_num_seqs`` (prompts x samples of the largest call) and ``max_new_tokens`` (the most tokens a call
        usually samples), where the caller knows them: vLLM on CPU sizes its KV cache and blocks by them, as the
        job loop's engine does (`gspo_core.rollout.make_engine`); None: vLLM's default cache (gigabytes)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kind = engine_kind(engine)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = None
        if kind == "transformers":
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
            disable_dropout(model)
        built = make_engine(
            kind,
            model_dir=model_path,
            policy=cast(Any, model),
            tokenizer=tokenizer,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_new_tokens=max_new_tokens,
        )
        return cls(built, tokenizer, model)

    def sample(self, prompt_tokens: list[int], n: int, params: SamplingParams) -> list[SampledSequence]:
        """``n`` continuations of ``prompt_tokens``, each with the sampler's log-prob of every token."""
        if not prompt_tokens:
            raise ValueError("prompt_tokens: empty")
        return self.sample_many([prompt_tokens], n, params)[0]

    def sample_many(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[SampledSequence]]:
        """``n`` continuations of each of ``prompts``, in one engine call: what a client's concurrent
        :meth:`sample` calls (tinker-cookbook's groups) amount to. The engine batches every sequence's decode
        steps together, as the job loop's rollout does; one prompt per call costs a whole decode loop of
        engine steps per prompt (docs/bench.md, issue 38)."""
        if not prompts:
            raise ValueError("prompts: empty")
        if empty := [i for i, prompt in enumerate(prompts) if not prompt]:
            raise ValueError(f"prompts[{empty[0]}]: empty")
        if n < 1 or params.max_tokens < 1:
            raise ValueError("n and params.max_tokens: must be at least 1")
        if params.top_k not in (-1, 0):
            raise ValueError("params.top_k: not supported (-1 only)")
        token_stops = tuple(stop for stop in params.stop or () if isinstance(stop, int))
        spec = SamplingSpec(
            n=n,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            ignore_eos=params.ignore_eos,
            stop_token_ids=token_stops,  # the engine stops there; stop strings are cut after sampling
        )
        self.engine.wake()
        groups = self.engine.generate([list(prompt) for prompt in prompts], spec)
        return [
            [self._stopped(c.completion_ids, c.logprobs, c.finish_reason, params.stop) for c in group]
            for group in groups
        ]

    def _stopped(self, tokens: list[int], logprobs: list[float], reason: str, stop) -> SampledSequence:
        """The sequence cut after its first stop token or stop string (kept), if any."""
        end = None
        if stop and isinstance(stop[0], int):
            end = next((i + 1 for i, token in enumerate(tokens) if token in stop), None)
        elif stop:
            end = next(
                (k for k in range(1, len(tokens) + 1) if any(s in self.tokenizer.decode(tokens[:k]) for s in stop)),
                None,
            )
        if end is None:
            return SampledSequence(list(tokens), list(logprobs), reason)
        return SampledSequence(list(tokens[:end]), list(logprobs[:end]), "stop")

    def compute_logprobs(self, tokens: list[int]) -> list[float | None]:
        """The log-prob of each token given those before it by the current weights (None for the first)."""
        if not tokens:
            raise ValueError("tokens: empty")
        if not isinstance(self.engine, TransformersEngine):
            return self._vllm_logprobs(tokens)
        # The engine's model: the session's own copy, or the trainer's model the job loop's engine samples with.
        model = self.engine.policy
        ids = torch.tensor([tokens], device=next(model.parameters()).device)
        with torch.no_grad():
            logp_LV = model(input_ids=ids).logits[0].float().log_softmax(-1)
        taken = logp_LV[:-1].gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        return [None, *taken.tolist()]

    def _vllm_logprobs(self, tokens: list[int]) -> list[float | None]:
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        llm = cast(Any, self.engine).llm
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=list(tokens))],
            VLLMParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
            use_tqdm=False,
        )[0]
        scored = zip(out.prompt_logprobs[1:], tokens[1:], strict=True)
        return [None, *(float(entry[token].logprob) for entry, token in scored)]

    def take_weights(self, training: TrainingSession) -> None:
        """``training``'s current weights into this engine (:meth:`push` of its gathered state)."""
        self.push(training.policy.model, training.full_state())

    def push(self, model: Policy, state: dict[str, torch.Tensor] | None = None) -> None:
        """``model``'s weights (``state``: its full state dict, gathered from the ranks' shards; None: its own)
        into this sampler, whatever the transport: a copy into the session's own model (transformers), nothing
        for an engine that samples with ``model``'s own parameters (the job loop's transformers engine), else
        the engine's weight push (vLLM's, or a rank's side of one every rank sends: `rollout.weight_push`)."""
        if self.model is not None:
            weights = dict(export_weights(model, state))
            self.model.load_state_dict({name: tensor.to(self.model.device) for name, tensor in weights.items()})
            return
        from gspo_core.step import push_weights

        self.engine.wake()
        push_weights(model, self.engine, state)

    def load_weights(self, model_dir: str) -> None:
        """The weights of a Hugging Face export (``model_dir``'s ``*.safetensors``, as ``TrainingSession.export_hf``
        writes them) into this engine, as :meth:`take_weights` pushes a live model's: no new engine."""
        from safetensors.torch import load_file

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"model_dir: no *.safetensors in {model_dir}")
        weights = {name: tensor for file in files for name, tensor in load_file(str(file)).items()}
        if self.model is None:
            self.engine.wake()
            self.engine.load_weights(weights.items())
            return
        # Tied parameters appear once in named_parameters and once in the export: only they may be absent.
        needed = {name for name, _ in self.model.named_parameters()}
        if missing := sorted(needed - set(weights)):
            raise ValueError(f"model_dir: {model_dir} lacks {missing[:3]}")
        loaded = self.model.load_state_dict({k: v.to(self.model.device) for k, v in weights.items()}, strict=False)
        if loaded.unexpected_keys:
            raise ValueError(f"model_dir: {model_dir} has unknown tensors {loaded.unexpected_keys[:3]}")

    def close(self) -> None:
        """Release the engine."""
        self.engine.close()
        self.model = None
