"""The benchmark harness: metric arithmetic on known traces, a tiny end-to-end run, bad input."""

import json
import re

import pytest
import torch

from domino.errors import DominoError
from domino.requests import GenerationStats
from pipelines import bench
from pipelines.benchmarks import side_by_side
from pipelines.benchmarks.methods import Output, make_method
from pipelines.benchmarks.prompts import load_prompt_set
from pipelines.benchmarks.report import Row, compare_with_baseline
from helpers import tiny_drafter


def trace(tokens, seconds, accept_lengths, proposed, accepted, draft=0.0, verify=0.0):
    stats = GenerationStats(accept_lengths=accept_lengths, proposed=proposed, accepted=accepted,
                            draft_s=draft, verify_s=verify, total_s=seconds)
    return Output(tokens, seconds, stats)


def test_metric_arithmetic_on_known_traces():
    plain, fast = Row("autoregressive", "d"), Row("domino", "d")
    plain.add(trace([1, 2, 3, 4], 4.0, [1, 1, 1], [], []))
    plain.add(trace([5, 6], 2.0, [1], [], []))
    # round 1: 3 drafts verified, 2 accepted (commits 3); round 2: 2 verified, 0 accepted (commits 1)
    fast.add(trace([1, 2, 3, 4, 5], 1.0, [3, 1], [2, 2, 1], [1, 1, 0], draft=0.2, verify=0.5))
    fast.add(trace([5, 6], 1.0, [1], [1], [0], draft=0.1, verify=0.6))
    compare_with_baseline({("autoregressive", "d"): plain, ("domino", "d"): fast},
                          {("autoregressive", "d"): [[1, 2, 3, 4], [5, 6]], ("domino", "d"): [[1, 2, 3, 4, 5], [5, 6]]})
    assert plain.tokens_per_second == 1.0 and fast.tokens_per_second == 3.5
    assert fast.speedup == 3.5 and plain.speedup == 1.0
    assert fast.tau == pytest.approx(5 / 3)
    assert fast.acceptance == [pytest.approx(1 / 3), 0.5, 0.0]
    assert fast.other_s == pytest.approx(2.0 - 0.3 - 1.1)
    assert plain.lossless is True and fast.lossless is False


def test_tiny_end_to_end_run(tmp_path, embedded_target):
    data = tmp_path / "two.jsonl"
    data.write_text(json.dumps({"turns": ["Say hi.", "Now say bye."]}) + "\n")
    out = tmp_path / "out"
    code = bench.main(["run", "--datasets", str(data), "humaneval", "--prompts", "1", "--max-new-tokens", "6",
                       "--methods", "hf-generate", "oracle", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["dataset"]): r for r in results["rows"]}
    assert set(rows) == {(m, d) for m in ("autoregressive", "hf-generate", "oracle") for d in ("two", "humaneval")}
    assert rows[("oracle", "two")]["generations"] == 2  # two turns, answered in turn
    assert all(r["lossless"] for r in rows.values())
    assert rows[("oracle", "humaneval")]["tau"] > 1
    assert (out / "acceptance.png").stat().st_size > 0 and (out / "speedup.png").stat().st_size > 0
    table = (out / "results.md").read_text()
    assert "| two | oracle |" in table
    header, _, *lines = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    columns = header.index("prefill"), header.index("other")  # the time split, whole: its shares add to 100%
    for line in lines:
        if line[columns[0]] != "-":
            assert sum(int(share.rstrip("%")) for share in line[columns[0]:columns[1] + 1]) in range(98, 103)


def test_several_verify_policies_run_side_by_side(tmp_path, embedded_target):
    path = tmp_path / "drafter"
    tiny_drafter(embedded_target, num_layers=1, confidence_head=True, lookup_ngram=2).save_pretrained(path)
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"turns": ["Repeat after me: one two three, one two three."]}) + "\n")
    out = tmp_path / "out"
    assert bench.main(["run", "--datasets", str(data), "--prompts", "1", "--max-new-tokens", "8", "--methods",
                       f"d={path}", "--verify", "full", "threshold", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"autoregressive", "d (full)", "d (threshold)"}
    assert all(r["lossless"] for r in rows.values())


def test_sampled_run_is_seeded_and_claims_no_token_equality(tmp_path, embedded_target):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"turns": ["Name a colour."]}) + "\n")
    runs = []
    for name in ("a", "b"):
        code = bench.main(["run", "--datasets", str(data), "--prompts", "1", "--max-new-tokens", "5", "--methods",
                           "oracle", "--temperature", "1", "--seed", "3", "--out", str(tmp_path / name)])
        assert code == 0
        runs.append({r["method"]: r for r in json.loads((tmp_path / name / "results.json").read_text())["rows"]})
    for method in ("autoregressive", "oracle"):
        assert runs[0][method]["lossless"] is None  # sampled outputs differ from plain decoding's by design
        for key in ("tokens", "rounds", "accepted"):  # the same seed draws the same numbers
            assert runs[0][method][key] == runs[1][method][key]
    with pytest.raises(SystemExit):
        bench.main(["run", "--temperature", "-1"])


