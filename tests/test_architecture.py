"""docs/architecture.md is the map, and these checks keep it true: it names every package and every long
module, every file it names exists (with the class or function it says is there), and the imports follow
the layers and the rules of the house it states. Pure AST and text: well under a second."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLL = ROOT / "roll"
PAGE = ROOT / "docs" / "architecture.md"

# Top to bottom (the page's "Layers"): a module imports its own package and the layers below, never one
# above; the packages of one layer do not import each other. Top-level modules count as packages.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("cli",),
    ("pipelines",),
    ("config",),
    ("plots", "run_compare"),
    ("run_metrics",),
    ("tracking",),
    ("trackers", "health"),
    ("serving",),
    ("export",),
    ("checkpoint", "rollout", "workers"),
    ("distributed",),
    ("strategies",),
    ("rewards",),
    ("envs", "models"),
    ("sandbox", "algorithms"),
    ("data",),
    ("utils",),
)
# Only these import Ray: the rest of the library calls clusters, never Ray handles.
RAY_PACKAGES = {"distributed", "workers"}
# Only these read the config at run time: a worker receives a spec built from it (pipelines/worker_specs.py).
CONFIG_READERS = {"cli", "pipelines", "config"}
LONG_MODULE_LINES = 200


def package_of(path: Path) -> str:
    rel = path.relative_to(ROLL)
    return rel.parts[0].removesuffix(".py")


def runtime_imports(path: Path) -> list[tuple[str, int]]:
    """The modules ``path`` imports when it runs (at module level or inside functions), leaving out the
    type-only imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "roll":  # from roll import checkpoint
                found += [(f"roll.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((node.module, node.lineno))
    return found


def modules() -> list[Path]:
    return sorted(p for p in ROLL.rglob("*.py") if "__pycache__" not in p.parts)


def imported_packages() -> list[tuple[str, str, str]]:
    """(importing package, imported package or 'ray', where) for every import of roll or Ray."""
    edges = []
    for path in modules():
        for module, line in runtime_imports(path):
            parts = module.split(".")
            if parts[0] == "roll" and len(parts) > 1:
                target = parts[1]
            elif parts[0] == "ray":
                target = "ray"
            else:
                continue
            edges.append((package_of(path), target, f"{path.relative_to(ROOT)}:{line}"))
    return edges


def test_every_package_is_in_a_layer() -> None:
    layered = {name for layer in LAYERS for name in layer}
    present = {package_of(p) for p in modules()} - {"__init__"}
    assert present <= layered, f"add these to LAYERS (and to docs/architecture.md): {present - layered}"


def test_imports_go_down_the_layers() -> None:
    depth = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    upward = [
        f"{where}: {source} imports {target}"
        for source, target, where in imported_packages()
        if target in depth and source != target and depth[target] <= depth[source]
    ]
    assert not upward, "imports against the layers of docs/architecture.md:\n" + "\n".join(upward)


def test_only_the_distributed_layer_and_the_workers_import_ray() -> None:
    found = [f"{where}" for source, target, where in imported_packages() if target == "ray"]
    outside = [w for w in found if package_of(ROOT / w.split(":")[0]) not in RAY_PACKAGES]
    assert found, "the scan sees Ray's imports"
    assert not outside, f"Ray imported outside {sorted(RAY_PACKAGES)}:\n" + "\n".join(outside)


def test_only_the_pipelines_and_the_cli_read_the_config() -> None:
    readers = [
        where
        for source, target, where in imported_packages()
        if target == "config" and source not in CONFIG_READERS
    ]
    assert not readers, (
        "roll.config imported at run time below pipelines/ (a worker gets a spec; a type hint goes under "
        "TYPE_CHECKING):\n" + "\n".join(readers)
    )


def page() -> str:
    return PAGE.read_text()


def test_the_page_names_every_package_and_every_long_module() -> None:
    text = page()
    packages = sorted({p.parent.relative_to(ROLL).as_posix() for p in ROLL.rglob("__init__.py")} - {"."})
    long_modules = [
        p.relative_to(ROLL).as_posix()
        for p in modules()
        if len(p.read_text().splitlines()) > LONG_MODULE_LINES
    ]
    missing = [f"{name}/" for name in packages if f"{name}/" not in text]
    missing += [name for name in long_modules if name not in text]
    assert len(long_modules) > 30, long_modules  # the scan sees the long modules
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_every_file_the_page_names_exists_with_what_it_says_is_there() -> None:
    """A path in backticks must exist; a path followed by a name (`roll/x.py`, `Name` or
    `roll/x.py` (`Name`)) must define that name."""
    text = page()
    paths = set(re.findall(r"`((?:roll|tests|benchmarks|examples|docs)/[\w/.-]+)`", text))
    assert len(paths) > 20, paths
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    wrong = []
    for path, name in re.findall(r"`(roll/[\w/]+\.py)`,? \(?`(\w+)`", text):
        source = ROOT / path
        defined = rf"^\s*(class|def|async def) {name}\b|^{name}\b\s*[:=]"
        if source.exists() and not re.search(defined, source.read_text(), re.M):
            wrong.append(f"{path} does not define {name}")
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
    assert not wrong, "\n".join(wrong)
