"""The replica's Prometheus metrics, through Ray Serve's metrics API (each series is tagged with the
deployment, replica and application, and exported by the Ray node's metrics agent). Ray prefixes the
names with `ray_`.

Beside domino's own series, the speculative-decoding counters carry vLLM's names as vLLM's Ray stat
logger exports them (its `vllm:` prefix becomes `vllm_`, so `ray_vllm_spec_decode_num_drafts_total`
and so on), with its `model_name` and `position` labels: dashboards built for vLLM on Ray Serve read
them unchanged. tau = 1 + accepted tokens / drafts."""

from __future__ import annotations

from ray.serve import metrics

from domino.engine import Event, StepTimes
from domino.requests import GenerationStats
from domino.config import MAX_BLOCK_SIZE

# One bucket per accepted length up to 16, then coarser up to the largest possible round. The bounds sit
# halfway between whole numbers: Ray exports a histogram's sum from its buckets' midpoints, which are then
# the lengths themselves (bounds on whole numbers made the sum, and so tau, about half a token low).
ACCEPT_LENGTH_BUCKETS = [length + 0.5 for length in [0, *range(1, 17), 24, 32, 48, MAX_BLOCK_SIZE + 1]]


class ReplicaMetrics:
    """Recorded on the engine thread: after every step, and when a request is cancelled."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.tokens = metrics.Counter("domino_generated_tokens", description="tokens generated and sent to clients")
        self.requests = metrics.Counter("domino_requests", description="requests that ended, by finish reason",
                                        tag_keys=("finish_reason",))
        self.accept_length = metrics.Histogram(
            "domino_accept_length", boundaries=ACCEPT_LENGTH_BUCKETS,
            description="tokens committed per verify forward of the target (tau is its mean)")
        self.prefill_seconds = metrics.Counter("domino_prefill_seconds", description="time spent prefilling prompts")
        self.draft_seconds = metrics.Counter("domino_draft_seconds",
                                             description="time spent drafting (a round shared by a batch counts once)")
        self.verify_seconds = metrics.Counter("domino_verify_seconds",
                                              description="time spent in verify forwards (one per round, for the batch)")
        self.queue_depth = metrics.Gauge("domino_queue_depth",
                                         description="requests the replica holds, waiting or decoding")
        model = ("model_name",)
        self.num_drafts = metrics.Counter("vllm_spec_decode_num_drafts", tag_keys=model,
                                          description="rounds that verified at least one drafted token")
        self.num_draft_tokens = metrics.Counter("vllm_spec_decode_num_draft_tokens", tag_keys=model,
                                                description="drafted tokens verified")
        self.num_accepted_tokens = metrics.Counter("vllm_spec_decode_num_accepted_tokens", tag_keys=model,
                                                   description="drafted tokens accepted")
        self.accepted_per_pos = metrics.Counter("vllm_spec_decode_num_accepted_tokens_per_pos",
                                                tag_keys=("model_name", "position"),
                                                description="drafted tokens accepted, by position in the draft")

    def on_step(self, events: list[Event], in_flight: int, times: StepTimes) -> None:
        tokens = sum(len(event.tokens) for event in events)
        if tokens:
            self.tokens.inc(tokens)
        for counter, seconds in ((self.prefill_seconds, times.prefill_s), (self.draft_seconds, times.draft_s),
                                 (self.verify_seconds, times.verify_s)):
            if seconds:
                counter.inc(seconds)
        for event in events:
            if event.finished:
                self.requests.inc(tags={"finish_reason": event.result.finish_reason})
                self.on_rounds(event.result.stats)
        self.queue_depth.set(in_flight)

    def on_rounds(self, stats: GenerationStats) -> None:
        """A request's rounds, counted when it ends (finished, cancelled or failed)."""
        for length in stats.accept_lengths:
            self.accept_length.observe(length)
        spec, tags = stats.speculative_decoding, {"model_name": self.model_name}
        if spec["num_drafts"]:
            self.num_drafts.inc(spec["num_drafts"], tags=tags)
            self.num_draft_tokens.inc(spec["num_draft_tokens"], tags=tags)
        if spec["num_accepted_draft_tokens"]:
            self.num_accepted_tokens.inc(spec["num_accepted_draft_tokens"], tags=tags)
        for position, count in enumerate(spec["num_accepted_draft_tokens_per_pos"]):
            if count:
                self.accepted_per_pos.inc(count, tags={**tags, "position": str(position)})

    def on_cancel(self, stats: GenerationStats | None) -> None:
        self.requests.inc(tags={"finish_reason": "cancelled"})
        if stats is not None:
            self.on_rounds(stats)

    def on_fail(self, stats: list[GenerationStats]) -> None:
        if stats:
            self.requests.inc(len(stats), tags={"finish_reason": "error"})
        for one in stats:
            self.on_rounds(one)
