#!/usr/bin/env python3
"""Self-checking run of weightsync's megatron-core trainer on 2 ranks (2 GPUs, or 2 CPU processes).

What it checks, for each model and scale, at TP 2 (and EP 2 for MoE models):

(a) ``logits``: megatron-core's forward of the model loaded from weightsync's torch_dist shards
    (parameters in float32, so the comparison is not blurred by bf16 rounding) equals the
    built-in engine's forward of the HF checkpoint (single process, float32) and the plain
    reference forward (``weightsync.engine.reference``), within ``LOGITS_ATOL + LOGITS_RTOL *
    max|logits|``. Families: Qwen3 dense and Qwen3-MoE by default; ``--all-families`` adds GLM-4.5
    and the MLA families (tiny scale).
(b) ``train``: ``--steps`` REINFORCE steps (bf16 parameters, float32 Adam master weights) on a
    fixed batch lower the loss (last < first) and raise the mean logprob of the response tokens of
    the rewarded samples; TP-replicated parameters stay identical on both ranks. Qwen3 dense and
    Qwen3-MoE.
(c) ``layout``: each MLA family (Kimi-K2, GLM-4.7-Flash, GLM-5) built by megatron-core on the
    device has exactly the parameter names, shapes and tensor-parallel attributes
    (``tensor_model_parallel``, ``partition_dim``) of weightsync's trainer layout.

Checkpoints are written by ``weightsync.sources.prepare`` (synthetic HF weights) into a temporary
directory, or ``--ckpt-dir``. The result is one JSON object on stdout (and in ``--out``), with
``"passed"``; the exit status is 0 only when every check passed.

Usage (the H200 machine)::

    python scripts/gpu_trainer_check.py                       # tiny + layers=2, cuda, nccl
    python scripts/gpu_trainer_check.py --all-families --out gpu_trainer_check.json
    python scripts/gpu_trainer_check.py --device cpu --quick  # the same on 2 CPU processes (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LOGITS_ATOL = 2e-3
LOGITS_RTOL = 1e-5
"""Logits agree when max |megatron - engine| <= LOGITS_ATOL + LOGITS_RTOL * max |engine logits|
(float32 on both sides; synthetic weights at real dims give logits in the thousands)."""
WORLD = 2
DENSE, MOE = "Qwen3-4B", "Qwen3-30B-A3B"
MLA_MODELS = ("Kimi-K2", "GLM-4.7-Flash", "GLM-5")
OTHER_MODELS = ("GLM-4.5-Air", *MLA_MODELS)
"""The families beyond Qwen3 dense / MoE (logits at tiny scale with --all-families)."""


def _train_parallel(model: str) -> Any:
    from weightsync.models import get_model
    from weightsync.models.parallel import TrainParallel

    return TrainParallel(world_size=WORLD, tp=2, ep=2 if get_model(model).is_moe else 1, etp=1)


def _tokens(vocab: int, rows: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (rows, length), generator=g).tolist()


def _reference_logits(spec: Any, hf_dir: Path, prompts: list[list[int]], device: str) -> dict[str, Any]:
    """Engine and reference logits of each prompt (float32, on the CPU)."""
    import torch

    from weightsync.models.checkpoint import read_hf_checkpoint

    out: dict[str, Any] = {}
    try:
        from weightsync.engine.engine import Engine
        from weightsync.engine.tp import EngineGroups

        engine = Engine.build(spec, EngineGroups.single(), device=torch.device(device), compute_dtype=torch.float32)
        try:
            engine.load_checkpoint(str(hf_dir))
            out["engine"] = [t.float().cpu() for t in engine.prompt_logits(prompts)]
        finally:
            engine.close()
    except Exception:  # reported in the summary; the reference forward still runs
        out["engine_error"] = traceback.format_exc(limit=3)
    from weightsync.engine.reference import Reference

    tensors, _ = read_hf_checkpoint(hf_dir)
    ref = Reference(spec, tensors)
    out["reference"] = [ref.logits(p).float().cpu() for p in prompts]
    return out


def _megatron_logits(model: Any, prompts: list[list[int]], vocab: int) -> list[Any]:
    """Full-vocab logits of each prompt, gathered over TP (every rank gets them)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from weightsync.sources.train_step import model_logits

    out = []
    group = parallel_state.get_tensor_model_parallel_group()
    device = next(model.parameters()).device
    for p in prompts:
        with torch.no_grad():
            local = model_logits(model, torch.tensor([p], device=device)).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        out.append(torch.cat(parts, dim=-1)[0, :, :vocab].cpu())
    return out


