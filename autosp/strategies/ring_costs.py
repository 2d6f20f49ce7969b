"""Cost arithmetic of blockwise (ring) attention, shared by the strategies that pass K/V blocks
around a ring (ring, zigzag ring, all-gather-KV's blockwise kernels, a hybrid's ring): the
kernel calls each rank makes, ring workspace, and the ring's transfers."""

from __future__ import annotations

import bisect
import math

from autosp.strategies.base import AttentionShape, KernelCall, SPMesh, Transfer
from autosp.strategies.blockwise import tiles_per_chunk
from autosp.strategies.layout import dealt_for, n_chunks, rank_chunks


def blockwise_kernel_calls(shape: AttentionShape, mesh: SPMesh, heads: float, ring: int) -> list[list[KernelCall]]:
    """Per ring rank, the fused calls of blockwise attention (ring, all-gather-KV, a hybrid's ring).

    The sequence is cut into equal chunks (see :mod:`autosp.strategies.layout`); a ring rank
    holding query chunks ``A`` makes, under a causal mask, one causal call per chunk in ``A``
    and ``sum(A)`` full calls (chunk ``a`` sees chunks ``0..a-1``): contiguous rank r makes
    1 causal + r full calls (the last rank is busiest); zigzag rank r (chunks r, 2P-1-r) makes
    2 causal + 2P-1 full on every rank (balanced). Ring rank g holds the tokens of the SP ranks
    ``g*u .. g*u+u-1`` (``u = degree / ring``).
    """
    sp, lay = mesh.degree, mesh.layout
    u = sp // ring
    n = n_chunks(lay, sp)
    c = shape.seq_len / n
    d = shape.head_dim
    out = []
    # balanced: the chunks the wrapper deals for these documents (else its default pattern)
    dealt = dealt_for(shape.documents, sp) if lay == "balanced" and shape.documents else None
    for g in range(ring):
        ids = [x for j in range(u) for x in (dealt[g * u + j] if dealt else rank_chunks(lay, g * u + j, sp))]
        if shape.masked:
            out.append([masked_tile_calls(shape, heads, ids, n, c)])
        elif shape.causal:
            out.append([KernelCall(heads, c, c, d, True, len(ids)), KernelCall(heads, c, c, d, False, sum(ids))])
        else:
            out.append([KernelCall(heads, c, c, d, False, len(ids) * n)])
    return out


def masked_tile_calls(shape: AttentionShape, heads: float, ids: list[int], n: int, c: float) -> KernelCall:
    """Under an explicit mask the kernels work on tiles (chunks of ``c`` tokens cut into ``m``
    tiles of ``t <= MASK_TILE``) and skip the tiles the mask hides; each tile it shows costs a
    full (masked, non-causal) call. Causal with window ``w``: query tile ``a`` sees key tiles
    ``a - d`` for ``0 <= d <= min(a, d_max)``, where ``d_max = ceil((w - 1) / t)`` (the nearest
    tokens of tile ``a - d`` are ``(d - 1) t + 1`` apart); without a window ``d_max = a``. Packed
    documents: tile ``a`` sees key tiles from the one holding the start of its first token's
    document (the union of its queries' key ranges is one interval)."""
    m = tiles_per_chunk(c)               # as the runtime cuts them
    t = c / m
    q_tiles = [x * m + k for x in ids for k in range(m)]
    if not shape.causal:
        return KernelCall(heads, t, t, shape.head_dim, False, len(q_tiles) * n * m)
    d_max = math.ceil((shape.window - 1) / t) if shape.window else None
    starts = _document_starts(shape.documents)
    count = 0
    for a in q_tiles:
        # packed documents: tile a's queries see keys from their first token's document start on
        first = int(starts[bisect.bisect_right(starts, a * t) - 1] // t) if starts else 0
        seen = a - first
        count += min(seen, d_max if d_max is not None else seen) + 1
    return KernelCall(heads, t, t, shape.head_dim, False, count)


def _document_starts(documents: tuple[int, ...]) -> list[int]:
    return [sum(documents[:i]) for i in range(len(documents))] if documents else []


def ring_workspace(shape: AttentionShape, mesh: SPMesh) -> float:
    """The larger of the two passes' buffers. Forward: the fp32 output accumulator, two K/V blocks
    in flight, the expanded K/V of one call. Backward (read off the memory probe): the output
    gradient made contiguous and the fp32 dQ accumulator, K and V made contiguous and their fp32
    dK/dV accumulators, the K/V and dK/dV blocks being received, and one kernel call's expanded
    K/V, contiguous inputs and gradients (about three query-sized tensors)."""
    s_loc = shape.seq_len / mesh.degree
    q_loc, kv_loc = shape.bytes(shape.heads, s_loc), shape.bytes(shape.kv_heads, s_loc)
    wide = 4 / shape.elem_bytes
    forward = q_loc * wide + 2 * 2 * kv_loc + 2 * q_loc
    backward = q_loc * (1 + wide) + 2 * kv_loc * (1 + wide) + 4 * kv_loc + 3 * q_loc
    return max(forward, backward)


def ring_transfers(kv_block: float, ring: int, inter: bool, elem_bytes: int) -> list[Transfer]:
    """K/V blocks pass around a ring of ``ring`` ranks, each hop beside one block's attention;
    backward sends the blocks again and the fp32 dK/dV accumulators travel with them."""
    return [Transfer("send_recv", ring, kv_block, "fwd", ring - 1, inter, overlap_steps=ring),
            Transfer("send_recv", ring, kv_block, "bwd", ring - 1, inter, overlap_steps=ring),
            Transfer("send_recv", ring, kv_block * 4 / elem_bytes, "bwd", ring, inter)]
