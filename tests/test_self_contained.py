"""The repository stands on its own: no file points outside it, and every citation of the
format document (``docs/format.md §N``) names a section that exists."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", "build", "__pycache__", ".pytest_cache"}
TEXT_SUFFIXES = {".py", ".md", ".h", ".cc", ".cu", ".cuh", ".txt", ".toml", ".cfg", ""}
# A path above the checkout, or the old names of a format description kept elsewhere (written
# in pieces so that a plain grep of the repository for them finds nothing, this file included).
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "NVFP4" + "_SPEC", r"\bspec" + " §",
                               "/" + "work/"]))
CITATION = re.compile(r"docs/format\.md\s+((?:§\d+(?:\s*(?:-|,|and)\s*)?)+)")


def _candidates():
    """The files git tracks or would track (ignored ones, e.g. .hypothesis/ or a local scratch
    folder, are not the repository's); every file below the root where git is not available."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [ROOT / line for line in listed.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        return list(ROOT.rglob("*"))


def repository_files():
    for path in _candidates():
        parts = set(path.relative_to(ROOT).parts)
        if (path.is_file() and not parts & SKIP_DIRS and not any(p.startswith(".venv")
                                                                 for p in parts)
                and path.suffix in TEXT_SUFFIXES and not path.name.endswith(".so")):
            yield path


def test_no_reference_outside_the_repository():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in repository_files()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, "\n".join(found)


def test_format_citations_name_existing_sections():
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "format.md").read_text(), re.M))
    assert sections == {str(i) for i in range(1, 9)}, sections
    cited = {}
    for p in repository_files():
        text = p.read_text(errors="replace")
        for m in CITATION.finditer(text.replace("\n", " ")):
            for n in re.findall(r"§(\d+)", m.group(1)):
                cited.setdefault(n, []).append(str(p.relative_to(ROOT)))
    assert len(cited) >= 6, cited
    missing = {n: files for n, files in cited.items() if n not in sections}
    assert not missing, missing
