"""How many of each request's drafted tokens to verify this round (DESIGN §6).

Verifying a token costs target capacity whether or not it is accepted. With the confidence head's
survival estimates c_{r,j}, the chance that draft j of request r is accepted is a_{r,j} = prod_{i<=j}
c_{r,i}. Verifying l_r tokens of each request returns tau = sum_r (1 + sum_{j<=l_r} a_{r,j}) tokens
per forward of B tokens, at SPS(B) forwards per second; DSpark admits (r, j) in order of a_{r,j} while
Theta = tau * SPS(B) does not drop. Every rule here looks only at confidences, which depend on the
tokens before the one being judged, so cutting a draft short never changes the output distribution.

Copied drafts (domino.lookup) are the one place where a rule may look further ahead: a copy run's
confidences are fixed when the run starts, by the text before it, so judging its first copy by the
whole run's worth still reads nothing of the tokens being judged.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field

import torch

from domino.errors import DominoError
from domino.verify import leading_run


@dataclass
class SPSProfile:
    """Target forwards per second against the number of tokens in the forward, measured at start-up.
    Between (and beyond) measured sizes the forward time is interpolated linearly."""

    tokens: list[int]
    seconds: list[float]

    def seconds_at(self, batch_tokens: int) -> float:
        i = min(max(bisect.bisect_left(self.tokens, batch_tokens), 1), len(self.tokens) - 1)
        (b0, b1), (t0, t1) = self.tokens[i - 1: i + 1], self.seconds[i - 1: i + 1]
        return max(t0 + (t1 - t0) * (batch_tokens - b0) / (b1 - b0), 1e-9)

    def __call__(self, batch_tokens: int) -> float:
        return 1.0 / self.seconds_at(batch_tokens)


@torch.no_grad()
def profile_sps(target, max_tokens: int = 512, context: int = 128, repeats: int = 3) -> SPSProfile:
    """Time one target forward of 1, 2, 4, ... max_tokens new tokens after `context` cached ones."""
    if max_tokens < 2:  # one size would leave nothing to interpolate between
        raise DominoError(f"the speed profile measures forwards of 1, 2, 4, ... tokens: its largest (max_tokens, "
                          f"max_batch_tokens when serving) must be at least 2, got {max_tokens}")
    sizes = [1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens]
    ids = torch.randint(0, target.vocab_size, (1, context + max_tokens), device=target.device)
    cache = target.new_cache()
    target.forward(ids[:, :context], cache)
    seconds = []
    for size in sizes:
        times = []
        for _ in range(repeats):
            target.synchronize()
            start = time.perf_counter()
            target.forward(ids[:, context: context + size], cache)
            target.synchronize()
            times.append(time.perf_counter() - start)
            cache.crop(-size)
        seconds.append(min(times))
    # a forward of more tokens is never cheaper (fewer tokens could be padded to as many): a size timed
    # above a larger one is noise, and would make verifying 2 tokens look dearer than 4
    seconds = [min(seconds[i:]) for i in range(len(seconds))]
    return SPSProfile(sizes, seconds)


class VerifyPolicy:
    """Decides, each round, whether to draft at all and how many drafts each request verifies."""

    name = ""  # the name a user picks it by (POLICIES)
    needs_confidence = False

    def wants_draft(self, rows: int) -> bool:
        """Whether this round, with `rows` requests, drafts at all."""
        return True

    def could_pay(self, caps: torch.Tensor) -> bool:
        """Whether any draft could be verified this round, whatever the drafts turn out to be."""
        return True

    def observe(self, drafted: bool, rows: int, committed: int, seconds: float,
                verify_tokens: int, verify_seconds: float) -> None:
        """What the round just run cost and returned; `verify_seconds`: its target forward over
        `verify_tokens` tokens."""

    def lengths(self, caps: torch.Tensor, confidence: torch.Tensor | None,
                copied: torch.Tensor | None = None) -> torch.Tensor:
        """Drafts to verify per row (n,), at most `caps`; `copied` (n, m) marks the drafts copied from
        the row's text (Draft.copied)."""
        raise NotImplementedError

    def admits_any(self, caps: torch.Tensor, first_confidence: torch.Tensor) -> bool:
        """Whether any request would verify its first draft, judged on the first position's
        confidences alone. If none would, no later draft would either (a position is admitted only
        after its prefix, and the first choice is the same), so the round can stop drafting early."""
        return bool(self.lengths(caps.clamp(max=1), first_confidence[:, None]).max() > 0)


class FullVerify(VerifyPolicy):
    """Verify every drafted token (up to each request's remaining budget)."""

    name = "full"

    def lengths(self, caps: torch.Tensor, confidence: torch.Tensor | None,
                copied: torch.Tensor | None = None) -> torch.Tensor:
        return caps


@dataclass
class ThresholdVerify(VerifyPolicy):
    """Verify while the estimated chance that the whole prefix survives stays above `threshold`."""

    threshold: float = 0.3
    name = "threshold"
    needs_confidence = True

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise DominoError(f"the threshold is a survival probability between 0 and 1 (exclusive), got {self.threshold}")

    def lengths(self, caps: torch.Tensor, confidence: torch.Tensor,
                copied: torch.Tensor | None = None) -> torch.Tensor:
        survive = torch.cumprod(confidence, dim=1) >= self.threshold
        return torch.minimum(leading_run(survive), caps)


