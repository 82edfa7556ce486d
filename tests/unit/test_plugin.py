"""Plugin registration, the vLLM version gate, the env registry and the patch manifest."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from importlib import metadata

import pytest

import ubtree_vllm
from ubtree_vllm import compat, envs, patches, plugin

HEAVY_MODULES = ("vllm", "torch", "transformers")


# --- registration -----------------------------------------------------------------------


def test_importing_package_and_plugin_imports_nothing_heavy(fresh_python):
    proc = fresh_python(
        f"""
        import sys
        import ubtree_vllm, ubtree_vllm.plugin, ubtree_vllm.patches, ubtree_vllm.envs
        print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))
        """
    )
    assert proc.stdout.strip() == "[]"


def test_register_imports_nothing_heavy_and_is_idempotent(fresh_python):
    """With an empty manifest (e.g. a version mismatch path) register() stays cheap."""
    proc = fresh_python(
        f"""
        import sys
        import ubtree_vllm.patches as patches
        from ubtree_vllm import plugin
        patches.MANIFEST = ()
        calls = []
        original = patches.apply
        patches.apply = lambda stage: calls.append(stage) or original(stage)
        plugin.register()
        plugin.register()
        print(calls, plugin._registered)
        print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))
        """
    )
    calls_line, heavy_line = proc.stdout.strip().splitlines()
    assert calls_line == "['engine'] True"
    assert heavy_line == "[]"


def test_register_with_real_manifest_applies_engine_patches_once(fresh_python):
    proc = fresh_python(
        """
        import ubtree_vllm.patches as patches
        from ubtree_vllm import plugin
        calls = []
        original = patches.apply
        patches.apply = lambda stage: calls.append(stage) or original(stage)
        plugin.register()
        plugin.register()
        print(calls, plugin._registered, len(patches.MANIFEST) > 0)
        """
    )
    assert proc.stdout.strip().splitlines()[-1] == "['engine'] True True"


@pytest.fixture
def unregistered(monkeypatch):
    """Make this process look as if register() had never run; restored afterwards."""
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(patches, "_applied_stages", set())


def test_register_applies_engine_patches_once(unregistered, monkeypatch):
    calls = []
    monkeypatch.setattr(patches, "apply", lambda stage: calls.append(stage) or ())
    plugin.register()
    plugin.register()
    assert calls == ["engine"]


@pytest.mark.parametrize("installed", ["0.31.2", "0.33.0", None])
def test_register_warns_and_does_nothing_on_unsupported_vllm(
    unregistered, monkeypatch, caplog, installed
):
    calls = []
    monkeypatch.setattr(patches, "apply", lambda stage: calls.append(stage) or ())
    monkeypatch.setattr(compat, "vllm_version", lambda: installed)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
        plugin.register()
    assert calls == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "ubtree_vllm plugin disabled" in warnings[0].getMessage()
    assert compat.SUPPORTED_VLLM in warnings[0].getMessage()


def _distribution():
    return metadata.distribution("ubtree-vllm")


def test_entry_points_are_declared_in_installed_metadata():
    dist = _distribution()
    assert dist.version == ubtree_vllm.__version__
    plugins = {ep.name: ep for ep in dist.entry_points if ep.group == "vllm.general_plugins"}
    assert plugins["ubtree"].value == "ubtree_vllm.plugin:register"
    assert plugins["ubtree"].load() is plugin.register
    scripts = {ep.name: ep for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts["ubtree"].value == "ubtree_vllm.cli:main"


def test_vllm_plugin_loader_calls_register(fresh_python):
    """vLLM's own loader finds the entry point and runs register() in a fresh process."""
    proc = fresh_python(
        """
        import os
        os.environ.pop("VLLM_PLUGINS", None)
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import ubtree_vllm.plugin
        print("registered", ubtree_vllm.plugin._registered)
        """
    )
    assert "registered True" in proc.stdout


