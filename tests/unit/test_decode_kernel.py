"""The native CPU decode-attention kernel against plain attention math over the same paged cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.fixtures.attention import DECODE_PATHS, decode_path, decode_threads, paged_attention_reference
from tokenmill.kernels import cpu_kernels

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the native CPU kernel cannot be built here")


@pytest.fixture(autouse=True, params=DECODE_PATHS)
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test on each path this machine runs: the AVX-512 tiles and the AVX2 ones."""
    with decode_path(request.param):
        yield request.param


# AVX2: head groups (num_heads / num_kv_heads) of 1, 2 and 3 take the four-key score tiles, larger ones one key
# at a time. AVX-512 (head_dim % 16 == 0): four-key tiles of up to 7 heads (8 → 4 + 4), 64-dimension value slices
# (128 → two, 80 → 64 + 16); other head sizes take the AVX2 path.
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 32), (6, 6, 20), (16, 2, 8),
                                                                 (12, 2, 64), (14, 2, 16), (8, 4, 32), (4, 4, 64),
                                                                 (14, 2, 64), (16, 2, 128), (9, 1, 80)])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (0, 30.0)])
@pytest.mark.parametrize("num_seqs", [1, 3, 12])
def test_matches_reference_fp32(num_heads: int, num_kv_heads: int, head_dim: int, window: int, softcap: float,
                                num_seqs: int) -> None:
    g = torch.Generator().manual_seed(num_heads * 100 + num_seqs)
    block_size, num_blocks, width = 4, 80, 6
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    # Distinct shuffled blocks per sequence, as the block pool hands them out.
    table = torch.randperm(num_blocks, generator=g)[:num_seqs * width].view(num_seqs, width)
    lens = torch.randint(1, width * block_size + 1, (num_seqs,), generator=g)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    assert kernels is not None
    out = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, scale, window, softcap)
    torch.testing.assert_close(out, paged_attention_reference(q, k_cache, v_cache, table, lens, scale, window, softcap),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches_accumulate_in_fp32(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(16, 4, 2, 16, generator=g).to(dtype)
    v_cache = torch.randn(16, 4, 2, 16, generator=g).to(dtype)
    table = torch.arange(16).view(2, 8)
    lens = torch.tensor([30, 7])
    q = torch.randn(2, 4, 16, generator=g).to(dtype)
    assert kernels is not None
    out = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.25, 0, 0.0)
    assert out.dtype == dtype
    ref = paged_attention_reference(q, k_cache, v_cache, table, lens, 0.25, 0, 0.0)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (70, 0.0), (0, 30.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[700], [1, 33, 250], [64, 64], [5, 400, 31, 129], [300] * 9, [1, 700, *[50] * 8]])
