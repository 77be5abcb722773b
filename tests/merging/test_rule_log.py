"""The rule log (:class:`raot_hf.merging.RuleLog`): chunks add up, and ``to_dict`` is the report's
``"merge"`` entry (docs/design.md §6.4)."""

import torch

from raot_hf.merging import RuleLog, apply_rule, merge_linear, merge_rule_spec, merge_ties
from raot_hf.merging.log import VARIES


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "v": torch.randn(5, generator=g), "ids": torch.arange(3)}


def test_chunk_logs_add_up_to_the_whole_merges_log():
    base, a, b = _state(0), _state(1), _state(2)
    kw = dict(base=base, density=0.5)
    _, whole = merge_ties([a, b], [0.6, 0.4], return_log=True, **kw)
    total = RuleLog("ties")
    for names in (["w"], ["v", "ids"]):
        chunk = [{k: s[k] for k in names} for s in (a, b)]
        _, part = merge_ties(chunk, [0.6, 0.4], return_log=True, base={k: base[k] for k in names}, density=0.5)
        total.add(part)
    assert total.counts == whole.counts == {"ties": 2, "copied from A (not floating point)": 1}
    assert total.totals == whole.totals and whole.totals["entries"] == 17
    assert total.settings == whole.settings and total.params == {}  # per-tensor notes stay with the parts
    assert whole.to_dict() == {
        "rule": "ties",
        "settings": whole.settings,
        "counts": whole.counts,
        "totals": whole.totals,
    }


def test_list_settings_extend_and_the_report_entry_keeps_its_order():
    log = RuleLog("toy", {"weights": (0.5, 0.5), "not_in_base": ["x"]})
    log.add(RuleLog("toy", {"weights": (0.25, 0.75), "not_in_base": ["y"]}, {"linear": 2}))
    log.add({"rule": "toy", "settings": {}, "counts": {"linear": 1}, "totals": {"entries": 4}})
    log.note("z", "copied")
    assert log.settings == {"weights": VARIES, "not_in_base": ["x", "y"]}  # parts that differ: said so
    log.add(RuleLog("toy", {"scale": 2.0}))
    log.add(RuleLog("toy", {"scale": 2.0}))
    assert log.settings["scale"] == 2.0
    assert log.counts == {"linear": 3, "copied": 1} and log.totals == {"entries": 4}
    assert list(log.to_dict()) == ["rule", "settings", "counts", "totals"]
    log.correction = {"method": "none"}
    assert list(log.to_dict()) == ["rule", "settings", "counts", "totals", "correction"]
    assert list(RuleLog("toy").to_dict()) == ["rule", "settings", "counts"]


def test_a_rule_returning_a_plain_dict_log_is_read_as_a_rule_log():
    spec = merge_rule_spec("linear")
    _, log = apply_rule(spec, [_state(1), _state(2)], [0.5, 0.5])
    assert isinstance(log, RuleLog) and log.counts["linear"] == 2
    plain = {"rule": "toy", "settings": {"k": 1}, "counts": {"taken": 3}}
    read = RuleLog.from_dict(plain)
    assert read.to_dict() == plain and read.totals is None and read.correction is None
    _, whole = merge_linear([_state(1), _state(2)], [0.5, 0.5], return_log=True)
    assert RuleLog.from_dict({**whole.to_dict(), "params": whole.params}) == whole
