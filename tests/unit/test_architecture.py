"""The package's shape, checked from its source: import arrows, backend boundaries, no copied backends.

DESIGN §2 says which way imports point; these tests read every module of ``celery_workflow`` with :mod:`ast` and
fail on:

* an import loop: among the imports that run (at module level or inside a function: an import deferred into a
  function is a loop in disguise when it closes one), where importing ``pkg.sub`` from outside ``pkg`` runs
  ``pkg/__init__.py`` too; imports under ``TYPE_CHECKING`` never run, so they are left out of the loop check (but not
  of the boundary checks below);
* a backend importing another backend (a backend is its public facade and its private package, the broker store its
  transport runs on included: ``_aws.broker_store``, ``_redis.store``, ``_sqlite.queue``, ``_postgres.queue``);
* a transport importing a backend module its backend does not offer it (:data:`TRANSPORT_IMPORTS`), and any other
  transport module (the Kombu layer shared by all of them) importing a backend at all;
* ``world.py`` importing any backend, or a World (any module on the World side, every backend's included) importing a
  transport;
* Celery's API used outside ``app.py`` (and Kombu's outside ``app.py`` and the transports);
* a module reaching into another celery_workflow module's private names;
* the transport's claim keys written or read anywhere but :class:`celery_workflow.world.Claim`;
* more than :data:`MAX_SHARED_LINES` consecutive lines shared by two Worlds or by two transports.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import celery_workflow

ROOT = Path(celery_workflow.__file__).parent
PACKAGE = "celery_workflow"

#: Each backend's modules, by prefix: its public facade and its private package (the broker store its transport runs
#: on lives there too). ``_redis`` is a backend of its own: the SQS store takes its control channel as the contract's
#: ``ControlStore``, so ``_aws`` never names it; the SQS transport puts the two together.
BACKENDS: dict[str, tuple[str, ...]] = {
    "sqlite": ("celery_workflow.world_sqlite", "celery_workflow._sqlite"),
    "postgres": ("celery_workflow.world_pg", "celery_workflow._postgres"),
    "aws": ("celery_workflow.world_sqs", "celery_workflow._aws", "celery_workflow.aws_costs"),
    "redis": ("celery_workflow._redis",),
    "memory": ("celery_workflow.testing.memory",),
}
#: The backend modules each transport may import: what its backend offers a transport (its broker store, what opening
#: one takes, its World's facade or class to build one from a URL). Every other module of ``transport/`` (the Kombu
#: layer the transports share) imports no backend module; backends never import a transport (:data:`WORLD_SIDE`).
TRANSPORT_IMPORTS: dict[str, frozenset[str]] = {
    "celery_workflow.transport.sqlite": frozenset(
        {"celery_workflow._sqlite.database", "celery_workflow._sqlite.queue", "celery_workflow._sqlite.world"}
    ),
    "celery_workflow.transport.postgres": frozenset(
        {
            "celery_workflow._postgres.database",
            "celery_workflow._postgres.listener",
            "celery_workflow._postgres.queue",
            "celery_workflow._postgres.standing",
            "celery_workflow._postgres.world",
        }
    ),
    "celery_workflow.transport.sqs": frozenset(
        {"celery_workflow._aws.broker_store", "celery_workflow._redis.store", "celery_workflow.world_sqs"}
    ),
}
#: Modules on the World side of the line: they store state and must not know how Celery consumes it.
WORLD_SIDE = (
    "celery_workflow.world",
    "celery_workflow._backend",
    "celery_workflow.world_sqlite",
    "celery_workflow._sqlite",
    "celery_workflow.world_pg",
    "celery_workflow._postgres",
    "celery_workflow.world_sqs",
    "celery_workflow._aws",
    "celery_workflow.testing.memory",
    "celery_workflow._redis",
)
MAX_SHARED_LINES = 15


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    #: (imported module, line, at module level outside TYPE_CHECKING)
    imports: list[tuple[str, int, bool]] = field(default_factory=list)
    #: lines of the imports under ``TYPE_CHECKING`` (they never run)
    typing_lines: set[int] = field(default_factory=set)
    #: names imported with ``from celery_workflow.x import name``: (module, name, line)
    names: list[tuple[str, str, int]] = field(default_factory=list)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _known(name: str, modules: set[str]) -> str | None:
    """The package module ``name`` refers to (itself, or its closest parent that is a module), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _typing_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk(node: ast.AST, top: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node with whether it runs at import time (module level, not under ``if TYPE_CHECKING``)."""
    for child in ast.iter_child_nodes(node):
        if _typing_only(child) or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, False)
        else:
            yield child, top
            yield from _walk(child, top)


def load() -> dict[str, Module]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = Module(_module_name(path), path, ast.parse(path.read_text(), str(path)))
        found[module.name] = module
    names = set(found)
    for module in found.values():
        package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
        module.typing_lines = {
            inner.lineno
            for node in ast.walk(module.tree)
            if _typing_only(node)
            for inner in ast.walk(node)
            if isinstance(inner, ast.Import | ast.ImportFrom)
        }
        for node, top in _walk(module.tree, True):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module.imports.append((alias.name, node.lineno, top))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if _known(target, names) == target:  # ``from package import submodule``
                        module.imports.append((target, node.lineno, top))
                    else:
                        module.imports.append((base, node.lineno, top))
                        if base.startswith(PACKAGE):
                            module.names.append((base, alias.name, node.lineno))
    return found


MODULES = load()


def _group(name: str) -> str | None:
    for group, prefixes in BACKENDS.items():
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return group
    return None


def _inside(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _internal(module: Module) -> Iterator[tuple[str, int, bool]]:
    names = set(MODULES)
    for target, line, top in module.imports:
        known = _known(target, names) if target.startswith(PACKAGE) else None
        if known is not None and known != module.name:
            yield known, line, top


def test_the_parser_sees_the_known_arrows() -> None:
    """Guards the checks below against a parser that finds nothing."""
    app = {t for t, _, _ in _internal(MODULES["celery_workflow.app"])}
    assert {"celery_workflow.world", "celery_workflow.runtime.handlers", "celery_workflow.client"} <= app
    facade = {t for t, _, _ in _internal(MODULES["celery_workflow.world_pg"])}
    assert "celery_workflow._postgres.world" in facade
    assert len(MODULES) > 50


def _runtime_graph() -> dict[str, set[str]]:
    """Module -> the package modules its running imports load: module level or inside a function, never under
    ``TYPE_CHECKING``; importing ``pkg.sub`` from outside ``pkg`` loads ``pkg`` (its ``__init__``) as well (the
    top package itself excepted: every module is inside it)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, module in MODULES.items():
        for target, line, _ in _internal(module):
            if line in module.typing_lines:
                continue
            graph[name].add(target)
            parent = target.rpartition(".")[0]
            while parent != PACKAGE and parent in MODULES and not _inside(name, (parent,)):
                graph[name].add(parent)
                parent = parent.rpartition(".")[0]
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """One loop (``a -> b -> ... -> a``) per strongly connected group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(name: str) -> None:  # Tarjan's strongly connected components
        index[name] = low[name] = len(index)
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            if target not in index:
                connect(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == name:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            connect(name)
    loops = []
    for group in groups:
        members = set(group)
        path, seen = [group[0]], {group[0]}
        while True:  # walk inside the group until a module repeats: that is a loop
            following = sorted(t for t in graph[path[-1]] if t in members)
            step = next((t for t in following if t in seen), following[0])
            if step in seen:
                loops.append([*path[path.index(step) :], step])
                break
            path.append(step)
            seen.add(step)
    return loops


def test_no_import_loop() -> None:
    loops = import_loops(_runtime_graph())
    assert loops == [], "import loops:\n" + "\n".join(" -> ".join(loop) for loop in loops)


def test_the_loop_check_finds_a_loop_deferred_into_a_function() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_loops(graph) == [["a", "b", "c", "a"]]
    assert import_loops({"a": {"b"}, "b": set()}) == []


def test_no_test_stand_in_ships_in_the_package() -> None:
    """Stand-ins for services (the SQS message move task API moto lacks) are test tooling: they live in ``tools/`` at
    the repository root, not in the installed package (issue #28, item 5). The package serves no HTTP with the
    standard library's server, which is what such a stand-in is built on."""
    servers = sorted(
        name for name, module in MODULES.items() for target, _, _ in module.imports if target == "http.server"
    )
    assert servers == []
    assert (ROOT.parent / "tools" / "move_tasks.py").is_file()


def test_no_backend_imports_another_backend() -> None:
    wrong = [
        f"{name}:{line} imports {target}"
        for name, module in MODULES.items()
        if (mine := _group(name)) is not None
        for target, line, _ in _internal(module)
        if (theirs := _group(target)) is not None and theirs != mine
    ]
    assert wrong == []


def test_transports_import_backends_only_through_what_the_backend_offers_them() -> None:
    offered = {target for targets in TRANSPORT_IMPORTS.values() for target in targets}
    assert offered <= set(MODULES), "TRANSPORT_IMPORTS names a module that is not there"
    assert all(_group(target) is not None for target in offered), "TRANSPORT_IMPORTS names a module of no backend"
    transports = [name for name in MODULES if _inside(name, ("celery_workflow.transport",))]
    assert set(TRANSPORT_IMPORTS) <= set(transports)
    wrong = [
        f"{name}:{line} imports {target}"
        for name in transports
        for target, line, _ in _internal(MODULES[name])
        if _group(target) is not None and target not in TRANSPORT_IMPORTS.get(name, frozenset())
    ]
    assert wrong == []


def test_world_py_names_no_backend_and_no_world_imports_a_transport() -> None:
    world = [t for t, _, _ in _internal(MODULES["celery_workflow.world"]) if _group(t) is not None]
    assert world == [], "world.py imports backends"
    wrong = [
        f"{name}:{line} imports {target}"
        for name, module in MODULES.items()
        if _inside(name, WORLD_SIDE)
        for target, line, _ in _internal(module)
        if _inside(target, ("celery_workflow.transport", "celery_workflow.app"))
    ]
    assert wrong == []


def test_celery_is_used_only_by_app_py() -> None:
    def users(package: str) -> set[str]:
        return {
            name
            for name, module in MODULES.items()
            for target, _, _ in module.imports
            if target == package or target.startswith(package + ".")
        }

    # demo.py is the demo application (user code the CLI's demo command runs), not part of the library's machinery;
    # workers on our transports run Celery's own pools (the transports are on its event loop: no pool of ours);
    # inspector/server.py wraps a bare
    # World for the run inspector in a Workflows with a Celery app of its own (only to build the wake-up message of a
    # hook it resumes, as app.py builds every message: with Celery's own builder); testing/conformance_faults.py,
    # testing/conformance_fanout.py, testing/conformance_versions.py, testing/conformance_deadlines.py and
    # testing/conformance_children.py run real workflows on the World under test, in a Workflows with a Celery app of
    # their own, for the same reason; worker_setup.py is app.py's worker side (the worker signals a Workflows connects:
    # queues without -Q, pools per process, upkeep), a module of its own to keep app.py under the size limit;
    # transport/scheduled.py is the ``inspect scheduled`` remote-control command a worker on our transports answers
    # (celery.worker.control's Panel, installed on celery.signals.worker_init); relay_celery.py is the Celery side of
    # the relay (publishing a stored delivery with Celery's own send_task_message, the worker's reserved requests);
    # celery_tasks.py is app.py's tasks (their bodies, their Request, what they report to Celery), split off app.py
    allowed = {
        "celery_workflow.celery_tasks",
        "celery_workflow.relay_celery",
        "celery_workflow.app",
        "celery_workflow.worker_setup",
        "celery_workflow.demo",
        "celery_workflow.transport.scheduled",
        "celery_workflow.inspector.server",
        "celery_workflow.testing.conformance_faults",
        "celery_workflow.testing.conformance_fanout",
        "celery_workflow.testing.conformance_versions",
        "celery_workflow.testing.conformance_deadlines",
        "celery_workflow.testing.conformance_children",
    }
    assert users("celery") <= allowed
    assert {n for n in users("kombu") if not n.startswith("celery_workflow.transport.")} <= {"celery_workflow.app"}


def test_no_module_reaches_into_another_modules_private_names() -> None:
    wrong = [
        f"{name}:{line} imports {target}.{imported}"
        for name, module in MODULES.items()
        for target, imported, line in module.names
        if imported.startswith("_") and not imported.startswith("__") and target != name
    ]
    for name, module in MODULES.items():
        aliases = {
            alias.asname or alias.name
            for node in ast.walk(module.tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE)
            for alias in node.names
            if f"{node.module}.{alias.name}" in MODULES
        }
        for node in ast.walk(module.tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and (node.value.id in aliases or (name.endswith("handlers") and node.value.id not in ("self", "cls")))
            ):
                wrong.append(f"{name}:{node.lineno} reads {ast.unparse(node)}")
    assert wrong == []


def test_the_claim_keys_live_in_one_place() -> None:
    users = sorted(
        name for name, module in MODULES.items() if re.search(r"cw_(receipt|attempts)", module.path.read_text())
    )
    assert users == ["celery_workflow.world"]


def test_the_task_name_prefixes_live_in_one_place() -> None:
    """``workflow.`` and ``step.`` task names are built and read by :mod:`celery_workflow.task_names` alone."""
    literal = re.compile(r"""["'](workflow|step)\.["'{]""")
    users = sorted(name for name, module in MODULES.items() if literal.search(module.path.read_text()))
    assert users == ["celery_workflow.task_names"]


# -- duplicated code -----------------------------------------------------------------------------------------------


def _significant(path: Path) -> list[tuple[int, str]]:
    """(line number, text with white space folded) of the lines that carry code: no blanks, comments, imports."""
    out = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        text = " ".join(raw.split())
        if not text or text.startswith(("#", "import ", "from ")) or text in ("(", ")", "[", "]", "{", "}", "),", "],"):
            continue
        out.append((number, text))
    return out


def _windows(path: Path, size: int) -> dict[str, int]:
    lines = _significant(path)
    return {
        hashlib.blake2b("\n".join(t for _, t in lines[i : i + size]).encode(), digest_size=16).hexdigest(): lines[i][0]
        for i in range(len(lines) - size + 1)
    }


def _show(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _shared(groups: dict[str, list[Path]], size: int) -> list[str]:
    windows = {(group, path): _windows(path, size) for group, paths in groups.items() for path in paths}
    found = []
    items = sorted(windows.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))
    for i, ((group_a, path_a), a) in enumerate(items):
        for (group_b, path_b), b in items[i + 1 :]:
            if group_a == group_b:
                continue
            common = set(a) & set(b)
            if common:
                key = min(common, key=lambda k: a[k])
                found.append(f"{_show(path_a)}:{a[key]} ~ {_show(path_b)}:{b[key]}")
    return found


def _files(prefixes: tuple[str, ...]) -> list[Path]:
    return [m.path for name, m in MODULES.items() if _inside(name, prefixes)]


def test_no_two_worlds_or_transports_share_more_than_fifteen_lines() -> None:
    worlds = {
        group: _files(tuple(p for p in prefixes if ".transport." not in p)) for group, prefixes in BACKENDS.items()
    }
    transports = {name: [m.path] for name, m in MODULES.items() if name.startswith("celery_workflow.transport.")}
    shared = _shared(worlds, MAX_SHARED_LINES + 1) + _shared(transports, MAX_SHARED_LINES + 1)
    assert shared == [], "runs of more than 15 lines shared between backends:\n" + "\n".join(shared)


def test_the_duplicate_check_finds_a_copy(tmp_path: Path) -> None:
    original = MODULES["celery_workflow._sqlite.world"].path
    copy = tmp_path / "copy.py"
    copy.write_text("\n".join(original.read_text().splitlines()[100:140]))
    assert _shared({"a": [original], "b": [copy]}, MAX_SHARED_LINES + 1) != []
