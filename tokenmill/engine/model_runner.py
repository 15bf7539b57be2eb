"""Owns the device: weights, KV cache tensors and the forward pass. Never decides what runs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.engine.cuda_graphs import WIDTH_STEP_TOKENS, DecodeGraphs
from tokenmill.engine.input_buffers import PersistentBlockTables
from tokenmill.engine.interfaces import BlockCopy, RunnerOutput, SampledTokens, ScheduledRequest, SchedulerOutput
from tokenmill.engine.model_input import (
    MAX_DECODE_QUERY,
    ModelInput,
    PlainDecodeArrays,
    build_model_input,
    is_plain_decode,
    plain_decode_arrays,
)
from tokenmill.engine.profiling import PhaseTimer, StepShape
from tokenmill.engine.request import TokenLogprob
from tokenmill.engine.sampler import Sampler, token_logprobs, top1_probs
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.kv_cache import KVCacheSpec, LayerKVCache, kv_cache_spec
from tokenmill.models.arch import ArchConfig
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.registry import model_class

log = logging.getLogger(__name__)

@dataclass(slots=True)
class PreparedStep:
    """A step's inputs built on the host (`ModelRunner.prepare`), in one of three forms: `inp`, device
    tensors to run eagerly; `plain` or `rows`, host arrays to stage into a CUDA graph's buffers."""

    inp: ModelInput | None = None
    plain: PlainDecodeArrays | None = None
    rows: ModelInput | None = None
    block_copies: list[BlockCopy] = field(default_factory=list)  # run before the forward (kv_cache.py)


