"""Turning per-generation records into the numbers we publish: per method and dataset, tau, acceptance
by block position, tokens/s, speedup over plain decoding from the same run, the time split, and
whether the output equals plain decoding's (losslessness at temperature 0)."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from domino.errors import DominoError
from pipelines.benchmarks.methods import Output

BASELINE = "autoregressive"


def add_counts(total: list[int], more: list[int]) -> None:
    """total += more, element-wise, growing total as needed (per-position counts)."""
    total.extend([0] * (len(more) - len(total)))
    for k, value in enumerate(more):
        total[k] += value


@dataclass
class Row:
    method: str
    dataset: str
    generations: int = 0
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    committed: int = 0  # tokens committed by verify forwards (excludes the prefill's first token)
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    accepted_copies: int = 0  # accepted drafts copied from the text (context lookup), not drafted
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    lossless: bool | None = None
    speedup: float | None = None

    def add(self, output: Output) -> None:
        self.generations += 1
        self.tokens += len(output.tokens)
        self.seconds += output.seconds
        s = output.stats
        if s is None:
            return
        self.rounds += s.rounds
        self.committed += sum(s.accept_lengths)
        add_counts(self.proposed, s.proposed)
        add_counts(self.accepted, s.accepted)
        self.accepted_copies += s.accepted_copies
        self.prefill_s += s.prefill_s
        self.draft_s += s.draft_s
        self.verify_s += s.verify_s

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float | None:
        return self.committed / self.rounds if self.rounds else None

    @property
    def acceptance(self) -> list[float]:
        return [a / p for a, p in zip(self.accepted, self.proposed) if p]

    @property
    def copied_share(self) -> float | None:
        """The share of accepted drafts that context lookup copied rather than the drafter drafted."""
        return self.accepted_copies / sum(self.accepted) if sum(self.accepted) else None

    @property
    def other_s(self) -> float:
        return max(0.0, self.seconds - self.prefill_s - self.draft_s - self.verify_s)

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second, "tau": self.tau,
                "acceptance": self.acceptance, "copied_share": self.copied_share, "other_s": self.other_s}


def compare_with_baseline(rows: dict[tuple[str, str], Row], outputs: dict[tuple[str, str], list[list[int]]],
                          exact: bool = True) -> None:
    """Fill in speedup against plain decoding on the same dataset, and with `exact` (greedy decoding)
    whether the outputs equal plain decoding's."""
    for (method, dataset), row in rows.items():
        baseline = rows.get((BASELINE, dataset))
        if baseline is None or not baseline.tokens_per_second:
            continue
        row.speedup = row.tokens_per_second / baseline.tokens_per_second
        row.lossless = outputs[(method, dataset)] == outputs[(BASELINE, dataset)] if exact else None


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {gpu}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


def markdown(rows: list[Row]) -> str:
    lines = ["| dataset | method | tokens/s | speedup | tau | acceptance @1..4 | accepted drafts copied | prefill | draft | "
             "verify | other | lossless |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        share = (lambda x: f"{100 * x / r.seconds:.0f}%") if r.seconds else (lambda x: "-")
        tau = f"{r.tau:.2f}" if r.tau is not None else "-"
        acceptance = " ".join(f"{a:.2f}" for a in r.acceptance[:4]) or "-"
        copied = f"{100 * r.copied_share:.0f}%" if r.copied_share is not None else "-"
        split = [share(r.prefill_s), share(r.draft_s), share(r.verify_s), share(r.other_s)] if r.rounds else ["-"] * 4
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
        lossless = {True: "yes", False: "NO", None: "-"}[r.lossless]
        lines.append(f"| {r.dataset} | {r.method} | {r.tokens_per_second:.1f} | {speedup} | {tau} | {acceptance} | {copied} | "
                     f"{' | '.join(split)} | {lossless} |")
    return "\n".join(lines)


def plots(rows: list[Row], out_dir: Path) -> list[Path]:
    """acceptance.png (acceptance rate by block position per method) and speedup.png (per dataset)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r.method for r in rows))
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        pooled = Row(method, "all")
        for r in rows:
            if r.method == method:
                add_counts(pooled.proposed, r.proposed)
                add_counts(pooled.accepted, r.accepted)
        if pooled.acceptance:
            ax.plot(range(1, len(pooled.acceptance) + 1), pooled.acceptance, marker="o", label=method)
    ax.set(xlabel="block position", ylabel="acceptance rate", ylim=(0, 1.05), title="Acceptance by position")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = [next((r.speedup or 0 for r in rows if r.method == method and r.dataset == d), 0) for d in datasets]
        ax.bar([x + i * width for x in range(len(datasets))], values, width, label=method)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(datasets))], datasets)
    ax.set(ylabel="speedup over autoregressive", title="Speedup per dataset")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def output_folder(path: str) -> Path:
    """The report's folder, made before anything is measured: a path that cannot hold it is refused at the
    start, not after the whole run."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DominoError(f"--out {path}: cannot make the report's folder there ({error.strerror})") from None
    if not os.access(folder, os.W_OK):
        raise DominoError(f"--out {path}: the folder is not writable")
    return folder


def write(rows: list[Row], out_dir: Path, command: str) -> dict[str, Path]:
    files = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    files["json"].write_text(json.dumps({"command": command, "machine": machine(),
                                         "rows": [r.as_dict() for r in rows]}, indent=2) + "\n")
    files["markdown"].write_text(f"Command: `{command}`\n\nMachine: {machine()}\n\n{markdown(rows)}\n")
    for path in plots(rows, out_dir):
        files[path.stem] = path
    return files
