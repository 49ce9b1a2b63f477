"""fp8_linear's launch table: per (out_features N, in_features K) shape of the V4-Flash and V4-Pro
block-FP8 projections (and their tensor-parallel shards), the three choices its launchers make by
token count M. rule.pick reads `w8a8_from`, triton_w8a8.config reads `tiles`, w8a8.route reads
`cublaslt_from` (each through its view: rule.W8A8_FROM, triton_w8a8.TUNED, w8a8.CUBLASLT_FROM).
Shapes not listed take each reader's default rule.

Measured by `python -m dsv4ops bench --only fp8_tune` (bench/fp8_tune.py): graph-timed, weights from
HBM, on an NVIDIA H100 80GB HBM3 with torch 2.11.0+cu130 and triton 3.6.0, at M = 1, 16, 64, 128, 256
(and 512 / 1024 where the Triton kernel still won at 256). Examples, us: V4-Flash o_b at one token,
W8A16 21.1 / W8A8 17.8 (w8a8_from 1); V4-Flash q_b at 128, Triton W8A8 24.9 / cuBLASLt 21.5
(cublaslt_from 128); the tiles' fastest config at 128 rows beside bf16 F.linear, V4-Flash q_a 9.1
/ 9.3, V4-Pro o_b 68.7 / 98.0.
"""

from __future__ import annotations

from typing import NamedTuple


class Launch(NamedTuple):
    """One shape's measured launch choices."""

    # The smallest M from which W8A8 ("fp8") beat W8A16 ("exact") by rule.MARGIN at every swept M at or
    # above it, timed on the route w8a8.route takes; None: never.
    w8a8_from: int | None
    # The smallest M from which cuBLASLt beat the Triton W8A8 kernel's fastest config at every swept M at
    # or above it; None: w8a8.DEFAULT_CUBLASLT_FROM.
    cublaslt_from: int | None
    # {M bucket: (QUANT, BM, BN, splits, warps, stages)}: the Triton W8A8 kernel's fastest of 70-180
    # configs; a call of M rows takes the smallest bucket >= M (the largest above 256).
    tiles: dict[int, tuple[bool, int, int, int, int, int]]