def check_logits(spec: Any, par: Any, rank: int, device: str, ckpt: Path, hf_dir: Path) -> dict[str, Any]:
    import torch

    from weightsync.sources.megatron_load import load_into_model
    from weightsync.sources.megatron_model import build_gpt_model

    # GLM-5: weightsync's core attention is dense (no DSA top-k selection); with prompts no longer
    # than index_topk the indexer selects every earlier key, so the forwards must agree.
    length = min(12, spec.index_topk) if spec.has_indexer else 12
    prompts = _tokens(spec.vocab_size, 2, length, seed=3)
    model = build_gpt_model(spec, par, rank, device=device, dtype=torch.float32)
    load_into_model(model, ckpt, spec, par, rank)
    model.eval()
    got = _megatron_logits(model, prompts, spec.vocab_size)
    res: dict[str, Any] = {"atol": LOGITS_ATOL, "rtol": LOGITS_RTOL}
    if rank == 0:
        refs = _reference_logits(spec, hf_dir, prompts, device)
        ok = []
        for kind in ("engine", "reference"):
            if kind in refs:
                diff = max(float((a - b).abs().max()) for a, b in zip(got, refs[kind]))
                scale = max(float(b.abs().max()) for b in refs[kind])
                res[f"max_abs_diff_vs_{kind}"] = diff
                ok.append(diff <= LOGITS_ATOL + LOGITS_RTOL * scale)
        if "engine_error" in refs:
            res["engine_error"] = refs["engine_error"]
        res["passed"] = bool(ok) and all(ok)
        res["logits_abs_max"] = max(float(t.abs().max()) for t in got)
    del model
    return res


