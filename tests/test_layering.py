"""The house's rules (docs/architecture.md): no import cycle among the project's modules, package `__init__`s
included; the wings of vit_mpp/ import only wings below them; the config engine loads nothing of the process
lifecycle (vit_mpp/processes/), and the core walk of a step imports from it only the named calls the document lists;
no stage imports another, and vit_mpp/ imports no stage; no function of the product over 100 lines or over 6
parameters; a package's `__init__.py` holds only its docstring, which names every module and folder it holds; each
command has one `main`, in the module that runs it.

Every `import` and `from ... import` counts, at any depth (inside a function too), when it names a module of the
packages checked; `from package import name` counts as an import of `package.name` when that is a module, and an
import of `a.b.c` also imports the packages `a.b` and `a` (Python runs their `__init__` first).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers.step_path import DOC, walk_files

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("data_tools", "vit_mpp", "pretrain", "finetune", "analysis", "experiments")
MAX_FUNCTION_LINES = 100
MAX_PARAMETERS = 6  # beside self/cls: what a function needs beyond that travels as one object (a Run, a dataclass)
# vit_mpp/'s floors, lowest first: a module imports only modules of its own floor or of floors below it
WINGS = (("vit_mpp.errors", "vit_mpp.durable", "vit_mpp.progress", "vit_mpp.cli", "vit_mpp"),
         ("vit_mpp.config",), ("vit_mpp.processes",), ("vit_mpp.data",), ("vit_mpp.models",), ("vit_mpp.tools",),
         ("vit_mpp.run",))
WING = "vit_mpp.processes"  # the process lifecycle: a wing the core walk reaches through named calls only
STAGES = ("data_tools", "pretrain", "finetune", "analysis", "experiments")


def module_files(packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages`."""
    modules = {}
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules that module `name` imports, anywhere in its file."""
    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {m for m in map(resolve, targets) if m and m != name}
    packages = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 1)}  # their __init__s
    return found | {p for p in packages if p in known and p != name}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_cycles():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    known = module_files(PACKAGES)
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    assert len(graph) > 40 and graph["data_tools.builder.build_shards"]  # the walk found the modules and their imports
    assert {"vit_mpp", "vit_mpp.data"} <= graph["vit_mpp.data.stream"]  # and the packages it lives in
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c) + ")"
        for c in cycles)


def test_no_function_of_the_product_is_over_100_lines():
    long = []
    for path in module_files(PACKAGES).values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def floor(module: str) -> int:
    """The floor of a vit_mpp module (see WINGS)."""
    for i, wing in enumerate(WINGS):
        if any(module == w or module.startswith(w + ".") for w in wing if w != "vit_mpp") or module in wing:
            return i
    raise AssertionError(f"{module} is on no floor of WINGS: add it there")


def test_the_wings_of_vit_mpp_import_only_downwards():
    known = module_files(PACKAGES)
    up = []
    for name, path in known.items():
        if not name.startswith("vit_mpp"):
            continue
        for target in imported_modules(name, path, known):
            if target.startswith("vit_mpp") and floor(target) > floor(name):
                up.append(f"{name} (floor {floor(name)}) imports {target} (floor {floor(target)})")
    assert not up, up


def test_no_stage_imports_another_and_the_shared_code_imports_none():
    known = module_files(PACKAGES)
    crossing = []
    for name, path in known.items():
        own = name.split(".")[0]
        for target in imported_modules(name, path, known):
            other = target.split(".")[0]
            if other != own and (other in STAGES or (own == "vit_mpp" and other != "vit_mpp")):
                crossing.append(f"{name} imports {target}")
    assert not crossing, crossing


def test_no_function_of_the_product_takes_over_6_parameters():
    many = []
    for path in module_files(PACKAGES).values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
                         if a.arg not in ("self", "cls")]
                if len(names) > MAX_PARAMETERS:
                    many.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({len(names)} parameters)")
    assert not many, many


def test_a_package_init_holds_only_its_docstring():
    busy = []
    for name, path in module_files(PACKAGES).items():
        if path.name != "__init__.py":
            continue
        body = ast.parse(path.read_text(encoding="utf-8")).body
        rest = body[1:] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body
        if name == "vit_mpp":  # the root also says its version, which pyproject reads
            rest = [n for n in rest if not (isinstance(n, ast.Assign) and [t.id for t in n.targets] == ["__version__"])]
        if rest or not body:
            busy.append(str(path.relative_to(REPO)))
    assert not busy, busy


def test_each_command_has_one_main_in_the_module_that_runs_it():
    """A `main` lives in a `__main__.py`, in a module that runs it when run (`if __name__ == "__main__"`), or in one
    a package's `__main__.py` imports it from (a sub-command); never two in a module, never nested."""
    known = module_files(PACKAGES)
    dispatched = set()
    for path in known.values():
        if path.name == "__main__.py":
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and any(a.name == "main" for a in node.names):
                    dispatched.add(node.module)
    wrong = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        mains = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "main"]
        if not mains:
            continue
        runs_itself = "if __name__ == \"__main__\":" in path.read_text(encoding="utf-8")
        top = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        if len(mains) != 1 or len(top) != 1 or not (path.name == "__main__.py" or runs_itself or name in dispatched):
            wrong.append(str(path.relative_to(REPO)))
    assert not wrong, wrong


