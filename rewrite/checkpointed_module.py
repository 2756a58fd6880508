"""The module ``optimize`` returns: the rewritten graph in training, planned again for new inputs.

:class:`CheckpointedModule` shares the user's module tree, keeps one :class:`PlannedVariant`
per input signature, autocast state, set of submodules in eval mode and held gradients, and
builds a missing one through its ``replan`` function (:data:`ReplanFunction`). Under FSDP2 it
rebuilds a variant with each sharded unit's hooks around the unit's ops
(:mod:`rewrite.units`).
"""

from __future__ import annotations

import copy
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from planner.core.costgraph import CostGraph
from planner.core.errors import PlannerError
from planner.core.plan import Plan
from profiling.measure import StepInputs, TrainingStep
from rewrite.attach import attach_to_user_modules, share_module_state
from rewrite.held_output import HeldOutputCheck, WatchesHeldOutput
from rewrite.operator_calls import call_operators_directly
from rewrite.saving import SavesAsTheModel
from rewrite.segments import apply_plan, fresh_copy
from rewrite.signature import (ForwardWithTheModelsSignature, autocast_state, describe_inputs, input_signature,
                               signature_of)
from rewrite.units import barrier_nodes, fsdp_unit_paths, insert_unit_hooks, unit_of_nodes
from planner.core.units import format_bytes

__all__ = ["CheckpointedModule", "PlannedVariant", "ReplanFunction", "FSDP_UNITS_IN_FLIGHT"]

log = logging.getLogger(__name__)

#: With ``world_size`` > 1 and ``fully_shard`` on submodules, the plan holds this many times the
#: largest unit's parameter bytes for FSDP2's buffers: the unit running (all-gather buffer and
#: gathered parameters, in backward its unsharded gradients and their reduce-scatter copy) and
#: the one prefetched (all-gather buffer and gathered parameters), and the collectives' own
#: buffers, whose lifetimes depend on when the communication threads run: docs/tuning.md
#: (FSDP_UNITS_IN_FLIGHT) has the measured spread.
FSDP_UNITS_IN_FLIGHT = 5


#: Builds the variant for inputs that were not planned: ``(model, inputs, cost_graph, grads_held)``
#: → ``(graph_module, plan, cost_graph)``. ``cost_graph`` is None when the inputs must be
#: profiled; otherwise it is the profile of the same shapes, re-solved for ``grads_held``.
ReplanFunction = Callable[[torch.nn.Module, StepInputs, "CostGraph | None", bool], "tuple[torch.fx.GraphModule, Plan, CostGraph]"]


@dataclass
class PlannedVariant:
    """One planned shape signature: the rewritten graph, its plan and the profile it came from."""

    graph_module: torch.fx.GraphModule
    plan: Plan
    cost_graph: CostGraph | None

    #: what runs it in training (:meth:`CheckpointedModule._runner`), made on its first call
    runner: Any = field(default=None, repr=False, compare=False)
    #: what a training call calls: the graph's own ``forward`` (a module call around it costs
    #: about 40 µs right after a backward: docs/tuning.md#watch_every_calls), or the compiled runner
    call: Any = field(default=None, repr=False, compare=False)
    #: the step it was planned for keeps the output through the backward; with a profile it is
    #: the profile's, without one the options' it was planned with (set by the module)
    output_held: bool = False

    def __post_init__(self) -> None:
        call_operators_directly(self.graph_module)  # what runs each step: no Python frame per operator
        if self.cost_graph is not None:
            self.output_held = self.cost_graph.output_held


def _parameter_bytes(module: torch.nn.Module) -> int:
    """Unsharded bytes of a module's parameters (FSDP ``DTensor`` shards count in full)."""
    total = 0
    for p in module.parameters():
        total += p.numel() * p.element_size()  # a DTensor reports its global shape
    return total



def _distributed_world_size() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


