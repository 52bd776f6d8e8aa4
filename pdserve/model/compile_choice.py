"""Whether an engine compiles its forwards, and why: ``--compile`` / ``--enforce-eager`` and the
table of where compiling measured faster.

- ``--enforce-eager`` or ``--compile false``: eager.
- ``--compile true``: compiled, whatever the model (a failed compilation still falls back to eager at
  the warm-up, see ``pdserve.model.compiled_forward``).
- ``--compile auto`` (the default): compiled where it measured faster than eager: dense Llama-type
  models of at most ``COMPILE_MAX_LAYERS`` layers on CPU, one rank (the reference workload's
  4-layer Llama: 1505 against 1267 output tok/s). A deeper model runs eager: its cold compilation
  takes minutes on a small CPU (SmolLM2's 30 layers: over 8 minutes on 2 cores, against seconds
  eager), so it is not a default that wins. Everything else runs eager until measured: CUDA
  devices, mixture-of-experts models, expert-parallel groups (their dispatch runs inside the
  forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import EngineConfig

# (device type, model type) pairs where compiled forwards measured faster than eager ones.
COMPILE_WINS = frozenset({("cpu", "llama")})
# The most layers a model compiles with under ``auto`` (a cold compilation grows with them).
COMPILE_MAX_LAYERS = 8


@dataclass(frozen=True)
class CompileChoice:
    enabled: bool
    reason: str


def choose_compile(
    config: EngineConfig, model_type: str, device_type: str, num_layers: int = 0
) -> CompileChoice:
    """Whether the engine of ``config`` (a ``model_type`` model of ``num_layers`` layers on
    ``device_type``) compiles."""
    if config.enforce_eager:
        return CompileChoice(False, "--enforce-eager")
    if config.compile == "false":
        return CompileChoice(False, "--compile false")
    if config.compile == "true":
        return CompileChoice(True, "--compile true")
    if config.ep > 1:
        return CompileChoice(False, "expert-parallel ranks run eager unless --compile true")
    if (device_type, model_type) not in COMPILE_WINS:
        return CompileChoice(
            False, f"{model_type} on {device_type} runs eager unless --compile true (not measured faster)"
        )
    if num_layers > COMPILE_MAX_LAYERS:
        return CompileChoice(
            False,
            f"{num_layers} layers compile for minutes cold on {device_type}; eager unless --compile true",
        )
    return CompileChoice(True, f"{model_type} on {device_type} runs faster compiled (--enforce-eager: eager)")
