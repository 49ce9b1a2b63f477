"""An independent model of the cache-row formats, written from the spec's tables (V4 spec 5.2 and
5.3; V4.1 spec 4.1-4.6) in plain Python floats: no torch casts, no code shared with dsv4ops.

It turns one row (a list of floats) into the bytes of its data plane and its scale plane, and
places rows into the bytes of a paged pool. Every quantizer reads bf16(x) (round to nearest even
from the fp32 bits); fp32 arithmetic is modelled by rounding exact float64 results to fp32."""

import math
import struct

# name -> (row dim, data bytes, scale bytes, page alignment): the spec's tables.
LAYOUT = {
    "fp8_584": (512, 576, 8, 576),
    "fp8_132": (128, 128, 4, 1),
    "fp8_528": (512, 512, 16, 512),
    "fp4_288": (512, 256, 32, 256),
    "mxfp4_68": (128, 64, 4, 512),
}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def f32(v: float) -> float:
    """Round a float64 to fp32 (nearest even)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def bf16(v: float) -> float:
    """Round an fp32 value to bf16 (nearest even on the fp32 bits)."""
    b = struct.unpack("<I", struct.pack("<f", f32(v)))[0]
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def bf16_bytes(v: float) -> bytes:
    return struct.pack("<f", bf16(v))[2:4]


def signbit(v: float) -> bool:
    return math.copysign(1.0, v) < 0


def pow2ceil_exp(v: float) -> int:
    """e with 2^e the smallest power of two >= v (v > 0)."""
    m, e = math.frexp(v)  # v = m 2^e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


def e4m3_value(code: int) -> float:
    e, m = (code >> 3) & 15, code & 7
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if code & 0x80 else mag


def ue8m0_value(code: int) -> float:
    """A UE8M0 scale byte: 2^(code - 127); 0xFF is NaN."""
    return math.nan if code == 255 else 2.0 ** (code - 127)


def e4m3_code(v: float) -> int:
    """Nearest e4m3fn code, ties to the even code; |v| above 464 (the midpoint of 448 and 480, the
    first step past the largest finite value) is the NaN code."""
    sign = 0x80 if signbit(v) else 0
    a = abs(v)
    if a > 464:
        return 0x7F | sign
    best = min(range(127), key=lambda c: (abs(e4m3_value(c) - a), c & 1))
    return best | sign


def e2m1_nibble(q: float, negative: bool) -> int:
    code = min(range(8), key=lambda c: (abs(E2M1[c] - abs(q)), c & 1))
    return code | (8 if negative else 0)


def _tiles(row, group):
    return [row[i:i + group] for i in range(0, len(row), group)]


def _nibbles_to_bytes(nibs):
    return bytes(nibs[2 * i] | (nibs[2 * i + 1] << 4) for i in range(len(nibs) // 2))


def encode(name: str, row) -> tuple[bytes, bytes]:
    """(data plane bytes, scale plane bytes) of one row in format `name`."""
    x = [bf16(v) for v in row]
    if name == "fp8_584":  # V4: nope in tiles of 64 (V4 scale rule: max(amax, 1e-4) / 448 in fp32), bf16 rope
        data, scales = b"", b""
        for tile in _tiles(x[:448], 64):
            e = pow2ceil_exp(f32(max(max(abs(v) for v in tile), f32(1e-4)) / 448))
            data += bytes(e4m3_code(v / 2.0**e) for v in tile)
            scales += bytes([e + 127])
        return data + b"".join(bf16_bytes(v) for v in x[448:]), scales + b"\0"
    if name == "fp8_132":  # V4: one power-of-two fp32 scale per row
        e = pow2ceil_exp(f32(max(max(abs(v) for v in x), f32(1e-4)) / 448))
        return bytes(e4m3_code(v / 2.0**e) for v in x), struct.pack("<f", 2.0**e)
    if name == "fp8_528":  # V4.1 spec 4.2: tiles of 32 (rope dims too), HF floor on amax
        data, scales = b"", b""
        for tile in _tiles(x, 32):
            e = pow2ceil_exp(f32(max(max(abs(v) for v in tile), f32(1e-4)) * f32(1 / 448)))
            data += bytes(e4m3_code(min(max(v / 2.0**e, -448.0), 448.0)) for v in tile)
            scales += bytes([e + 127])
        return data, scales
    if name == "fp4_288":  # V4.1 spec 4.3: e4m3 scale per 16, no upper clamp
        nibs, scales = [], b""
        for tile in _tiles(x, 16):
            code = e4m3_code(f32(max(max(abs(v) for v in tile), 6 * 2.0**-9) / 6))
            scales += bytes([code])
            s = e4m3_value(code) if code & 0x7F != 0x7F else math.nan
            for v in tile:
                if math.isnan(s):  # the row reads back NaN; its nibbles keep only the sign
                    nibs.append(8 if signbit(v) else 0)
                else:
                    nibs.append(e2m1_nibble(min(max(f32(v / s), -6.0), 6.0), signbit(v)))
        return _nibbles_to_bytes(nibs), scales
    if name == "mxfp4_68":  # V4.1 spec 4.4: UE8M0 per 32
        nibs, scales = [], b""
        for tile in _tiles(x, 32):
            e = pow2ceil_exp(f32(max(max(abs(v) for v in tile), 6 * 2.0**-126) * f32(1 / 6)))
            scales += bytes([e + 127])
            nibs += [e2m1_nibble(min(max(v / 2.0**e, -6.0), 6.0), signbit(v)) for v in tile]
        return _nibbles_to_bytes(nibs), scales
    raise KeyError(name)


def page_bytes(name: str, block_size: int) -> int:
    _, db, sb, align = LAYOUT[name]
    return -(-block_size * (db + sb) // align) * align


def pool_bytes(name: str, blocks: int, block_size: int, rows: dict, fill: int = 0xFF) -> bytes:
    """The bytes of a pool of `blocks` pages holding rows {slot: row}; every other byte `fill`."""
    _, db, sb, _ = LAYOUT[name]
    page = page_bytes(name, block_size)
    buf = bytearray([fill]) * (blocks * page)
    for slot, row in rows.items():
        p, o = divmod(slot, block_size)
        data, scales = encode(name, row)
        buf[p * page + o * db: p * page + (o + 1) * db] = data
        at = p * page + block_size * db + o * sb
        buf[at: at + sb] = scales
    return bytes(buf)


def decode(name: str, data: bytes, scales: bytes) -> list:
    """The values a reader gets back from one row's bytes."""
    dim, _, _, _ = LAYOUT[name]
    if name == "fp8_584":
        nope = [e4m3_value(data[j]) * 2.0 ** (scales[j // 64] - 127) for j in range(448)]
        return nope + [struct.unpack("<f", b"\0\0" + data[448 + 2 * j: 450 + 2 * j])[0] for j in range(64)]
    if name == "fp8_132":
        s = struct.unpack("<f", scales)[0]
        return [e4m3_value(c) * s for c in data]
    if name == "fp8_528":
        return [e4m3_value(data[j]) * 2.0 ** (scales[j // 32] - 127) for j in range(dim)]
    out = []
    group = 16 if name == "fp4_288" else 32
    for j in range(dim):
        nib = (data[j // 2] >> (4 * (j % 2))) & 0xF
        v = E2M1[nib & 7] * (-1.0 if nib & 8 else 1.0)
        sc = scales[j // group]
        if name == "fp4_288":
            out.append(v * (math.nan if sc & 0x7F == 0x7F else e4m3_value(sc)))
        else:
            out.append(v * 2.0 ** (sc - 127))
    return out


def roundtrip(name: str, row) -> list:
    return decode(name, *encode(name, row))
