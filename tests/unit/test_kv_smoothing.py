"""Smoothing for the int8 KV cache (layers/kv_smoothing.py): keys stored as (k − μ)·σ⁻¹ with queries
multiplied by σ, values as (v − ν)·τ⁻¹ with outputs mapped back as o·τ + ν. The native and torch
writers store the same bytes; every reader (the native decode kernel, the SDPA path over gathered
blocks) gives the attention of the unsmoothed keys and values up to int8 rounding, and far closer
than plain int8 on rows with large per-channel biases; without the query scale, or without the
output's, it is wrong."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.attention import assert_writes_same_bytes, paged_attention_reference, prefill_metadata
from tokenmill.kernels import cpu_kernels
from tokenmill.layers.attention import AttentionMetadata, GroupMetadata, PagedAttention
from tokenmill.layers.kv_cache import Int8KVCache, LayerKVCache, dequantize_int8, kv_cache_spec
from tokenmill.layers.kv_smoothing import ChannelMoments, KVSmoothing, fit_smoothing

kernels = cpu_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="the native CPU kernel cannot be built here")
CPU = torch.device("cpu")


def _biased_keys(n: int, kvh: int, hd: int, g: torch.Generator) -> torch.Tensor:
    """Keys [n, KVH, hd] shaped like Qwen2.5's first layers: channel spreads over two decades and a
    few channels with a large, nearly constant bias, which sets a plain int8 row's scale. The
    distribution is fixed per (KVH, hd), so calibration keys and the keys a test writes share it."""
    spread = 10 ** torch.empty(kvh, hd).uniform_(-1, 1, generator=torch.Generator().manual_seed(kvh * 1000 + hd))
    bias = torch.zeros(kvh, hd)
    bias[:, :3] = torch.tensor([120.0, -80.0, 60.0])
    return bias + spread * torch.randn(n, kvh, hd, generator=g)


def _biased_values(n: int, kvh: int, hd: int, g: torch.Generator) -> torch.Tensor:
    """Values with a few biased channels too (another fixed distribution than the keys')."""
    return 0.3 * _biased_keys(n, kvh, hd + 1, g)[..., 1:]


def _smoothing(kvh: int, hd: int, num_heads: int, g: torch.Generator, values: bool = True) -> KVSmoothing:
    """A fit on calibration keys and values of the same distributions (not the rows the tests write)."""
    return KVSmoothing(fit_smoothing(_biased_keys(512, kvh, hd, g), num_heads),
                       fit_smoothing(_biased_values(512, kvh, hd, g), num_heads) if values else None)


def _int8(num_blocks: int, bs: int, kvh: int, hd: int, smoothing: KVSmoothing | None,
          native: bool = True) -> Int8KVCache:
    cache = kv_cache_spec("int8", torch.float32).allocate(num_blocks, bs, kvh, hd, CPU)
    assert isinstance(cache, Int8KVCache)
    cache.smoothing = smoothing
    if not native:
        cache.writer = None
    return cache


# -- the fit ------------------------------------------------------------------------------------

def test_fit_centres_each_channel_and_scales_it_by_a_power_of_two_near_its_spread() -> None:
    g = torch.Generator().manual_seed(0)
    keys = _biased_keys(4096, 2, 16, g)
    keys[:, 1, 5] = 3.0  # a dead channel: constant
    sm = fit_smoothing(keys, num_heads=6)
    torch.testing.assert_close(sm.shift, keys.double().mean(0).float())
    std = keys.double().std(0, unbiased=False).float()
    log2 = torch.log2(sm.sigma)
    assert torch.equal(log2, log2.round())  # powers of two: σ · σ⁻¹ == 1 exactly
    assert torch.equal(sm.sigma * sm.inv_sigma, torch.ones_like(sm.sigma))
    live = std > 0.01 * std.amax(-1, keepdim=True)
    assert bool(((sm.sigma[live] / std[live]).log2().abs() <= 0.5 + 1e-6).all())
    # The dead channel is scaled like one 1% as wide as its head's widest, not by 1/1e-6.
    assert float(sm.sigma[1, 5]) >= 0.01 * float(std[1].amax()) / 2**0.5
    # Query heads 0-2 share kv head 0, 3-5 kv head 1 (SDPA's enable_gqa and the native kernel's grouping).
    assert sm.head_sigma.shape == (6, 16)
    assert torch.equal(sm.head_sigma[:3], sm.sigma[0].expand(3, 16))
    assert torch.equal(sm.head_sigma[3:], sm.sigma[1].expand(3, 16))
    assert torch.equal(sm.head_shift[3:], sm.shift[1].expand(3, 16))


def test_moments_accumulate_over_batches() -> None:
    g = torch.Generator().manual_seed(1)
    keys = _biased_keys(300, 2, 8, g)
    moments = ChannelMoments()
    for part in keys.split(70):
        moments.add(part)
    whole = fit_smoothing(keys, 2)
    parts = moments.fit(2)
    torch.testing.assert_close(parts.shift, whole.shift)
    assert torch.equal(parts.sigma, whole.sigma)
    with pytest.raises(ValueError, match="do not group"):
        fit_smoothing(keys, 3)


def test_normalize_and_restore_are_inverse() -> None:
    g = torch.Generator().manual_seed(2)
    sm = _smoothing(2, 8, 4, g).keys
    k = _biased_keys(10, 2, 8, g)
    torch.testing.assert_close(sm.restore(sm.normalize(k)), k, rtol=1e-6, atol=1e-4)
    q = torch.randn(10, 4, 8, generator=g)
    # bf16 queries scale exactly too (σ is a power of two).
    assert torch.equal(sm.scale_queries(q.bfloat16()).float(), sm.scale_queries(q.bfloat16().float()))


# -- the writers --------------------------------------------------------------------------------

@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("values", [True, False])
def test_native_and_torch_writers_store_the_same_bytes_with_smoothing(dtype: torch.dtype, values: bool) -> None:
    """Strided views of a fused projection, a zero row, keys far beyond the calibration's range:
    the native write and normalize + quantize_int8 + index_copy_ agree bit for bit."""
    g = torch.Generator().manual_seed(3)
    kvh, hd, T, heads = 3, 64, 11, 9
    kv = _smoothing(kvh, hd, heads, g, values)
    sm = kv.keys
    native, reference = _int8(8, 4, kvh, hd, kv), _int8(8, 4, kvh, hd, kv, native=False)
    assert native.writer is not None
    fused = torch.randn(T, (heads + 2 * kvh) * hd, generator=g)
    fused[:, heads * hd: (heads + kvh) * hd] = _biased_keys(T, kvh, hd, g).reshape(T, -1)
    fused[:, (heads + kvh) * hd:] = _biased_values(T, kvh, hd, g).reshape(T, -1)
    fused[2, :] = 0.0  # keys 0 - μ: not a zero row once smoothed
    fused[7, heads * hd: (heads + kvh) * hd] *= 1e5  # beyond fp16 once smoothed: the scale saturates
    fused = fused.to(dtype)
    k = fused[:, heads * hd: (heads + kvh) * hd].view(T, kvh, hd)
    v = fused[:, (heads + kvh) * hd:].view(T, kvh, hd)
    slots = torch.randperm(32, generator=g)[:T]
    assert_writes_same_bytes(native, reference, slots, k, v)
    # The keys hold (k − μ)·σ⁻¹, each within half a step of its row's scale (but the saturated row).
    rows = slots[torch.arange(T) != 7]
    stored = dequantize_int8(native.k, native.k_scale, torch.float32).view(-1, kvh, hd)[rows]
    step = native.k_scale.float().view(-1, kvh)[rows].unsqueeze(-1)
    expected = sm.normalize(k[torch.arange(T) != 7])
    assert bool(((stored - expected).abs() <= step * 0.5 + 1e-3 * step).all())
    assert float(native.k_scale.view(-1, kvh)[slots[7]].float().amax()) == 65504.0
    stored_v = dequantize_int8(native.v, native.v_scale, torch.float32).view(-1, kvh, hd)[slots]
    expected_v = kv.values.normalize(v) if kv.values is not None else v.float()
    step_v = native.v_scale.float().view(-1, kvh)[slots].unsqueeze(-1)
    assert bool(((stored_v - expected_v).abs() <= step_v * 0.5 + 1e-3 * step_v).all())


@needs_kernel
def test_native_writer_checks_the_smoothing() -> None:
    cache = _int8(2, 4, 2, 8, None)
    assert kernels is not None
    k = torch.ones(1, 2, 8)
    slots = torch.tensor([0])
    with pytest.raises(RuntimeError, match="go together"):
        kernels.kv_write_int8(cache.k, cache.v, cache.k_scale, cache.v_scale, slots, k, k, torch.zeros(2, 8), None)
    with pytest.raises(RuntimeError, match="go together"):
        kernels.kv_write_int8(cache.k, cache.v, cache.k_scale, cache.v_scale, slots, k, k, None, None, None,
                              torch.ones(2, 8))
    with pytest.raises(RuntimeError, match="contiguous float32 \\[KVH, hd\\]"):
        kernels.kv_write_int8(cache.k, cache.v, cache.k_scale, cache.v_scale, slots, k, k, torch.zeros(2, 4),
                              torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="contiguous float32 \\[KVH, hd\\]"):
        kernels.kv_write_int8(cache.k, cache.v, cache.k_scale, cache.v_scale, slots, k, k, None, None,
                              torch.zeros(2, 8).double(), torch.ones(2, 8).double())


# -- the readers --------------------------------------------------------------------------------



def _decode_meta(lens: torch.Tensor, bs: int, tables: torch.Tensor) -> AttentionMetadata:
    """One decode token per sequence at position len - 1 (its key written by the step itself)."""
    pos = lens - 1
    slots = tables[torch.arange(len(lens)), pos // bs] * bs + pos % bs
    mask = (torch.arange(tables.shape[1] * bs)[None, :] < lens[:, None]).view(len(lens), 1, 1, -1)
    return AttentionMetadata(slots, GroupMetadata(tables, lens, mask, None, 0, len(lens), 1, None), None)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


H, KVH, HD, BS = 8, 2, 32, 4


@pytest.fixture
def prefill() -> dict[str, torch.Tensor | AttentionMetadata | KVSmoothing]:
    g = torch.Generator().manual_seed(5)
    tables = torch.randperm(24, generator=g)[:18].view(3, 6)
    meta, t = prefill_metadata([21, 9, 16], BS, tables)
    # Queries with large channels where the keys have their biases (as Qwen's do), so q · μ is large.
    q = torch.randn(t, H, HD, generator=g)
    q[..., :3] *= 4
    return {"meta": meta, "q": q, "k": _biased_keys(t, KVH, HD, g), "v": _biased_values(t, KVH, HD, g),
            "smoothing": _smoothing(KVH, HD, H, g)}


def _attend(cache: LayerKVCache, data: dict, softcap: float | None = None,
            kernel: object | None = None) -> torch.Tensor:
    attn = PagedAttention(H, KVH, HD, HD**-0.5, softcap, decode_kernel=kernel)  # type: ignore[arg-type]
    return attn(data["q"], data["k"], data["v"], cache, data["meta"], False)


@pytest.mark.parametrize("native_writer", [True, False])
def test_sdpa_prefill_over_smoothed_keys_is_the_unsmoothed_attention(prefill: dict, native_writer: bool) -> None:
    """Prefill (the SDPA path: gather, dequantize, scaled queries, outputs mapped back) over the
    smoothed int8 cache is close to float32 attention over the raw keys and values, and much closer
    than plain int8 on these rows; keys smoothed alone sit between."""
    if native_writer and kernels is None:
        pytest.skip("the native CPU kernel cannot be built here")
    exact = _attend(kv_cache_spec("fp32", torch.float32).allocate(24, BS, KVH, HD, CPU), prefill)
    smoothed = _attend(_int8(24, BS, KVH, HD, prefill["smoothing"], native_writer), prefill)
    keys_only = _attend(_int8(24, BS, KVH, HD, KVSmoothing(prefill["smoothing"].keys), native_writer), prefill)
    plain = _attend(_int8(24, BS, KVH, HD, None, native_writer), prefill)
    errors = [_relative_error(out, exact) for out in (smoothed, keys_only, plain)]
    assert errors[0] < 0.02, errors
    assert errors[0] < errors[1] < errors[2] and errors[2] > 5 * errors[0], errors


@pytest.mark.parametrize("hook", ["queries", "outputs"])
def test_without_the_query_or_output_scale_the_attention_is_wrong(prefill: dict, monkeypatch: pytest.MonkeyPatch,
                                                                  hook: str) -> None:
    """What the tolerance above must reject: the same cache read with unscaled queries (q · (k − μ)/σ),
    or its output left as the attention over (v − ν)/τ."""
    monkeypatch.setattr(Int8KVCache, hook, lambda self, x: x)
    exact = _attend(kv_cache_spec("fp32", torch.float32).allocate(24, BS, KVH, HD, CPU), prefill)
    broken = _attend(_int8(24, BS, KVH, HD, prefill["smoothing"], native=False), prefill)
    assert _relative_error(broken, exact) > 0.2


@needs_kernel
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 32), (9, 3, 64), (4, 4, 16)])
def test_native_decode_and_sdpa_decode_agree_on_smoothed_keys(num_heads: int, num_kv_heads: int,
                                                               head_dim: int) -> None:
    """Decode through PagedAttention: the native kernel (int8 rows in place, scaled queries, outputs
    mapped back) and the SDPA path (dequantized gather, the same around it) agree, and both give
    float32 attention over the raw keys and values up to int8 rounding."""
    g = torch.Generator().manual_seed(num_heads)
    bs, num_seqs, width, num_blocks = 16, 5, 4, 24
    sm = _smoothing(num_kv_heads, head_dim, num_heads, g)
    tables = torch.randperm(num_blocks, generator=g)[:num_seqs * width].view(num_seqs, width)
    lens = torch.tensor([64, 1, 17, 33, 50])
    slots = torch.arange(num_blocks * bs)
    k, v = _biased_keys(len(slots), num_kv_heads, head_dim, g), _biased_values(len(slots), num_kv_heads, head_dim, g)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    q[..., :3] *= 4
    exact = kv_cache_spec("fp32", torch.float32).allocate(num_blocks, bs, num_kv_heads, head_dim, CPU)
    int8 = _int8(num_blocks, bs, num_kv_heads, head_dim, sm)
    for cache in (exact, int8):
        cache.write(slots, k, v)  # the whole pool: the context the decode tokens attend to
    meta = _decode_meta(lens, bs, tables)
    assert meta.decode is not None
    step_k, step_v = k[meta.slot_mapping], v[meta.slot_mapping]  # rewrites the decode tokens' own slots
    scale = head_dim**-0.5
    native = PagedAttention(num_heads, num_kv_heads, head_dim, scale, None, decode_kernel=kernels)
    sdpa = PagedAttention(num_heads, num_kv_heads, head_dim, scale, None)
    out_native = native(q, step_k, step_v, int8, meta, False)
    out_sdpa = sdpa(q, step_k, step_v, int8, meta, False)
    torch.testing.assert_close(out_native, out_sdpa, rtol=1e-4, atol=1e-4)
    ref = paged_attention_reference(q, exact.k, exact.v, tables, lens, scale, 0, 0.0, dtype=torch.float64)
    assert _relative_error(out_native.double(), ref.reshape(num_seqs, -1)) < 0.02


