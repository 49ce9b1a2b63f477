"""GPU (sm_90): the radix top-k selects of csrc/indexer/ (launcher dsv4ops/indexer/cuda.py: the grid
select of rows longer than a 4096-key tile, with one CTA a tile, two CTAs of several tiles, or one
CTA walking the row; the one-CTA-a-chunk tree) and the Triton select they replace there, on keys
written straight into the workspace, against an independent formulation (a stable sort by key, then
by column). Key sets built to stress a radix select: every key distinct, few distinct values (ties
across the k-th), keys differing only in their lowest byte, the top key 0xffffffff, most keys 0 (no
entry), the k-th key tied within a small bin, the k-th key's bin taken whole (with a key at the
bin's lowest value), rows shorter than k, padding tokens; one chunk, chunks with one merge, and
small chunks forcing two merge levels; grid rows of 1 to 64 tiles (and rows of one live tile in a
wider launch), a launch of as many tiles as the GPU holds at once, CUDA-graph replays with new row
lengths, and the grid's largest k (its candidate list serves the spread kinds and rank-ties, its
global levels the bunched ones: few-values, low-byte). Outputs poisoned before each call."""

import pytest
import torch

from dsv4ops import csrc
from dsv4ops.indexer import cuda as indexer_cuda
from dsv4ops.indexer import triton as indexer_tt
from dsv4ops.indexer import workspace as ws

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU (the arch table's csrc select)")]

DEV = "cuda"


def _grid(ctas):
    """indexer_cuda.select with the grid select's CTAs a token fixed ("fit": one a 4096-key tile, as
    many as 2 an SM hold over the launch, each then holding one tile or more; a number: that many,
    capped at the tiles) instead of the launcher's `grid_ctas`; rows of one tile still take the tree."""
    def run(*args):
        launcher = indexer_cuda.grid_ctas

        def fixed(tokens, n_row, device):
            tiles = -(-n_row // ws.GRID_TILE)
            fit = 2 * torch.cuda.get_device_properties(device).multi_processor_count // tokens
            return max(1, min(tiles, fit if ctas == "fit" else ctas))
        indexer_cuda.grid_ctas = fixed
        try:
            indexer_cuda.select(*args)
        finally:
            indexer_cuda.grid_ctas = launcher
    return run


# "csrc": the launcher's choice
SELECTS = {"csrc": indexer_cuda.select, "csrc-grid": _grid("fit"), "csrc-grid-2": _grid(2), "csrc-grid-1": _grid(1),
           "csrc-tree": indexer_cuda.select_tree, "triton": indexer_tt.select_tree}


def _keys(kind: str, t: int, n: int, g: torch.Generator) -> torch.Tensor:
    """int64 [t, n] of uint32 key values (0 = no entry)."""
    def rand(lo, hi):
        return torch.randint(lo, hi, (t, n), device=DEV, generator=g)
    if kind == "distinct":
        return torch.stack([torch.randperm(n, device=DEV, generator=g) for _ in range(t)]) * 4099 % (1 << 32) + 1
    if kind == "few-values":
        return torch.tensor([0, 0x80000000, 0x80000000, 0xC0400000, 0xC0800000], device=DEV)[rand(0, 5)]
    if kind == "low-byte":
        return 0x80000000 + rand(0, 256)
    if kind == "top-key":
        return torch.where(rand(0, 8) == 0, 0xFFFFFFFF, rand(1, 1 << 32))
    if kind == "sparse":
        return torch.where(rand(0, 64) == 0, rand(1, 1 << 32), 0)
    if kind == "rank-ties":
        # 500 keys in 100 high bins; in one lower bin 5 keys, then 20 equal keys (the 512th largest
        # is the 12th of the bin: 7 of the 20 are taken), then 5; the rest low
        m = min(530, n)
        j = torch.arange(m, device=DEV)
        planted = torch.where(j < 500, (2047 - j % 100) << 21 | j,
                              torch.where(j < 505, 1900 << 21 | (200 + j), torch.where(j < 525, 1900 << 21 | 77,
                                                                                       1900 << 21 | (j - 520))))
        planted = planted.expand(t, -1)
        cols = torch.argsort(torch.rand(t, n, device=DEV, generator=g), dim=1)[:, :m]
        return rand(1, 1 << 30).scatter(1, cols, planted)
    if kind == "whole-bin":
        # 500 keys in 100 high bins of the top 11 bits, then one bin of exactly 12 keys, one of them
        # its lowest value (low 21 bits zero): at k = 512 that bin is taken whole; the rest lower
        m = min(512, n)
        j = torch.arange(m, device=DEV)
        planted = torch.where(j < 500, (2047 - j % 100) << 21 | (j + 1), 1900 << 21 | torch.where(j == 500, 0, j))
        cols = torch.argsort(torch.rand(t, n, device=DEV, generator=g), dim=1)[:, :m]
        return rand(1, 1 << 30).scatter(1, cols, planted.expand(t, -1))
    raise KeyError(kind)


def _expected(keys: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.full((keys.shape[0], k), -1, dtype=torch.int32, device=DEV)
    for i in range(keys.shape[0]):
        row = keys[i, :lens[i]]
        cols = (row != 0).nonzero().flatten()
        order = torch.argsort(-row[cols], stable=True)  # descending key; equal keys keep column order
        best = cols[order[:k]].sort().values
        out[i, :best.numel()] = best.to(torch.int32)
    return out


def _run(select, keys: torch.Tensor, lens: torch.Tensor, k: int) -> torch.Tensor:
    """The select as indexer_topk launches it for V4.1's candidate blocks (output = column, one block
    per entry, ratio 1), over a row of keys.shape[1] columns; lens 0 = a padding token."""
    t, n = keys.shape
    row_words = ws.layout(n, k)[3]
    work = torch.full((t * row_words,), 0x5A5A5A5A, dtype=torch.int32, device=DEV)
    work.view(t, row_words)[:, :n] = (keys - (keys >> 31 << 32)).to(torch.int32)  # the same 32 bits, signed
    pos = (lens - 1).clamp(min=0).to(torch.int32)
    req = torch.where(lens > 0, 0, -1).to(torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    out = torch.full((t, k), 12345, dtype=torch.int32, device=DEV)
    common = (pos, req, table, table, out, work, 0, table.stride(0), 0, 0, 1, out.stride(0), n, 1, 1, row_words)
    select(t, n, k, 0, common, 2, 1)
    return out


@pytest.mark.parametrize("select", sorted(SELECTS))
@pytest.mark.parametrize("kind", ["distinct", "few-values", "low-byte", "top-key", "sparse", "rank-ties", "whole-bin"])
@pytest.mark.parametrize("n,k", [(300, 512), (1000, 64), (5000, 512), (40000, 512), (70000, 1024), (20000, 8192),
                                 (262144, 512)],
                         ids=["shorter-than-k", "one-chunk", "one-chunk-5000", "merge", "merge-top1024", "grid-max-k",
                              "1m-positions"])
def test_select_equals_a_stable_sort(select, kind, n, k):
    csrc.load()
    g = torch.Generator(device=DEV).manual_seed(n + k)
    t = 7
    keys = _keys(kind, t, n, g)
    # A row of one live tile in a wider launch selects in shared memory (3000 > k keys, 511, 1, 0);
    # n // 2 leaves half the grid's CTAs idle. Last: a padding token.
    lens = torch.tensor([n, n - 1, n // 2, min(3000, n), min(k, n) - 1, 1, 0], device=DEV)
    got = _run(SELECTS[select], keys, lens, k)
    assert torch.equal(got, _expected(keys, lens, k))


@pytest.mark.parametrize("select", sorted(SELECTS))
def test_two_merge_levels(select, monkeypatch):
    # 1024-key chunks and merge groups of 4 lists: 16384 columns -> 16 lists -> 4 -> 1.
    csrc.load()
    monkeypatch.setattr(ws, "CHUNK", 1024)
    monkeypatch.setattr(ws, "MERGE_BLOCK", 2048)
    n, k = 16384, 512
    assert len(ws.merge_levels(n, k)) == 2
    g = torch.Generator(device=DEV).manual_seed(7)
    keys = torch.cat([_keys("few-values", 2, n, g), _keys("distinct", 2, n, g)])
    lens = torch.tensor([n, 9000, n, 3000], device=DEV)
    assert torch.equal(_run(SELECTS[select], keys, lens, k), _expected(keys, lens, k))


@pytest.mark.parametrize("select", ["csrc-grid", "csrc-grid-2", "csrc-tree"])
def test_csrc_select_is_bitwise_deterministic(select):
    csrc.load()
    g = torch.Generator(device=DEV).manual_seed(3)
    n, k = 1 << 18, 512
    keys = _keys("few-values", 2, n, g)
    lens = torch.tensor([n, n // 3], device=DEV)
    first = _run(SELECTS[select], keys, lens, k)
    for _ in range(3):
        assert torch.equal(_run(SELECTS[select], keys, lens, k), first)


def test_grid_select_over_a_full_gpu():
    # As many tiles as CTAs fit at once (2 an SM, the kernel's launch bounds): every CTA waits at the
    # token barriers and look-backs while all others run. One token more is refused with an error.
    csrc.load()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, k = 16384, 512
    t = 2 * sms // 4
    g = torch.Generator(device=DEV).manual_seed(5)
    keys = torch.cat([_keys("few-values", t // 2, n, g), _keys("distinct", t - t // 2, n, g)])
    lens = torch.randint(3 * n // 4 + 1, n + 1, (t,), device=DEV, generator=g)  # every tile live
    assert torch.equal(_run(_grid(4), keys, lens, k), _expected(keys, lens, k))
    with pytest.raises(RuntimeError, match=r"exceed the \d+ resident CTAs"):
        _run(_grid(4), torch.cat([keys, keys[:1]]), torch.cat([lens, lens[:1]]), k)


@pytest.mark.parametrize("ctas", [0, 5])
def test_grid_select_refuses_ctas_outside_its_tiles_and_keeps_its_buffers(ctas):
    # 16384 columns are 4 tiles: 0 or 5 CTAs a token is refused before anything is written.
    csrc.load()
    t, n, k = 2, 16384, 512
    row_words = ws.layout(n, k)[3]
    work = torch.full((t * row_words,), 0x5A5A5A5A, dtype=torch.int32, device=DEV)
    out = torch.full((t, k), 12345, dtype=torch.int32, device=DEV)
    pos = torch.full((t,), n - 1, dtype=torch.int32, device=DEV)
    req = torch.zeros(t, dtype=torch.int32, device=DEV)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match=r"ctas: expected 1 \.\. 4 CTAs a token"):
        torch.ops.dsv4_csrc.topk_grid(pos, req, table, table, out, work, 0, t, row_words, 0, n, ctas, False, n, 1, 1,
                                      1, 2)
    torch.cuda.synchronize()
    assert (work == 0x5A5A5A5A).all() and (out == 12345).all()


@pytest.mark.parametrize("ctas", ["fit", 2])
def test_grid_select_replays_in_a_cuda_graph(ctas):
    # The state words are zeroed by a memset node of each replay: new keys and row lengths (one live
    # tile, all ten, a padding token), the same graph, exact rows.
    csrc.load()
    g = torch.Generator(device=DEV).manual_seed(9)
    t, n, k = 3, 40000, 512
    row_words = ws.layout(n, k)[3]
    work = torch.zeros(t * row_words, dtype=torch.int32, device=DEV)
    lens = torch.tensor([n, 30000, 0], device=DEV)
    pos = (lens - 1).clamp(min=0).to(torch.int32)
    req = torch.where(lens > 0, 0, -1).to(torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    out = torch.full((t, k), 12345, dtype=torch.int32, device=DEV)
    common = (pos, req, table, table, out, work, 0, table.stride(0), 0, 0, 1, out.stride(0), n, 1, 1, row_words)
    _grid(ctas)(t, n, k, 0, common, 2, 1)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _grid(ctas)(t, n, k, 0, common, 2, 1)
    for kind, new_lens in [("distinct", [n, 30000, 0]), ("few-values", [3000, 0, n]), ("top-key", [0, n - 1, 4097])]:
        keys = _keys(kind, t, n, g)
        work.view(t, row_words)[:, :n] = (keys - (keys >> 31 << 32)).to(torch.int32)
        lens.copy_(torch.tensor(new_lens))
        pos.copy_((lens - 1).clamp(min=0))
        req.copy_(torch.where(lens > 0, 0, -1))
        out.fill_(12345)
        graph.replay()
        assert torch.equal(out, _expected(keys, lens, k)), kind


@pytest.mark.parametrize("select", sorted(SELECTS))
def test_prefill_sized_launch(select):
    # 600 tokens: enough CTAs that the csrc launch takes its throughput shape (16 keys a thread)
    csrc.load()
    g = torch.Generator(device=DEV).manual_seed(11)
    n, k = 3000, 512
    keys = torch.cat([_keys("few-values", 300, n, g), _keys("top-key", 300, n, g)])
    lens = torch.randint(0, n + 1, (600,), device=DEV, generator=g)
    assert torch.equal(_run(SELECTS[select], keys, lens, k), _expected(keys, lens, k))
