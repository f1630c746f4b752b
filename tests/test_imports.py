"""The package's modules form layers: no import circle, counting the imports inside functions too."""

import ast
from pathlib import Path

import txl

PACKAGE = Path(txl.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """{module: the txl modules it imports anywhere in its file}; a package stands for its __init__."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("txl", *path.relative_to(PACKAGE).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str:  # the module a dotted name lives in
        while name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {owner(a.name) for a in node.names if a.name.startswith("txl")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("txl"):
                edges |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else owner(node.module)
                          for a in node.names}
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_model_layers_point_down():
    """positions knows no other txl module; the kernels never import the attention that calls them; no module
    of the model imports the package above it; the data layer does not import the model."""
    graph = import_graph()
    assert graph["txl.model.positions"] == set()
    assert not graph["txl.model.kernels"] & {"txl.model.attention", "txl.model.transformer", "txl.model"}
    assert "txl.model" not in set().union(*(graph[m] for m in graph if m.startswith("txl.model.")))
    assert not {m for m in graph["txl.data.iterator"] if m.startswith("txl.model")}


def floors(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports between the package's parts (a subpackage such as txl.data or txl.model
    counted as one part, a module of the package as one): the number of floors the house stands on."""
    def part(name: str) -> str:
        return ".".join(name.split(".")[:2])

    parts: dict[str, set[str]] = {}
    for name, edges in graph.items():
        parts.setdefault(part(name), set()).update(part(e) for e in edges if part(e) != part(name))
    chains: dict[str, list[str]] = {}

    def chain(p: str) -> list[str]:
        if p not in chains:
            chains[p] = [p] + max((chain(q) for q in parts.get(p, ())), key=len, default=[])
        return chains[p]

    return max((chain(p) for p in parts), key=len)


def test_the_package_stands_eight_floors_high():
    """Convenience imports pointed down (the tokenizer files find a model directory in txl.hub, not through
    txl.pretrained and the model; elastic reads rundir.latest; score takes inference_context from evaluate):
    8 floors, not 11."""
    longest = floors(import_graph())
    assert len(longest) <= 8, " -> ".join(longest)
    graph = import_graph()
    assert "txl.pretrained" not in graph["txl.data.tokenizer.files"] and "txl.checkpoint" not in graph["txl.elastic"]
    assert "txl.generation" not in graph["txl.score"]


def test_the_floor_counter_counts():
    assert floors({"txl.a": {"txl.b.x"}, "txl.b.x": {"txl.b.y"}, "txl.b.y": {"txl.c"}, "txl.c": set()}) == [
        "txl.a", "txl.b", "txl.c"]
