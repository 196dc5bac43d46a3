"""The weight-update library: what moves the weights, on both sides.

Everything another RL framework would import to update engines from its own trainer, and that the
built-in engine uses to receive:

* ``updater``           :class:`WeightUpdater`: the facade, one per trainer rank; ``update(version)``
                        does one whole update (re-exported as ``from weightsync import WeightUpdater``)
* ``updater_config``    :class:`UpdaterConfig`: how it updates (mode, buckets, transport, checks, token)
* ``update_result``     :class:`UpdateStats` (what an update cost) and :class:`UpdateError`
* ``rank_group``        one trainer rank decides, or every rank agrees, and every rank sees a failure
* ``broadcast_groups``  the engines' weight-update groups, trainer side: create, announce, leave
* ``from_megatron``     a live megatron-core job's parallel sizes (:meth:`WeightUpdater.from_megatron`)
* ``engines``           the engines of an update found from their URLs (sizes, parameter tables)
* ``names``             a rank's live parameters placed on its layout (both megatron-core specs)
* ``verify``            the verification: expected fingerprints from the trainer ranks' partials,
                        compared with every engine rank's (:mod:`weightsync.fingerprint`)
* ``share_fingerprint`` one trainer rank's partial fingerprints of exactly the bytes it writes
* ``tensor_sender``     the colocated broadcast: full tensors through ``/update_weights_from_tensor``
* ``p2p_sender``        :class:`P2PSender`: replays one trainer rank's share of the static plan,
                        writing converted bytes straight into engine parameters (one-sided)
* ``p2p_pack``          the staging layout and packing of a plan share's transformed ops
* ``p2p_receiver``      :class:`Receiver`: an engine rank's transport, arena and one registration
* ``params``            :class:`ParamStore`: an engine rank's parameters carved from one block;
                        :func:`write_global` fills them from a global tensor by the layout's pieces
* ``broadcast_sender``  the classic path: gather full tensors on the source ranks, broadcast buckets
* ``broadcast_receiver`` keep this rank's pieces of each broadcast bucket
* ``engine_client``     the HTTP client of an engine's sglang-named control endpoints

Imports only ``models``, ``layout``, ``plan``, ``transport``, ``quant`` and ``fingerprint`` (tests pin it).
"""
