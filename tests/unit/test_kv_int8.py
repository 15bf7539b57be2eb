"""The int8 KV cache: quantization, the native decode kernel reading it in place, the SDPA path
over gathered (dequantized) blocks, and the byte sizing that turns it into more blocks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.fixtures.attention import (
    DECODE_PATHS,
    assert_writes_same_bytes,
    decode_path,
    decode_threads,
    paged_attention_reference,
    prefill_metadata,
)
from tokenmill.config import CacheConfig
from tokenmill.errors import TokenmillError
from tokenmill.kernels import cpu_kernels
from tokenmill.layers.attention import GroupMetadata, PagedAttention
from tokenmill.layers.kv_cache import (
    DenseKVCache,
    Int8KVCache,
    KVCacheSpec,
    dequantize_int8,
    kv_cache_spec,
    quantize_int8,
)

kernels = cpu_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="the native CPU kernel cannot be built here")


@pytest.fixture(params=DECODE_PATHS)
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The decode kernel on each path this machine runs: the AVX-512 tiles and the AVX2 ones."""
    with decode_path(request.param):
        yield request.param


def _int8_cache(num_blocks: int, block_size: int, kvh: int, hd: int, g: torch.Generator) -> Int8KVCache:
    """A full int8 pool written through the cache's own write path, with per-row magnitudes spread
    over 3 decades so a scale read from the wrong (slot, head) cannot pass."""
    spec = kv_cache_spec("int8", torch.float32)
    cache = spec.allocate(num_blocks, block_size, kvh, hd, torch.device("cpu"))
    assert isinstance(cache, Int8KVCache)
    slots = torch.arange(num_blocks * block_size)
    magnitude = 10 ** torch.empty(len(slots), kvh, 1).uniform_(-1.5, 1.5, generator=g)
    k = torch.randn(len(slots), kvh, hd, generator=g) * magnitude
    v = torch.randn(len(slots), kvh, hd, generator=g) * magnitude.flip(0)
    cache.write(slots, k, v)
    return cache


def _dequantized(cache: Int8KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    return (dequantize_int8(cache.k, cache.k_scale, torch.float32),
            dequantize_int8(cache.v, cache.v_scale, torch.float32))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_write_stores_the_same_bytes_as_the_torch_path(dtype: torch.dtype) -> None:
    """The fused projection's strided k/v views, rows of zeros, ties (x/s = n + 0.5 exactly) and
    values beyond fp16's range: the native write and quantize_int8 + index_copy_ agree bit for bit."""
    g = torch.Generator().manual_seed(3)
    kvh, hd, T = 3, 64, 9
    spec = kv_cache_spec("int8", torch.float32)
    native = spec.allocate(8, 4, kvh, hd, torch.device("cpu"))
    reference = spec.allocate(8, 4, kvh, hd, torch.device("cpu"))
    assert isinstance(native, Int8KVCache) and isinstance(reference, Int8KVCache) and native.writer is not None
    reference.writer = None
    fused = torch.randn(T, 5 * kvh * hd, generator=g) * 10 ** torch.empty(T, 1).uniform_(-3, 3, generator=g)
    fused[2, :] = 0.0
    fused[4, : kvh * hd] = torch.tensor([127.0, 63.5, -0.5, 1.5] * (kvh * hd // 4))  # ties at scale 1
    fused[5, kvh * hd: 2 * kvh * hd] *= 1e7  # amax / 127 beyond fp16: the scale saturates at 65504
    fused = fused.to(dtype)
    k = fused[:, : kvh * hd].view(T, kvh, hd)  # strided views, as qkv's split hands them over
    v = fused[:, kvh * hd: 2 * kvh * hd].view(T, kvh, hd)
    slots = torch.randperm(32, generator=g)[:T]
    assert_writes_same_bytes(native, reference, slots, k, v)


@needs_kernel
def test_native_write_rejects_a_slot_out_of_range() -> None:
    cache = kv_cache_spec("int8", torch.float32).allocate(2, 4, 1, 8, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="slot out of range"):
        cache.write(torch.tensor([8]), torch.ones(1, 1, 8), torch.ones(1, 1, 8))


# -- quantization -------------------------------------------------------------------------------

def test_quantize_is_symmetric_per_row_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * 10 ** torch.empty(50, 3, 1).uniform_(-3, 3, generator=g)
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (50, 3)
    amax = x.abs().amax(-1)
    # fp16 rounding only: half an ulp relative, or half the subnormal step (2^-25) for rows under 0.008.
    torch.testing.assert_close(scale.float(), amax / 127, rtol=2**-11, atol=2**-25)
    assert int(q.abs().amax()) == 127  # every row uses the full range
    err = (dequantize_int8(q, scale, torch.float32) - x).abs()
    # Half a step, plus the clip of the largest element when the fp16 scale rounded down.
    assert bool((err <= scale.float().unsqueeze(-1) * 0.5 + amax.unsqueeze(-1) * 1e-3).all())


def test_zero_rows_quantize_to_zero() -> None:
    q, scale = quantize_int8(torch.zeros(4, 2, 8))
    assert not q.any() and not scale.any()
    assert not dequantize_int8(q, scale, torch.float32).isnan().any()


# -- the native decode kernel over an int8 cache ------------------------------------------------

@needs_kernel
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 32), (6, 6, 20), (16, 2, 8),
                                                                 (8, 4, 32), (4, 4, 64), (14, 2, 64)])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (0, 30.0)])
