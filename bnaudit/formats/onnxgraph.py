"""Walking an ONNX ModelProto's graphs: the main graph, subgraphs (If/Loop/Scan bodies) and
local functions, without the `onnx` package (the protobuf messages are only read).

    walk_graph(graph, where)     (graph path, node) of a graph and its subgraphs
    all_graphs(graph)            (graph path, graph) of a graph and every subgraph
    with_function_nodes(proto)   every node as written: the main graph, then function bodies
    call_sites(proto)            every node as it runs: a function's body once per call
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_GRAPH, _GRAPHS = 5, 10  # AttributeProto.AttributeType


def walk_graph(graph: Any, where: str) -> Iterator[tuple[str, Any]]:
    for node in graph.node:
        yield where, node
        yield from subgraph_nodes(node, where)


def subgraph_nodes(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    for sub_where, sub in subgraphs(node, where):
        yield from walk_graph(sub, sub_where)


def subgraphs(node: Any, where: str) -> Iterator[tuple[str, Any]]:
    label = node.name or node.op_type
    for attr in node.attribute:
        if attr.type == _GRAPH:
            yield f"{where}/{label}.{attr.name}", attr.g
        elif attr.type == _GRAPHS:
            for i, g in enumerate(attr.graphs):
                yield f"{where}/{label}.{attr.name}[{i}]", g


def all_graphs(graph: Any, where: str = "main") -> Iterator[tuple[str, Any]]:
    yield where, graph
    for node in graph.node:
        for sub_where, sub in subgraphs(node, where):
            yield from all_graphs(sub, sub_where)


def with_function_nodes(proto: Any) -> Iterator[tuple[str, Any]]:
    """(graph path, node) of the main graph and its subgraphs, then of each local function's body."""
    yield from walk_graph(proto.graph, "main")
    for function in proto.functions:
        where = f"function:{function.name}"
        for node in function.node:
            yield where, node
            yield from subgraph_nodes(node, where)


@dataclass(frozen=True)
class _CallSite:
    """A node of a local function's body as one call instantiates it: the function's formal
    inputs and outputs renamed to the call's, attributes that refer to the function's own
    (`ref_attr_name`) replaced by the call's values, the label prefixed by the call's."""

    name: str
    op_type: str
    domain: str
    input: list[str]
    output: list[str]
    attribute: list[Any]


def call_sites(proto: Any) -> Iterator[tuple[str, Any]]:
    """(graph path, node) of every node as it runs: the main graph and its subgraphs, where
    a call of a local function stands for its body once per call (a BatchNorm2d function
    called twice is two BN nodes, each with the initializers its call passes), then the
    bodies of functions no graph calls, as written."""
    functions = {(f.domain, f.name): f for f in proto.functions}
    called: set[tuple[str, str]] = set()

    def expand(where: str, node: Any, depth: int) -> Iterator[tuple[str, Any]]:
        function = functions.get((node.domain, node.op_type))
        if function is None or depth > 16:  # deeper nesting than exporters write: the call stays a node
            yield where, node
            return
        called.add((node.domain, node.op_type))
        renames = {**dict(zip(function.input, node.input)), **dict(zip(function.output, node.output))}
        given = {a.name: a for a in node.attribute}
        label = node.name or node.op_type
        for inner in function.node:
            site = _CallSite(
                f"{label}/{inner.name or inner.op_type}",
                inner.op_type,
                inner.domain,
                [renames.get(n, n) for n in inner.input],
                [renames.get(n, n) for n in inner.output],
                _bound_attributes(inner, given),
            )
            yield from expand(f"function:{function.name}", site, depth + 1)

    for where, node in walk_graph(proto.graph, "main"):
        yield from expand(where, node, 0)
    for key, function in functions.items():
        if key not in called:
            where = f"function:{function.name}"
            for node in function.node:
                yield where, node
                yield from subgraph_nodes(node, where)


def _bound_attributes(node: Any, given: dict[str, Any]) -> list[Any]:
    out = []
    for attr in node.attribute:
        if not attr.ref_attr_name:
            out.append(attr)
        elif attr.ref_attr_name in given:
            bound = type(attr)()
            bound.CopyFrom(given[attr.ref_attr_name])
            bound.name = attr.name
            out.append(bound)
        # a reference the call does not set: the operator's default applies, as at run time
    return out
