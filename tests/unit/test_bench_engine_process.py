"""bench/engine_process.py without a real engine start: a child whose engine cannot be built reports its traceback,
which the parent raises (the interleaved CPU engine test in tests/vllm/test_vllm_bench.py runs the working path)."""
from __future__ import annotations

import pytest

from ubtree_vllm.bench.engine_process import EngineProcess, starts_side_by_side
from ubtree_vllm.bench.settings import E2ESettings


def test_a_failed_engine_start_raises_the_childs_traceback(tmp_path):
    missing = tmp_path / "no-such-target"
    settings = E2ESettings(target=str(missing), methods=("ar",), datasets=("toy",), temperatures=(0.0,))
    with pytest.raises(RuntimeError, match="engine ar failed in its process:(.|\n)*Traceback"):
        EngineProcess("ar", settings, settings, missing, {"enforce_eager": True}, tmp_path).wait_started()


def test_engines_start_side_by_side_only_with_a_fixed_kv_cache_size():
    assert starts_side_by_side({"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 4 << 30})
    assert not starts_side_by_side({"gpu_memory_utilization": 0.2})
    assert not starts_side_by_side({"gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": None})
