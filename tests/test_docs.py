"""The design document is the repository's own: every citation of docs/design.md names a section
heading that exists there, and nothing points at a design file outside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
SCANNED = ("raot_hf", "tests", "benchmarks")
SUFFIXES = (".py", ".md")

_SECTION = r"\d+(?:\.\d+)?"
# "docs/design.md §4", "docs/design.md §3.3", ranges "docs/design.md §4–6" (en dash or hyphen)
_CITATION = re.compile(rf"docs/design\.md\)?\s*§({_SECTION})(?:\s*[–-]\s*({_SECTION}))?")
# a bare "§3.3" inside the package: the package's comments cite the design document that way
_BARE = re.compile(rf"§({_SECTION})(?:\s*[–-]\s*({_SECTION}))?")
_HEADING = re.compile(rf"^#+\s+§({_SECTION})\b")
# the old design file that lived outside the repository (spelled in upper case)
_OUTSIDE = re.compile(r"\bDESIGN\.md\b")


def design_sections(text: str) -> list[str]:
    """Section ids ("4", "3.3") of the headings of the design document, in order."""
    return [m.group(1) for line in text.splitlines() if (m := _HEADING.match(line))]


def cited_sections(text: str, *, bare: bool = False) -> list[str]:
    """Every section a text cites; a range "§4–6" cites 4, 5 and 6."""
    out = []
    for m in (_BARE if bare else _CITATION).finditer(text):
        first, last = m.group(1), m.group(2)
        if last is not None and "." not in first and "." not in last:
            out += [str(n) for n in range(int(first), int(last) + 1)]
        else:
            out += [first] + ([last] if last else [])
    return out


def missing_citations(text: str, sections: set[str], *, bare: bool = False) -> list[str]:
    return [s for s in cited_sections(text, bare=bare) if s not in sections]


def _files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in (*SCANNED, "docs"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES and p.is_file())
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def test_design_document_keeps_the_section_numbering():
    sections = design_sections(DESIGN.read_text(encoding="utf-8"))
    top = [s for s in sections if "." not in s]
    assert top == [str(n) for n in range(1, 12)], top
    assert len(sections) == len(set(sections)), "a section number is used twice"
    for sub in (s for s in sections if "." in s):
        assert sub.split(".")[0] in top, sub


def test_every_citation_names_an_existing_section():
    sections = set(design_sections(DESIGN.read_text(encoding="utf-8")))
    problems = []
    count = 0
    for path in _files():
        text = path.read_text(encoding="utf-8")
        count += len(cited_sections(text))
        problems += [f"{path.relative_to(ROOT)}: §{s}" for s in missing_citations(text, sections)]
        if path.suffix == ".py" and path.relative_to(ROOT).parts[0] == "raot_hf":
            problems += [f"{path.relative_to(ROOT)}: bare §{s}" for s in missing_citations(text, sections, bare=True)]
    assert count > 0, "no citation of docs/design.md found: the scan is broken"
    assert not problems, "citations of sections docs/design.md does not have:\n" + "\n".join(problems)


def test_nothing_cites_a_design_file_outside_the_repository():
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _files()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _OUTSIDE.search(line)
    ]
    assert not offenders, "cite docs/design.md instead of the old DESIGN" + ".md:\n" + "\n".join(offenders)


def test_the_checks_catch_what_they_are_for():
    sections = {"1", "3", "3.3", "4", "5", "6"}
    assert missing_citations("see docs/design.md §3.3 and docs/design.md §4–6", sections) == []
    assert missing_citations("see docs/design.md §3.4", sections) == ["3.4"]
    assert missing_citations("see docs/design.md §4–7", sections) == ["7"]
    assert missing_citations("[docs/design.md §9](docs/design.md)", sections) == ["9"]
    assert missing_citations("a bare (§3.2) citation", sections, bare=True) == ["3.2"]
    assert design_sections("# title\n## §1 Conventions\n### §3.3 Folding\ntext §4\n") == ["1", "3.3"]
    assert _OUTSIDE.search("as DESIGN" + ".md §4 says") and not _OUTSIDE.search("docs/design.md §4")


_PATH = re.compile(r"(?<![~/.\w])raot_hf/[\w/]+(?:\.py|\.json)?")  # not inside another path (~/.cache/raot_hf/…)


def test_every_module_path_the_docs_name_exists():
    """docs/architecture.md's map (and every other document's file references) stays true as the
    code moves: each ``raot_hf/…`` path named in README.md, docs/ and benchmarks' READMEs exists."""
    documents = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(ROOT.glob("benchmarks/**/README.md")),
    ]
    missing = []
    for doc in documents:
        for m in _PATH.finditer(doc.read_text(encoding="utf-8")):
            path = m.group(0).rstrip("/")
            if not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "documents name files that do not exist:\n" + "\n".join(sorted(set(missing)))
