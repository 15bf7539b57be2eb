"""The elementwise glue of a decoder layer in a few Triton kernels, for CUDA.

In eager PyTorch a layer's glue is ~15 small kernels (RMSNorm in several ops, the residual add, RoPE
in three, the KV write in four, SiLU·mul in two); replayed from a CUDA graph at batch 1 they cost
more than the layer's weights take to stream (docs/performance.md, the GPU path). Here:

  rms_norm        one program per row: residual += x (optional, in place), then
                  y = x̂ · w with x̂ = x / sqrt(mean(x²) + eps), in float32, rounded once
  rope_kv_write   one program per (token, head) over q, k, v: q and k rotated (rotate-half layout,
                  y = x·cos + roll(x, hd/2)·signed_sin), q written to a new tensor, k and v
                  written straight into their cache slots; replaces RoPE + the KV write
  act_mul         act(gate) · up over the fused gate/up projection (silu or tanh-GELU)

Math is float32 inside each kernel, one rounding on store (the ATen ops round after each op in the
model dtype, so bf16 results can differ in the last bit; float32 agrees to rounding). The same
source runs on CPU under Triton's interpreter, which is how tests/unit/test_triton_glue.py checks
it without a GPU.
"""

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl


def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
              HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        total = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        stored = total.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, stored, mask=mask)
        x = stored.to(tl.float32)  # the norm of the sum as the residual stream holds it
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rope_kv_write(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr,
                   sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, s_cos, s_sin, sqo_t, sqo_h, s_slot, s_head,
                   num_heads, num_kv_heads, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < HEAD_DIM
    half = HEAD_DIM // 2
    partner = tl.where(d < half, d + half, d - half)
    if h < num_heads + num_kv_heads:
        cos = tl.load(cos_ptr + t * s_cos + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * s_sin + d, mask=mask, other=0.0).to(tl.float32)
        if h < num_heads:
            q_src = q_ptr + t * sq_t + h * sq_h
            qx = tl.load(q_src + d, mask=mask, other=0.0).to(tl.float32)
            qp = tl.load(q_src + partner, mask=mask, other=0.0).to(tl.float32)
            tl.store(qo_ptr + t * sqo_t + h * sqo_h + d, (qx * cos + qp * sin).to(qo_ptr.dtype.element_ty),
                     mask=mask)
        else:
            kh = h - num_heads
            k_src = k_ptr + t * sk_t + kh * sk_h
            kx = tl.load(k_src + d, mask=mask, other=0.0).to(tl.float32)
            kp = tl.load(k_src + partner, mask=mask, other=0.0).to(tl.float32)
            kslot = tl.load(slot_ptr + t)
            tl.store(kc_ptr + kslot * s_slot + kh * s_head + d, (kx * cos + kp * sin).to(kc_ptr.dtype.element_ty),
                     mask=mask)
    else:  # names of its own: Triton wants a name bound in both branches to have one type
        vh = h - num_heads - num_kv_heads
        val = tl.load(v_ptr + t * sv_t + vh * sv_h + d, mask=mask, other=0.0)
        vslot = tl.load(slot_ptr + t)
        tl.store(vc_ptr + vslot * s_slot + vh * s_head + d, val.to(vc_ptr.dtype.element_ty), mask=mask)


def _act_mul(gu_ptr, out_ptr, stride_gu, stride_o, n_cols, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # tanh approximation; tanh(z) = 1 - 2 / (e^{2z} + 1)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    else:
        act = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _compiled() -> tuple[Any, Any, Any]:
    return triton.jit(_rms_norm), triton.jit(_rope_kv_write), triton.jit(_act_mul)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, hidden] → norm(x)·w (with `residual`: residual += x first, in place, and the norm of it)."""
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    rows, cols = x.shape
    out = torch.empty_like(x)
    if rows:
        res = residual if residual is not None else x
        _compiled()[0][(rows,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), cols, float(eps),
                                HAS_RES=residual is not None, BLOCK=_pow2(cols))
    return out


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q [T, H, hd], k and v [T, KVH, hd] (strided views of the fused projection); cos and signed_sin
    [T, 1, hd] or [T, hd]. Writes rotated k and v into the dense caches [blocks, bs, KVH, hd] at
    `slots` [T]; returns rotated q [T, H, hd], contiguous."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous()
    assert v_cache.is_contiguous() and head_dim % 2 == 0
    cos2, sin2 = cos.reshape(tokens, head_dim), signed_sin.reshape(tokens, head_dim)
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens:
        _compiled()[1][(tokens, heads + 2 * kv_heads)](
            q, k, v, cos2, sin2, out, k_cache, v_cache, slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos2.stride(0),
            sin2.stride(0), out.stride(0), out.stride(1), kv_heads * head_dim, head_dim, heads, kv_heads,
            HEAD_DIM=head_dim, BLOCK=_pow2(head_dim))
    return out


_ACT_BLOCK = 1024


def act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """gate_up [T, 2I] → act(gate)·up [T, I]; act is SiLU, or GELU (tanh approximation) when `gelu`."""
    assert gate_up.stride(-1) == 1
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        _compiled()[2][(rows, math.ceil(cols / _ACT_BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0), cols,
                                                            GELU=gelu, BLOCK=_ACT_BLOCK)
    return out
