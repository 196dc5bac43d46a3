"""The built-in rollout engine: tensor-parallel inference in the sglang layout, its HTTP control API
(sglang's endpoint names) and the weight checker. It receives weights through the library
(:mod:`weightsync.sync`: the parameter arena, the p2p receiver, the broadcast receiver).

Modules, bottom up:

* ``config``     :class:`ServeConfig`, everything one engine needs
* ``loader``     fill parameters from an HF checkpoint or dummy weights; post-load derivations
                 (MLA ``w_kc``/``w_vc``)
* ``tp``         process groups and collectives (TP, attention-TP, control)
* ``layers``, ``attention``, ``model``   the forward of every family
* ``sampling``, ``engine``   batched KV-cached generation and logprobs on one rank
* ``checker``    the weight checker
* ``control``    rank 0 drives the other ranks (typed commands, per-rank replies)
* ``scheduler``  rank 0's batching: the driver thread, the queue, generation
* ``states``     the engine's state machine, written once as a table (``TRANSITIONS``)
* ``session``    the weight-update sessions that drive it (begin / write / end / publish / abort),
                 the scheduler's gate
* ``io_base``, ``io_generate``, ``io_struct``   the request bodies (``/generate``'s, the
                 control and weight-update ones); ``http_api`` the HTTP layer
* ``http_guard``, ``http_body``   connections (a cap, read deadlines) and request bodies (a size,
                 a budget of bodies parsed at once), bounded
* ``stops``      stop strings and patterns, matched in linear time (RE2)
* ``live_check`` the served weights checked against their publication (a write outside a session)
* ``bootstrap``, ``serve``   the server of ``weightsync serve`` (its command line: :mod:`weightsync.cli.serve`)
* ``reference``  a plain reference forward over global HF tensors (tests, logprob parity)

See docs/engine.md.
"""