@dataclass
class GateRecord:
    """What drafting has returned at one batch-size class: the mean and mean square of the plain rounds
    a drafted round lost (negative: won), over about the last `memory` drafted rounds."""

    mean: float
    square: float
    rounds: int = 0  # drafted rounds seen
    sure_losses: int = 0  # drafted rounds in a row after which the loss was sure
    skip: int = 0  # plain rounds still to run


@dataclass
class SpeculationGate:
    """Drafting costs time before its worth is known: with many requests in a batch, a round of plain
    decoding can commit more tokens per second than a round of draft + verify. A drafted round loses
    when it commits fewer tokens per second than plain rounds would have (the SPS profile's estimate,
    corrected by what the target's forwards really measured). One round says little: a drafter whose
    first draft passes 40 % of the time loses most rounds and still wins on average. So the gate judges
    the mean of the rounds lost per drafted round, over about the last `memory` of them, starting from
    `prior` rounds at break-even that spread by `prior_spread` plain rounds (a drafter is given a few
    rounds before it is judged). While the mean shows a loss, the gate decodes plainly for long enough
    that a drafted round's expected loss stays under `explore` of the time until the next try. Once the
    loss is also sure (the mean more than `sure` standard errors above break-even), that stretch grows
    `growth`-fold with each drafted round that leaves it sure, up to `max_backoff` rounds. A hopeless
    drafter is thus retried rarely, while one near break-even, or a winner after an unlucky start (four
    losses in a row are common for a drafter that loses 60 % of its rounds), is retried soon: growing the
    stretch with every loss in a row instead shut such a winner out for most of 1 000 rounds in a third
    of simulated runs (tests/test_engine.py). Whether drafting pays depends on how many requests share
    the round, so all this is kept per batch-size class (1, 2-3, 4-7, ...): losing at 32 requests does
    not stop drafting at 1. Rounds of copies alone (domino.lookup) are not shown to it: they run no
    drafter, and the engine runs them whatever the gate says. The gate looks only at finished rounds, so
    it never changes the output."""

    sps: SPSProfile
    explore: float = 0.05
    growth: int = 4
    max_backoff: int = 1024
    memory: int = 32
    prior: int = 4
    prior_spread: float = 1.0
    sure: float = 2.0
    calibration: float = 1.0  # measured / profiled speed of the target's forwards
    records: dict[int, GateRecord] = field(default_factory=dict)  # by batch-size class

    @staticmethod
    def size_class(rows: int) -> int:
        return rows.bit_length()

    def wants_draft(self, rows: int) -> bool:
        record = self.records.get(self.size_class(rows))
        if record is not None and record.skip:
            record.skip -= 1
            return False
        return True

    def observe(self, drafted: bool, rows: int, committed: int, seconds: float,
                verify_tokens: int, verify_seconds: float) -> None:
        # every round's target forward says how fast the target runs now (the profile was taken on a short
        # context, and once); drafted rounds must tell it too, or a gate that stays open never learns it
        self.calibration = 0.5 * (self.calibration + self.sps.seconds_at(verify_tokens) / verify_seconds)
        if not drafted:
            return
        plain_seconds = 1.0 / (self.calibration * self.sps(rows))  # a plain round commits one token per row
        lost = seconds / plain_seconds - committed / rows  # > 0: plain rounds would have been faster
        record = self.records.setdefault(self.size_class(rows), GateRecord(0.0, self.prior_spread ** 2))
        record.rounds += 1
        weight = min(record.rounds + self.prior, self.memory)
        record.mean += (lost - record.mean) / weight
        record.square += (lost ** 2 - record.square) / weight
        error = math.sqrt(max(record.square - record.mean ** 2, 0.0) / weight)
        record.sure_losses = record.sure_losses + 1 if record.mean > self.sure * error else 0
        stretch = record.mean / self.explore * self.growth ** max(record.sure_losses - 1, 0)
        record.skip = min(math.ceil(stretch), self.max_backoff) if record.mean > 0 else 0


@dataclass
class GatedPolicy(VerifyPolicy):
    """A policy whose rounds draft only while a SpeculationGate finds drafting pays."""

    sps: SPSProfile

    def __post_init__(self) -> None:
        self.gate = SpeculationGate(self.sps)

    def wants_draft(self, rows: int) -> bool:
        return self.gate.wants_draft(rows)

    def observe(self, drafted: bool, rows: int, committed: int, seconds: float,
                verify_tokens: int, verify_seconds: float) -> None:
        self.gate.observe(drafted, rows, committed, seconds, verify_tokens, verify_seconds)


