"""The trainer layout against live megatron-core 0.16.1 (CPU, gloo, local layer spec).

Contracts:

* ``train_coords`` gives every rank the position that megatron-core's own ``RankGenerator``
  gives it, on the dense axes (tp, cp, dp, pp) and the expert axes (etp, ep, edp, pp).
* ``stage_layers`` matches ``get_transformer_layer_offset`` / ``get_num_layers_to_build``.
* On every rank of a ``GPTModel`` built by megatron-core at TP/PP/CP/EP/ETP > 1, the parameter
  names (and the router ``expert_bias`` buffer), their order, shapes and tensor-parallel
  attributes (``tensor_model_parallel``, ``partition_dim``) are exactly what
  ``trainer_layout`` predicts. A TP-split local tensor is one whose pieces cover less than
  their global tensors along ``partition_dim``; a replicated one has full pieces.

MLA families are not built here: megatron-core 0.16.1's MLA asserts CUDA at construction. CP is
not built either: the local spec's ``DotProductAttention`` refuses CP > 1 (only TE supports it);
CP changes no parameter, and the CP axis of ``train_coords`` is checked against ``RankGenerator``.
The models are built in subprocesses (one per rank) so that Megatron's global parallel state
never leaks into other tests; ``torch.cuda.current_device`` is pointed at the CPU there
(the MoE router allocates its buffers with it) and ``Tensor.cuda`` is the identity (with tied
embeddings and pp > 1, the last stage's copy is moved to CUDA before its all-reduce).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from weightsync.layout.megatron import stage_layers, train_coords, trainer_layout
from weightsync.layout.megatron_ranks import DEFAULT_ORDER, ORDERS
from weightsync.models import get_model
from weightsync.models.hf import global_tensors
from weightsync.models.parallel import TrainParallel

pytest.importorskip("megatron.core")

GRID = [
    TrainParallel(world_size=w, **{"etp": 1, **kw})
    for w, kw in [
        (8, {"tp": 2, "cp": 2}),
        (16, {"tp": 2, "cp": 2, "pp": 2, "ep": 4}),
        (16, {"tp": 4, "pp": 2, "ep": 2, "etp": 2}),
        (32, {"tp": 2, "pp": 2, "cp": 2, "ep": 8}),
        (24, {"tp": 2, "pp": 3, "ep": 2, "etp": 2}),
        (16, {"tp": 2, "pp": 2, "ep": 2}),
        (256, {"tp": 8, "pp": 8, "cp": 4, "ep": 32}),
    ]
]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("par", GRID, ids=lambda p: f"w{p.world_size}-tp{p.tp}-pp{p.pp}-cp{p.cp}-ep{p.ep}-etp{p.etp}")
def test_train_coords_match_rank_generator(par, order):
    from megatron.core.parallel_state import RankGenerator

    if order != DEFAULT_ORDER and par.pp > 1 and par.edp != par.dp:
        with pytest.raises(ValueError, match="expert dp"):  # megatron-core asserts the same
            train_coords(par, 0, order=order)
        return
    dense = RankGenerator(tp=par.tp, ep=1, dp=par.dp, pp=par.pp, cp=par.cp, order=order)
    expert = RankGenerator(tp=par.etp, ep=par.ep, dp=par.edp, pp=par.pp, cp=1, order=order)
    want: dict[int, dict[str, int]] = {r: {} for r in range(par.world_size)}
    for gen, axes in ((dense, {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}),
                      (expert, {"tp": "etp", "ep": "ep", "dp": "edp"})):
        for token, field in axes.items():
            for group in gen.get_ranks(token):
                for index, r in enumerate(group):
                    want[r][field] = index
    for r in range(par.world_size):
        c = train_coords(par, r, order=order)
        assert {f: getattr(c, f) for f in want[r]} == want[r], r


@pytest.mark.parametrize(
    ("layers", "pp", "last"),
    [(4, 2, None), (4, 2, 1), (61, 8, 5), (46, 4, 10), (20, 3, 6), (94, 4, 22), (78, 8, 8)],
)
def test_stage_layers_match_megatron(layers, pp, last):
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, num_layers_in_last_pipeline_stage=last,
                               pipeline_dtype=torch.float32)
    spec = get_model("Qwen3-4B", "tiny").replace(num_layers=layers)
    got = stage_layers(spec, TrainParallel(world_size=pp, pp=pp, pp_last_stage_layers=last))
    for s, stage in enumerate(got):
        offset = get_transformer_layer_offset(config, pp_rank=s)
        count = get_num_layers_to_build(config, pp_rank=s)
        assert (stage.start, len(stage)) == (offset, count), s


WORKER = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.cuda.current_device = lambda: "cpu"  # the MoE router allocates its buffers there
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings, pp > 1: all-reduce of the copy
    import torch.distributed as dist
    from weightsync.models import get_model
    from weightsync.layout.megatron_pieces import padded_vocab_size

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig


    def build(model, cfg):
        spec = get_model(model, "tiny")
        tp, pp = cfg["tp"], cfg["pp"]
        moe = {}
        if spec.is_moe:
            moe = dict(
                num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_intermediate_size,
                moe_router_topk=spec.num_experts_per_tok,
                moe_layer_freq=[int(spec.is_moe_layer(i)) for i in range(spec.num_layers)],
                moe_router_enable_expert_bias=spec.router_expert_bias,
                moe_router_score_function=spec.router_score_function,
                moe_shared_expert_intermediate_size=(spec.num_shared_experts * spec.moe_intermediate_size) or None,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
        config = TransformerConfig(
            num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.intermediate_size,
            gated_linear_unit=True, normalization="RMSNorm", add_bias_linear=False,
            add_qkv_bias=spec.attention_bias, qk_layernorm=spec.qk_norm,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cfg["cp"],
            expert_model_parallel_size=cfg["ep"], expert_tensor_parallel_size=cfg["etp"],
            # the local spec's torch RMSNorm refuses sequence parallel; it changes no parameter
            sequence_parallel=False, num_layers_in_last_pipeline_stage=cfg["last"],
            pipeline_dtype=torch.float32 if pp > 1 else None,
            use_cpu_initialization=True, params_dtype=torch.float32, **moe)
        pp_rank = ps.get_pipeline_model_parallel_rank()
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                           pp_rank=pp_rank)
        return GPTModel(
            config=config, transformer_layer_spec=block, position_embedding_type="rope",
            vocab_size=padded_vocab_size(spec.vocab_size, tp, 128), max_sequence_length=64,
            pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
            share_embeddings_and_output_weights=spec.tie_word_embeddings)


    try:
        for job, (model, cfg) in enumerate(json.loads(sys.argv[1])):
            ps.initialize_model_parallel(
                tensor_model_parallel_size=cfg["tp"], pipeline_model_parallel_size=cfg["pp"],
                context_parallel_size=cfg["cp"], expert_model_parallel_size=cfg["ep"],
                expert_tensor_parallel_size=cfg["etp"])
            try:
                gpt = build(model, cfg)
            finally:
                ps.destroy_model_parallel()
            out = []
            for name, p in gpt.named_parameters():
                out.append([name, list(p.shape), bool(getattr(p, "tensor_model_parallel", False)),
                            getattr(p, "partition_dim", -1)])
            for name, b in gpt.named_buffers():
                if name.endswith("expert_bias"):
                    out.append([name, list(b.shape), False, -1])
            # which global layer and which global experts each local module computes
            layers = {}
            for i, layer in enumerate(gpt.decoder.layers):
                experts = getattr(layer.mlp, "local_expert_indices", None)
                layers[i] = [layer.layer_number - 1, experts]
            print("PARAMS " + json.dumps({"job": job, "rank": rank, "params": out, "layers": layers}), flush=True)
    finally:
        dist.destroy_process_group()
    """
)


