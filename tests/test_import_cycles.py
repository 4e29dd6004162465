"""No import cycle anywhere in rollstream/, imports inside functions included: a module that
needs another lazily still depends on it, and two modules that need each other are one module
split in the wrong place. The import-linter contracts (pyproject.toml) check the layers; this
checks what layers cannot see, cycles inside one layer."""

from __future__ import annotations

import grimp


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The groups of modules of ``graph`` that import each other, directly or through others
    (the strongly connected components of more than one module, Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_module_of_rollstream_imports_itself_through_others():
    graph = grimp.build_graph("rollstream", cache_dir=None)
    # function-level imports are in the graph: the transformers path of load_prompt_ids
    assert graph.direct_import_exists(importer="rollstream.policy.prompt_ids", imported="rollstream.policy.model")
    assert cycles(graph) == []


def test_the_check_finds_a_cycle_through_a_lazy_import():
    graph = grimp.ImportGraph()
    for module in ("pkg.a", "pkg.b", "pkg.c", "pkg.d"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    graph.add_import(importer="pkg.c", imported="pkg.a")  # say, inside a function
    graph.add_import(importer="pkg.d", imported="pkg.a")
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
