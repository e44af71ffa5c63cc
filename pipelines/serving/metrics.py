"""The replica's Prometheus metrics, through Ray Serve's metrics API (each series is tagged with the
deployment, replica and application, and exported by the Ray node's metrics agent). Ray prefixes the
names with `ray_`."""

from __future__ import annotations

from ray.serve import metrics

from domino.engine import Event
from domino.config import MAX_BLOCK_SIZE

# One bucket per accepted length up to 16, then coarser up to the largest possible round.
ACCEPT_LENGTH_BUCKETS = [*range(1, 17), 24, 32, 48, MAX_BLOCK_SIZE + 1]


class ReplicaMetrics:
    """Recorded on the engine thread: after every step, and when a request is cancelled."""

    def __init__(self) -> None:
        self.tokens = metrics.Counter("domino_generated_tokens", description="tokens generated and sent to clients")
        self.requests = metrics.Counter("domino_requests", description="requests that ended, by finish reason",
                                        tag_keys=("finish_reason",))
        self.accept_length = metrics.Histogram(
            "domino_accept_length", boundaries=ACCEPT_LENGTH_BUCKETS,
            description="tokens committed per verify forward of the target (tau is its mean)")
        self.draft_seconds = metrics.Counter("domino_draft_seconds", description="time spent drafting")
        self.verify_seconds = metrics.Counter("domino_verify_seconds", description="time spent in verify forwards")
        self.queue_depth = metrics.Gauge("domino_queue_depth",
                                         description="requests the replica holds, waiting or decoding")

    def on_step(self, events: list[Event], in_flight: int) -> None:
        tokens = sum(len(event.tokens) for event in events)
        if tokens:
            self.tokens.inc(tokens)
        for event in events:
            if event.finished:
                stats = event.result.stats
                self.requests.inc(tags={"finish_reason": event.result.finish_reason})
                for length in stats.accept_lengths:
                    self.accept_length.observe(length)
                if stats.draft_s:
                    self.draft_seconds.inc(stats.draft_s)
                if stats.verify_s:
                    self.verify_seconds.inc(stats.verify_s)
        self.queue_depth.set(in_flight)

    def on_cancel(self) -> None:
        self.requests.inc(tags={"finish_reason": "cancelled"})
