"""One frozen dataclass per subsystem; each validates itself on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.engine.service_class import SERVICE_TIERS, ServiceClass
from tokenmill.errors import TokenmillError
from tokenmill.kernels import ATTENTION_BACKENDS, DEFAULT_QUANTIZATION, GEMM_BACKENDS, QUANTIZATIONS
from tokenmill.layers import KV_CACHE_DTYPES
from tokenmill.platform import auto_dtype

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPILE_MODES = ("auto", "on", "off")


def compile_mode(value: str | bool | None) -> str:
    """ModelConfig.compile from what a user passes: --compile / --no-compile / neither (True, False,
    None) or LLM(compile=True/False/"auto"/"on"/"off")."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TokenmillError(message)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str
    dtype: str = "auto"  # "auto": bfloat16 where the hardware has it natively (GPU, AVX512-BF16/AMX), else float32
    device: str = "auto"  # "auto": cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    # CPU GEMM kernel per weight: "auto" = the native kernel for 1-4 rows, oneDNN for large matrices
    # (faster than MKL on AVX2 hosts), else F.linear; "aten" always F.linear, "onednn" always oneDNN
    # where available. See layers/linear.py.
    gemm_backend: str = "auto"
    # Decode attention: "auto" uses the native CPU kernel where it builds, "sdpa" the PyTorch path,
    # "native" insists on the kernel. See layers/attention.py.
    attention_backend: str = "auto"
    # Weights: "auto" keeps a GGUF's own bit width (8-bit types run as q8, 4-bit as q4, natively);
    # "none" dequantizes to `dtype` (the reference path); "q8" / "q4" quantize every matrix at load,
    # safetensors too. The default is DEFAULT_QUANTIZATION (why: tokenmill/kernels). See layers/linear.py.
    quantization: str = DEFAULT_QUANTIZATION
    # True: on AMX hosts, quantized GEMMs of 64+ rows (prefill chunks, wide decode batches) take bf16
    # tiles, 2-4x faster, with bf16 rounding: a request's tokens then depend on what shares its batch,
    # and Qwen2.5-Coder-1.5B fails the 0.99 top-1 release gate with them (docs/quantization.md). False
    # (the default): the integer kernels' rounding at every row count, the same bits on every path.
    amx_bf16: bool = False
    # True: no CUDA graphs; every decode step launches its kernels from Python (engine/cuda_graphs.py).
    enforce_eager: bool = False
    # torch.compile of the decoder stack's glue around the native GEMM/attention ops (models/compiled.py):
    # "on", "off", or "auto" = where it measured faster, which on CPU is nowhere yet (docs/performance.md).
    compile: str = "auto"

    def __post_init__(self) -> None:
        _require(self.compile in COMPILE_MODES,
                 f"compile '{self.compile}' is not supported: use {', '.join(COMPILE_MODES)}")
        _require(self.quantization in QUANTIZATIONS,
                 f"quantization '{self.quantization}' is not supported: use {', '.join(QUANTIZATIONS)}")
        _require(self.gemm_backend in GEMM_BACKENDS,
                 f"gemm backend '{self.gemm_backend}' is not supported: use {', '.join(GEMM_BACKENDS)}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention backend '{self.attention_backend}' is not supported: use {', '.join(ATTENTION_BACKENDS)}")
        _require(self.dtype == "auto" or self.dtype in _DTYPES,
                 f"dtype '{self.dtype}' is not supported: use auto, {', '.join(_DTYPES)}")
        _require(self.max_model_len is None or self.max_model_len > 0, "max_model_len must be positive")

    def torch_dtype(self) -> torch.dtype:
        return auto_dtype(self.torch_device()) if self.dtype == "auto" else _DTYPES[self.dtype]

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # KV budget: an explicit block count wins; else bytes; else a fraction of free memory.
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    memory_fraction: float = 0.25
    enable_prefix_caching: bool = True
    # Element type of keys and values: "auto" = the model's dtype; "int8" stores a fp16 scale per
    # (token, kv head) and holds ~1.9x the tokens of bf16 (3.9x fp32) in the same bytes. Every
    # device can run it: the native CPU decode kernel reads int8 in place, the SDPA path dequantizes
    # the blocks it gathers. See layers/kv_cache.py.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv cache dtype '{self.kv_cache_dtype}' is not supported: use {', '.join(KV_CACHE_DTYPES)}")
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 "block_size must be a power of two")
        _require(self.num_blocks is None or self.num_blocks > 0, "num_blocks must be positive")
        _require(0.0 < self.memory_fraction <= 0.95, "memory_fraction must be in (0, 0.95]")


