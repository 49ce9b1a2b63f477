"""Fused decode gate (dsv4::router_gate for <= 64 tokens) in CuTe DSL: the arch-independent part.

One launch, two phases, on a grid of (experts / 64) x `splits` CTAs (<= the SM count, so all are
resident; launched cooperatively, which also makes the launch fail rather than hang otherwise):
  1. CTA (n, s) multiplies the 64-row token tile (TMA zero-fills rows >= tokens) by expert rows
     [64n, 64n + 64) over its hidden slice [s * K_cta, (s + 1) * K_cta) with the arch's MMA
     (cute_sm90: WGMMA, cute_sm100: tcgen05) and stores the fp32 partial of the live rows into
     ws[s, token, expert].
  2. After a grid barrier, CTA c finishes tokens c, c + grid, ...: logits = sum over s of ws in
     order (deterministic), written out; scores and keys into shared memory; warp 0 picks the top k
     with the same rounds as csrc/router/gate_topk.cu (lowest expert on exact ties).
Splitting hidden (not tokens) is what spreads the weight read, the whole cost at decode (2 MB for
Flash, 5.5 MB for Pro in bf16), over the SMs. The grid barrier counters live in a per-device int32
buffer that the last CTA resets, so CUDA-graph replays find it zeroed; concurrent router_gate calls
on two streams of one device would share it and are not supported.
"""

import math

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

BN = 64  # experts per CTA
BK = 64  # hidden per stage: 128 B of bf16, one 128-B swizzle row
THREADS = 128  # one warpgroup
MAX_TOKENS = 64  # the token tile (the MMA's M) is 64 on sm_90 and 128 on sm_100

_CUTLASS_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}


