"""GeGLU input projection as one Hopper GEMM (CuteDSL, sm90a): out = gelu(x @ W_in.T) * (x @ W_gate.T).

Shapes: T packed tokens, D hidden, F mlp width; weight (2F, D) in HF's (out, in) layout, input rows
[0, F) then gate rows [F, 2F) (ModernBERT's Wi).

Each (tile.m, tile.n) tile of the (T, F) output is one CTA's work: TMA loads x's (m, 64) slab and
the matching (n, 64) slabs of BOTH weight halves into one pipeline stage; WGMMA accumulates them
into two fp32 register tiles (input and gate) from the same x slab, so x is read once for both.
The epilogue computes exact-erf GELU(a) * g in fp32, rounds once to x's dtype and stores through
its own shared-memory buffers with TMA. u (T, 2F) is never written: that is the whole point
against cuBLAS + gate.

Persistent: one CTA an SM (a CTA's shared memory fills one) takes cluster tiles in turn, and warp 0
keeps `stages` loads in flight over the CTA's whole (tile, k) sequence, so the next tile's first
slabs load while this tile's epilogue runs (K = 768 is only 12 slabs: a tile's pipeline fill and
epilogue are a large part of it). Clusters of 2 M tiles share each weight slab by TMA multicast.

The weight is seen as a (F, D, 2) tensor (the two halves as a batch mode), so one TMA descriptor
serves both halves and a ragged last N tile (F % tile.n != 0) reads zeros past row F of each half
instead of the other half's rows. T is a runtime value (TMA zero-fills rows past T on load and
clips them on store), so one compiled kernel per (dtype, D, F, tile) serves every pack.

Follows the structure of CUTLASS's examples/python/CuTeDSL hopper dense_gemm.py (warp 0 issues
the TMA loads between MMAs, no warp specialisation); the persistent tile loop, the second
accumulator, the batch-mode weight and the epilogue are ours. Requires CUTE_DSL's sm_90a target
(WGMMA does not exist on sm100).
"""

import dataclasses
import functools
import math
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from packedenc.kernels.cute import compile_cache

__all__ = ["Tile", "DEFAULT_TILE", "geglu", "compiled", "smem_bytes"]

BK = 64  # K per stage: 4 WGMMA k-blocks of 16 (bf16 / fp16)
SMEM_CAPACITY = 232448  # sm90: 227 KiB per CTA
INV_SQRT2 = 1.0 / math.sqrt(2.0)
DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}


EPI_N, EPI_STAGES = 32, 4  # the epilogue's staging tiles (m x 32 for 16-bit outputs), in turn


def smem_bytes(tile: "Tile") -> int:
    # the load stages, the epilogue's own buffers (the next tile's slabs load meanwhile), barriers and alignment
    return tile.stages * (tile.m + 2 * tile.n) * BK * 2 + EPI_STAGES * tile.m * EPI_N * 2 + 1024


@dataclasses.dataclass(frozen=True)
class Tile:
    """Launch shape: output tile (m x n) per CTA, pipeline stages, cluster (M, N) of CTAs."""

    m: int = 128  # 128: two consumer warp groups of 64 rows; 64: one
    n: int = 128  # per half: the CTA multiplies m x 2n; 2 x 64 x n fp32 registers per warp group
    stages: int = 4  # (m + 2n) x 64 x 2 B each; 4 x 48 KiB at 128 x 128
    cluster: tuple[int, int] = (1, 1)  # (2, 1): two M tiles share the weight slabs (TMA multicast)

    def __post_init__(self):
        if self.m not in (64, 128) or self.n not in (64, 128, 192) or self.stages < 2:
            raise ValueError(f"Tile: m in (64, 128), n in (64, 128, 192), stages >= 2; got {self}")
        if self.cluster not in ((1, 1), (2, 1), (1, 2), (2, 2)):
            raise ValueError(f"Tile: cluster must be (1|2, 1|2), got {self.cluster}")
        if smem_bytes(self) > SMEM_CAPACITY:
            raise ValueError(f"Tile {self}: {smem_bytes(self)} B of shared memory > {SMEM_CAPACITY}")


DEFAULT_TILE = Tile(cluster=(2, 1))


