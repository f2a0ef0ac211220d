"""Trainer -> inference weight transfer.

The simplest correct transfer: rank 0 of the trainer exports its full weights once into Ray's object
store, and every inference worker loads them from there (the driver passes only a reference, so the
bytes never travel through the controller). A version number guards against loading stale weights.
Bucketed transfer over a collective group replaces this for large models (see the device-mapping issue).
"""

from __future__ import annotations

from roll.distributed.cluster import Cluster


def sync_weights(trainer: Cluster, inference: Cluster, version: int) -> None:
    """Load ``trainer``'s current weights (``export_weights``) into every ``inference`` worker."""
    exported = trainer.export_weights(blocking=False)
    # Passing the object reference, not the value: each worker fetches the weights itself.
    inference.load_weights(exported.refs[0], version)
