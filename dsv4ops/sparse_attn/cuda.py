"""sm_90 launcher of `dsv4::sparse_attn` with the CUDA C++ kernel of csrc/sparse_attn/ (wgmma) for
bf16 q and out, int32 comp_idx and the byte pools of the models (`FORMAT_PAIRS`: V4's fp8_584 window
and entries, V4.1's fp8_528 window and fp4_288 entries, V4's fp4_288 entry option), and the Triton
kernel for every other case (exact pools, fp32 or fp16 activations). Same arguments as the op.

The arch table selects it on sm_90 (dsv4ops/_arch.py); the sm_100a build of csrc/ compiles the
kernel to a trap, and sm_100 runs the Triton kernel.

The C++ kernels take a token x 64 heads (csrc/sparse_attn/sparse_attn.cu) or x 8 / 16 heads
(small_heads.cu, a tensor-parallel rank's share: `cta_heads`) x one split of its key list per CTA
(one CTA per SM: 218-226 KiB of shared memory); a batch that would leave SMs idle splits each list
(`split_plan`), and the splits' partial outputs are merged with the sink: by the kernel itself, over
distributed shared memory, where a token's splits form one thread-block cluster (below), else by a
second kernel (workspace allocated per call from static sizes, so the call stays CUDA-graph safe).
The split count fills one wave of CTAs (HCA 32 x 1M: 4 splits of 65 tiles); it is sized by the key
list's width, but a split past its token's real list (window plus `comp_lens` entries) leaves at once
and the combine reads only the live splits, so the cost follows the real context (HCA 1 x 4K in a cache
of 1M positions a request: 12.1 us, 10.7 at a 4K `max_context`). The kernels' designs are in their
files' headers.

The splits' partial outputs are bf16, each normalized by its own softmax sum (so bounded by the
largest |value| of its keys), with fp32 log2-sums: half the bytes of fp32 partials, the traffic that
made the combine a second, memory-bound kernel. The rounding adds at most half a bf16 ulp of the output
before the combine's fp32 sum (the bf16 output then rounds once more); over the sweep grid the largest
difference from FlashMLA's output (fp32 partials) went from 7.8e-3 to 8.5e-3 of its largest |output|
(median 4.4e-3 -> 4.7e-3). H100, 2026-11-27, the same warm machine, fp32 / bf16 partials at the split
count the earlier rule picked, us: V4-Flash CSA 32 x 4K 24.3-24.5 / 19.5-20.2, HCA 32 x 64K 24.9-25.0
/ 20.6-20.9, CSA 1 x 4K 11.5-11.8 / 10.9-11.0, sliding 1 x 4K 10.0-10.3 / 9.0-9.4, V4-Pro CSA 32 x 4K
45.2-45.4 / 39.8-40.0, 16 heads HCA 1 x 1M 17.6-17.8 / 15.7-16.0. With the split rule refit to them
(below) and the combine's rounds of loads (csrc/sparse_attn/combine.cu), the sweep grid's V4-Flash
64-head CSA median went from 0.86 to 0.82 of FlashMLA's time (points over 0.9: 15 -> 5), HCA 0.89 ->
0.84 (15 -> 10), sliding 1.02 -> 0.99 (30 -> 22), V4-Pro's 128-head rows 1.09-1.11 -> 1.02-1.04.

Against FlashMLA on the same pools (H100, 2026-11-27; README Benchmarks) it takes 0.77-0.87x its
time at batch 1, at CSA 32 x 4K and at 128 x 4K and longer contexts, and misses on three rows: sliding
128 x 4K (1.01x), V4-Pro CSA 128 x 4K (1.15x) and a 4096-token prefill (1.34x). What bounds them:
- the per-tile chain of the 64-head kernel. Its consumers split S by dims before 2026-11-27 (each
  warpgroup half of S, added through shared memory, the softmax run by both, then both halves of
  P V in step); warpgroup 0 now computes all of S and the softmax and hands P to warpgroup 1, which
  adds its half of P V while warpgroup 0 is on the next tile, and warpgroup 0 issues its own half of
  P V in one wgmma group with the next tile's S (csrc/sparse_attn/sparse_attn.cu has the steps and
  their timings). Same runs, us, before / after: V4-Pro CSA 128 x 4K 129.2-132.6 / 116.2-117.2,
  V4-Flash CSA 128 x 4K 42.1-43.0 / 38.6-38.7, V4-Pro HCA 32 x 64K 34.7-35.4 / 32.8-33.8, V4-Flash
  sliding 256 x 16K 34.9-35.6 / 33.1-33.3; over the sweep grid (README) every 64 / 128-head row's
  median fell (V4-Pro CSA 1.24 -> 1.10, V4-Flash sliding 1.10 -> 1.02). A CTA of one or two tiles
  (batch 1 and 8, split lists) pays for the hand-off instead, 3-9% slower over the sweep (sliding
  1 x 4K 9.1 us in the 2026-11-26 side-by-side, 9.7 after it, with fp32 partials; CSA 1 x 4K 11.4 ->
  11.5-11.9, same runs):
  its S runs on one warpgroup and warpgroup 1's P V waits for it.
  Forced split counts there (60 points, batch 1 and 8) put the split rule within 3% of the fastest at
  52; it misses by 6-7% at V4-Pro sliding 8 x * (2 splits, 1 faster) and by 11-18% at three HCA
  points (V4-Flash 1 x 1M, V4-Pro 1 x 256K and 8 x 16K); not refit. ncu of V4-Pro CSA 128 x 4K (base
  clocks, 149 us there): 8.7 cycles a warp between issues (16 warps: issue slots about half busy),
  DRAM 40% busy, the shared-memory LSU pipe 60% (the producers' raw-row reads and bf16 stores, the
  hand-off), so neither memory nor issue alone bounds it; FlashMLA's 64-key tiles read q from shared
  memory once per 64 keys where ours read it once per 32 (64 KiB a tile, the largest share of the
  S wgmmas' operand traffic), and 64-key bf16 tiles do not fit beside q and the raw ring in 227 KiB.
- sliding 128 x 4K (ncu before the restructure, 1.13x then): one wave of 128 CTAs of 4 tiles each,
  every CTA loading its 64 KiB of q, running its tiles and storing 64 KiB of output in the same phase
  as the others, so DRAM idles during the tiles and the tensor cores during the loads (DRAM 25%, issue
  slots 34% busy). A second split per token (two waves) measured 46.3 us against 14.3; what would close
  it is another CTA's loads under each CTA's tiles (a persistent kernel with two tokens in flight per
  SM).
- CSA 32 x 4K (1.09x with fp32 partials, 0.87x with bf16): 4 splits of 5 tiles fill the wave, and
  the splits' fp32 partial outputs (16.8 MB written and read back) made the combine a second,
  memory-latency-bound kernel (long scoreboard 59% of its stalls).
- V4-Pro: the two CTAs of a token each gather and dequantize the same keys (placing them side by side
  in launch order, so the second read hits L2, changed nothing: 128.6 vs 128.1 us); the prefill also
  pays each CTA's start in each of its 31 waves.
  How much each link cost in the split-S kernel, from build-time experiments (H100, 2026-11-27,
  graph-timed; V4-Pro CSA 128 x 4K / V4-Flash CSA 128 x 4K, us): as built 131.6 / 42.7; producers that
  gather nothing 120.9 / 37.6; producers that gather and dequantize nothing (only the tile handoffs)
  105.1 / 33.2; no partial-S exchange 126.5 / 41.5. A V4-Pro cluster sharing one dequantized tile was
  built on that kernel and measured (same day and GPU): the two CTAs of a token as a cluster of 2, CTA
  r gathering and dequantizing tiles r, r + 2, ... into its own bf16 buffer and the other's (16-B
  st.shared::cluster beside each local store), the handoff on mbarriers (full: the producing CTA's
  release after its producers' named barrier; empty: both CTAs' consumer warps). It passed the csrc
  GPU tests and took 195.5-200.2 us at V4-Pro CSA 128 x 4K against 129.2-132.7 (HCA 32 x 64K
  46.8-47.5 against 34.5-35.4, sliding 128 x 4K 39.6-40.1 against 29.7-30.2), one arrival per
  producer thread or one per tile alike: with two buffers a tile's producer now waits for both CTAs'
  consumers, and every converted chunk is also a remote store. Not kept.
ncu of the kernel as built beside FlashMLA's (H100, 2026-11-27, base clocks ~1.44 GHz, one call each):
V4-Pro CSA 128 x 4K 144.7 us against 126.9 + 4.9 (its combine), issue slots 48% / 31% busy, shared-memory
LSU wavefronts 61% / 42% of peak (our raw ring: cp.async writes, the dequantization's reads, then bf16
stores), DRAM 41% / 27% (each of a token's two 64-head CTAs reads its keys), barrier stalls 2.3 / 3.7
per issue; V4-Flash CSA 128 x 4K 46.7 against 59.8 + 4.3 (LSU 52% / 27%); the 4096-token prefill 1.06 ms,
LSU 61%, issue 48%, DRAM 15%; 8 heads CSA 128 x 4K 40.8 us, LSU 44%, barrier 3.6 per issue. No unit is
saturated: the per-tile chain bounds them. What would close V4-Pro and the prefill, by these numbers:
producers loading rows into registers and storing bf16 (no raw ring: the traffic behind 61% against
42%, and 55 KiB that would let 64-key tiles fit beside q, reading q once per 64 keys), and one
gathered tile for both 64-head halves without the remote stores the cluster build paid (above).
Both were then built on the kernel as built and measured against it (H100, 2026-11-28, same call, two
rounds each, us, new / as built), and neither is kept:
- The pair by st.async: a token's two CTAs a cluster of 2, CTA r's producers converting tiles r, r + 2,
  ... and sending each 16-B chunk and the tile mask into the other CTA's tile by st.async completing
  on its mbarrier (full: own producers' arrivals or the peer's bytes; empty: at the producing CTA, one
  arrival per consumer warpgroup of both; three buffers). It passed the 86 csrc GPU tests and was
  slower at every V4-Pro point: CSA 128 x 4K 143.8, 143.8 / 116.0, 115.9; CSA 32 x 4K 46.7 / 38.7-39.3;
  1 x 4K 15.1-15.2 / 13.2-13.3; HCA 128 x 64K 89.0-89.8 / 73.1-73.4; sliding 8 x 4K 13.1 / 11.3-11.7
  (V4-Flash controls equal). Likely (not profiled): with one tile of slack in the ring, a tile's
  producer waits for both CTAs' consumers and half the tiles arrive a remote round trip later, on
  every tile's chain, while the gather it saves is not the bound (DRAM 41%). racecheck also reports
  the st.async mask hand-off.
- Register-loading producers (each lane's 20 words of a row loaded two 32-key units ahead, no raw
  ring) with three 64-key bf16 tiles in small_heads.cu's 8- and 16-head CTAs: passed the tests and
  racecheck, slower: 8 heads CSA 128 x 4K 34.0, 33.6 / 32.5, 31.8; sliding 128 x 4K 10.0, 9.6 / 8.7,
  8.5; CSA 256 x 64K 67.7, 67.8 / 62.5, 62.7; 16 heads alike. The registers hold two units ahead
  (~37 KB an SM in flight) where the raw ring held three (~56 KB), at one CTA an SM; the 32-head CTA,
  which kept the ring but ran the same refactored gather code, was also 1-5% slower in that call, so
  part of the loss is not the design's.
Where each role's warps wait, from ncu's warp-state samples per SASS instruction mapped to source
lines (-lineinfo; H100, 2026-11-28, base clocks, one call, samples of each role's warps): V4-Pro CSA
128 x 4K: warpgroup 1 85% on barriers, 75% waiting for warpgroup 0's P; warpgroup 0 38% on barriers,
27% at the next tile's FULL (waiting for the producers) and 12% on its wgmma group; the producers'
samples are mostly their conversion (short scoreboard 22%, fixed-latency waits 21%, issuing 16%), their
gathers 9% (long scoreboard); the consumers' q load and output store, each CTA's start and end, 9% of
all samples. The 4096-token prefill alike (warpgroup 0: 23% at FULL). 8 heads CSA 128 x 4K: warpgroup
1 92% on barriers, the producers 32% on theirs. So the tiles reach warpgroup 0 late although the ring
lets the producers start a tile one to two consumer iterations ahead: the producers' per-tile work
(mostly the conversion) is on the chain. Moving registers to the producers (setmaxnreg 80, the
consumers 176; no spill reported) made the 64-head kernel much slower in the same call, V4-Pro CSA
128 x 4K 166.9-167.0 against 116.1-116.7 us, the prefill 1212-1216 against 840; the 8-32-head kernel,
whose producers run the same code with the same split, was unchanged, so the loss is the 64-head
consumers' at 176 registers (why, not profiled).
What the tiles' conversion costs, and what the consumers' chain costs (H100, 2026-11-28, each build
against the kernel as built in the same call, two rounds, us, new / as built):
- No conversion at all (the producers gather, the bf16 tiles keep stale bytes; a timing probe, wrong
  results): V4-Pro CSA 128 x 4K 108.7-110.2 / 115.1-116.9, V4-Flash CSA 128 x 4K 35.5-36.1 / 38.0-38.3,
  the prefill 809-812 / 842-847, 8 heads CSA 128 x 4K 26.0-26.1 / 31.6-32.1. So at 64 heads no change
  on the producers' side can take more than 4-7%; at 8-32 heads, up to 18%.
- Warpgroup 1 converting every tile (tile i + 2 under its P V of tile i) and the producers only
  gathering (branch wip/wg1-convert): the 86 csrc GPU tests passed; 144.4-144.7 / 115.2-115.8, Flash
  45.9-46.2 / 38.0-38.9, prefill 1060-1065 / 840-841 (8-32 heads unchanged).
- The integer e4m3 -> bf16 conversion (above) rebuilt on this kernel: bit-exact (the 86 tests), 3-14%
  slower (V4-Pro CSA 119.8-120.1 / 116.2-117.0, 8 heads 33.7-34.4 / 31.6, 8 heads sliding 9.2-9.6 /
  8.4).
- ncu (base clocks, one call each): the tensor pipe is active 37% of the cycles at V4-Pro CSA
  128 x 4K, 33% at V4-Flash CSA 128 x 4K (issue slots 45% / 39%).
- FA3-style ping-pong consumers (branch wip/seesaw): each warpgroup computes S and the softmax of
  alternate tiles and its half of every tile's P V, handing P and the running max to the other, so one
  warpgroup's softmax runs while the other's wgmmas do. A softmax under an in-flight 128-register
  accumulator needs more than the consumers' 192 registers of the 64 / 192 split (ptxas then
  serializes every wgmma), so this build has one producer warpgroup (384 threads, 72 / 216). It
  passed the 86 csrc GPU tests and was slower: V4-Pro CSA 128 x 4K 139.3-140.4 / 115.7-117.2,
  Flash 44.0-44.6 / 38.1-38.5, prefill 1033-1037 / 840-844. The same build without the conversion took 99.0-99.4 /
  116.5-116.7, Flash 34.9-35.1 / 38.6-39.0, HCA 32 x 1M 87.9-88.2 / 103.2, prefill 668-670 / 846-852.
  Without conversion the ping-pong consumers are faster than the kernel as built is (V4-Pro 99 against
  109 us, prefill 669 against 810, the probe above, an earlier call), so the loss with conversion is
  the one producer warpgroup's (read from these timings, not profiled).
- The same consumers with both producer warpgroups (branch wip/seesaw512: 512 threads, setmaxnreg 56 /
  200, the split at which ptxas keeps the wgmmas asynchronous; at 64 / 192 it serializes them): the 86
  tests passed; V4-Pro CSA 128 x 4K 119.3-120.6 / 116.0-116.5, HCA 128 x 64K 74.7-74.9 / 73.2-73.6,
  V4-Flash CSA 128 x 4K 38.7-39.3 / 38.4-38.8, HCA 32 x 1M 106.1-106.2 / 102.5, prefill 866-873 / 846,
  and 1-2% faster where a CTA has few tiles (CSA 32 x 4K 18.9 / 19.2, sliding 128 x 4K 12.9 / 13.1,
  sliding 1 x 4K 8.5 / 8.7). Waiting for each warpgroup's P V before its softmax (one wgmma group in
  flight) was slower still (120.1-120.2, prefill 885-886). Not kept: fed by two producer warpgroups at
  56 registers, the ping-pong consumers (99 us in the 384-thread build without conversion) take 120.
- What the conversion's arithmetic costs: e4m3 -> f16 and one f16x2 multiply by the scale, stored as the
  tiles' bits (2 instructions a pair of codes instead of 6 in the SASS; a timing probe, wrong results:
  the consumers still read bf16). Same call, us, probe / as built: V4-Pro CSA 128 x 4K 117.0-117.9 /
  116.8-117.7, prefill 844-852 / 843-850, sliding 128 x 4K 13.3-13.4 / 12.9-13.2; on wip/seesaw512
  113.5-114.5 and 819-827; 8 heads CSA 128 x 4K 30.1-30.2 / 32.2-32.5, 32 heads 36.0 / 37.7-38.0. So at
  64 heads the producers' arithmetic is not what makes the chain long (ncu below) (f16 tiles with q and
  P in f16, exact wherever the scales keep e4m3 x 2^e within f16, would take 0-3% there and ~6% at 8-32
  heads; not built).
ncu of the kernels as built at the sweep's worst rows (H100, 2026-11-28, base clocks 1.42-1.60 GHz,
one call each; shared-memory LSU wavefronts / bank reads / bank writes, % of peak; DRAM, SM %):
- V4-Pro CSA 128 x 4K (256 CTAs, 1.94 waves): 145 us, LSU 61 / reads 21 / writes 8, DRAM 41, SM 44,
  8.1 cycles a warp between issues; V4-Pro HCA 128 x 1M: 882 us, 70 / 24 / 9, DRAM 43, SM 49, 7.9; the
  4096-token prefill (31 waves): 1.06 ms, 61 / 21 / 9, DRAM 15, SM 47, 7.7. The busiest unit is the
  LSU's shared-memory pipe (the raw ring's copies and reads, the bf16 stores, the hand-offs), under
  its peak, and the banks are far from theirs: no unit is saturated; the per-tile chain bounds these
  rows (above), and fewer instructions a tile (the probe) do not shorten it. By the layout (derived,
  not measured), the raw ring's 592-B rows put a warp's four keys at bank offsets 0 / 80 / 32 / 112,
  so each 8-B code load takes 3 wavefronts where 2 would do: ~10% of the producers' wavefronts.
- V4-Flash sliding 256 x 64K (worst 64-head sliding row, 1.08): 37.4 us, 256 CTAs of 4 tiles in 1.94
  waves, LSU 32, DRAM 32, SM 30, 9.3 cycles between issues: each CTA's q load and output store are
  not under any other CTA's tiles; a persistent CTA taking a second token (its gather started under
  the first's last tiles) would overlap them (not built: q's 72 KiB cannot be double-buffered beside
  the tiles and the raw ring).
- V4-Flash HCA 8 x 16K (worst 64-head HCA row, 1.13): 40 CTAs (8 tokens x 5 splits, 0.30
  waves) 12.9 us, then the combine 6.8 us (512 CTAs of one (token, head), 0.65 waves, 12.7 cycles
  between issues), DRAM 4% / 9%: both latency-bound at too few keys to fill the GPU.
- 8 heads sliding 64 x 256K (worst 8-head shard row, 0.73 of FlashMLA's padded time): 64 CTAs (0.48
  waves) of 2 tiles, 12.9 us, DRAM 12%, SM 14%; the split rule keeps one split (a second costs the
  combine).
What the split combine costs in the graph, measured by not launching it (a timing probe, wrong results;
same call, two rounds, us, with / without): V4-Flash HCA 8 x 16K 13.0-13.7 / 8.7-8.9, CSA 8 x 4K
15.1-16.2 / 10.6-10.7, CSA 1 x 4K 10.9-11.1 / 7.1-7.5, HCA 1 x 1M 19.3-19.5 / 11.9-12.2, CSA 32 x 4K
19.0-19.3 / 14.7-15.0, CSA 8 x 256K 14.8 / 10.3-10.5, sliding 8 x 4K 9.7 / 7.1, 8 heads HCA 8 x 16K
8.3-8.5 / 6.2-6.3, V4-Pro HCA 8 x 16K 14.0-14.4 / 9.5-9.6: merging the splits after their last stores
costs 22-38% of every split point's time. Both kernels merge them themselves where the split plan
says so (csrc/sparse_attn/cluster_merge.cuh): a token's at most 8 splits one thread-block cluster, each
CTA staging its normalized bf16 output and log2-sums in its shared memory, split r merging heads r,
r + S, ... over distributed shared memory between two cluster barriers (no partials in global memory,
no second kernel), planned only where the grid's clusters fit the device at once
(cudaOccupancyMaxActiveClusters, `cluster_capacity`; 32 clusters of 4 whole-SM CTAs did not: CSA 32 x 4K
31.8 us against 19.0 with the combine). At 64 heads, merged / the combine, us, each build timed beside
the other in the same calls (H100, 2026-11-28, three calls): HCA 8 x 16K 11.4-11.6 / 12.9-13.3, CSA 8 x
4K 13.8-14.1 / 14.7-15.0, CSA 8 x 256K 13.8-14.1 / 14.8-15.1, V4-Pro HCA 8 x 16K 11.7-12.2 / 13.8-14.1,
V4-Pro CSA 32 x 4K 34.9-36.2 / 39.1-39.9; slower at HCA 8 x 4K (2 splits of 3 and 2 tiles) 11.5 /
10.8-10.9, one round.
What the merge costs, HCA 8 x 16K: the two cluster barriers alone (a timing probe, wrong results)
8.5-8.6, near the 8.7-8.9 without any merge; the merge's loads (~64 KB a CTA from its peers, whatever
the split count) the other ~3 us; 16-B loads took 0.6 us less than 8-B ones; reading its own split from
its own shared memory instead of over the cluster was slower (12.2 against 11.4, one round). Splits of
one tile cost about what the combine does at 64 heads (sliding 8 x 4K, 4 splits: 9.6 merged, 9.5 with it).
In small_heads.cu a CTA reads only its H heads' rows from its peers, and the consumers merge while the
producers pass the barriers (on the producers' path the merge made ptxas spill 8-24 B in their gather
loop): 8 heads HCA 8 x 16K 7.4 us merged against 8.2 with the combine, 16 heads 8.3 / 9.4, 8 heads
sliding 64 x 4K in 2 splits 7.7 against one split's 8.7 (forced counts, one call). The split plan
weighs both merges (SPLIT_COSTS); against the rule before, at the 245 sweep points where they differ
(H100, same call, two rounds each): 137 faster by over 3%, 15 slower (the worst V4-Pro HCA 32 x 4K at
128 heads, 14.3 against 12.8 us, which the final constants no longer merge), geometric mean 0.96.
FlashMLA's prefill row reads gathered bf16 keys (no conversion): the ping-pong consumers without
conversion took 669 us, 1.07x its 628.
V4.1's rows (H100, 2026-11-27): the producers dequantize 528-B window rows and 288-B FP4 entries
(csrc/sparse_attn/rows.cuh) into the same bf16 tiles, so the consumers' chain is V4's: 128 x 4K window +
512 entries 40.6 us (V4's kernel on the same keys re-encoded to 584-B rows: 38.1; FlashMLA on them:
47.9; the Triton kernel: 175; 43.0 / 40.8 / 47.7 with the split-S consumers). Reading 57% of V4's bytes
buys no time: ncu (base clocks, split-S consumers) showed the V4.1 CTA latency-bound like V4's, DRAM 22%
busy, SM 44%, 7.8 cycles a warp between issues (barrier 1.30, fixed-latency wait 1.27, short scoreboard
1.16 per issue) with one 16-warp CTA an SM. Keeping the rows in e4m3 for FP8 wgmmas would need q in e4m3
(V4 and V4.1 run QK in bf16) and is not exact for FP4 entries (an e2m1 value times an e4m3 scale has up
to 6 significant bits), so the tiles stay bf16; the time is the tile chain's (above).
Tensor-parallel shards (H100, 2026-11-27, README's sweep table): with the 64-head CTA a rank's 8 heads
cost nearly what 64 do (CSA 128 x 4K 37.0 against 41.9 us); small_heads.cu's CTA, tensor work sized to
the heads, takes 32.2 / 34.2 / 38.0 us at 8 / 16 / 32 heads, 0.62-0.74x FlashMLA's padded 51.6, and
sliding 128 x 4K 8.8 / 9.8 / 12.6 against 14.5 (the 32-head CTA, slower than the padded 64-head
one on the H200, is no longer built: `cta_heads`). It is chain-bound, not bandwidth-bound: ncu (base
clocks, 8 heads) DRAM 38% busy, SM 38%, barrier stalls 40% of the cycles between issues; taking out
the dequantization, the wgmmas or the gather (build-time experiments) saved 6.9 / 4.2 / 7.2 of 32.8 us,
so each is a link of one chain, not the bound: with two key tiles in the ring, the producers refill a
tile only after its P V, so a tile's dequantization, S and softmax, and P V follow one another (a
third tile does not fit beside four raw stages). Two CTAs an SM or a deeper bf16 ring would let them
overlap; a third tile fed by register-loading producers was slower (above, "Register-loading").
The combine (csrc/sparse_attn/combine.cu) merges a token's splits with one thread walking them while
(token, head) pairs fill the GPU, and spreads them over a CTA's warps, four loads in flight each, at few
tokens with many splits. H100, 2026-11-27, one run, walking / spread: HCA 1 x 1M 29.7 -> 14.6 us at 8
heads, 43.3 -> 17.8 at 16 (130 splits), 44.2 -> 22.0 at 32 (the 64-head CTA), 29.3 -> 23.0 at 64,
V4-Pro's 128 heads 36.9 -> 25.9 (FlashMLA: 28.7 / 26.7). The walking thread stays where it is as
fast (2 splits of CSA 64 x 4K at 32 heads: 31.3 us, 36.2 through the spreading kernel).
Tried on the split-S kernel and not kept: issuing the next tile's S before waiting for this tile's
P V (ptxas then serializes every wgmma; 51.2 us against 43.3 at CSA 128 x 4K), an integer e4m3 ->
bf16 conversion (bit-exact, 1-5% slower: the conversion math is not what bounds the producers), and
issuing the next tile's S before this tile's softmax (its wgmmas under the softmax, then P V joining
them in flight and one wait_group 0, which ptxas keeps asynchronous), slower in both forms it fits
(H100, 2026-11-27, same run, us, V4-Pro CSA 128 x 4K / V4-Flash CSA 128 x 4K): with the two bf16
tiles 153.8 / 48.4 against 130.5 / 42.3, as the consumers then hold both tiles and the producers
cannot fill ahead; with three tiles (the raw ring cut to 3 or 2 stages and the S exchange to two
8 KiB rounds to stay within 227 KiB) 135.3-137.5 / 43.6-44.8 against 129.1-129.4 / 42.2-42.3. The
kept form issues the next S after the softmax, beside P V, with three bf16 tiles. Gathering each
key's data bytes with one bulk (TMA) copy from the key's first producer lane, completing on an
mbarrier a raw stage, instead of 4-5 16-B cp.async a lane (the scales stay cp.async) passed the 85
csrc GPU tests and memcheck and took 2-4% off the split-S kernel (same run, us: V4-Pro CSA 128 x 4K
129.4 / 127.0 against 132.4 / 129.8, 8 heads CSA 128 x 4K 31.6 against 32.3, 64 heads sliding
128 x 4K 13.8 against 14.4); not kept then for a racecheck report on its tile-mask hand-off, which
is the tool's limitation below. Rebuilt on the current kernel (same call, two rounds, us, cp.async /
bulk) it passed the 85 tests and cost time on the CSA rows: V4-Pro CSA 128 x 4K 117.4, 118.4 / 119.9,
122.9, V4-Flash CSA 128 x 4K 38.7, 39.3 / 39.8, 39.9, 8 heads CSA 128 x 4K 32.4, 32.0 / 33.0, 32.3; the
sliding rows 0-3% faster (256 x 16K 33.5, 34.0 / 33.0, 33.5). Not kept.
racecheck (CUDA 13.0) reports hazards on both kernels' named-barrier hand-offs (bar.arrive ->
bar.sync counting fewer threads than the CTA: producers -> warpgroup 0, warpgroup 0 <-> 1) and on the
consumers' final bar.sync exchange after them; tests/racecheck_named_barriers.cu reproduces both on
a kernel whose synchronization is correct (the exchange alone: 0 hazards; after such hand-offs:
reported). With line info (csrc/ builds with -lineinfo; the SASS of the three sparse_attn files is the
same without it), every report on tests/sanitize_run.py's 66 paths falls on those lines (H100,
2026-11-27: 454 hazards, tests/racecheck_report.py names each line's barrier; the other 62 are in
cuBLAS's nvjet GEMMs). memcheck, synccheck and initcheck are clean on the 32 attention paths; the
GPU tests' run-to-run bitwise checks and bug injections (a hand-off read from the other buffer,
warpgroup 1's rescale dropped, the next S issued on the wrong tile: each fails them) cover the
hand-offs."""