@dataclass(frozen=True, slots=True)
class SLOTarget:
    """One service class's latency targets (seconds); None: no target."""

    ttft_s: float | None = None  # time to first token
    tpot_s: float | None = None  # time per output token after the first

    def __post_init__(self) -> None:
        _require(self.ttft_s is None or self.ttft_s > 0, "a TTFT target must be positive")
        _require(self.tpot_s is None or self.tpot_s > 0, "a TPOT target must be positive")


@dataclass(frozen=True, slots=True)
class ServiceClassConfig:
    """Per-class SLO targets and the SLO-aware step builder's knobs (docs/workload_classes.md).

    The most latency-sensitive class present that has a TPOT target is protected: its decodes
    always run, and lower classes fill only what is left of step_time_margin x its TPOT target,
    by the online step-time model (engine/step_time.py). Defaults are for a 2-core CPU serving
    SmolLM2-135M, where a chat decode step alone takes ~60 ms (issue 15): an interactive target
    of 100 ms/token (10 tokens/s, faster than anyone reads) leaves room for batch work; standard
    (plain completions) tolerates 0.5 s; batch has no targets, it only wants throughput.
    """

    enabled: bool = True  # False: the scheduler ignores classes (they remain labels for metrics)
    interactive: SLOTarget = SLOTarget(ttft_s=1.0, tpot_s=0.1)
    standard: SLOTarget = SLOTarget(ttft_s=5.0, tpot_s=0.5)
    batch: SLOTarget = SLOTarget()
    # Steps are planned to this fraction of the TPOT target: the rest pays for what happens between
    # steps (output processing, detokenization, streaming), which the step-time model does not see.
    step_time_margin: float = 0.8
    # Lower classes fill a step holding protected work only while it stays within this fraction over
    # the protected work's own predicted time (None: the TPOT target alone bounds them). Chat then
    # runs near its speed alone on any machine, not just within the target.
    protected_slowdown: float | None = 0.05
    min_step_samples: int = 16  # measured steps before the step-time fit is trusted
    # Until then, a step holding protected decodes carries at most this many tokens in all.
    unfitted_step_tokens: int = 32
    # An interactive prompt advances at least this many tokens a step, even when the running
    # interactive decodes alone fill the target (else its TTFT would be unbounded).
    min_prefill_chunk: int = 16
    # While interactive traffic is recent (a request of the class seen within interactive_recent_s),
    # even steps without protected work end within arrival_step_share x the interactive TTFT target:
    # a chat that arrives while a batch prefill runs waits at most that long for its first step.
    # Steps are capped in time, not in share: the batch work still has the whole machine.
    arrival_step_share: float = 0.1
    interactive_recent_s: float = 60.0
    # With no recent interactive traffic, such steps still end within quiet_step_share x that target
    # (None: the whole token budget): the first chat after a quiet spell otherwise waited for a batch
    # burst's full-budget prefill step, 6-8 s on SmolLM2 at 2 cores (docs/workload_classes.md, run 13).
    # Prefill is compute-bound, so shorter chunks cost batch throughput little.
    quiet_step_share: float | None = 1.0
    # Synthetic steps that fit the step-time model while a fresh server's engine idles, stopped by
    # the first real request (engine/calibration.py); 0: learn from live traffic only. `tokenmill
    # serve` sets 24.
    calibration_steps: int = 0

    def __post_init__(self) -> None:
        _require(0.0 < self.step_time_margin <= 1.0, "step_time_margin must be in (0, 1]")
        _require(self.protected_slowdown is None or self.protected_slowdown >= 0,
                 "protected_slowdown must be >= 0 or None")
        _require(self.calibration_steps >= 0, "calibration_steps must be >= 0")
        _require(0.0 <= self.arrival_step_share <= 1.0, "arrival_step_share must be in [0, 1]")
        _require(self.interactive_recent_s >= 0, "interactive_recent_s must be >= 0")
        _require(self.quiet_step_share is None or self.quiet_step_share > 0, "quiet_step_share must be > 0 or None")
        _require(self.min_step_samples >= 1, "min_step_samples must be positive")
        _require(self.unfitted_step_tokens >= 1, "unfitted_step_tokens must be positive")
        _require(self.min_prefill_chunk >= 1, "min_prefill_chunk must be positive")

    def target(self, service_class: ServiceClass) -> SLOTarget:
        return {ServiceClass.INTERACTIVE: self.interactive, ServiceClass.STANDARD: self.standard,
                ServiceClass.BATCH: self.batch}[service_class]


