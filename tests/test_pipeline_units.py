"""The pipeline's pieces that need no cluster: config parsing, row normalisation, tokenisation with
assistant-only loss masks, feature transport and the padding collate."""

import json
import logging
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from domino.errors import DominoError
from domino.embedded import cache_dir
from pipelines.training import checkpoints
from pipelines.training.config import PipelineConfig, parse_args
from pipelines.training.data import (TOO_LONG, MalformedRow, embedded_sharegpt, list_files, repeated, survey,
                                     to_messages, tokenize_batch, tokenized_conversations)
from pipelines.training.features import from_numpy, to_numpy
from pipelines.training.trainer import Feed, PadCollate, train_config
from pipeline_helpers import conversation, write_jsonl


@pytest.fixture(scope="module")
def tokenizer_path(embedded_target):
    return str(cache_dir() / "smollm2-135m")


def test_config_defaults_overrides_and_files(tmp_path):
    assert parse_args([]) == PipelineConfig()
    path = tmp_path / "run.yaml"
    path.write_text("steps: 50\nrun_name: from-file\nlr: 1e-3\n")
    cfg = parse_args(["--config", str(path), "steps=7", "regenerate=false", "storage_path=s3://bucket/runs/"])
    assert (cfg.steps, cfg.run_name, cfg.lr, cfg.regenerate) == (7, "from-file", 1e-3, False)
    assert cfg.storage_uri == "s3://bucket/runs"
    assert parse_args(["storage_path=~/x"]).storage_uri.endswith("/x")
    path.write_text("run_name: 2024\n")  # a name that YAML reads as a number is still that name
    assert parse_args(["--config", str(path)]).run_name == parse_args(["run_name=2024"]).run_name == "2024"
    ds = cfg.deepspeed()
    assert ds["zero_optimization"]["stage"] == 2 and ds["train_micro_batch_size_per_gpu"] == cfg.batch_size
    assert ds["optimizer"]["params"]["lr"] == 1e-3 and ds["optimizer"]["params"]["torch_adam"] is True
    objective = train_config(parse_args(["decay=3.5", "confidence_weight=0.25"]), torch.device("cpu")).objective
    assert (objective.decay, objective.confidence_weight) == (3.5, 0.25)
    assert train_config(parse_args(["compute_dtype=bfloat16"]), torch.device("cpu")).objective.compute_dtype == "bfloat16"
    assert train_config(parse_args(["compute_dtype=float32"]), torch.device("cuda")).objective.compute_dtype == "float32"
    assert train_config(parse_args([]), torch.device("cuda")).objective.compute_dtype == "bfloat16"


def test_help_prints_each_default_as_the_command_line_reads_it():
    """`train.py --help` lists `key = default`; typed back as key=default, each gives the default itself
    (a null default printed as Python's None would come back as the string 'None' and fail)."""
    from pipelines.training.config import help_text

    printed = dict(line.split("  # ")[0].strip().split(" = ", 1) for line in help_text().splitlines()[2:])
    assert set(printed) == set(PipelineConfig.model_fields) and printed["minutes"] == "null"
    assert parse_args([f"{key}={value}" for key, value in printed.items()]) == PipelineConfig()


