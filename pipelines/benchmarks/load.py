"""Load test for the OpenAI-compatible server (pipelines/serve.py): N concurrent clients send chat
completions until a request count or a time limit is reached; reports errors, p50 / p99 latency,
total tokens/s, and the server's speculative statistics.

Loopback only: it refuses any host other than this machine. Several servers (label=URL) are measured
in turns, round after round, so that they see the same machine load. It exits with 1 when any request
failed, or was never sent because --max-seconds ran out, so that a script can tell.

    python -m pipelines.bench load --url plain=http://127.0.0.1:8000/plain \\
        --url oracle=http://127.0.0.1:8000/oracle [--clients 32] [--requests 64] [--max-tokens 32]
"""

import argparse
import ipaddress
import math
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import requests

from pipelines.benchmarks import HelpFormatter

PROMPTS = [
    "Write a short poem about the ocean.",
    "Explain how photosynthesis works in simple terms.",
    "Write a Python function that checks whether a number is prime.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "Give me three tips for learning a new language.",
    "Describe the water cycle.",
    "What is the capital of France, and why is it famous?",
    "List the planets of the solar system in order.",
]


@dataclass
class Outcome:
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests
    tokens: int = 0
    committed: int = 0  # tokens committed by verify forwards (the numerator of tau)
    rounds: int = 0
    compute_s: float = 0.0  # the server's prefill + draft + verify time, summed over requests
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def check_loopback(url: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise SystemExit(f"error: {url} is not an http(s) URL, such as http://127.0.0.1:8000")
    host = parsed.hostname
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        addresses = set()
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise SystemExit(f"error: {url} is not on this machine: the load test only targets loopback addresses")


def check_answers(url: str) -> None:
    """Refuse at once a server that does not answer, instead of failing every request of the run."""
    try:
        requests.get(f"{url}/v1/models", timeout=30)
    except requests.RequestException as error:
        raise SystemExit(f"error: nothing answers at {url} ({type(error).__name__})") from None


def server_root(url: str) -> str:
    """The server's root (its route prefix); the base URL an OpenAI client is given, ending in /v1, is taken too."""
    return url.rstrip("/").removesuffix("/v1")


def run(url: str, clients: int, total: int, max_seconds: float, max_tokens: int, temperature: float) -> Outcome:
    """`clients` threads share a budget of `total` requests; none starts after `max_seconds`."""
    outcome, lock = Outcome(), threading.Lock()
    issued = iter(range(total))
    start = time.monotonic()

    def client() -> None:
        session = requests.Session()
        while time.monotonic() - start < max_seconds:
            with lock:
                i = next(issued, None)
            if i is None:
                return
            body = dict(messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                        max_tokens=max_tokens, temperature=temperature)
            sent = time.monotonic()
            try:
                response = session.post(f"{url}/v1/chat/completions", json=body, timeout=max_seconds)
                reply = response.json()
            except (requests.RequestException, ValueError) as error:
                with lock:
                    outcome.errors.append(f"{type(error).__name__}: {error}")
                continue
            with lock:
                if response.status_code != 200:
                    outcome.errors.append(f"{response.status_code}: {reply.get('error', {}).get('message')}")
                    continue
                stats = reply["metrics"]
                outcome.latencies.append(time.monotonic() - sent)
                outcome.tokens += reply["usage"]["completion_tokens"]
                outcome.rounds += stats["rounds"]
                outcome.committed += round(stats["tau"] * stats["rounds"])
                outcome.compute_s += stats["prefill_s"] + stats["draft_s"] + stats["verify_s"]

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outcome.wall_s = time.monotonic() - start
    return outcome


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.bench load", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--url", action="append", required=True, help="label=URL of a server, its root or its OpenAI base URL (.../v1) (repeatable)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients per server")
    parser.add_argument("--requests", type=int, default=64, help="requests per server and round")
    parser.add_argument("--max-seconds", type=float, default=600, help="per server and round")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    parser.add_argument("--temperature", type=float, default=0.0, help="temperature of each request (0: greedy)")
    parser.add_argument("--rounds", type=int, default=1, help="measure every server this many times, in turns")
    args = parser.parse_args(argv)
    if min(args.clients, args.requests, args.max_tokens, args.rounds) < 1 or not 0 < args.max_seconds < math.inf:
        parser.error("--clients, --requests, --max-tokens, --rounds and --max-seconds must be positive (and finite)")
    if not 0 <= args.temperature < math.inf:
        parser.error("--temperature must be a finite number, not negative")

    labelled = [item.split("=", 1) if "=" in item else (item, item) for item in args.url]
    servers = {label: server_root(url) for label, url in labelled}
    if len(servers) < len(labelled):
        parser.error("two --url options have the same label: give each server its own (label=URL)")
    for url in servers.values():
        check_loopback(url)
        check_answers(url)
    results = {label: Outcome() for label in servers}
    for _ in range(args.rounds):
        for label, url in servers.items():
            got = run(url, args.clients, args.requests, args.max_seconds, args.max_tokens,
                      args.temperature)
            total = results[label]
            total.latencies += got.latencies
            total.errors += got.errors
            total.wall_s += got.wall_s
            for name in ("tokens", "committed", "rounds", "compute_s"):
                setattr(total, name, getattr(total, name) + getattr(got, name))

    print(f"# {args.clients} clients, {args.requests} chat requests per server and round, {args.rounds} round(s), "
          f"max_tokens {args.max_tokens}, temperature {args.temperature}")
    print("\n| server | requests ok | errors | p50 latency s | p99 latency s | total tokens/s | tau | "
          "server compute tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, r in results.items():
        print(f"| {label} | {len(r.latencies)} | {len(r.errors)} | {percentile(r.latencies, 50):.1f} | "
              f"{percentile(r.latencies, 99):.1f} | {r.tokens / r.wall_s:.1f} | {r.committed / max(1, r.rounds):.2f} | "
              f"{r.tokens / max(r.compute_s, 1e-9):.1f} |")
    asked = args.requests * args.rounds
    for label, r in results.items():
        for error in r.errors[:5]:
            print(f"error ({label}): {error}")
        unsent = asked - len(r.latencies) - len(r.errors)
        if unsent:
            print(f"error ({label}): {unsent} of the {asked} requests were not sent before --max-seconds ran out")
    # a load test with failed requests, or with requests it never sent, did not pass
    return 1 if any(r.errors or len(r.latencies) < asked for r in results.values()) else 0