def check_train(spec: Any, par: Any, rank: int, device: str, ckpt: Path, steps: int, lr: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from weightsync.sources.train_step import MegatronTrainer, batch_from_samples

    rows = _tokens(spec.vocab_size, 4, 16, seed=5)
    samples = [{"prompt_ids": r[:6], "output_ids": r[6:], "reward": float(i % 2)} for i, r in enumerate(rows)]
    batch = batch_from_samples(samples, device=device)
    trainer = MegatronTrainer.from_torch_dist(ckpt, spec, par, rank, device=device, lr=lr)
    before = _rewarded_logprob(trainer.model, batch, spec.vocab_size)
    history = [trainer.step(batch) for _ in range(steps)]
    after = _rewarded_logprob(trainer.model, batch, spec.vocab_size)
    losses = [h["loss"] for h in history]
    # TP-replicated parameters (norms, router) must stay identical on every TP rank: this checks
    # the gradient reduction (sequence-parallel and q/k-layernorm gradients are partial per rank).
    group = parallel_state.get_tensor_model_parallel_group()
    diverged = []
    for name, p in trainer.model.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        copies = [torch.empty_like(p.data) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, p.data.contiguous(), group=group)
        if not all(torch.equal(copies[0], c) for c in copies[1:]):
            diverged.append(name)
    changed = sum(1 for n, p in trainer.model.named_parameters() if p.requires_grad)
    return {"losses": losses, "grad_norms": [h["grad_norm"] for h in history], "lr": lr,
            "rewarded_logprob_before": before, "rewarded_logprob_after": after,
            "replicas_diverged": diverged[:10], "params": changed,
            "passed": len(losses) >= 2 and losses[-1] < losses[0] and after > before and not diverged}


def _rewarded_logprob(model: Any, batch: Any, vocab: int) -> float:
    """Mean logprob of the response tokens of the samples with a positive advantage."""
    import torch

    from weightsync.sources.train_step import token_logprobs

    model.eval()
    with torch.no_grad():
        logp = token_logprobs(model, batch.tokens, vocab)
    mask = batch.loss_mask[:, 1:] * (batch.advantages[:, None] > 0)
    return float((logp * mask).sum() / mask.sum())


def check_layout(spec: Any, par: Any, rank: int, device: str) -> dict[str, Any]:
    from weightsync.sources.megatron_model import build_gpt_model, check_against_layout

    model = build_gpt_model(spec, par, rank, device=device)
    layout = check_against_layout(model, spec, par, rank)  # raises with every difference
    return {"params": len(layout), "passed": True}


def _worker(rank: int, plan: list[dict[str, Any]], port: int, device: str, out_dir: str, steps: int,
            lr: float) -> None:
    import torch
    import torch.distributed as dist

    from weightsync.models import get_model
    from weightsync.sources.megatron_model import destroy_parallel_state, init_parallel_state

    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.manual_seed(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD)
    results = []
    for item in plan:
        spec = get_model(item["model"], item["scale"])
        par = _train_parallel(item["model"])
        rec = {"check": item["check"], "model": item["model"], "scale": item["scale"], "par": repr(par)}
        t0 = time.perf_counter()
        init_parallel_state(par)
        try:
            if item["check"] == "logits":
                rec.update(check_logits(spec, par, rank, device, Path(item["ckpt"]), Path(item["hf"])))
            elif item["check"] == "train":
                rec.update(check_train(spec, par, rank, device, Path(item["ckpt"]), steps, lr))
            else:
                rec.update(check_layout(spec, par, rank, device))
        except Exception:  # one failed check must not hide the others
            rec.update(passed=False, error=traceback.format_exc(limit=6))
        finally:
            destroy_parallel_state()
            if device == "cuda":
                torch.cuda.empty_cache()
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(rec)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _plan(args: argparse.Namespace, ckpt_root: Path) -> list[dict[str, Any]]:
    from weightsync.sources.prepare import PrepareConfig, prepare

    plan = []
    scales = ["tiny"] if args.quick else args.scales.split(",")
    logit_models = [DENSE, MOE, *(OTHER_MODELS if args.all_families else ())]
    for scale in scales:
        for model in logit_models:
            if model in OTHER_MODELS and scale != "tiny":
                continue
            res = prepare(PrepareConfig(model=model, scale=scale, ckpt_dir=ckpt_root, train=_train_parallel(model),
                                        progress=False), say=lambda s: print(s, file=sys.stderr))
            item = {"model": model, "scale": scale, "ckpt": str(res.paths.torch_dist), "hf": str(res.paths.hf)}
            plan.append({**item, "check": "logits"})
            if model in (DENSE, MOE):
                plan.append({**item, "check": "train"})
    plan += [{"check": "layout", "model": m, "scale": "tiny"} for m in MLA_MODELS]
    return plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--scales", default="tiny,layers=2", help="comma-separated scales of the logits/train checks")
    p.add_argument("--quick", action="store_true", help="tiny scale only")
    p.add_argument("--all-families", action="store_true", help="also check logits of GLM-4.5 and the MLA families")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="where to prepare checkpoints (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)

    import torch
    import torch.multiprocessing as mp

    if args.device == "cuda" and torch.cuda.device_count() < WORLD:
        print(json.dumps({"passed": False, "error": f"needs {WORLD} GPUs, found {torch.cuda.device_count()}"}))
        return 1
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt_root = args.ckpt_dir or Path(tmp) / "ckpt"
        plan = _plan(args, ckpt_root)
        out_dir = Path(tmp) / "results"
        out_dir.mkdir()
        from weightsync.proc import free_port

        mp.spawn(_worker, args=(plan, free_port(), args.device, str(out_dir), args.steps, args.lr), nprocs=WORLD)
        per_rank = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    checks = per_rank[0]
    for other in per_rank[1:]:  # a failure on any rank fails the check
        for rec, o in zip(checks, other, strict=True):
            if not o.get("passed", True):
                rec["passed"] = False
                rec.setdefault("error", o.get("error", "failed on another rank"))
    import megatron.core

    summary = {
        "passed": all(c.get("passed", False) for c in checks),
        "device": args.device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(WORLD)] if args.device == "cuda" else [],
        "torch": torch.__version__, "megatron_core": megatron.core.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.perf_counter() - t0, 1),
        "checks": checks,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
