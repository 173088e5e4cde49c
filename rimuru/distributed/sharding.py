"""Which slice of each dense tensor a tensor-parallel rank keeps, decided from the tensor's hub name.

Megatron-style: q/k/v and MLP gate/up projections are split by output rows (column parallel), o_proj and
MLP down projections by input columns (row parallel), so each rank's attention and MLP outputs are partial
sums that one all-reduce completes. Attention heads split evenly; KV heads split when there are at least
as many as ranks, otherwise each KV head is replicated on ``world / kv_heads`` ranks (rank ``r`` keeps KV
head ``r // (world / kv_heads)``, the head its query heads read), as vLLM does. Routed experts are split
along the intermediate dim in the host store (``HostExpertStore``), so each rank's expert pages hold its
slice. Everything else — embeddings, LM head, norms, q/k norms, the router, the shared-expert gate — is
replicated. A bias of a row-parallel projection stays on rank 0 only (zeros elsewhere: same bytes on every
rank, so every rank's pool has the same size).
"""

from __future__ import annotations

import re

import torch

from rimuru.distributed.comm import Shard
from rimuru.models.spec import ModelSpec

_ATTN = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")
_MLP = re.compile(r"\.mlp\.(shared_expert\.)?(gate_proj|up_proj|down_proj)\.weight$")
_LINEAR_ATTN = re.compile(r"\.linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|conv1d|A_log|dt_bias|norm"
                          r"|out_proj)(\.weight|\.bias)?$")


# What vocab_parallel_head=None (auto) gives a plain MoE model at TP > 1. On since wave 8: on 2x H200, 48 layers, one
# engine switched at run time (results/reference/e2e_tp2/align_vocab_48L/), the step took 0.065 ms (64 running) and
# 0.090 ms (128) less with it, separated ranges; fp32 greedy identical to TP=1, a killed rank reported in 0.63 s.
VOCAB_PARALLEL_AUTO = True


def vocab_parallel(setting: bool | None, spec: ModelSpec, world: int) -> bool:
    """Whether the LM head is vocabulary-parallel at ``world`` ranks: ``setting`` (``EngineConfig.vocab_parallel_head``)
    True or False as given; None (auto) ``VOCAB_PARALLEL_AUTO`` where it can be (a plain MoE model whose vocabulary
    divides by ``world``). Never on one rank."""
    if world == 1:
        return False
    if setting is None:
        return VOCAB_PARALLEL_AUTO and not spec.is_hybrid and spec.vocab_size % world == 0
    return bool(setting)


def check_shardable(spec: ModelSpec, shard: Shard, vocab_parallel: bool | None = False) -> None:
    """Clear errors for a model that cannot be split ``shard.world`` ways (``vocab_parallel`` True: its LM head too;
    None, auto, asks for nothing: :func:`vocab_parallel` leaves the head replicated where it cannot be split)."""
    w = shard.world
    if w == 1:
        return
    if vocab_parallel and spec.is_hybrid:
        raise ValueError("vocab_parallel_head is not supported for hybrid (linear-attention) models yet")
    problems = []
    if vocab_parallel and spec.vocab_size % w:
        problems.append(f"vocabulary of {spec.vocab_size} (vocab_parallel_head)")
    if spec.is_hybrid:
        if spec.linear_num_key_heads % w:
            problems.append(f"{spec.linear_num_key_heads} linear-attention key heads")
        if spec.linear_num_value_heads % w:
            problems.append(f"{spec.linear_num_value_heads} linear-attention value heads")
    if spec.num_heads % w:
        problems.append(f"{spec.num_heads} attention heads")
    kv = spec.num_kv_heads
    if kv % w and w % kv:
        problems.append(f"{kv} KV heads (neither divides the other)")
    if spec.moe_intermediate_size % w:
        problems.append(f"expert intermediate size {spec.moe_intermediate_size}")
    if spec.shared_expert_intermediate_size % w:
        problems.append(f"shared expert intermediate size {spec.shared_expert_intermediate_size}")
    if spec.intermediate_size % w and len(spec.moe_layers) < spec.num_layers:
        problems.append(f"dense MLP intermediate size {spec.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={w} does not divide {spec.model_type}'s " + ", ".join(problems))