def test_bad_input_is_named(tmp_path, embedded_target, capsys):
    with pytest.raises(DominoError, match="neither an embedded set"):
        load_prompt_set(str(tmp_path / "missing.jsonl"), 5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"question": "no turns"}\n')
    with pytest.raises(DominoError, match=r"bad.jsonl:2: expected a JSON object with a \"turns\" list"):
        load_prompt_set(str(bad), 5)
    bad.write_text('{"turns": []}\n')
    with pytest.raises(DominoError, match="non-empty list"):
        load_prompt_set(str(bad), 5)
    with pytest.raises(DominoError, match="unknown method 'beam'"):
        make_method("beam", embedded_target)
    assert bench.main(["run", "--datasets", str(tmp_path / "nope.jsonl")]) == 2
    assert "error: dataset" in capsys.readouterr().err
    # every benchmark's bad input ends in one line and exit 2, not a traceback
    assert bench.main(["run", "--datasets", "gsm", "--methods", f"d={tmp_path / 'gone'}"]) == 2
    assert f"no drafter checkpoint folder at {tmp_path / 'gone'}" in capsys.readouterr().err
    tiny_drafter(embedded_target, num_layers=1).save_pretrained(tmp_path / "plain")  # no confidence head
    assert bench.main(["run", "--datasets", "gsm", "--methods", f"p={tmp_path / 'plain'}", "--verify", "threshold"]) == 2
    assert f"error: method 'p={tmp_path / 'plain'}': verify 'threshold' needs" in capsys.readouterr().err
    assert bench.main(["drafter-costs", "--block-size", "999"]) == 2
    out, err = capsys.readouterr()
    assert "block_size must be between 2 and 64" in err and "|" not in out  # no table half printed
    assert bench.main(["batching", "--drafter", str(tmp_path / "gone")]) == 2
    assert "error: no drafter checkpoint at" in capsys.readouterr().err
    assert bench.main(["batching", "--drafter", str(tmp_path / "plain")]) == 2  # (c) needs a confidence head
    out, err = capsys.readouterr()
    assert "verify 'confidence' needs a drafter trained with a confidence head" in err and "|" not in out
    assert bench.main(["engine", "--target", str(tmp_path / "gone")]) == 2
    assert "error: target" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:  # not a table of nan
        bench.main(["load", "--url", "x=http://127.0.0.1:1", "--clients", "0"])
    assert exit.value.code == 2 and "--clients, --requests" in capsys.readouterr().err
    for url, message in [("x=notaurl", "notaurl is not an http(s) URL"),
                         ("x=http://127.0.0.1:1", "nothing answers at http://127.0.0.1:1 (ConnectionError)")]:
        with pytest.raises(SystemExit, match=re.escape(message)):  # before any request, not a table of errors
            bench.main(["load", "--url", url])


def test_a_run_that_could_not_report_correctly_is_refused_before_it_decodes(tmp_path, embedded_target, capsys):
    """Rows are keyed by method name, so two drafters of one name would share a row (judged lossless or not
    against one baseline), and a drafter named like a built-in would join its row. A report folder that
    cannot be made, or a prompts file that is not UTF-8, would end the run late or with a traceback."""
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"turns": ["Say hi."]}) + "\n")
    for run in ("a", "b"):
        tiny_drafter(embedded_target, num_layers=1).save_pretrained(tmp_path / run / "drafter")
    same_names = [str(tmp_path / run / "drafter") for run in ("a", "b")]
    assert bench.main(["run", "--datasets", str(data), "--prompts", "1", "--methods", *same_names,
                       "--out", str(tmp_path / "out")]) == 2
    assert "several methods are named drafter" in capsys.readouterr().err
    assert bench.main(["run", "--datasets", str(data), "--methods", f"autoregressive={same_names[0]}"]) == 2
    assert "'autoregressive' names a built-in method" in capsys.readouterr().err
    assert bench.main(["run", "--datasets", str(data), "--methods", "oracle", "--out", str(data)]) == 2
    assert f"--out {data}: cannot make the report's folder" in capsys.readouterr().err
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"turns": ["caf\xe9"]}\n')
    assert bench.main(["run", "--datasets", str(binary)]) == 2
    assert "binary.jsonl is not UTF-8 text" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert bench.main(["dflash-race", "--drafter", same_names[0]]) == 2  # z-lab's loop reads DFlash checkpoints only
    assert "is a domino checkpoint, and z-lab's loop reads DFlash ones" in capsys.readouterr().err


def test_the_ablation_measures_learned_drafts_alone_unless_told_otherwise():
    # copies from the text would be most of every head's tau, hiding what the ablation compares
    assert side_by_side.parse_args([], ablation=True).lookup == 0
    assert side_by_side.parse_args(["--lookup", "3"], ablation=True).lookup == 3
    assert side_by_side.parse_args([], ablation=False).lookup is None  # run: each checkpoint's own