@pytest.mark.parametrize("args, message", [
    (["stepz=3"], "unknown config key 'stepz' (did you mean 'steps'?)"),
    (["steps=0"], "steps: Input should be greater than or equal to 1"),
    (["steps=abc"], "steps: Input should be a valid integer"),
    (["head=lstm"], "head must be one of none, domino, sglang-domino, markov, rnn"),
    (["log_every=7", "checkpoint_every=10"], "checkpoint_every (10) must be a multiple of log_every (7)"),
    (["fail_at_step=500", "steps=100"], "fail_at_step (500) must be below steps (100)"),
    (["steps"], "expected key=value or --config FILE, got 'steps'"),
    (["--config", "/nonexistent/run.yaml"], "cannot read config file /nonexistent/run.yaml"),
    (["data="], "data: String should have at least 1 character"),
    (["target="], "target: String should have at least 1 character"),
    (["run_name=../../elsewhere"], "run_name names one folder under storage_path: no '/' in it"),
    (["run_name=.."], "run_name names one folder under storage_path"),
    (["deepspeed_config=/nonexistent.json"], None),  # checked when the DeepSpeed config is read
])
def test_bad_config_is_one_clear_line(args, message):
    if message is None:
        with pytest.raises(DominoError, match="deepspeed_config: cannot read /nonexistent.json"):
            parse_args(args).deepspeed()
        return
    with pytest.raises(DominoError) as error:
        parse_args(args)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_config_files_must_be_a_mapping_and_bad_yaml_is_placed(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- steps\n")
    with pytest.raises(DominoError, match="must hold a mapping"):
        parse_args(["--config", str(path)])
    path.write_text("steps: 50\nlr: [1e-3\nseed: 1\n")
    with pytest.raises(DominoError, match=r"list.yaml is not valid YAML \(line 3, column 5\)"):
        parse_args(["--config", str(path)])
    path.write_text("[1, 2]")
    with pytest.raises(DominoError, match="deepspeed_config: .*list.yaml holds a JSON list, not an object"):
        parse_args([f"deepspeed_config={path}"]).deepspeed()
    # a value both files could set would be silently the pipeline's: the DeepSpeed file may not set it
    path.write_text(json.dumps({"gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                "gradient_accumulation_steps": 4}))
    with pytest.raises(DominoError, match=r"sets gradient_clipping \(the pipeline's grad_clip\), optimizer.params.lr "
                                          r"\(the pipeline's lr\), gradient_accumulation_steps"):
        parse_args([f"deepspeed_config={path}"]).deepspeed()


@pytest.mark.parametrize("args, message", [
    (["lookup_ngram=2", "lookup_min_ngram=3"], "lookup_min_ngram must be between 1 and lookup_ngram (2), got 3"),
    (["deepspeed_config=/nonexistent.json"], "deepspeed_config: cannot read /nonexistent.json"),
    (["data=/nonexistent/chats.jsonl"], "data path /nonexistent/chats.jsonl does not exist"),
    (["max_length=100000"], "max_length 100000 is longer than the target's context (8192 tokens)"),
])
def test_the_main_job_refuses_a_bad_config_before_ray_starts(monkeypatch, args, message):
    from pipelines import train

    def connect():
        raise AssertionError("Ray was started before the config was checked")
    monkeypatch.setattr(train, "connect", connect)
    with pytest.raises(DominoError) as error:
        train.run(parse_args(args))
    assert message in str(error.value)


def test_too_few_conversations_name_the_ones_held_out():
    from pipelines.training.data import Survey, check_survey

    with pytest.raises(DominoError, match="has 1 conversations to train on.*; eval_prompts=8 holds out 7 of them"):
        check_survey(Survey(rows=8, trainable=1, held_rows=7), PipelineConfig(batch_size=2))


def test_rows_normalise_from_both_formats():
    sharegpt, openai = conversation(1, "sharegpt"), conversation(1, "openai")
    assert to_messages(sharegpt) == to_messages(openai) == to_messages({"json_line": json.dumps(openai)})
    # ShareGPT chunks that open mid-conversation lose the answers that have no question before them
    chunk = {"conversations": [{"from": "gpt", "value": "tail"}, {"from": "human", "value": "q"},
                               {"from": "gpt", "value": "a"}]}
    assert [m["role"] for m in to_messages(chunk)] == ["user", "assistant"]


@pytest.mark.parametrize("row, reason", [
    ({"json_line": "{oops"}, "not valid JSON"),
    ({"json_line": "[1, 2]"}, "not a JSON object"),
    ({"text": "hi"}, "no 'conversations' or 'messages' field"),
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "user"}]}, "a turn without a text 'content'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn after a user turn"),
])
def test_malformed_rows_name_their_reason(row, reason):
    with pytest.raises(MalformedRow, match=reason):
        to_messages(row)


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    rows = [{"json_line": json.dumps(conversation(3, "openai"))}, {"json_line": "{oops"}]
    out = tokenize_batch(pa.Table.from_pylist(rows), tokenizer_path, 512)
    assert out["error"] == ["", "not valid JSON"]
    ids, mask = out["input_ids"][0], out["loss_mask"][0]
    trained = tokenizer.decode(ids[mask])
    assert trained == "3 plus 3 is 6.<|im_end|>\n3 times two is 6, the same.<|im_end|>\n"
    assert "Question 3" in tokenizer.decode(ids[~mask]) and "And times two?" in tokenizer.decode(ids[~mask])
    assert json.loads(out["prompt"][0]) == [{"role": "user", "content": "Question 3: what is 3 plus 3?"}]
    # cut to a window that ends inside the prompt: nothing to learn, skipped (not malformed)
    short = tokenize_batch(pa.Table.from_pylist(rows[:1]), tokenizer_path, 20)
    assert short["error"] == [TOO_LONG] and len(short["input_ids"][0]) == 20