def local_heads(spec: ModelSpec, shard: Shard) -> tuple[int, int]:
    """(query heads, KV heads) on one rank (``ModelSpec.heads_per_rank``)."""
    return spec.heads_per_rank(shard.world)


def shard_dense_tensor(name: str, t: torch.Tensor, spec: ModelSpec, shard: Shard) -> torch.Tensor:
    """This rank's part of one dense (non-routed-expert) tensor, contiguous."""
    if shard.world == 1:
        return t
    if ".linear_attn." in name:
        return _shard_linear_attention(name, t, spec, shard)
    if m := _ATTN.search(name):
        proj, kind = m.groups()
        if proj == "q_proj":
            return t[shard.rows(t.shape[0], f"{name} rows")].contiguous()
        if proj in ("k_proj", "v_proj"):
            kv, w = spec.num_kv_heads, shard.world
            if kv >= w:
                return t[shard.rows(t.shape[0], f"{name} rows")].contiguous()
            head = shard.rank // (w // kv)
            size = t.shape[0] // kv
            return t[head * size:(head + 1) * size].contiguous()
        # o_proj: input columns by head; its bias is added once (rank 0)
        if kind == "bias":
            return t.clone() if shard.rank == 0 else torch.zeros_like(t)
        return t[:, shard.rows(t.shape[1], f"{name} columns")].contiguous()
    if m := _MLP.search(name):
        if m.group(2) == "down_proj":
            return t[:, shard.rows(t.shape[1], f"{name} columns")].contiguous()
        return t[shard.rows(t.shape[0], f"{name} rows")].contiguous()
    return t


def _shard_linear_attention(name: str, t: torch.Tensor, spec: ModelSpec, shard: Shard) -> torch.Tensor:
    """A Gated DeltaNet layer split by heads: rank ``r`` keeps key heads ``[r·h/N, (r+1)·h/N)`` and value heads
    ``[r·hv/N, (r+1)·hv/N)`` — the value heads that read exactly those key heads (value head ``j`` reads key head
    ``j // (hv/h)``). ``in_proj_qkv`` rows and ``conv1d`` channels are ``[q | k | v]``, so a rank keeps its slice of
    each of the three parts; ``in_proj_z``/``in_proj_b``/``in_proj_a``, ``A_log`` and ``dt_bias`` go by value
    head; ``out_proj`` by input columns (a partial sum that the layer's all-reduce completes); the gated
    RMSNorm weight (one per value-head channel) is replicated. The rank's SSM pages then hold its value heads'
    states and its conv rows its channels (``PoolLayout.build(tp=N)``)."""
    m = _LINEAR_ATTN.search(name)
    if m is None:
        raise ValueError(f"{name}: no tensor-parallel split for this linear-attention tensor")
    part = m.group(1)
    key_dim = spec.linear_num_key_heads * spec.linear_key_head_dim
    value_dim = spec.linear_num_value_heads * spec.linear_value_head_dim
    if part in ("in_proj_qkv", "conv1d"):  # [q | k | v] rows (channels)
        if t.shape[0] != 2 * key_dim + value_dim:
            raise ValueError(f"{name}: {t.shape[0]} rows, expected {2 * key_dim + value_dim} (q, k, v)")
        q, k, v = torch.split(t, [key_dim, key_dim, value_dim], dim=0)
        return torch.cat([q[shard.rows(key_dim, f"{name} q rows")], k[shard.rows(key_dim, f"{name} k rows")],
                          v[shard.rows(value_dim, f"{name} v rows")]]).contiguous()
    if part == "norm":
        return t
    if part == "out_proj":
        return t[:, shard.rows(t.shape[1], f"{name} columns")].contiguous()
    return t[shard.rows(t.shape[0], f"{name} rows")].contiguous()  # in_proj_z / _b / _a, A_log, dt_bias