def _run_world(world: int, jobs: list[tuple[str, TrainParallel]], port: int) -> dict[tuple[int, int], dict]:
    """Build every job's GPTModel on ``world`` processes; returns (job, rank) -> record with
    ``params`` ([name, shape, tensor_model_parallel, partition_dim]) and ``layers`` (local index ->
    [global layer, global expert indices or None])."""
    spec = [
        (model, {"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "etp": p.etp, "last": p.pp_last_stage_layers})
        for model, p in jobs
    ]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(spec)], env=dict(env, RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    out: dict[tuple[int, int], list] = {}
    errors = []
    for r, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=600)
        if proc.returncode != 0:
            errors.append(f"rank {r} exit {proc.returncode}:\n{stderr[-3000:]}")
        for line in stdout.splitlines():
            if line.startswith("PARAMS "):
                rec = json.loads(line[len("PARAMS "):])
                out[rec["job"], rec["rank"]] = rec
    assert not errors, "\n".join(errors)
    return out


def _predicted(model: str, par: TrainParallel, rank: int) -> list:
    spec = get_model(model, "tiny")
    gts = global_tensors(spec)
    rows = []
    for t in trainer_layout(spec, par, rank):
        split = {d for p in t.pieces for d, (a, b) in enumerate(p.global_box) if b - a < gts[p.global_name].shape[d]}
        if not t.pieces:  # a vocab shard that is all padding: split over TP like the others
            split = {0}
        rows.append([t.name, list(t.shape), split])
    return rows


LIVE = {
    "qwen3-tp2-dp2": ("Qwen3-4B", TrainParallel(world_size=4, tp=2)),
    "qwen3-tp2-pp2-tied-last1": ("Qwen3-4B", TrainParallel(world_size=4, tp=2, pp=2, pp_last_stage_layers=1)),
    "qwen3-tp4-groups<tp": ("Qwen3-4B", TrainParallel(world_size=4, tp=4)),
    "qwen3moe-tp2-ep2-dp2": ("Qwen3-30B-A3B", TrainParallel(world_size=4, tp=2, ep=2, etp=1)),
    "qwen3moe-tp4-ep2-etp2": ("Qwen3-30B-A3B", TrainParallel(world_size=4, tp=4, ep=2, etp=2)),
    "glm45-tp2-pp2-ep2-last3": ("GLM-4.5-Air", TrainParallel(world_size=4, tp=2, pp=2, ep=2, etp=1,
                                                             pp_last_stage_layers=3)),
    "glm45-tp1-ep4-dp4": ("GLM-4.5-Air", TrainParallel(world_size=4, ep=4)),
}


@pytest.fixture(scope="module")
def live_params() -> dict[tuple[str, int], dict]:
    """Every LIVE job built once, on one set of 4 gloo processes."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    jobs = list(LIVE.values())
    assert {p.world_size for _, p in jobs} == {4}
    got = _run_world(4, jobs, port)
    return {(job_id, rank): params for (job, rank), params in got.items() for job_id in [list(LIVE)[job]]}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("job_id", list(LIVE))
def test_live_gpt_model_matches_layout(job_id, live_params):
    model, par = LIVE[job_id]
    for rank in range(par.world_size):
        params = live_params[job_id, rank]["params"]
        want = _predicted(model, par, rank)
        # named_parameters() order; the expert_bias buffers come after all parameters in the worker
        assert [p[0] for p in params] == [w[0] for w in want if not w[0].endswith(".expert_bias")] + [
            w[0] for w in want if w[0].endswith(".expert_bias")], f"rank {rank}: names or order differ"
        want_by_name = {w[0]: w for w in want}
        for name, shape, tmp, dim in params:
            _, wshape, split = want_by_name[name]
            assert shape == wshape, f"rank {rank} {name}: live {shape} != layout {wshape}"
            if split:
                assert tmp, f"rank {rank} {name}: layout splits dims {split}, live param is not TP-split"
                assert split == {dim}, f"rank {rank} {name}: layout splits dims {split}, live partition_dim {dim}"
            elif tmp:
                # A parallel linear whose TP group has size 1 is still marked
                # tensor_model_parallel; then its pieces are whole.
                group = par.etp if ".mlp.experts." in name else par.tp
                assert group == 1, f"rank {rank} {name}: live param is TP-split, layout holds it whole"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("job_id", list(LIVE))
def test_live_layers_and_experts_are_the_layout_globals(job_id, live_params):
    """Local layer i computes the global layer, and local expert k the global expert, whose HF
    tensors the layout's pieces name."""
    model, par = LIVE[job_id]
    spec = get_model(model, "tiny")
    for rank in range(par.world_size):
        live_layers = live_params[job_id, rank]["layers"]
        tensors = {t.name: t for t in trainer_layout(spec, par, rank)}
        for local, (layer, experts) in live_layers.items():
            norm = tensors[f"decoder.layers.{local}.input_layernorm.weight"]
            assert norm.pieces[0].global_name == f"model.layers.{layer}.input_layernorm.weight", (rank, local)
            for k, expert in enumerate(experts or []):
                fc2 = tensors[f"decoder.layers.{local}.mlp.experts.local_experts.{k}.linear_fc2.weight"]
                assert fc2.pieces[0].global_name == f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
            assert bool(experts) == spec.is_moe_layer(layer), (rank, local)
