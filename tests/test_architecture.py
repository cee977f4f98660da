"""docs/ARCHITECTURE.md names files that exist, and every package's file is named."""

import re
from pathlib import Path

import redcoast

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGE = Path(redcoast.__file__).parent


def _named() -> tuple[set[Path], set[Path]]:
    """The files and folders the page names, as paths in the package: a package's row
    names its files bare; elsewhere a path is relative to `redcoast/`."""
    files, folders = set(), set()
    for line in DOC.read_text().splitlines():
        row = re.match(r"^\| `redcoast/([a-z_]+)/` \| (.*)\|$", line)
        if row:
            folders.add(PACKAGE / row[1])
            files |= {PACKAGE / row[1] / name for name in re.findall(r"`([a-z_]+\.py)`", row[2])}
            continue
        for path in re.findall(r"`(?:redcoast/)?([a-z_]+(?:/[a-z_]+)*\.py)`", line):
            if not path.startswith("tests/"):
                files.add(PACKAGE / path)
    return files, folders


def test_every_file_and_package_it_names_exists() -> None:
    files, folders = _named()
    assert len(folders) >= 8 and len(files) >= 40
    missing = sorted(str(p.relative_to(PACKAGE)) for p in files | folders if not p.exists())
    assert not missing, f"docs/ARCHITECTURE.md names what does not exist: {missing}"


def test_every_package_and_top_level_file_is_on_the_page() -> None:
    files, folders = _named()
    packages = {p.parent for p in PACKAGE.glob("*/__init__.py")}
    assert packages <= folders, sorted(str(p) for p in packages - folders)
    top = {p for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    assert top <= files, sorted(p.name for p in top - files)