def plan(hidden: int, experts: int, num_sms: int) -> tuple[int, int]:
    """(k_tiles per CTA, splits): the fewest hidden tiles per CTA that keep the grid within the SMs.
    Flash (4096, 256) on 132 SMs: 2 tiles, 32 splits, 128 CTAs; Pro (7168, 384): 7, 16, 96 CTAs."""
    k_tiles, n_tiles = hidden // BK, experts // BN
    for per_cta in range(1, k_tiles + 1):
        if k_tiles % per_cta == 0 and n_tiles * (k_tiles // per_cta) <= num_sms:
            return per_cta, k_tiles // per_cta
    raise ValueError(f"experts: {experts} experts need more than the {num_sms} SMs for one CTA each")


@cute.jit
def order_key(x: Float32) -> Uint32:
    """uint32 with the float order, NaN above +inf (torch.sort); 0 is no float's key."""
    bits = x.bitcast(Uint32)
    key = bits | Uint32(0x80000000)
    if bits & Uint32(0x80000000):
        key = bits ^ Uint32(0xFFFFFFFF)
    if x != x:
        key = Uint32(0xFFFFFFFF)
    return key


@cute.jit
def sqrt_softplus(x: Float32) -> Float32:
    """torch's fp32 softplus (passes x through above threshold 20), then sqrt."""
    sp = x
    if x <= Float32(20.0):
        sp = cute.math.log1p(cute.math.exp(x))
    return cute.math.sqrt(sp)


class RouterGateKernel:
    """Shared host setup, grid barrier and top-k epilogue. Subclasses supply `arch`, `setup` (tiled MMA
    and staged shared layouts), `make_tma_atoms` and `mainloop` (which stores the partials)."""

    arch = ""

    def __init__(self, dtype, hidden: int, experts: int, top_k: int, k_tiles_per_cta: int, splits: int):
        if experts % BN or experts % 32 or hidden % BK or not 1 <= top_k <= 32:
            raise ValueError(f"unsupported router shape: hidden {hidden}, experts {experts}, top_k {top_k}")
        self.dtype = dtype
        self.hidden, self.experts, self.top_k = hidden, experts, top_k
        self.kt, self.splits = k_tiles_per_cta, splits
        self.n_tiles = experts // BN
        self.grid_size = self.n_tiles * splits
        self.items = experts // 32  # keys per lane in the top-k warp

    # ---- host --------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mBias: cute.Tensor,
        mLogits: cute.Tensor,
        mWeights: cute.Tensor,
        mIndices: cute.Tensor,
        mWs: cute.Tensor,
        mSync: cute.Tensor,
        scale: Float32,
        stream,
    ):
        self.setup()
        tma_x, mX_tma, tma_w, mW_tma = self.make_tma_atoms(mX, mW)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[Int64, self.kt * 2 + 2]  # a full/empty pair per stage + accumulator
            tmem_address: Int32  # sm_100 only: where the accumulator columns were allocated
            sX: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.x_smem_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.w_smem_layout)], 1024]
            sScore: cute.struct.MemRange[Float32, self.experts]
            sKey: cute.struct.MemRange[Float32, self.experts]

        self.shared_storage = SharedStorage
        self.kernel(
            self.tiled_mma,
            self.x_smem_layout,
            self.w_smem_layout,
            tma_x,
            mX_tma,
            tma_w,
            mW_tma,
            mX,
            mBias,
            mLogits,
            mWeights,
            mIndices,
            mWs,
            mSync,
            scale,
        ).launch(grid=[self.n_tiles, self.splits, 1], block=[THREADS, 1, 1], stream=stream, cooperative=True)

    # ---- device ------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        x_layout: cute.ComposedLayout,
        w_layout: cute.ComposedLayout,
        tma_x: cute.CopyAtom,
        mX_tma: cute.Tensor,
        tma_w: cute.CopyAtom,
        mW_tma: cute.Tensor,
        mX: cute.Tensor,
        mBias: cute.Tensor,
        mLogits: cute.Tensor,
        mWeights: cute.Tensor,
        mIndices: cute.Tensor,
        mWs: cute.Tensor,
        mSync: cute.Tensor,
        scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        n_tile, split, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tokens = mX.shape[0]
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)

        # Layouts and the MMA travel as kernel arguments: values built on the host cannot be used
        # inside the kernel region directly.
        self.mainloop(
            tiled_mma, x_layout, w_layout, tma_x, mX_tma, tma_w, mW_tma, storage, mWs, tokens, n_tile, split, tidx, warp
        )
        self.grid_barrier(mSync, tidx, 0)
        cta = split * self.n_tiles + n_tile
        for t in cutlass.range(cta, tokens, self.grid_size, unroll=1):
            self.finish_token(t, storage, mBias, mLogits, mWeights, mIndices, mWs, scale, tidx, warp)
        self.grid_exit(mSync, tidx)

    @cute.jit
    def grid_barrier(self, mSync: cute.Tensor, tidx, slot: int):
        """Every CTA's partials are visible to every CTA after this (release fence, arrive, spin)."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            counter = mSync.iterator + slot
            cute.arch.atomic_add(counter, Int32(1), sem="release", scope="gpu")
            arrived = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
            spins = Int32(0)
            # Bounded (2^20 polls, about a second; a healthy wait is microseconds): a broken barrier
            # gives wrong outputs, which the tests see, rather than a hung GPU.
            while arrived < self.grid_size and spins < (1 << 20):
                arrived = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
                spins = spins + 1
        cute.arch.sync_threads()
        cute.arch.fence_acq_rel_gpu()

    @cute.jit
    def grid_exit(self, mSync: cute.Tensor, tidx):
        """The last CTA out zeroes both counters: every CTA has passed the barrier by then."""
        if tidx == 0:
            left = cute.arch.atomic_add(mSync.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
            if left == self.grid_size - 1:
                cute.arch.atomic_exch(mSync.iterator, Int32(0), scope="gpu")
                cute.arch.atomic_exch(mSync.iterator + 1, Int32(0), scope="gpu")

    @cute.jit
    def finish_token(self, t, storage, mBias, mLogits, mWeights, mIndices, mWs, scale: Float32, tidx, warp):
        sScore = storage.sScore.get_tensor(cute.make_layout(self.experts))
        sKey = storage.sKey.get_tensor(cute.make_layout(self.experts))
        for chunk in cutlass.range_constexpr(math.ceil(self.experts / THREADS)):
            e = chunk * THREADS + tidx
            if e < self.experts:
                logit = Float32(0.0)
                for s in cutlass.range_constexpr(self.splits):
                    logit = logit + mWs[s, t, e]
                mLogits[t, e] = logit
                score = sqrt_softplus(logit)
                sScore[e] = score
                sKey[e] = score + mBias[e]
        cute.arch.sync_threads()
        if warp == 0:
            self.top_k_warp(t, sScore, sKey, mWeights, mIndices, scale)
        cute.arch.sync_threads()  # shared rows are rewritten by the next token

    @cute.jit
    def top_k_warp(self, t, sScore, sKey, mWeights, mIndices, scale: Float32):
        lane = cute.arch.lane_idx()
        keys = cute.make_rmem_tensor((self.items,), Uint32)
        for j in cutlass.range_constexpr(self.items):
            keys[j] = order_key(sKey[j * 32 + lane])
        taken = Uint32(0)
        total = Float32(0.0)
        mine_score = Float32(0.0)
        mine_index = Int32(0)
        for r in cutlass.range_constexpr(self.top_k):
            best = Uint32(0)
            best_j = Int32(0)
            for j in cutlass.range_constexpr(self.items):
                if ((taken >> Uint32(j)) & Uint32(1)) == Uint32(0):
                    if keys[j] > best:
                        best = keys[j]
                        best_j = Int32(j)
            top = cute.arch.warp_redux_sync(best, "umax")
            candidate = Uint32(0xFFFFFFFF)
            if best == top:
                candidate = Uint32(best_j * 32 + lane)
            winner = cute.arch.warp_redux_sync(candidate, "umin")
            owner = Int32(winner & Uint32(31))
            if lane == owner:
                taken = taken | (Uint32(1) << Uint32(best_j))
            score = sScore[Int32(winner)]  # one shared address: a broadcast read
            total = total + score
            if lane == r:
                mine_score = score
                mine_index = Int32(winner)
        if lane < self.top_k:
            mWeights[t, lane] = mine_score / (total + Float32(1e-20)) * scale
            mIndices[t, lane] = Int64(mine_index)


# ---- compile cache and launch ---------------------------------------------------------------
_compiled: dict = {}
_sync: dict = {}


def compile_kernel(kernel_cls, torch_dtype, hidden: int, experts: int, top_k: int, num_sms: int):
    """Compiles (once per key) from fake tensors with a symbolic token count, for kernel_cls.arch
    (works without a GPU); the TVM-FFI function launches on torch's current stream."""
    key = (kernel_cls.arch, torch_dtype, hidden, experts, top_k, num_sms)
    if key not in _compiled:
        per_cta, splits = plan(hidden, experts, num_sms)
        dtype = _CUTLASS_DTYPES[torch_dtype]
        kernel = kernel_cls(dtype, hidden, experts, top_k, per_cta, splits)
        tokens = cute.sym_int()
        row_major = (1, 0)

        def fake(dt, shape, order=row_major, align=16):
            return cute.runtime.make_fake_compact_tensor(dt, shape, stride_order=order, assumed_align=align)

        args = (
            fake(dtype, (tokens, hidden)),
            fake(dtype, (experts, hidden)),
            fake(Float32, (experts,), (0,), 4),
            fake(Float32, (tokens, experts), align=4),
            fake(Float32, (tokens, top_k), align=4),
            fake(Int64, (tokens, top_k), align=8),
            fake(Float32, (splits, tokens, experts), (2, 1, 0), 4),
            fake(Int32, (2,), (0,), 4),
            Float32(1.0),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        )
        compiled = cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {kernel_cls.arch}")
        _compiled[key] = (compiled, splits)
    return _compiled[key]


