"""Decides, each step, which requests propose and how many tokens: speculate only where it pays.

Two rules, both about goodput (tokens emitted per second), not acceptance:
  * per request: a request whose recent acceptance (a moving average the scheduler keeps) falls
    below min_acceptance stops proposing; it probes again with one draft every probe_interval steps.
    A request the proposer has nothing for (the n-gram proposer found no match) is not counted.
    Where the proposer sorts proposals into buckets (n-gram), the gains already price each kind, so the
    request's signal is its calibration instead: accepted tokens over the tokens its plans expected
    (decayed sums). accepted / proposed punished long proposals: three 15-guess n-gram drafts failing
    where a type hint broke a copied signature had a code edit sit out 16 steps of a copied body
    (edit 2 of the bench: 60 steps against 33 without the cut-off). The calibration does not scale the
    gains: scaled gains that no longer pay stop the drafts that would measure a recovery (tried: two of
    three code edits then ran 2-3x the steps).
  * per step: emitted tokens per second with and without speculation, from the measured time of
    decode-only steps as a function of their token count T(n): a moving average per token count
    where that count was measured, interpolated between measured counts, and a linear fit
    T(n) = a + b n of all samples beyond them. (The linear fit alone misjudged: on a 2-core CPU with
    integer-quantized weights, 8 rows cost 3.2x 2 rows against the 2x the fit drew from batch-1
    steps, and two requests speculating ran at 0.76x.) Each request's j-th proposal is worth its
    expected gain g_ij, the chance that verification gets to it and accepts it: from the proposer's
    bucket for the request (acceptance.py: position by position, per kind of proposal, e.g. the
    n-gram match length) or, for proposals without one (a draft model), a_i^j with a_i the
    request's recent acceptance. Gains fall with j, so the R proposals worth most over the whole
    batch are a prefix of each request's, and the step proposes the R in 0..sum of caps with the most
        (n + sum of the R largest gains) / T(n + R)       (n decoding requests; R = 0: n / T(n))
    A memory-bound step (dense weights at batch 1 on CPU: every weight streamed once) has b ≈ 0 and
    proposals are nearly free; where extra rows cost (integer-quantized weights, large batches) only
    the likeliest proposals pay, or none. Until the fit has seen a spread of token counts, the step
    proposes K iff n <= max_batch_size. Every _EXPLORE_EVERY plans, an option not chosen (if
    speculating: plain, or every proposal the caps allow, in turn; if not: one proposal a request)
    runs once when its token count has few measurements or none recent, so both sides of the
    comparison stay measured as the batch and its contexts change.
  * a draft model's forwards are priced apart: T(n) is measured without the proposer's time, and
    a plan of R proposals costs T(n + R) + (its longest proposal) x the mean time of a decode-like
    draft forward (one over a new prompt, or after a long gap, costs like a prefill: not counted;
    counted, one such catch-up priced every later guess as a prefill and kept drafting off).
  * while a draft model drafts (DraftGate, draft_gate.py): each guess comes with the draft's top-1 probability p, and
    the acceptance of guesses in p's bin is learned like a bucket's (prior: the bin's middle, a
    calibrated draft). A guess is kept while its gain (the product of its request's kept guesses'
    bin rates) buys more tokens per second than its verification row costs, by the same measured
    T(n); at the first guess that does not, the request's proposal ends and it takes no more draft
    forwards. A draft request's planned gains are κ·α^j: α its recent acceptance of verified
    guesses, κ how often its drafting got any guess past the gate (a dropped first guess cost a
    forward for nothing; counting it as a failed draft instead kept a 0.95-acceptance request off).
    Measured offline on the chat bench (Qwen2.5-Coder-0.5B drafting for the 1.5B, teacher-forced,
    docs/speculative.md): guesses at p >= 0.9 were all accepted, at p < 0.5 a third were; one rate
    per request averaged them.
  * a draft request that has not drafted for _STALE_PLANS_OFF plans is planned at α̂^j instead, α̂ the
    target's own confidence over its recent tokens turned into an acceptance estimate
    (target_confidence.py): κ and α are not measured while it is off; catch-up charged as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request
from tokenmill.engine.spec.acceptance import AcceptanceModel, ewma
from tokenmill.engine.spec.draft_gate import CONFIDENCE_PRIORS, DraftGate
from tokenmill.engine.spec.step_times import StepTimePredictor
from tokenmill.engine.spec.target_confidence import TargetConfidence

_MIN_DRAFTS_TO_JUDGE = 4  # drafts before a request's acceptance is trusted
_MIN_SAMPLES = 16  # steps before the cost fit is trusted
_EXPLORE_EVERY = 16  # every so many steps try another k, so token counts spread and stay measured
_NO_FIT_MIN_RATE = 0.5  # before the cost fit: a bucket proposes only if its first guess is accepted this often
_EWMA = 0.25  # weight of the newest step in a token count's moving average
_MIN_COUNT_SAMPLES = 2  # measurements before a token count's average is used
# A step slower than this many times its count's average enters the average clipped to it: a VM pause or a
# collection in one step of a rarely run count (a 2-row step at 19 ms against 11 measured, Zen 5) otherwise
# priced that count at 1.32x a decode for dozens of plans, where it costs 1.15x. A real slowdown (longer
# contexts, a slow spell of the host) still moves the average, by up to 6% a step.
_SPIKE = 1.25
_STALE_PLANS = 64  # a count last measured this many plans ago is measured again (contexts grow)
# Speculate only for a predicted gain of at least this much: at batch 32 on a 2-core CPU every row
# costs and the best plan's predicted edge was a few percent, inside the step-time averages' noise,
# and speculating on it measured 0.93x of plain where the old one-k-for-all plan measured 0.96x. The
# margin grows by a point a request up to _MAX_MIN_GAIN: at batch 8 (Zen 5, after the 8-row tiles made
# a plain 8-request step cheap) 5% measured 0.98x and 1.13x of plain, 12% 1.14x and 1.29x (6 rounds each).
_MIN_GAIN = 0.05
_MIN_GAIN_PER_REQUEST = 0.01
_MAX_MIN_GAIN = 0.15
_CALIBRATION_DECAY = 0.7  # each bucketed draft ages a request's calibration sums (as recent_acceptance's 0.3 weight)
# Pseudo-tokens both expected and accepted in a calibration: the first drafts of a code edit (one accepted of
# ~11 expected over its first four, the rewrite's opening lines) otherwise cut it off at once; three failed
# 15-guess drafts of long matches (~8 expected each) still do.
_CALIBRATION_PRIOR = 4.0
# A draft forward in which no sequence computes more than this many tokens (the guesses accepted last
# step and the correction) costs about what one more guess will; tokens a draft is behind beyond it
# are a catch-up, priced per token.
DECODE_LIKE_TOKENS = 8
# A draft request that planned no guess for more than this many plans is planned from α̂ (above).
_STALE_PLANS_OFF = 4
# A catch-up is paid once and serves the steps that follow: a plan charges this share of it. Charged
# whole, a request that sat out ~20 steps never paid it again (a 0.92-acceptance code edit stayed
# off for the rest of its run); a quarter still keeps chat traffic, whose guesses barely pay, off.
_CATCH_UP_HORIZON = 4


def min_gain(num_decoding: int) -> float:
    """The predicted gain a step of `num_decoding` requests must promise before it speculates."""
    return min(_MIN_GAIN + _MIN_GAIN_PER_REQUEST * (num_decoding - 1), _MAX_MIN_GAIN)


def geometric_gains(acceptance: float, k: int) -> list[float]:
    """Gains of proposals 1..k when each is accepted with probability `acceptance` independently of
    the others (no bucket: a request's recent acceptance); a verification emits 1 + their sum."""
    return [acceptance ** j for j in range(1, k + 1)]


@dataclass(slots=True)
class _Pending:
    """A request's draft planned this step: its bucket and its counters before verification, and the
    confidence bins of the guesses a DraftGate kept, in order."""

    bucket: int | None
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    bins: list[int] = field(default_factory=list)
    gains: list[float] = field(default_factory=list)  # a bucketed proposal's planned gains, position by position


class SpecController:
    def __init__(self, config: SpeculativeConfig,
                 bucket_prior: Callable[[int], float | None] | None = None) -> None:
        """`bucket_prior`: the proposer's prior acceptance of a bucket (Proposer.bucket_prior)."""
        self.config = config
        self.bucket_prior = bucket_prior
        self.samples: deque[tuple[int, float]] = deque(maxlen=256)  # (tokens in the step, step time s)
        # tokens → (moving average of step time s, samples, the plan count at the latest sample)
        self.by_count: dict[int, tuple[float, int, int]] = {}
        self.acceptance = AcceptanceModel(config.num_speculative_tokens)
        self.confidence = AcceptanceModel(1)  # per confidence bin, position-free: P(accepted | reached)
        self.target = TargetConfidence()  # α̂ of draft requests that sit out (target_confidence.py)
        self._last_drafted: dict[str, int] = {}  # the plan count at a request's latest proposal
        self.draft_forward_s: float | None = None  # moving average of one draft-model forward
        # Moving average of what each token a draft forward computes beyond one per sequence costs
        # (a catch-up: a long one runs at prefill speed, ~4.7 ms a token for the q4 0.5B on Zen 3
        # against 13 ms for a whole one-token forward); None (free) until measured.
        self.draft_token_s: float | None = None
        self._predict: StepTimePredictor | None = None  # the last plan's step-time predictor, for its gate
        self.is_on = True  # the last step's decision, for the stats
        self._cooldown: dict[str, int] = {}
        # request → decayed sums (accepted tokens, tokens its plans expected) of its bucketed drafts
        self._calibration: dict[str, tuple[float, float]] = {}
        self._pending: dict[str, _Pending] = {}
        self._num_plans = 0

    def observe(self, num_tokens: int, step_time_s: float) -> None:
        if num_tokens > 0:
            self.samples.append((num_tokens, step_time_s))
            mean, seen, _ = self.by_count.get(num_tokens, (step_time_s, 0, 0))
            sample = min(step_time_s, _SPIKE * mean) if seen else step_time_s
            self.by_count[num_tokens] = (ewma(mean if seen else None, sample, _EWMA), seen + 1, self._num_plans)

    def observe_draft(self, seconds: float) -> None:
        """One decode-like draft-model forward took `seconds` (Proposer.last_decode_forward_s)."""
        self.draft_forward_s = ewma(self.draft_forward_s, seconds, _EWMA)

    def observe_catch_up(self, extra_tokens: int, seconds: float) -> None:
        """A draft forward computed `extra_tokens` beyond one per sequence in `seconds`
        (Proposer.last_catch_ups); priced once a decode-like forward's time is known."""
        if extra_tokens <= 0 or self.draft_forward_s is None:
            return
        self.draft_token_s = ewma(self.draft_token_s, max(seconds - self.draft_forward_s, 0.0) / extra_tokens, _EWMA)

    def measured(self) -> dict[int, float]:
        """Token counts measured often enough to trust → their moving-average step time."""
        return {n: t for n, (t, seen, _) in self.by_count.items() if seen >= _MIN_COUNT_SAMPLES}

    def predict(self, num_tokens: int, fit: tuple[float, float], measured: dict[int, float] | None = None) -> float:
        """Step time for `num_tokens`: measured there, else between the nearest measured counts,
        else the fit's slope from the nearest measured count (the fit itself when none is).
        `measured`: self.measured(), when the caller predicts several counts at once."""
        return StepTimePredictor(fit, self.measured() if measured is None else measured)(num_tokens)

    def plan(self, requests: list[Request], buckets: Sequence[int | None] | None = None,
             catch_up: Sequence[int] | None = None) -> list[int]:
        """Proposals per request. `buckets`: the proposer's kind of proposal per request (None: none;
        0: the proposer has nothing to offer it), see acceptance.py. `catch_up`: tokens a draft model
        must compute for each before its first guess (Proposer.catch_up_tokens)."""
        buckets = list(buckets) if buckets is not None else [None] * len(requests)
        catch_up = list(catch_up) if catch_up is not None else [0] * len(requests)
        self._predict = None
        self._learn(requests)
        if not self.config.adaptive:
            ks = [0 if b == 0 else self.config.num_speculative_tokens for b in buckets]
        else:
            caps = [0 if b == 0 else self._k_for(r, b) for r, b in zip(requests, buckets, strict=True)]
            ks = self._allocate(requests, buckets, caps, catch_up) if any(caps) else caps
            self.is_on = any(ks)
        for request, bucket, k in zip(requests, buckets, ks, strict=True):
            if k:
                stats = request.spec_stats
                estimate = self._revival_estimate(request) if bucket is None else None
                if estimate is not None:
                    # Revived on α̂: its κ and α start again from the estimate the plan used, so the guesses
                    # verified from here move them, not the dip that turned it off.
                    stats.recent_kept, stats.recent_acceptance = 1.0, estimate
                self._last_drafted[request.request_id] = self._num_plans
                self._pending[request.request_id] = _Pending(
                    bucket, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                    gains=self._bucket_gains(bucket, k) if bucket is not None else [])
        return ks

    def _learn(self, requests: list[Request]) -> None:
        """Score last step's drafts into the acceptance model, from the requests' counters: a draft
        the step did not verify (the request was skipped or preempted) teaches nothing."""
        for request in requests:
            pending = self._pending.pop(request.request_id, None)
            stats = request.spec_stats
            # The target's confidence at each token emitted since the last plan: row j of a verification
            # emitted token j, so it is also the row that checked guess j + 1.
            confidences, stats.target_confidences = stats.target_confidences, []
            if pending is not None and stats.num_drafts == pending.num_drafts + 1:
                drafted = stats.num_draft_tokens - pending.num_draft_tokens
                accepted = stats.num_accepted_tokens - pending.num_accepted_tokens
                if pending.bucket is not None:
                    self.acceptance.record(pending.bucket, drafted, accepted)
                    got, expected = self._calibration.get(request.request_id, (0.0, 0.0))
                    promised = sum(pending.gains[:drafted])
                    self._calibration[request.request_id] = (_CALIBRATION_DECAY * got + accepted,
                                                             _CALIBRATION_DECAY * expected + promised)
                # Guess j was reached if the j - 1 before it were accepted (the scheduler may have cut the
                # proposal to `drafted` guesses; past those nothing was verified).
                reached = min(drafted, accepted + 1)
                for j, b in enumerate(pending.bins[:reached]):
                    self.confidence.record(b, 1, 1 if j < accepted else 0)
                self.target.record_verified(confidences, reached, accepted)
            self.target.observe(request.request_id, confidences)

    def calibration(self, request_id: str) -> float:
        """A bucketed request's accepted tokens over those its plans expected, with _CALIBRATION_PRIOR
        pseudo-tokens of each (1.0 before any draft)."""
        got, expected = self._calibration.get(request_id, (0.0, 0.0))
        return (got + _CALIBRATION_PRIOR) / (expected + _CALIBRATION_PRIOR)

    def _k_for(self, request: Request, bucket: int | None) -> int:
        stats, rid = request.spec_stats, request.request_id
        signal = stats.recent_acceptance if bucket is None else self.calibration(rid)
        if stats.num_drafts < _MIN_DRAFTS_TO_JUDGE or signal >= self.config.min_acceptance:
            self._cooldown.pop(rid, None)
            return self.config.num_speculative_tokens
        left = self._cooldown.get(rid, self.config.probe_interval)
        if left <= 0:
            self._cooldown.pop(rid)
            return self.config.num_speculative_tokens  # probe: one draft to re-measure acceptance
        self._cooldown[rid] = left - 1
        return 0

    def _gains(self, request: Request, bucket: int | None, k: int) -> list[float]:
        if bucket is None:  # a draft model: guesses reach verification only where the gate kept them
            stats = request.spec_stats
            estimate = self._revival_estimate(request)
            if estimate is not None:
                return geometric_gains(estimate, k)
            return [stats.recent_kept * g for g in geometric_gains(stats.recent_acceptance, k)]
        return self._bucket_gains(bucket, k)

    def _bucket_gains(self, bucket: int, k: int) -> list[float]:
        """What the bucket's learned acceptance promises (a request's calibration compares its outcomes
        with this)."""
        return self.acceptance.gains(bucket, k, None if self.bucket_prior is None else self.bucket_prior(bucket))

    def _allocate(self, requests: list[Request], buckets: list[int | None], caps: list[int],
                  catch_up: list[int]) -> list[int]:
        """Proposals per request (each at most its cap) that maximise emitted tokens per second."""
        n = len(requests)
        fit = self.cost_fit()
        self._num_plans += 1
        if fit is None:
            # A draft model always proposes K, so step sizes never vary and the fit never forms:
            # cycle through the smaller k now and then to measure what they cost.
            if n > self.config.max_batch_size:
                return [0] * n
            k = self.config.num_speculative_tokens
            if self._num_plans % _EXPLORE_EVERY == 0:
                k = (self._num_plans // _EXPLORE_EVERY) % self.config.num_speculative_tokens
            # A bucket whose first guess is learned (or, fresh, believed) to fail more often than not
            # proposes nothing meanwhile: 8 requests on 1- and 2-token lookup matches (learned 0.04)
            # proposed 7 guesses each for the first 16 steps of a fresh engine, at ~5x a plain step.
            return [0 if b is not None and self._bucket_gains(b, 1)[0] < _NO_FIT_MIN_RATE else min(cap, k)
                    for b, cap in zip(buckets, caps, strict=True)]
        # Every request's proposal j by its gain; a request's gains fall with j, so the R best over the
        # batch take a prefix of each request's (the sort is stable, so equal gains keep j's order).
        ranked = sorted(((g, i) for i, (r, b, cap) in enumerate(zip(requests, buckets, caps, strict=True))
                         for g in self._gains(r, b, cap)), key=lambda e: -e[0])
        predict = self._predict = StepTimePredictor(fit, self.measured())
        plain_rate = n / max(predict(n), 1e-9)
        best_r, best_rate, emitted = 0, plain_rate, float(n)
        # A draft model's forwards: as many as the longest proposal, each draft_forward_s, plus for
        # each request that proposes the tokens its draft is behind by beyond a decode-like forward's.
        forward_s, proposed, longest = self.draft_forward_s or 0.0, [0] * n, 0
        token_s = self.draft_token_s or 0.0
        behind_s = [token_s * max(0, c - DECODE_LIKE_TOKENS) / _CATCH_UP_HORIZON for c in catch_up]
        catching_up = 0.0
        for rows, (gain, i) in enumerate(ranked, start=1):
            emitted += gain
            proposed[i] += 1
            catching_up += behind_s[i] if proposed[i] == 1 else 0.0
            if buckets[i] is None:  # a draft model's guess (a lookup's costs no forward: spec/hybrid.py)
                longest = max(longest, proposed[i])
            rate = emitted / max(predict(n + rows) + forward_s * longest + catching_up, 1e-9)
            if rate > best_rate:
                best_r, best_rate = rows, rate
        if best_rate < plain_rate * (1 + min_gain(n)):
            best_r = 0  # a predicted gain within the step-time estimates' noise is not worth its rows
        ks = [0] * n
        for _, i in ranked[:best_r]:
            ks[i] += 1
        if self._num_plans % _EXPLORE_EVERY == 0:
            # Not speculating, probe with one proposal a request: the nearest token count above the
            # plain step, which is what decides whether any pays, at a third of K = 3's cost when it
            # does not (a batch-32 probe with K = 3 cost 2.7x a plain step for 2x its tokens, measured).
            # A request whose draft is far behind is left out: its catch-up would cost more than the
            # probe measures (and is what keeps a draft that does not pay from costing while off).
            # While speculating, every other probe proposes all the caps allow instead of nothing:
            # otherwise the counts above the chosen one are never measured again, and one slow
            # sample of them kept a 0.97-acceptance draft at one guess a step for a whole run.
            in_step = [cap if c <= DECODE_LIKE_TOKENS else 0 for cap, c in zip(caps, catch_up, strict=True)]
            if not best_r:
                other = [min(cap, 1) for cap in in_step]
            elif (self._num_plans // _EXPLORE_EVERY) % 2:
                # The likeliest proposals the caps allow, at most twice the plan's (and at least K): all
                # of them at batch 16 with K = 15 would score 256 rows to price a count no plan is near.
                other, limit = [0] * n, max(self.config.num_speculative_tokens, 2 * best_r)
                for _, i in ranked:
                    if in_step[i] and limit:
                        other[i] += 1
                        limit -= 1
            else:
                other = [0] * n
            _, seen, latest = self.by_count.get(n + sum(other), (0.0, 0, 0))
            if seen < 2 * _MIN_COUNT_SAMPLES or self._num_plans - latest > _STALE_PLANS:
                return other
        return ks

    def is_stale(self, request: Request) -> bool:
        """A request that drafted before but planned no guess for more than _STALE_PLANS_OFF plans: its
        κ and α are from before it went off."""
        if not request.spec_stats.num_drafts:
            return False
        return self._num_plans - self._last_drafted.get(request.request_id, 0) > _STALE_PLANS_OFF

    def _revival_estimate(self, request: Request) -> float | None:
        """α̂ for a draft request that is stale (None otherwise, or before its first scored token)."""
        return self.target.estimate(request.request_id) if self.is_stale(request) else None

    def confidence_rate(self, bin_index: int) -> float:
        """The learned acceptance of draft guesses in confidence bin `bin_index`."""
        return self.confidence.gains(bin_index, 1, CONFIDENCE_PRIORS[bin_index])[0]

    def gate(self, num_decoding: int) -> DraftGate:
        """A DraftGate for the drafting of the step just planned, `num_decoding` requests decoding: it
        predicts step times as that plan did (None before the cost fit forms)."""
        return DraftGate(self, num_decoding, self._predict)

    def note_kept(self, request_id: str, bin_index: int) -> None:
        """A DraftGate kept a guess of this bin for `request_id`: scored once verification has run."""
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.bins.append(bin_index)

    def cost_fit(self) -> tuple[float, float] | None:
        """Least-squares (a, b) of step time = a + b * tokens; None until the samples spread."""
        if len(self.samples) < _MIN_SAMPLES:
            return None
        xs = [float(x) for x, _ in self.samples]
        ys = [y for _, y in self.samples]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var < len(xs) * 0.25:  # token counts barely vary: the slope is noise
            return None
        b = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var, 0.0)
        return max(my - b * mx, 0.0), b

    def forget(self, request_id: str) -> None:
        self._cooldown.pop(request_id, None)
        self._calibration.pop(request_id, None)
        self._pending.pop(request_id, None)
        self.target.forget(request_id)
        self._last_drafted.pop(request_id, None)
