"""Decode steps replayed from CUDA graphs: one capture per (batch bucket, table-width bucket).

A decode step on a GPU is hundreds of small kernels (28 layers x ~12 ops for a 1.5B model) whose
launches from Python cost more than their work at small batches. A graph captured once replays
them all with one call. It replays fixed addresses and shapes, so:

  * inputs live in static device buffers, staged from one pinned host buffer with one copy a step:
        host/dev int64 [input ids: B | positions: B | slots: B | seq_lens: B | block table: B x W]
    B is the largest batch bucket, W the block-table width of the longest context; a step of
    bucket b copies the fields and the first b table rows, one contiguous prefix;
  * a step of n plain decodes (one new token each, engine/model_input.py's `PlainDecodeArrays`)
    pads to the next batch bucket b >= n (as vLLM does): padding rows decode token 0 at position 0
    into a pad slot of a block the KV cache manager never hands out (`pad_block`), over a table of
    that block, seq_len 1: real rows never read what they write;
  * the table a graph reads is the first w columns of the static table, w the smallest width bucket
    that covers the step's longest context, so a short context's step does not pay the split
    attention of the longest one (kernels/triton_attention.py sizes its grid from the table width).

Plain decode steps replay, and so do steps whose every request brings at most MAX_DECODE_QUERY
tokens (speculative verification, a draft catching up, short prompts), whose attention rows are
one-token decodes too (`stage_rows`); steps with a prefill group and batches past the largest bucket
run eagerly. `enforce_eager` (ModelConfig) turns graphs off. The logits and
sampling stay outside the graph (they read only the rows that sample).

Without CUDA, `mode="eager"` re-runs the forward over the same static buffers on every replay: the
tests exercise the staging, padding and bucketing on CPU, and the capture itself only on a GPU
(tests/engine/test_cuda_graphs.py, benchmarks/gpu_check.py).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tokenmill.engine.interfaces import ScheduledRequest
from tokenmill.engine.model_input import ModelInput, PlainDecodeArrays
from tokenmill.layers.attention import AttentionMetadata, GroupMetadata

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]  # ids, positions, meta → hidden
_FIELDS = 4  # input id, position, slot, seq_len; then the block table
WIDTH_STEP_TOKENS = 2048  # table-width buckets: this many tokens, x4, x16, ..., then the full width


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 128, every 32 beyond, and max_batch itself: a few
    dozen captures, and from 8 rows up padding adds at most one step of rows (a replayed step's time
    barely grows with its rows: 2.1 ms at 1 row, 2.7 ms at 128 for a 1.5B model on an H200)."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, 129, 16), *range(160, 1025, 32)]
    buckets = [b for b in sizes if b < max_batch]
    return [*buckets, max_batch]


def width_buckets(max_width: int, block_size: int, step_tokens: int = WIDTH_STEP_TOKENS) -> list[int]:
    step = max(1, step_tokens // block_size)
    widths = []
    w = step
    while w * 5 < max_width * 4:  # a bucket within 25% of the full width would save little
        widths.append(w)
        w *= 4
    return [*widths, max_width]


class DecodeGraphs:
    def __init__(self, forward: Forward, device: torch.device, max_batch: int, table_width: int, block_size: int,
                 pad_block: int, mode: str = "cuda", width_step_tokens: int = WIDTH_STEP_TOKENS) -> None:
        assert mode in ("cuda", "eager")
        self.forward = forward
        self.device = device
        self.block_size = block_size
        self.pad_block = pad_block
        self.mode = mode
        self.buckets = batch_buckets(max_batch)
        self.widths = width_buckets(table_width, block_size, width_step_tokens)
        rows = self.buckets[-1]
        self._rows = rows
        size = _FIELDS * rows + rows * table_width
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self._host_fields, self._host_table = self._split(self.host.numpy())
        self._dev_fields, self._dev_table = self._split(self.dev)
        self._pad(0, rows)
        self.dev.copy_(self.host)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        # Marks the last staging copy: the host buffer is not rewritten before it has left.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def table_width(self) -> int:
        return self.widths[-1]

    def _split(self, flat: Any) -> tuple[Any, Any]:
        """The [4, B] fields and the [B, W] table of a flat buffer (numpy or torch)."""
        rows = self._rows
        return flat[:_FIELDS * rows].reshape(_FIELDS, rows), flat[_FIELDS * rows:].reshape(rows, -1)

    def _pad(self, start: int, stop: int) -> None:
        """Host rows [start, stop) become padding: token 0 at position 0, written to the pad block's
        first slot, seq_len 1, a table of the pad block."""
        fields = self._host_fields
        fields[0, start:stop] = 0
        fields[1, start:stop] = 0
        fields[2, start:stop] = self.pad_block * self.block_size
        fields[3, start:stop] = 1
        self._host_table[start:stop] = self.pad_block

    def _views(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        f = self._dev_fields
        decode = GroupMetadata(block_table=self._dev_table[:batch, :width], seq_lens=f[3, :batch], mask=None,
                               sliding_mask=None, token_start=0, num_tokens=batch, max_query_len=1, pad_index=None)
        return f[0, :batch], f[1, :batch], AttentionMetadata(slot_mapping=f[2, :batch], decode=decode, prefill=None)

    def key_for(self, n: int, needed: int) -> tuple[int, int] | None:
        """The (batch, width) graph for `n` attention rows over `needed` table columns, or None (eager)."""
        if n > self.max_batch or needed > self.table_width:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, n)], self.widths[bisect.bisect_left(self.widths, needed)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch, width) pair, largest batch first so smaller graphs reuse its memory pool.
        Each forward runs eagerly twice first: that compiles the Triton kernels and settles cuBLAS."""
        started = time.monotonic()
        pool = None
        for batch in reversed(self.buckets):
            for width in self.widths:
                ids, positions, meta = self._views(batch, width)
                for _ in range(2):
                    self.forward(ids, positions, meta)
                if self.mode == "eager":
                    continue
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(ids, positions, meta)
                pool = graph.pool()
                self._graphs[(batch, width)] = graph
                self._outputs[(batch, width)] = out
        if self.mode == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("CUDA graphs: %d captured (batch %s x table width %s) in %.1f s", len(self._graphs),
                 self.buckets, self.widths, time.monotonic() - started)

    def stage(self, a: PlainDecodeArrays) -> ModelInput | None:
        """Write a plain decode step into the static buffers (padded to its bucket) and return a
        ModelInput over them, or None where no graph fits (the caller runs it eagerly)."""
        key = self.key_for(a.num_rows, a.table.shape[1])
        if key is None:
            return None
        self._write(key, a.input_ids, a.positions, a.slots, a.seq_lens, a.table)
        return self._staged_input(key, a.num_rows, *a.sampling(self.device))

    def rows_key(self, host: ModelInput) -> tuple[int, int] | None:
        """The graph `stage_rows` stages this host-built step into (decode rows only, in a captured
        bucket), or None."""
        meta, decode = host.meta, host.meta.decode
        if meta.prefill is not None or decode is None or decode.max_query_len != 1 or decode.has_mask:
            return None
        return self.key_for(host.input_ids.shape[0], decode.block_table.shape[1])

    def stage_rows(self, host: ModelInput) -> ModelInput | None:
        """A step built on the host (CPU tensors) whose tokens are all decode-group rows: speculative
        verification (1 + k rows per request), a draft model catching up, prompts of a few tokens.
        Each row is a one-token decode at its own position over its request's table, the same shape
        as a plain decode, so the same graphs serve it. None where it has a prefill group or no
        graph fits."""
        key = self.rows_key(host)
        if key is None:
            return None
        meta, decode = host.meta, host.meta.decode
        assert decode is not None
        n = host.input_ids.shape[0]
        self._write(key, host.input_ids.numpy(), host.positions.numpy(), meta.slot_mapping.numpy(),
                    decode.seq_lens.numpy(), decode.block_table.numpy())
        return self._staged_input(key, n, host.sample_indices.to(self.device), host.sampled,
                                  host.prompt_logprob_offsets, host.every_row_sampled)

    def _staged_input(self, key: tuple[int, int], n: int, sample_indices: torch.Tensor,
                      sampled: list[ScheduledRequest], prompt_offsets: list[tuple[ScheduledRequest, int]],
                      every_row: bool) -> ModelInput:
        """A ModelInput over the static buffers of graph `key`, its first `n` rows real."""
        ids, positions, meta = self._views(*key)
        return ModelInput(input_ids=ids[:n], positions=positions[:n], meta=meta, sample_indices=sample_indices,
                          sampled=sampled, prompt_logprob_offsets=prompt_offsets, every_row_sampled=every_row,
                          graph_key=key)

    def _write(self, key: tuple[int, int], input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
               seq_lens: np.ndarray, rows: np.ndarray) -> None:
        n = len(input_ids)
        batch, width = key
        if self._copied is not None:
            self._copied.synchronize()
        fields, table = self._host_fields, self._host_table
        fields[0, :n] = input_ids
        fields[1, :n] = positions
        fields[2, :n] = slots
        fields[3, :n] = seq_lens
        used = rows.shape[1]
        table[:n, :used] = rows
        table[:n, used:width] = self.pad_block  # never read (past seq_len); kept valid
        self._pad(n, batch)
        # Non-blocking from pinned memory; only the fields and the bucket's table rows travel.
        prefix = _FIELDS * self._rows + batch * table.shape[1]
        self.dev[:prefix].copy_(self.host[:prefix], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def replay(self, inp: ModelInput) -> torch.Tensor:
        """The final hidden states [n, hidden] of the staged step (a view of the graph's static output:
        valid until the next replay)."""
        assert inp.graph_key is not None
        n = inp.input_ids.shape[0]
        self.replays += 1
        if self.mode == "eager":
            ids, positions, meta = self._views(*inp.graph_key)
            return self.forward(ids, positions, meta)[:n]
        self._graphs[inp.graph_key].replay()
        return self._outputs[inp.graph_key][:n]
