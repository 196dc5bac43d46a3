"""Builders of the sglang layout, one per module kind: vocab, GQA and MLA attention, MLPs, MoE.

Each builder appends the parameters of one module, in sglang's names and shapes, to a
:class:`LayerBuilder`. The builder turns *segments* (a box of a global tensor placed at a box
of the local tensor) into :class:`~weightsync.layout.box.Piece` records, and adds the fp8 scale
tensor of every block-quantized weight.

Where each layout comes from (sgl-project/sglang, python/sglang/srt/layers/):

* ``linear.py`` QKVParallelLinear: local rows = [q rows of this rank's heads; k rows; v rows];
  when attention-TP >= kv heads each rank holds one kv head, number
  ``tp_rank // (tp_size // num_kv_heads)`` (``num_kv_head_replicas``); otherwise
  ``num_kv_heads / tp`` consecutive heads. MergedColumnParallelLinear ``gate_up_proj`` =
  [gate shard; up shard]. RowParallelLinear splits the input (column) dim.
* ``moe/fused_moe_triton/layer.py`` FusedMoE: local experts ``[ep_rank * E_l, (ep_rank+1) * E_l)``
  (``_map_global_expert_id_to_local_expert_id``), then, with shared-experts fusion, the shared
  expert; ``w13_weight[E_l, 2 * I_l, H]`` = per expert [w1 (gate) rows ``t * I_l ...``; w3 (up)
  rows], ``w2_weight[E_l, H, I_l]`` (``_load_w13``, ``_load_w2`` narrow by ``moe_tp_rank``).
* ``quantization/fp8.py``: block-quantized linear weights are float8_e4m3fn with a float32
  ``weight_scale_inv[ceil(out_l / bn), ceil(in_l / bk)]``; Fp8MoEMethod holds
  ``w13_weight_scale_inv[E_l, 2 * ceil(I_l / bn), ceil(H / bk)]`` and
  ``w2_weight_scale_inv[E_l, ceil(H / bn), ceil(I_l / bk)]``. Splits must keep whole blocks.
* ``quantization/kv_cache.py``: with fp8 (``Fp8Config.get_quant_method`` of a ``RadixAttention``)
  MLA's ``attn_mqa`` and ``attn_mha`` each hold float32 scalars ``k_scale`` and ``v_scale``,
  1.0 after load (constant parameters here; GQA families build their attention without the
  quant config, so without them).
* ``models/deepseek_v2.py``: ``fused_qkv_a_proj_with_mqa`` = cat(q_a_proj, kv_a_proj_with_mqa)
  rows, scales concatenated the same way (``load_weights``); ``w_kc[h_l, qk_nope, kv_lora]`` and
  ``w_vc[h_l, kv_lora, v_head]`` split from ``kv_b_proj`` (``post_load_weights``).
* ``attention/dsa/dsa_indexer.py`` Indexer: replicated ``wq_b``, ``wk`` and ``weights_proj``
  (bfloat16), or their fusion ``wk_weights_proj`` (option ``dsa_indexer_fusion``), and a
  ``LayerNorm`` ``k_norm`` whose weight and bias are float32.

Legend: ``H`` hidden, ``I`` intermediate, ``E`` experts, ``*_l`` local (per-rank) size,
``s`` attention-TP rank, ``t`` moe-TP rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from weightsync.layout.box import Box, LocalTensor, Piece, full_box
from weightsync.layout.sglang_coords import EngineCoords, VocabShard
from weightsync.layout.sglang_options import LayoutOptions
from weightsync.models.hf import is_fp8_linear
from weightsync.models.parallel import RolloutParallel
from weightsync.models.spec import Family, ModelSpec

FP8 = "float8_e4m3fn"
SCALE_DTYPE = "float32"
KV_SCALE = 1.0
"""sglang's ``Fp8KVCacheMethod.process_weights_after_loading`` value of ``k_scale`` / ``v_scale``
absent from the checkpoint."""
INDEXER_PROJ_DTYPE = "bfloat16"
"""The DSA indexer's ``weights_proj`` / ``wk_weights_proj`` (``ReplicatedLinear(params_dtype=torch.bfloat16)``)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class Seg:
    """``gbox`` of global tensor ``gname`` (of shape ``gshape``) sits at ``lbox`` of a local tensor."""

    gname: str
    gshape: tuple[int, ...]
    gbox: Box
    lbox: Box


