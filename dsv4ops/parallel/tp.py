"""Tensor parallelism of an attention layer: which parameters are split over the ranks, and how a
full (unsharded) state dict is cut down to one rank's share.

Rank r of W holds query heads [r H/W, (r + 1) H/W) and output groups [r G/W, (r + 1) G/W): its heads
are exactly its groups' heads (group g = heads g H/G .. (g + 1) H/G - 1, contiguous), so a rank runs
attention, inverse RoPE and o_a on its own heads and o_b on its own groups' columns, and the ranks'
o_b outputs add up to the layer's output (one all-reduce). q_b_proj is split by rows (column
parallel), o_a_proj by groups, o_b_proj by columns (row parallel), the sinks by heads; everything
else (q_a_proj, kv_proj, the norms, the compressors, the whole indexer) is replicated: every rank
computes all index heads and the same top-k (vLLM's and SGLang's split).
"""

from __future__ import annotations

from torch import Tensor

from dsv4ops.parallel import Group, agreement

# Parameter (under the layer's prefix) -> (dim it is split along, what is split: "heads" or
# "groups"). The `weight_scale_inv` tile scales of a block-FP8 projection follow its weight.
SPLIT = {
    "q_b_proj.weight": (0, "heads"),
    "q_b_proj.weight_scale_inv": (0, "heads"),
    "o_a_proj.weight": (0, "groups"),
    "o_a_proj.weight_scale_inv": (0, "groups"),
    "o_b_proj.weight": (1, "groups"),
    "o_b_proj.weight_scale_inv": (1, "groups"),
    "sinks": (0, "heads"),
}


def agree(layer, what: str, state: dict) -> None:
    """Raise on every rank of the layer's tensor-parallel group (`layer.tp_group`; none: nothing)
    unless every rank makes this call (`what`, `state`) with the same model config, and on a rank
    the others do not join within dsv4ops.parallel.agreement.timeout_s. Eager code only (the
    layers' eager checks call it): a compiled forward does not check (dsv4ops.parallel.agreement)."""
    if layer.tp_group is not None:
        agreement.check(layer.tp_group, "tensor-parallel", what, state, layer.config,
                        "; every rank must build the same layers and run the same forwards on inputs of the same shape")


def check_divides(group: Group | None, heads: int, groups: int, who: str) -> None:
    """Raise unless the group's size divides the query heads and the output groups."""
    if group is None:
        return
    for n, what in ((heads, "num_heads"), (groups, "o_groups")):
        if n % group.size:
            raise ValueError(f"process_group: {who} splits its {what} ({n}) over the group's {group.size} ranks; "
                             f"expected a group size that divides {n}")


def shard_(state_dict: dict, prefix: str, group: Group | None, full: dict[str, tuple[int, ...]], who: str,
           cut: bool = True) -> None:
    """Replace, in `state_dict`, every split parameter under `prefix` by this rank's share (a copy
    of the slice, so the full tensor can be freed; cut=False: check only). `full` gives each split
    parameter's full shape (the model's, for the layer's dims); a tensor of another shape raises:
    a tensor-parallel shard given to a layer without a process group ("load the full checkpoint,
    or build the layer with a process group"), or, with a group, anything but the full tensor
    (each rank cuts its own share of the full tensor; a shard cannot say which rank's it is). The
    layers call it from `_load_from_state_dict` (on the copy load_state_dict hands down), so any
    module holding them loads full checkpoints."""
    size = 1 if group is None else group.size
    for name, (dim, _) in SPLIT.items():
        key = prefix + name
        if key not in state_dict or name not in full or not isinstance(state_dict[key], Tensor):
            continue
        t, want = state_dict[key], full[name]
        got = tuple(t.shape)
        if got == want:
            if size > 1 and cut:
                n = want[dim] // size
                state_dict[key] = t.narrow(dim, group.rank * n, n).clone()
            continue
        if len(got) == len(want) and got[dim] and want[dim] % got[dim] == 0 and \
                got[:dim] + got[dim + 1:] == want[:dim] + want[dim + 1:]:
            k = want[dim] // got[dim]
            if size == 1:
                raise ValueError(f"state_dict: {key} has shape {list(got)}, 1/{k} of the full {list(want)} along dim "
                                 f"{dim}: a tensor-parallel shard, but {who} has no process_group (it holds every "
                                 f"head); load the full checkpoint, or build the layer with the process_group of "
                                 f"{k} ranks")
            raise ValueError(f"state_dict: {key} has shape {list(got)}, 1/{k} of the full {list(want)} along dim {dim}; "
                             f"{who} (rank {group.rank} of {size}) cuts its share out of the full tensor: load the "
                             f"full checkpoint on every rank")
        if size > 1:  # without a group, torch's own "size mismatch" names the key among the load's errors
            raise ValueError(f"state_dict: {key} has shape {list(got)}, expected the full {list(want)} (every "
                             f"rank cuts its share, 1/{size} along dim {dim})")


def scale_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """Tile-scale shape of a block-FP8 weight of `shape`."""
    return tuple(-(-s // block) for s in shape)


def check_fp8_split(name: str, shape: tuple[int, ...], dim: int, group: Group, block: int) -> None:
    """A block-FP8 weight kept in e4m3 splits along whole tiles only."""
    if shape[dim] % (group.size * block):
        raise ValueError(f"keep_fp8: {name} [{', '.join(map(str, shape))}] splits over {group.size} ranks along dim "
                         f"{dim} into {shape[dim] // group.size}, not a multiple of its {block} x {block} scale tiles; "
                         f"load it dequantized (keep_fp8=False)")


def full_shapes(cfg, blocks: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """The full shapes of the split parameters of a layer of `cfg` (a V4 or V4.1 attention config);
    `blocks` {projection: tile} names the projections kept block-FP8 (their tile scales split too)."""
    h, g, d = cfg.num_heads, cfg.o_groups, cfg.head_dim
    shapes = {"q_b_proj.weight": (h * d, cfg.q_lora_rank), "o_a_proj.weight": (g * cfg.o_lora_rank, h * d // g),
              "o_b_proj.weight": (cfg.hidden_size, g * cfg.o_lora_rank), "sinks": (h,)}
    for name, block in blocks.items():
        shapes[name + ".weight_scale_inv"] = scale_shape(shapes[name + ".weight"], block)
    return shapes
