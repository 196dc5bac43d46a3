"""Contract: at TP 2, a pause-free update's flip (swap, then copy) happens between two forward steps
of the running batch on every rank at the same step, and no forward step reads two versions.

Two engine processes (gloo); rank 0 drives them through its scheduler and update sessions, as
``weightsync serve`` does. Each rank records, for every forward step (a ``Model.hidden`` call and
the ``Model.logits`` that follows), the raw-byte sum of every weight the step read, and the batch
it belongs to. The engine serves checkpoint A, then B (a swap published during a batch), then A
again (a copy published during another batch). The contract, checked on what both ranks saw:

* every step read one version: each step's sums are all A's or all B's (a step that read some
  weights of each would be a third kind);
* both ranks switched versions at the same steps, and each switch is inside a batch (the step
  before it belongs to the same batch: the requests kept their KV and went on);
* the long requests' answers say where: ``version_spans`` [(0, v), (k, v')] with k > 0.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.engine_helpers import one_torch_thread, tiny, write_tiny_checkpoint  # noqa: F401 -- autouse fixture
from weightsync.models.parallel import RolloutParallel

MODEL = "Qwen3-4B"
PAR = RolloutParallel(tp=2)
LONG = 200


def _record(rank: int, steps: list[dict[str, Any]]) -> None:
    """Patch this process's model to record every forward step's reads (module docstring)."""
    from weightsync.engine.engine import Engine
    from weightsync.engine.model import Model

    hidden, w, generate = Model.hidden, Model.w, Engine.generate
    batch = [0]

    def generate_recorded(self: Engine, *a: Any, **k: Any) -> Any:
        batch[0] += 1
        return generate(self, *a, **k)

    def hidden_recorded(self: Model, *a: Any, **k: Any) -> torch.Tensor:
        steps.append({"batch": batch[0], "sums": {}})
        return hidden(self, *a, **k)

    def w_recorded(self: Model, name: str) -> torch.Tensor:
        if steps:
            steps[-1]["sums"][name] = int(self.store[name].reshape(-1).view(torch.uint8).sum())
        return w(self, name)

    Engine.generate, Model.hidden, Model.w = generate_recorded, hidden_recorded, w_recorded


def _rank_main(rank: int, port: int, ckpts: tuple[str, str], out: str) -> None:
    import torch.distributed as dist

    from tests.engine_helpers import start_sessions
    from weightsync.engine.control import Driver, worker_loop
    from weightsync.engine.engine import Engine, GenRequest
    from weightsync.engine.sampling import SamplingParams
    from weightsync.engine.tp import EngineGroups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    steps: list[dict[str, Any]] = []
    _record(rank, steps)
    engine = Engine.build(tiny(MODEL), EngineGroups.build(PAR, rank), device=torch.device("cpu"))
    engine.load_checkpoint(ckpts[0])
    seen: dict[str, Any] = {"steps": steps}
    if rank == 0:
        sessions = start_sessions(Driver(engine), weight_version="v0")
        seen["answers"] = []
        for version, (flip, ckpt) in enumerate((("swap", ckpts[1]), ("copy", ckpts[0])), start=1):
            sessions.begin(pause_free=True, flip=flip)
            sessions.update_from_disk(ckpt)
            sessions.end()
            req = GenRequest(rid=f"long{version}", input_ids=(5, 17, 250, 3),
                             sampling=SamplingParams(max_new_tokens=LONG, temperature=0.0, ignore_eos=True))
            fut = sessions.scheduler.submit([req])[0]
            while not sessions.scheduler.running:
                time.sleep(0.005)
            time.sleep(0.3)  # some steps under the old version first
            published = sessions.set_weight_version(f"v{version}")
            result, final = fut.result(timeout=300)
            seen["answers"].append({"published": published, "spans": result.version_spans, "final": final})
        sessions.scheduler.stop()
    else:
        worker_loop(engine)
    torch.save(seen, f"{out}.{rank}")
    engine.close()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("pause_free_tp")
    write_tiny_checkpoint(MODEL, root / "a", seed=1)
    write_tiny_checkpoint(MODEL, root / "b", seed=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = root / "seen.pt"
    mp.start_processes(_rank_main, args=(port, (str(root / "a"), str(root / "b")), str(out)), nprocs=2,
                       start_method="spawn")
    return [torch.load(Path(f"{out}.{r}"), weights_only=False) for r in range(2)]


def _versions(steps: list[dict[str, Any]]) -> list[int]:
    """Each step's version, numbered by first appearance (the same sums: the same version)."""
    kinds: list[dict[str, int]] = []
    out = []
    for s in steps:
        if s["sums"] not in kinds:
            kinds.append(s["sums"])
        out.append(kinds.index(s["sums"]))
    return out


@pytest.mark.timeout(600)
def test_every_rank_flips_at_the_same_step_and_no_step_mixes_versions(seen: list[dict[str, Any]]) -> None:
    steps = [r["steps"] for r in seen]
    assert len(steps[0]) == len(steps[1]) > 0, "both ranks ran the same forward steps"
    labels = [_versions(s) for s in steps]
    assert set(labels[0]) == {0, 1}, "every step read all of A or all of B: no third, mixed, kind"
    assert labels[0] == labels[1], "both ranks read the same version at every step"
    switches = [i for i in range(1, len(labels[0])) if labels[0][i] != labels[0][i - 1]]
    assert len(switches) == 2, switches  # A -> B (swap), B -> A (copy)
    for i in switches:
        assert steps[0][i]["batch"] == steps[0][i - 1]["batch"], f"the flip at step {i} is inside a batch"
    for answer, flip in zip(seen[0]["answers"], ("swap", "copy"), strict=True):
        assert (answer["published"]["flip"], answer["published"]["flip_at"]) == (flip, "step")
        (start, old), (k, new) = answer["spans"]
        assert start == 0
        assert 0 < k < LONG
        assert new == answer["final"] != old
