"""dsv4::inv_rope and inv_rope.api.inv_rope: the trailing rope channels rotated back by the query
position (interleaved pairs), the rest copied; every row written; bad inputs. Issue 3."""

from functools import partial

import builders
from interp import INV_FREQ, i32
import pytest
import torch
from dsv4ops import testing as T
from dsv4ops.inv_rope import reference as inv_rope_ref
from dsv4ops.inv_rope import triton as inv_rope_tt

from dsv4ops.reference.functional import apply_rope, rope_angles

BF16, FP32, I32 = torch.bfloat16, torch.float32, torch.int32


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_rotates_the_rope_channels_back(dtype):
    args = builders.inv_rope_args(dtype, heads=3, dim=16, tokens=4, noncontig=True)
    args["out"].fill_(float("nan"))
    builders.call_op("inv_rope", args)
    o, out = args["o"], args["out"]
    assert builders.bytes_equal(out[..., :8], o[..., :8])  # the nope channels are copied
    # Independently of reference.functional, in fp64: pair i of the trailing 8 channels times e^(-i t theta_i).
    z = torch.view_as_complex(o[..., 8:].double().unflatten(-1, (4, 2)).contiguous())
    angle = args["positions"].double()[:, None, None] * args["inv_freq"].double()
    expect = torch.view_as_real(z * torch.polar(torch.ones_like(angle), -angle)).flatten(-2)
    # Error scale: the pair norm |z|. fp32: the angle t x theta (t <= 21, theta <= 1) is rounded to
    # half an ulp of 21, 2^-20 rad, then cos, sin, two products and a sum add about 4 x 2^-24: under
    # 32 x 2^-24. bf16: one final rounding, half an ulp = 2^-8 relative.
    tol = (2.0**-8 if dtype == BF16 else 32 * 2.0**-24) * z.abs().amax()
    assert ((out[..., 8:].double() - expect).abs() <= tol).all()
    public = builders.call_public("inv_rope", args)
    assert public.is_contiguous() and builders.bytes_equal(public, out)


def test_undoes_the_rope_at_the_same_position():
    o = torch.randn(5, 2, 16)
    positions = torch.tensor([0, 1, 7, 100, 4096], dtype=I32)
    inv_freq = builders.rope_table(8)
    cos, sin = rope_angles(positions, inv_freq, o.dtype)
    rotated = apply_rope(o, cos[:, None], sin[:, None])
    back = builders.call_public("inv_rope", dict(o=rotated, positions=positions, inv_freq=inv_freq, out=None))
    # Both rotations use the same rounded angle, so R(-a) R(a) = (cos^2 + sin^2) I up to the rounding
    # of 2 x (2 products + 1 sum) and of cos^2 + sin^2 itself: under 8 fp32 ulps of |o|.
    assert ((back - o).abs() <= 8 * 2.0**-24 * o.abs().amax()).all()
    assert not torch.equal(rotated[1:], o[1:])


# ---- bad inputs: one per rule ------------------------------------------------------------------
ARGS = partial(builders.inv_rope_args, FP32)
wa = builders.with_arg
BAD = [
    ("o-ndim", wa("o", lambda a: a["o"][0]), r"o: expected 3-D \[tokens, heads, head_dim\]"),
    ("o-dtype", wa("o", lambda a: a["o"].int()), r"o: expected dtype in"),
    ("o-last-dim", wa("o", lambda a: a["o"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"o: expected a contiguous last dim"),
    ("positions-ndim", wa("positions", lambda a: a["positions"][None]), r"positions: expected 1-D \[tokens\]"),
    ("positions-dtype", wa("positions", lambda a: a["positions"].long()), r"positions: expected dtype in"),
    ("positions-size", wa("positions", lambda a: a["positions"][:2]),
     r"positions: expected size 3 \(tokens of o\) at dim 0, got 2"),
    ("positions-device", wa("positions", lambda a: a["positions"].to("meta")),
     r"positions: expected device cpu \(as o\), got meta"),
    ("inv_freq-ndim", wa("inv_freq", lambda a: a["inv_freq"][None]), r"inv_freq: expected 1-D"),
    ("inv_freq-dtype", wa("inv_freq", lambda a: a["inv_freq"].bfloat16()), r"inv_freq: expected dtype in"),
    ("inv_freq-width", wa("inv_freq", lambda a: torch.ones(9)),
     r"inv_freq: expected at most 8 frequencies \(head dim 16\), got 9"),
    ("out-shape", wa("out", lambda a: a["out"][:1]), r"out: expected shape \(3, 2, 16\) \(as o\)", ("op",)),
    ("out-dtype", wa("out", lambda a: a["out"].bfloat16()), r"out: expected dtype in \[torch.float32\]", ("op",)),
    ("out-last-dim", wa("out", lambda a: a["out"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"out: expected a contiguous last dim", ("op",)),
    ("positions-negative", wa("positions", lambda a: torch.tensor([0, -7, 14], dtype=I32)),
     r"positions: expected >= 0 \(token positions\), got -7 at index 1", ("public",)),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_writes_nothing(case):
    _, mutate, match, *via = case
    builders.assert_bad_case("inv_rope", ARGS(), mutate, match, via)


# ---- the Triton kernel under the interpreter, against the reference (helpers: tests/interp.py) -------------
def test_inv_rope():
    o, pos = torch.randn(3, 9, 512), i32(0, 129, 70000)

    def run(fn, dtype):
        out = torch.full((3, 9, 512), float("nan"), dtype=dtype)
        fn(o.to(dtype), pos, INV_FREQ, out)
        return out

    got = run(inv_rope_tt.inv_rope, torch.bfloat16)
    T.assert_close_to_ref(got, run(inv_rope_ref.inv_rope, torch.float64), run(inv_rope_ref.inv_rope, torch.bfloat16))
    assert torch.equal(got[..., :448], o[..., :448].bfloat16()), "nope dims are copied"


def test_inv_rope_kernel_rejects_other_layouts_by_name():
    with pytest.raises(ValueError, match="inv_freq"):
        inv_rope_tt.inv_rope(torch.randn(2, 2, 512), i32(0, 1), INV_FREQ[:16], torch.empty(2, 2, 512))
