"""The output vocabulary of a merge file's ``tokenizer:`` (mergekit's ``base``, a model's, or the
``union``) and each model's embedding rows moved into it (docs/design.md §6.10).

For each model, the row of an output token is the model's own row of that token; a token the model
lacks (or one whose ``tokens:`` entry is forced) gets a fill: the base's row when the base has the
token, the one model's row when a single model has it, the mean of the rows of the models that
have it otherwise, zeros when none does, or the row the ``tokens:`` entry names. The merge rule
then merges these rows like any other tensor. Rows past the vocabulary (``pad_to_multiple_of``)
are each model's mean row.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from raot_hf.errors import RaotError

logger = logging.getLogger("raot_hf.merging.vocab")

#: Chat templates by name (``chat_template: chatml``), written for this project.
CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "alpaca": (
        "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
        "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
        "{% else %}{{ '### Response:\\n' + message['content'] + eos_token + '\\n\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
}


def chat_template_text(setting: str | None, tokenizers: list[Any]) -> str | None:
    """The template a merge file's ``chat_template`` names: ``auto`` — the one most of
    ``tokenizers`` carry (None when none does), a name of :data:`CHAT_TEMPLATES`, or the text itself."""
    if setting is None:
        return None
    if setting != "auto":
        return CHAT_TEMPLATES.get(setting, setting)
    found = []
    for tokenizer in tokenizers:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        if template:
            found.append(template.strip())
    return Counter(found).most_common(1)[0][0] if found else None


def union_tokenizer(base: Any, others: list[Any], rows: list[int]) -> Any:
    """``base`` (a fresh tokenizer, changed in place) extended to the union: the base's vocabulary,
    then each tokenizer's tokens not yet present (tokenizers in order, tokens by id) as added
    tokens, then every tokenizer's own added tokens (the first setting of a token wins). A
    tokenizer's ids at or past its model's ``rows`` are left out."""
    base_vocab = base.get_vocab()
    normal: dict[str, None] = {}
    added: dict[str, Any] = {}
    for tokenizer, limit in zip([base, *others], rows, strict=True):
        own_added = tokenizer.added_tokens_decoder
        added_names = {info.content for info in own_added.values()}
        for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
            if index < limit and token not in added_names and token not in base_vocab:
                normal.setdefault(token)
        for index, info in sorted(own_added.items()):
            if index < limit:
                added.setdefault(info.content, info)
    new = [t for t in normal if t not in added]
    if new:
        base.add_tokens(new)
    for info in added.values():
        if info.content not in base.get_vocab():
            base.add_tokens([info], special_tokens=bool(getattr(info, "special", False)))
    return base


@dataclass
class OutputVocabulary:
    """The output tokenizer and, per checkpoint (by index), the row of each output token in it
    (−1: it lacks the token); ``fills``: output id → (kind, checkpoint, row) of a token's fill
    (``model``: that checkpoint's row; ``mean`` over the checkpoints that have it; ``zero``);
    ``forced``: ids whose fill replaces every model's own row; ``size``: output rows (padded)."""

    tokenizer: Any
    size: int
    rows: dict[int, torch.Tensor]
    fills: dict[int, tuple[str, int | None, int | None]] = field(default_factory=dict)
    forced: set[int] = field(default_factory=set)

    def moved(self, tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each checkpoint's embedding (or head) ``tensors[i]`` moved to the output vocabulary."""
        count = len(next(iter(self.rows.values())))
        any_tensor = next(iter(tensors.values()))
        fills: dict[int, torch.Tensor] = {}
        for index, (kind, checkpoint, row) in self.fills.items():
            if kind == "model":
                fills[index] = tensors[checkpoint][row].to(torch.float64)
            elif kind == "zero":
                fills[index] = torch.zeros(any_tensor.shape[1], dtype=torch.float64)
            else:  # the mean over the checkpoints that have the token, summed from the first
                having = [tensors[c][int(r[index])].to(torch.float64) for c, r in self.rows.items() if c in tensors
                          and r[index] >= 0]  # fmt: skip
                total = having[0]
                for value in having[1:]:
                    total = total + value
                fills[index] = total / len(having)
        out = {}
        for checkpoint, tensor in tensors.items():
            rows = self.rows[checkpoint]
            moved = torch.zeros((self.size, tensor.shape[1]), dtype=tensor.dtype)
            own = (rows >= 0).nonzero().flatten()
            own = own[[int(i) not in self.forced for i in own]] if self.forced else own
            moved[own] = tensor[rows[own]]
            for index, value in fills.items():
                if rows[index] < 0 or index in self.forced:
                    moved[index] = value.to(tensor.dtype)
            if self.size > count:  # padding rows: the mean of the vocabulary's
                moved[count:] = moved[:count].to(torch.float64).mean(0).to(tensor.dtype)
            out[checkpoint] = moved
        return out


def build_vocabulary(spec, tokenizers: dict[int, Any], rows: dict[int, int], base: int | None, order: list[int],
                     refs: dict[Any, int]) -> OutputVocabulary:  # fmt: skip
    """The output vocabulary of a ``tokenizer:`` spec (:class:`raot_hf.merging.mergefile.TokenizerSpec`).
    ``tokenizers``: checkpoint index → its tokenizer (a fresh copy: the output's is changed in
    place); ``rows``: each checkpoint's embedding rows; ``base``: the base's index (None: the first
    in ``order``, the checkpoints in the merge file's order); ``refs``: model reference → index."""
    first = base if base is not None else order[0]
    if spec.source == "base":
        tokenizer = tokenizers[first]
    elif spec.source == "union":
        others = [i for i in order if i != first]
        tokenizer = union_tokenizer(
            tokenizers[first], [tokenizers[i] for i in others], [rows[first]] + [rows[i] for i in others]
        )
    else:
        tokenizer = tokenizers[refs[spec.source]]
    missing = [t for t in spec.tokens if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing)
    vocab = tokenizer.get_vocab()
    count = len(vocab)
    if max(vocab.values()) >= count:
        raise RaotError("the output tokenizer's ids are not 0 … n − 1; choose another tokenizer source")
    size = count
    if spec.pad_to_multiple_of and size % spec.pad_to_multiple_of:
        size += spec.pad_to_multiple_of - size % spec.pad_to_multiple_of
    table: dict[int, torch.Tensor] = {}
    for i in order:
        own = tokenizers.get(i, tokenizers[first]).get_vocab()  # no tokenizer: the base's, as mergekit assumes
        positions = torch.full((count,), -1, dtype=torch.long)
        for token, index in vocab.items():
            if token in own and own[token] < rows[i]:
                positions[index] = own[token]
        table[i] = positions
    vocabulary = OutputVocabulary(tokenizer, size, table)
    for token, index in vocab.items():
        how = spec.tokens.get(token)
        if how is not None:
            vocabulary.fills[index] = _explicit_fill(token, how, table, tokenizers, rows, refs)
            if how.force:
                vocabulary.forced.add(index)
            continue
        having = [i for i in order if table[i][index] >= 0]
        if len(having) == 1:
            vocabulary.fills[index] = ("model", having[0], int(table[having[0]][index]))
        elif not having:
            logger.warning("token %r is in no model: its embedding rows are zeros", token)
            vocabulary.fills[index] = ("zero", None, None)
        elif base is not None and table[base][index] >= 0:
            vocabulary.fills[index] = ("model", base, int(table[base][index]))
        elif len(having) < len(order):
            vocabulary.fills[index] = ("mean", None, None)
    return vocabulary


def _explicit_fill(token, how, table, tokenizers, rows, refs) -> tuple[str, int | None, int | None]:
    """A ``tokens:`` entry's fill: zeros, or a row of the checkpoint it names (its own row of the
    token, or the row of another token or id)."""
    if how.kind == "zero":
        return ("zero", None, None)
    if how.model not in refs:
        raise RaotError(f"tokenizer: tokens {token!r} names {how.model}, which the merge does not read; name a model")
    checkpoint = refs[how.model]
    own = tokenizers[checkpoint].get_vocab() if checkpoint in tokenizers else {}
    wanted = token if how.kind == "model" else how.token
    row = how.token_id if how.kind == "model_token" and how.token_id is not None else own.get(wanted, -1)
    if not 0 <= row < rows[checkpoint]:
        raise RaotError(
            f"tokenizer: tokens {token!r}: {how.model} has no row for {wanted or row!r}; name another source"
        )
    return ("model", checkpoint, int(row))
