"""The server's start-up heap, taken out of Python's cyclic garbage collector.

A full collection walks every object the collector tracks, and it runs on whichever thread allocates when the
threshold trips: often the engine thread, mid-step. After start-up that is ~370,000 objects (the model's modules
and parameters, torch, transformers, the server), none of which becomes cyclic garbage while the server runs:
walking them all is a pause of every stream. Frozen after start-up, later
full collections walk only what came after (requests, adapters loaded since). Objects frozen are still freed by
reference counting; only a cycle among them would never be.
"""

from __future__ import annotations

import gc


def freeze_start_up_heap() -> int:
    """Collect what is garbage now, then move every object alive to the collector's permanent generation; returns
    how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