class GegluGemm:
    """The kernel for one (dtype, D, F, tile); `__call__` is the host side that `cute.compile` traces."""

    def __init__(self, dtype: type[cutlass.Numeric], D: int, F: int, tile: Tile):
        self.dtype, self.D, self.F, self.tile = dtype, D, F, tile
        self.acc_dtype = cutlass.Float32
        self.cluster_shape_mn = tile.cluster
        # Two accumulators double the registers of a plain GEMM: a 128-row tile takes two
        # warp groups (64 rows each) so that one thread holds 2 x 64 x n / 128 fp32 values.
        self.atom_layout_mnk = (2, 1, 1) if tile.m == 128 else (1, 1, 1)
        self.mma_warp_groups = math.prod(self.atom_layout_mnk)
        self.threads_per_cta = 128 * self.mma_warp_groups
        self.tile_shape_mnk = (tile.m, tile.n, BK)
        self.ab_stage, self.epi_stage = tile.stages, EPI_STAGES
        self.num_mcast_ctas_a, self.num_mcast_ctas_b = tile.cluster[1], tile.cluster[0]
        self.is_a_mcast, self.is_b_mcast = self.num_mcast_ctas_a > 1, self.num_mcast_ctas_b > 1

    def _setup(self):
        """Layouts that need the MLIR context (called inside the traced `__call__`)."""
        k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, k_major, self.acc_dtype, self.atom_layout_mnk,
            tiler_mn=(64, self.tile.n))
        self.cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(
            self.tile_shape_mnk, self.dtype, is_cooperative=self.mma_warp_groups == 2)
        self.a_smem_layout_staged = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, self.tile_shape_mnk, self.dtype, self.ab_stage)
        self.b_smem_layout_staged = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, self.tile_shape_mnk, self.dtype, self.ab_stage)
        self.epi_smem_layout_staged = sm90_utils.make_smem_layout_epi(
            self.dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, self.epi_stage)

    @cute.jit
    def __call__(self, mX_TD: cute.Tensor, mW: cute.Tensor, mO_TF: cute.Tensor, max_ctas: cutlass.Int32,
                 stream: cuda.CUstream):
        """x (T, D), weight (2F, D), out (T, F); T is dynamic. The traced host side: layouts, TMA
        descriptors, grid, launch. Compiled with TVM-FFI's calling convention, so the compiled function
        takes torch tensors: no CuteDSL pointer or stream objects built per call, which cost more host
        time than the call itself (benchmarks/results/history/cute_host_probe_h200_4eb58ae.json)."""
        x_ptr, w_ptr, out_ptr, T = mX_TD.iterator, mW.iterator, mO_TF.iterator, mX_TD.shape[0]
        self._setup()
        D, F = self.D, self.F
        # (T, D, 1), (F, D, 2) and (T, F, 1), K / F contiguous; the last mode is the batch mode.
        mX = cute.make_tensor(x_ptr, cute.make_ordered_layout((T, D, 1), order=(1, 0, 2)))
        mW = cute.make_tensor(w_ptr, cute.make_ordered_layout((F, D, 2), order=(1, 0, 2)))
        mO = cute.make_tensor(out_ptr, cute.make_ordered_layout((T, F, 1), order=(1, 0, 2)))

        a_smem = cute.slice_(self.a_smem_layout_staged, (None, None, 0))
        b_smem = cute.slice_(self.b_smem_layout_staged, (None, None, 0))
        tma_atom_x, tma_x = cute.nvgpu.cpasync.make_tiled_tma_atom(
            self._g2s_op(self.num_mcast_ctas_a), mX, a_smem, (self.tile.m, BK), num_multicast=self.num_mcast_ctas_a)
        tma_atom_w, tma_w = cute.nvgpu.cpasync.make_tiled_tma_atom(
            self._g2s_op(self.num_mcast_ctas_b), mW, b_smem, (self.tile.n, BK), num_multicast=self.num_mcast_ctas_b)
        tma_atom_o, tma_o = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mO,
            cute.slice_(self.epi_smem_layout_staged, (None, None, 0)), self.epi_tile)

        # Persistent: at most max_ctas CTAs (one an SM fits), each taking cluster tiles in turn, so the
        # next tile's first stages load while this tile's epilogue runs.
        n_clusters = cute.ceil_div(cute.ceil_div(T, self.tile.m), self.cluster_shape_mn[0]) * cute.ceil_div(
            cute.ceil_div(F, self.tile.n), self.cluster_shape_mn[1])
        cluster_size = self.cluster_shape_mn[0] * self.cluster_shape_mn[1]
        grid_clusters = cutlass.max(cutlass.min(n_clusters, max_ctas // cluster_size), 1)
        grid = (grid_clusters * self.cluster_shape_mn[0], self.cluster_shape_mn[1], 1)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.a_smem_layout_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.b_smem_layout_staged)], 1024]
            sG: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.b_smem_layout_staged)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.epi_smem_layout_staged)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tma_atom_x, tma_x, tma_atom_w, tma_w, tma_atom_o, tma_o, self.tiled_mma, self.cta_layout_mnk,
                    self.a_smem_layout_staged, self.b_smem_layout_staged, self.epi_smem_layout_staged).launch(
            grid=grid, block=[self.threads_per_cta, 1, 1], cluster=(*self.cluster_shape_mn, 1), stream=stream)

    @staticmethod
    def _g2s_op(mcast: int):
        if mcast == 1:
            return cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        return cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()

    @cute.kernel
    def kernel(self, tma_atom_x: cute.CopyAtom, mX_mkl: cute.Tensor, tma_atom_w: cute.CopyAtom, mW_nkl: cute.Tensor,
               tma_atom_o: cute.CopyAtom, mO_mnl: cute.Tensor, tiled_mma: cute.TiledMma, cta_layout_mnk: cute.Layout,
               a_smem_layout_staged: cute.ComposedLayout, b_smem_layout_staged: cute.ComposedLayout,
               epi_smem_layout_staged: cute.ComposedLayout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_x)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_w)
        tidx, _, _ = cute.arch.thread_idx()

        cidx, _, _ = cute.arch.cluster_idx()
        grid_clusters, _, _ = cute.arch.cluster_dim()  # the grid, in clusters (one row of them)
        cm, cn = self.cluster_shape_mn
        num_m = cute.ceil_div(cute.ceil_div(cute.size(mO_mnl, mode=[0]), self.tile.m), cm)  # cluster tiles
        num_n = cute.ceil_div(cute.ceil_div(self.F, self.tile.n), cn)
        n_tiles = num_m * num_n
        in_cluster = cute.arch.block_in_cluster_idx()
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord_mnk = cta_layout_mnk.get_flat_coord(cta_rank)

        a_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord_mnk, mode=1)
        b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord_mnk, mode=0)
        a_mcast_mask = a_mcast_mask if self.is_a_mcast else 0
        b_mcast_mask = b_mcast_mask if self.is_b_mcast else 0
        a_smem = cute.slice_(a_smem_layout_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_layout_staged, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.dtype, a_smem) + 2 * cute.size_in_bytes(self.dtype, b_smem)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # One consumer arrival per warp (and per peer CTA that multicasts into this one).
        mcast_size = self.num_mcast_ctas_a + self.num_mcast_ctas_b - 1
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(), num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     mcast_size * self.threads_per_cta // 32),
            tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)), defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sG = storage.sG.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        # The epilogue's own staging buffer: x's stages fill with the next tile meanwhile.
        sC = storage.sC.get_tensor(epi_smem_layout_staged.outer, swizzle=epi_smem_layout_staged.inner)

        # Every tile's slabs: (m | n, BK, tiles, k) views of x and the two weight halves; (m, n, tiles_m, tiles_n) of out.
        tile_mnk = self.tile_shape_mnk
        gA = cute.local_tile(mX_mkl, tile_mnk, (None, None, None, 0), proj=(1, None, 1))
        gB = cute.local_tile(mW_nkl, tile_mnk, (None, None, None, 0), proj=(None, 1, 1))  # input half
        gG = cute.local_tile(mW_nkl, tile_mnk, (None, None, None, 1), proj=(None, 1, 1))  # gate half
        gC = cute.local_tile(mO_mnl, tile_mnk, (None, None, None, 0), proj=(1, 1, None))

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.mma_warp_groups, stride=128)(wg_idx))
        tCgC = thr_mma.partition_C(gC[(None, None, 0, 0)])

        a_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape)
        b_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape)
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_x, cluster_coord_mnk[1], a_cta_layout, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_w, cluster_coord_mnk[0], b_cta_layout, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        tGsG, tGgG = cute.nvgpu.cpasync.tma_partition(
            tma_atom_w, cluster_coord_mnk[0], b_cta_layout, cute.group_modes(sG, 0, 2), cute.group_modes(gG, 0, 2))

        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tCrG = tiled_mma.make_fragment_B(thr_mma.partition_B(sG))
        acc_a = cute.make_rmem_tensor(tCgC.shape, self.acc_dtype)  # x @ W_in.T
        acc_g = cute.make_rmem_tensor(tCgC.shape, self.acc_dtype)  # x @ W_gate.T

        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)
        k_tiles = cute.size(gA, mode=[3])
        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)

        # Warp 0 keeps ab_stage loads in flight over this CTA's whole sequence of (tile, k) slabs:
        # the producer's count is the slab's place in it. (`producer.advance()` stays inline: the DSL
        # carries `producer` through the dynamic loops only if it is updated in their bodies.)
        slabs = (tma_atom_x, tAgA, tAsA, tma_atom_w, tBgB, tBsB, tGgG, tGsG, a_mcast_mask, b_mcast_mask)
        if warp_idx == 0:
            for _ in cutlass.range(self.ab_stage, unroll=1):
                ld_tile = cidx + producer.count // k_tiles * grid_clusters
                if ld_tile < n_tiles:
                    self._load(mainloop, producer, self._tile_mn(ld_tile, num_m, num_n, in_cluster),
                               producer.count % k_tiles, slabs)
                    producer.advance()

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        num_k_blocks = cute.size(tCrA, mode=[2])

        for tile in cutlass.range(cidx, n_tiles, grid_clusters, unroll=1):
            pid_m, pid_n = self._tile_mn(tile, num_m, num_n, in_cluster)
            # k tile 0, unrolled at trace time: the first k block of each accumulator overwrites it.
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            mainloop.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(num_k_blocks):
                cute.gemm(tiled_mma, acc_a, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)],
                          acc_a)
                cute.gemm(tiled_mma, acc_g, tCrA[(None, None, kb, read.index)], tCrG[(None, None, kb, read.index)],
                          acc_g)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            read.advance()

            # Each later k tile hands the previous stage back (one WGMMA group stays in flight) and
            # warp 0 refills it with the next slab in this CTA's sequence; the last stage goes back
            # after the final wait, so ab_stage loads stay in flight into the next tile's k tiles
            # while this tile's epilogue runs.
            for k in cutlass.range(1, k_tiles + 1, unroll=1):
                if k < k_tiles:
                    mainloop.consumer_wait(read)
                    cute.nvgpu.warpgroup.fence()
                    for kb in cutlass.range_constexpr(num_k_blocks):
                        cute.gemm(tiled_mma, acc_a, tCrA[(None, None, kb, read.index)],
                                  tCrB[(None, None, kb, read.index)], acc_a)
                        cute.gemm(tiled_mma, acc_g, tCrA[(None, None, kb, read.index)],
                                  tCrG[(None, None, kb, read.index)], acc_g)
                    cute.nvgpu.warpgroup.commit_group()
                    read.advance()
                    cute.nvgpu.warpgroup.wait_group(1)
                else:
                    cute.nvgpu.warpgroup.wait_group(0)
                mainloop.consumer_release(release)
                release.advance()
                ld_tile = cidx + producer.count // k_tiles * grid_clusters
                if warp_idx == 0 and ld_tile < n_tiles:
                    self._load(mainloop, producer, self._tile_mn(ld_tile, num_m, num_n, in_cluster),
                               producer.count % k_tiles, slabs)
                    producer.advance()

            rounds = (tile - cidx) // grid_clusters  # this CTA's tiles before this one: the store buffers' turn
            self.epilogue(acc_a, acc_g, sC, gC[(None, None, pid_m, pid_n)], tiled_mma, tma_atom_o, tidx, warp_idx,
                          rounds)

        if warp_idx == 0:
            cute.arch.cp_async_bulk_wait_group(0)  # this CTA's last stores are done before it exits
        # a peer CTA may still multicast into this one's stages or wait on its barriers
        if cute.size(self.cluster_shape_mn) > 1:
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def _load(self, mainloop, producer, tile_mn, k, slabs):
        """Warp 0: x's slab and both weight slabs of (tile, k) into the producer's stage, one barrier."""
        tma_atom_x, tAgA, tAsA, tma_atom_w, tBgB, tBsB, tGgG, tGsG, a_mcast_mask, b_mcast_mask = slabs
        m, n = tile_mn
        mainloop.producer_acquire(producer)
        bar = mainloop.producer_get_barrier(producer)
        cute.copy(tma_atom_x, tAgA[(None, m, k)], tAsA[(None, producer.index)], tma_bar_ptr=bar, mcast_mask=a_mcast_mask)
        cute.copy(tma_atom_w, tBgB[(None, n, k)], tBsB[(None, producer.index)], tma_bar_ptr=bar, mcast_mask=b_mcast_mask)
        cute.copy(tma_atom_w, tGgG[(None, n, k)], tGsG[(None, producer.index)], tma_bar_ptr=bar, mcast_mask=b_mcast_mask)
        mainloop.producer_commit(producer)

    @cute.jit
    def _tile_mn(self, t: cutlass.Int32, num_m: cutlass.Int32, num_n: cutlass.Int32, in_cluster):
        """Cluster tile t's CTA tile (m, n), grouped: 8 M tiles (clusters) walk the N tiles together,
        so x's slabs and the weight stay in L2 between the CTAs that read them at once; the last
        num_m % 8 M tiles form a narrower group. (Plain arithmetic, not CUTLASS's layout form: with
        fewer than 8 M tiles that form takes a remainder by zero before it reaches its tail branch.)"""
        group_m = 8
        group = group_m * num_n  # cluster tiles in one group of 8 M tiles
        n_full = num_m // group_m * group  # cluster tiles in whole groups
        cid_m = t // group * group_m + t % group_m
        cid_n = t % group // group_m
        if t >= n_full:  # then num_m % 8 > 0
            tail_m = num_m % group_m
            cid_m = num_m - tail_m + (t - n_full) % tail_m
            cid_n = (t - n_full) // tail_m
        return cid_m * self.cluster_shape_mn[0] + in_cluster[0], cid_n * self.cluster_shape_mn[1] + in_cluster[1]

    @cute.jit
    def epilogue(self, acc_a: cute.Tensor, acc_g: cute.Tensor, sC: cute.Tensor, gC: cute.Tensor,
                 tiled_mma: cute.TiledMma, tma_atom_o: cute.CopyAtom, tidx: cutlass.Int32, warp_idx: cutlass.Int32,
                 rounds: cutlass.Int32):
        # gelu(a) * g in fp32, exact erf (HF "gelu"), into acc_a; rounded once when stored.
        a = acc_a.load()
        acc_a.store(0.5 * a * (1.0 + cute.math.erf(a * INV_SQRT2, fastmath=True)) * acc_g.load())

        copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(LayoutEnum.ROW_MAJOR, elem_ty_d=self.dtype,
                                                          elem_ty_acc=self.acc_dtype)
        copy_atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype)
        tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma))
        thr_copy_r2s = tiled_copy_r2s.get_slice(tidx)
        tRS_sD = thr_copy_r2s.partition_D(sC)  # (R2S, R2S_M, R2S_N, stage)
        tRS_rAcc = tiled_copy_r2s.retile(acc_a)
        rD_layout = cute.make_layout(cute.shape(thr_copy_r2s.partition_S(sC))[:3])
        tRS_rD = cute.make_rmem_tensor_like(rD_layout, self.acc_dtype)
        n_rD = cute.size(tRS_rD)

        gC_epi = cute.zipped_divide(gC, self.epi_tile)
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
            tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi)
        epi_shape = gC_epi.shape[1]
        epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                                                self.threads_per_cta))
        n_epi = cute.size(gC_epi, mode=[1])
        for epi_idx in cutlass.range_constexpr(n_epi):
            for v in cutlass.range_constexpr(n_rD):
                tRS_rD[v] = tRS_rAcc[epi_idx * n_rD + v]
            tRS_rD_out = cute.make_rmem_tensor_like(rD_layout, self.dtype)
            tRS_rD_out.store(tRS_rD.load().to(self.dtype))
            # buffers in turn across this CTA's tiles: the acquire after each store keeps the
            # oldest one's store finished before its buffer is written again
            buf = (rounds * n_epi + epi_idx) % cute.size(tRS_sD, mode=[3])
            cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")  # st.shared visible to the TMA store
            pipeline.sync(barrier_id=1)
            if warp_idx == 0:
                cute.copy(tma_atom_o, bSG_sD[(None, buf)], bSG_gD[(None, epi_layout.get_hier_coord(epi_idx))])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            pipeline.sync(barrier_id=1)


