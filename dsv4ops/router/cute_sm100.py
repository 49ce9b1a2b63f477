"""sm_100a mainloop of the fused decode gate: tcgen05 MMA 128 x 64 x 16 (one CTA) from swizzled shared
memory into 64 TMEM columns, read back with 32x32b loads (thread i holds token row i). The whole
kernel is described in cute.py. Compile-checked for sm_100a on CPU; not yet run on a B200."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from dsv4ops.router import cute as _base
from dsv4ops.router.cute import BK, BN, THREADS

BM = 128  # tokens per tile: the one-CTA tcgen05 M whose accumulator rows map 1:1 onto TMEM lanes
TILE = (BM, BN, BK)


class RouterGateSm100(_base.RouterGateKernel):
    arch = "sm_100a"

    def setup(self):
        self.tiled_mma = cute.make_tiled_mma(
            tcgen05.MmaF16BF16Op(
                self.dtype,
                Float32,
                (BM, BN, 16),
                tcgen05.CtaGroup.ONE,
                tcgen05.OperandSource.SMEM,
                OperandMajorMode.K,
                OperandMajorMode.K,
            )
        )
        self.x_smem_layout = sm100_utils.make_smem_layout_a(self.tiled_mma, TILE, self.dtype, self.kt)
        self.w_smem_layout = sm100_utils.make_smem_layout_b(self.tiled_mma, TILE, self.dtype, self.kt)

    def make_tma_atoms(self, mX, mW):
        op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        one_x = cute.select(self.x_smem_layout, mode=[0, 1, 2])
        one_w = cute.select(self.w_smem_layout, mode=[0, 1, 2])
        tma_x, mX_tma = cute.nvgpu.make_tiled_tma_atom_A(op, mX, one_x, TILE, self.tiled_mma)
        tma_w, mW_tma = cute.nvgpu.make_tiled_tma_atom_B(op, mW, one_w, TILE, self.tiled_mma)
        return tma_x, mX_tma, tma_w, mW_tma

    @cute.jit
    def mainloop(
        self,
        tiled_mma,
        x_layout,
        w_layout,
        tma_x,
        mX_tma,
        tma_w,
        mW_tma,
        storage,
        mWs,
        tokens,
        n_tile,
        split,
        tidx,
        warp,
    ):
        sX = storage.sX.get_tensor(x_layout.outer, swizzle=x_layout.inner)
        sW = storage.sW.get_tensor(w_layout.outer, swizzle=w_layout.inner)
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_address, barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=THREADS)
        )
        tmem.allocate(BN)  # 64 fp32 columns x 128 lanes: the whole accumulator
        stage_bytes = cute.size_in_bytes(self.dtype, cute.select(x_layout, mode=[0, 1, 2])) + cute.size_in_bytes(
            self.dtype, cute.select(w_layout, mode=[0, 1, 2])
        )
        mbar = storage.mbar.data_ptr()
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            num_stages=self.kt,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            tx_count=stage_bytes,
            barrier_storage=mbar,
        ).make_participants()
        acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS),
            barrier_storage=mbar + self.kt * 2,
        ).make_participants()

        gX = cute.local_tile(mX_tma, TILE, (0, n_tile, None), proj=(1, None, 1))  # (BM, BK, k_tiles)
        gW = cute.local_tile(mW_tma, TILE, (0, n_tile, None), proj=(None, 1, 1))  # (BN, BK, k_tiles)
        thr_mma = tiled_mma.get_slice(0)
        tCgX = thr_mma.partition_A(gX)
        tCgW = thr_mma.partition_B(gW)
        tCrX = tiled_mma.make_fragment_A(sX)
        tCrW = tiled_mma.make_fragment_B(sW)
        tCtAcc = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BM, BN)))
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((BM, BN)))  # (token, expert) of each accumulator
        tXsX, tXgX = cpasync.tma_partition(
            tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 3), cute.group_modes(tCgX, 0, 3)
        )
        tWsW, tWgW = cpasync.tma_partition(
            tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 3), cute.group_modes(tCgW, 0, 3)
        )

        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(Float32)
        tCtAcc = cute.make_tensor(tmem_ptr, tCtAcc.layout)
        epi_tiler = ((cute.size(tCtAcc, mode=[0, 0]), cute.size(tCtAcc, mode=[0, 1])),)
        tCtAcc_epi = cute.zipped_divide(tCtAcc, epi_tiler)
        tCcC_epi = cute.zipped_divide(tCcC, epi_tiler)
        tmem_copy = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x64), Float32), tCtAcc_epi[None, 0]
        )
        thr_copy = tmem_copy.get_slice(tidx)
        tDtC = thr_copy.partition_S(tCtAcc_epi)
        tDcC = thr_copy.partition_D(tCcC_epi)
        tDrC = cute.make_rmem_tensor(tDcC[None, None, 0].shape, Float32)

        # One thread issues every load (<= 7 stages, none reused), then the MMAs stage by stage.
        if warp == 0:
            acc_empty = acc_producer.acquire_and_advance()
            for stage in cutlass.range_constexpr(self.kt):
                ab_empty = ab_producer.acquire_and_advance()
                k_tile = split * self.kt + stage
                cute.copy(tma_x, tXgX[(None, k_tile)], tXsX[(None, ab_empty.index)], tma_bar_ptr=ab_empty.barrier)
                cute.copy(tma_w, tWgW[(None, k_tile)], tWsW[(None, ab_empty.index)], tma_bar_ptr=ab_empty.barrier)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for stage in cutlass.range_constexpr(self.kt):
                ab_full = ab_consumer.wait_and_advance()
                for k_block in cutlass.range_constexpr(cute.size(tCrX, mode=[2])):
                    coord = (None, None, k_block, ab_full.index)
                    cute.gemm(tiled_mma, tCtAcc, tCrX[coord], tCrW[coord], tCtAcc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                ab_full.release()
            acc_empty.commit()
        tmem.relinquish_alloc_permit()

        acc_full = acc_consumer.wait_and_advance()
        cute.copy(tmem_copy, tDtC[None, None, 0], tDrC)
        acc_full.release()
        tDcC_tile = tDcC[None, None, 0]
        for i in cutlass.range(cute.size(tDrC), unroll_full=True):
            m, n = tDcC_tile[i]
            if m < tokens:
                mWs[split, m, n_tile * BN + n] = tDrC[i]
        pipeline.sync(barrier_id=1)  # every thread has read TMEM before it is freed
        tmem.free(tmem_ptr)


def router_gate(x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor: float):
    _base.launch(RouterGateSm100, x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor)