def import_closure(start: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module that importing `start` may load (its imports, theirs, ...)."""
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_the_config_engine_loads_nothing_of_the_process_lifecycle():
    """Reading a config (every tool does, before torch) must not load the rank's lifecycle and its exit hooks."""
    known = module_files(PACKAGES)
    graph = {name: imported_modules(name, path, known) for name, path in known.items()}
    reached = import_closure("vit_mpp.config.engine", graph)
    assert "vit_mpp.cli" in reached  # the closure is followed: the engine's parser
    assert not {m for m in reached if m == WING or m.startswith(WING + ".")}, sorted(reached)


def named_calls() -> dict[str, set[str]]:
    """The wing's named calls, from docs/architecture.md's table after "**The named calls**": module -> names."""
    text = DOC.read_text()
    calls: dict[str, set[str]] = {}
    for line in text[text.index("**The named calls**"):].splitlines()[1:]:
        if line.startswith("| `"):
            names, where = line.split("|")[1:3]
            module = where.strip().strip("`").removesuffix(".py").replace("/", ".")
            calls.setdefault(module, set()).update(re.findall(r"`(\w+)`", names.split("(")[0]))
        elif calls and not line.startswith("|"):
            break
    return calls


def wing_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for every import of the wing in a file; name None for an import of a module itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name == WING or a.name.startswith(WING + ".")]
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module + ".").startswith(WING + "."):
            found += [(node.module, a.name) if node.module != WING else (f"{WING}.{a.name}", None)
                      for a in node.names]
    return found


def test_the_core_walk_reaches_the_process_lifecycle_only_through_its_named_calls():
    calls = named_calls()
    assert calls and all(m.startswith(WING + ".") for m in calls), calls
    known = module_files(PACKAGES)
    for module, names in calls.items():  # each named call is a definition of the module the table names
        defined = {n.name for n in ast.parse(known[module].read_text()).body
                   if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert names <= defined, (module, names - defined)
    walk = walk_files()
    assert len(walk) <= 8 and not [f for f in walk if f.startswith(WING.replace(".", "/"))], walk
    stray = [f"{file} imports {module}" + (f".{name}" if name else "") for file in walk
             for module, name in wing_imports(REPO / file) if name not in calls.get(module, set())]
    assert not stray, stray


def test_a_package_docstring_names_every_module_and_folder_it_holds():
    """`name.py` for a module, `name/` for a sub-package (`__main__.py` is the package's command, `python -m
    PACKAGE`)."""
    unnamed = []
    for path in module_files(PACKAGES).values():
        if path.name != "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        for child in sorted(path.parent.iterdir()):
            if child.name in ("__init__.py", "__main__.py") or not (
                    child.suffix == ".py" or (child / "__init__.py").is_file()):
                continue
            named = child.name if child.suffix == ".py" else f"{child.name}/"
            if not re.search(rf"(?<![\w.]){re.escape(named)}", doc):
                unnamed.append(f"{path.relative_to(REPO)}: {child.name}")
    assert not unnamed, unnamed