# ---- host side: compile once per (dtype, D, F, tile) and machine, launch per call -------------------

_COMPILED: dict[tuple, object] = {}
HOW: dict[tuple, str] = {}  # key -> "loaded" / "compiled" / ... (compile_cache.load_or_compile's word)


def _fake(dtype, rows, cols) -> cute.Tensor:
    """A compile-time stand-in for a row-major (rows, cols) tensor with a 16-byte aligned base."""
    return cute.runtime.make_fake_compact_tensor(dtype, (rows, cols), stride_order=(1, 0), assumed_align=16)


def compiled(dtype: torch.dtype, D: int, F: int, tile: Tile = DEFAULT_TILE):
    """The compiled kernel for these static sizes (T stays a runtime argument): from this process's
    memory, else from the on-disk compile cache (`compile_cache.py`), else compiled (~1 s) and cached."""
    key = (dtype, D, F, tile)
    if key not in _COMPILED:
        cdt = DTYPES[dtype]
        T = cute.sym_int()  # x's and out's rows: one runtime value, checked equal at the call
        _COMPILED[key], HOW[key] = compile_cache.load_or_compile(
            key, (Path(__file__),),
            lambda: cute.compile(GegluGemm(cdt, D, F, tile), _fake(cdt, T, D), _fake(cdt, 2 * F, D), _fake(cdt, T, F),
                                 cutlass.Int32(1), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                                 options="--enable-tvm-ffi"))
    return _COMPILED[key]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def geglu(x_TD: torch.Tensor, weight: torch.Tensor, tile: Tile = DEFAULT_TILE, max_ctas: int | None = None) -> torch.Tensor:
    """gelu(x @ weight[:F].T) * (x @ weight[F:].T), (T, F) in x's dtype. No checks beyond asserts:
    the caller (`linear_glu.covers_linear_glu`) decides which inputs come here. `max_ctas`: the
    persistent grid's size, default one CTA per SM (a CTA's shared memory fills one); a value of at
    least the tile count gives every tile its own CTA (no cross-tile prefetch: the probes' baseline)."""
    T, D = x_TD.shape
    F = weight.shape[0] // 2
    assert weight.shape == (2 * F, D) and x_TD.dtype == weight.dtype and x_TD.is_contiguous() and weight.is_contiguous()
    out_TF = torch.empty((T, F), device=x_TD.device, dtype=x_TD.dtype)
    if T == 0:
        return out_TF
    if x_TD.data_ptr() % 16:  # TMA needs 16-byte aligned bases; a fresh copy is
        x_TD = x_TD.clone()
    if weight.data_ptr() % 16:
        weight = weight.clone()
    fn = compiled(x_TD.dtype, D, F, tile)
    index = x_TD.device.index
    ctas = _sm_count(index) if max_ctas is None else max_ctas
    if index == torch.cuda.current_device():  # the launch goes to the current device
        fn(x_TD, weight, out_TF, ctas)  # on torch's current stream (TVM-FFI's environment stream)
    else:
        with torch.cuda.device(x_TD.device):
            fn(x_TD, weight, out_TF, ctas)
    return out_TF
