"""Training data: prompts answered by the target itself, stored as token-id shards.

Recipe. Prompts come only from the two training prompt files (ShareGPT first human turns
and GSM8K train), never from a benchmark set. Each prompt is wrapped in the target's chat
template (`add_generation_prompt=True`) and answered by the target at temperature
T_train (1.0 by default; 0.0 for the ablation). A sample is `prompt + response`, the
response ending in an EOS token when the target stopped before `max_new_tokens`.

Target hidden states are not stored. The trainer recomputes them online with one frozen,
no-grad target forward per batch: for SmolLM2-135M that forward costs a few percent of a
training step on the GPU, while storing 5 layers x 576 bf16 features is ~5.8 KB per token
(~17 GB for 3M tokens), which would dominate disk, I/O and the data-generation time.

On-disk format (a folder):
  manifest.json            settings, target identity, per-shard counts (see `Manifest`)
  shard-00000.safetensors  one shard of `shard_size` consecutive prompts:
      input_ids    [num_tokens] int32   all samples concatenated (prompt + response)
      offsets      [num_samples + 1] int64  sample i is input_ids[offsets[i]:offsets[i+1]]
      prompt_lens  [num_samples] int32  prompt tokens at the start of each sample
Shard i always holds prompts [i * shard_size, (i + 1) * shard_size) of the deterministic
prompt order, so generation is resumable: a shard listed in the manifest is complete (it
is written to a temporary name, renamed, then recorded) and is skipped on the next run.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "ubtree-train-data"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
# The only prompt files training may read: (file name, JSON field holding the prompt).
PROMPT_SOURCES: dict[str, tuple[str, str]] = {
    "sharegpt": ("sharegpt_first_human_turns.jsonl", "prompt"),
    "gsm8k": ("gsm8k_train.jsonl", "question"),
}
# Benchmark prompt files; reading them for training would leak the evaluation set.
BENCHMARK_FILES = frozenset({"spec_bench_question.jsonl", "mt_bench_question.jsonl", "HumanEval.jsonl.gz"})


@dataclass
class DataGenConfig:
    """Settings of one data-generation run (the `data:` section of a run YAML)."""

    # HF folder of the target ("default": the embedded SmolLM2-135M-Instruct).
    target: str = "default"
    # Short target name written into the manifest and the drafter config.
    target_name: str | None = None
    # Output folder (manifest + shards).
    out_dir: str = "runs/data"
    # Folder with the prompt files (PROMPT_SOURCES).
    data_root: str = "../shared/data"
    sources: tuple[str, ...] = ("sharegpt", "gsm8k")
    num_prompts: int = 1024
    # Prompts longer than this after chat templating are skipped (never truncated).
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 512
    # T_train: 1.0 (recipe) or 0.0 (greedy ablation).
    temperature: float = 1.0
    # Independent answers per prompt (each its own sample).
    samples_per_prompt: int = 1
    # Of each prompt's samples_per_prompt answers, the first greedy_samples are greedy (T = 0) and
    # the rest at `temperature`: a mix of the contexts a T = 0 and a T > 0 request will see.
    greedy_samples: int = 0
    backend: str = "hf"
    shard_size: int = 1024
    # HF backend: prompts per generate() call.  vLLM schedules its in-flight requests itself.
    batch_size: int = 16
    seed: int = 0
    # Stop after the shard that crosses this budget of generation time, counted once the backend
    # is ready (None: no limit).
    max_minutes: float | None = None
    # vLLM backend only: fraction of GPU memory vLLM may take.
    gpu_memory_utilization: float = 0.85
    # vLLM backend only: requests kept in the engine across shards (continuous batching), and
    # vLLM's max_num_seqs (None: vLLM's default). Neither changes the dataset's content.
    inflight_samples: int = 4096
    max_num_seqs: int | None = None
    # vLLM backend only: a fixed KV cache (vLLM's kv_cache_memory_bytes) instead of a share of the memory that
    # profiling finds free. vLLM then skips that profiling, which another engine starting beside it upsets, so
    # several gen-data engines can start at once; pair it with a small gpu_memory_utilization (vLLM's start-up
    # check wants that share free). None: profile.
    kv_cache_memory_bytes: int | None = None
    # Several gen-data processes may fill one folder (e.g. several vLLM engines on one GPU when one
    # engine's host work bounds its throughput): worker w of num_workers generates the shards with
    # index = w (mod num_workers). Not part of the dataset's identity.
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        self.sources = tuple(self.sources)
        unknown = [s for s in self.sources if s not in PROMPT_SOURCES]
        if unknown or not self.sources:
            raise ValueError(f"sources must be a non-empty subset of {sorted(PROMPT_SOURCES)}, got {list(self.sources)}")
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"backend must be 'hf' or 'vllm', got {self.backend!r}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("num_prompts", "max_prompt_tokens", "max_new_tokens", "shard_size", "batch_size",
                     "samples_per_prompt", "inflight_samples"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if int(self.num_workers) < 1 or not 0 <= int(self.worker) < int(self.num_workers):
            raise ValueError(f"worker must be in [0, num_workers = {self.num_workers}), got {self.worker}")
        if self.max_num_seqs is not None and int(self.max_num_seqs) < 1:
            raise ValueError(f"max_num_seqs must be >= 1 or null, got {self.max_num_seqs}")
        if self.kv_cache_memory_bytes is not None and int(self.kv_cache_memory_bytes) < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1 or null, got {self.kv_cache_memory_bytes}")
        if not 0 <= int(self.greedy_samples) <= int(self.samples_per_prompt):
            raise ValueError(f"greedy_samples must be in [0, samples_per_prompt = {self.samples_per_prompt}], "
                             f"got {self.greedy_samples}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DataGenConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown data setting(s) {unknown}; allowed keys: {sorted(known)}")
        return cls(**dict(values))

    def identity(self) -> dict[str, Any]:
        """Settings that define the dataset's content; a resumed run must match them."""
        keys = ("sources", "num_prompts", "max_prompt_tokens", "max_new_tokens", "temperature", "backend",
                "shard_size", "seed", "samples_per_prompt", "greedy_samples")
        return {k: (list(v) if isinstance(v := getattr(self, k), tuple) else v) for k in keys}


