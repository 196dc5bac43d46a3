"""``weightsync bench MODEL``: the transfer benchmark -- link rate, p2p update, broadcast update.

In one run, on one machine, with the same model and the same processes:

* **link**: a plain copy of the update's bytes -- inside one process (CPU ``memmove``; CUDA
  GPU-to-GPU peer copy and same-GPU copy), and between the benchmark's own processes: each
  trainer rank writes the bytes it sends in p2p as one run per destination, through the same
  transport into the same engine arenas (the figure p2p's wire rate is compared with);
* **p2p**: trainer ranks holding Megatron-layout shards of random global tensors write with
  :class:`~weightsync.sync.p2p_sender.P2PSender` into engine ranks holding sglang-layout
  parameters in one registered arena (``shm`` on CPU, ``cuda_ipc`` on GPU);
* **broadcast**: the same model through the baseline path (stage sources gather and broadcast
  bucket by bucket; engine ranks keep their pieces);
* **tensor** (one GPU shared by one trainer and one engine rank, where broadcast cannot run): the
  reference system's colocated path, re-implemented as the baseline (:mod:`.colocated`).

Every update is timed between barriers of all processes, after one warm-up run, ``--repeats``
times; afterwards every engine rank compares its parameters bit for bit with the expected
slicing of the global tensors. Prints a table and one ``BENCH_JSON {...}`` line, or, with
``--out``, writes that JSON to the file instead.

The modules, in the order a benchmark uses them:

* :mod:`.config` -- what one benchmark is (:class:`~.config.BenchConfig`, from the command line;
  imports no torch, as the CLI imports it to build its parser);
* :mod:`.launcher` -- spawns one process per rank and collects their replies;
* :mod:`.worker` -- one rank process (trainer or engine), the steps every process goes through;
* :mod:`.data` -- the global values, poisoning, the bit-exact check;
* :mod:`.colocated` -- the colocated baseline;
* :mod:`.summary` -- the JSON record and the table.

Nothing in ``launch/`` outside this package imports it: the run loop does not depend on the
benchmark (``tests/test_structure_layering.py``).

Typical usage::

    weightsync bench Qwen3-4B --scale layers=2 --train tp=2 --rollout tp=2 --device cpu
    weightsync bench Qwen3-30B-A3B --scale layers=16 --train tp=1 --rollout tp=1 --device cuda \\
        --out $OUT/bench.json
"""
