"""What a merge writes (docs/design.md §6): the repository directory ``from_pretrained`` loads.

* :mod:`~raot_hf.outputs.save` — :func:`write_merged_repo`, which orchestrates the rest;
* :mod:`~raot_hf.outputs.shards` — size parsing, safetensors shards and their index, verification;
* :mod:`~raot_hf.outputs.atomic` — the atomic temporary-sibling directory;
* :mod:`~raot_hf.outputs.card` — the model card and every rendering of the gate table and verdict;
* :mod:`~raot_hf.outputs.report` — ``raot_report.json``, its functional checks (:class:`Check`) and the
  card's context built from it;
* :mod:`~raot_hf.outputs.hashing` — SHA-256 of input files for the report.
"""

from raot_hf.outputs.atomic import check_destination
from raot_hf.outputs.card import CARD_NAME, alignment_summary, gate_table_text, render_model_card
from raot_hf.outputs.hashing import file_sha256, hash_checkpoint_files
from raot_hf.outputs.report import REPORT_NAME, Check, model_card_context, report_to_json
from raot_hf.outputs.save import write_merged_repo
from raot_hf.outputs.shards import INDEX_NAME, SINGLE_WEIGHTS_NAME, parse_size

__all__ = [
    "CARD_NAME",
    "INDEX_NAME",
    "REPORT_NAME",
    "SINGLE_WEIGHTS_NAME",
    "Check",
    "alignment_summary",
    "check_destination",
    "file_sha256",
    "gate_table_text",
    "hash_checkpoint_files",
    "model_card_context",
    "parse_size",
    "render_model_card",
    "report_to_json",
    "write_merged_repo",
]
