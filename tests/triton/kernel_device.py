"""Where the Triton kernel tests run, and the row check they share.

Imported by a test module, it skips the module unless the kernels can run: on CUDA, or on CPU
tensors under the Triton interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before
triton is imported).
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1 (set it before triton is imported)",
                allow_module_level=True)


def assert_written_rows(got: torch.Tensor, ref: torch.Tensor, row_index: torch.Tensor, atol: float,
                        rtol: float) -> None:
    """Rows ``row_index`` (-1 entries skipped) match the reference; every other row of ``got`` is still NaN."""
    rows = row_index[row_index >= 0].long()
    torch.testing.assert_close(got[rows], ref[rows], atol=atol, rtol=rtol)
    untouched = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    untouched[rows] = False
    assert torch.isnan(got[untouched]).all(), "rows outside row_index were written"