class CheckpointedModule(SavesAsTheModel, WatchesHeldOutput, torch.nn.Module):
    """The module ``optimize`` returns: the rewritten graph in training, the user's own module
    in eval mode (``opt.eval()`` or ``model.eval()``: the graph is specialised to training).

    Its module tree *is* the user's (the same child modules, parameter and buffer dicts), so
    ``state_dict()`` keys, parameter objects, DDP and FSDP see the user's model; the graph reads
    its parameters through those same modules. ``plan`` is the plan for the example inputs.

    Inputs with another shape signature (batch size, sequence length, dtype), another autocast
    state, submodules switched to eval mode (frozen BatchNorm), or parameters whose ``.grad``
    already exists (gradient accumulation) are planned
    again for the same budget by ``replan`` (one INFO log line, then cached); without
    ``replan`` they raise :class:`PlannerError`. Profiling new shapes runs a backward, so under
    ``torch.distributed`` it is refused: plan each shape before wrapping (:meth:`plan_for`).

    It saves as the model does (:mod:`rewrite.saving`): ``save_pretrained`` is the model's own,
    and ``torch.save(opt)`` keeps the model and its plans, capturing the graph again on the first
    training call after loading.

    Example:
        >>> import torch
        >>> from planner import optimize
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
        >>> opt = optimize(model, (torch.randn(8, 16),), budget_gb=1.0)
        >>> list(opt.state_dict()) == list(model.state_dict())
        True
        >>> opt(torch.randn(4, 16)).shape   # another batch size: re-planned for the same budget
        torch.Size([4, 16])
    """

    def __init__(
        self,
        graph_module: torch.fx.GraphModule,
        original: torch.nn.Module,
        plan: Plan,
        *,
        cost_graph: CostGraph | None = None,
        example_inputs: Any = None,
        replan: ReplanFunction | None = None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "original", original)
        object.__setattr__(self, "_forward_signature", signature_of(original))
        object.__setattr__(self, "replan", replan)
        if attach_to_user_modules(graph_module, original):
            tree: torch.nn.Module = original
        else:
            log.debug("the captured graph names attributes the model does not have; keeping its own module tree")
            tree = graph_module
        share_module_state(self, tree)
        object.__setattr__(self, "graph_module", graph_module)  # not a child: no new state_dict keys
        object.__setattr__(self, "_variants", {})
        object.__setattr__(self, "_profiles", {})
        object.__setattr__(self, "_unit_variants", {})
        object.__setattr__(self, "_held_output_check", HeldOutputCheck())
        self.plan = plan
        object.__setattr__(self, "_cost_graph", cost_graph)
        object.__setattr__(self, "_profile_later", None)
        self._planned_key: tuple[Any, ...] | None = None
        if example_inputs is not None:
            inputs = StepInputs.from_example(example_inputs)
            self._planned_key = self._key(inputs, grads_held=False)
            self._remember(self._planned_key, self._new_variant(graph_module, plan, cost_graph), inputs)
            if cost_graph is None and hasattr(replan, "profile_for"):
                # planned without a profile (the measured unoptimized step fit the budget):
                # the example inputs are profiled if ``cost_graph`` is ever read
                object.__setattr__(self, "_profile_later", (example_inputs,))
        self.train(original.training)

    @property
    def cost_graph(self) -> CostGraph | None:
        """The profile the plan was solved on. A plan made without one (the measured unoptimized
        step fit the budget, so nothing was profiled) has its example inputs profiled here, on
        first read."""
        graph = self.__dict__.get("_cost_graph")
        pending = self.__dict__.get("_profile_later")
        if graph is None and pending is not None:
            object.__setattr__(self, "_profile_later", None)
            example_inputs = pending[0]
            graph = self.replan.profile_for(self.original, example_inputs)  # type: ignore[union-attr]
            object.__setattr__(self, "_cost_graph", graph)
            key = self._planned_key
            if key is not None and key in self._variants:
                self._variants[key].cost_graph = graph
                self._remember(key, self._variants[key], StepInputs.from_example(example_inputs))
        return graph

    @cost_graph.setter
    def cost_graph(self, graph: CostGraph | None) -> None:
        object.__setattr__(self, "_cost_graph", graph)

    def train(self, mode: bool = True) -> "CheckpointedModule":
        super().train(mode)
        self.original.train(mode)
        return self

    def _key(self, inputs: StepInputs, grads_held: bool | None = None) -> tuple[Any, ...]:
        """What a plan depends on: input signature, autocast state, the submodules in eval mode
        (traced as such) and whether parameter gradients already exist."""
        # it runs every training step, right after the last one's backward has emptied the CPU
        # caches: plain loops over lists made once (on a cold cache they beat map/attrgetter
        # chains, which touch more code), no generator per submodule
        names, modules, parameter_dicts = self._submodule_lists()
        in_eval: tuple[str, ...] = ()
        for m in modules:
            if not m.training:
                in_eval = tuple(name for name, sub in zip(names, modules) if not sub.training)
                break
        if grads_held is None:
            grads_held = False
            # each module's own parameter dict, read now: fully_shard may have replaced its values
            for parameters in parameter_dicts:
                for p in parameters.values():
                    if p is not None and p.grad is not None:
                        grads_held = True
                        break
                if grads_held:
                    break
        return (input_signature(inputs), autocast_state(), in_eval, grads_held)

    def _submodule_lists(self) -> tuple[list[str], list[torch.nn.Module], list[dict[str, Any]]]:
        """``self.original.named_modules()`` as first walked (a submodule added later is not in
        the captured graph either) as names and modules, and the parameter dicts of those that
        hold parameters: the walk, and ``parameters()``'s, cost about a millisecond a step on a
        model of a few hundred submodules."""
        cached = self.__dict__.get("_submodules")
        if cached is None:
            walked = list(self.original.named_modules())
            cached = ([name for name, _ in walked], [m for _, m in walked],
                      [m._parameters for _, m in walked if m._parameters])
            object.__setattr__(self, "_submodules", cached)
        return cached

    def _new_variant(self, gm: torch.fx.GraphModule, plan: Plan, graph: CostGraph | None) -> PlannedVariant:
        """A variant of ``gm`` and ``plan``; planned without a profile (``graph`` None), its step is
        the one of the options it was planned with."""
        variant = PlannedVariant(gm, plan, graph)
        if graph is None:
            variant.output_held = self.planned_output_held()
        return variant

    def planned_output_held(self) -> bool:
        """Whether the plan was made for a loop that keeps the output through the backward (the
        profile's, or without one the options' it was planned with: every variant has the same)."""
        graph = self.__dict__.get("_cost_graph")
        if graph is not None:
            return bool(graph.output_held)
        return bool(getattr(getattr(self.replan, "capture", None), "output_held", True))

    def _remember(self, key: tuple[Any, ...], variant: PlannedVariant, inputs: StepInputs) -> None:
        self._variants[key] = variant
        if variant.cost_graph is not None:
            self._profiles[key[:3]] = (variant.cost_graph, describe_inputs(inputs))

    @property
    def plans(self) -> dict[str, Plan]:
        """Every plan made so far, by a readable description of what it was made for."""
        out = {}
        for (signature, autocast, in_eval, grads_held), variant in self._variants.items():
            shapes = self._profiles.get((signature, autocast, in_eval), (None, "example inputs"))[1]
            notes = [f"autocast {d}:{t.replace('torch.', '')}" for d, t in autocast]
            notes += [f"{len(in_eval)} modules in eval mode"] if in_eval else []
            notes += ["grads held"] if grads_held else []
            out[f"{shapes}{' (' + ', '.join(notes) + ')' if notes else ''}"] = variant.plan
        return out

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan used for inputs like ``args``/``kwargs`` in the current autocast state and
        with the parameters' current ``.grad``; plans them (profiling one step) if needed.

        Call it before wrapping with DDP or FSDP for each batch shape you will train on: unlike a
        forward, it profiles new shapes under ``torch.distributed`` too.

        Example:
            >>> from planner import optimize
            >>> opt = optimize(torch.nn.Linear(8, 8), (torch.randn(4, 8),), budget_gb=1.0)
            >>> opt.plan_for(torch.randn(2, 8)).segments
            ()
        """
        return self._variant(StepInputs(args, kwargs), explicit=True).plan

    def training_graph_for(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        """The rewritten graph a training call with ``args``/``kwargs`` runs (planned first if
        needed, as a forward would): call it with the same arguments. ``planner.enable`` runs
        it from the model's own ``forward``.

        Example:
            >>> from planner import optimize
            >>> opt = optimize(torch.nn.Linear(8, 8), (torch.randn(4, 8),), budget_gb=1.0)
            >>> x = torch.randn(4, 8)
            >>> opt.training_graph_for(x)(x).shape
            torch.Size([4, 8])
        """
        return self._runner(self._variant(StepInputs(args, kwargs)))

    def _runner(self, variant: PlannedVariant) -> Any:
        """What runs ``variant`` in training: its graph, compiled where ``optimize(compile=...)``
        asked for it (:mod:`rewrite.compiled`); made once per variant."""
        if variant.runner is None:
            variant.runner = self._new_runner(variant)
        return variant.runner

    def _new_runner(self, variant: PlannedVariant) -> Any:
        capture = getattr(self.replan, "capture", None)
        backend = getattr(capture, "compile_backend", None)
        if backend is None:
            return variant.graph_module
        from rewrite.compiled import compiled_runner

        return compiled_runner(variant.graph_module, backend, getattr(capture, "step", None) or TrainingStep())

    def _variant(self, inputs: StepInputs, explicit: bool = False) -> PlannedVariant:
        """The planned variant for ``inputs``, planned now where none is. Under
        ``torch.compile(opt)`` the lookup runs outside the traced graph; eagerly it is a plain
        call (``torch.compiler.disable`` costs about a millisecond a call even when nothing
        compiles: a tenth of a small model's step)."""
        if torch.compiler.is_compiling():
            return self._variant_outside_the_graph(inputs, explicit)
        return self._looked_up_variant(inputs, explicit)

    @torch.compiler.disable
    def _variant_outside_the_graph(self, inputs: StepInputs, explicit: bool) -> PlannedVariant:
        return self._looked_up_variant(inputs, explicit)

    def _looked_up_variant(self, inputs: StepInputs, explicit: bool) -> PlannedVariant:
        key = self._key(inputs)
        variant = self._variants.get(key)
        if variant is None:
            variant = self._planned_variant(key, inputs, explicit)
        units = fsdp_unit_paths(self) if _distributed_world_size() > 1 else ()
        return self._with_units(key, variant, units) if units else variant

    def _with_units(self, key: tuple[Any, ...], variant: PlannedVariant, units: tuple[str, ...]) -> PlannedVariant:
        """``variant`` rebuilt with the FSDP hooks of ``units`` (submodules wrapped by
        ``fully_shard``) around their ops, re-solved if a segment spanned two units."""
        cached = self._unit_variants.get((key, units))
        if cached is not None:
            return cached
        gm = fresh_copy(variant.graph_module)
        attach_to_user_modules(gm, self.original)
        plan = variant.plan
        owner = unit_of_nodes(gm.graph, units)
        straddles = any(len({owner.get(name, "") for name in seg.node_names}) > 1 for seg in plan.segments)
        sharded = getattr(self.replan, "world_size", 1) > 1
        if straddles or sharded:
            solve = getattr(self.replan, "solve", None)
            if solve is None or variant.cost_graph is None:
                raise PlannerError(f"a checkpointed segment spans two of the FSDP units {units[:3]} and this "
                                   f"module cannot re-plan; use optimize()")
            in_flight = FSDP_UNITS_IN_FLIGHT * max(_parameter_bytes(self.get_submodule(u)) for u in units)
            plan = solve(variant.cost_graph, grads_held=key[3], keep=barrier_nodes(gm.graph, units),
                         extra_bytes=in_flight if sharded else 0)
            log.info("re-planned for %d FSDP units: no segment spans two units%s; %d segments", len(units),
                     f", {format_bytes(in_flight)} for the units in flight" if sharded else "", len(plan.segments))
        insert_unit_hooks(gm, self.original, units)
        unit_variant = self._new_variant(apply_plan(gm, plan), plan, variant.cost_graph)
        self._unit_variants[(key, units)] = unit_variant
        return unit_variant

    def _planned_variant(self, key: tuple[Any, ...], inputs: StepInputs, explicit: bool) -> PlannedVariant:
        if self._planned_key is None and self.graph_module is not None:
            # built without example inputs: the first call is the planned one
            self._planned_key = key
            self._variants[key] = self._new_variant(self.graph_module, self.plan, self.cost_graph)
        variant = self._variants.get(key)
        if variant is not None:
            return variant
        grads_held = key[3]
        profile = self._profiles.get(key[:3])
        reason = self._why(key, inputs)
        roomy = self._roomy_with_grads_held(key) if profile is None and grads_held else None
        if roomy is not None:
            self._variants[key] = roomy
            return roomy
        if self.replan is None:
            planned = self._planned_key
            if planned is not None and key[0] == planned[0] and key[2] == planned[2]:
                # same graph; only autocast or held gradients differ: it runs, but the peak was
                # planned for another memory picture
                log.debug("no re-planning without replan: %s", reason)
                return self._variants[planned]
            raise PlannerError(f"this module was planned for other inputs ({reason}) and cannot re-plan; "
                               f"call optimize() with these inputs")
        if profile is None and torch._C._autograd._profiler_enabled():
            raise PlannerError(
                f"inputs not planned yet ({reason}) while torch.profiler is recording: planning them profiles "
                f"a step with the profiler, which would end your session. Plan them first: opt.plan_for(*batch)"
            )
        if profile is None and not explicit and _distributed_world_size() > 1:
            raise PlannerError(
                f"inputs not planned yet ({reason}) under torch.distributed: profiling them would run a "
                f"backward through DDP/FSDP hooks on one rank. Plan every batch shape before wrapping the "
                f"module (opt.plan_for(*batch) for each), or keep the batch shape fixed (drop_last=True)"
            )
        log.info("re-planning for the same budget (%s): %s", format_bytes(self.plan.budget_bytes), reason)
        same_graph = [v for k, v in self._variants.items() if k[:3] == key[:3]]
        solve = getattr(self.replan, "solve", None)
        if profile is not None and same_graph and solve is not None:
            # same shapes: solve again and rewrite the captured graph; no tracing or profiling
            plan, graph = solve(profile[0], grads_held=grads_held), profile[0]
            gm = apply_plan(fresh_copy(same_graph[0].graph_module), plan)
        else:
            with torch.random.fork_rng(devices=[]):
                gm, plan, graph = self.replan(self.original, inputs, profile[0] if profile else None, grads_held)
        if not attach_to_user_modules(gm, self.original):
            log.debug("re-planned graph keeps its own module tree")
        variant = self._new_variant(gm, plan, graph)
        self._remember(key, variant, inputs)
        if self.graph_module is None:  # loaded from a file: this is its graph now
            object.__setattr__(self, "graph_module", gm)
        return variant

    def _roomy_with_grads_held(self, key: tuple[Any, ...]) -> PlannedVariant | None:
        """The empty plan of the same shapes, made without a profile because the measured step
        fit the budget, where that step plus every parameter gradient held all step still fits
        (gradient accumulation): no profile, no measurement. Otherwise None."""
        fits = getattr(self.replan, "fits_with_grads_held", None)
        for other, variant in self._variants.items():
            if other[:3] == key[:3] and variant.cost_graph is None and not variant.plan.segments and fits is not None:
                grad_bytes = sum(p.numel() * p.element_size() for p in self.parameters() if p.requires_grad)
                if fits(variant.plan, grad_bytes):
                    log.info("gradients held (accumulation): the unoptimized step with %s of gradients held still "
                             "fits the budget; nothing to recompute", format_bytes(grad_bytes))
                    return variant
        return None

    def _why(self, key: tuple[Any, ...], inputs: StepInputs) -> str:
        """One phrase saying what differs from the inputs already planned."""
        signature, autocast, in_eval, grads_held = key
        planned = self._planned_key
        if self.graph_module is None:
            return "loaded from a file: the rewritten graph is captured again"
        if planned is not None and signature != planned[0] and key[:3] not in self._profiles:
            before = self._profiles.get(planned[:3], (None, "the example inputs"))[1]
            return f"inputs {describe_inputs(inputs)} (planned for {before})"
        if planned is not None and autocast != planned[1]:
            state = ", ".join(f"{d} {t.replace('torch.', '')}" for d, t in autocast) or "off"
            return f"autocast {state} (planned with {', '.join(d for d, _ in planned[1]) or 'autocast off'})"
        if planned is not None and in_eval != planned[2]:
            names = ", ".join(in_eval[:3]) + (", ..." if len(in_eval) > 3 else "")
            return f"submodules in eval mode: {names or 'none'} (planned with {len(planned[2])} in eval mode)"
        if grads_held:
            return "parameter gradients already exist (gradient accumulation): they are held all step"
        return f"inputs {describe_inputs(inputs)}"

    def _checkpointed_forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.original.training:  # opt.eval() or model.eval(): the user's own module
            return self.original(*args, **kwargs)
        if "transformers.trainer" in sys.modules:
            self._check_the_caller()
        variant = self._variant(StepInputs(args, kwargs))
        call = variant.call  # a compiled module has no truth value: compared with None
        if call is None:
            runner = self._runner(variant)
            call = variant.call = runner.forward if isinstance(runner, torch.fx.GraphModule) else runner
        output = call(*args, **kwargs)
        if not variant.output_held:
            self._held_output_check.watch(output)
        return output

    forward = ForwardWithTheModelsSignature()

    def __getstate__(self) -> dict[str, Any]:
        # the rewritten graphs do not pickle (torch.export's graph modules hold local functions):
        # the model, plans and profiles do; the first training call captures the graph again
        state = dict(self.__dict__)
        state.update(graph_module=None, _variants={}, _unit_variants={}, _profile_later=None, _submodules=None)
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> "CheckpointedModule":
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        with warnings.catch_warnings():  # torch's own pytree spec copy warns about LeafSpec
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            for name, value in self.__dict__.items():
                object.__setattr__(new, name, copy.deepcopy(value, memo))
        for variant in (*new._variants.values(), *new._unit_variants.values()):
            attach_to_user_modules(variant.graph_module, new.original)
            variant.runner = variant.call = None  # made again from the copied graph on the first call
        if not new._variants and new.graph_module is not None:
            attach_to_user_modules(new.graph_module, new.original)
        return new