def test_the_embedded_target_tokenises_by_its_name(embedded_target):
    """Tasks on other nodes get the embedded target's name (the converted folder lies on the driver's node)."""
    from domino.target import resolve_target

    rows = pa.Table.from_pylist([{"json_line": json.dumps(conversation(2, "openai"))}])
    by_name = tokenize_batch(rows, "smollm2-135m", 256)
    assert by_name["error"] == [""]
    by_path = tokenize_batch(rows, resolve_target("smollm2-135m"), 256)
    assert by_name["input_ids"][0].tolist() == by_path["input_ids"][0].tolist()


def test_embedded_sharegpt_reads_the_first_conversations():
    rows = embedded_sharegpt(3)
    assert len(rows) == 3 and json.loads(rows[0])["id"] == "QWJhYvA_0"


def test_data_paths_are_checked(tmp_path):
    with pytest.raises(DominoError, match="does not exist"):
        list_files(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DominoError, match="no .jsonl, .json or .parquet files"):
        list_files(str(tmp_path))
    with pytest.raises(DominoError, match="neither JSON"):
        list_files(str(write_jsonl(tmp_path / "rows.txt", [])))
    path = write_jsonl(tmp_path / "rows.jsonl", [conversation(0)])
    assert list_files(str(tmp_path)) == [str(path)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_features_travel_as_numpy_and_pad_into_batches(dtype):
    features = [torch.randn(n, 6) for n in (3, 5)]
    batch = {"input_ids": np.array([np.arange(3), np.arange(5)], dtype=object),
             "loss_mask": np.array([np.ones(3, bool), np.ones(5, bool)], dtype=object),
             "features": np.array([to_numpy(f, dtype) for f in features], dtype=object),
             "target_seconds": np.array([0.5, 0.25])}
    out = PadCollate(dtype)(batch)
    assert out["input_ids"].shape == (2, 5) and out["lengths"].tolist() == [3, 5]
    assert out["loss_mask"].sum() == 8 and float(out["target_seconds"]) == 0.75
    tolerance = 1e-2 if dtype == "bfloat16" else 1e-3
    assert torch.allclose(out["features"][0, :3].float(), features[0], atol=tolerance, rtol=tolerance)
    assert (out["features"][0, 3:] == 0).all()
    assert from_numpy(to_numpy(features[1], dtype), dtype).dtype == getattr(torch, dtype)
    shared = to_numpy(features[1], dtype)
    shared.setflags(write=False)  # as arrays from Ray's object store arrive
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_numpy(shared, dtype)


def test_target_labels_pad_into_batches():
    batch = {"input_ids": np.array([np.arange(3), np.arange(5)], dtype=object),
             "loss_mask": np.array([np.ones(3, bool), np.ones(5, bool)], dtype=object),
             "target_next": np.array([np.array([7, 8, 9], np.int32), np.arange(5, dtype=np.int32)], dtype=object),
             "target_seconds": np.array([0.5, 0.25])}
    out = PadCollate("float32")(batch)
    assert out["target_next"].tolist() == [[7, 8, 9, 0, 0], [0, 1, 2, 3, 4]]


def test_replay_follows_each_streamed_batch_with_batches_from_memory(ray_cluster):
    """replay=3: every third batch is streamed, the two after it come from the streamed ones kept in
    memory (at most replay_memory of them); only streamed tokens count as data."""
    rows = [{"input_ids": np.arange(i + 2), "loss_mask": np.ones(i + 2, bool), "target_seconds": 0.0} for i in range(8)]
    cfg = PipelineConfig(batch_size=2, replay=3, replay_memory=2, feature_dtype="float32")
    feed = Feed(ray_cluster.data.from_items(rows).iterator(), cfg, torch.device("cpu"), seed=0)
    seen = [int(next(feed)["lengths"].sum()) for _ in range(12)]
    streamed = seen[0::3]
    assert sorted(streamed) == sorted([2 + 3, 4 + 5, 6 + 7, 8 + 9])  # every row once per epoch
    for i in range(4):
        remembered = streamed[max(0, i - 1): i + 1]  # the memory holds the last two streamed batches
        assert set(seen[3 * i + 1: 3 * i + 3]) <= set(remembered)
    assert feed.tokens == sum(streamed[1:])  # the counters start at the first batch


@pytest.mark.parametrize("steps, replay, workers, rows", [(7, 2, 1, 8), (12, 3, 2, 16), (2, 1, 1, 4)])
def test_the_stream_holds_the_runs_batches_and_ends_with_them(ray_cluster, steps, replay, workers, rows):
    """The rows of every epoch the run needs, and no row more: a stream that went on past the last batch
    left feature tasks running when the run ended, and Ray logged their actor's kill as a failed task."""
    cfg = PipelineConfig(steps=steps, replay=replay, batch_size=2, num_workers=workers)
    data = ray_cluster.data.from_items([{"i": i} for i in range(5)])
    stream = [row["i"] for row in repeated(data, 5, cfg).take_all()]
    assert len(stream) == rows and set(stream) <= set(range(5))


def test_held_out_prompts_are_the_datas_first_however_its_blocks_finish(ray_cluster, tmp_path, tokenizer_path):
    """The evaluation holds out the first `eval_prompts` distinct prompts in the data's order, even when a
    later file's rows are tokenised first (here the first file's answers are long, so slow to tokenise):
    a run's held-out prompts, and so its closing tau, must not depend on which task finished first."""
    folder = tmp_path / "chats"
    folder.mkdir()
    long_answer = "and so on " * 20_000
    write_jsonl(folder / "a.jsonl", [{"messages": [{"role": "user", "content": f"Slow question {i}?"},
                                                   {"role": "assistant", "content": long_answer}]} for i in range(48)])
    write_jsonl(folder / "b.jsonl", [conversation(i) for i in range(48)])
    cfg = PipelineConfig(data=str(folder), max_conversations=0, eval_prompts=2, max_length=64)
    found = survey(tokenized_conversations(cfg, tokenizer_path), cfg, vocab_size=49152)
    assert [json.loads(p)[0]["content"] for p in found.held_out] == ["Slow question 0?", "Slow question 1?"]
    assert (found.rows, found.held_rows, found.trainable) == (96, 2, 94)


def test_a_json_file_may_hold_one_array_of_conversations(ray_cluster, tmp_path, tokenizer_path):
    """ShareGPT's own dumps are one JSON array, indented, in a `.json` file: its elements are the rows, in
    their order, beside JSON Lines in the same folder, and a file of one indented conversation is one
    row; an array cut off is named in one line."""
    folder = tmp_path / "chats"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps([conversation(i, "sharegpt") for i in range(6)], indent=2))
    write_jsonl(folder / "b.json", [conversation(i, "openai") for i in range(6, 10)])
    cfg = PipelineConfig(data=str(folder), max_conversations=0, eval_prompts=2, max_length=64)
    found = survey(tokenized_conversations(cfg, tokenizer_path), cfg, vocab_size=49152)
    first = [conversation(i, "sharegpt")["conversations"][0]["value"] for i in range(2)]
    assert [json.loads(p)[0]["content"] for p in found.held_out] == first
    assert (found.rows, found.held_rows, found.trainable, sum(found.malformed.values())) == (10, 2, 8, 0)
    (folder / "c.json").write_text(json.dumps(conversation(10, "openai"), indent=2))  # one conversation
    found = survey(tokenized_conversations(cfg, tokenizer_path), cfg, vocab_size=49152)
    assert (found.rows, found.trainable, sum(found.malformed.values())) == (11, 9, 0)
    (folder / "a.json").write_text(json.dumps([conversation(0, "sharegpt")] * 3)[:-40])
    with pytest.raises(DominoError, match=r"cannot read .*: .*a.json starts as a JSON array but is not one"):
        survey(tokenized_conversations(cfg, tokenizer_path), cfg, vocab_size=49152)