# SchedulerConfig.shared_prefix_wait_tokens's default (the CLIs' and LLM's): two blocks, SGLang's threshold; 128 waited
# only for long shared prompts, where 32 measured faster from 2 requests sharing 32 tokens up (docs/performance.md)
SHARED_PREFIX_WAIT_TOKENS = 32


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one engine step
    max_num_seqs: int = 64
    policy: str = "fcfs"  # "fcfs" or "priority" (orders requests within a service class)
    enable_chunked_prefill: bool = True
    service_classes: ServiceClassConfig = field(default_factory=ServiceClassConfig)
    # Schedule step N + 1 while step N runs (engine/pipeline.py): "on", "off", or "auto" (off for now).
    async_scheduling: str = "auto"
    # A waiting request whose next uncached prompt blocks, this many tokens or more, a running request (as
    # urgent or more) is computing waits for them instead of computing them again beside it: it then finds
    # them cached (SGLang's in-batch prefix caching; n > 1 children, bursts with one system prompt). 0: off.
    shared_prefix_wait_tokens: int = SHARED_PREFIX_WAIT_TOKENS

    def __post_init__(self) -> None:
        _require(self.async_scheduling in ("auto", "on", "off"), "async_scheduling must be auto, on or off")
        _require(self.shared_prefix_wait_tokens >= 0, "shared_prefix_wait_tokens must be >= 0")
        _require(self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive")
        _require(self.max_num_seqs > 0, "max_num_seqs must be positive")
        _require(self.policy in ("fcfs", "priority"), "policy must be 'fcfs' or 'priority'")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft", "ngram-draft", "suffix-draft")
DRAFT_METHODS = ("draft", "ngram-draft", "suffix-draft")  # the methods that load a draft model
# ngram: 7 (was 5) since the Zen 5 duo tiles made an 8-row verification ~2.2x a decode: a copied span's
# 8-token steps then beat 6-token ones, and the controller still picks k <= 7 by measured step times
# (batch-1 code edits 1.83-1.88x against 1.74-1.84x with 5, equal at 32 requests; docs/speculative.md).
# 15 (16-row verifications at ~3.2x a decode) measured the same as 7 on the three edits (1.009x, two
# engines in one process, 5 rounds), and 11 0.966x: the spans' ends cost what their longer steps save.
# suffix: as ngram (its guesses are lookups too, priced by the same controller); suffix-draft as ngram-draft.
DEFAULT_SPECULATIVE_TOKENS = {"ngram": 7, "suffix": 7, "draft": 3, "ngram-draft": 5, "suffix-draft": 5}


# A draft's default weights: q4 blocks, the fewest bytes a draft forward streams. Measured on the Zen 3
# host (docs/speculative.md): Qwen2.5-Coder-0.5B drafting for the 1.5B at batch 1, code edit 1.50x with
# a q4 draft against 1.15x with the GGUF's own (mostly 8-bit) blocks, chat 0.99x against 0.93x.
DRAFT_QUANTIZATION = "q4"


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec/). Off unless `method` is set."""

    # None: off; "ngram" (prompt lookup), "suffix" (prompt lookup and a cache of recent outputs:
    # engine/spec/suffix.py), "draft" (a smaller model), "ngram-draft" (lookup where the context
    # repeats, the draft elsewhere: engine/spec/hybrid.py) or "suffix-draft" (the same with suffix's lookup)
    method: str | None = None
    # K: at most this many proposals per request per step (the controller picks k <= K each step).
    # 0 = the method's default: n-gram 5 (the controller gives rows only to likely proposals, and
    # long copied spans pay on hosts with cheap extra rows), draft 3 (each draft token is a draft forward),
    # ngram-draft 5 (lookups as n-gram's; the controller prices each draft guess's forward).
    num_speculative_tokens: int = 0
    ngram_min: int = 1  # n-gram lookup tries suffixes of ngram_max..ngram_min tokens
    ngram_max: int = 4
    draft_model: str | None = None  # catalog name or path of the draft (same tokenizer as the target)
    # The draft's weight format (ModelConfig.quantization's values); None: DRAFT_QUANTIZATION, or
    # "none" when the target runs "none" (the float reference path). Its tokens are only guesses that
    # verification checks, so its rounding changes speed, never the output.
    draft_quantization: str | None = None
    # A sampled request's draft guesses are drawn from the draft's distribution (q goes to verification);
    # False: the draft's argmax for every request (q a point mass).
    draft_sampling: bool = True
    # The draft's lm_head keeps only the first draft_vocab token ids (None: all). A byte-level BPE
    # vocabulary is in merge order, so low ids are the frequent tokens (Qwen2.5's first 65,536 of
    # 151,936 cover 98.2-98.7% of prose and code tokens), and the head is a large share of a small
    # draft's bytes (Qwen2.5-0.5B: 136 M of 494 M weights). The draft cannot guess a token past the
    # cut; verification is unchanged, so output is exact either way (docs/speculative.md).
    draft_vocab: int | None = None
    # suffix: the recent outputs the cross-request cache keeps, in tokens (oldest evicted first; ~0.45 KB
    # a token of index: engine/spec/output_cache.py).
    suffix_cache_tokens: int = 65536
    # Controller (spec/controller.py): requests below this recent acceptance stop proposing and
    # probe again every probe_interval steps; until step times have been measured over a spread of
    # batch sizes, steps with more than max_batch_size decoding requests do not speculate.
    min_acceptance: float = 0.2
    probe_interval: int = 16
    max_batch_size: int = 8
    adaptive: bool = True  # False: every decoding request always proposes (tests, raw-mechanism benchmarks)

    def draft_weights(self, target_quantization: str) -> str:
        """The draft model's ModelConfig.quantization next to a target running `target_quantization`."""
        if self.draft_quantization is not None:
            return self.draft_quantization
        return "none" if target_quantization == "none" else DRAFT_QUANTIZATION

    def __post_init__(self) -> None:
        _require(self.method is None or self.method in SPECULATIVE_METHODS,
                 f"speculative method '{self.method}' is not supported: use {', '.join(SPECULATIVE_METHODS)}")
        if self.num_speculative_tokens == 0:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_SPECULATIVE_TOKENS.get(self.method or "", 3))
        _require(1 <= self.num_speculative_tokens <= 32, "num_speculative_tokens must be in 1..32")
        _require(1 <= self.ngram_min <= self.ngram_max, "ngram_min and ngram_max must satisfy 1 <= min <= max")
        _require(self.method not in DRAFT_METHODS or bool(self.draft_model),
                 f"speculative method '{self.method}' needs a draft model: pass --draft-model NAME")
        _require(self.draft_quantization is None or self.draft_quantization in QUANTIZATIONS,
                 f"draft quantization '{self.draft_quantization}' is not supported: use {', '.join(QUANTIZATIONS)}")
        _require(self.draft_vocab is None or self.draft_vocab >= 1, "draft_vocab must be a positive token count")
        _require(self.suffix_cache_tokens >= 0, "suffix_cache_tokens must be >= 0")
        _require(0.0 <= self.min_acceptance <= 1.0, "min_acceptance must be in [0, 1]")
        _require(self.probe_interval >= 1, "probe_interval must be positive")
        _require(self.max_batch_size >= 1, "max_batch_size must be positive")


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    """Step profiling (engine/profiling.py, docs/performance.md): off unless num_steps > 0."""

    num_steps: int = 0  # steps timed per phase, then as many again instrumented (torch trace, stack samples)
    output_dir: str = "tokenmill-profile"  # profile.json, profile.txt, trace.json (Chrome trace), stacks.txt
    warmup_steps: int = 2  # steps with work skipped first (kernel builds, first-touch pages)
    torch_trace: bool = True  # False: no trace.json
    sample_interval_ms: float = 1.0  # the engine thread's Python stacks (stacks.txt, folded); 0: off

    def __post_init__(self) -> None:
        _require(self.num_steps >= 0, "profile steps must be >= 0")
        _require(self.warmup_steps >= 0, "profile warmup steps must be >= 0")
        _require(self.sample_interval_ms >= 0, "the stack sampling interval must be >= 0 ms")

    @property
    def instrumented(self) -> bool:
        """Whether a second window of num_steps steps runs under the torch profiler or the stack sampler."""
        return self.torch_trace or self.sample_interval_ms > 0

    @property
    def enabled(self) -> bool:
        return self.num_steps > 0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # None: one per CPU of the affinity mask, capped by a cgroup CPU quota
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # After loading, glibc keeps freed memory for reuse (platform.retain_freed_memory): a step's
    # large activations (a prefill's gate/up output is 68 MB) otherwise come as fresh mmap pages
    # and are faulted in on every step. False: glibc's defaults.
    retain_freed_memory: bool = True
    # CPU engines run fewer compute threads while other processes take some of their CPUs
    # (engine/cpu_share.py): one busy process beside a 2-thread engine made its steps 2.6x slower.
    adapt_threads: bool = True

    def __post_init__(self) -> None:
        _require(not (self.scheduler.async_scheduling == "on" and self.speculative.method is not None),
                 "async scheduling does not combine with speculative decoding: use --async-scheduling auto or off")


