"""The decoding methods a benchmark compares, all on the same target with the same limits.

Ours run through domino's engine (plain autoregressive decoding, drafters, the oracle ceiling);
Hugging Face `generate`, plain and with prompt-lookup decoding, are the baselines users would
otherwise pick. Every method returns the same record: tokens, seconds, and our per-round statistics
where the method has them. At a temperature above 0 every method samples, seeded per call so that a
rerun draws the same numbers (speculative sampling is exact in distribution, not token for token)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from domino.config import DEFAULT_BLOCK_SIZE
from domino.decoding import GenerationConfig, SpeculativeDecoder
from domino.drafter import Drafter
from domino.errors import DominoError
from domino.requests import GenerationStats
from domino.sampling import GREEDY, SamplingParams
from domino.scheduler import make_policy
from domino.target import Target

BUILTIN = ("autoregressive", "hf-generate", "prompt-lookup", "oracle")


@dataclass
class Output:
    tokens: list[int]
    seconds: float
    stats: GenerationStats | None = None  # rounds, acceptance and time split (our engine only)


@dataclass
class Method:
    name: str
    target: Target
    decoder: SpeculativeDecoder | None = None  # None: a Hugging Face generate method
    hf_options: dict = field(default_factory=dict)
    sampling: SamplingParams = GREEDY

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Output:
        if self.decoder is not None:
            config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=self.sampling, seed=seed)
            result = self.decoder.generate(prompt_ids, config)
            return Output(result.tokens, result.stats.total_s, result.stats)
        ids = torch.tensor([prompt_ids], device=self.target.device)
        sampling = {} if self.sampling.greedy else dict(
            temperature=self.sampling.temperature, top_p=self.sampling.top_p, top_k=self.sampling.top_k or None)
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = self.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                         do_sample=not self.sampling.greedy, eos_token_id=self.target.stop_token_ids,
                                         pad_token_id=self.target.stop_token_ids[0], **sampling, **self.hf_options)
        seconds = time.perf_counter() - start
        return Output(out[0, ids.shape[1]:].tolist(), seconds)


def make_method(spec: str, target: Target, block_size: int = DEFAULT_BLOCK_SIZE, verify: str = "full",
                sampling: SamplingParams = GREEDY, lookup_ngram: int | None = None) -> Method:
    """'autoregressive', 'hf-generate', 'prompt-lookup', 'oracle', or a drafter checkpoint given as
    PATH or NAME=PATH, whose drafts are verified by the policy named `verify` (domino.scheduler);
    `lookup_ngram` overrides the checkpoint's context lookup (0: the learned drafter alone)."""
    if spec == "autoregressive":
        return Method(spec, target, SpeculativeDecoder(target, None), sampling=sampling)
    if spec == "oracle":
        return Method(spec, target, SpeculativeDecoder(target, "oracle", block_size=block_size), sampling=sampling)
    if spec == "hf-generate":
        return Method(spec, target, sampling=sampling)
    if spec == "prompt-lookup":
        # 10 tokens a lookup, the value Hugging Face's documentation of prompt lookup decoding uses
        return Method(spec, target, hf_options=dict(prompt_lookup_num_tokens=10), sampling=sampling)
    name, _, path = spec.rpartition("=")
    if name in BUILTIN:
        raise DominoError(f"method '{spec}': '{name}' names a built-in method; give the drafter another name")
    if not Path(path).is_dir():
        if name or "/" in path:
            raise DominoError(f"method '{spec}': no drafter checkpoint folder at {path}")
        raise DominoError(f"unknown method '{spec}': use one of {', '.join(BUILTIN)}, or a drafter checkpoint "
                          f"folder (PATH or NAME=PATH)")
    drafter = Drafter.from_pretrained(path, target)
    if lookup_ngram is not None:
        drafter.set_lookup(lookup_ngram)
    try:
        decoder = SpeculativeDecoder(target, drafter, policy=make_policy(verify, target))
    except DominoError as error:
        raise DominoError(f"method '{spec}': {error}") from None
    return Method(name or Path(path).name, target, decoder, sampling=sampling)


def make_methods(spec: str, target: Target, block_size: int, verify: list[str], sampling: SamplingParams = GREEDY,
                 lookup_ngram: int | None = None) -> list[Method]:
    """make_method, once per verify policy for a drafter checkpoint when `verify` names several (each then
    named 'NAME (policy)'), so that policies are compared side by side in one run."""
    if spec in BUILTIN or len(verify) == 1:
        return [make_method(spec, target, block_size, verify[0], sampling, lookup_ngram)]
    methods = [make_method(spec, target, block_size, policy, sampling, lookup_ngram) for policy in verify]
    return [replace(method, name=f"{method.name} ({policy})") for method, policy in zip(methods, verify)]


def check_unique_names(methods: list[Method]) -> None:
    """Rows are keyed by method name: two methods of one name would share a row, and a row of two drafters'
    outputs would be judged against one baseline."""
    names = [method.name for method in methods]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise DominoError(f"several methods are named {', '.join(repeated)} (a checkpoint is named after its "
                          f"folder): name each as NAME=PATH")