def test_parquet_files_of_either_format_mix_with_json(ray_cluster, tmp_path, tokenizer_path):
    """Parquet rows become rows as JSON's do: two Parquet files with different columns (ShareGPT's and
    OpenAI's), one with a null column, beside JSON Lines, all train; none is called malformed."""
    folder = tmp_path / "chats"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist([conversation(i, "sharegpt") for i in range(5)]), folder / "a.parquet")
    openai = [conversation(i, "openai") for i in range(5, 10)]
    pq.write_table(pa.Table.from_pylist([{**row, "conversations": None} for row in openai]), folder / "b.parquet")
    write_jsonl(folder / "c.jsonl", [conversation(i, "openai") for i in range(10, 14)])
    cfg = PipelineConfig(data=str(folder), max_conversations=0, eval_prompts=2, max_length=64)
    found = survey(tokenized_conversations(cfg, tokenizer_path), cfg, vocab_size=49152)
    assert (found.rows, found.held_rows, found.trainable, dict(found.malformed)) == (14, 2, 12, {})


def test_gpu_check_parses_its_arguments_into_a_valid_config(tmp_path):
    from pipelines.benchmarks.gpu_check import SHAPES, arguments, pipeline_config

    args, overrides = arguments(["--shape", "1.7b", "--steps", "20", "lr=1e-4"])
    cfg = pipeline_config(args, "/models/qwen3-random", str(tmp_path), overrides)
    assert args.shape in SHAPES and cfg.steps == cfg.checkpoint_every == 20 and cfg.lr == 1e-4
    assert cfg.use_gpu and cfg.feature_gpus + cfg.trainer_gpus == 1 and cfg.draft_layers == 5
    with pytest.raises(DominoError, match="unknown config key 'stepz'"):
        pipeline_config(args, "/models/qwen3-random", str(tmp_path), ["stepz=3"])