_LOG_REQUEST_MODES = ("off", "meta", "ids", "ids+text")


CACHE_ISOLATIONS = ("shared", "api-key")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise: the API has no auth by default
    port: int = 8000
    served_model_name: str = "model"  # the `model` clients must send
    api_key: str | None = None  # None: /v1/* is open
    # The admission queue holds requests admitted but not yet producing tokens; beyond it: 429.
    max_queue_requests: int = 256
    max_queue_tokens: int = 1 << 20  # their prompt tokens
    retry_after_s: int = 1
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may take to finish
    log_requests: str = "off"  # off, meta (timings), ids (+ token ids), ids+text: a JSON line per request
    # Service classes (docs/workload_classes.md): the share of both queue bounds that only interactive
    # requests may fill, so a flood of standard/batch submissions is refused before it blocks a chat user.
    interactive_queue_reserve: float = 0.25
    # (API key, service class name) pairs: requests with that bearer token default to that class (each
    # key is also accepted as a credential). A body `service_tier` or the header still overrides it.
    api_key_classes: tuple[tuple[str, str], ...] = ()
    # Streamed batch-class responses get a chunk at most this often (the text since the last one in
    # it; first token and finish at once): a batch job wants throughput, and a hundred of its streams
    # writing a chunk every step take the cores from the engine thread. 0: a chunk a step.
    batch_stream_interval_s: float = 0.25
    # "shared": requests share cached prefix blocks (and suffix-speculation outputs) unless their bodies
    # name different `cache_salt`s; "api-key": each API key is its own cache namespace too (its requests'
    # salt is the key's, plus the body's), so tenants with different keys cannot learn from a cache hit's
    # latency what another sent, whatever their clients send. Needs api_key or api_key_classes.
    cache_isolation: str = "shared"
    # /v1/responses kept in memory for previous_response_id and GET /v1/responses/{id}, least recently used
    # forgotten first; 0: none kept (store answered false, previous_response_id a 400)
    responses_store_size: int = 1000
    responses_store_mb: int = 256  # ...holding at most this much of their JSON

    def __post_init__(self) -> None:
        _require(self.responses_store_size >= 0 and self.responses_store_mb >= 1,
                 "responses_store_size must be >= 0 and responses_store_mb >= 1")
        _require(0.0 <= self.interactive_queue_reserve < 1.0, "interactive_queue_reserve must be in [0, 1)")
        _require(self.cache_isolation in CACHE_ISOLATIONS,
                 f"cache_isolation must be one of {', '.join(CACHE_ISOLATIONS)}")
        _require(self.cache_isolation != "api-key" or self.api_key is not None or bool(self.api_key_classes),
                 "cache isolation by API key needs API keys: pass --api-key or --api-key-class")
        _require(self.batch_stream_interval_s >= 0, "batch_stream_interval_s must be >= 0")
        _require(all(key for key, _ in self.api_key_classes), "api keys must not be empty")
        for _, name in self.api_key_classes:
            _require(name in SERVICE_TIERS, f"service class '{name}' is unknown: use one of {', '.join(SERVICE_TIERS)}")
        _require(0 < self.port < 65536, "port must be in 1..65535")
        _require(bool(self.served_model_name), "served_model_name must not be empty")
        _require(self.api_key is None or bool(self.api_key), "api_key must not be empty")
        _require(self.max_queue_requests > 0, "max_queue_requests must be positive")
        _require(self.max_queue_tokens > 0, "max_queue_tokens must be positive")
        _require(self.retry_after_s > 0, "retry_after_s must be positive")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _require(self.log_requests in _LOG_REQUEST_MODES,
                 f"log_requests must be one of {', '.join(_LOG_REQUEST_MODES)}")
