"""The Ray Data stages that run the frozen target: regeneration of responses and target features.

Both are callable classes run on actor pools, so each actor loads the target once and then serves
batch after batch (on a GPU when `feature_gpus` > 0). Features leave the actor as numpy arrays of the
chosen layers' hidden states, per sequence, and stream straight to the trainers: nothing is stored.
"""

from __future__ import annotations

import json
import time
import warnings

import numpy as np
import ray
import torch

from domino.target import Target, training_dtype
from pipelines.training.config import PipelineConfig

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_threads(cpus: float) -> int:
    """Intra-op threads for a worker holding `cpus` CPUs: more threads than cores only adds contention."""
    return max(1, round(cpus))


def to_numpy(x: torch.Tensor, dtype: str) -> np.ndarray:
    """numpy has no bfloat16: bf16 travels as its 16 bits, reinterpreted as int16."""
    x = x.detach().to(DTYPES[dtype]).cpu()
    return x.view(torch.int16).numpy() if dtype == "bfloat16" else x.numpy()


def from_numpy(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A tensor over the array's memory. Arrays from Ray's object store are read-only, which torch warns
    of; the tensors made here are only read (the collate pads them into new ones)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        x = torch.from_numpy(np.ascontiguousarray(array))
    return x.view(torch.bfloat16) if dtype == "bfloat16" else x


class TargetActor:
    def __init__(self, target_path: str, cpus: float, gpus: float, compute_dtype: str | None = None):
        """`compute_dtype` (a PipelineConfig value, "auto" included) or None: the dtype serving runs it in."""
        torch.set_num_threads(torch_threads(cpus))
        device = "cuda" if gpus else "cpu"
        dtype = None if compute_dtype is None else DTYPES[training_dtype(compute_dtype, device)]
        self.target = Target.load(target_path, device=device, dtype=dtype)


class Regenerate(TargetActor):
    """Replace each conversation by its first prompt and the target's own greedy answer to it: the
    drafter learns to imitate what it will verify against, so the target runs as it is served."""

    def __init__(self, target_path: str, cpus: float, gpus: float, max_length: int, max_new_tokens: int):
        super().__init__(target_path, cpus, gpus)
        self.max_length, self.max_new_tokens = max_length, max_new_tokens
        tokenizer = self.target.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.stop_ids = set(self.target.stop_token_ids)
        self.answered = 0  # for the progress line

    @torch.no_grad()
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        prompts = [self.target.encode_prompt(json.loads(p)) for p in batch["prompt"]]
        prompts = [p for p in prompts if len(p) < self.max_length]
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "num_tokens": []}
        if not prompts:
            return out
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id)
        attention = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(prompt):] = torch.tensor(prompt)
            attention[i, width - len(prompt):] = 1
        budget = min(self.max_new_tokens, self.max_length - min(map(len, prompts)))
        generated = self.target.model.generate(
            input_ids=ids.to(self.target.device), attention_mask=attention.to(self.target.device),
            max_new_tokens=budget, do_sample=False, pad_token_id=self.pad_id,
            eos_token_id=sorted(self.stop_ids) or None)[:, width:].tolist()
        for prompt, answer in zip(prompts, generated):
            answer = answer[: self.max_length - len(prompt)]
            stop = next((i for i, token in enumerate(answer) if token in self.stop_ids), None)
            answer = answer if stop is None else answer[: stop + 1]
            out["input_ids"].append(np.asarray(prompt + answer, dtype=np.int32))
            out["loss_mask"].append(np.asarray([False] * len(prompt) + [True] * len(answer)))
            out["num_tokens"].append(len(prompt) + len(answer))
        self.answered += len(prompts)
        print(f"[regenerate] this actor has written {self.answered} answers", flush=True)
        return out


class TargetFeatures(TargetActor):
    """One padded target forward per batch, only as deep as the chosen layers need; per sequence, the
    chosen layers' features (and the final hidden state when the loss distils the target's
    distribution; and with `target_labels` the target's greedy next token at every position, for which
    the forward runs the whole target and its LM head), cut back to its own length.
    `target_seconds` is each sequence's share of the forward time: summed by the trainers, it gives
    the producers' own throughput, separate from any time they spend waiting on the trainers."""

    def __init__(self, target_path: str, cpus: float, gpus: float, layer_ids: list[int], final_hidden: bool,
                 dtype: str, compute_dtype: str, target_labels: bool = False):
        super().__init__(target_path, cpus, gpus, compute_dtype)
        self.layer_ids, self.final_hidden, self.dtype = layer_ids, final_hidden, dtype
        self.target_labels = target_labels

    @torch.no_grad()
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        start = time.perf_counter()
        sequences = list(batch["input_ids"])
        lengths = [len(s) for s in sequences]
        ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, sequence in enumerate(sequences):  # right padding: padded slots never feed real tokens
            ids[i, : lengths[i]] = torch.from_numpy(np.asarray(sequence, dtype=np.int64))
            attention[i, : lengths[i]] = 1
        device = self.target.device
        run = self.target.forward if self.target_labels else self.target.features
        out = run(ids.to(device), layer_ids=self.layer_ids, final_hidden=self.final_hidden,
                  attention_mask=attention.to(device))
        result = {"input_ids": sequences, "loss_mask": list(batch["loss_mask"]),
                  "features": [to_numpy(out.features[i, :n], self.dtype) for i, n in enumerate(lengths)]}
        if self.target_labels:
            choice = out.logits.argmax(dim=-1).to(torch.int32).cpu()
            result["target_next"] = [choice[i, :n].numpy() for i, n in enumerate(lengths)]
        if self.final_hidden:
            result["final_hidden"] = [to_numpy(out.final_hidden[i, :n], self.dtype) for i, n in enumerate(lengths)]
        seconds = time.perf_counter() - start
        result["target_seconds"] = [seconds / len(sequences)] * len(sequences)
        return result


def regenerated(rows: ray.data.Dataset, cfg: PipelineConfig, target_path: str) -> ray.data.Dataset:
    """Prompts -> the target's own answers. Only token ids come out (4 bytes a token), so the caller
    can keep them in memory across epochs instead of generating again."""
    return rows.map_batches(
        Regenerate, fn_constructor_kwargs=dict(
            target_path=target_path, cpus=cfg.feature_cpus, gpus=cfg.feature_gpus,
            max_length=cfg.max_length, max_new_tokens=cfg.regenerate_tokens),
        compute=ray.data.ActorPoolStrategy(size=cfg.regenerate_actors), batch_size=cfg.regenerate_batch_size,
        num_cpus=cfg.feature_cpus, num_gpus=cfg.feature_gpus, batch_format="numpy")


def with_features(rows: ray.data.Dataset, cfg: PipelineConfig, target_path: str, layer_ids: list[int]) -> ray.data.Dataset:
    """Token sequences -> token ids, loss mask, features (and final hidden states), on an actor pool."""
    return rows.map_batches(
        TargetFeatures, fn_constructor_kwargs=dict(
            target_path=target_path, cpus=cfg.feature_cpus, gpus=cfg.feature_gpus, layer_ids=layer_ids,
            final_hidden=cfg.distill, dtype=cfg.feature_dtype, target_labels=cfg.labels == "target",
            compute_dtype=cfg.compute_dtype),
        compute=ray.data.ActorPoolStrategy(size=cfg.feature_actors), batch_size=cfg.feature_batch_size,
        num_cpus=cfg.feature_cpus, num_gpus=cfg.feature_gpus, batch_format="numpy")