# ---- target identity ------------------------------------------------------------------
def resolve_target_path(target: str) -> Path:
    """`"default"` -> the embedded default target folder; anything else is a path."""
    if target == "default":
        from ubtree_vllm.models.default_target import default_target_path

        return default_target_path()
    path = Path(target).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target {target!r} is not an HF model folder (no config.json)")
    return path


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 over the token -> id map: equal iff two tokenizers map every token alike."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def load_tokenizer_and_eos(target_path: str | Path) -> tuple[Any, list[int]]:
    """The target's tokenizer and its EOS ids (tokenizer + generation config, if any)."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    try:
        gen_cfg = GenerationConfig.from_pretrained(target_path)
    except OSError:
        gen_cfg = None
    return tokenizer, eos_token_ids(tokenizer, gen_cfg)


def eos_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (deduplicated, sorted)."""
    ids: set[int] = set()
    for source in (tokenizer, generation_config):
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
    if not ids:
        raise ValueError("the target's tokenizer defines no EOS token")
    return sorted(ids)


def _default_name(target: str) -> str | None:
    if target != "default":
        return None
    from ubtree_vllm.models.default_target import DEFAULT_TARGET_NAME

    return DEFAULT_TARGET_NAME


def _max_positions(target_path: Path) -> int | None:
    cfg = json.loads((target_path / "config.json").read_text())
    return cfg.get("text_config", cfg).get("max_position_embeddings")