import functools

import torch

from dsv4ops import csrc
from dsv4ops.quant import formats
from dsv4ops.sparse_attn import checks as _checks
from dsv4ops.sparse_attn import triton as _triton

KEYS_PER_TILE = 32  # csrc/sparse_attn/pipeline.cuh kKeys: a producer unit, a tile of the 64-head kernel
HEADS_PER_CTA = 64  # csrc/sparse_attn/sparse_attn.cu kHeads
SMALL_HEADS = (8, 16)  # csrc/sparse_attn/small_heads.cu: 64-key tiles (wgmma's M)
ROW_FORMATS = {"fp8_584": 0, "fp8_528": 1, "fp4_288": 2}  # csrc/sparse_attn/rows.cuh RowFormat
# (window, entries) pairs the kernel reads (rows.cuh `serves_formats`): V4, V4 with fp4 entries, V4.1,
# and V4.1's sliding layers (their entry list is empty; the window pool stands in for the entries').
FORMAT_PAIRS = {("fp8_584", "fp8_584"), ("fp8_584", "fp4_288"), ("fp8_528", "fp4_288"), ("fp8_528", "fp8_528")}


def serves(q, window_cache, comp_cache, comp_idx, window_fmt: str, comp_fmt: str, lse=None) -> bool:
    """Whether the C++ kernel serves these arguments (the Triton kernel serves the rest, a
    context-parallel shard's partial with `lse` included)."""
    return ((window_fmt, comp_fmt) in FORMAT_PAIRS and q.dtype == torch.bfloat16 and q.shape[-1] == 512
            and comp_idx.dtype == torch.int32 and window_cache.is_contiguous() and comp_cache.is_contiguous()
            and lse is None)


