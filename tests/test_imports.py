"""The import graph of the packages: dependencies flow one way (llamaspec <- jaxmodel,
torchref <- compare <- llama_parity), no module imports itself back through others (lazy
imports inside functions count too: a cycle is a design knot whether or not Python trips on
it), and no private name (`_x`) is imported from or read off another module."""

from __future__ import annotations

import ast
from pathlib import Path

from llamaspec.files import atomic_write

ROOT = Path(__file__).resolve().parents[1]
LEVEL = {"llamaspec": 0, "jaxmodel": 1, "torchref": 1, "compare": 2, "llama_parity": 3}
# compare's rooms: the shared vocabulary at the bottom, what can be compared and the page
# toolkit above it, the two products on top (and neither imports the other).
ROOMS = {"compare.vocabulary": 0, "compare.metrics": 0, "compare.environment": 0, "compare.results": 0,
         "compare.evidence": 0, "compare.explain": 1,   # typed records, and the sentences made from them
         "compare.adapters": 1, "compare.report": 1,
         "compare.judge": 2,      # the one judge of a tap, shared by the ladder and the probes
         "compare.ladder": 3, "compare.probes": 3, "compare.sweep": 3,
         "compare.controls": 4,   # the planted-bug catalogue: calibrates the engine, never imported by it
         "compare.repro": 4}      # a finding as a case to hand upstream: on top of the ladder


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in LEVEL for p in (ROOT / pkg).rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]):
    """(imported module, names taken from it, line) for every import in the file; names
    read as attributes of an imported module (`ops._x`) are reported as taken too."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.append((a.name, [], node.lineno))
                if a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:  # `from . import ops`: a module, not a name
                    found.append((sub, [], node.lineno))
                    aliases[a.asname or a.name] = sub
                else:
                    found.append((base, [a.name], node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.append((aliases[node.value.id], [node.attr], node.lineno))
    return found


def _room(module: str) -> str | None:
    """The compare room a module lives in (None outside compare/ and for compare/__init__)."""
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


def _against_rooms(mine: str | None, theirs: str | None) -> bool:
    """A room may import rooms below it; the shared bottom rooms may also import each other."""
    if not mine or not theirs or mine == theirs:
        return False
    return ROOMS[theirs] > ROOMS[mine] or ROOMS[theirs] == ROOMS[mine] > 0


def _graph():
    mods = _modules()
    known = set(mods)
    edges, problems = {m: set() for m in mods}, []
    for name, path in mods.items():
        top = name.split(".")[0]
        for target, names, line in _imports(name, path, known):
            if target.split(".")[0] not in LEVEL:
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            other = target.split(".")[0]
            if other != top and LEVEL[other] >= LEVEL[top]:
                problems.append(f"{where}: {name} imports {target} (not below {top})")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != name:
                problems.append(f"{where}: {name} takes private {', '.join(private)} from {target}")
            if target in known and target != name:
                edges[name].add(target)
            mine, theirs = _room(name), _room(target)
            if _against_rooms(mine, theirs):
                problems.append(f"{where}: {name} imports {target} ({theirs} is not below {mine})")
    return edges, problems


def _cycles(edges) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in edges:
        if v not in index:
            visit(v)
    return out


def _without_package_inits(edges):
    """A package's __init__ re-exports its modules; a module importing a sibling through the
    package (`from llamaspec import Policy`) is not a cycle with that module."""
    return {m: {t for t in ts if not (t in LEVEL or "." not in t and t == m.split(".")[0])} for m, ts in edges.items()}


def test_dependencies_flow_one_way_and_no_private_name_crosses_a_module():
    _, problems = _graph()
    assert not problems, "\n".join(problems)


def test_no_import_cycle():
    edges, _ = _graph()
    cycles = _cycles(_without_package_inits(edges))
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_what_it_checks():
    """The graph is not empty and knows the edges every reader can see."""
    edges, _ = _graph()
    assert "llamaspec.policy" in edges["torchref.ops"] or "llamaspec" in edges["torchref.ops"]
    assert "compare.metrics" in edges["compare.ladder.engine"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _room("compare.ladder.engine") == "compare.ladder" and _room("compare") is None
    assert _against_rooms("compare.ladder", "compare.probes") and _against_rooms("compare.adapters", "compare.ladder")
    assert not _against_rooms("compare.ladder", "compare.adapters") and not _against_rooms(
        "compare.vocabulary", "compare.metrics")
    assert {"compare.adapters", "compare.metrics"} <= edges["compare.ladder.engine"]


# ----- the models' private names, and the controls room ---------------------------------------

MODEL_PACKAGES = ("torchref", "jaxmodel")
ENGINE_ROOMS = ("compare.judge", "compare.ladder", "compare.adapters", "compare.probes", "compare.report")


def _private_names_defined(paths) -> set[str]:
    """`_x` names the files define: functions, classes, methods, module globals and the
    attributes their code assigns (`self._x = ...`)."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Name):
                            names.add(leaf.id)
                        elif isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store):
                            names.add(leaf.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_reads(path: Path, private: set[str]):
    """(line, `x._name`) for every attribute access in the file whose name is one of
    `private`, on anything but the file's own `self` / `cls`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in private and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            yield node.lineno, f"{ast.unparse(node.value)}.{node.attr}"


# White-box tests of a model package's own internals (invariant.py's packing cache and exp).
WHITE_BOX = {"tests/test_batch_invariant.py"}


def _outside_the_models() -> list[Path]:
    return [p for d in ("compare", "llama_parity", "bench", "tests") for p in sorted((ROOT / d).rglob("*.py"))
            if str(p.relative_to(ROOT)) not in WHITE_BOX]


def test_nothing_outside_the_models_reads_their_private_names():
    """Attribute access included (`m._rope`, `attn._head`), not only imports: controls, adapters
    and the engine work on the models' public seams (module.ops, rope_tables, head_weight,
    Attention's cache seams)."""
    private = _private_names_defined(p for pkg in MODEL_PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    found = [f"{path.relative_to(ROOT)}:{line}: {read}" for path in _outside_the_models()
             for line, read in _private_reads(path, private)]
    assert not found, "\n".join(found)


def test_the_private_name_check_sees_what_it_checks(tmp_path):
    private = _private_names_defined((ROOT / "torchref").rglob("*.py"))
    assert {"_take_slots", "_param", "_install", "_KEPT"} <= private
    probe = tmp_path / "probe.py"
    atomic_write(probe, "def f(m, self):\n    m._install(1)\n    self._install(2)\n    return m.model._param\n",
                 "probe module")
    assert sorted(read for _, read in _private_reads(probe, private)) == ["m._install", "m.model._param"]


def test_the_engine_never_imports_the_controls_room():
    edges, _ = _graph()
    found = [(m, t) for m, targets in edges.items() if _room(m) in ENGINE_ROOMS
             for t in targets if _room(t) == "compare.controls"]
    assert not found, found
    assert "compare.controls.prefill" in edges["compare.controls.decode"]   # the graph sees the room
