"""The FFN backends by name: what `kernel=<name>` selects and `LayerDispatcher` chooses among."""

from __future__ import annotations

from sparse_llm.ffn.backend import FFNBackend
from sparse_llm.ffn.torch_backend import TorchFFN
from sparse_llm.ffn.twell.backend import TwellFFN

_BACKENDS: dict[str, FFNBackend] = {}


def register_backend(backend: FFNBackend) -> None:
    """Make `backend` selectable by its name (`kernel=<name>`)."""
    if not backend.name:
        raise ValueError(f"{type(backend).__name__} has no `name`; set a class attribute `name = '...'`.")
    _BACKENDS[backend.name] = backend


def get_backend(name: str) -> FFNBackend:
    """The registered backend called `name`; the error lists the valid names."""
    if name not in _BACKENDS:
        raise ValueError(f"Unknown FFN backend {name!r}; choose one of {sorted(_BACKENDS)} or 'auto'.")
    return _BACKENDS[name]


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


# Both import without a GPU or CuPy; "twell" reports at run time whether it can run here.
register_backend(TorchFFN())
register_backend(TwellFFN())