def test_benchmark_report_counts_the_cache_it_avoided_and_what_was_written(tmp_path):
    from domino.config import DrafterConfig
    from pipelines.benchmarks.pipeline import cache_bytes_per_token, report
    from pipelines.train import RunOutcome

    cfg = parse_args([f"storage_path={tmp_path}", "run_name=r"])
    drafter = DrafterConfig(target_hidden_size=576, target_vocab_size=49152, target_num_layers=30,
                            target_layer_ids=[15], mask_token_id=0)
    assert cache_bytes_per_token(cfg, drafter) == 576 * 2 + 5  # bf16 features, int32 id, mask flag
    (tmp_path / "r" / "step_000001").mkdir(parents=True)
    (tmp_path / "r" / "step_000001" / "weights").write_bytes(b"x" * 2**20)
    metrics = {"run_feature_tokens_per_s": 300.0, "run_train_tokens_per_s": 150.0, "run_data_wait": [0.05],
               "run_tokens": 1000.0, "first_batch_s": 12.0}
    text = report(cfg, RunOutcome(drafter, epoch_tokens=2**20, metrics=metrics), 600)
    assert "| producer capacity / trainer demand | 2.00 |" in text
    assert "| data wait per trainer (share of wall time after the first batch) | 5.0% |" in text
    assert "| offline cache for one epoch (1048576 tokens) | 1.13 GiB |" in text
    assert "| written by the run: checkpoints in storage_path | 1.0 MiB |" in text


