"""Every Triton launch variant compiled ahead of time for sm_90 and sm_100 (in a subprocess without the
interpreter: no GPU needed), and the programmatic-dependent-launch contract those kernels keep."""

import inspect
import os
import subprocess
import sys

import builders
import pytest
import torch
import triton
from interp import BS, INV_FREQ, new_pool, pool_fmt

from dsv4ops import triton_helpers as th
from dsv4ops.attn_merge import triton as attn_merge_tt
from dsv4ops.compressor import triton as compressor_tt
from dsv4ops.fp8_linear import triton as fp8_linear_tt
from dsv4ops.fp8_linear import triton_w8a8 as w8a8_tt
from dsv4ops.indexer import triton as indexer_tt
from dsv4ops.indexer import triton_prep as indexer_prep_tt
from dsv4ops.inv_rope import triton as inv_rope_tt
from dsv4ops.qkv_prep import triton as qkv_prep_tt
from dsv4ops.quant import formats
from dsv4ops.quant import triton as quant_tt
from dsv4ops.sparse_attn import triton as sparse_attn_tt
from dsv4ops.visible_entries import triton as visible_entries_tt

tl = triton.language


def test_a_pdl_launch_requires_the_wait_first():
    # A kernel launched with programmatic dependent launch may start before the previous kernel of the
    # stream has finished: touching memory before wait_prior_grid() would race with it.
    @triton.jit
    def _no_wait(x_ptr):
        tl.store(x_ptr, 1)

    x = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="must start with wait_prior_grid"):
        th.launch(_no_wait, (1,), (x,), {}, pdl=True)
    assert x.item() == 0
    th.launch(_no_wait, (1,), (x,), {})
    assert x.item() == 1


_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
                 torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


def signature(kernel, args, constexprs):
    """ASTSource signature, constexprs and attributes of one recorded launch: like Triton's runtime
    specialization, 16-byte aligned pointers and ints divisible by 16 (not `do_not_specialize`)
    carry tt.divisibility = 16, so the compiled code is the code the GPU runs."""
    sig, attrs = {}, {}
    values = iter(args)
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            continue
        v = next(values)
        if isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TRITON_TYPES[v.dtype]
            aligned = v.data_ptr() % 16 == 0
        elif isinstance(v, bool):
            sig[p.name], aligned = "i1", False
        elif isinstance(v, int):
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            aligned = v % 16 == 0 and not p.do_not_specialize
        else:
            sig[p.name], aligned = "fp32", False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, dict(constexprs), attrs


