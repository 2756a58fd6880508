"""What a moment of the step can free, as a linear expression of the covering bounds' rerun
variables: the freed side of each moment's constraint in :mod:`planner.bounds.covering`.

A storage saved for backward can be gone at a moment only if the node that made it runs again
in a recompute: otherwise the backward has nothing to read it from. Two more facts hold for
every plan, and one for plans of whole segments:

* **A storage read later in the forward is live.** Recomputes run in the backward only, so a
  storage that a node after the moment reads in the forward is still there, whatever runs
  again later.
* **A storage is never gone where it is used**: at the forward of its maker or of a node
  reading it, and at the backward of a node that saved it.
* **Every saver still to run its backward holds it, unless it is in a segment.** A node
  outside every segment keeps what it saved from its forward to its backward. Inside a
  segment a saver runs again (wholly, or up to its last save), except a last node that saves
  only its inputs, which the recompute stops at before running it, and a node a selective
  policy keeps, whose saves the checkpoint takes too. So a storage is freed at a moment only
  where its maker and each saver holding it then run again (the variable ``freed_{k}_by_...``
  below both), the savers that save only their inputs and those in ``may_keep`` (the nodes a
  selective policy may keep; none for plans of whole segments) aside.

Example:
    >>> import pulp
    >>> from planner.core.costgraph import CostGraph, CostNode, Storage
    >>> from planner.bounds.storage_uses import StorageUses
    >>> nodes = [CostNode("x", "placeholder", kind="input", output_storages=(0,)),
    ...          CostNode("proj", "op", input_names=("x",), output_storages=(1,), saved_storages=(0,)),
    ...          CostNode("attn", "op", input_names=("proj",), output_storages=(2,), saved_storages=(1, 2)),
    ...          CostNode("head", "op", input_names=("attn",), output_storages=(3,), saved_storages=(2,))]
    >>> g = CostGraph(tuple(nodes), (Storage(0, 2**20, True), *(Storage(k, 2**20) for k in (1, 2, 3))), ("head",))
    >>> prob = pulp.LpProblem("freed", pulp.LpMinimize)
    >>> x = {n: prob.add_variable(f"rerun_{n}", cat=pulp.LpBinary) for n in ("proj", "attn", "head")}
    >>> at_head = ("backward", "head", 3)   # attn's output is read there; proj's is freeable
    >>> [str(v) for _, v in FreedStorages(StorageUses(g), prob, x).terms(*at_head)]
    ['freed_1_by_attn']
    >>> [str(v) for _, v in FreedStorages(StorageUses(g), prob, x, frozenset({"attn"})).terms(*at_head)]
    ['rerun_proj']
"""

from __future__ import annotations

import pulp

from planner.bounds.storage_uses import StorageUses

__all__ = ["FreedStorages"]


class FreedStorages:
    """The storages each moment can free and what each needs to run again.

    ``uses`` is the graph's :class:`planner.bounds.storage_uses.StorageUses`; ``rerun`` the binary
    "node runs again" variable of every rerunnable node; ``may_keep`` the nodes a selective
    policy may keep. The savers rule of the module docstring adds one variable per storage and
    set of holding savers, created once and shared by the moments that need it.
    """

    def __init__(self, uses: StorageUses, prob: pulp.LpProblem,
                 rerun: dict[str, pulp.LpVariable], may_keep: frozenset[str] = frozenset()) -> None:
        self.uses = uses
        self.prob = prob
        self.rerun = rerun
        #: savers that may be in a segment without running again: never forced to
        self._exempt = may_keep | uses.stop_before
        self._freed: dict[tuple[int, tuple[str, ...]], pulp.LpVariable] = {}

    def terms(self, phase: str, name: str, here: int) -> list[tuple[float, pulp.LpVariable]]:
        """``(MiB, variable)`` pairs whose sum is what the moment (``phase`` of node ``name`` at
        graph position ``here``) frees; empty when nothing can be freed there."""
        uses = self.uses
        by_variable: dict[str, tuple[float, pulp.LpVariable]] = {}
        for first, made_by, mib, k, savers in uses.freeable:
            if first > here:
                continue  # not saved yet
            if phase == "backward" and name in savers:
                continue  # this backward reads it
            if phase == "forward" and (made_by == name or k in uses.inputs_of[name]
                                       or uses.last_use.get(k, -1) > here):
                continue  # being made or read now, or read later in the forward
            variable = self._variable(k, made_by, savers, phase, here)
            mib_so_far = by_variable.get(variable.name, (0.0, variable))[0]
            by_variable[variable.name] = (mib_so_far + mib, variable)
        return list(by_variable.values())

    def _variable(self, k: int, made_by: str, savers: set[str], phase: str, here: int) -> pulp.LpVariable:
        """``rerun[made_by]``, or the variable of "the maker and every saver holding ``k`` at
        this moment run again"."""
        position = self.uses.position
        holding = tuple(sorted(
            j for j in savers
            if j != made_by and j not in self._exempt
            and (position[j] <= here if phase == "forward" else position[j] < here)))
        if not holding:
            return self.rerun[made_by]
        key = (k, holding)
        variable = self._freed.get(key)
        if variable is None:
            label = f"freed_{k}_by_{'_'.join(holding)}"
            variable = self.prob.add_variable(label, lowBound=0, upBound=1)
            for j in (made_by, *holding):
                self.prob += variable <= self.rerun[j], f"{label}_needs_{j}"
            self._freed[key] = variable
        return variable