@pytest.mark.parametrize("minutes, planned, length", [
    (80, 2910, 2910),  # the budget cut the plan before the checkpoint: finish it, whatever the clock says
    (80, 6000, 6000),  # written before the cut (or the budget kept every step): all steps, still to be fitted
    (80, None, 6000),  # a checkpoint older than the budget
    (None, 2910, 6000),  # the budget taken away: all steps again
])
def test_a_resumed_run_finishes_the_plan_its_budget_cut(minutes, planned, length):
    cfg = PipelineConfig(steps=6000, minutes=minutes)
    assert checkpoints.steps_to_finish(cfg, planned) == length
    state = checkpoints.RunState(uri="", step=length, planned_steps=planned, world_size=1,
                                 drafter=None, config={})
    assert state.finished(cfg) and not checkpoints.RunState(**{**vars(state), "step": length - 1}).finished(cfg)


def test_a_rerun_names_every_setting_changed_since_its_checkpoint_steps_too():
    """Raising `steps` extends a finished run, so the resume line says so, like any other change."""
    written = PipelineConfig(steps=60)
    state = checkpoints.RunState(uri="", step=60, planned_steps=60, world_size=1, drafter=None,
                                 config=written.model_dump())
    assert state.changed(written) == "" and state.finished(written)
    longer = PipelineConfig(steps=80, lr=1e-3)
    assert state.changed(longer) == "steps 60 -> 80, lr 0.002 -> 0.001" and not state.finished(longer)


def test_a_command_interrupted_with_ctrl_c_ends_in_one_line(capsys):
    from pipelines.training.errors import exit_status

    def interrupted():
        raise KeyboardInterrupt

    assert exit_status(interrupted) == 130
    assert capsys.readouterr().err == "interrupted\n"  # the command's own line says what is kept


def test_ray_notices_a_user_can_do_nothing_about_are_quiet_and_warnings_are_not():
    """The token-authentication notice of a private cluster (its absence still warns), and Ray Train's
    worker-group start-up lines (the job's own line reports the workers)."""
    from ray._private.authentication import authentication_token_setup as auth
    from ray.train.v2._internal.execution.worker_group import worker_group

    from pipelines.train import quiet_ray_notices

    quiet_ray_notices()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    for logger in (auth.logger, worker_group.logger):
        logger.addHandler(handler)
    try:
        auth._warn_token_auth_enabled()
        auth._warn_token_auth_disabled()
        worker_group.logger.info("Started training worker group of size 1")
        worker_group.logger.warning("a worker died")
    finally:
        for logger in (auth.logger, worker_group.logger):
            logger.removeHandler(handler)
    assert [r.getMessage()[:41] for r in records] == ["Token authentication is disabled for this", "a worker died"]


def test_a_domino_error_from_a_ray_task_is_one_line(capsys):
    """Ray wraps a task's DominoError in a RayTaskError that is also a DominoError, whose text carries the
    task's traceback: the command line prints the reason alone."""
    import traceback

    from ray.exceptions import RayTaskError

    from pipelines.training.errors import exit_status

    try:
        raise DominoError("the held-out prompt is longer than the context")
    except DominoError as error:
        wrapped = RayTaskError("evaluate", traceback.format_exc(), error).as_instanceof_cause()

    def command():
        raise wrapped
    assert exit_status(command) == 2
    assert capsys.readouterr().err == "error: the held-out prompt is longer than the context\n"
