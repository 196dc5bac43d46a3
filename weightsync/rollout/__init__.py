"""The built-in rollout engine: tensor-parallel inference in the sglang layout, its HTTP control API
(sglang's endpoint names), the receiving end of weight transfers, and the weight checker.

Modules, bottom up:

* ``params``     one block of parameter memory per rank, in the layout's names/shapes/dtypes
* ``receiver``   the block registered with a p2p transport (shm / cuda_ipc / mooncake)
* ``loader``     fill parameters from an HF checkpoint, dummy weights or one received tensor;
                 post-load derivations (MLA ``w_kc``/``w_vc``)
* ``tp``         process groups and collectives (TP, attention-TP, control)
* ``layers``, ``attention``, ``model``   the forward of every family
* ``sampling``, ``engine``   batched KV-cached generation and logprobs on one rank
* ``checker``, ``broadcast``   weight checker; broadcast update path
* ``control``    rank 0 drives the other ranks (typed commands, per-rank replies)
* ``scheduler``  rank 0's state machine and batching; ``io_struct`` + ``http_api`` the HTTP layer
* ``bootstrap``, ``serve``   ``weightsync serve``
* ``reference``  a plain reference forward over global HF tensors (tests, logprob parity)

See docs/engine.md.
"""
