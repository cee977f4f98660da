"""The package's structure: the framework knows no model, and the zoo is one of its users."""

import ast
import re
import tomllib
from pathlib import Path

import redcoast

PACKAGE = Path(redcoast.__file__).parent
# The public surface and the command line join the framework to the zoo; nothing else may.
GLUE = {"__init__.py", "__main__.py", "cli.py"}


def _imports(source: str, module_path: str) -> list[tuple[int, str]]:
    """Every module the source of `module_path` (`redcoast/fit.py`) imports, at any depth
    of the file, as absolute dotted names."""
    package = list(Path(module_path).parts[:-1])
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.append((node.lineno, module))
            # `from . import models` names the module in the alias.
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_no_framework_module_imports_the_zoo() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "models" or str(relative) in GLUE:
            continue
        source = path.read_text()
        for line, module in _imports(source, str(path.relative_to(PACKAGE.parent))):
            if module == "redcoast.models" or module.startswith("redcoast.models."):
                offenders.append(f"{relative}:{line} imports {module}")
    assert not offenders, "\n".join(offenders)


def test_the_direction_test_sees_an_import_of_the_zoo() -> None:
    # The finder itself: relative, absolute, aliased and nested imports all count.
    source = (
        "from .models import layers\nfrom . import models\nimport redcoast.models.hf\n"
        "def f():\n    from .models.planning import planned\n"
    )
    names = {name for _, name in _imports(source, "redcoast/fit.py")}
    assert {
        "redcoast.models",
        "redcoast.models.layers",
        "redcoast.models.hf",
        "redcoast.models.planning",
    } <= names
    deeper = {name for _, name in _imports("from ..models import hf", "redcoast/train/fit.py")}
    assert "redcoast.models.hf" in deeper


def test_every_runtime_dependency_is_imported_by_the_library() -> None:
    """What `pip install redcoast` brings, the library uses: a package only the tests
    use belongs in the `test` extra."""
    pyproject = PACKAGE.parent.parent / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in dependencies}
    imported = set()
    for path in PACKAGE.rglob("*.py"):
        module_path = str(path.relative_to(PACKAGE.parent))
        imported |= {name.split(".")[0] for _, name in _imports(path.read_text(), module_path)}
    # `rc.text` imports tokenizers lazily, by name (`_import("tokenizers")`).
    imported |= set(re.findall(r'_import\("(\w+)"\)', (PACKAGE / "text/_tokenizer.py").read_text()))
    assert names - imported == set()