def row_seg(gname: str, gshape: tuple[int, ...], g0: int, g1: int, l0: int, lead: Box = ()) -> Seg:
    """Rows ``[g0, g1)`` of a global tensor (all other dims whole) placed at local row ``l0``."""
    rest = tuple((0, d) for d in gshape[1:])
    return Seg(gname, gshape, ((g0, g1), *rest), (*lead, (l0, l0 + g1 - g0), *rest))


def col_seg(gname: str, gshape: tuple[int, ...], g0: int, g1: int, lead: Box = ()) -> Seg:
    """Columns ``[g0, g1)`` of a 2-D global tensor: a row-parallel weight's local shard."""
    return Seg(gname, gshape, ((0, gshape[0]), (g0, g1)), (*lead, (0, gshape[0]), (0, g1 - g0)))


class LayerBuilder:
    """Collects one rank's local tensors; adds fp8 scale tensors for block-quantized weights."""

    def __init__(self, spec: ModelSpec, options: LayoutOptions) -> None:
        self.spec = spec
        self.options = options
        self.tensors: list[LocalTensor] = []

    def replicated(self, name: str, shape: tuple[int, ...] | None = None, dtype: str | None = None) -> None:
        """A tensor every rank holds whole, named as its global tensor (default shape ``[H]``)."""
        shape = shape if shape is not None else (self.spec.hidden_size,)
        self.emit(name, shape, [Seg(name, shape, full_box(shape), full_box(shape))], dtype)

    def constant(self, name: str, shape: tuple[int, ...], dtype: str, value: float) -> None:
        """A parameter the engine holds at ``value`` and no update writes (no pieces)."""
        self.tensors.append(LocalTensor(name=name, shape=shape, dtype=dtype, pieces=(), constant=value))

    def derived(self, name: str, shape: tuple[int, ...]) -> None:
        """A tensor the engine recomputes after an update (no pieces, never written by a plan)."""
        self.tensors.append(LocalTensor(name=name, shape=shape, dtype=self.spec.dtype, pieces=(), derived=True))

    def emit(self, name: str, shape: tuple[int, ...], segs: list[Seg], dtype: str | None = None) -> None:
        """Append local tensor ``name``; when its weights are fp8 block-quantized, its scale tensor too."""
        quant = [is_fp8_linear(self.spec, s.gname) for s in segs]
        if segs and any(quant) != all(quant):
            raise AssertionError(f"{name}: mixes fp8-quantized and unquantized global tensors")
        if not (segs and quant[0]):
            self.tensors.append(_local(name, shape, dtype or self.spec.dtype, segs))
            return
        self.tensors.append(_local(name, shape, FP8, segs))
        assert self.spec.fp8_block is not None
        bn, bk = self.spec.fp8_block
        lead = shape[:-2]
        scale_shape = (*lead, _cdiv(shape[-2], bn), _cdiv(shape[-1], bk))
        scale_segs = [self._scale_seg(name, shape, s) for s in segs]
        self.tensors.append(_local(name + "_scale_inv", scale_shape, SCALE_DTYPE, scale_segs))

    def _scale_seg(self, name: str, lshape: tuple[int, ...], seg: Seg) -> Seg:
        """The scale blocks of a weight segment; refuses a segment that cuts a quantization block."""
        block = self.spec.fp8_block
        assert block is not None
        extra = len(seg.lbox) - len(seg.gbox)
        try:
            gbox, lbox = _scale_boxes(seg.gbox, seg.gshape, seg.lbox[extra:], lshape[extra:], block)
        except _BlockCut as cut:
            dim, (g0, g1), (l0, l1) = cut.args
            raise Fp8BlockCut(
                f"{self.spec.name}: fp8 block {block} is cut by {name}: it holds {seg.gname}[{g0}:{g1}] (dim {dim}) "
                f"at local [{l0}:{l1}]; sglang needs every shard of a block-quantized weight to hold whole blocks "
                f"(choose a tp/ep whose splits are multiples of {block[dim]})"
            ) from None
        gshape = tuple(_cdiv(d, b) for d, b in zip(seg.gshape, block, strict=True))
        return Seg(seg.gname + "_scale_inv", gshape, gbox, (*seg.lbox[:extra], *lbox))