# --- compat -----------------------------------------------------------------------------


def test_installed_vllm_is_the_supported_one():
    assert compat.vllm_version_is(compat.vllm_version())
    assert compat.check_vllm_version() == compat.vllm_version()


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.32.0+cu130", True),
        ("0.32.1", False),
        ("0.32.0rc1", False),
        ("0.32.0.dev5", False),
        ("0.32.0.post1", False),
        ("0.31.0", False),
        ("0.33.0", False),
        ("not-a-version", False),
        (None, False),
    ],
)
def test_vllm_version_is(version, supported):
    assert compat.vllm_version_is(version) is supported


def test_check_vllm_version_messages(monkeypatch):
    monkeypatch.setattr(compat, "vllm_version", lambda: None)
    with pytest.raises(RuntimeError, match="vLLM is not installed"):
        compat.check_vllm_version()
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.33.0")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0 only, but vLLM 0\.33\.0"):
        compat.check_vllm_version()


# --- envs -------------------------------------------------------------------------------


def test_capture_flag_left_by_a_v1_engine_is_reopened():
    from vllm.compilation import monitor

    from ubtree_vllm import compat

    monitor.set_cudagraph_capturing_enabled(False)  # what vLLM's V1 runner leaves after capture
    try:
        with pytest.raises(RuntimeError, match="inappropriate time"):
            monitor.validate_cudagraph_capturing_enabled()
        compat.allow_cudagraph_capture_for_next_engine()
        monitor.validate_cudagraph_capturing_enabled()
    finally:
        monitor.set_cudagraph_capturing_enabled(True)