LAUNCH: dict[tuple[int, int], Launch] = {
    (1024, 4096): Launch(w8a8_from=256, cublaslt_from=None, tiles={  # V4-Flash q_a_proj
        1: (False, 16, 64, 8, 4, 3), 16: (True, 16, 64, 8, 4, 3), 64: (False, 64, 64, 8, 4, 4),
        128: (False, 64, 128, 8, 8, 4), 256: (False, 64, 64, 4, 4, 4)}),
    (32768, 1024): Launch(w8a8_from=64, cublaslt_from=128, tiles={  # V4-Flash q_b_proj
        1: (True, 16, 256, 1, 8, 3), 16: (True, 16, 128, 1, 4, 3), 64: (False, 64, 128, 1, 4, 3),
        128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)}),
    (512, 4096): Launch(w8a8_from=256, cublaslt_from=1024, tiles={  # V4-Flash kv_proj
        1: (True, 16, 64, 16, 4, 3), 16: (True, 16, 64, 16, 4, 3), 64: (True, 64, 64, 16, 4, 3),
        128: (False, 64, 64, 8, 4, 4), 256: (False, 64, 128, 8, 8, 4)}),
    (4096, 8192): Launch(w8a8_from=1, cublaslt_from=256, tiles={  # V4-Flash o_b_proj
        1: (True, 16, 128, 8, 4, 3), 16: (True, 16, 128, 8, 4, 3), 64: (False, 64, 64, 4, 4, 4),
        128: (False, 128, 64, 4, 4, 4), 256: (False, 128, 128, 2, 8, 4)}),
    (8192, 1024): Launch(w8a8_from=64, cublaslt_from=256, tiles={  # V4-Flash indexer q_b_proj
        1: (False, 16, 128, 4, 4, 4), 16: (False, 16, 128, 1, 4, 4), 64: (False, 64, 64, 1, 4, 4),
        128: (False, 128, 64, 1, 8, 3), 256: (False, 128, 64, 1, 4, 3)}),
    (1536, 7168): Launch(w8a8_from=1, cublaslt_from=None, tiles={  # V4-Pro q_a_proj
        1: (True, 16, 64, 14, 4, 3), 16: (True, 16, 64, 14, 4, 3), 64: (False, 64, 64, 14, 4, 3),
        128: (False, 64, 64, 8, 4, 3), 256: (False, 64, 64, 4, 4, 4)}),
    (65536, 1536): Launch(w8a8_from=64, cublaslt_from=128, tiles={  # V4-Pro q_b_proj
        1: (False, 16, 128, 1, 4, 3), 16: (False, 16, 128, 1, 4, 3), 64: (False, 64, 128, 1, 4, 3),
        128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)}),
    (512, 7168): Launch(w8a8_from=1, cublaslt_from=1024, tiles={  # V4-Pro kv_proj
        1: (True, 16, 64, 14, 4, 3), 16: (True, 16, 64, 14, 4, 3), 64: (False, 64, 64, 14, 4, 3),
        128: (False, 64, 64, 14, 4, 4), 256: (False, 128, 64, 8, 4, 3)}),
    (7168, 16384): Launch(w8a8_from=1, cublaslt_from=64, tiles={  # V4-Pro o_b_proj
        1: (False, 16, 64, 4, 4, 3), 16: (True, 16, 128, 4, 4, 3), 64: (False, 64, 64, 2, 4, 4),
        128: (False, 128, 64, 2, 4, 4), 256: (False, 128, 128, 1, 8, 4)}),
    (8192, 1536): Launch(w8a8_from=64, cublaslt_from=128, tiles={  # V4-Pro indexer q_b_proj
        1: (False, 16, 128, 1, 4, 4), 16: (True, 16, 64, 2, 4, 3), 64: (False, 64, 64, 1, 4, 4),
        128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)}),
    # tensor-parallel shards: a rank's q_b_proj rows / o_b_proj columns (warmup._fp8_projections, TP 2-16)
    (4096, 4096): Launch(w8a8_from=1, cublaslt_from=256, tiles={  # V4-Flash o_b_proj, TP2
        1: (True, 16, 128, 8, 4, 3), 16: (False, 16, 128, 4, 4, 4), 64: (False, 64, 64, 4, 4, 4),
        128: (False, 128, 64, 4, 4, 4), 256: (False, 128, 64, 2, 4, 4)}),
    (16384, 1024): Launch(w8a8_from=64, cublaslt_from=128, tiles={  # V4-Flash q_b_proj, TP2
        1: (False, 16, 64, 1, 4, 4), 16: (False, 16, 128, 1, 4, 4), 64: (False, 64, 128, 1, 4, 4),
        128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)}),
    (4096, 2048): Launch(w8a8_from=64, cublaslt_from=256, tiles={  # V4-Flash o_b_proj, TP4
        1: (True, 16, 64, 4, 4, 3), 16: (True, 16, 64, 4, 4, 3), 64: (False, 64, 64, 4, 4, 4),
        128: (False, 64, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 3)}),
    (4096, 1024): Launch(w8a8_from=16, cublaslt_from=256, tiles={  # V4-Flash q_b_proj and o_b_proj, TP8
        1: (False, 16, 128, 8, 4, 4), 16: (True, 16, 32, 2, 4, 3), 64: (False, 64, 64, 1, 4, 4),
        128: (False, 64, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 3)}),
    (2048, 1024): Launch(w8a8_from=128, cublaslt_from=None, tiles={  # V4-Flash q_b_proj, TP16
        1: (True, 16, 64, 8, 4, 3), 16: (True, 16, 32, 2, 4, 3), 64: (True, 64, 64, 8, 4, 3),
        128: (False, 64, 64, 1, 4, 4), 256: (False, 64, 64, 1, 4, 4)}),
    (7168, 8192): Launch(w8a8_from=1, cublaslt_from=64, tiles={  # V4-Pro o_b_proj, TP2
        1: (False, 16, 64, 4, 4, 3), 16: (False, 16, 128, 2, 4, 4), 64: (False, 64, 128, 2, 4, 4),
        128: (False, 128, 64, 2, 4, 4), 256: (False, 128, 64, 1, 4, 4)}),
    (32768, 1536): Launch(w8a8_from=64, cublaslt_from=128, tiles={  # V4-Pro q_b_proj, TP2
        1: (True, 16, 128, 1, 4, 3), 16: (False, 16, 128, 1, 4, 4), 64: (False, 64, 128, 1, 4, 3),
        128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)}),
    (7168, 4096): Launch(w8a8_from=1, cublaslt_from=64, tiles={  # V4-Pro o_b_proj, TP4
        1: (True, 16, 64, 4, 4, 3), 16: (True, 16, 128, 4, 4, 3), 64: (False, 64, 64, 2, 4, 4),
        128: (False, 128, 64, 2, 4, 4), 256: (False, 128, 64, 1, 4, 4)}),
    (16384, 1536): Launch(w8a8_from=64, cublaslt_from=128, tiles={  # V4-Pro q_b_proj, TP4
        1: (False, 16, 128, 1, 4, 4), 16: (False, 16, 128, 1, 4, 4), 64: (False, 64, 64, 1, 4, 4),
        128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)}),
    (7168, 2048): Launch(w8a8_from=1, cublaslt_from=128, tiles={  # V4-Pro o_b_proj, TP8
        1: (True, 16, 128, 4, 4, 3), 16: (True, 16, 128, 4, 4, 3), 64: (False, 64, 64, 1, 4, 4),
        128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)}),
    (4096, 1536): Launch(w8a8_from=64, cublaslt_from=256, tiles={  # V4-Pro q_b_proj, TP16
        1: (True, 16, 64, 4, 4, 3), 16: (True, 16, 64, 4, 4, 3), 64: (False, 64, 64, 1, 4, 4),
        128: (False, 64, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 3)}),
    (7168, 1024): Launch(w8a8_from=64, cublaslt_from=256, tiles={  # V4-Pro o_b_proj, TP16
        1: (False, 16, 64, 1, 4, 4), 16: (False, 16, 128, 1, 4, 4), 64: (False, 64, 64, 1, 4, 4),
        128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)}),
}
