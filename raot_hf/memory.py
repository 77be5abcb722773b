"""Handing freed memory back to the operating system between stages (docs/design.md §7.2).

Activation temporaries under 32 MB come from the C heap, which keeps the pages after they are
freed: without a trim, the resident size after the calibration pass stays at its high-water mark
and the later stages' allocations come on top of it.
"""

from __future__ import annotations

import gc


def release_freed_memory(working_files=None) -> None:
    """Collect the young garbage generations and return the heap's free pages to the OS (glibc's
    ``malloc_trim``; a no-op where it is not available). A full collection is left to Python: it
    walks every object of transformers' import, while the tensors a stage frees are freed when
    their last reference goes. The resident weight pages of the offloaded models in
    ``working_files`` (:class:`raot_hf.io.offload.WorkingFiles`; None: an in-memory merge) are
    dropped too."""
    gc.collect(1)
    from raot_hf.io.offload import trim_heap

    if working_files is not None:  # offloaded models' weights: back to their files (docs/design.md §7.4)
        working_files.release_all(trim=False)
    trim_heap()
