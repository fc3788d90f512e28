"""Serving processes freeze their start-up heap once ready (splitserve/common/gc_heap.py)."""
import json
import subprocess
import sys

# Run in a process of its own: freezing is for the whole process, and pytest's heap is not ours.
SCRIPT = """
import gc, json
from splitserve.common.gc_heap import freeze_startup_heap

class Node:
    pass

loaded = []  # live reference cycles, as a loaded model and its framework hold
for _ in range(20000):
    a, b = Node(), Node()
    a.other, b.other = b, a
    loaded.append(a)
gc.collect()
tracked_before = len(gc.get_objects())
frozen = freeze_startup_heap()
tracked_after = len(gc.get_objects())
late = Node()
late.me = late  # a cycle made while serving, then dropped
del late
print(json.dumps({"tracked_before": tracked_before, "frozen": frozen, "tracked_after": tracked_after,
                  "collected_after": gc.collect(), "alive": sum(1 for a in loaded if a.other.other is a)}))
"""


def test_the_startup_heap_leaves_collections_and_later_garbage_is_still_collected():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=60)
    result = json.loads(out.stdout)
    assert result["tracked_before"] >= 40000
    assert result["frozen"] >= 40000  # every start-up object, the cycles included
    assert result["tracked_after"] < 1000  # what a full collection still walks
    assert result["collected_after"] >= 1  # garbage made after the freeze is still found
    assert result["alive"] == 20000  # frozen objects stay as they were
