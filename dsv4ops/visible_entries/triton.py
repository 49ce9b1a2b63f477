"""Triton kernel of `dsv4::visible_entries` (visible_entries/reference.py is the specification): the
HCA key list in one launch. Grid (tokens, blocks of COLS columns): a program whose columns all lie
past its token's visible count stores -1 without reading the table; the others read the table
entries of their visible columns only. Stores are whole contiguous rows (coalesced)."""

import triton
import triton.language as tl

from dsv4ops.triton_helpers import launch, wait_prior_grid
from dsv4ops.visible_entries import checks as _checks

# Columns per program: a V4-Flash key list is max_context / 128 entries wide (512 at 64K, 8192 at
# 1M), so a decode token takes 1-8 programs of at most 4 KiB of stores each.
MAX_COLS = 1024


# The table's row count is not specialized on: warmup runs on a one-request table (n_requests == 1
# would compile another variant than a serving cache's).
@triton.jit(do_not_specialize=["n_requests"])
def _visible_entries_kernel(table_ptr, pos_ptr, req_ptr, out_ptr, s_tab_r, s_tab_b, s_out, n_requests, n_cols, ratio,
                            BS: tl.constexpr, COLS: tl.constexpr):
    wait_prior_grid()
    t = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * COLS
    cols = start + tl.arange(0, COLS)
    in_row = cols < n_cols
    pos = tl.load(pos_ptr + t)
    req = tl.load(req_ptr + t)
    live = (req >= 0) & (req < n_requests) & (pos >= 0)
    # (pos + 1) // ratio, capped at n_cols + 1: no int32 overflow at the largest position.
    count = tl.where(live, tl.minimum(pos // ratio, n_cols) + (pos % ratio == ratio - 1).to(tl.int32), 0)
    dst = out_ptr + t * s_out + cols
    if start < count:
        visible = in_row & (cols < count)
        blk = tl.load(table_ptr + req.to(tl.int64) * s_tab_r + (cols // BS) * s_tab_b, mask=visible, other=-1)
        tl.store(dst, tl.where(blk >= 0, blk * BS + cols % BS, -1), mask=in_row)
    else:
        tl.store(dst, tl.full([COLS], -1, tl.int32), mask=in_row)


def visible_entries(block_table, positions, req_slots, out, ratio, block_size) -> None:
    """Launcher of `dsv4::visible_entries` (same arguments)."""
    _checks.visible_entries(block_table, positions, req_slots, out, ratio, block_size)
    t, n_cols = out.shape
    if t == 0 or n_cols == 0:
        return
    cols = min(MAX_COLS, triton.next_power_of_2(n_cols))
    launch(_visible_entries_kernel, (t, triton.cdiv(n_cols, cols)),
           (block_table, positions, req_slots, out, block_table.stride(0), block_table.stride(1), out.stride(0),
            block_table.shape[0], n_cols, ratio),
           dict(BS=block_size, COLS=cols), pdl=True)
