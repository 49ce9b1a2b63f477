"""The ranks' check, on the host, that they make the same call with the same state, before the
collectives whose shapes depend on it: a tensor-parallel forward, a context-parallel step plan, a
manager or layer bound to a group (their model configs).

Each check is one all-gather of an 8-byte digest on a gloo side group of the group's ranks, made
once per group (`bind`, when a layer or manager is built with it: a collective of the group's
ranks). The side group carries dsv4ops' own timeout, `timeout_s`: a rank whose call
the others do not make fails after it, naming its call, where the group's own collective would
wait for the process group's timeout (gloo: 30 minutes, NCCL: 10) and then say only "Timed out".
Gloo closes a side group after a timeout, so every later check of that group fails at once too.
Ranks that disagree exchange their states (only then) and all raise, naming what differs.

Cost: one 8-byte gloo all-gather per check plus a sha256 of the call's state (a config's digest is
computed once per config object); measured on 2 CPU processes in tests/test_parallel_checks.py.
A check runs only in eager code: a compiled or CUDA-graph-captured forward skips it (Dynamo
cannot trace a gloo call on the host, a graph replays no host code)."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math

import torch

# Seconds a rank waits at a check for the other ranks before it raises. 120: the first step of a
# rank may wait for another that is still loading its checkpoint or compiling (minutes at V4-Flash
# sizes) without failing, and a divergent call fails 15x sooner than gloo's default (30 min) and 5x
# sooner than NCCL's (10 min). Set it before the groups are bound; a new value binds a new side group
# at the next check (a collective: set it on every rank).
timeout_s: float = 120.0

_GROUPS: dict[str, object] = {}  # group name -> its ProcessGroup
_SIDE: dict[tuple[str, float], object] = {}  # (group name, timeout) -> its gloo side group
_CONFIGS: dict[int, tuple[object, str, dict]] = {}  # id(config) -> (config, digest, fields)


def timeout() -> float:
    """timeout_s, checked."""
    t = timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"dsv4ops.parallel.agreement.timeout_s: expected a positive number of seconds, got {t!r}")
    return float(t)


def bind(process_group) -> None:
    """Make the group's side group (once per group and timeout; a collective of the group's ranks)."""
    import torch.distributed as dist

    name, t = process_group.group_name, timeout()
    _GROUPS[name] = process_group
    if (name, t) not in _SIDE:
        ranks = dist.get_process_group_ranks(process_group)
        # Local synchronization: only the group's ranks make it (other groups of the job, e.g. the
        # tensor-parallel groups of other data-parallel replicas, make their own at the same time).
        _SIDE[name, t] = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=t),
                                        use_local_synchronization=True)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def config_state(config) -> tuple[str, dict]:
    """(digest, {field: value}) of a model config, computed once per config object."""
    held = _CONFIGS.get(id(config))
    if held is None or held[0] is not config:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)} \
            if dataclasses.is_dataclass(config) else {"config": config}
        held = _CONFIGS[id(config)] = (config, f"{_digest(repr(sorted(fields.items(), key=str))):x}", fields)
    return held[1], held[2]


def check(group, role: str, what: str, state: dict, config=None, hint: str = "") -> None:
    """Raise on every rank of `group` (a dsv4ops.parallel.Group) unless every rank's `state` (and
    model `config`) is the same; on a rank the others do not join within timeout_s, raise there.
    `what` names the call, `role` the group ("tensor-parallel", "context-parallel")."""
    import torch.distributed as dist

    t = timeout()
    if (group.name, t) not in _SIDE:
        bind(_GROUPS[group.name])
    side = _SIDE[group.name, t]
    cfg_digest, fields = config_state(config) if config is not None else ("", {})
    state = {"call": what, **state}
    mine = torch.tensor([_digest(repr(sorted(state.items(), key=str)) + cfg_digest)], dtype=torch.int64)
    got = [torch.zeros_like(mine) for _ in range(group.size)]
    try:
        dist.all_gather(got, mine, group=side)
    except RuntimeError as e:
        if "Timed out" in str(e):  # gloo's words for its own timeout; a closed group says "closed" / "closure"
            raise RuntimeError(f"{what}: rank {group.rank} of the {role} group waited {t:g} s "
                               f"(dsv4ops.parallel.agreement.timeout_s) for the other ranks' {what}, and not all came: "
                               f"a rank made a call the others did not (or is stuck before it); nothing was changed. "
                               f"This group's checks are closed now: destroy the process group and start again") from e
        raise RuntimeError(f"{what}: rank {group.rank} could not check that the {role} group's ranks agree: the check's "
                           f"group is closed (a rank timed out at an earlier check, a call the others did not make, or "
                           f"exited) ({e}); nothing was changed. Destroy the process group and start again") from e
    digests = [int(x) for x in got]
    if len(set(digests)) == 1:
        return
    full = {**{k: repr(v) for k, v in state.items()}, **{k: repr(v) for k, v in fields.items()}}
    every = [None] * group.size
    dist.all_gather_object(every, full, group=side)
    keys = dict.fromkeys(k for e in every for k in e)  # another call may carry other keys
    differ = [k for k in keys if len({repr(e.get(k)) for e in every}) > 1]
    shown = "; ".join(f"{k}: " + ", ".join(f"rank {r} {e.get(k)}" for r, e in enumerate(every)) for k in differ)
    agree = [r for r, d in enumerate(digests) if d == digests[group.rank]]
    raise RuntimeError(f"{what}: the ranks of the {role} group disagree ({shown}); ranks {agree} agree with rank "
                       f"{group.rank}, of {group.size}{hint}; nothing was changed")
