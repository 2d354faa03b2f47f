"""Placement: which node gets the next sandbox.

A node's score is its free capacity after taking the sandbox — the smallest free fraction
over the dimensions the sandbox asks for (sandbox slots always; CPUs and memory when it sets
limits) — plus ``CACHE_WEIGHT`` times the fraction of the image's bytes the node already
caches. Highest score wins; a node the sandbox would not fit on is never chosen. Filling by
free *fraction* spreads sandboxes in proportion to capacity (a node twice as large gets twice
as many), and the cache term prefers a node that can start the image without fetching it,
unless it is more than ``CACHE_WEIGHT`` fuller than the best other node.

`Placer` keeps the views of all nodes and updates the chosen node after each decision (its
usage grows, and it will hold the image), so a batch is placed against one round of node
queries. It is pure computation over plain numbers: benchmarks/bench_placement.py runs it on
simulated nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CACHE_WEIGHT = 0.25


@dataclass
class NodeView:
    name: str
    cap_sandboxes: int
    cap_cpus: float
    cap_memory: int
    used_sandboxes: int = 0
    used_cpus: float = 0.0
    used_memory: int = 0
    #: image -> (image bytes, bytes of it this node caches)
    images: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def from_info(cls, name: str, info: dict[str, Any], image: str | None = None) -> NodeView:
        cap, use = info["capacity"], info["usage"]
        v = cls(name, int(cap["sandboxes"]), float(cap["cpus"]), int(cap["memory"]),
                int(use["sandboxes"]), float(use["cpus"]), int(use["memory"]))
        if image and "image" in info:
            v.images[image] = (int(info["image"]["bytes"]), int(info["image"]["cached_bytes"]))
        return v

    def score(self, image: str | None, cpus: float | None, memory: int | None) -> float | None:
        """None if the sandbox does not fit, else free fraction + cache bonus."""
        if self.cap_sandboxes <= self.used_sandboxes:
            return None
        free = 1.0 - (self.used_sandboxes + 1) / self.cap_sandboxes
        if cpus:
            left = self.cap_cpus - self.used_cpus - cpus
            if left < -1e-9:
                return None
            free = min(free, left / self.cap_cpus)
        if memory:
            left_m = self.cap_memory - self.used_memory - memory
            if left_m < 0:
                return None
            free = min(free, left_m / self.cap_memory)
        if image is not None:
            total, cached = self.images.get(image, (0, 0))
            if total:
                free += CACHE_WEIGHT * cached / total
        return free

    def take(self, image: str | None, cpus: float | None, memory: int | None) -> None:
        self.used_sandboxes += 1
        self.used_cpus += cpus or 0.0
        self.used_memory += memory or 0
        if image is not None:
            total, _ = self.images.get(image, (0, 0))
            self.images[image] = (total, total)  # once a sandbox runs here, the image is cached

    def release(self, cpus: float | None, memory: int | None) -> None:
        self.used_sandboxes = max(0, self.used_sandboxes - 1)
        self.used_cpus = max(0.0, self.used_cpus - (cpus or 0.0))
        self.used_memory = max(0, self.used_memory - (memory or 0))


class Placer:
    """Greedy placement over a set of node views (a linear scan: a few microseconds per node,
    see docs/benchmarks-cluster.md)."""

    def __init__(self, views: list[NodeView]) -> None:
        self.views = {v.name: v for v in views}

    def ranked(self, image: str | None = None, cpus: float | None = None,
               memory: int | None = None, exclude: set[str] | frozenset[str] = frozenset()
               ) -> list[str]:
        """Names of the nodes the sandbox fits on, best first."""
        scored = [(s, name) for name, v in self.views.items() if name not in exclude
                  and (s := v.score(image, cpus, memory)) is not None]
        scored.sort(key=lambda t: (-t[0], t[1]))
        return [name for _, name in scored]

    def place(self, image: str | None = None, cpus: float | None = None,
              memory: int | None = None, exclude: set[str] | frozenset[str] = frozenset()
              ) -> str | None:
        """The best node (and count the sandbox against it), or None when nothing fits."""
        best, best_score = None, -1e18
        for name, v in self.views.items():
            if name in exclude:
                continue
            s = v.score(image, cpus, memory)
            if s is not None and s > best_score:
                best, best_score = name, s
        if best is not None:
            self.views[best].take(image, cpus, memory)
        return best