def target_identity(target_path: Path, tokenizer: Any, name: str | None) -> dict[str, Any]:
    cfg = json.loads((target_path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return {
        "name": name or target_path.name,
        "path": str(target_path),
        "vocab_size": text["vocab_size"],
        "tokenizer_vocab_size": len(tokenizer),
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
    }


# ---- prompts ---------------------------------------------------------------------------
def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_prompt_texts(data_root: str | Path, sources: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """All prompt texts of `sources` in file order, and each file's SHA-256."""
    texts, digests = [], {}
    for source in sources:
        file_name, key = PROMPT_SOURCES[source]
        assert file_name not in BENCHMARK_FILES
        path = Path(data_root) / file_name
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {path} not found (data_root={str(data_root)!r})")
        digests[file_name] = _sha256_file(path)
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                text = json.loads(line).get(key)
                if isinstance(text, str) and text.strip():
                    texts.append(text)
    return texts, digests


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """One user turn in the target's chat template, ready for the assistant's answer."""
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False)
    return tokenizer(templated, add_special_tokens=False)["input_ids"]


def select_prompts(texts: Sequence[str], tokenizer: Any, num_prompts: int, max_prompt_tokens: int,
                   seed: int) -> list[list[int]]:
    """Deterministic prompt order: shuffle with `seed`, template, skip over-long prompts."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    prompts: list[list[int]] = []
    for i in order:
        ids = chat_prompt_ids(tokenizer, texts[i])
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
            if len(prompts) == num_prompts:
                break
    if len(prompts) < num_prompts:
        raise ValueError(f"num_prompts={num_prompts} but only {len(prompts)} prompts fit max_prompt_tokens="
                         f"{max_prompt_tokens}")
    return prompts


# ---- generation backends ---------------------------------------------------------------
# (prompts, seed, temperatures) -> responses, each ending at the first EOS when the target stopped;
# one per prompt, in order, prompt i answered at temperatures[i] (generate_dataset repeats each
# prompt samples_per_prompt times).
GenerateFn = Callable[[Sequence[Sequence[int]], int, Sequence[float]], list[list[int]]]
# One shard's work: (shard index, prompts, seed, temperatures), as for a GenerateFn.
ShardJob = tuple[int, list[list[int]], int, list[float]]
# Jobs in (pulled lazily, so the caller's time budget decides when to stop), (shard index,
# responses) out as each shard completes, in any order; every pulled job is completed.
StreamFn = Callable[[Iterator[ShardJob]], Iterator[tuple[int, list[list[int]]]]]


def sequential_stream(generate: GenerateFn) -> StreamFn:
    """One job at a time through a GenerateFn (the HF backend, tests)."""
    def stream(jobs: Iterator[ShardJob]) -> Iterator[tuple[int, list[list[int]]]]:
        for index, prompts, seed, temperatures in jobs:
            yield index, generate(prompts, seed, temperatures)

    return stream


def truncate_at_eos(tokens: Iterable[int], eos: set[int]) -> list[int]:
    """Tokens up to and including the first EOS."""
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos:
            break
    return out


def hf_generator(target_path: Path, cfg: DataGenConfig, eos: list[int], device: str | None = None) -> GenerateFn:
    """Batched HF `generate` (left-padded); sampling restarts from `seed` for every call."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(dev).eval()
    eos_set = set(eos)

    @torch.no_grad()
    def generate(prompts: Sequence[Sequence[int]], seed: int, temperatures: Sequence[float]) -> list[list[int]]:
        torch.manual_seed(seed)
        # One temperature per generate() call, sorted by length so each pads little; results go back in order.
        batches = []
        for t in sorted(set(temperatures)):
            group = sorted((i for i, ti in enumerate(temperatures) if ti == t), key=lambda i: len(prompts[i]))
            batches += [group[s:s + cfg.batch_size] for s in range(0, len(group), cfg.batch_size)]
        results: list[list[int]] = [[] for _ in prompts]
        for chunk in batches:
            temperature = temperatures[chunk[0]]
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.full((len(chunk), width), eos[0], dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, width - len(prompts[i]):] = torch.tensor(list(prompts[i]))
                mask[row, width - len(prompts[i]):] = 1
            out = model.generate(
                input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=cfg.max_new_tokens,
                do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=eos[0])  # [b, width + new]
            for row, i in enumerate(chunk):
                results[i] = truncate_at_eos(out[row, width:].tolist(), eos_set)
        return results

    return generate


def _vllm_engine(target_path: Path, cfg: DataGenConfig) -> Any:
    from vllm import LLM  # lazy: vLLM is only needed for this backend

    extra = {name: getattr(cfg, name) for name in ("max_num_seqs", "kv_cache_memory_bytes")
             if getattr(cfg, name) is not None}
    return LLM(model=str(target_path), tokenizer=str(target_path), dtype="bfloat16", seed=cfg.seed,
               max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens,
               gpu_memory_utilization=cfg.gpu_memory_utilization, generation_config="vllm", **extra)


def _vllm_response(completion: Any, eos_set: set[int]) -> list[int]:
    tokens = list(completion.token_ids)
    stop = completion.stop_reason
    # vLLM may drop the stop token id from token_ids; keep EOS-terminated responses uniform.
    if completion.finish_reason == "stop" and isinstance(stop, int) and (not tokens or tokens[-1] != stop):
        tokens.append(stop)
    return truncate_at_eos(tokens, eos_set)


def vllm_stream(target_path: Path, cfg: DataGenConfig, eos: list[int]) -> StreamFn:
    """vLLM's offline engine fed continuously across shards: up to `inflight_samples` requests are in
    the engine at once, so a shard's long answers finish beside the next shards' short ones instead
    of draining the batch at every shard's end (one `LLM.generate` per shard spent most of its
    time in that tail). Token ids in, token ids out; no detokenization.

    One engine-level seed per run; per-request seeds would force vLLM's slow per-request sampling
    path, so reproducibility is up to vLLM's batch schedule.
    """
    return engine_stream(_vllm_engine(target_path, cfg).llm_engine, cfg, eos)


def engine_stream(engine: Any, cfg: DataGenConfig, eos: list[int]) -> StreamFn:
    """`vllm_stream` over an engine with vLLM's `LLMEngine` calls (add_request, step,
    get_num_unfinished_requests, has_unfinished_requests)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eos_set = set(eos)
    params: dict[float, Any] = {}

    def stream(jobs: Iterator[ShardJob]) -> Iterator[tuple[int, list[list[int]]]]:
        responses: dict[int, list[list[int]]] = {}
        remaining: dict[int, int] = {}
        exhausted = False
        while True:
            while not exhausted and engine.get_num_unfinished_requests() < cfg.inflight_samples:
                job = next(jobs, None)
                if job is None:
                    exhausted = True
                    break
                index, prompts, _seed, temperatures = job
                responses[index], remaining[index] = [[] for _ in prompts], len(prompts)
                for j, (prompt, t) in enumerate(zip(prompts, temperatures)):
                    if t not in params:
                        params[t] = SamplingParams(temperature=t, top_p=1.0, top_k=0, max_tokens=cfg.max_new_tokens,
                                                   stop_token_ids=eos, detokenize=False)
                    engine.add_request(f"{index}:{j}", TokensPrompt(prompt_token_ids=list(prompt)), params[t])
                if not prompts:
                    del remaining[index]
                    yield index, responses.pop(index)
            if not engine.has_unfinished_requests():
                return
            for out in engine.step():
                if not out.finished:
                    continue
                index, j = (int(x) for x in out.request_id.split(":"))
                responses[index][j] = _vllm_response(out.outputs[0], eos_set)
                remaining[index] -= 1
                if remaining[index] == 0:
                    del remaining[index]
                    yield index, responses.pop(index)

    return stream


# ---- shards and manifest ---------------------------------------------------------------
def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def write_shard(path: Path, samples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict[str, int]:
    """Write (prompt, response) pairs atomically; returns the shard's counts."""
    lengths = [len(p) + len(r) for p, r in samples]
    flat = [t for p, r in samples for t in (*p, *r)]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tensors = {
        "input_ids": torch.tensor(flat, dtype=torch.int32),
        "offsets": offsets,
        "prompt_lens": torch.tensor([len(p) for p, _ in samples], dtype=torch.int32),
    }
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return {"num_samples": len(samples), "num_tokens": len(flat),
            "num_response_tokens": sum(len(r) for _, r in samples)}


def _write_json_atomic(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def generate_dataset(cfg: DataGenConfig, generator: GenerateFn | None = None, log: Callable[[str], None] = print,
                     stream: StreamFn | None = None) -> dict[str, Any]:
    """Generate (or resume) the dataset in `cfg.out_dir`; returns the manifest.

    `generator` (one shard at a time) or `stream` overrides the backend (tests). Raises ValueError if `out_dir` holds a
    dataset made with other settings or for another tokenizer.
    """
    target_path = resolve_target_path(cfg.target)
    tokenizer, eos = load_tokenizer_and_eos(target_path)
    max_positions = _max_positions(target_path)
    if max_positions is not None and cfg.max_prompt_tokens + cfg.max_new_tokens > max_positions:
        raise ValueError(f"max_prompt_tokens + max_new_tokens = {cfg.max_prompt_tokens + cfg.max_new_tokens} exceeds "
                         f"the target's max_position_embeddings {max_positions}")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts, digests = load_prompt_texts(cfg.data_root, cfg.sources)
    manifest: dict[str, Any] = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "target": {**target_identity(target_path, tokenizer, cfg.target_name or _default_name(cfg.target)),
                   "eos_token_ids": eos},
        "generation": {**cfg.identity(), "source_sha256": digests},
        "shards": [], "num_samples": 0, "num_tokens": 0, "num_response_tokens": 0, "complete": False,
    }
    manifest_path = out / MANIFEST_FILE
    prompts = select_prompts(texts, tokenizer, cfg.num_prompts, cfg.max_prompt_tokens, cfg.seed)
    num_shards = -(-cfg.num_prompts // cfg.shard_size)
    manifest = _merge_shards(manifest_path, manifest, [], num_shards)  # checks an existing dataset's settings
    done = {s["file"] for s in manifest["shards"]}
    # this worker's shards: index = worker (mod num_workers)
    todo = [i for i in range(cfg.worker, num_shards, cfg.num_workers) if shard_name(i) not in done]
    if stream is None:
        if generator is not None:
            stream = sequential_stream(generator)
        elif not todo:
            stream = sequential_stream(lambda prompts, seed, temperatures: [])  # nothing left: no engine
        elif cfg.backend == "hf":
            stream = sequential_stream(hf_generator(target_path, cfg, eos))
        else:
            stream = vllm_stream(target_path, cfg, eos)
    # max_minutes counts generation time: an engine that takes minutes to start (compile, CUDA
    # graphs on a cold machine) still writes shards
    started = time.monotonic()

    def shard_samples(index: int) -> list[list[int]]:
        """Shard `index`'s prompts, each repeated samples_per_prompt times (the order of its answers)."""
        shard_prompts = prompts[index * cfg.shard_size:(index + 1) * cfg.shard_size]
        return [list(p) for p in shard_prompts for _ in range(cfg.samples_per_prompt)]

    def jobs() -> Iterator[ShardJob]:
        for index in todo:
            if cfg.max_minutes is not None and time.monotonic() - started > cfg.max_minutes * 60:
                log(f"gen-data: stopping at the time budget ({cfg.max_minutes} min) after {len(done)} of "
                    f"{num_shards} shards (the shards already in flight finish); run again to resume")
                return
            chunk = shard_samples(index)
            temperatures = [0.0 if j % cfg.samples_per_prompt < cfg.greedy_samples else cfg.temperature
                            for j in range(len(chunk))]
            yield index, chunk, cfg.seed * 100003 + index, temperatures

    for index, responses in stream(jobs()):
        name = shard_name(index)
        counts = write_shard(out / name, list(zip(shard_samples(index), responses)))
        manifest = _merge_shards(manifest_path, manifest, [{"file": name, **counts}], num_shards)
        done.add(name)
        log(f"gen-data: wrote {name} ({counts['num_samples']} samples, {counts['num_response_tokens']} response "
            f"tokens) [{len(done)}/{num_shards}] {time.monotonic() - started:.0f}s")
    return _merge_shards(manifest_path, manifest, [], num_shards)


def _merge_shards(manifest_path: Path, manifest: dict[str, Any], new_shards: Sequence[dict[str, Any]],
                  num_shards: int) -> dict[str, Any]:
    """Add `new_shards` to the manifest on disk (or to `manifest` if none is there) under an exclusive lock, so
    the gen-data workers of one folder (``worker``/``num_workers``) each add theirs; returns the merged manifest.

    ValueError when the manifest on disk was made with other generation or target settings."""
    import fcntl

    with open(manifest_path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        merged = dict(manifest)
        if manifest_path.is_file():
            old = json.loads(manifest_path.read_text())
            for section, keys in (("generation", None), ("target", ("tokenizer_sha256", "vocab_size"))):
                mine, theirs = manifest[section], old.get(section, {})
                diff = [k for k in (keys or set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
                if diff:
                    raise ValueError(f"{manifest_path.parent} holds a dataset with different {section} settings "
                                     f"{diff}; use another out_dir or delete it")
            merged["shards"] = list(old["shards"])
        else:
            merged["shards"] = list(manifest["shards"])
        have = {s["file"] for s in merged["shards"]}
        merged["shards"] += [s for s in new_shards if s["file"] not in have]
        _finish_manifest(merged, num_shards)
        _write_json_atomic(manifest_path, merged)
    return merged


def _finish_manifest(manifest: dict[str, Any], num_shards: int) -> None:
    manifest["shards"].sort(key=lambda s: s["file"])
    for key in ("num_samples", "num_tokens", "num_response_tokens"):
        manifest[key] = sum(s[key] for s in manifest["shards"])
    manifest["complete"] = len(manifest["shards"]) == num_shards


# ---- reading ---------------------------------------------------------------------------
# Which answers of a dataset a run trains on: every one, only the greedy ones (T = 0), or only those
# drawn at the generation temperature (the T_train ablations on one dataset of both kinds).
ANSWERS = ("all", "greedy", "sampled")


def answer_mask(manifest: Mapping[str, Any], num_samples: int, answers: str) -> torch.Tensor:
    """[num_samples] bool: the samples of one shard that `answers` keeps.

    A shard holds each prompt's samples_per_prompt answers in a row, the first greedy_samples
    of them greedy (generate_dataset). ValueError naming `answers` when the data has none of that kind.
    """
    if answers not in ANSWERS:
        raise ValueError(f"answers must be one of {ANSWERS}, got {answers!r}")
    gen = manifest["generation"]
    per_prompt, greedy = int(gen.get("samples_per_prompt", 1)), int(gen.get("greedy_samples", 0))
    if float(gen["temperature"]) == 0.0:
        greedy = per_prompt  # every answer of a T_train = 0 dataset is greedy
    if answers == "greedy" and greedy == 0 or answers == "sampled" and greedy == per_prompt:
        raise ValueError(f"answers={answers!r}: the dataset has no such answers (samples_per_prompt {per_prompt}, "
                         f"greedy_samples {greedy}, temperature {gen['temperature']})")
    is_greedy = torch.arange(num_samples) % per_prompt < greedy
    return {"all": torch.ones(num_samples, dtype=torch.bool), "greedy": is_greedy, "sampled": ~is_greedy}[answers]


@dataclass
class TokenDataset:
    """All samples of a dataset folder in memory (token ids are small: 4 bytes each)."""

    manifest: dict[str, Any]
    # [num_tokens] int32, [num_samples + 1] int64, [num_samples] int32
    input_ids: torch.Tensor
    offsets: torch.Tensor
    prompt_lens: torch.Tensor
    root: Path = field(default=Path("."))
    # ANSWERS: the kind of answer each shard contributes (the others are skipped at load)
    answers: str = "all"

    @classmethod
    def load(cls, directory: str | Path, shard_files: Sequence[str] | None = None,
             answers: str = "all") -> TokenDataset:
        """All shards listed in the manifest, or only `shard_files` (in that order); `answers` selects samples."""
        root = Path(directory)
        manifest = read_manifest(root)
        if not manifest["shards"]:
            raise ValueError(f"{root} holds no shards yet; run `ubtree gen-data` to completion")
        answer_mask(manifest, 0, answers)  # the data has such answers
        dataset = cls(manifest, torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                      torch.zeros(0, dtype=torch.int32), root, answers)
        listed = [s["file"] for s in manifest["shards"]]
        for name in listed if shard_files is None else shard_files:
            if name not in listed:
                raise ValueError(f"dataset {root}: shard {name} is not in its manifest")
            dataset.append_shard(name)
        return dataset

    def append_shard(self, name: str) -> range:
        """Load one shard file and append its samples of the kind `answers` keeps; returns their indices."""
        t = load_file(str(self.root / name))
        offsets, prompt_lens = t["offsets"], t["prompt_lens"]
        keep = answer_mask(self.manifest, int(prompt_lens.numel()), self.answers)
        if not bool(keep.all()):
            lengths = offsets.diff()  # [num_samples] tokens of each sample
            t = {"input_ids": t["input_ids"][keep.repeat_interleave(lengths)],
                 "offsets": torch.cat([offsets[:1] * 0, torch.cumsum(lengths[keep], 0)]),
                 "prompt_lens": prompt_lens[keep]}
        first, base = len(self), int(self.input_ids.numel())
        self.input_ids = torch.cat([self.input_ids, t["input_ids"]])
        self.offsets = torch.cat([self.offsets, t["offsets"][1:] + base])
        self.prompt_lens = torch.cat([self.prompt_lens, t["prompt_lens"]])
        return range(first, len(self))

    def __len__(self) -> int:
        return int(self.prompt_lens.numel())

    def response_tokens(self) -> torch.Tensor:
        """[num_samples] int64 response length of each sample."""
        return (self.offsets[1:] - self.offsets[:-1]) - self.prompt_lens.long()

    def sample_length(self, index: int) -> int:
        """Tokens (prompt + response) of sample `index`."""
        return int(self.offsets[index + 1] - self.offsets[index])

    def sample(self, index: int) -> tuple[torch.Tensor, int]:
        """(token ids [T] int64, prompt length) of sample `index`."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.input_ids[start:end].long(), int(self.prompt_lens[index])

    def check_target(self, tokenizer: Any, vocab_size: int) -> None:
        """ValueError naming the field when this data was not made with this target's tokenizer."""
        t = self.manifest["target"]
        if t["vocab_size"] != vocab_size:
            raise ValueError(f"dataset {self.root}: target.vocab_size is {t['vocab_size']} but the target model's "
                             f"vocab_size is {vocab_size}; the data was made for another target")
        if t["tokenizer_sha256"] != tokenizer_fingerprint(tokenizer):
            raise ValueError(f"dataset {self.root}: target.tokenizer_sha256 does not match the target's tokenizer; "
                             f"the data was tokenized for another target ({t['name']!r})")
        if len(self) and int(self.input_ids.max()) >= vocab_size:
            raise ValueError(f"dataset {self.root}: input_ids has token id {int(self.input_ids.max())} >= "
                             f"vocab_size {vocab_size}")


def read_manifest(root: str | Path) -> dict[str, Any]:
    manifest_path = Path(root) / MANIFEST_FILE
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{root} is not a training dataset (no {MANIFEST_FILE}); run `ubtree gen-data`")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{manifest_path}: unsupported format {manifest.get('format')!r} "
                         f"v{manifest.get('format_version')}")
    return manifest


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: randperm(num_samples) seeded by (seed, epoch)."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 7919 + epoch))


class ShardStream:
    """Sample order over a dataset folder that gen-data is still writing.

    Shards join as they land (`refresh`). Samples never trained on go first, each new shard
    shuffled by (seed, shard index); once every loaded sample has been seen, epochs over all
    loaded samples (randperm seeded by (seed, epoch)) fill in until new data lands. The state
    (`state_dict`) is the loaded shard list and the queues, so a resume with the same shards
    on disk continues the same order.
    """

    def __init__(self, dataset: TokenDataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.shards: list[str] = []
        self.fresh: list[int] = []
        self.replay: list[int] = []
        self.epoch = 0
        self._mtime = None

    def refresh(self) -> int:
        """Load shards listed in the manifest since the last call; returns how many samples joined."""
        path = self.dataset.root / MANIFEST_FILE
        mtime = path.stat().st_mtime_ns
        if mtime == self._mtime:
            return 0
        self._mtime = mtime
        manifest = read_manifest(self.dataset.root)
        self.dataset.manifest = manifest
        joined = 0
        for shard in manifest["shards"]:
            if shard["file"] in self.shards:
                continue
            index = len(self.shards)
            self._add(shard["file"], index)
            joined += shard["num_samples"]
        return joined

    def _add(self, name: str, index: int) -> None:
        new = self.dataset.append_shard(name)
        self.shards.append(name)
        g = torch.Generator().manual_seed(self.seed * 7919 + 1_000_003 * (index + 1))
        self.fresh += [new[i] for i in torch.randperm(len(new), generator=g).tolist()]

    def take(self, count: int) -> list[int]:
        out = []
        while len(out) < count:
            if self.fresh:
                out.append(self.fresh.pop())
                continue
            if not self.replay:
                self.replay = epoch_permutation(len(self.dataset), self.seed, self.epoch).tolist()
                self.epoch += 1
            out.append(self.replay.pop())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"shards": list(self.shards), "fresh": list(self.fresh), "replay": list(self.replay),
                "epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for index, name in enumerate(state["shards"]):
            self._add(name, index)
        self.fresh, self.replay, self.epoch = list(state["fresh"]), list(state["replay"]), state["epoch"]


def manifest_summary(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance fields the trainer copies into its outputs."""
    return {"target": manifest["target"]["name"], **{k: manifest["generation"][k] for k in
            ("temperature", "backend", "max_new_tokens", "num_prompts", "sources", "seed")},
            "samples_per_prompt": manifest["generation"].get("samples_per_prompt", 1),
            "greedy_samples": manifest["generation"].get("greedy_samples", 0),
            "num_samples": manifest["num_samples"], "num_tokens": manifest["num_tokens"],
            "num_response_tokens": manifest["num_response_tokens"]}

