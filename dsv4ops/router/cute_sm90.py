"""sm_90a mainloop of the fused decode gate: WGMMA 64 x 64 x 16 from 128-B-swizzled shared memory,
fp32 accumulators in registers (32 per thread). The whole kernel is described in cute.py."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils.layout import LayoutEnum

from dsv4ops.router import cute as _base
from dsv4ops.router.cute import BK, BN, THREADS

BM = 64  # tokens per tile: WGMMA's M; rows past the token count are TMA zero-fill


class RouterGateSm90(_base.RouterGateKernel):
    arch = "sm_90a"

    def setup(self):
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), tiler_mn=(BM, BN)
        )
        tile = (BM, BN, BK)
        # Both operands are K-major: x is [tokens, hidden], the gate weight [experts, hidden].
        self.x_smem_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, self.dtype, self.kt)
        self.w_smem_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, self.dtype, self.kt)

    def make_tma_atoms(self, mX, mW):
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_x, mX_tma = cpasync.make_tiled_tma_atom(op, mX, cute.slice_(self.x_smem_layout, (None, None, 0)), (BM, BK))
        tma_w, mW_tma = cpasync.make_tiled_tma_atom(op, mW, cute.slice_(self.w_smem_layout, (None, None, 0)), (BN, BK))
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
        stage_bytes = cute.size_in_bytes(self.dtype, cute.slice_(x_layout, (None, None, 0))) + cute.size_in_bytes(
            self.dtype, cute.slice_(w_layout, (None, None, 0))
        )
        loads = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.kt,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        gX = cute.local_tile(mX_tma, (BM, BK), (0, None))  # (BM, BK, k_tiles)
        gW = cute.local_tile(mW_tma, (BN, BK), (n_tile, None))  # (BN, BK, k_tiles)
        tXsX, tXgX = cpasync.tma_partition(
            tma_x, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
        )
        tWsW, tWgW = cpasync.tma_partition(
            tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2)
        )
        cute.arch.sync_threads()  # barriers initialised before anyone waits on them

        # All kt stages are issued at once (<= 7 x 16 KB): no buffer is reused, nothing waits for one.
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kt)
        if warp == 0:
            for stage in cutlass.range_constexpr(self.kt):
                loads.producer_acquire(producer)
                k_tile = split * self.kt + stage
                bar = loads.producer_get_barrier(producer)
                cute.copy(tma_x, tXgX[(None, k_tile)], tXsX[(None, stage)], tma_bar_ptr=bar)
                cute.copy(tma_w, tWgW[(None, k_tile)], tWsW[(None, stage)], tma_bar_ptr=bar)
                loads.producer_commit(producer)
                producer.advance()

        thr_mma = tiled_mma.get_slice(tidx)
        tCrX = tiled_mma.make_fragment_A(thr_mma.partition_A(sX))
        tCrW = tiled_mma.make_fragment_B(thr_mma.partition_B(sW))
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((BM, BN)))  # (token, expert) of each accumulator
        acc = cute.make_rmem_tensor(tCcC.shape, Float32)

        consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kt)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        for stage in cutlass.range_constexpr(self.kt):
            loads.consumer_wait(consumer)
            warpgroup.fence()
            for k_block in cutlass.range_constexpr(cute.size(tCrX, mode=[2])):
                coord = (None, None, k_block, stage)
                cute.gemm(tiled_mma, acc, tCrX[coord], tCrW[coord], acc)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            consumer.advance()
        warpgroup.wait_group(0)

        for i in cutlass.range_constexpr(cute.size(acc)):
            m, n = tCcC[i]
            if m < tokens:
                mWs[split, m, n_tile * BN + n] = acc[i]


def router_gate(x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor: float):
    _base.launch(RouterGateSm90, x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor)
