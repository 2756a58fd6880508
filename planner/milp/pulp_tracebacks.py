"""Import PuLP without keeping the importer's frames alive.

PuLP 3 keeps the exception from each optional solver library it fails to load as a class
attribute (``COPT_DLL.err``, ``CPLEX_PY.err``), to quote it if that solver is asked for later.
An exception's traceback holds every frame that was running when it was raised, up to the
outermost caller. So the first ``import planner`` inside a function kept that function's frame
and all its locals (a model, its data, a DDP or FSDP wrapper and the process group under it)
alive until the interpreter exited. Found in ``examples/distributed_train.py``, whose
``main()`` imports planner: after it returned, its DDP wrapper was still alive, held by
``main``'s frame through the import frames of ``pulp/apis/copt_api.py``'s kept exception.

:func:`release_pulp_import_tracebacks` drops those tracebacks; the exceptions and their
messages stay, so PuLP's own error for a missing solver reads the same.

Example:
    >>> release_pulp_import_tracebacks() >= 0  # how many tracebacks it dropped this time
    True
"""

from __future__ import annotations

import logging
import sys

import pulp  # noqa: F401  (imported here so its failed optional imports are cleaned up below)

__all__ = ["release_pulp_import_tracebacks"]

log = logging.getLogger(__name__)


def release_pulp_import_tracebacks() -> int:
    """Drop the tracebacks of the exceptions PuLP's loaded modules keep on their classes.

    Returns how many tracebacks were dropped (0 on a second call, or with a PuLP that keeps
    none).
    """
    released = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "pulp" or name.startswith("pulp.")):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type):
                for attribute in list(vars(value).values()):
                    released += _drop_tracebacks(attribute)
    if released:
        log.debug("dropped %d traceback(s) PuLP kept from its optional solver imports", released)
    return released


def _drop_tracebacks(value: object) -> int:
    """Clear the traceback of ``value`` and of the exceptions chained to it, if it is one."""
    dropped = 0
    seen: set[int] = set()
    while isinstance(value, BaseException) and id(value) not in seen:
        seen.add(id(value))
        if value.__traceback__ is not None:
            value.__traceback__ = None
            dropped += 1
        value = value.__cause__ or value.__context__
    return dropped
