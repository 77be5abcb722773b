"""The options of a merge (docs/architecture.md): :class:`RaotConfig`
(:mod:`raot_hf.config.core`), the options sections and their registry
(:mod:`raot_hf.config.sections`), and the field metadata that generates the CLI
(:mod:`raot_hf.config.options`). Nothing here imports a method: each method registers its own
section, and ``RaotConfig`` reads the registries (:mod:`raot_hf.registry`).
"""

from raot_hf.config.core import DTYPES, HEAD_POLICIES, RESIDUAL_MODES, SCOPES, RaotConfig, alignments

__all__ = ["DTYPES", "HEAD_POLICIES", "RESIDUAL_MODES", "SCOPES", "RaotConfig", "alignments"]
