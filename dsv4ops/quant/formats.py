"""Cache-row formats: one record per format, independent of the model version.

A pool of a byte format is uint8 [blocks, page bytes]. A page of B slots is a data plane
(B x data_bytes, slot s at s * data_bytes) followed by a scale plane (B x scale_bytes, slot s at
B * data_bytes + s * scale_bytes), the page padded up to a multiple of page_align (spec V4 5.2,
V4.1 4.1). The number of slots of a page is page bytes // row bytes, so a page's padding must be
shorter than one row: `page_bytes` rejects block sizes that break this (mxfp4_68 pages are padded
to 512 B: 128 x 68 B = 8704 B = 17 x 512 B fits, 64 x 68 B = 4352 B would leave 256 B).
A pool of the `exact` format is a float tensor [blocks, block_size, dim] of plain rows.

| name     | rows   | data | scales | element            | scale, per group of      | page align | used by (spec)        |
|----------|--------|------|--------|--------------------|--------------------------|------------|-----------------------|
| fp8_584  | 512    | 576  | 8      | e4m3 448 + bf16 64 | UE8M0 / 64 (7 + 1 pad)   | 576        | V4 window, compressed |
| fp8_132  | 128    | 128  | 4      | e4m3               | fp32 pow2 / 128          | 1          | V4 indexer keys       |
| fp8_528  | 512    | 512  | 16     | e4m3 (rope too)    | UE8M0 / 32               | 512        | V4.1 window           |
| fp4_288  | 512    | 256  | 32     | e2m1               | e4m3 / 16                | 256        | V4.1 compressed       |
| mxfp4_68 | 128    | 64   | 4      | e2m1               | UE8M0 / 32               | 512        | V4.1 index keys       |
| exact    | any    | -    | -      | the pool's dtype   | -                        | -          | comparisons           |

e2m1 nibbles: element 2i in the low nibble of byte i, element 2i + 1 in the high nibble.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

EXACT = "exact"


@dataclass(frozen=True)
class Format:
    name: str
    dim: int  # elements per row
    data_bytes: int  # per slot, data plane
    scale_bytes: int  # per slot, scale plane
    element: str  # "e4m3" or "e2m1"
    scale: str  # "ue8m0" (exponent byte e, value 2^(e - 127)), "e4m3" (e4m3fn bits) or "fp32"
    group: int  # elements per scale
    quantized: int  # leading elements quantized; the rest (the 584-B rope part) are bf16
    page_align: int
    rounds_to_bf16: bool = True  # the quantizer reads bf16(x), as the official and engine writers

    @property
    def row_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    def padded(self, block_size):
        """Bytes of `block_size` rows padded to the page alignment (works on symbolic sizes)."""
        return -(-block_size * self.row_bytes // self.page_align) * self.page_align

    def page_bytes(self, block_size: int) -> int:
        """Bytes of a page of `block_size` slots (rows, then scales, then padding)."""
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1 slots per page, got {block_size}")
        nbytes = self.padded(block_size)
        if nbytes // self.row_bytes != block_size:
            raise ValueError(
                f"block_size: {self.name} pages are padded to a multiple of {self.page_align} B; {block_size} rows "
                f"({block_size * self.row_bytes} B) leave {nbytes - block_size * self.row_bytes} B of padding, more "
                f"than one {self.row_bytes}-B row, so the page size would not give the slot count back; got "
                f"{block_size}"
            )
        return nbytes

    def block_size(self, page_bytes: int) -> int:
        """Slots of a page of `page_bytes` bytes (valid when page_bytes(result) == page_bytes)."""
        return page_bytes // self.row_bytes


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp8_584", 512, 576, 8, "e4m3", "ue8m0", 64, 448, 576),
        Format("fp8_132", 128, 128, 4, "e4m3", "fp32", 128, 128, 1),
        Format("fp8_528", 512, 512, 16, "e4m3", "ue8m0", 32, 512, 512),
        Format("fp4_288", 512, 256, 32, "e2m1", "e4m3", 16, 512, 256),
        Format("mxfp4_68", 128, 64, 4, "e2m1", "ue8m0", 32, 128, 512),
    )
}
NAMES = (*FORMATS, EXACT)


def get(name: str) -> Format:
    """The record of a byte format; ValueError naming the known formats otherwise."""
    if name not in FORMATS:
        raise ValueError(f"fmt: expected a byte format in {sorted(FORMATS)}, got {name!r}")
    return FORMATS[name]


def block_size(cache_shape, name: str) -> int:
    """Slots per page of a pool of format `name` with shape `cache_shape`."""
    return cache_shape[1] if name == EXACT else get(name).block_size(cache_shape[1])


def pool_shape(name: str, blocks: int, block_size: int, dim: int) -> tuple[int, ...]:
    """Shape of a pool of `blocks` pages of `block_size` rows of `dim` elements."""
    if name == EXACT:
        return (blocks, block_size, dim)
    f = get(name)
    if dim != f.dim:
        raise ValueError(f"dim: {name} stores {f.dim}-d rows, got {dim}")
    return (blocks, f.page_bytes(block_size))

INDEX_FORMATS = (EXACT, "fp8_132", "mxfp4_68")  # 128-d index keys
ROW_FORMATS = (EXACT, *(n for n, f in FORMATS.items() if f.dim == 512))  # 512-d window rows, compressed entries


@dataclass(frozen=True)
class CacheFormats:
    """The row format of each cache pool, V4 and V4.1 alike: `window` (the sliding-window ring),
    `comp` (the compressed entries), `index` (the indexer's keys; its query is quantized the same
    way). The format a pool stores is the layer's numerics (its fake quantizer); "exact" stores
    plain rows of CacheConfig.exact_dtype. Presets: `v4()` (V4's serving cache, DeepSeek's
    inference formats), `v41()` (the QAT formats of the released V4.1), `exact()` (none: the
    transformers comparison). V4 holds (window, comp) in exact/exact, fp8_584/fp8_584 or
    fp8_584/fp4_288; V4.1 any pair of ROW_FORMATS."""

    window: str
    comp: str
    index: str

    def __post_init__(self):
        for name, allowed in (("window", ROW_FORMATS), ("comp", ROW_FORMATS), ("index", INDEX_FORMATS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {list(allowed)}, got {getattr(self, name)!r}")

    @classmethod
    def v4(cls) -> CacheFormats:
        return cls("fp8_584", "fp8_584", "fp8_132")

    @classmethod
    def v41(cls) -> CacheFormats:
        return cls("fp8_528", "fp4_288", "mxfp4_68")

    @classmethod
    def exact(cls) -> CacheFormats:
        return cls(EXACT, EXACT, EXACT)

    def replace(self, **changes) -> CacheFormats:
        return dataclasses.replace(self, **changes)