# The split rule's costs per kernel, keyed by its tile's keys: (us a tile of a CTA's chain takes (S,
# softmax, P V; its start and end about one more), us of the combine, bytes a us of its traffic (each
# split's bf16 partial written and read, L2-resident at these sizes), us of the merge in a cluster,
# bytes a us a CTA reads from its peers there ((S - 1) / S of its heads' 1-KiB rows), us more for such
# a grid on over 7/8 of the SMs). Fit to forced split counts, 1-6 and 8, each with the combine and
# merged in its cluster, beside the rule's count (V4-Flash at 64 / 32 / 16 / 8 heads and V4-Pro at
# 128 / 16, batch 1 / 8 / 32 / 64 x sliding 4K, CSA 4K and HCA 4K-1M: 168 points), and to an A/B of a
# first fit against the rule before at the 245 sweep points where they differed (H100, 2026-11-28),
# each point scored by its pick's time over the fastest measured:
# - sparse_attn.cu (64 heads a CTA, 32-key tiles): 1.25 us, 1.5 us, 2 TB/s, 1 us, 20 GB/s (~11 B a
#   cycle an SM: distributed shared memory), 1.5 us. Within 3% at 123 of 127 points (mean 0.3%); the
#   worst V4-Flash HCA 1 x 256K at 32 heads (70 splits 13.6 us, 35: 12.5) and V4-Pro HCA 8 x 256K at
#   128 heads (6 splits merged 25.5-26.0, 8 with the combine 24.4-24.8). The last term is
#   empirical: with splits of 3 tiles, 64 clusters of 2 took 14.2-14.3 us at HCA 64 x 4K against one
#   split's 12.8-12.9 (likely the clusters waiting for the SMs the previous kernel's tail holds under
#   PDL; not profiled), while CSA 64 x 4K's splits of 10 tiles merged in 24.2 against 32.5. The
#   constants before (1.5 us, 0.5 us, 1.5 TB/s, fit to the combine, the launch merging 2-8 splits of
#   2 tiles or more wherever their clusters fit): 100 of 127 (mean 2.2%), up to 13.5% over.
# - small_heads.cu (64-key tiles): 2 us, 0.5 us, 1 TB/s (as before), 0 us, 20 GB/s, 1.5 us: 282 of 286
#   (mean 0.2%), the worst 16 heads HCA 1 x 4K (3 splits merged 9.1 us, with the combine 8.7); with the
#   combine alone (as before): 141 of 286 (mean 4.2%), up to 19% over. Its
#   CTAs read only their H heads' rows, so the merge wins at splits of one tile too (8 heads sliding
#   64 x 4K: 2 splits merged 7.7 us, one split 8.7).
SPLIT_COSTS = {KEYS_PER_TILE: (1.25, 1.5, 2e6, 1.0, 2e4, 1.5), 2 * KEYS_PER_TILE: (2.0, 0.5, 1e6, 0.0, 2e4, 1.5)}
MAX_CLUSTER_SPLITS = 8  # csrc/sparse_attn/params.h kMaxClusterSplits: a portable cluster's CTAs