def test_embedded_prompt_sets_load_and_sharegpt_is_held_out_of_training():
    from pipelines.training.data import MalformedRow, embedded_sharegpt, to_messages

    for name in ("humaneval", "mt-bench", "gsm"):
        conversations = load_prompt_set(name, 2).conversations
        assert len(conversations) == 2
        assert all(turns and all(isinstance(t, str) and t for t in turns) for turns in conversations)
    held_out = [turns[0] for turns in load_prompt_set("sharegpt", 3).conversations]
    assert len(held_out) == 3 and all(held_out)
    trained_on = set()  # user turns of the conversations the pipeline reads, from the start of the file
    for line in embedded_sharegpt(1200):
        try:
            trained_on |= {m["content"].strip() for m in to_messages({"json_line": line}) if m["role"] == "user"}
        except MalformedRow:
            continue
    assert not set(held_out) & trained_on


def test_the_load_test_takes_a_servers_root_or_its_openai_base_url():
    from pipelines.benchmarks.load import server_root

    for url in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/"):
        assert server_root(url) == "http://127.0.0.1:8000"
    assert server_root("http://127.0.0.1:8000/plain/v1") == "http://127.0.0.1:8000/plain"


def test_one_command_runs_every_benchmark(capsys):
    """`python -m pipelines.bench COMMAND`: each command's module exists and answers --help under its own name."""
    assert bench.main(["--help"]) == 0
    listed = capsys.readouterr().out
    for command in bench.COMMANDS:
        assert command in listed
        try:
            code = bench.main([command, "--help"])
        except SystemExit as exit:  # argparse's --help
            code = exit.code
        assert code == 0, command
        assert capsys.readouterr().out.strip(), command
    assert bench.main(["no-such-benchmark"]) == 2
    assert "unknown benchmark 'no-such-benchmark'" in capsys.readouterr().err


def test_learning_curve_measures_saved_checkpoints(tmp_path, embedded_target, capsys):
    """`learning-curve --checkpoints`: one row per saved drafter; its 'held-out tau' is the learned drafter
    alone even when the checkpoint turns context lookup on, which the next column then measures."""
    path = tmp_path / "step_000001" / "drafter"
    tiny_drafter(embedded_target, num_layers=1, lookup_ngram=3).save_pretrained(path)
    assert bench.main(["learning-curve", "--checkpoints", str(path), "--held-out", "2", "--new-tokens", "32"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {path} |"))
    alone, with_lookup, shuffled = (float(cell) for cell in row.split("|")[2:5])
    assert alone < 1.05 and shuffled < 1.05  # random weights: hardly a learned draft passes
    assert with_lookup > alone + 0.1  # the target's greedy answers repeat themselves
    assert bench.main(["learning-curve", "--checkpoints", str(tmp_path / "missing")]) == 2
    assert f"error: no drafter checkpoint at {tmp_path / 'missing'}" in capsys.readouterr().err


def test_gpu_drafter_halves_make_drafters_the_pipeline_would(tmp_path, embedded_target, capsys):
    """`gpu-drafter prepare` here, `train` where a GPU is (tried on CPU): the pipeline's drafter config
    and draft vocabulary travel in the data folder, and the drafters saved at a quarter, half and all
    of the steps load for the target. A folder `prepare` did not write, or no GPU, is named in one line."""
    from domino.drafter import Drafter

    data, out = tmp_path / "data", tmp_path / "drafters"
    assert bench.main(["gpu-drafter", "prepare", "--out", str(data), "--conversations", "12",
                       "max_length=128", "batch_size=2", "draft_vocab_size=512"]) == 0
    settings = json.loads((data / "config.json").read_text())
    assert settings["drafter"]["head"] == "markov" and settings["drafter"]["draft_vocab_size"] == 512
    assert len(settings["draft_vocabulary"]) == 512 and settings["train"]["objective"]["compute_dtype"] == "bfloat16"
    settings["train"]["objective"]["compute_dtype"] = "float32"  # bfloat16 products are emulated on most CPUs
    (data / "config.json").write_text(json.dumps(settings))
    assert bench.main(["gpu-drafter", "train", "--data", str(data), "--out", str(out), "--minutes", "0.3",
                       "--device", "cpu"]) == 0
    steps = int(re.findall(r"step \d+/(\d+) ", capsys.readouterr().out)[-1])
    saved = sorted(out.iterdir())
    assert 1 <= len(saved) <= 3 and saved[-1].name == f"step_{steps:06d}"
    for folder in saved:
        drafter = Drafter.from_pretrained(folder, embedded_target)
        assert drafter.config.draft_vocab_size == 512 and drafter.config.head == "markov"
    assert bench.main(["gpu-drafter", "train", "--data", str(tmp_path), "--out", str(out), "--device", "cpu"]) == 2
    assert "holds no config.json and data.npz" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:  # a config key (prepare's) is named, not dropped
        bench.main(["gpu-drafter", "train", "--data", str(data), "--out", str(out), "steps=10"])
    assert stopped.value.code == 2 and "train takes no key=value or other arguments, got: steps=10" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(["gpu-drafter", "train", "--data", str(data), "--out", str(out)]) == 2
        assert "error: no CUDA GPU here" in capsys.readouterr().err
