"""The pipeline on one GPU: one feature actor and one DeepSpeed trainer sharing it, on a Qwen3-shaped
target with random weights, reporting the figures of pipelines/benchmarks/pipeline.py. Run wherever a
GPU is available (CI does not); it should finish within 10 minutes on one GPU.

    python -m pipelines.bench gpu-check [--shape 4b|1.7b|0.6b] [--steps 100] [key=value ...]

The target has Qwen3's layers, widths and heads; its vocabulary is that of the embedded target's
tokenizer (the one chat tokenizer available offline), so ShareGPT tokenises as in the CPU default.
Random weights make tau meaningless here, so the closing evaluation is off.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from domino.errors import DominoError
from domino.target import DEFAULT_TARGET, resolve_target
from pipelines.benchmarks import HelpFormatter
from pipelines.training.config import PipelineConfig, parse_args
from pipelines.training.errors import exit_status

# Qwen3 model cards: layers, hidden, intermediate, attention heads, key/value heads
SHAPES = {"4b": (36, 2560, 9728, 32, 8), "1.7b": (28, 2048, 6144, 16, 8), "0.6b": (28, 1024, 3072, 16, 8)}


def arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench gpu-check", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="4b", help="Qwen3 size to imitate")
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--storage", default=None, help="storage_path (default: a temporary folder)")
    return parser.parse_known_args(argv)  # the rest are pipeline key=value overrides


def pipeline_config(args: argparse.Namespace, target: str, storage: str, overrides: list[str]) -> PipelineConfig:
    """One GPU shared half and half: the feature actor and the trainer each ask for 0.5 GPU."""
    settings = dict(
        run_name=f"gpu-check-{args.shape}", storage_path=storage, target=target, data="sharegpt",
        max_conversations=2000, max_length=1024, regenerate=False, eval_prompts=0,
        feature_actors=1, feature_batch_size=4, feature_cpus=4, feature_gpus=0.5, data_cpus=1,
        draft_layers=5, block_size=16, rank=256, num_workers=1, use_gpu=True, trainer_cpus=4, trainer_gpus=0.5,
        batch_size=4, anchors_per_sequence=256, steps=args.steps, lr=6e-4, log_every=10,
        checkpoint_every=args.steps)
    return parse_args([f"{k}={v}" for k, v in settings.items()] + overrides)


def random_qwen3(shape: str, folder: Path) -> Path:
    """Save a Qwen3-shaped model with random bf16 weights and the embedded target's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(DEFAULT_TARGET))
    layers, hidden, intermediate, heads, kv_heads = SHAPES[shape]
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)  # built on the host: the driver keeps no GPU memory from Ray's actors and workers
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def check(args: argparse.Namespace, overrides: list[str]) -> None:
    from pipelines.benchmarks.pipeline import report
    from pipelines.train import run

    if not torch.cuda.is_available():
        raise DominoError("no CUDA GPU here: this check needs one (on a CPU: python -m pipelines.bench pipeline)")
    with tempfile.TemporaryDirectory(prefix="domino-gpu-check-") as folder:
        start = time.perf_counter()
        target = random_qwen3(args.shape, Path(folder) / "target")
        print(f"# random Qwen3-{args.shape} target written in {time.perf_counter() - start:.0f} s; "
              f"GPU: {torch.cuda.get_device_name()}", flush=True)
        cfg = pipeline_config(args, str(target), args.storage or str(Path(folder) / "runs"), overrides)
        outcome = run(cfg)
        print(report(cfg, outcome, time.perf_counter() - start))


def main(argv: list[str]) -> int:
    args, overrides = arguments(argv)
    return exit_status(lambda: check(args, overrides))