def cta_heads(heads: int) -> int:
    """Heads per CTA: small_heads.cu's 8 or 16 where they hold all the heads, else sparse_attn.cu's 64
    (17-32 heads with padding rows; more heads take several CTAs a token). small_heads.cu's 32-head
    CTA was slower than the padded 64-head one at every point measured (H200, 2026-11-28, same calls,
    two rounds each, us, 32-head / 64-head CTA, 32 heads: V4-Flash sliding 64 x 4K 12.2 / 10.8, 256 x
    4K 23.5 / 21.3; CSA 40 x 4K 23.6 / 19.7, 128 x 4K 37.1 / 34.6, 512 x 4K 138.6 / 130.5; HCA 64 x 16K
    17.6 / 14.8, 128 x 256K 105.1 / 99.3, 512 x 4K 61.3 / 51.8; V4-Pro CSA 128 x 4K 59.9 / 56.1: faster
    by 5-28% at all 198 points from 24 to 512 tokens) and is no longer built; 16 heads keep theirs
    (sliding 256 x 4K 18.3 / 20.3 us on the 64-head CTA; csrc/sparse_attn/small_heads.cu)."""
    return next((h for h in SMALL_HEADS if heads <= h), HEADS_PER_CTA)


def tile_keys(cta: int) -> int:
    """Keys of a consumer tile of the kernel with `cta` heads a CTA."""
    return KEYS_PER_TILE if cta == HEADS_PER_CTA else 2 * KEYS_PER_TILE


