"""What a merge writes (docs/design.md §6): the repository directory ``from_pretrained`` loads, by
:func:`write_merged_repo` (``save``) from shards, an atomic directory, the card and the report."""

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