def test_every_env_var_is_documented_and_prefixed():
    assert "UBTREE_CACHE_DIR" in envs.ENVIRONMENT_VARIABLES
    for name, var in envs.ENVIRONMENT_VARIABLES.items():
        assert name.startswith("UBTREE_")
        assert var.doc.strip()
        envs.get(name)  # the default parses
        assert name in envs.describe()
        assert name in dir(envs)


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("UBTREE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert envs.UBTREE_CACHE_DIR == tmp_path / ".cache" / "ubtree_vllm"
    monkeypatch.setenv("UBTREE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert envs.UBTREE_CACHE_DIR == tmp_path / "elsewhere"  # read lazily, not at import
    monkeypatch.setenv("UBTREE_CACHE_DIR", "")
    assert envs.UBTREE_CACHE_DIR == tmp_path / ".cache" / "ubtree_vllm"


def test_unknown_env_attribute_raises():
    with pytest.raises(AttributeError):
        envs.UBTREE_NO_SUCH_VARIABLE  # noqa: B018


# --- patch manifest ---------------------------------------------------------------------


def test_manifest_entries_are_well_formed():
    patches.validate_manifest()
    for spec in patches.MANIFEST:
        assert isinstance(spec, patches.PatchSpec)
        assert spec.stage in patches.STAGES
        assert spec.vllm_symbol.startswith("vllm."), spec
        assert importlib.util.find_spec(spec.module) is not None, f"{spec.name}: no {spec.module}"


def _spec(**overrides) -> patches.PatchSpec:
    fields = dict(
        name="toy", vllm_symbol="vllm.toy.symbol", why="because", how="wrap it",
        removal_condition="upstream fixes it",
    )
    fields.update(overrides)
    return patches.PatchSpec(**fields)


def test_patch_spec_validation():
    assert _spec().module == "ubtree_vllm.patches.engine.patch_toy"
    assert _spec(stage="worker").module == "ubtree_vllm.patches.worker.patch_toy"
    for field in ("name", "vllm_symbol", "why", "how", "removal_condition"):
        with pytest.raises(ValueError, match=field):
            _spec(**{field: "  "})
    with pytest.raises(ValueError, match="stage"):
        _spec(stage="scheduler")
    with pytest.raises(ValueError, match="outside"):
        _spec(module="somewhere_else.patch_toy")
    with pytest.raises(ValueError, match="duplicate"):
        patches.validate_manifest((_spec(), _spec(vllm_symbol="vllm.other")))
    with pytest.raises(ValueError, match="patched twice"):
        patches.validate_manifest((_spec(), _spec(name="toy2")))


def test_apply_rejects_unknown_stage():
    with pytest.raises(ValueError, match="unknown patch stage"):
        patches.apply("scheduler")


def test_apply_runs_each_stage_once_in_manifest_order(monkeypatch):
    calls = []
    for name in ("first", "second", "late"):
        module = types.ModuleType(f"ubtree_vllm.patches.toy_{name}")
        module.apply = lambda name=name: calls.append(name)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    manifest = (
        _spec(name="first", vllm_symbol="vllm.a", module="ubtree_vllm.patches.toy_first"),
        _spec(name="late", vllm_symbol="vllm.c", stage="worker",
              module="ubtree_vllm.patches.toy_late"),
        _spec(name="second", vllm_symbol="vllm.b", module="ubtree_vllm.patches.toy_second"),
    )
    monkeypatch.setattr(patches, "MANIFEST", manifest)
    monkeypatch.setattr(patches, "_applied_stages", set())
    assert patches.apply("engine") == ("first", "second")
    assert patches.apply("engine") == ()
    assert calls == ["first", "second"]
    assert patches.apply("worker") == ("late",)
    assert calls == ["first", "second", "late"]


def test_empty_manifest_applies_nothing(monkeypatch):
    monkeypatch.setattr(patches, "MANIFEST", ())
    monkeypatch.setattr(patches, "_applied_stages", set())
    assert patches.apply("engine") == ()
    assert patches.apply("worker") == ()


def test_triton_ops_exports_the_launchers():
    from ubtree_vllm import triton_ops

    assert triton_ops.__doc__
    assert triton_ops.__all__ == ["commit_accepted_paths", "head_loss_rows", "inject_chain_lattice",
                                   "kv_cache_pointers", "kv_path_commit", "lookup_chain_rows", "node_inputs",
                                   "tree_accept", "tree_accept_rows", "tree_attention", "tree_bad_words", "tree_layout",
                                   "tree_penalties", "tree_search", "vocab_top_k"]
    assert all(callable(getattr(triton_ops, name)) for name in triton_ops.__all__)


def test_triton_ops_imports_without_triton_and_launchers_say_why(fresh_python):
    proc = fresh_python(
        """
        import sys
        sys.modules["triton"] = None  # import triton -> ImportError
        import torch
        from ubtree_vllm.triton_ops import tree_attention
        q, kv = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16)
        cache = torch.zeros(3, 16, 2, 16)
        idx = torch.zeros(1, dtype=torch.long)
        try:
            tree_attention(q, kv, kv, cache, cache, torch.zeros(1, 1, dtype=torch.int32), idx, idx, idx,
                           idx[None], 0.25, torch.empty_like(q))
        except RuntimeError as err:
            print(err)
        """
    )
    assert "tree_attention needs Triton, which is not installed" in proc.stdout


def test_draft_cuda_graphs_flag(monkeypatch):
    monkeypatch.delenv("UBTREE_DRAFT_CUDA_GRAPHS", raising=False)
    assert envs.UBTREE_DRAFT_CUDA_GRAPHS is True
    for raw, value in (("0", False), ("false", False), ("1", True), ("TRUE", True)):
        monkeypatch.setenv("UBTREE_DRAFT_CUDA_GRAPHS", raw)
        assert envs.UBTREE_DRAFT_CUDA_GRAPHS is value
    monkeypatch.setenv("UBTREE_DRAFT_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="UBTREE_DRAFT_CUDA_GRAPHS: expected one of 0, 1, true, false, got 'yes'"):
        envs.UBTREE_DRAFT_CUDA_GRAPHS
