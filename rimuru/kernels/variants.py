"""Which small-batch decode kernel variants the wrappers launch (issue 11, waves 5 and 7), for A/B runs in one process.

Levers (``baseline``: none, the wave-4 kernels; ``fast``, the default: the eight that measured faster on the H200,
``direct_moe``, ``qkv_fused``, ``gemv``, ``pdl``, ``pdl_chain``, ``moe_gemv``, ``align_par`` and ``nosplit_full``;
``wave5``: the wave-5 default, ``direct_moe`` and ``qkv_fused``; ``all``: every one):

* ``merge``: split-KV decode merges its splits inside the decode kernel (the last split of a request and KV head
  to finish merges; no ``decode_reduce_kernel`` launch); off (2x H200 at 5096965, 48 layers: TP=1 -0.065 ms at 64
  running and TP=2 unchanged, TP=2 -0.037 / TP=1 +0.019 at 256: mixed; results/reference/e2e_tp2/levers_48L/);
* ``direct_moe``: the fused MoE builds its expert-grouped schedule from the top-k ids inside the kernel for
  small batches (no ``moe_align`` launch);
* ``qkv_fused``: q/k RMSNorm + RoPE and the KV write in one launch per layer (not two ``norm_rope`` and a
  ``write_kv``);
* ``router_fused``: the router GEMV and the top-k softmax in one launch for small batches;
* ``small_gemm``: the attention's qkv and output projections of a few rows through a Triton kernel without
  split-K (cuBLAS launches a GEMM and a split-K reduction for the output projection at batch 1);
* ``gemv`` (wave 7): the attention's qkv and output projections and the router's logits of at most 4 rows through a
  Triton matrix-vector kernel (``rimuru/kernels/small_linear.py``: whole-K rows per program, no tensor cores, no
  split-K), instead of cuBLAS;
* ``pdl`` (wave 7, with ``gemv``): those projections launched as programmatic dependents (``rimuru/kernels/pdl.py``):
  their weight loads start while the kernel before them (``add_rms_norm``, the attention's merge) still runs, which
  signals its dependents at its start;
* ``pdl_chain`` (wave 7): every Triton kernel of a decode layer (``add_rms_norm``, the projections, q/k norm + RoPE
  + KV write, decode attention and its merge, top-k softmax, both fused-MoE launches) launched as a programmatic
  dependent of the one before it: it waits for it at its start and then lets the next one launch, so each launch's
  latency hides behind the kernel before it;
* ``moe_gemv`` (wave 7): one token's experts (decode at batch 1) as matrix-vector products
  (``rimuru/kernels/fused_moe.py``, ``moe_gemv_kernel``: whole-K rows per program, no 16-row ``tl.dot`` padding);
* ``gemv_le2`` (wave 7, with ``gemv``, off by default): the gemv only for projections of at most
  ``small_linear.GEMV_NARROW_ROWS`` (2) rows, cuBLAS above (the gemv took 1,447 us a 48-layer step at 4 rows against
  cuBLAS's 1,188, results/reference/engine/run_38fd399_48L/): the row limit A/B'd on the device;
* ``moe_gemv_host`` (off by default): ``moe_gemv`` also where misses are read in place from host pages (the
  offloading policies' graphs), as at ``f7b685e``; without it those launches keep the tiled kernel
  (``fused_moe.moe_gemv``), for a same-call A/B;
* ``align_par`` (issue 13 wave 8): ``moe_align`` of a batch past its fused-scatter limit (33-256 tokens at top-8) in
  one launch of many programs (``moe_align_parallel_kernel``) instead of a one-program count and a scatter launch
  (2x H200 at e0383b6, one layer's alignment alone, 48 in a graph: 6.24 vs 9.99 us at 64 tokens, 9.24 vs 10.14 at
  128; results/reference/e2e_tp2/align_vocab_48L/routing);
* ``router_tiles`` (issue 13 wave 8, off: measured slower): the router GEMM and the top-k softmax of 17-256 tokens in
  one launch (``norm_rope.router_tiles_kernel``: ``tl.dot`` tiles of 16 tokens x 16 experts, the last program of a
  token block picks its top-k) instead of cuBLAS's GEMM and ``topk_softmax`` (2x H200 at 4902a34, one layer alone:
  11.8 vs 8.2 us at 64 and 128 tokens; results/reference/e2e_tp2/default_48L/);
* ``wide_gemm`` (issue 13 wave 8, off: measured slower): the attention's qkv and output projections of 17-128 rows
  through ``small_linear.wide_linear`` (all rows in one ``tl.dot`` tile, 32 output columns a program, no split-K)
  instead of cuBLAS (2x H200 at 4902a34: 7.5-7.7 vs 6.2-6.5 us at a TP=2 rank's shapes and 64 rows, 11.3-21.5 vs
  6.6-9.8 us elsewhere; results/reference/e2e_tp2/default_48L/);
* ``pdl_wide`` (issue 13 wave 9, off: measured no gain for the step ratio): ``pdl_chain`` at every
  decode batch size, not only at most ``pdl.PDL_MAX_ROWS`` rows, and the flag-free fused all-reduce kernel
  (``lamport_add_rms_norm_kernel``, the tensor-parallel sub-layer end) in the chain too (without it that kernel breaks
  the chain at every batch size). 2x H200 at 5096965, 48 layers: TP=2 -0.020 ms at 64 running but +0.078 at 256, TP=1
  -0.076 / +0.272 (the step ratio worse at 64); bit-identical greedy tokens; a killed-rank check with it hung once
  (levers_48L/) and reported in 5.2 s once (kill_0d4539f/), where the default's control ran out of time;
* ``slice_tiles`` (issue 13 wave 9, off: measured no gain, TP=2 +0.025 ms at 64 running, -0.014 at 256 within the
  spread; results/reference/e2e_tp2/levers_48L/): a fused-MoE shape without a tuned table that is a
  tensor-parallel slice of a tuned one (Qwen3-30B-A3B's experts at TP=2: intermediate 384 of 768) takes the full
  width's tiles by token count (``fused_moe.slice_table``) instead of the generic rows-per-expert rule, which picks
  64-row blocks from 256 tokens at top-8 where the tuned table keeps 16- and 32-row blocks up to 511;
* ``nosplit_full`` (issue 13 wave 11, in ``fast``): the split-KV decode keeps one split when the unsplit grid
  (requests x KV heads) already runs ``paged_attention.FULL_GRID_PER_SM`` (3) programs per SM
  (``paged_attention.split_count``): at TP=2 a rank's 2 KV heads x 256 requests fell just under the 4-per-SM target
  and split in two, adding a merge launch per layer (235 us a 48-layer step, results/reference/e2e_tp2/wave11_8452ced/).
  2x H200 at 5b77161, 48 layers, same-process A/B x4: TP=2 at 256 running 11.309 -> 11.060 ms, TP=1 at 128 (512
  programs too) 16.248 -> 15.997 ms, ranges separated; every other cell (64 running, TP=1 at 256, TP=2 at 128) within
  0.01 ms; TP=2 greedy tokens identical with and without it (results/reference/e2e_tp2/nosplit_5b77161/);
* ``pdl_eager`` (off by default): the programmatic-launch levers act outside CUDA graphs too (see below): the
  engine as measured at 38fd399, for an eager A/B.

Programmatic launches act only in CUDA graphs (``GRAPH_ONLY``: ``pdl``, ``pdl_chain``): a kernel launched inside
:func:`for_graphs` (a graph's capture and the eager pass before it that compiles what the capture launches) takes
them, any other launch does not, unless ``pdl_eager`` is on. Their gain is the launch latency a kernel hides behind
the one before it, which needs the GPU to be behind the host; an eager decode step at <= 32 rows
(``pdl.PDL_MAX_ROWS``) is host-bound (48 layers on the H200: 46-77 ms eager against 2.8-11 ms replayed), so each
kernel is launched after its predecessor ended and there is nothing to hide, while the attribute still goes to the
driver and every kernel still runs its ``griddepcontrol`` instructions. The decision is made once per capture by
its owner (:class:`rimuru.engine.cuda_graphs.DecodeGraphs` and the scripts that capture), never per launch; the
results are bit-equal either way (they only move when a kernel may start).

CUDA graphs keep the levers that were on when they were captured (``workflow/scripts/profile_decode_gpu.py
--ab`` captures one graph per variant and replays them alternately). The default comes from
``RIMURU_DECODE_KERNELS``: ``fast``, ``baseline`` or a comma-separated list of levers; :func:`use` switches it
for a block.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

LEVERS = ("merge", "direct_moe", "qkv_fused", "router_fused", "small_gemm", "gemv", "pdl", "pdl_chain", "moe_gemv",
          "gemv_le2", "moe_gemv_host", "pdl_eager", "align_par", "router_tiles", "wide_gemm", "pdl_wide",
          "slice_tiles", "nosplit_full")
# The levers that measured faster (H200, 48 layers: results/reference/engine/run_2445415_48L/ab_* for the wave-5 two,
# run_38fd399_48L/ for the wave-7 four; align_par: results/reference/e2e_tp2/align_vocab_48L/; nosplit_full:
# results/reference/e2e_tp2/nosplit_5b77161/): the others made their kernels slower than what they replace and are
# off unless asked for (``all`` or by name).
WAVE5 = ("direct_moe", "qkv_fused")
FAST = WAVE5 + ("gemv", "pdl", "pdl_chain", "moe_gemv", "align_par", "nosplit_full")
VARIANTS = ("fast", "wave5", "baseline", "all")
GRAPH_ONLY = ("pdl", "pdl_chain")  # act only on launches inside for_graphs() (or with pdl_eager)


def parse(spec: str) -> frozenset[str]:
    """``fast`` (the levers that measured faster), ``wave5`` (wave 5's default), ``all`` (every lever), ``baseline``
    (none) or levers separated by commas, ``fast`` / ``wave5`` among them standing for their levers
    (``wave5,gemv``)."""
    if spec == "fast":
        return frozenset(FAST)
    if spec == "wave5":
        return frozenset(WAVE5)
    if spec == "all":
        return frozenset(LEVERS)
    if spec in ("baseline", ""):
        return frozenset()
    levers = set()
    for s in spec.split(","):  # "fast" / "wave5" inside a list: their levers plus the others named
        s = s.strip()
        levers |= {"fast": set(FAST), "wave5": set(WAVE5)}.get(s, {s})
    levers = frozenset(levers)
    unknown = sorted(levers - set(LEVERS))
    if unknown:
        raise ValueError(f"unknown kernel lever(s) {unknown}: use fast, baseline, all or a list of fast and "
                         f"{', '.join(LEVERS)}")
    return levers


_current = parse(os.environ.get("RIMURU_DECODE_KERNELS", "fast"))
_graphs = False  # inside for_graphs(): the kernels launched now belong to a CUDA graph


def on(lever: str) -> bool:
    """Whether ``lever`` acts on the kernel launched now: on in the current variant and, for a ``GRAPH_ONLY``
    lever, inside :func:`for_graphs` (or with ``pdl_eager``)."""
    if lever not in LEVERS:
        raise ValueError(f"unknown kernel lever {lever!r}")
    return lever in _current and (lever not in GRAPH_ONLY or _graphs or "pdl_eager" in _current)


@contextmanager
def for_graphs() -> Iterator[None]:
    """The kernels launched inside build a CUDA graph (its capture, and the eager pass before it that compiles what
    the capture will launch): the ``GRAPH_ONLY`` levers act. Entered once per capture by the capture's owner."""
    global _graphs
    before, _graphs = _graphs, True
    try:
        yield
    finally:
        _graphs = before


def current() -> str:
    if _current == frozenset(FAST):
        return "fast"
    if _current == frozenset(WAVE5):
        return "wave5"
    return "all" if _current == frozenset(LEVERS) else ",".join(sorted(_current)) or "baseline"


def select(spec: str) -> None:
    """Launch ``spec``'s kernels from now on in this process (a run-time switch made by its owner: an A/B's driver,
    or a tensor-parallel worker told by rank 0; CUDA graphs captured before keep their kernels)."""
    global _current
    _current = parse(spec)


@contextmanager
def use(spec: str) -> Iterator[None]:
    """Launch ``spec``'s kernels inside the block (CUDA graphs captured inside keep them)."""
    global _current
    levers = parse(spec)
    before, _current = _current, levers
    try:
        yield
    finally:
        _current = before


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype``: fp32 means fp32 (IEEE; Triton's GPU default would
    be TF32), anything else ``tf32`` (which 16-bit inputs ignore). Every kernel with a ``DOT_PRECISION``."""
    return "ieee" if dtype == torch.float32 else "tf32"
