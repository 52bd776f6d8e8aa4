"""An engine's compiled forward, its cache of compiled code, and its fallback to eager.

The compiled code (inductor's FX-graph and AOT-autograd caches, the C++ it builds) goes to
``<cache dir>/torch-compile`` unless ``TORCHINDUCTOR_CACHE_DIR`` names another place: a process
that starts after one that compiled the same model loads the code instead of generating and
building it again, and its warm-up takes seconds instead of a minute.

torch.compile compiles at the first call of each shape class, that is in the start-up warm-up.
A compilation that fails there (an operator inductor cannot lower, a C++ compiler missing) must not
stop the service: the warm-up's error is logged as the reason, and the forwards run eagerly from then on.

Once the warm-ups are done the process stops compiling (``stop_compiling``): a forward whose shape
class no warm-up compiled (dynamo specialises on sizes 0 and 1, on sizes that happen to be equal, on
which optional inputs are set) runs eagerly instead of holding the engine, and every request queued
behind it, for a compilation of many seconds on a CPU. ``--recompile-in-serving`` keeps compiling.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

logger = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CACHE_SUBDIR = "torch-compile"
REASON_CHARS = 300
# Shape classes an engine compiles in its warm-up (prefill: alone, batched, over one cached
# prefix or each its own, a chunk's continuation...; decode: one row, several, a shared prefix) are
# more than dynamo's default limit of 8 per frame, past which it runs the frame eagerly. Dynamo's
# settings are per thread: each thread that calls the forward raises it for itself.
RECOMPILE_LIMIT = 64


def use_compile_cache(cache_root: Path) -> Path:
    """Points torch's compile caches at ``cache_root/torch-compile`` unless ``TORCHINDUCTOR_CACHE_DIR``
    is set; returns the directory in use. Call before the first compilation of the process."""
    configured = os.environ.get(INDUCTOR_CACHE_ENV)
    # torch sets the variable itself (to its default, under /tmp) the first time it looks it up.
    if configured and os.path.abspath(configured) != os.path.abspath(default_cache_dir()):
        return Path(configured)
    directory = cache_root / CACHE_SUBDIR
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_CACHE_ENV] = str(directory)
    return directory


class CompiledForward:
    """Calls ``compiled`` (``torch.compile(model)``), or ``model`` once ``fall_back`` was called."""

    def __init__(self, model: Any, compiled: Callable[..., Any]) -> None:
        self._model = model
        self._compiled: Callable[..., Any] | None = compiled
        self.fallback_reason = ""
        self._configured = threading.local()

    @property
    def active(self) -> bool:
        """Whether calls still go through the compiled code."""
        return self._compiled is not None

    def __call__(self, **inputs: Any) -> Any:
        compiled = self._compiled
        if compiled is None:
            return self._model(**inputs)
        if not getattr(self._configured, "done", False):
            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
            # The models' float constants (norm epsilon, attention and rotary scaling) are compiled
            # as constants: taken for inputs, some fail AOTAutograd's scalar pass, which restarts
            # dynamo's analysis, so each shape class was traced twice (half of a warm start).
            config.specialize_float = True
            self._configured.done = True
        return compiled(**inputs)

    def fall_back(self, reason: str) -> None:
        """From now on the forwards run eagerly."""
        self._compiled = None
        self.fallback_reason = reason


def stop_compiling() -> None:
    """From now on this process runs compiled code where a compiled shape class fits and eagerly
    where none does, compiling nothing more (torch's stance ``eager_on_recompile``, process-wide:
    call it once every engine of the process has warmed up)."""
    torch.compiler.set_stance("eager_on_recompile")
    logger.info("warm-ups done: a shape class they did not compile runs eagerly (--recompile-in-serving)")


def static_dims(tensor: torch.Tensor, *dims: int) -> torch.Tensor:
    """``tensor``, its sizes ``dims`` (negative: from the end) compiled as the constants they are.

    A forward compiled with dynamic sizes takes every size of its inputs for a variable, and two sizes
    equal at the compilation for one variable: a model's own sizes (KV heads, head width) passed in
    its cache could be tied that way to sizes that change (rows, positions), and a later step where
    they differ would not match the compiled code. Marked, a size stays a constant of the code. A view
    passed in has sizes of its own, apart from its base's: both are marked.
    """
    for dim in dims:
        torch._dynamo.mark_static(tensor, dim % tensor.dim())
    return tensor


def compile_model(model: Any, device: torch.device) -> CompiledForward:
    """``model`` compiled for the engines' forwards.

    Shapes (batch, context) change at every step: compiled once with dynamic sizes. On CPU the
    generated code calls its kernels from C++ instead of Python (inductor's ``cpp_wrapper``): a decode
    step of the reference model (32 rows) costs about 1 ms less of its 10.
    """
    compiled = torch.compile(model, dynamic=True, options={"cpp_wrapper": device.type == "cpu"})
    return CompiledForward(model, compiled)


def warm_up_or_fall_back(
    forward: CompiledForward | None,
    warm_up: Callable[[], float],
    passthrough: tuple[type[Exception], ...] = (),
) -> float:
    """Runs ``warm_up`` (which compiles ``forward``) and returns its duration; when it fails (with
    anything but ``passthrough``, raised as is), the forwards fall back to eager, the reason is
    logged, and 0 is returned."""
    if forward is None or not forward.active:
        return 0.0
    try:
        return warm_up()
    except passthrough:
        raise
    except Exception as exc:  # whatever the compiler raised: the service starts eager instead
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:REASON_CHARS]}"
        logger.warning("compiling the forwards failed (%s); they run eagerly", reason)
        logger.debug("compilation failure", exc_info=True)
        forward.fall_back(reason)
        return 0.0
