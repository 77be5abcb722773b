"""The parents' outputs kept from the calibration pass for the one sweep (docs/design.md §5.7):
the temporary store reads back exactly what was put, row ranges across pieces included, with
direct I/O and without, and gives up (keeping nothing) past its budget."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raot_hf.calibration.kept import ALIGN, KeptOutputs


def _store(tmp_path, direct: bool, budget=None) -> KeptOutputs:
    store = KeptOutputs(tmp_path, budget=budget)
    if not direct and store.direct is not None:  # the buffered path, as where the system has no O_DIRECT
        import os

        os.close(store.direct)
        store.direct = store._staged = None
    return store


@pytest.mark.parametrize("direct", [True, False])
@settings(max_examples=20, deadline=None)
@given(
    pieces=st.lists(st.integers(0, 700), min_size=1, max_size=6),
    width=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_rows_read_back_what_was_put(tmp_path_factory, direct, pieces, width, dtype, cut):
    store = _store(tmp_path_factory.mktemp("kept"), direct)
    g = torch.Generator().manual_seed(len(pieces) * 1000 + width)
    parts = [torch.randn(n, width, generator=g).to(dtype) for n in pieces]
    for p in parts:
        store.put(("site", "a", 0, "q"), p)
        store.put(("other",), p[: max(1, p.shape[0] // 2)])  # interleaved: pieces are not contiguous
    full = torch.cat(parts)
    lo, hi = sorted(int(c * full.shape[0]) for c in cut)
    assert torch.equal(store.rows(("site", "a", 0, "q"), lo, hi), full[lo:hi])
    assert torch.equal(store.rows(("site", "a", 0, "q")), full)
    assert store.nbytes % ALIGN == 0
    store.close()


def test_past_its_budget_the_store_keeps_nothing(tmp_path):
    store = _store(tmp_path, True, budget=3 * ALIGN)
    store.put(("k",), torch.ones(10, 10))
    assert store.usable and store.has(("k",))
    store.put(("k",), torch.ones(1000, 10))  # 40 kB > the budget's 12 kB
    assert not store.usable and not store.has(("k",)) and "GiB" in store.why