@functools.cache
def cluster_capacity(device: int, cta: int) -> tuple[int, ...]:
    """Clusters of s CTAs (index s; 0 below 2) of the kernel with `cta` heads a CTA that `device` holds
    at once (csrc/sparse_attn/cluster_merge.cuh `max_clusters`)."""
    csrc.load()
    with torch.cuda.device(device):
        return (0, 0) + tuple(torch.ops.dsv4_csrc.cluster_capacity(cta, s) for s in range(2, MAX_CLUSTER_SPLITS + 1))


@functools.cache  # launch-time Python: up to a few hundred candidate counts per shape
def split_plan(ctas: int, keys: int, sms: int, heads: int = HEADS_PER_CTA, tile: int = KEYS_PER_TILE,
               clusters: tuple[int, ...] = ()) -> tuple[int, bool]:
    """(splits of each key list, whether a token's splits merge in their cluster) for `ctas` CTAs (of
    `heads` heads) of one split each: none once they fill half the SMs (a second split would only add
    a wave and a merge), else the count with the least modelled time (SPLIT_COSTS): whole waves of
    (tiles of a split + one) x a tile's time, plus, for several splits, the cheaper merge: in their
    clusters, where 2-8 splits' clusters all fit the device at once (`clusters`: cluster_capacity),
    or by the combine kernel with its partials' traffic. Counts the launcher's rounding to whole
    tiles would change are not candidates; the smaller count on a tie. CSA 8 x 4K (20 tiles) at 64
    heads: 7 splits of 3 tiles merged in their clusters. HCA 32 x 1M (8320 keys, 132 SMs): 4 splits
    through the combine, one wave of 65 tiles a CTA (one split per 1024 keys, the Triton kernel's
    rule, made 3 waves of 29: 211 us). A sliding window of 4 tiles at batch 32 stays whole at 64 heads:
    2 splits took 13.1-13.4 us with the combine against 11.3-11.6 (H100, bf16 partials)."""
    if ctas >= sms // 2:
        return 1, False
    tiles = -(-keys // tile)
    rows = heads * 512 * 2  # bytes of a CTA-split's bf16 output
    tile_us, combine_us, partial_bytes_per_us, merge_us, peer_bytes_per_us, full_us = SPLIT_COSTS[tile]

    def cost(s: int) -> tuple[float, bool]:
        chain = -(-ctas * s // sms) * (-(-tiles // s) + 1) * tile_us
        if s == 1:
            return chain, False
        combine = combine_us + ctas * s * 2 * rows / partial_bytes_per_us  # written, then read back
        merge = merge_us + (s - 1) / s * rows / peer_bytes_per_us + (full_us if ctas * s > sms * 7 // 8 else 0.0)
        if s <= MAX_CLUSTER_SPLITS and s < len(clusters) and ctas <= clusters[s] and merge < combine:
            return chain + merge, True
        return chain + combine, False

    counts = [s for s in range(1, tiles + 1) if -(-tiles // -(-tiles // s)) == s]
    best = min(counts, key=lambda s: (cost(s)[0], s))
    return best, cost(best)[1]


def sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out,
                scale: float, window: int, ring_size: int, window_fmt: str, comp_fmt: str, lse=None) -> None:
    """Launcher of `dsv4::sparse_attn` (same arguments)."""
    if not serves(q, window_cache, comp_cache, comp_idx, window_fmt, comp_fmt, lse):
        _triton.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends,
                            sinks, out, scale, window, ring_size, window_fmt, comp_fmt, lse)
        return
    _checks.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out,
                        scale, window, ring_size, window_fmt, comp_fmt)
    csrc.load()
    t, h, _ = q.shape
    ends = positions if window_ends is None else window_ends
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    cta = cta_heads(h)
    tile = tile_keys(cta)
    window_keys = -(-window // KEYS_PER_TILE) * KEYS_PER_TILE
    keys = window_keys + comp_idx.shape[1]
    ctas = t * -(-h // cta)
    clusters = cluster_capacity(q.device.index, cta) if ctas < sms // 2 else ()
    n_split, merge = split_plan(ctas, keys, sms, min(h, cta), tile, clusters)
    split_keys = -(-keys // n_split // tile) * tile
    n_split = -(-keys // split_keys)
    merge = merge and n_split > 1
    if n_split > 1 and not merge:  # the combine's workspaces
        partial = torch.empty(t * n_split * h, q.shape[-1], dtype=torch.bfloat16, device=q.device)
        split_lse = torch.empty(t * n_split * h, dtype=torch.float32, device=q.device)
    else:
        partial = split_lse = out  # unused
    wb, cb = formats.block_size(window_cache.shape, window_fmt), formats.block_size(comp_cache.shape, comp_fmt)
    torch.ops.dsv4_csrc.sparse_attn(q, window_cache, comp_cache, ends, req_slots, comp_idx.contiguous(), comp_lens,
                                    sinks, out, partial, split_lse, scale, window, ring_size, ROW_FORMATS[window_fmt],
                                    ROW_FORMATS[comp_fmt], wb, cb, formats.get(window_fmt).page_bytes(wb),
                                    formats.get(comp_fmt).page_bytes(cb), window_keys, split_keys, n_split, cta,
                                    merge)
