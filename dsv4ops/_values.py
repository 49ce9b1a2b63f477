"""Value checks of the public functions, run on the host in eager mode only (the metadata rules are
`torch._check`s in `_checks.py`, run by the ops and their fakes). Each check costs a host sync, so
none runs while compiling or on tensors without data (FakeTensor, meta). Errors are ValueError
naming the argument, the expectation and what came."""

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor


def has_data(*tensors: Tensor) -> bool:
    """True when the values can be read: eager mode and real tensors."""
    if torch.compiler.is_compiling():
        return False
    return not any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors)


def in_range(name: str, t: Tensor, low: int, high: int | None, what: str):
    """Every value v of t satisfies low <= v < high (high None: no upper bound)."""
    bad = t < low if high is None else (t < low) | (t >= high)
    if t.numel() and bool(bad.any()):
        at = bad.flatten().nonzero()[0, 0].item()
        expect = f">= {low}" if high is None else f"values in [{low}, {high})"
        where = f" at index {at}" if t.dim() == 1 else f" at flat index {at}"
        raise ValueError(f"{name}: expected {expect} ({what}), got {t.flatten()[at].item()}{where}")


def finite(name: str, t: Tensor, what: str):
    """Every value of t is finite (no NaN, no inf)."""
    bad = ~torch.isfinite(t)
    if t.numel() and bool(bad.any()):
        at = bad.nonzero()[0].tolist()
        raise ValueError(f"{name}: expected finite values ({what}), got {t[tuple(at)].item()} at index "
                         f"{at[0] if len(at) == 1 else tuple(at)}")


def distinct(name: str, t: Tensor, what: str):
    """The values >= 0 of a 1-D tensor are pairwise distinct (-1 may repeat)."""
    v = t[t >= 0]
    uniq, counts = torch.unique(v, return_counts=True)
    if bool((counts > 1).any()):
        dup = uniq[counts > 1][0].item()
        raise ValueError(f"{name}: expected distinct {what}, got {dup} ({counts[counts > 1][0].item()} times)")


def closing_slots(entry_slots: Tensor, positions: Tensor, req_slots: Tensor, ratio: int, block_size: int):
    """The entry slots of a compressor step: distinct among the live tokens that close an entry
    ((p + 1) % ratio == 0), each at the offset of its entry w = p // ratio in a block of the paged
    pool (w % block_size: where the readers' block tables find it), and -1 for every other live
    token. Slots planned for another ratio fail one of the two: ratio 2's slots at ratio 4 sit on
    tokens that close nothing; ratio 4's at 2 or 1 sit on closing tokens whose entry is another
    (p = 3: entry 0 at ratio 4, 1 at ratio 2, 3 at ratio 1), stored at the wrong rotation. The
    offset cannot tell them apart where the entries agree modulo block_size (p = 4 x block_size - 1)."""
    live = req_slots >= 0
    closes = live & ((positions.long() + 1) % ratio == 0)
    distinct("entry_slots", entry_slots[closes], "slots among the tokens that close an entry")
    stray = live & ~closes & (entry_slots != -1)
    if bool(stray.any()):
        i = stray.nonzero()[0, 0].item()
        raise ValueError(f"entry_slots: expected -1 for the tokens that close no entry at ratio {ratio} ((position + "
                         f"1) % {ratio} != 0), got {entry_slots[i].item()} at index {i} (position "
                         f"{positions[i].item()}); were the slots planned for another ratio?")
    entry = positions.long() // ratio
    astray = closes & (entry_slots >= 0) & (entry_slots.long() % block_size != entry % block_size)
    if bool(astray.any()):
        i = astray.nonzero()[0, 0].item()
        slot = entry_slots[i].item()
        raise ValueError(f"entry_slots: expected a slot at offset {entry[i].item() % block_size} of its "
                         f"{block_size}-entry block (entry {entry[i].item()}, closed by position {positions[i].item()} "
                         f"at ratio {ratio}), got {slot} (offset {slot % block_size}) at index {i}; were the slots "
                         f"planned for another ratio?")


