"""The server's start-up heap frozen out of the garbage collector (server/heap.py), in a process of its own: a
freeze is process-wide."""

import subprocess
import sys

CODE = """
import gc, weakref
import torch
from loraplex.server.heap import freeze_start_up_heap

class Node:
    pass

cycle = Node()
cycle.self = cycle
garbage = weakref.ref(cycle)
del cycle  # cyclic garbage left by start-up: collected, not frozen for good
kept = [torch.zeros(1) for _ in range(1000)]
tracked = len(gc.get_objects())
frozen = freeze_start_up_heap()
print(garbage() is None, frozen > tracked // 2, len(gc.get_objects()))
"""


def test_start_up_garbage_is_collected_and_the_rest_frozen():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout.split()
    collected, all_frozen, still_tracked = out
    assert collected == "True" and all_frozen == "True"
    assert int(still_tracked) < 100  # a later full collection walks almost nothing of the start-up heap
