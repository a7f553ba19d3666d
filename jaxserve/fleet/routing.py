"""Which served model version answers a request's `model`.

- a pinned id (`name@version`) goes to that version;
- a name picks one of its versions at random in proportion to their weights (KServe's
  canary split), from a seeded generator so that a test can reproduce the split; versions
  whose engine failed are skipped while another version of the name is healthy;
- an alias (`--served-model-name` beyond the first) is its name;
- no `model` at all is the first name of the file (clients that omit it, as lm-eval may).

A `RoutingTable` is immutable: a reload builds a new one and `ModelRouter.publish` swaps it
in one assignment, so every request sees either the old set of versions and weights or the
new one, never a mix.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from typing import Sequence

from jaxserve.fleet.models_file import ModelEntry
from jaxserve.fleet.served_model import ServedModel


class UnknownModelError(LookupError):
    """No served model answers to this id."""


@dataclasses.dataclass(frozen=True)
class Route:
    """The version chosen for a request and why: "weight" (a name's split), "pinned" (a
    pinned id), or "fallback" (`fallback_from`'s version could not take it)."""

    served: ServedModel
    reason: str
    fallback_from: str | None = None


class RoutingTable:
    """Names, pinned ids, weights and fallbacks of one configuration of the server: each
    version with the entry it was published with (weights read from here, so a reload that
    changes only weights changes them all at once)."""

    def __init__(self, versions: Sequence[tuple[ServedModel, ModelEntry]]):
        self.entries = {served.pinned_id: entry for served, entry in versions}
        self.served = [served for served, _ in versions]  # file order
        self.pinned = {s.pinned_id: s for s in self.served}
        self.versions: dict[str, list[ServedModel]] = {}
        self.aliases: dict[str, str] = {}
        for served, entry in versions:
            self.versions.setdefault(entry.name, []).append(served)
            for alias in entry.aliases:
                self.aliases[alias] = entry.name
        self.default_name = versions[0][1].name

    def ids(self) -> list[str]:
        """Every id a client may send: names, aliases, pinned ids."""
        return [*self.versions, *self.aliases, *self.pinned]

    def weight(self, served: ServedModel) -> float:
        return self.entries[served.pinned_id].weight

    def versions_for(self, model: str | None) -> list[ServedModel] | None:
        """The versions an id can name: a pinned id its one version, a name or alias all of
        its versions in file order, None (the default model) the default name's; None if
        the id names nothing."""
        if model is None:
            model = self.default_name
        if model in self.pinned:
            return [self.pinned[model]]
        return self.versions.get(self.aliases.get(model, model))

    def resolve(self, model: str | None, rng: random.Random) -> Route:
        """The version for a request's `model` (`UnknownModelError` if none answers)."""
        versions = self.versions_for(model)
        if versions is None:
            raise UnknownModelError(f"The model `{model}` does not exist; served: "
                                    f"{self.ids()}")
        if model in self.pinned:
            return Route(versions[0], "pinned")
        weighted = [v for v in versions if self.weight(v) > 0]
        healthy = [v for v in weighted if v.failure is None] or weighted
        return Route(rng.choices(healthy, [self.weight(v) for v in healthy])[0], "weight")


class ModelRouter:
    """The current routing table and the seeded generator of weighted choices."""

    def __init__(self, seed: int = 0):
        self.table: RoutingTable | None = None  # None until the first models are loaded
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()  # handlers run on the event loop and thread pool

    def publish(self, table: RoutingTable) -> None:
        self.table = table  # one assignment: readers see the old table or the new one

    def route(self, model: str | None) -> Route:
        with self._rng_lock:
            return self.table.resolve(model, self._rng)

    def fallback(self, route: Route) -> Route | None:
        """Who answers when `route`'s version cannot (queue full, engine failed, retired):
        its configured fallback in the current table; None if it has none."""
        table = self.table
        entry = table.entries.get(route.served.pinned_id)
        if entry is None or entry.fallback is None:
            return None
        try:
            chosen = self.route(entry.fallback)
        except UnknownModelError:
            return None
        return Route(chosen.served, "fallback", route.fallback_from or route.served.pinned_id)
