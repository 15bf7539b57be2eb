"""Plain stats dataclasses the engine emits; the server turns them into Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.step_time import StepTimeFit


@dataclass(slots=True)
class ClassStepStats:
    """What the SLO-aware scheduler decided for one step (docs/workload_classes.md). Keys are
    service class names ("interactive", "standard", "batch"); every class is a key."""

    scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_seqs: dict[str, int] = field(default_factory=dict)
    num_deferred: int = 0  # running requests of lower classes paused this step (they keep their KV blocks)
    protected_class: str | None = None  # whose TPOT target bounded the step; None: whole budget for all
    step_time_limit_s: float | None = None  # margin x that target
    predicted_step_time_s: float | None = None  # the fit's prediction for this step; None: no fit yet
    step_time_fit: StepTimeFit | None = None


@dataclass(slots=True)
class StepStats:
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_preempted: int
    kv_usage: float  # fraction of KV blocks held by requests
    prefix_cache_queries: int  # cumulative tokens looked up
    prefix_cache_hits: int  # cumulative tokens found
    step_time_s: float
    num_prompt_tokens: int = 0  # prompt tokens computed this step (prefix-cache hits excluded)
    num_generation_tokens: int = 0  # tokens sampled this step
    num_preemptions_total: int = 0
    # CPU engines: compute threads now, and the cores other processes took from this engine's CPUs
    # over the last interval (engine/cpu_share.py; 0 / 0.0 where the governor is off).
    cpu_threads: int = 0
    cpu_other_cores: float = 0.0
    ttfts_s: list[float] = field(default_factory=list)  # of requests whose first token came this step
    inter_token_latencies_s: list[float] = field(default_factory=list)
    # Speculative decoding, this step: requests whose proposals were verified, tokens proposed,
    # tokens accepted, and per position i how many drafts had token i accepted; whether the
    # controller let requests propose (None: speculation is not configured).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_is_on: bool | None = None
    spec_num_gated_tokens: int = 0  # draft guesses the confidence gate dropped (drafted, never verified)
    spec_num_forced_tokens: int = 0  # proposals the requests' grammars forced (counted in spec_num_draft_tokens)
    spec_num_prediction_accepted: int = 0  # prediction tokens accepted (predicted outputs)
    spec_num_prediction_rejected: int = 0  # prediction tokens verified and refused
    spec_cached_tokens: int = 0  # tokens of recent outputs the proposer keeps for other requests (suffix)
    # Service classes: this step's decisions, and per class the TTFTs and inter-token latencies of
    # this step's tokens and the requests running / waiting now.
    classes: ClassStepStats = field(default_factory=ClassStepStats)
    class_ttfts_s: dict[str, list[float]] = field(default_factory=dict)
    class_inter_token_latencies_s: dict[str, list[float]] = field(default_factory=dict)
    class_num_running: dict[str, int] = field(default_factory=dict)
    class_num_waiting: dict[str, int] = field(default_factory=dict)