class _BlockCut(Exception):
    """A weight segment that does not hold whole fp8 blocks: ``(dim, global range, local range)``."""


class Fp8BlockCut(ValueError):
    """A layout whose shards cut fp8 quantization blocks (sglang refuses it); the message names the
    tensor, or the MoE size, and the block."""


@functools.lru_cache(maxsize=4096)
def _scale_boxes(gbox: Box, gshape: tuple[int, ...], lbox: Box, lshape: tuple[int, ...],
                 block: tuple[int, int]) -> tuple[Box, Box]:
    """Block-index boxes of a 2-D weight segment (cached: every expert repeats the same numbers).

    A segment's ends must fall on block edges, except where it ends both its global and its local
    tensor (the last, partial block of both).
    """
    gout: list[tuple[int, int]] = []
    lout: list[tuple[int, int]] = []
    for dim, b in enumerate(block):
        (g0, g1), (l0, l1) = gbox[dim], lbox[dim]
        at_end = g1 == gshape[dim] and l1 == lshape[dim]
        if g0 % b or l0 % b or ((g1 % b or l1 % b) and not at_end):
            raise _BlockCut(dim, (g0, g1), (l0, l1))
        gout.append((g0 // b, _cdiv(g1, b)))
        lout.append((l0 // b, _cdiv(l1, b)))
    return tuple(gout), tuple(lout)


def _local(name: str, shape: tuple[int, ...], dtype: str, segs: list[Seg]) -> LocalTensor:
    pieces = tuple(Piece(s.gname, s.gbox, s.lbox) for s in segs)
    return LocalTensor(name=name, shape=shape, dtype=dtype, pieces=pieces)


def build_vocab(b: LayerBuilder, name: str, gname: str, shard: VocabShard) -> None:
    """An embedding or lm_head: this rank's vocab rows, padding rows without pieces."""
    h = b.spec.hidden_size
    gshape = (b.spec.vocab_size, h)
    segs = [row_seg(gname, gshape, shard.start, shard.stop, 0)] if shard.stop > shard.start else []
    b.emit(name, (shard.rows, h), segs)


def build_attention(b: LayerBuilder, c: EngineCoords, p: str) -> None:
    """The ``self_attn`` parameters of layer prefix ``p`` (``model.layers.{i}.``)."""
    if b.spec.is_mla:
        _mla_attention(b, c, p + "self_attn.")
    else:
        _gqa_attention(b, c, p + "self_attn.")


def kv_head_range(spec: ModelSpec, c: EngineCoords) -> tuple[int, int]:
    """The global kv heads ``[first, last)`` an attention-TP rank holds (QKVParallelLinear)."""
    tp, s, kv = c.attn_tp_size, c.attn_tp_rank, spec.num_kv_heads
    if tp >= kv:
        first = s // (tp // kv)
        return first, first + 1
    per = kv // tp
    return s * per, (s + 1) * per


def _gqa_attention(b: LayerBuilder, c: EngineCoords, a: str) -> None:
    spec = b.spec
    d, h = spec.head_dim, spec.hidden_size
    s = c.attn_tp_rank
    nh_l = spec.num_attention_heads // c.attn_tp_size
    kv0, kv1 = kv_head_range(spec, c)
    nkv_l = kv1 - kv0
    nq, nkv = spec.num_attention_heads * d, spec.num_kv_heads * d
    q_rows = (s * nh_l * d, (s + 1) * nh_l * d)
    kv_rows = (kv0 * d, kv1 * d)
    out_l = (nh_l + 2 * nkv_l) * d
    for kind in ("weight", "bias") if spec.attention_bias else ("weight",):
        tail = (h,) if kind == "weight" else ()
        segs = [
            row_seg(f"{a}q_proj.{kind}", (nq, *tail), *q_rows, 0),
            row_seg(f"{a}k_proj.{kind}", (nkv, *tail), *kv_rows, nh_l * d),
            row_seg(f"{a}v_proj.{kind}", (nkv, *tail), *kv_rows, (nh_l + nkv_l) * d),
        ]
        b.emit(f"{a}qkv_proj.{kind}", (out_l, *tail), segs)
    b.emit(a + "o_proj.weight", (h, nh_l * d), [col_seg(a + "o_proj.weight", (h, nq), *q_rows)])
    if spec.qk_norm:
        b.replicated(a + "q_norm.weight", (d,))
        b.replicated(a + "k_norm.weight", (d,))


def _head_rows(c: EngineCoords, per_head: int, nh_l: int) -> tuple[int, int]:
    return c.attn_tp_rank * nh_l * per_head, (c.attn_tp_rank + 1) * nh_l * per_head


def _mla_attention(b: LayerBuilder, c: EngineCoords, a: str) -> None:
    spec = b.spec
    h, nh = spec.hidden_size, spec.num_attention_heads
    nh_l = nh // c.attn_tp_size
    qk, kv_lora, rope = spec.qk_head_dim, spec.kv_lora_rank, spec.qk_rope_head_dim
    nope, v = spec.qk_nope_head_dim, spec.v_head_dim
    kv_a = (kv_lora + rope, h)
    if spec.q_lora_rank is not None:
        q_lora = spec.q_lora_rank
        segs = [
            row_seg(a + "q_a_proj.weight", (q_lora, h), 0, q_lora, 0),
            row_seg(a + "kv_a_proj_with_mqa.weight", kv_a, 0, kv_a[0], q_lora),
        ]
        b.emit(a + "fused_qkv_a_proj_with_mqa.weight", (q_lora + kv_a[0], h), segs)
        b.replicated(a + "q_a_layernorm.weight", (q_lora,))
        q_b = (nh * qk, q_lora)
        b.emit(a + "q_b_proj.weight", (nh_l * qk, q_lora),
               [row_seg(a + "q_b_proj.weight", q_b, *_head_rows(c, qk, nh_l), 0)])
    else:
        q = (nh * qk, h)
        b.emit(a + "q_proj.weight", (nh_l * qk, h), [row_seg(a + "q_proj.weight", q, *_head_rows(c, qk, nh_l), 0)])
        b.replicated(a + "kv_a_proj_with_mqa.weight", kv_a)
    b.replicated(a + "kv_a_layernorm.weight", (kv_lora,))
    kv_b = (nh * (nope + v), kv_lora)
    b.emit(a + "kv_b_proj.weight", (nh_l * (nope + v), kv_lora),
           [row_seg(a + "kv_b_proj.weight", kv_b, *_head_rows(c, nope + v, nh_l), 0)])
    b.emit(a + "o_proj.weight", (h, nh_l * v), [col_seg(a + "o_proj.weight", (h, nh * v), *_head_rows(c, v, nh_l))])
    b.derived(a + "w_kc", (nh_l, nope, kv_lora))
    b.derived(a + "w_vc", (nh_l, kv_lora, v))
    if spec.has_indexer:
        _indexer(b, a + "indexer.")
    if spec.fp8_block is not None:
        # Fp8Config gives every RadixAttention an Fp8KVCacheMethod: float32 scalars k_scale / v_scale,
        # 1.0 after load when the checkpoint has none (Kimi-K2 has none; nothing trains them).
        for attn in ("attn_mqa", "attn_mha"):
            for scale in ("k_scale", "v_scale"):
                b.constant(f"{a}{attn}.{scale}", (), SCALE_DTYPE, KV_SCALE)


def _indexer(b: LayerBuilder, ix: str) -> None:
    """The DSA indexer (``Indexer.__init__``), in sglang's parameter order; ``weights_proj`` (and the
    fused ``wk_weights_proj``) are bfloat16 whatever the model dtype (``params_dtype=torch.bfloat16``)."""
    spec = b.spec
    h, n, dim = spec.hidden_size, spec.index_n_heads, spec.index_head_dim
    q_in = spec.q_lora_rank if spec.q_lora_rank is not None else h
    b.replicated(ix + "wq_b.weight", (n * dim, q_in))
    if b.options.dsa_indexer_fusion:
        # deepseek_weight_loader._load_fused_indexer_wk: wk fills the top rows, weights_proj the bottom ones.
        segs = [row_seg(ix + "wk.weight", (dim, h), 0, dim, 0), row_seg(ix + "weights_proj.weight", (n, h), 0, n, dim)]
        b.emit(ix + "wk_weights_proj.weight", (dim + n, h), segs, dtype=INDEXER_PROJ_DTYPE)
    else:
        b.replicated(ix + "wk.weight", (dim, h))
        b.replicated(ix + "weights_proj.weight", (n, h), dtype=INDEXER_PROJ_DTYPE)
    b.replicated(ix + "k_norm.weight", (dim,), dtype="float32")
    b.replicated(ix + "k_norm.bias", (dim,), dtype="float32")


def dense_mlp_split(spec: ModelSpec, par: RolloutParallel, c: EngineCoords) -> tuple[int, int]:
    """``(rank, size)`` of the TP split of dense (non-MoE) MLP layers.

    DeepseekV2 / GLM-4.5 / GLM-4.7-Flash decoder layers replicate the dense MLP when
    ``--moe-dense-tp-size 1`` (``communicator.enable_moe_dense_fully_dp``); Qwen3's Qwen2MLP
    always splits over the full TP group.
    """
    if par.moe_dense_tp == 1 and spec.family in (Family.DEEPSEEK_V3, Family.GLM4_MOE):
        return 0, 1
    return c.tp_rank, c.tp_size


def _gate_up_down(b: LayerBuilder, m: str, inter: int, rank: int, size: int) -> None:
    """``{m}gate_up_proj.weight`` = [gate shard; up shard], ``{m}down_proj.weight`` column shard."""
    h = b.spec.hidden_size
    i_l = inter // size
    rows = (rank * i_l, (rank + 1) * i_l)
    segs = [
        row_seg(m + "gate_proj.weight", (inter, h), *rows, 0),
        row_seg(m + "up_proj.weight", (inter, h), *rows, i_l),
    ]
    b.emit(m + "gate_up_proj.weight", (2 * i_l, h), segs)
    b.emit(m + "down_proj.weight", (h, i_l), [col_seg(m + "down_proj.weight", (h, inter), *rows)])


def build_mlp(b: LayerBuilder, c: EngineCoords, par: RolloutParallel, layer: int, p: str) -> None:
    """The ``mlp`` parameters of layer ``layer``: a dense MLP, or router + experts + shared experts."""
    spec = b.spec
    m = p + "mlp."
    if not spec.is_moe_layer(layer):
        _gate_up_down(b, m, spec.intermediate_size, *dense_mlp_split(spec, par, c))
        return
    e, h = spec.num_experts, spec.hidden_size
    b.replicated(m + "gate.weight", (e, h), dtype="float32" if b.options.router_fp32 else None)
    if spec.router_expert_bias:
        b.replicated(m + "gate.e_score_correction_bias", (e,), dtype="float32")
    _experts(b, c, m)
    if spec.num_shared_experts and not b.options.shared_experts_fusion:
        # Standard (non-a2a) MoE: shared experts split over the full TP group.
        shared = spec.num_shared_experts * spec.moe_intermediate_size
        _gate_up_down(b, m + "shared_experts.", shared, c.tp_rank, c.tp_size)


def _experts(b: LayerBuilder, c: EngineCoords, m: str) -> None:
    """``w13_weight`` / ``w2_weight``: this EP rank's routed experts, then (fused) the shared expert."""
    spec = b.spec
    e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    e_l, i_l = e // c.moe_ep_size, i // c.moe_tp_size
    e0, i0 = c.moe_ep_rank * e_l, c.moe_tp_rank * i_l
    sources = [f"{m}experts.{e0 + j}." for j in range(e_l)]
    if b.options.shared_experts_fusion:
        sources.append(m + "shared_experts.")  # global expert id n_routed_experts, local slot e_l
    w13: list[Seg] = []
    w2: list[Seg] = []
    for j, ex in enumerate(sources):
        lead = ((j, j + 1),)
        w13.append(row_seg(ex + "gate_proj.weight", (i, h), i0, i0 + i_l, 0, lead))
        w13.append(row_seg(ex + "up_proj.weight", (i, h), i0, i0 + i_l, i_l, lead))
        w2.append(col_seg(ex + "down_proj.weight", (h, i), i0, i0 + i_l, lead))
    b.emit(m + "experts.w13_weight", (len(sources), 2 * i_l, h), w13)
    b.emit(m + "experts.w2_weight", (len(sources), h, i_l), w2)