def supports(x, weight, bias, logits_out, weights_out, indices_out) -> bool:
    """Shapes and layouts the fused kernel serves; anything else takes the cuBLAS path."""
    tokens, hidden = x.shape
    experts = weight.shape[0]
    return (
        x.dtype in _CUTLASS_DTYPES
        and 1 <= tokens <= MAX_TOKENS
        and hidden % BK == 0
        and experts % BN == 0
        and 1 <= weights_out.shape[1] <= 32
        and all(t.is_contiguous() for t in (x, weight, bias, logits_out, weights_out, indices_out))
        and x.data_ptr() % 16 == 0  # TMA sources
        and weight.data_ptr() % 16 == 0
    )


def launch(kernel_cls, x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor: float):
    device = x.device
    shape = (x.dtype, x.shape[1], weight.shape[0], weights_out.shape[1])
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    first_use = (kernel_cls.arch, *shape, num_sms) not in _compiled or device not in _sync
    if first_use and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "router_gate: run the fused decode gate once with this shape before CUDA-graph capture (its first "
            "call compiles the kernel and allocates the grid-barrier counters)"
        )
    compiled, splits = compile_kernel(kernel_cls, *shape, num_sms)
    if device not in _sync:
        _sync[device] = torch.zeros(2, dtype=torch.int32, device=device)
    ws = torch.empty((splits, x.shape[0], weight.shape[0]), dtype=torch.float32, device=device)
    compiled(x, weight, bias, logits_out, weights_out, indices_out, ws, _sync[device], routed_scaling_factor)