def record_launches():
    """Every launch variant the V4 configurations use (bf16 model with FP8 or bf16 pools, fp32 exact
    model with fp32 pools) and V4.1's QAT formats, recorded from the launchers on tiny CPU tensors."""
    launches, seen, recorded = [], set(), []
    t = 3
    pos, req = torch.zeros(t, dtype=torch.int32), torch.zeros(t, dtype=torch.int32)
    for dtype, mode in ((torch.bfloat16, "fp8"), (torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        pool = {"fp8": "fp8", "bf16": torch.bfloat16, "fp32": torch.float32}[mode]
        adt = torch.float32 if mode == "fp8" else dtype
        with th.recording() as rec:
            q, kv = torch.zeros(t, 64, 512, dtype=dtype), torch.zeros(t, 512, dtype=dtype)
            window = new_pool(pool, 512, 4)
            f512, f128 = pool_fmt(window, 512), builders.format_name(pool, 128)
            qkv_prep_tt.qkv_prep(q, kv, pos, req, INV_FREQ, q, window, 8, 1e-6, True, f512)
            for d, ratio, coff in ((512, 4, 2), (512, 128, 1), (128, 4, 2)):
                a = torch.zeros(t, coff * d, dtype=adt)
                compressor_tt.compressor_update(a, a, torch.zeros(ratio, coff * d), pos, req, pos, torch.ones(d),
                                                INV_FREQ, torch.zeros(1, coff * ratio, 2 * coff * d), new_pool(pool, d, 1),
                                                None, 1e-6, f512 if d == 512 else f128)
            qi = torch.zeros(t, 64, 128, dtype=dtype)
            qi_out = torch.zeros(t, 64, 128, dtype=torch.float8_e4m3fn if mode == "fp8" else dtype)
            indexer_prep_tt.indexer_q_prep(qi, qi[..., 0], pos, INV_FREQ, qi_out, torch.zeros(t, 64),
                                      "fp8_132" if mode == "fp8" else "exact")
            for tokens, blocks in ((t, 2), (t, 2100)):  # one chunk per row; rows of several chunks, merged
                indexer_tt.indexer_topk(torch.zeros(tokens, 64, 128, dtype=qi_out.dtype), torch.zeros(tokens, 64),
                                        torch.zeros(tokens, dtype=torch.int32), torch.zeros(tokens, dtype=torch.int32),
                                        new_pool(pool, 128, 2), torch.zeros(1, blocks, dtype=torch.int32), None,
                                        torch.zeros(tokens, 512, dtype=torch.int32), None,
                                        builders.topk_workspace(tokens, blocks * BS, 512), 4, 0, f128)
            idx = torch.zeros(t, 512, dtype=torch.int32)
            lens = torch.full((t,), idx.shape[1], dtype=torch.int32)
            sparse_attn_tt.sparse_attn(q, window, new_pool(pool, 512, 2), pos, req, idx, lens, None, torch.zeros(64), q,
                                       0.04, 8, 8, f512, f512)
            # A context-parallel shard's partial (lse; split like the call above), and the merge.
            sparse_attn_tt.sparse_attn(q, window, new_pool(pool, 512, 2), pos, req, idx, lens, None, torch.zeros(64), q,
                                       0.04, 8, 8, f512, f512, torch.zeros(t, 64))
            attn_merge_tt.attn_merge(torch.zeros(2, t, 64, 512, dtype=dtype), torch.zeros(2, t, 64), torch.zeros(64), q)
            inv_rope_tt.inv_rope(q, pos, INV_FREQ, q)
            for blocks in (8, 128):  # V4-Flash's HCA key lists at 64K and 1M context: 512 and 8192 entries
                visible_entries_tt.visible_entries(torch.zeros(1, blocks, dtype=torch.int32), pos, req,
                                                   torch.zeros(t, blocks * 64, dtype=torch.int32), 128, 64)
            _record_fp8_linear(dtype, 128, t)
            for d in (512, 128):
                rows = torch.zeros(t, d, dtype=dtype)
                quant_tt.pack_kv(rows, pos, new_pool(pool, d, 1), f512 if d == 512 else f128)
                quant_tt.unpack_kv(new_pool(pool, d, 1), pos, rows, f512 if d == 512 else f128)
        recorded.append(rec)
    recorded.append(_record_v41_launches(t, pos, req))
    recorded.append(_record_v4_fp4_launches(t, pos, req))
    for rec in recorded:
        for kernel, args, constexprs, warps in rec:
            sig, consts, attrs = signature(kernel, args, constexprs)
            key = (kernel.__name__, str(sig), str(consts), str(attrs), warps)
            if key not in seen:
                seen.add(key)
                launches.append((kernel, sig, consts, attrs, warps))
    return launches


def _record_fp8_linear(dtype, block: int, t: int) -> None:
    """fp8_linear's variants: decode rows at V4-Flash's kv_proj shape (512 x 4096: split-K and the
    reduce) and at q_b_proj's (32768 x 1024: no split), a 4096-row prefill; UE8M0 and fp32 scales."""
    for m, n, k in ((t, 512, 4096), (t, 32768, 1024), (4096, 256, 512)):
        weight = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        tiles = (-(-n // block), -(-k // block))
        for scale in (torch.empty(tiles, dtype=torch.uint8), torch.empty(tiles)):
            fp8_linear_tt.fp8_linear(torch.empty(m, k, dtype=dtype), weight, scale, torch.empty(m, n, dtype=dtype),
                                     block)
        if block == 128 and k % 128 == 0:  # W8A8's activation quantization, rows padded to 16
            mp = -(-m // 16) * 16
            fp8_linear_tt.act_quant(torch.empty(m, k, dtype=dtype), torch.empty(mp, k, dtype=torch.float8_e4m3fn),
                                    torch.empty(k // 128, mp))
            w8a8_tt.fp8_linear_w8a8(torch.empty(m, k, dtype=dtype), weight, torch.empty(tiles),
                                    torch.empty(m, n, dtype=dtype))


def _record_v41_launches(t, pos, req) -> list:
    """The launch variants of a bf16 V4.1 model with its QAT formats (fp8_528 window, fp4_288
    compressed, mxfp4_68 index keys)."""
    with th.recording() as rec:
        q, kv = torch.zeros(t, 64, 512, dtype=torch.bfloat16), torch.zeros(t, 512, dtype=torch.bfloat16)
        window, comp = builders.page_pool(4, BS, 512, "fp8_528"), builders.page_pool(2, BS, 512, "fp4_288")
        qkv_prep_tt.qkv_prep(q, kv, pos, req, INV_FREQ, q, window, 8, 1e-6, False, "fp8_528")
        for ratio, adt in ((2, torch.float32), (1, torch.bfloat16)):
            a = torch.zeros(t, 512, dtype=adt)
            compressor_tt.compressor_update(a, a, torch.zeros(ratio, 512), pos, req, pos, torch.ones(512), INV_FREQ,
                                            torch.zeros(1, ratio, 1024), comp, torch.zeros(t, 512, dtype=torch.bfloat16),
                                            1e-6, "fp4_288")
        idx = torch.zeros(t, 512, dtype=torch.int32)
        lens = torch.full((t,), idx.shape[1], dtype=torch.int32)
        sparse_attn_tt.sparse_attn(q, window, comp, pos, req, idx, lens, None, torch.zeros(64), q, 0.04, 8, 8,
                                   "fp8_528", "fp4_288")
        qi = torch.zeros(t, 64, 128, dtype=torch.bfloat16)
        q4 = torch.zeros(t, 64, 68, dtype=torch.uint8)
        indexer_prep_tt.indexer_q_prep(qi, qi[..., 0], pos, INV_FREQ, q4, torch.zeros(t, 64), "mxfp4_68")
        keys = builders.page_pool(2, 128, 128, "mxfp4_68")
        indexer_prep_tt.indexer_k_prep(torch.zeros(t, 512, dtype=torch.bfloat16), pos, req, pos, torch.zeros(128, 512),
                                  torch.ones(128), INV_FREQ, keys, 2, 1e-6, "mxfp4_68")
        cb, keep, k = 8, 2048, 512
        for blocks in (2, 8192):  # one chunk; rows of several chunks (entries and blocks), merged
            table = torch.zeros(1, blocks, dtype=torch.int32)
            n = blocks * 128
            idx, cand = torch.zeros(t, k, dtype=torch.int32), torch.zeros(t, keep, dtype=torch.int32)
            indexer_tt.indexer_topk(q4, torch.zeros(t, 64), pos, req, keys, table, None, idx, cand,
                                    builders.topk_workspace(t, n, k, keep=keep, cand_block=cb), 1, cb, "mxfp4_68")
            indexer_tt.indexer_topk(q4, torch.zeros(t, 64), pos, req, keys, table, cand, idx, None,
                                    builders.topk_workspace(t, n, k, cand_cols=keep * cb), 1, cb, "mxfp4_68")
        _record_fp8_linear(torch.bfloat16, 32, t)
        for fmt, bs in (("fp8_528", BS), ("fp4_288", BS), ("mxfp4_68", 7)):
            d = formats.FORMATS[fmt].dim
            rows, pool = torch.zeros(t, d, dtype=torch.bfloat16), builders.page_pool(1, bs, d, fmt)
            quant_tt.pack_kv(rows, pos, pool, fmt)
            quant_tt.unpack_kv(pool, pos, rows, fmt)
    return rec


def _record_v4_fp4_launches(t, pos, req) -> list:
    """A bf16 V4 model with kv_cache="fp4" / indexer_cache="mxfp4": fp4_288 entries (CSA and HCA)
    beside fp8_584 window rows, and the MXFP4 indexer's rotated keys and queries of 64 heads over
    pages of 128 keys."""
    with th.recording() as rec:
        q = torch.zeros(t, 64, 512, dtype=torch.bfloat16)
        window, comp = new_pool("fp8", 512, 4), builders.page_pool(2, BS, 512, "fp4_288")
        for ratio, coff in ((4, 2), (128, 1)):
            a = torch.zeros(t, coff * 512)
            compressor_tt.compressor_update(a, a, torch.zeros(ratio, coff * 512), pos, req, pos, torch.ones(512),
                                            INV_FREQ, torch.zeros(1, coff * ratio, 2 * coff * 512), comp, None, 1e-6,
                                            "fp4_288")
        keys = builders.page_pool(2, 128, 128, "mxfp4_68")
        a = torch.zeros(t, 256)
        compressor_tt.compressor_update(a, a, torch.zeros(4, 256), pos, req, pos, torch.ones(128), INV_FREQ,
                                        torch.zeros(1, 8, 512), keys, None, 1e-6, "mxfp4_68", True)
        qi, q4 = torch.zeros(t, 64, 128, dtype=torch.bfloat16), torch.zeros(t, 64, 68, dtype=torch.uint8)
        indexer_prep_tt.indexer_q_prep(qi, qi[..., 0], pos, INV_FREQ, q4, torch.zeros(t, 64), "mxfp4_68", True)
        idx = torch.zeros(t, 512, dtype=torch.int32)
        # The scoring of 64 heads at ratio 4 is this mode's own variant (the selects are V4's and V4.1's).
        indexer_tt.indexer_topk(q4, torch.zeros(t, 64), pos, req, keys, torch.zeros(1, 2, dtype=torch.int32), None,
                                idx, None, builders.topk_workspace(t, 2 * 128, 512), 4, 0, "mxfp4_68")
        lens = torch.full((t,), idx.shape[1], dtype=torch.int32)
        sparse_attn_tt.sparse_attn(q, window, comp, pos, req, idx, lens, None, torch.zeros(64), q, 0.04, 8, 8,
                                   "fp8_584", "fp4_288")
    return rec


def _aot_compile(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = set()
    for kernel, sig, consts, attrs, warps in record_launches():
        compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        assert compiled.asm["cubin"], kernel.__name__
        if "wait_prior_grid()" in inspect.getsource(kernel.fn):  # a PDL kernel: the wait before any global access
            ptx = compiled.asm["ptx"]
            first_access = min(ptx.find(op) if op in ptx else len(ptx) for op in ("ld.global", "st.global"))
            assert -1 < ptx.find("griddepcontrol.wait") < first_access, kernel.__name__
        names.add(kernel.__name__)
    print(f"sm_{arch}: compiled", " ".join(sorted(names)))


def test_aot_compile_every_kernel_for_sm90_and_sm100():
    # Needs un-interpreted JITFunctions: subprocesses without TRITON_INTERPRET, one per arch, run
    # side by side. ptxas ships with triton (triton/backends/nvidia/bin): no GPU or CUDA toolkit.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["DSV4OPS_TRITON_AOT"] = "1"
    procs = {arch: subprocess.Popen([sys.executable, __file__, str(arch)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env) for arch in (90, 100)}
    expected = {"_qkv_prep_kernel", "_compress_kernel", "_pool_split_kernel", "_finish_kernel", "_save_kernel",
                "_q_prep_kernel", "_k_prep_kernel", "_score_kernel",
                "_block_keys_kernel", "_select_kernel", "_merge_kernel", "_sparse_attn_kernel", "_combine_kernel",
                "_attn_merge_kernel", "_visible_entries_kernel", "_inv_rope_kernel", "_pack_kernel", "_unpack_kernel",
                "_fp8_linear_kernel", "_reduce_kernel", "_act_quant_kernel", "_w8a8_kernel"}
    for arch, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"sm_{arch}: " + stdout[-3000:] + stderr[-6000:]
        assert set(stdout.split("compiled", 1)[1].split()) == expected, stdout


if __name__ == "__main__":
    _aot_compile(int(sys.argv[1]))