def kv_bytes_per_block(arch: ArchConfig, block_size: int, spec: KVCacheSpec) -> int:
    """Keys and values (and their scales, if quantized) of every layer for `block_size` tokens."""
    return arch.num_layers * block_size * spec.bytes_per_token(arch.num_kv_heads, arch.head_dim)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def num_kv_blocks(arch: ArchConfig, cache: CacheConfig, spec: KVCacheSpec, device: torch.device) -> int:
    """An explicit block count wins; else as many blocks of `spec` as the byte budget holds."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = cache.kv_cache_bytes
    if budget is None:
        budget = int(available_memory_bytes(device) * cache.memory_fraction)
    return max(1, budget // kv_bytes_per_block(arch, cache.block_size, spec))


class ModelRunner:
    def __init__(self, model_config: ModelConfig, arch: ArchConfig, tensors: Mapping[str, torch.Tensor],
                 max_model_len: int, block_size: int, num_blocks: int | None,
                 kv_spec: KVCacheSpec | None = None, max_num_seqs: int | None = None) -> None:
        """`num_blocks` None: no KV cache yet; the caller sizes it once the weights are in memory
        (`allocate_kv_cache`). `max_model_len` bounds the positions the model can take.
        `max_num_seqs`: keep persistent block tables of that many rows, which needs `forget` for
        every request that ends (the engine core calls it); None rebuilds the tables every step."""
        self.device = model_config.torch_device()
        self.dtype = model_config.torch_dtype()
        self.arch = arch
        self.block_size = block_size
        self.kv_spec = kv_spec or kv_cache_spec("auto", self.dtype)
        self.model: LlamaForCausalLM = model_class(arch.architecture)(
            arch, max_model_len, self.dtype, self.device, model_config.gemm_backend, model_config.attention_backend,
            model_config.quantization)
        self.model.load_weights(tensors)
        if model_config.amx_bf16:
            self.model.set_quant_path(bf16=True)
        self.model.set_compile(model_config.compile)
        self.kv_caches: list[LayerKVCache] = []
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks)
        self.sampler = Sampler(self.device, model_config.seed)
        # Each sampled token also carries the target's top-1 probability at its row (SampledTokens.confidences):
        # set by the engine core for a draft proposer's controller (engine/spec/controller.py).
        self.track_confidence = False
        self.timer = PhaseTimer(self.device)  # the engine core shares its own (profiling.py)
        self.last_tokens: dict[str, int] = {}  # each request's last token sampled by `run`: pending tokens' source
        self.tables: PersistentBlockTables | None = None
        if max_num_seqs is not None:
            self.tables = PersistentBlockTables(max_num_seqs, -(-max_model_len // block_size) + 1)
        # False: the previous per-step path (tables rebuilt, masks for every group), for
        # benchmarks/host_overhead.py's before/after in one process.
        self.persistent_inputs = self.tables is not None
        # Decode-group steps replay CUDA graphs (engine/cuda_graphs.py): on CUDA, with persistent
        # tables and the paged decode kernel, unless enforce_eager. Captured once the KV cache exists.
        self.graphs: DecodeGraphs | None = None
        self._graph_mode: str | None = None
        self._graph_width_step = WIDTH_STEP_TOKENS
        if (self.device.type == "cuda" and not model_config.enforce_eager and self.tables is not None
                and self.model.attn.decode_kernel is not None):
            self._graph_mode = "cuda"

    def forget(self, request_id: str, sampler: bool = True) -> None:
        """A request ended (finished or aborted): free its row and (`sampler`) its sampler state. With
        asynchronous scheduling the sampler's part goes to the device thread, after the running step
        (which may still sample a row of the request: engine/pipeline.py)."""
        if sampler:
            self.sampler.forget(request_id)
        if self.tables is not None:
            self.tables.forget(request_id)

    def reset(self) -> None:
        if self.tables is not None:
            self.tables.reset()

    def _input(self, out: SchedulerOutput) -> ModelInput:
        return self._device_input(self.prepare(out))

    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        """The step's inputs, from the requests' state now: all the host work of a step before the
        forward. Asynchronous scheduling calls it on the scheduling thread while the previous step
        runs, so it touches no device buffer another step may be reading: a CUDA graph's static
        buffers are written by `run`, on the executing thread, and so are the KV blocks it copies."""
        step = self._prepare_inputs(out)
        step.block_copies = out.block_copies
        return step

    def _prepare_inputs(self, out: SchedulerOutput) -> PreparedStep:
        fast = self.persistent_inputs and self.tables is not None
        if self.graphs is not None and fast:
            assert self.tables is not None
            if is_plain_decode(out.scheduled):
                arrays = plain_decode_arrays(out.scheduled, self.block_size, self.tables)
                if self.graphs.key_for(arrays.num_rows, arrays.table.shape[1]) is not None:
                    return PreparedStep(plain=arrays)
            elif all(s.num_new_tokens <= MAX_DECODE_QUERY for s in out.scheduled):
                host = build_model_input(out.scheduled, self.block_size, self.arch.sliding_window,
                                         torch.device("cpu"), self.tables, decode_mask=False)
                if self.graphs.rows_key(host) is not None:
                    return PreparedStep(rows=host)
            # No graph fits: eager. Building updated the persistent tables idempotently; build again.
        return PreparedStep(inp=build_model_input(
            out.scheduled, self.block_size, self.arch.sliding_window, self.device, self.tables if fast else None,
            decode_mask=not fast or self.model.attn.decode_kernel is None))

    def _device_input(self, p: PreparedStep) -> ModelInput:
        """Fill in the pending tokens (the previous step's samples), then stage into a graph's buffers."""
        if p.plain is not None:
            assert self.graphs is not None
            for row, request_id in p.plain.pending_rows:
                p.plain.input_ids[row] = self.last_tokens[request_id]
            staged = self.graphs.stage(p.plain)
            assert staged is not None, "prepare checked that a graph fits"
            return staged
        inp = p.rows if p.rows is not None else p.inp
        assert inp is not None
        if inp.pending_rows:
            rows = [row for row, _ in inp.pending_rows]
            tokens = [self.last_tokens[rid] for _, rid in inp.pending_rows]
            if inp.input_ids.device.type == "cpu":
                inp.input_ids.numpy()[rows] = tokens  # a torch index_put is ~80 µs of small-op overhead
            else:
                inp.input_ids[torch.tensor(rows)] = torch.tensor(tokens, dtype=inp.input_ids.dtype).to(
                    inp.input_ids.device, non_blocking=True)
        if p.rows is not None:
            assert self.graphs is not None
            staged = self.graphs.stage_rows(p.rows)
            assert staged is not None, "prepare checked that a graph fits"
            return staged
        return inp

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """`num_blocks` for the KV cache manager; with CUDA graphs one more, the padding rows' (never handed out)."""
        if self._graph_mode is None:
            self.kv_caches = self._allocate_kv(num_blocks)
            return
        self.kv_caches = self._allocate_kv(num_blocks + 1)
        assert self.tables is not None
        graphs = DecodeGraphs(self._forward_meta, self.device, self.tables.table.shape[0], self.tables.width,
                              self.block_size, pad_block=num_blocks, mode=self._graph_mode,
                              width_step_tokens=self._graph_width_step)
        try:
            graphs.capture()
        except Exception as e:  # a capture that fails (an op this GPU/driver cannot capture) costs speed, not service
            log.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly (as with --enforce-eager)",
                        type(e).__name__, e)
            self.graphs = None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return
        self.graphs = graphs

    def enable_decode_graphs(self, mode: str, width_step_tokens: int = WIDTH_STEP_TOKENS) -> None:
        """Replay decode-group steps from graphs from now on: "cuda", or "eager" (the same static
        buffers re-run eagerly, how CPU tests exercise the staging). Reallocates the KV cache."""
        self._graph_mode = mode
        self._graph_width_step = width_step_tokens
        self.allocate_kv_cache(self.kv_caches[0].k.shape[0] if self.kv_caches else 1)

    def _forward_meta(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _forward(self, inp: ModelInput) -> torch.Tensor:
        if inp.graph_key is not None:
            assert self.graphs is not None
            return self.graphs.replay(inp)
        return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)

    def _forward_announced(self, inp: ModelInput, on_forward: Callable[[], None] | None) -> torch.Tensor:
        """The forward, with `on_forward` called as it starts: from inside the native decoder stack where
        it runs (after the embedding and RoPE tables, whose torch calls each hand the GIL over: host work
        started before them held it through them), as the stack declines a step (a prefill's Python layers
        release the GIL op by op anyway), or before the forward where there is no stack."""
        stack = self.model.native_stack
        if on_forward is not None and stack is None:
            on_forward()
        elif stack is not None:
            stack.on_enter = on_forward
        try:
            with self.timer.phase("forward"):
                return self._forward(inp)
        finally:
            if stack is not None:
                stack.on_enter = None

    def _allocate_kv(self, num_blocks: int) -> list[LayerKVCache]:
        return [self.kv_spec.allocate(num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim,
                                      self.device) for _ in range(self.arch.num_layers)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.kv_caches)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step; sample for every request whose chunk reached its last known token."""
        with self.timer.phase("build_input"):
            prepared = self.prepare(out)
        return self.run(prepared)

    def _copy_block_rows(self, copies: list[BlockCopy]) -> None:
        """Every copy of the step, in every layer: the flat row indices built once."""
        bs = self.block_size
        src = [c.src * bs + r for c in copies for r in range(c.num_rows)]
        dst = [c.dst * bs + r for c in copies for r in range(c.num_rows)]
        src_rows, dst_rows = (torch.tensor(rows, dtype=torch.long, device=self.device) for rows in (src, dst))
        for layer in self.kv_caches:
            layer.copy_rows(src_rows, dst_rows)

    @torch.inference_mode()
    def run(self, prepared: PreparedStep, on_forward: Callable[[], None] | None = None) -> RunnerOutput:
        """Execute a prepared step: the device work (forward, logits, sampling). Steps run in the order
        they were prepared, each after the one before it ended (its samples fill the pending tokens).
        `on_forward` is called as the forward starts (asynchronous scheduling times its host work by it)."""
        timer = self.timer
        if prepared.block_copies:  # rows requests take from cached partial blocks
            self._copy_block_rows(prepared.block_copies)
        with timer.phase("build_input"):
            inp = self._device_input(prepared)
        if timer.enabled:
            timer.shape = _shape(inp)
        with timer.phase("sample"):
            if inp.sampled and not any(s.spec_token_ids for s in inp.sampled):
                self.sampler.prepare([s.request for s in inp.sampled])  # grammar masks overlap the forward
        hidden = self._forward_announced(inp, on_forward)
        with timer.phase("logits"):
            result = RunnerOutput(prompt_logprobs=self._prompt_logprobs(hidden, inp))
            rows = hidden if inp.every_row_sampled else hidden[inp.sample_indices]
            logits = self.model.compute_logits(rows) if inp.sampled else None
        if logits is not None:
            with timer.phase("sample"):
                if any(s.spec_token_ids for s in inp.sampled):
                    result.sampled = self._verify(logits, inp)
                else:
                    requests = [s.request for s in inp.sampled]
                    samples = self.sampler(logits, requests)
                    result.sampled = {r.request_id: SampledTokens([token], [logprob])
                                      for r, (token, logprob) in zip(requests, samples, strict=True)}
                if self.track_confidence:
                    self._attach_confidences(logits, inp, result.sampled)
        self.last_tokens = {rid: tokens.token_ids[-1] for rid, tokens in result.sampled.items()}
        return result

    @staticmethod
    def _attach_confidences(logits: torch.Tensor, inp: ModelInput, sampled: dict[str, SampledTokens]) -> None:
        """Request i owns 1 + k_i logits rows in order (k_i = 0 without proposals); its emitted token j
        came from its row j."""
        probs, row = top1_probs(logits), 0
        for s in inp.sampled:
            tokens = sampled[s.request.request_id]
            tokens.confidences = probs[row:row + len(tokens.token_ids)]
            row += 1 + len(s.spec_token_ids)

    def _verify(self, logits: torch.Tensor, inp: ModelInput) -> dict[str, SampledTokens]:
        """Speculative step: every sampled request owns 1 + k rows (k = 0 without proposals)."""
        requests = [s.request for s in inp.sampled]
        drafts = [s.spec_token_ids for s in inp.sampled]
        # q of each proposal: a sampling draft's distributions, or None for point masses (n-gram lookup,
        # a greedy draft: q = one-hot), see Sampler.verify.
        draft_probs = [s.spec_draft_probs for s in inp.sampled]
        verified = self.sampler.verify(logits, requests, drafts,
                                       draft_probs if any(q is not None for q in draft_probs) else None)
        return {r.request_id: SampledTokens(tokens, logprobs)
                for r, (tokens, logprobs) in zip(requests, verified, strict=True)}

    @torch.inference_mode()
    def sample_logits(self, out: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """Run one step without sampling (a draft model's forward): the requests whose chunk reached
        their last token, in row order, and the float32 logits of their last token."""
        inp = self._input(out)
        hidden = self._forward(inp)
        return inp.sampled, self.model.compute_logits(hidden[inp.sample_indices])

    def _prompt_logprobs(self, hidden: torch.Tensor, inp: ModelInput) -> dict[str, list[TokenLogprob]]:
        """Position p of the prompt scores prompt token p + 1 (the first prompt token has none)."""
        result: dict[str, list[TokenLogprob]] = {}
        for s, offset in inp.prompt_logprob_offsets:
            request = s.request
            start = s.num_computed_tokens
            last = min(start + s.num_new_tokens, request.num_prompt_tokens - 1)
            if last <= start:
                continue
            logits = self.model.compute_logits(hidden[offset:offset + last - start])
            targets = torch.tensor(request.token_ids[start + 1:last + 1], device=logits.device)
            entries = token_logprobs(logits, targets, [request.params.prompt_logprobs] * len(targets))
            result[request.request_id] = [e for e in entries if e is not None]
        return result

    @torch.inference_mode()
    def logits_for(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step and return the float32 logits of every scheduled token (for parity tests)."""
        inp = self._input(out)
        return self.model.compute_logits(self._forward(inp))



def _shape(inp: ModelInput) -> StepShape:
    if inp.graph_key is not None:  # the static metadata is the padded bucket's: count the real rows
        rows = int(inp.input_ids.shape[0])
        return StepShape(rows, 0, rows)
    meta = inp.meta
    num_decode = meta.decode.num_tokens if meta.decode is not None else 0
    num_prefill = meta.prefill.num_tokens if meta.prefill is not None else 0
    num_seqs = (meta.decode.block_table.shape[0] if meta.decode is not None else 0) + \
        (meta.prefill.block_table.shape[0] if meta.prefill is not None else 0)
    return StepShape(num_decode, num_prefill, num_seqs)