@pytest.mark.parametrize("num_seqs", [1, 3, 12])
def test_int8_kernel_matches_attention_on_dequantized_values(num_heads: int, num_kv_heads: int, head_dim: int,
                                                             window: int, softcap: float, num_seqs: int,
                                                             path: str) -> None:
    g = torch.Generator().manual_seed(num_heads * 100 + num_seqs)
    block_size, num_blocks, width = 4, 80, 6
    cache = _int8_cache(num_blocks, block_size, num_kv_heads, head_dim, g)
    table = torch.randperm(num_blocks, generator=g)[:num_seqs * width].view(num_seqs, width)  # shuffled blocks
    lens = torch.randint(1, width * block_size + 1, (num_seqs,), generator=g)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    assert kernels is not None
    out = kernels.paged_decode_attention_int8(q, cache.k, cache.v, cache.k_scale, cache.v_scale, table, lens,
                                              scale, window, softcap)
    ref = paged_attention_reference(q, *_dequantized(cache), table, lens, scale, window, softcap,
                                    dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[500], [3, 90, 257]])
def test_int8_kernel_long_sequences_split_into_chunks(threads: int, lens: list[int], path: str) -> None:
    """Few long sequences: chunks of keys across threads, partial softmaxes merged (scales per chunk)."""
    g = torch.Generator().manual_seed(7 + threads)
    block_size = 16
    width = -(-max(lens) // block_size)
    num_blocks = width * len(lens) + 2
    cache = _int8_cache(num_blocks, block_size, 3, 64, g)
    table = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    seq_lens = torch.tensor(lens)
    q = torch.randn(len(lens), 9, 64, generator=g)
    with decode_threads(threads):
        assert kernels is not None
        out = kernels.paged_decode_attention_int8(q, cache.k, cache.v, cache.k_scale, cache.v_scale, table,
                                                  seq_lens, 0.125, 0, 0.0)
    ref = paged_attention_reference(q, *_dequantized(cache), table, seq_lens, 0.125, 0, 0.0, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@needs_kernel
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_int8_kernel_under_half_precision_queries(q_dtype: torch.dtype, path: str) -> None:
    g = torch.Generator().manual_seed(1)
    cache = _int8_cache(16, 4, 2, 16, g)
    table = torch.arange(16).view(2, 8)
    lens = torch.tensor([30, 7])
    q = torch.randn(2, 4, 16, generator=g).to(q_dtype)
    assert kernels is not None
    out = kernels.paged_decode_attention_int8(q, cache.k, cache.v, cache.k_scale, cache.v_scale, table, lens,
                                              0.25, 0, 0.0)
    assert out.dtype == q_dtype
    ref = paged_attention_reference(q, *_dequantized(cache), table, lens, 0.25, 0, 0.0, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_dense_half_caches_under_fp32_queries(cache_dtype: torch.dtype, path: str) -> None:
    """--kv-cache-dtype bf16 on an fp32 model: the query stays fp32, the cache is read as stored."""
    g = torch.Generator().manual_seed(2)
    k = torch.randn(20, 4, 3, 64, generator=g).to(cache_dtype)
    v = torch.randn(20, 4, 3, 64, generator=g).to(cache_dtype)
    table = torch.randperm(20, generator=g)[:18].view(3, 6)
    lens = torch.tensor([24, 9, 1])
    q = torch.randn(3, 9, 64, generator=g)
    assert kernels is not None
    out = kernels.paged_decode_attention(q, k, v, table, lens, 0.125, 0, 0.0)
    assert out.dtype == torch.float32
    ref = paged_attention_reference(q, k, v, table, lens, 0.125, 0, 0.0, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_int8_kernel_checks_its_scales() -> None:
    assert kernels is not None
    k = torch.zeros(4, 4, 2, 8, dtype=torch.int8)
    scales = torch.zeros(4, 4, 2, dtype=torch.float16)
    q, table, lens = torch.zeros(1, 4, 8), torch.zeros(1, 1, dtype=torch.int64), torch.tensor([2])
    with pytest.raises(RuntimeError, match="fp16 scales"):
        kernels.paged_decode_attention_int8(q, k, k, scales.float(), scales.float(), table, lens, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="scales \\[num_blocks"):
        kernels.paged_decode_attention_int8(q, k, k, scales[:2], scales[:2], table, lens, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="int8 caches"):
        kernels.paged_decode_attention_int8(q, k.float(), k.float(), scales, scales, table, lens, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_decode_attention_int8(q, k, k, scales, scales, table + 4, lens, 1.0, 0, 0.0)


# -- PagedAttention: write, then the SDPA path (gather + dequantize) and the native path -------------



@pytest.mark.parametrize("softcap", [None, 20.0])
def test_sdpa_path_reads_int8_blocks_dequantized(softcap: float | None) -> None:
    """Prefill (the SDPA path) over an int8 cache equals the same attention over a dense cache that
    holds the dequantized values, and stays close to attention over the unquantized ones."""
    g = torch.Generator().manual_seed(3)
    h, kvh, hd, bs = 8, 2, 32, 4
    tables = torch.randperm(12, generator=g)[:9].view(3, 3)
    meta, t = prefill_metadata([11, 5, 8], bs, tables)
    q, k, v = torch.randn(t, h, hd, generator=g), torch.randn(t, kvh, hd, generator=g), torch.randn(t, kvh, hd,
                                                                                                   generator=g)
    attn = PagedAttention(h, kvh, hd, hd**-0.5, softcap)
    int8 = kv_cache_spec("int8", torch.float32).allocate(12, bs, kvh, hd, torch.device("cpu"))
    out = attn(q, k, v, int8, meta, False)  # writes (quantizes) the step's keys, then reads them back
    assert isinstance(int8, Int8KVCache) and meta.prefill is not None
    dense = DenseKVCache(*_dequantized(int8))  # holds exactly the values the int8 cache stands for
    torch.testing.assert_close(out, attn._group(q, dense, meta.prefill, False).reshape(t, -1))
    exact = kv_cache_spec("fp32", torch.float32).allocate(12, bs, kvh, hd, torch.device("cpu"))
    full = attn(q, k, v, exact, meta, False)
    assert 0 < float((out - full).abs().max()) < 0.03  # int8 rounding of unit-variance keys and values


@needs_kernel
def test_native_and_sdpa_decode_agree_on_an_int8_cache() -> None:
    g = torch.Generator().manual_seed(4)
    h, kvh, hd, bs, num_seqs = 9, 3, 64, 16, 5
    cache = _int8_cache(40, bs, kvh, hd, g)
    tables = torch.randperm(40, generator=g)[:num_seqs * 4].view(num_seqs, 4)
    lens = torch.tensor([64, 1, 17, 33, 50])
    mask = (torch.arange(4 * bs)[None, :] < lens[:, None]).view(num_seqs, 1, 1, 4 * bs)
    group = GroupMetadata(tables, lens, mask, None, 0, num_seqs, 1, None)
    q = torch.randn(num_seqs, h, hd, generator=g)
    sdpa = PagedAttention(h, kvh, hd, hd**-0.5, None)
    native = PagedAttention(h, kvh, hd, hd**-0.5, None, decode_kernel=kernels)
    torch.testing.assert_close(native._group(q, cache, group, False), sdpa._group(q, cache, group, False),
                               rtol=1e-4, atol=1e-4)


# -- sizing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_holds_1_9x_bf16_and_3_8x_fp32_tokens(head_dim: int) -> None:
    int8 = kv_cache_spec("int8", torch.float32).bytes_per_token(3, head_dim)
    assert int8 == 2 * 3 * (head_dim + 2)  # int8 elements plus one fp16 scale per kv head
    assert kv_cache_spec("bf16", torch.float32).bytes_per_token(3, head_dim) / int8 >= 1.9
    assert kv_cache_spec("fp32", torch.float32).bytes_per_token(3, head_dim) / int8 >= 3.8


def test_auto_is_the_model_dtype_and_names_are_checked() -> None:
    assert kv_cache_spec("auto", torch.bfloat16) == KVCacheSpec("bf16", torch.bfloat16)
    assert kv_cache_spec("auto", torch.float32).dtype == torch.float32
    with pytest.raises(TokenmillError, match="kv cache dtype 'int4' is not supported"):
        CacheConfig(kv_cache_dtype="int4")


def test_allocation_counts_the_scales() -> None:
    spec = kv_cache_spec("int8", torch.float32)
    cache = spec.allocate(10, 16, 3, 64, torch.device("cpu"))
    assert cache.nbytes == 10 * 16 * spec.bytes_per_token(3, 64)
    assert all(not t.any() for t in cache.tensors())  # zeroed: masked keys meet 0 * V


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"], ["batch", "in.jsonl", "-o", "out.jsonl"]])
def test_every_engine_command_takes_the_flag(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.cli.batch import _engine_kwargs
    from tokenmill.cli.main import build_parser

    args = build_parser().parse_args([*command, "--kv-cache-dtype", "int8"])
    assert args.kv_cache_dtype == "int8"
    if command[0] == "batch":
        assert _engine_kwargs(args)["kv_cache_dtype"] == "int8"
    assert build_parser().parse_args(command).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


@needs_kernel
@pytest.mark.parametrize("window", [0, 30])
def test_int8_prefill_kernel_matches_attention_on_dequantized_values(window: int) -> None:
    """The native prefill kernel (AVX-512 builds) over an int8 cache: each key's scale in its transposed
    copy, each value's in the softmax weight after the row sum; queries at positions 60-139 and 0-40."""
    assert kernels is not None
    if not kernels.wide_attention_built():
        pytest.skip("the native prefill attention needs an AVX-512 build of the CPU kernels")
    g = torch.Generator().manual_seed(9 + window)
    cache = _int8_cache(24, 16, 2, 64, g)
    table = torch.randperm(24, generator=g)[:20].view(2, 10)
    lens, qlens = [140, 41], [80, 41]
    q = torch.randn(sum(qlens), 14, 64, generator=g)
    out = kernels.paged_prefill_attention(q, cache.k, cache.v, table, torch.tensor(lens), torch.tensor(qlens), 0.125,
                                          window, cache.k_scale, cache.v_scale)
    rows = [0] * qlens[0] + [1] * qlens[1]
    row_lens = torch.tensor([*range(61, 141), *range(1, 42)])
    ref = paged_attention_reference(q, *_dequantized(cache), table[rows], row_lens, 0.125, window, 0.0,
                                    dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
