"""dsv4::visible_entries and visible_entries.api.visible_entries: the HCA key list (the pool slot of
every complete entry of each token's request, -1 elsewhere) against loops over tokens and entries;
unallocated blocks, padding and out-of-range tokens give -1; every element written; bad inputs."""

from functools import partial

import builders
import pytest
import torch

from dsv4ops.visible_entries.api import visible_entries

I32 = torch.int32
POISON = 2**31 - 1


def expected_entries(block_table, positions, req_slots, ratio: int, block_size: int) -> torch.Tensor:
    """The key list as loops over tokens and entries: entry w of request r is visible to a token at
    position p when w < (p + 1) // ratio, and sits at slot table[r][w // bs] * bs + w % bs when
    that block is allocated; anything else, and a padding token's whole row, is -1."""
    table = block_table.tolist()
    width = block_table.shape[1] * block_size
    rows = []
    for p, r in zip(positions.tolist(), req_slots.tolist()):
        row = [-1] * width
        if 0 <= r < len(table) and p >= 0:
            for w in range(min((p + 1) // ratio, width)):
                block = table[r][w // block_size]
                if block >= 0:
                    row[w] = block * block_size + w % block_size
        rows.append(row)
    return torch.tensor(rows, dtype=I32).view(len(rows), width)


def random_case(ratio: int, block_size: int, blocks: int = 5, requests: int = 4, tokens: int = 21, seed: int = 0,
                device=None) -> dict:
    """A table of distinct random blocks with a quarter unallocated (-1, anywhere in a row), and
    tokens at the positions where the count changes (0, ratio - 1, ratio, ratio + 1), where the
    table fills (blocks x bs x ratio - 1) and past it up to the largest int32 position (where
    p + 1 overflows int32), and at random; every fifth token padding."""
    g = torch.Generator().manual_seed(seed)
    # A pool of requests x blocks blocks: the table's numel, the pool_blocks builders.call_public passes.
    table = torch.randperm(requests * blocks, generator=g).to(I32).view(requests, blocks)
    table[torch.rand(table.shape, generator=g) < 0.25] = -1
    full = blocks * block_size * ratio
    edges = [0, ratio - 1, ratio, ratio + 1, 2 * ratio - 1, full - 1, full, 10 * full, 2**31 - 1]
    pos = torch.tensor(edges + torch.randint(0, full, (tokens - len(edges),), generator=g).tolist(), dtype=I32)
    req = torch.randint(0, requests, pos.shape, generator=g).to(I32)
    req[::5] = -1
    out = torch.full((tokens, blocks * block_size), POISON, dtype=I32)
    return dict(block_table=table.to(device), positions=pos.to(device), req_slots=req.to(device), out=out.to(device),
                ratio=ratio, block_size=block_size)


def _expect(args: dict) -> torch.Tensor:
    return expected_entries(args["block_table"], args["positions"], args["req_slots"], args["ratio"],
                            args["block_size"])


# V4's HCA ratio over its 64-entry blocks, CSA's ratio over 16-entry blocks, and ratio 1 over
# 3-entry blocks (every position closes an entry; a block size that is not a power of two).
SHAPES = [(128, 64), (4, 16), (1, 3)]


@pytest.mark.parametrize("ratio,block_size", SHAPES)
def test_matches_the_loop_formulation(ratio, block_size):
    args = random_case(ratio, block_size)
    want = _expect(args)
    assert (want == -1).any() and (want >= 0).any()  # both kinds of element appear
    builders.call_op("visible_entries", args)
    assert torch.equal(args["out"], want)  # the op cuts a list past the table's width at it
    # The public function refuses a live token whose entries pass the table (the BAD table): the others.
    fits = (args["req_slots"] < 0) | ((args["positions"].long() + 1) // ratio <= args["out"].shape[1])
    assert not fits.all()
    sub = dict(args, positions=args["positions"][fits], req_slots=args["req_slots"][fits], out=args["out"][fits])
    assert torch.equal(builders.call_public("visible_entries", sub), want[fits])


def test_counts_at_the_entry_boundaries():
    # One request, blocks 7 and 2 of 4 entries, ratio 4: entry w closes at position 4w + 3.
    table = torch.tensor([[7, 2]], dtype=I32)
    pos = torch.tensor([0, 2, 3, 4, 7, 15, 31], dtype=I32)
    out = visible_entries(table, pos, torch.zeros(7, dtype=I32), 4, 4, 8)
    a = [28, 29, 30, 31, 8, 9, 10, 11]  # the slots of entries 0..7
    assert out.tolist() == [[-1] * 8, [-1] * 8, a[:1] + [-1] * 7, a[:1] + [-1] * 7, a[:2] + [-1] * 6,
                            a[:4] + [-1] * 4, a]


def test_an_unallocated_block_gives_minus_one():
    # Entries 2..3 lie in block -1 (unallocated): -1, not the slot arithmetic of -1 x 2 + w % 2.
    table = torch.tensor([[5, -1, 7]], dtype=I32)
    out = visible_entries(table, torch.tensor([5, 2], dtype=I32), torch.tensor([0, 0], dtype=I32), 1, 2, 8)
    assert out.tolist() == [[10, 11, -1, -1, 14, 15], [10, 11, -1, -1, -1, -1]]


def test_the_op_makes_out_of_range_tokens_padding():
    # The op (no value checks): a request slot past the table or below -1, or a negative position,
    # gives the row of a padding token, all -1 (the public function rejects these values).
    args = builders.visible_entries_args(ratio=1)
    args["req_slots"] = torch.tensor([0, 2, -2, 1, 1, -1], dtype=I32)
    args["positions"] = torch.tensor([5, 6, 7, -1, -9, 0], dtype=I32)
    builders.call_op("visible_entries", args)
    assert (args["out"][1:] == -1).all() and (args["out"][0, :6] >= 0).all()


def test_writes_within_a_strided_out():
    # out may have a row stride gap (a view of wider rows): the gap stays untouched.
    args = random_case(4, 16)
    wide = torch.full((args["out"].shape[0], args["out"].shape[1] + 5), POISON, dtype=I32)
    args["out"] = wide[:, :-5]
    builders.call_op("visible_entries", args)
    assert torch.equal(args["out"], _expect(args)) and (wide[:, -5:] == POISON).all()


@pytest.mark.parametrize("tokens,blocks", [(0, 3), (3, 0), (0, 0)], ids=["no-tokens", "no-blocks", "neither"])
def test_empty(tokens, blocks):
    args = builders.visible_entries_args(blocks=max(blocks, 1))
    args["block_table"] = args["block_table"][:, :blocks]
    # Position 0 sees no entry at ratio 2: a table of no blocks holds all its tokens see.
    args["positions"], args["req_slots"] = torch.zeros(tokens, dtype=I32), args["req_slots"][:tokens]
    out = builders.call_public("visible_entries", args)
    assert out.shape == (tokens, blocks * 4) and out.dtype == I32


# ---- bad inputs: one per rule ------------------------------------------------------------------
ARGS = partial(builders.visible_entries_args, ratio=1)
wa = builders.with_arg
BAD = [
    ("block_table-ndim", wa("block_table", lambda a: a["block_table"][0]),
     r"block_table: expected 2-D \[requests, blocks per request\]"),
    ("block_table-dtype", wa("block_table", lambda a: a["block_table"].long()), r"block_table: expected dtype in"),
    ("positions-ndim", wa("positions", lambda a: a["positions"][None]), r"positions: expected 1-D \[tokens\]"),
    ("positions-dtype", wa("positions", lambda a: a["positions"].long()), r"positions: expected dtype in"),
    ("positions-device", wa("positions", lambda a: a["positions"].to("meta")),
     r"positions: expected device cpu \(as block_table\), got meta"),
    ("req_slots-dtype", wa("req_slots", lambda a: a["req_slots"].long()), r"req_slots: expected dtype in"),
    ("req_slots-size", wa("req_slots", lambda a: a["req_slots"][:2]),
     r"req_slots: expected size 6 \(tokens of positions\) at dim 0, got 2"),
    ("ratio", wa("ratio", lambda a: 0), r"ratio: expected > 0, got 0"),
    ("block_size", wa("block_size", lambda a: -4), r"block_size: expected > 0 entries per block, got -4"),
    ("out-ndim", wa("out", lambda a: a["out"].flatten()), r"out: expected 2-D \[tokens, blocks x block_size\]",
     ("op",)),
    ("out-dtype", wa("out", lambda a: a["out"].long()), r"out: expected dtype in \[torch.int32\]", ("op",)),
    ("out-tokens", wa("out", lambda a: a["out"][:5]), r"out: expected size 6 \(tokens of positions\)", ("op",)),
    ("out-width", wa("out", lambda a: a["out"][:, :8]),
     r"out: expected size 12 \(3 blocks of block_table x block_size 4\) at dim 1, got 8", ("op",)),
    ("out-last-dim", wa("out", lambda a: a["out"].t().contiguous().t()), r"out: expected a contiguous last dim",
     ("op",)),
    ("positions-negative", wa("positions", lambda a: torch.tensor([5, 6, -7, 0, 1, 0], dtype=I32)),
     r"positions: expected >= 0 \(token positions\), got -7 at index 2", ("public",)),
    ("req_slots-past-table", wa("req_slots", lambda a: torch.tensor([0, 0, 2, 1, 1, -1], dtype=I32)),
     r"req_slots: expected values in \[-1, 2\) \(-1 or one of the 2 requests of block_table\), got 2 at index 2",
     ("public",)),
    ("req_slots-below-padding", wa("req_slots", lambda a: torch.tensor([0, 0, 0, 1, 1, -2], dtype=I32)),
     r"req_slots: expected values in \[-1, 2\) .*, got -2 at index 5", ("public",)),
    ("block_table-below-unallocated", wa("block_table", lambda a: torch.tensor([[0, 1, -1], [2, -3, -1]], dtype=I32)),
     r"block_table: expected values in \[-1, 6\) \(-1 or one of the pool's 6 blocks\), got -3 at flat index 4",
     ("public",)),
    # Issue 32: a block past the pool was accepted (its slots are no entry to sparse_attn).
    ("block_table-past-the-pool", wa("block_table", lambda a: torch.tensor([[0, 1, -1], [2, 6, -1]], dtype=I32)),
     r"block_table: expected values in \[-1, 6\) \(-1 or one of the pool's 6 blocks\), got 6 at flat index 4",
     ("public",)),
    # Issue 52: a token seeing more entries than the table holds got a truncated list (indexer_topk refuses it).
    ("block_table-narrow", wa("positions", lambda a: torch.tensor([5, 6, 12, 0, 1, 0], dtype=I32)),
     r"block_table: expected 4 blocks for the 13 visible entries of request 0 at position 12, got a table 3 blocks "
     r"wide", ("public",)),
]


def test_pool_blocks_must_be_a_count():
    args = ARGS()
    for bad in (-1, 2.0, None):
        with pytest.raises(ValueError, match=rf"pool_blocks: expected an int >= 0 \(the blocks of the pool the table "
                                             rf"indexes\), got {bad!r}"):
            visible_entries(args["block_table"], args["positions"], args["req_slots"], 1, 4, bad)


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_writes_nothing(case):
    _, mutate, match, *via = case
    builders.assert_bad_case("visible_entries", ARGS(), mutate, match, via)


# ---- the Triton kernel under the interpreter, against the reference (helpers: tests/interp.py) -------------
from dsv4ops.visible_entries import triton as visible_entries_tt  # noqa: E402


# (ratio, block size, blocks): V4's HCA key list 2560 entries wide (three column programs; the
# tokens' counts end in each of them, or before them), CSA's ratio over 16-entry blocks, ratio 1
# over 3-entry blocks.
@pytest.mark.parametrize("ratio,block_size,blocks", [(128, 64, 40), (4, 16, 5), (1, 3, 5)])
def test_visible_entries(ratio, block_size, blocks):
    args = random_case(ratio, block_size, blocks)
    # Out-of-range tokens are padding in the kernel too: a request past the table, below -1, and a
    # negative position of a live request.
    args["req_slots"][1], args["req_slots"][2], args["positions"][3] = 4, -2, -5
    wide = torch.full((args["out"].shape[0], args["out"].shape[1] + 3), 2**31 - 1, dtype=torch.int32)
    args["out"] = wide[:, :-3]  # rows with a stride gap, poisoned
    visible_entries_tt.visible_entries(*args.values())
    want = expected_entries(args["block_table"], args["positions"], args["req_slots"], ratio, block_size)
    assert torch.equal(args["out"], want) and (wide[:, -3:] == 2**31 - 1).all()
    assert (want[:4] == -1).all() and (want >= 0).any()
