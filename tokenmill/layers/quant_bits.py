"""Bit and nibble packing of the block formats (layers/quant_formats.py): q4's nibble bytes and q5/q6's
mask planes, in the row order and the kernel's interleaved order."""

from __future__ import annotations

import torch

BLOCK = 32
ROW_GROUP = 8  # output rows interleaved per group (the kernel's 8 int32 lanes)
HIGH_BYTES = 32  # q5's fifth-bit plane per (group, block): 8 chunks x 2 nibble halves x uint16 (q6: two planes)


def pack_high(high: torch.Tensor, groups: int, nb: int) -> torch.Tensor:
    # Column j of a block = 16 h + 2 c + e (h: low or high nibble, c: chunk, e: column of the pair):
    # [G, r, nb, h, c, e] → [G, nb, c, h, (r, e)], then the 16 bits (r, e) into one uint16.
    bits = high.reshape(groups, ROW_GROUP, nb, 2, 8, 2).permute(0, 2, 4, 3, 1, 5).reshape(groups, nb, 8, 2, 16)
    weights = torch.tensor([1 << i for i in range(16)], dtype=torch.int32)
    words = (bits.to(torch.int32) * weights).sum(-1)  # [G, nb, c, h] in [0, 2^16)
    lo, hi = (words & 0xFF).to(torch.uint8), (words >> 8).to(torch.uint8)
    return torch.stack([lo, hi], dim=-1).reshape(groups, nb * HIGH_BYTES).contiguous()


def unpack_high(plane: torch.Tensor, nb: int) -> torch.Tensor:
    groups = plane.shape[0]
    words = plane.reshape(groups, nb, 8, 2, 2).to(torch.int32)
    words = words[..., 0] | (words[..., 1] << 8)  # [G, nb, c, h]
    bits = (words.unsqueeze(-1) >> torch.arange(16, dtype=torch.int32)) & 1  # [G, nb, c, h, (r, e)]
    bits = bits.reshape(groups, nb, 8, 2, ROW_GROUP, 2).permute(0, 4, 1, 3, 2, 5)  # [G, r, nb, h, c, e]
    return bits.reshape(groups * ROW_GROUP, nb * BLOCK).to(torch.uint8)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[rows, cols] values < 16 → q4's bytes, w(j) | w(j + 16) << 4 per 32-block."""
    rows, cols = q.shape
    blocks = q.reshape(rows, cols // BLOCK, BLOCK)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(rows, cols // 2).contiguous()


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    rows = qs.shape[0]
    blocks = qs.reshape(rows, -1, 16)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).reshape(rows, -1)
