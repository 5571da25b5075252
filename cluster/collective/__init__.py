"""Moshpit All-Reduce: the collective the replicas average with (numpy and asyncio; Ray only
in ``transport.RayTransport`` and ``peer.py``).

One module per role:

* ``grid.py``: the Moshpit grid of a plan, zone-aware when peers declare zones (pure).
* ``partition.py``: part sizes by share, owners taking turns, the step's bounds
  (``ContributionBounds`` -> ``Limits``), validation (``check_contribution``) and the
  weighted mean (pure).
* ``shares.py``: DeDLOC load balancing, each peer's share from its measured throughput.
* ``deadline.py``: adaptive round deadlines from observed round times (capped at the
  configured timeout).
* ``codecs.py``: the ``Codec`` interface and its registry (``register_codec``,
  ``get_codec``, ``codec_names``); the built-ins none / fp16 / uint8 / blockwise8.
* ``round.py``: ``GroupRound``, one butterfly round inside one group, reading what
  arrived from its ``GroupMailbox`` (``mailbox.py``).
* ``transport.py``: how a round moves messages and bytes (``RayTransport``; in-process
  ``LocalNetwork`` for tests); ``inline.py``: small payloads as call arguments.
* ``averager.py``: ``Averager``, the rounds of a plan; the API a replica calls
  (``all_reduce``; ``AveragingError`` when a step errors).
* ``peer.py``, ``faults.py``: an averaging actor of its own (benchmarks, tests) and the
  input-level faults it can inject.

The names below are the package's public interface; the modules are imported for them
(numpy only, no Ray, no torch).
"""

from moshray.cluster.collective.averager import Averager, AveragingError
from moshray.cluster.collective.codecs import (Codec, Encoded, codec_names, get_codec,
                                               register_codec)
from moshray.cluster.collective.partition import ContributionBounds, Limits
from moshray.cluster.collective.round import GroupRound

__all__ = ["Averager", "AveragingError", "Codec", "ContributionBounds", "Encoded",
           "GroupRound", "Limits", "codec_names", "get_codec", "register_codec"]
