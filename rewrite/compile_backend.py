"""The ``torch.compile`` backend a planned step compiles with: the one named, AOTAutograd's cache off.

AOTAutograd's on-disk cache (``torch._functorch.config.enable_autograd_cache``) reloads the
metadata that rebuilds a graph's outputs that are views. In torch 2.13 the view metadata of
``_unsafe_view`` and ``resize_`` is serialized through references to temporaries
(pytorch#185630, fixed by pytorch#185861), so a warm cache can hand back garbage sizes: a planned
GPT-2 step compiled in a second process, on the cache the first one filled, failed on its first
run with ``RuntimeError: shape '[94898595860418, 590774985640113900, 4096]' is invalid``. A
planned step compiles several variants of one graph (each plan checked, with and without its
segments' outputs kept), and users run the same script again, so the cache is warm exactly where
it hurts. :func:`uncached_backend` runs the named backend with that cache off while it compiles;
Inductor's own FX graph cache, which compiles the kernels, stays on.

Example:
    >>> import torch
    >>> import torch._functorch.config as functorch_config
    >>> seen = []
    >>> def inner(gm, example_inputs):
    ...     seen.append(functorch_config.enable_autograd_cache)
    ...     return gm.forward
    >>> compiled = torch.compile(torch.nn.Tanh(), backend=uncached_backend(inner))
    >>> torch.equal(compiled(torch.ones(3)), torch.tanh(torch.ones(3))), seen
    (True, [False])
    >>> torch._dynamo.reset()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch._functorch.config as functorch_config
from torch._dynamo import lookup_backend

__all__ = ["uncached_backend"]


def uncached_backend(backend: str | Callable[..., Any]) -> Callable[..., Any]:
    """``backend`` (a name ``torch.compile`` knows, or a backend callable) compiling with
    AOTAutograd's cache off (see the module docs).

    Example:
        >>> callable(uncached_backend("aot_eager"))
        True
    """
    inner = lookup_backend(backend)

    def compile_without_autograd_cache(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        with functorch_config.patch(enable_autograd_cache=False):
            return inner(gm, example_inputs, **kwargs)

    compile_without_autograd_cache.__name__ = f"{getattr(inner, '__name__', backend)}_without_autograd_cache"
    return compile_without_autograd_cache
