"""Build hook: ship the model-card templates of ``model_cards/`` inside the wheel.

``model_cards/`` is the one copy of the templates (docs/design.md §6 names it); the wheel
carries them as ``raot_hf/templates/*.md``, where :func:`raot_hf.outputs.card._template_text`
looks first. Everything else about the build is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CARDS = Path(__file__).resolve().parent / "model_cards"


class BuildPyWithCards(build_py):
    """build_py that also copies model_cards/*.md to raot_hf/templates/ in the build tree."""

    def run(self):
        # a build tree left by an earlier build keeps modules that have since been deleted
        # (setuptools only adds files): start the package from a clean slate
        shutil.rmtree(Path(self.build_lib) / "raot_hf", ignore_errors=True)
        super().run()
        target = Path(self.build_lib) / "raot_hf" / "templates"
        target.mkdir(parents=True, exist_ok=True)
        for card in sorted(CARDS.glob("*.md")):
            shutil.copyfile(card, target / card.name)


setup(cmdclass={"build_py": BuildPyWithCards})
