"""The DVC stage graph, read from DVC itself: which stages a target needs, in run order."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import networkx as nx


def stage_address(stage: Any, root: str | Path) -> str:
    """What ``dvc repro`` accepts from ``root``: ``name`` (``name@item``) for the root dvc.yaml,
    ``sub/dvc.yaml:name`` otherwise. (DVC's own ``addressing`` is relative to the process's cwd.)"""
    dvcfile = os.path.relpath(stage.path, root)
    return stage.name if dvcfile == "dvc.yaml" else f"{dvcfile}:{stage.name}"


def _load_graph(root: str | Path) -> tuple[nx.DiGraph, dict[str, Any], dict[Any, str], dict[str, int]]:
    """DVC's stage graph, stages by address, addresses by stage, declaration positions.

    DVC's edges point from a stage to the stages it depends on.
    """
    # lazy: DVC's API (~1 s); the flow process imports this before it needs it
    from dvc.repo import Repo

    root = os.path.abspath(root)
    with Repo(root) as repo:
        graph = repo.index.graph
        stages = list(repo.index.stages)
    address = {s: stage_address(s, root) for s in stages}
    by_name = {address[s]: s for s in stages}
    position = {address[s]: i for i, s in enumerate(stages)}
    return graph, by_name, address, position


def all_stages(root: str | Path) -> list[str]:
    """Every stage of the project (``name`` or ``name@item``) in run order."""
    graph, by_name, address, position = _load_graph(root)
    return _run_order(graph, set(by_name), address, position)


def upstream_stages(root: str | Path, targets: str | Iterable[str]) -> list[str]:
    """The stages ``targets`` depend on, and the targets, in an order DVC could run them.

    Ties between independent stages are broken by declaration order in ``dvc.yaml`` (so the
    order is deterministic). Raises ``KeyError`` naming an unknown target and the known ones.
    """
    graph, by_name, address, position = _load_graph(root)
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = [t for t in targets if t not in by_name]
    if unknown:
        raise KeyError(f"unknown DVC stage(s) {unknown}; stages in {root}: {sorted(by_name)}")
    needed: set[str] = set()
    for t in targets:
        node = by_name[t]
        needed.add(t)
        needed.update(address[s] for s in nx.descendants(graph, node))
    return _run_order(graph, needed, address, position)


def _run_order(
    graph: nx.DiGraph, names: set[str], address: dict[Any, str], position: dict[str, int]
) -> list[str]:
    sub = nx.DiGraph()
    sub.add_nodes_from(names)
    for stage, dep in graph.edges:
        if address[stage] in names and address[dep] in names:
            sub.add_edge(address[dep], address[stage])  # dependency first
    return list(nx.lexicographical_topological_sort(sub, key=lambda name: position[name]))
