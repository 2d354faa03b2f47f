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

import bisect
from dataclasses import dataclass, field
from typing import Any

CACHE_WEIGHT = 0.1


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
        # overcommit: a node offers its capacity times its ratios, and counts as used what
        # its sandboxes declared or, where more, what they hold now at the same ratio
        mem_ratio = float(cap.get("memory_overcommit", 1.0))
        used_memory = max(int(use["memory"]), int(use.get("resident", 0) * mem_ratio))
        v = cls(name, int(cap["sandboxes"]), float(cap["cpus"]) * float(
                    cap.get("cpu_overcommit", 1.0)), int(cap["memory"] * mem_ratio),
                int(use["sandboxes"]), float(use["cpus"]), used_memory)
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

    def release_on(self, name: str, cpus: float | None = None,
                   memory: int | None = None) -> None:
        """A placed sandbox failed to start: give its room back."""
        self.views[name].release(cpus, memory)



class FastPlacer(Placer):
    """`Placer`'s decisions at a fraction of its cost, for large clusters and batches.

    Each node's free fraction lives in a flat list updated in place after each decision,
    and for each image the nodes caching it are listed; the best node is then the larger of
    the freest node overall and the freest caching node plus its bonus, both found by
    builtin ``max`` over a list (a C loop) instead of a Python method call per node.
    Requests with CPU or memory limits, or with excluded nodes, take the full scan.
    """

    def __init__(self, views: list[NodeView]) -> None:
        super().__init__(views)
        self._names = list(self.views)
        self._index = {name: i for i, name in enumerate(self._names)}
        self._free = [self._free_of(self.views[n]) for n in self._names]
        #: image -> (indices of nodes caching all of it, {index: bonus} for partial caches)
        self._cached: dict[str, tuple[list[int], dict[int, float]]] = {}
        for i, name in enumerate(self._names):
            for image in self.views[name].images:
                self._note(i, image)

    @staticmethod
    def _free_of(v: NodeView) -> float:
        if v.cap_sandboxes <= v.used_sandboxes:
            return -1e18
        return 1.0 - (v.used_sandboxes + 1) / v.cap_sandboxes

    def _note(self, i: int, image: str) -> None:
        total, cached = self.views[self._names[i]].images.get(image, (0, 0))
        full, partial = self._cached.setdefault(image, ([], {}))
        partial.pop(i, None)
        if total and cached >= total:
            if i not in full:
                bisect.insort(full, i)
        elif total and cached:
            partial[i] = CACHE_WEIGHT * cached / total

    def place(self, image: str | None = None, cpus: float | None = None,
              memory: int | None = None, exclude: set[str] | frozenset[str] = frozenset()
              ) -> str | None:
        if cpus or memory or exclude:
            name = super().place(image, cpus, memory, exclude)
            if name is not None:
                self._update(self._index[name], image)
            return name
        free = self._free
        if not free:
            return None
        best = max(range(len(free)), key=free.__getitem__)
        key = (free[best], -best)  # ties go to the first node, as in the scan
        if image is not None and image in self._cached:
            full, partial = self._cached[image]
            if full:
                c = max(full, key=free.__getitem__)  # full is sorted: first of equals
                if free[c] > -1e17 and (free[c] + CACHE_WEIGHT, -c) > key:
                    best, key = c, (free[c] + CACHE_WEIGHT, -c)
            for c, bonus in partial.items():
                if free[c] > -1e17 and (free[c] + bonus, -c) > key:
                    best, key = c, (free[c] + bonus, -c)
        if free[best] < -1e17:
            return None
        name = self._names[best]
        self.views[name].take(image, cpus, memory)
        self._update(best, image)
        return name

    def _update(self, i: int, image: str | None) -> None:
        self._free[i] = self._free_of(self.views[self._names[i]])
        if image is not None:
            self._note(i, image)

    def release_on(self, name: str, cpus: float | None = None,
                   memory: int | None = None) -> None:
        """A placed sandbox failed to start: give its room back."""
        self.views[name].release(cpus, memory)
        self._update(self._index[name], None)
