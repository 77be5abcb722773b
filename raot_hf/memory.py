"""Handing freed memory back to the operating system between stages (docs/design.md §7.2).

Activation temporaries under 32 MB come from the C heap, which keeps the pages after they are
freed: without a trim, the resident size after the calibration pass stays at its high-water mark
and the later stages' allocations come on top of it.
"""

from __future__ import annotations

import gc


def release_freed_memory() -> None:
    """Collect the young garbage generations and return the heap's free pages to the OS (glibc's
    ``malloc_trim``; a no-op where it is not available). A full collection is left to Python: it
    walks every object of transformers' import (~0.2 s), while the tensors a stage frees are freed
    when their last reference goes. Offloaded models' resident weight pages are dropped too."""
    gc.collect(1)
    from raot_hf.io.offload import release_all, trim_heap

    release_all(trim=False)  # offloaded models' weights: back to their files (docs/design.md §7.4)
    trim_heap()