def test_long_sequences_split_into_chunks_merge_exactly(threads: int, window: int, softcap: float, dtype: torch.dtype,
                                                         lens: list[int]) -> None:
    """Few sequences (split across threads, chunks of at least 64 keys) or long ones (chunks that fit
    L2, ~170 keys here): the kernel merges the chunks' partial softmaxes; every chunk boundary, a
    window that starts inside a chunk, and sequences too short to split must all give plain
    attention's answer."""
    g = torch.Generator().manual_seed(len(lens) * 1000 + threads)
    block_size, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    width = -(-max(lens) // block_size)
    num_blocks = width * len(lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    with decode_threads(threads):
        assert kernels is not None
        out = kernels.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, 0.125, window, softcap)
    ref = paged_attention_reference(q, k_cache.float(), v_cache.float(), table, seq_lens, 0.125, window, softcap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bit_identical_whatever_else_is_in_the_step(threads: int, dtype: torch.dtype) -> None:
    """Speculative verification scores 1 + k rows of a request where a plain decode scores one, and
    greedy output must not change with it: each row's chunks depend on its own length only, and an
    unsplit row never takes the merge because another row split."""
    g = torch.Generator().manual_seed(7)
    block_size, num_heads, num_kv_heads, head_dim, width = 16, 9, 3, 64, 40
    k_cache = torch.randn(width * 3, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(width * 3, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(width * 3, generator=g)[:width * 3].view(3, width)
    lens = [[117], [117, 118, 119, 120], [117, 600, 20], [117, 20], [117] * 12]
    q = torch.randn(1, num_heads, head_dim, generator=g)
    with decode_threads(threads):
        assert kernels is not None
        outs = []
        for step in lens:
            rows = len(step)
            qs = torch.cat([q, torch.randn(rows - 1, num_heads, head_dim, generator=g)]) if rows > 1 else q
            order = [0, *range(1, rows)]
            tables = table[[0 if i == 0 else i % 3 for i in order]]
            out = kernels.paged_decode_attention(qs, k_cache, v_cache, tables, torch.tensor(step), 0.125, 0, 0.0)
            outs.append(out[0])
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_a_split_row_gives_every_thread_an_equal_share(threads: int) -> None:
    """parallel_for hands each thread a contiguous run of ceil(items / threads) chunks: a split row's
    chunks come in a multiple of the threads and of equal length, so a batch-1 row's keys divide
    evenly (64, 64, 22 gave one thread of two 128 keys and the other 22)."""
    assert kernels is not None
    key_bytes = 2 * 3 * 64 * 4  # SmolLM2: keys and values of 3 kv heads x 64 fp32 dims
    assert kernels.decode_chunks(150, 2, key_bytes) == [38, 38, 38, 36]
    assert kernels.decode_chunks(100, 2, key_bytes) == [50, 50]
    assert kernels.decode_chunks(64, 2, key_bytes) == [64]  # too short to split
    max_chunk = (256 << 10) // key_bytes
    for keys in range(1, 2500):
        lens = kernels.decode_chunks(keys, threads, key_bytes)
        assert sum(lens) == keys and max(lens) <= max(64, max_chunk)
        if len(lens) == 1:
            continue
        assert min(lens[:-1]) >= 32 and max(lens) - min(lens) < len(lens)
        run = -(-len(lens) // threads)
        shares = [sum(lens[i:i + run]) for i in range(0, len(lens), run)]
        if keys >= 32 * threads:  # room for every thread
            assert len(shares) == threads and max(shares) - min(shares) < 2 * len(lens), (keys, lens)


def test_a_strided_query_and_a_given_output_match_the_copying_call() -> None:
    """The decoder stack passes q as a view of its fused q/k/v rows (a stride between sequences) and
    its own output buffer."""
    assert kernels is not None
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(30, 16, 3, 64, generator=g)
    v_cache = torch.randn(30, 16, 3, 64, generator=g)
    table = torch.randperm(30, generator=g).view(3, 10)
    lens = torch.tensor([17, 64, 150])
    qkv = torch.randn(3, 9 + 2 * 3, 64, generator=g)
    q = qkv.narrow(1, 0, 9)
    assert not q.is_contiguous()
    expected = kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, table, lens, 0.125, 0, 0.0)
    assert torch.equal(kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125, 0, 0.0), expected)


def test_bad_arguments_raise_instead_of_reading_out_of_bounds() -> None:
    assert kernels is not None
    cache = torch.zeros(4, 4, 2, 8)
    with pytest.raises(RuntimeError, match="int64 indices"):
        kernels.paged_decode_attention(torch.zeros(1, 4, 8), cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                       torch.ones(1, dtype=torch.int64), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="head layout"):
        kernels.paged_decode_attention(torch.zeros(1, 3, 8), cache, cache, torch.zeros(1, 1, dtype=torch.int64),
                                       torch.ones(1, dtype=torch.int64), 1.0, 0, 0.0)
    table = torch.zeros(1, 1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="outside its block table"):
        kernels.paged_decode_attention(torch.zeros(1, 4, 8), cache, cache, table, torch.tensor([5]), 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_decode_attention(torch.zeros(1, 4, 8), cache, cache, table + 4, torch.tensor([2]), 1.0, 0, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bit_identical_at_any_thread_count_under_a_pinned_split(dtype: torch.dtype) -> None:
    """The engine's CPU governor moves the thread count while requests decode (engine/cpu_share.py); with
    the split pinned at its most threads, a row's keys are cut and merged alike at 1 thread and at 2."""
    assert kernels is not None
    g = torch.Generator().manual_seed(11)
    block_size, num_heads, num_kv_heads, head_dim, width = 16, 9, 3, 64, 40
    k_cache = torch.randn(width, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(width, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(width, generator=g).view(1, width)
    q = torch.randn(1, num_heads, head_dim, generator=g)
    before, pinned = torch.get_num_threads(), kernels.set_decode_split_threads(2)
    outs = []
    try:
        assert kernels.decode_split_threads() == 2
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            for keys in (300, 601):  # 4 chunks at 1 thread unpinned, 6 at 2; split either way
                outs.append(kernels.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([keys]),
                                                           0.125, 0, 0.0))
    finally:
        torch.set_num_threads(before)
        kernels.set_decode_split_threads(pinned)
    for i in range(2, len(outs)):
        assert torch.equal(outs[i], outs[i % 2])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(14, 2, 64), (9, 3, 64), (16, 2, 128)])
@pytest.mark.parametrize("first", [5, 117, 700])
def test_verification_rows_match_each_row_alone(threads: int, num_heads: int, num_kv_heads: int, head_dim: int,
                                                first: int) -> None:
    """A verification's rows read the same blocks (lengths first .. first + 7) and run chunk by chunk in
    turn (item_order); each row's output must be the bits of that row scored on its own, as a plain
    decode of it would be, and close to plain attention."""
    assert kernels is not None
    g = torch.Generator().manual_seed(first + num_heads)
    block_size, rows = 16, 8
    width = -(-(first + rows) // block_size)
    k_cache = torch.randn(width + 2, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(width + 2, block_size, num_kv_heads, head_dim, generator=g)
    table = torch.randperm(width + 2, generator=g)[:width].view(1, width).expand(rows, width).contiguous()
    lens = torch.arange(first, first + rows)
    q = torch.randn(rows, num_heads, head_dim, generator=g)
    with decode_threads(threads):
        together = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, 0.125, 0, 0.0)
        for r in range(rows):
            alone = kernels.paged_decode_attention(q[r:r + 1], k_cache, v_cache, table[r:r + 1], lens[r:r + 1],
                                                   0.125, 0, 0.0)
            assert torch.equal(together[r:r + 1], alone), r
    ref = paged_attention_reference(q, k_cache, v_cache, table, lens, 0.125, 0, 0.0)
    torch.testing.assert_close(together, ref, rtol=1e-5, atol=1e-5)