def request_runs(positions: Tensor, req_slots: Tensor):
    """The tokens of each request form one contiguous run of the flat batch (padding tokens, request
    -1, end a run) with consecutive positions: the compressor pools a block's rows from the step
    itself by token offset."""
    req, pos = req_slots.long(), positions.long()
    live = req >= 0
    cont = live[1:] & (req[1:] == req[:-1])
    gap = cont & (pos[1:] != pos[:-1] + 1)
    if bool(gap.any()):
        i = gap.nonzero()[0, 0].item() + 1
        raise ValueError(f"positions: expected consecutive positions within a request, got {pos[i - 1].item()} then "
                         f"{pos[i].item()} for request {req[i].item()} at tokens {i - 1}, {i}")
    starts = live.clone()
    starts[1:] &= ~cont
    run_req = req[starts]
    uniq, counts = torch.unique(run_req, return_counts=True)
    if bool((counts > 1).any()):
        r = uniq[counts > 1][0].item()
        raise ValueError(f"req_slots: expected the tokens of a request to be contiguous in the step, got request {r} "
                         f"in {counts[counts > 1][0].item()} separate runs")


def request_span(positions: Tensor, req_slots: Tensor, limit: int, what: str):
    """For each request, max position - min position + 1 over its tokens of the step is <= limit."""
    live = req_slots >= 0
    if not bool(live.any()):
        return
    req, pos = req_slots[live].long(), positions[live].long()
    n = int(req.max()) + 1
    hi = torch.full((n,), -1, dtype=torch.long, device=req.device).scatter_reduce(0, req, pos, "amax")
    lo = torch.full((n,), 2**62, dtype=torch.long, device=req.device).scatter_reduce(0, req, pos, "amin")
    span = (hi - lo + 1).where(hi >= 0, 0)
    if bool((span > limit).any()):
        r = (span > limit).nonzero()[0, 0].item()
        raise ValueError(f"positions: expected the tokens of a request to span at most {limit} positions ({what}), "
                         f"got {span[r].item()} for request {r} (positions {lo[r].item()}..{hi[r].item()})")


def window_ends(positions: Tensor, req_slots: Tensor, ends: Tensor):
    """For each live token, its position <= ends <= the last position of its request among the
    tokens (the window never reaches a row the call has not written)."""
    live = req_slots >= 0
    if not bool(live.any()):
        return
    req, pos, end = req_slots[live].long(), positions[live].long(), ends[live].long()
    hi = torch.full((int(req.max()) + 1,), -1, dtype=torch.long, device=req.device).scatter_reduce(0, req, pos, "amax")
    bad = (end < pos) | (end > hi[req])
    if bool(bad.any()):
        i = bad.nonzero()[0, 0].item()
        at = live.nonzero()[i, 0].item()
        raise ValueError(f"window_ends: expected values from the token's position to the last position of its request "
                         f"({pos[i].item()}..{hi[req[i]].item()} for request {req[i].item()}), got {end[i].item()} at "
                         f"index {at}")


def table_width(positions: Tensor, req_slots: Tensor, block_table: Tensor, block_size: int, ratio: int) -> Tensor:
    """Every live token's visible entries (w < (p + 1) // ratio) fit in the block table's width (the
    kernels clamp a wider list to the table: a silent truncation); returns the blocks each live
    token needs."""
    live = req_slots >= 0
    pos, req = positions[live].long(), req_slots[live].long()
    need = -(-((pos + 1) // ratio) // block_size)
    width = block_table.shape[1]
    if bool((need > width).any()):
        i = (need > width).nonzero()[0, 0].item()
        raise ValueError(f"block_table: expected {need[i].item()} blocks for the {(pos[i].item() + 1) // ratio} "
                         f"visible entries of request {req[i].item()} at position {pos[i].item()}, got a table "
                         f"{width} blocks wide")
    return need