@dataclass
class GatedFullVerify(GatedPolicy, FullVerify):
    """Every draft verified, in the rounds the gate lets draft: for drafters without a confidence head.
    A drafter that loses to plain decoding (a weak one, or any one in a crowded batch) then costs a
    drafted round now and then instead of every round."""

    name = "gated"

    def could_pay(self, caps: torch.Tensor) -> bool:
        """Whether verifying every draft could beat a plain round were all of them to pass. The verify
        forward is padded to the longest row: rows x (1 + longest cap) tokens."""
        rows, longest = len(caps), int(caps.max())
        return (rows + int(caps.sum())) * self.sps(rows * (1 + longest)) >= rows * self.sps(rows)


@dataclass
class ConfidenceScheduler(GatedPolicy):
    """DSpark's greedy admission. `padded`: the verify forward runs every row at the batch's longest
    length, so the cost is rows * (1 + max l); verifying up to that length is then free for every row,
    and rows are topped up to it. With padded=False the cost is sum_r (1 + l_r), as in a ragged backend.
    A SpeculationGate skips drafting while it does not pay.

    Where admitting a draft alone would lower Theta, a copied draft is also tried with the rest of its
    copy run: on a CPU, a verify of 2 tokens costs about as much as one of 16, so a single copy rarely
    pays for the step while the run does. A draft admitted neither way closes its row (DSpark's first
    drop; other rows go on, which only matters for such runs)."""

    padded: bool = True
    name = "confidence"
    needs_confidence = True
    _could_pay: dict[tuple[int, frozenset[int]], bool] = field(default_factory=dict, repr=False)

    def could_pay(self, caps: torch.Tensor) -> bool:
        """Whether verifying could raise Theta even if every draft were certain to pass and every one began
        a copy run. Admission only grows with the confidences, so where even that admits nothing (many rows
        on a CPU, whose verify cost grows with every padded slot), no real draft would be verified either,
        and the round need not draft, not even to explore: the SPS profile alone rules it out. With every
        draft certain, the first admission (if any) is one row's first draft or whole run, so the answer
        depends only on the number of rows and the distinct caps: that is the cache's key."""
        key = (len(caps), frozenset(caps.tolist()))
        if key not in self._could_pay:
            certain = torch.ones(len(caps), max(key[1], default=0), dtype=torch.double)
            self._could_pay[key] = bool(self.lengths(caps.cpu(), certain, certain.bool()).max() > 0)
        return self._could_pay[key]

    def cost(self, lengths: torch.Tensor) -> int:
        if self.padded:
            return int(lengths.numel() * (1 + lengths.max()))
        return int((1 + lengths).sum())

    def lengths(self, caps: torch.Tensor, confidence: torch.Tensor,
                copied: torch.Tensor | None = None) -> torch.Tensor:
        survive = torch.cumprod(confidence.double(), dim=1).tolist()  # a_{r,j}
        copies = copied.tolist() if copied is not None else None
        rows, limits = len(survive), caps.tolist()
        lengths = torch.zeros(rows, dtype=torch.long)
        tau = float(rows)  # every row commits at least one token
        theta = tau * self.sps(self.cost(lengths))
        candidates = sorted((-survive[r][j], j, r) for r in range(rows) for j in range(limits[r]))
        for _, j, r in candidates:
            # a position is admitted only after its whole prefix, so a row that dropped at j is closed: its
            # later positions all sort after (r, j)
            if j != lengths[r]:
                continue
            ends = [j + 1]
            if copies is not None and copies[r][j] and limits[r] > j + 1:
                ends.append(limits[r])  # the copy run to the row's cap: copies run to the block's end
            for end in ends:
                lengths[r] = end
                gain = sum(survive[r][j:end])
                new_theta = (tau + gain) * self.sps(self.cost(lengths))
                if new_theta >= theta:
                    tau, theta = tau + gain, new_theta
                    break
            else:
                lengths[r] = j
        if self.padded:
            lengths = torch.minimum(lengths.max().expand(rows), caps.cpu())
        return lengths.to(caps.device)


def check_fits(policy: VerifyPolicy | type[VerifyPolicy], drafter) -> None:
    """Refuse a policy that reads confidences with a drafter (a Drafter, 'oracle' or None) that has no
    confidence head."""
    if policy.needs_confidence and getattr(drafter, "confidence", None) is None:
        given = {None: "decoding without a drafter", "oracle": "the oracle"}.get(drafter, "this drafter")
        raise DominoError(f"verify '{policy.name}' needs a drafter trained with a confidence head "
                          f"(confidence_head=true); {given} has none")


POLICY_CLASSES: dict[str, type[VerifyPolicy]] = {
    policy.name: policy for policy in (FullVerify, GatedFullVerify, ThresholdVerify, ConfidenceScheduler)}
POLICIES = tuple(POLICY_CLASSES)


def make_policy(name: str, target=None, threshold: float = ThresholdVerify.threshold, max_tokens: int = 512):
    """A verify policy by name (POLICIES); 'gated' and 'confidence' profile the target's SPS."""
    if name not in POLICY_CLASSES:
        raise DominoError(f"unknown verify policy '{name}': choose {', '.join(POLICIES)}")
    policy = POLICY_CLASSES[name]
    if policy is ThresholdVerify:
        return ThresholdVerify(threshold)
    if issubclass(policy, GatedPolicy):
        return policy(profile_sps(target, max_tokens=max_tokens))
    return policy()