def test_the_triton_decode_path_reads_smoothed_rows_too() -> None:
    """The CUDA decode kernel (kernels/triton_attention.py; here under Triton's interpreter) sits behind
    the same `native_decode` and hooks: over a smoothed cache it agrees with the SDPA path."""
    triton_attention = pytest.importorskip("tokenmill.kernels.triton_attention")
    if not triton_attention.interpreting():
        pytest.skip("needs Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1)")
    g = torch.Generator().manual_seed(0)
    h, kvh, hd, bs, num_blocks = 8, 2, 32, 16, 12
    int8 = _int8(num_blocks, bs, kvh, hd, _smoothing(kvh, hd, h, g), native=False)
    slots = torch.arange(num_blocks * bs)
    k, v = _biased_keys(len(slots), kvh, hd, g), _biased_values(len(slots), kvh, hd, g)
    int8.write(slots, k, v)
    meta = _decode_meta(torch.tensor([40, 7, 25]), bs, torch.randperm(num_blocks, generator=g)[:9].view(3, 3))
    q = torch.randn(3, h, hd, generator=g)
    step_k, step_v = k[meta.slot_mapping], v[meta.slot_mapping]
    triton = PagedAttention(h, kvh, hd, hd**-0.5, None, decode_kernel=triton_attention.TritonDecodeKernels())
    sdpa = PagedAttention(h, kvh, hd, hd**-0.5, None)
    torch.testing.assert_close(triton(q, step_k, step_v, int8, meta, False), sdpa(q, step_k, step_v, int8, meta, False),
                               rtol=1e-4, atol=1e-4)
