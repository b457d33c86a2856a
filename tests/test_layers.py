"""The package imports in one direction: no module takes part in an import cycle, not even with its own package.

import-linter (``lint-imports`` in CI, contracts in pyproject.toml) holds the layers to their order and keeps
sibling modules acyclic; this test also catches a module that imports the package it belongs to, whose
``__init__`` imports it back.
"""

import grimp


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.find_modules_directly_imported_by(target)))))
                    break
                if target in on_stack:
                    low[module] = min(low[module], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_of_the_package_takes_part_in_an_import_cycle():
    graph = grimp.build_graph("auditor", exclude_type_checking_imports=True)
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle_through_a_package():
    graph = grimp.ImportGraph()
    for name in ("p", "p.a", "p.b", "q"):
        graph.add_module(name)
    graph.add_import(importer="p", imported="p.a")
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p")
    graph.add_import(importer="q", imported="p")
    assert _cycles(graph) == [["p", "p.a", "p.b"]]
