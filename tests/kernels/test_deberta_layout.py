"""The DeBERTa kernels' sub-package imports as a tree: each module imports only modules below it in
the order its `__init__` lists, never the package itself (which re-exports them), and only at the top
of the file; every file stays within the house's 400 lines."""

import ast
from pathlib import Path

import packedenc.kernels.triton.deberta as pkg

ORDER = ["slots", "scores", "tiles", "launch", "forward_wide", "forward", "backward", "op"]
PREFIX = "packedenc.kernels.triton.deberta"


def _imports(tree: ast.Module):
    """(line, module) of every import statement anywhere in the file, and the line of the first def."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, []) for a in node.names)
    first_def = min((n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))), default=10**9)
    return found, first_def


def test_the_sub_package_imports_form_a_tree():
    folder = Path(pkg.__file__).parent
    files = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    assert files == sorted(ORDER), "a new module: place it in ORDER (and the package docstring)"
    for i, name in enumerate(ORDER):
        src = (folder / f"{name}.py").read_text()
        assert len(src.splitlines()) <= 400, name
        found, first_def = _imports(ast.parse(src))
        for line, module, names in found:
            assert line < first_def, f"{name}.py:{line} imports {module} below its first definition"
            if module == PREFIX:
                raise AssertionError(f"{name}.py:{line} imports the package that re-exports it ({names})")
            if module.startswith(PREFIX + "."):
                below = module[len(PREFIX) + 1:]
                assert below in ORDER[:i], f"{name}.py imports {below}, which is not below it in {ORDER}"
    init = ast.parse((folder / "__init__.py").read_text())
    for line, module, _ in _imports(init)[0]:
        assert module.startswith(PREFIX + ".") and module[len(PREFIX) + 1:] in ORDER, module
