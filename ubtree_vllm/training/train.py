"""The drafter trainer: a library loop driven by `TrainConfig`; `ubtree train` is a thin CLI.

Determinism and exact resume. The data order is a pure function of (seed, cursor):
epoch e visits the samples in `randperm(num_samples)` drawn from seed (seed, e), and the
cursor counts samples consumed. The anchors of step s are drawn from a CPU generator
seeded by (seed, s). With the checkpointed weights, optimizer, scheduler and cursor, a
resumed run therefore computes the same step s + 1 as the uninterrupted one.

Time slices. `max_minutes` stops the loop at the first step boundary past the budget,
writes a checkpoint and returns `status == "paused"`; running the same config again
resumes from the newest checkpoint. When `max_steps` is reached the drafter is exported
(export.py), checked by a round trip, and a `train` record is appended. With
`schedule_by_time` the LR schedule runs over `max_minutes` instead of `max_steps`, and the
budget's end finishes (exports) the run: the form of one device slice.

Training across sessions. `init_drafter` starts from an exported drafter (the committed one):
its weights, a fresh optimizer and warm-up. Its `ubtree_meta.json` carries the cumulative
label rows and distinct tokens of every slice behind it; the new export and `train` record
add this slice's.

Streaming data (`stream_data`). The trainer trains on a dataset folder that `ubtree gen-data`
is still writing beside it on the same GPU: it waits for the first shard, then picks up new
shards as they land (data.py:ShardStream; unseen samples first).

Initialisation (fresh drafters): the target features are standardised per channel (the RMS
over the first batches; a few channels of the fused layers are ~35x the median), kept as the
backbone's feature scale and folded into `fc` at export; the drafter's final norm starts from
the target's final norm (both feed the same LM head) times `norm_init_scale` (0.1), so the first
logits are near uniform rather than confidently random.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.io import load_drafter, training_totals
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.training import checkpoint as ckpt
from ubtree_vllm.training.batching import LengthPools
from ubtree_vllm.training.data import (ANSWERS, ShardStream, TokenDataset, epoch_permutation, manifest_summary,
                                      read_manifest, resolve_target_path)
from ubtree_vllm.training.export import check_round_trip, export_drafter
from ubtree_vllm.training.grow import grow_layers
from ubtree_vllm.training.losses import LossConfig, collate, drafter_loss, make_generator
from ubtree_vllm.training.target import FrozenTarget
from ubtree_vllm.training.target_cache import TargetCache, cached_target_outputs

SCHEDULES = ("cosine", "linear", "constant")
# Settings that may change between time slices of one run; all others must match the checkpoint.
SLICE_SETTINGS = frozenset({"max_minutes", "log_every", "checkpoint_every", "keep_checkpoints", "progress",
                            "records_path", "export_dir", "device", "resume", "stream_wait_minutes",
                            "stream_refresh_steps", "head_chunk_rows", "target_cache_gb"})
# Block depths whose proposer top-1 accuracy the history logs.
DEPTHS_LOGGED = (1, 2, 4, 8, 16)
# Drafter settings an `init_drafter` fixes; an override that disagrees is an error.
DRAFTER_IDENTITY = ("num_layers", "block_size", "top_k", "selector_rank", "mask_token_id", "target_layer_ids",
                    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


@dataclass
class TrainConfig:
    """One training run (the `train:` section of a run YAML). Unknown keys are an error."""

    # HF folder of the target ("default": the embedded SmolLM2-135M-Instruct).
    target: str = "default"
    # Name written into the drafter config; default: the dataset manifest's target name.
    target_name: str | None = None
    data_dir: str = "runs/data"
    # Which answers of the dataset to train on (data.ANSWERS): all, only the greedy ones or only the
    # sampled ones (the T_train = 0 / 1 ablations on one dataset that holds both).
    answers: str = "all"
    output_dir: str = "runs/train"
    # Where the final drafter folder goes (default: <output_dir>/drafter).
    export_dir: str | None = None
    # Optional drafter folder to start from (its config wins over `drafter`).
    init_drafter: str | None = None
    # Layers appended to init_drafter's backbone (grow.py): each a copy of its last layer with the
    # residual outputs zeroed, so the grown drafter starts as the same function with more capacity.
    grow_layers: int = 0
    # Overrides of DrafterConfig.for_target (num_layers, block_size, top_k, mask_token_id, ...).
    drafter: dict[str, Any] = field(default_factory=dict)
    # Objective (losses.py). The joint ablation: proposer_kl=0, detach_selector=false.
    selector_loss: str = "kl"
    beta: float = 0.1
    loss_decay: float | None = 7.0
    blocks_per_seq: int = 256
    proposer_kl: float = 1.0
    detach_selector: bool = True
    head_chunk_rows: int = 4096
    # Device memory (GiB) for the target's outputs of each sample, reused when the sample comes
    # again (training/target_cache.py); 0 runs the target on every batch.
    target_cache_gb: float = 0.0
    # Initialisation of a fresh drafter (module docstring).
    standardize_features: bool = True
    feature_stats_batches: int = 4
    norm_from_target: bool = True
    # Multiplies that norm: a random drafter's logits through the target's norm are confidently wrong;
    # 0.1 starts near uniform (and learnt fastest of 0.1 / 0.3 / 1.0 in a CPU comparison).
    norm_init_scale: float = 0.1
    # Train on a dataset gen-data is still writing (module docstring).
    stream_data: bool = False
    stream_wait_minutes: float = 10.0
    stream_refresh_steps: int = 20
    # Data: sequences per step and the truncation length.
    batch_size: int = 8
    max_seq_len: int = 1024
    # Batches drawn at once and regrouped by length, so each pads less (batching.py); 1: the data order's batches
    length_pool_batches: int = 1
    # Optimization.
    max_steps: int = 1000
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    schedule: str = "cosine"
    weight_decay: float = 0.01
    adam_betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    # "auto": CUDA if available; bf16 autocast on CUDA, float32 on CPU.
    device: str = "auto"
    # Bookkeeping.
    log_every: int = 10
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    max_minutes: float | None = None
    # LR schedule over max_minutes of training-loop time (not max_steps; start-up and waiting for
    # data do not count); the budget's end finishes (exports) the run.
    schedule_by_time: bool = False
    resume: bool = True
    progress: bool = True
    records_path: str | None = "docs/benchmarks/records.jsonl"

    def __post_init__(self) -> None:
        self.adam_betas = tuple(self.adam_betas)  # type: ignore[assignment]
        if self.answers not in ANSWERS:
            raise ValueError(f"answers must be one of {ANSWERS}, got {self.answers!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not self.target_cache_gb >= 0:
            raise ValueError(f"target_cache_gb must be >= 0 (GiB; 0: no cache), got {self.target_cache_gb}")
        if not self.norm_init_scale > 0:
            raise ValueError(f"norm_init_scale must be > 0, got {self.norm_init_scale}")
        if self.schedule_by_time and not self.max_minutes:
            raise ValueError("schedule_by_time needs max_minutes (the schedule runs over it)")
        for name in ("batch_size", "max_steps", "log_every", "checkpoint_every", "keep_checkpoints",
                     "feature_stats_batches", "stream_refresh_steps", "length_pool_batches"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if not 0 <= self.warmup_steps:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"lr must be > 0 and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        if self.grow_layers < 0 or (self.grow_layers and not self.init_drafter):
            raise ValueError(f"grow_layers must be >= 0 and needs init_drafter (the drafter it grows), got "
                             f"{self.grow_layers} with init_drafter {self.init_drafter!r}")
        if not isinstance(self.drafter, dict):
            raise ValueError(f"drafter must be a mapping of DrafterConfig overrides, got {self.drafter!r}")  # noqa: TRY004
        self.loss_config()  # validates selector_loss, beta, loss_decay, blocks_per_seq

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown train setting(s) {unknown}; allowed keys: {sorted(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["adam_betas"] = list(self.adam_betas)
        return out

    def loss_config(self) -> LossConfig:
        return LossConfig(self.selector_loss, self.beta, self.loss_decay, self.blocks_per_seq, self.proposer_kl,
                          self.detach_selector, self.head_chunk_rows)

    @property
    def drafter_dir(self) -> Path:
        return Path(self.export_dir) if self.export_dir else Path(self.output_dir) / "drafter"


@dataclass
class TrainResult:
    # "finished" (max_steps reached, drafter exported) or "paused" (time budget)
    status: str
    step: int
    history: list[dict[str, float]]
    drafter_dir: Path | None
    checkpoint: Path | None
    wall_time_s: float
    tokens_seen: int


def lr_factor(step: int, cfg: TrainConfig, time_progress: float | None = None) -> float:
    """LR multiplier at `step`: linear warmup, then cosine/linear decay to min_lr_ratio (or constant).

    `time_progress` (0..1, schedule_by_time) replaces the step-based progress of the decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if time_progress is not None:
        progress = min(1.0, max(0.0, time_progress))
    else:
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


class DataOrder:
    """Sample indices for a cursor: epoch e is randperm(n) seeded by (seed, e)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        self.num_samples, self.seed = num_samples, seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def take(self, cursor: int, count: int) -> list[int]:
        out = []
        for c in range(cursor, cursor + count):
            epoch, i = divmod(c, self.num_samples)
            if epoch != self._epoch:
                self._epoch, self._perm = epoch, epoch_permutation(self.num_samples, self.seed, epoch)
            out.append(int(self._perm[i]))
        return out


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_drafter_config(cfg: TrainConfig, hf_config: Any, target_name: str) -> DrafterConfig:
    """The drafter config of the run; errors name the `drafter.*` setting at fault."""
    if cfg.init_drafter:
        drafter_cfg = DrafterConfig.load(cfg.init_drafter)
        drafter_cfg = dataclasses.replace(drafter_cfg, num_layers=drafter_cfg.num_layers + cfg.grow_layers)
        for key, value in cfg.drafter.items():
            if key not in DRAFTER_IDENTITY:
                continue
            have = getattr(drafter_cfg, key)
            want = tuple(value) if isinstance(have, tuple) else value
            if have != want:
                grown = f" + grow_layers {cfg.grow_layers}" if key == "num_layers" and cfg.grow_layers else ""
                raise ValueError(f"train config 'drafter.{key}' is {value!r} but init_drafter "
                                 f"{cfg.init_drafter}{grown} has {key} = {have!r}; drop the override or start "
                                 "a fresh drafter")
        if drafter_cfg.target_name != target_name:
            raise ValueError(f"init_drafter {cfg.init_drafter} was trained for target {drafter_cfg.target_name!r}, "
                             f"the data is for {target_name!r} (target)")
    else:
        known = {f.name for f in dataclasses.fields(DrafterConfig)} - {"target_name", "vocab_size", "hidden_size",
                                                                      "target_num_layers", "extra"}
        unknown = sorted(set(cfg.drafter) - known)
        if unknown:
            raise ValueError(f"unknown drafter setting(s) {unknown}; allowed keys: {sorted(known)}")
        overrides = dict(cfg.drafter)
        if "target_layer_ids" in overrides:
            overrides["target_layer_ids"] = tuple(overrides["target_layer_ids"])
        try:
            drafter_cfg = DrafterConfig.for_target(hf_config, target_name, **overrides)
        except ValueError as exc:
            raise ValueError(f"train config 'drafter': {exc}") from exc
    drafter_cfg.check_hf_target(hf_config)
    return drafter_cfg


def _param_groups(drafter: UBTreeDrafter, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not norms or per-depth mixing weights)."""
    decay = [p for p in drafter.parameters() if p.ndim >= 2]
    no_decay = [p for p in drafter.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _check_resume(saved: Mapping[str, Any], cfg: TrainConfig) -> None:
    mine = cfg.to_dict()
    diff = sorted(k for k in mine if k not in SLICE_SETTINGS and saved.get(k) != mine[k])
    if diff:
        raise ValueError(f"cannot resume from {cfg.output_dir}: setting(s) {diff} differ from the checkpoint "
                         f"(use a new output_dir, or restore them)")


def _wait_for_shards(data_dir: str, minutes: float, log: Callable[[str], None]) -> None:
    """Block until the dataset folder lists at least one shard (stream_data)."""
    deadline = time.monotonic() + minutes * 60
    while True:
        try:
            if read_manifest(data_dir)["shards"]:
                return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"stream_data: no shard appeared in {data_dir} within stream_wait_minutes={minutes}")
        log(f"train: waiting for the first shard in {data_dir}")
        time.sleep(5)


def _open_data(cfg: TrainConfig, log: Callable[[str], None]) -> tuple[TokenDataset, ShardStream | None]:
    if not cfg.stream_data:
        dataset = TokenDataset.load(cfg.data_dir, answers=cfg.answers)
        if not dataset.manifest["complete"]:
            raise ValueError(f"dataset {cfg.data_dir} is incomplete ({len(dataset)} of "
                             f"{dataset.manifest['generation']['num_prompts']} samples); run `ubtree gen-data` again to "
                             f"finish it, or set stream_data: true")
        return dataset, None
    _wait_for_shards(cfg.data_dir, cfg.stream_wait_minutes, log)
    dataset = TokenDataset.load(cfg.data_dir, shard_files=[], answers=cfg.answers)
    return dataset, ShardStream(dataset, cfg.seed)


@torch.no_grad()
def _feature_scale(target: FrozenTarget, dataset: TokenDataset, cfg: TrainConfig, device: torch.device) -> torch.Tensor:
    """[F] float32: 1 / RMS of each feature channel over the first feature_stats_batches batches."""
    sums, count = None, 0
    take = min(len(dataset), cfg.feature_stats_batches * cfg.batch_size)
    for start in range(0, take, cfg.batch_size):
        batch = collate([dataset.sample(i) for i in range(start, min(take, start + cfg.batch_size))],
                        cfg.max_seq_len).to(device)
        valid = torch.arange(batch.input_ids.shape[1], device=device)[None] < batch.lengths[:, None]
        part, n = target.feature_square_sums(batch.input_ids, valid)
        sums, count = (part if sums is None else sums + part), count + n
    rms = (sums / max(1, count)).sqrt().float()
    return 1.0 / rms.clamp(min=1e-3)


def train(cfg: TrainConfig, stop_at_step: int | None = None, log: Callable[[str], None] = print) -> TrainResult:
    """Run (or resume) training; see the module docstring. `stop_at_step` pauses early (tests)."""
    from transformers import AutoConfig, AutoTokenizer

    started = time.monotonic()
    device = resolve_device(cfg.device)
    use_bf16 = device.type == "cuda"
    out = Path(cfg.output_dir)
    existing = ckpt.list_checkpoints(out)
    if existing and not cfg.resume:
        raise ValueError(f"{out} already has checkpoints; set resume: true to continue or use a new output_dir")

    dataset, stream = _open_data(cfg, log)
    if stream is not None and not existing:
        stream.refresh()
    target_path = resolve_target_path(cfg.target)
    hf_config = AutoConfig.from_pretrained(target_path)
    dataset.check_target(AutoTokenizer.from_pretrained(target_path), hf_config.get_text_config().vocab_size)
    target_name = cfg.target_name or dataset.manifest["target"]["name"]
    drafter_cfg = build_drafter_config(cfg, hf_config, target_name)
    target = FrozenTarget.from_pretrained(target_path, drafter_cfg.target_layer_ids, device,
                                          torch.bfloat16 if use_bf16 else torch.float32)

    torch.manual_seed(cfg.seed)
    drafter = load_drafter(cfg.init_drafter) if cfg.init_drafter else UBTreeDrafter(drafter_cfg)
    if cfg.grow_layers:
        drafter = grow_layers(drafter, cfg.grow_layers)
        log(f"train: grew {cfg.init_drafter} to {drafter.cfg.num_layers} layers (the new ones start as the identity)")
    drafter = drafter.to(device=device, dtype=torch.float32)
    drafter.bind_hf_target(target.model)
    drafter.train()
    optimizer = torch.optim.AdamW(_param_groups(drafter, cfg.weight_decay), lr=cfg.lr, betas=cfg.adam_betas)
    loop_s = 0.0  # training-loop seconds of this run (all slices), for the schedule and throughput
    loop_started = None

    def time_progress() -> float | None:
        if not cfg.schedule_by_time:
            return None
        now = loop_s + (time.monotonic() - loop_started if loop_started is not None else 0.0)
        return now / (cfg.max_minutes * 60)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, time_progress()))
    pools = None
    if cfg.length_pool_batches > 1:
        pools = LengthPools(lambda i: min(dataset.sample_length(i), cfg.max_seq_len), cfg.batch_size,
                            cfg.length_pool_batches, cfg.seed)
    step = cursor = tokens_seen = 0
    label_rows: torch.Tensor | int = 0  # label rows of the steps since the last read of tokens_seen
    wall_before = 0.0
    history: list[dict[str, float]] = []
    seen: set[int] = set()
    if existing:
        state = ckpt.load_checkpoint(existing[-1])
        _check_resume(state["config"], cfg)
        if stream is None and state["data"] != _data_identity(dataset):
            raise ValueError(f"cannot resume from {out}: the dataset changed since the checkpoint "
                             f"({state['data']} -> {_data_identity(dataset)})")
        drafter.load_state_dict(state["model"])
        drafter.backbone.feature_scale.copy_(state["feature_scale"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        step, cursor, tokens_seen = state["step"], state["cursor"], state["tokens_seen"]
        wall_before, history, loop_s = state["wall_time_s"], state["history"], state.get("loop_s", 0.0)
        seen = set(state.get("seen", []))
        if stream is not None:
            stream.load_state_dict(state["stream"])
        if pools is not None and state.get("length_pools"):
            pools.load_state_dict(state["length_pools"])
        log(f"train: resumed from {existing[-1]} (step {step}/{cfg.max_steps})")
    else:
        if cfg.standardize_features:
            scale = _feature_scale(target, dataset, cfg, device)
            if cfg.init_drafter:  # keep the loaded function: its fc already holds the folded scale
                drafter.backbone.fc.weight.data /= scale[None, :]
            drafter.backbone.feature_scale.copy_(scale)
        norm = target.final_norm_weight()
        if cfg.norm_from_target and not cfg.init_drafter and norm is not None:
            drafter.backbone.norm.weight.data.copy_(norm.float() * cfg.norm_init_scale)

    start_step = step
    loss_cfg = cfg.loss_config()
    cache = None
    if cfg.target_cache_gb > 0:
        cache = TargetCache(cfg.target_cache_gb * 2**30, drafter_cfg.num_features, drafter_cfg.hidden_size, device,
                            target.head_weight.dtype)
    cached_steps = cached_samples = 0
    order = DataOrder(len(dataset), cfg.seed) if stream is None else None
    params = [p for p in drafter.parameters()]
    sums: dict[str, torch.Tensor] = {}
    window = 0
    last_ckpt: Path | None = existing[-1] if existing else None
    prior = training_totals(cfg.init_drafter)

    def save() -> Path:
        payload = {"model": drafter.state_dict(), "feature_scale": drafter.backbone.feature_scale.cpu(),
                   "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": ckpt.rng_state(),
                   "cursor": cursor, "tokens_seen": tokens_seen, "wall_time_s": wall_before + time.monotonic() - started,
                   "loop_s": loop_s, "history": history, "config": cfg.to_dict(),
                   "drafter_config": drafter_cfg.to_hf_dict(), "data": _data_identity(dataset), "seen": sorted(seen),
                   "stream": stream.state_dict() if stream is not None else None,
                   "length_pools": pools.state_dict() if pools is not None else None}
        path = ckpt.save_checkpoint(out, step, payload, cfg.keep_checkpoints)
        ckpt.plot_history(history, out / "loss_curve.png", f"UBTree drafter for {target_name}")
        (out / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
        return path

    bar = None
    if cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=step, desc="train", dynamic_ncols=True)
    status = "finished"
    loop_started = time.monotonic()
    while step < cfg.max_steps:
        if stop_at_step is not None and step >= stop_at_step:
            status = "paused"
            break
        if cfg.schedule_by_time and time_progress() >= 1.0:  # the budget counts training-loop time only
            break
        if not cfg.schedule_by_time and cfg.max_minutes is not None and time.monotonic() - started > cfg.max_minutes * 60:
            status = "paused"
            break
        if stream is not None and step % cfg.stream_refresh_steps == 0:
            stream.refresh()
        draw = (lambda count: order.take(cursor, count)) if order is not None else stream.take
        indices = pools.next_batch(draw) if pools is not None else draw(cfg.batch_size)
        seen.update(indices)
        batch = collate([dataset.sample(i) for i in indices], cfg.max_seq_len)
        on_device = batch.to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16):
            cached, hits = (cached_target_outputs(cache, target, indices, on_device, batch.host_lengths.tolist())
                            if cache is not None else (None, 0))
            result = drafter_loss(drafter, target, on_device, loss_cfg, make_generator(cfg.seed, step),
                                  target_outputs=cached)
        cached_steps += hits == len(indices)
        cached_samples += hits
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        cursor += cfg.batch_size
        label_rows = label_rows + result.num_tokens  # a device scalar: read at logging, no sync per step
        by_depth = {f"top1_depth{d}": result.top1_by_depth[d - 1].nan_to_num(0.0) for d in DEPTHS_LOGGED
                    if d <= drafter_cfg.block_size}
        for key, value in {**result.metrics, **by_depth, "grad_norm": grad_norm.detach()}.items():
            sums[key] = sums.get(key, 0.0) + value.float()
        window += 1
        if bar is not None:
            bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            tokens_seen, label_rows = tokens_seen + int(label_rows), 0  # SYNC: logging only
            entry = {"step": step, "lr": scheduler.get_last_lr()[0], "tokens_seen": tokens_seen,
                     "samples_seen": len(seen), **{k: float(v) / window for k, v in sums.items()}}  # SYNC: logging only
            history.append(entry)
            sums, window = {}, 0
            if bar is not None:
                bar.set_postfix(loss=f"{entry['loss']:.3f}", top1=f"{entry['top1']:.3f}",
                                tau=f"{entry['chain_tau']:.2f}")
            else:
                log(f"step {step}: loss {entry['loss']:.4f} ce {entry['ce']:.4f} kl {entry['kl']:.4f} "
                    f"top1 {entry['top1']:.3f} topk_hit {entry['topk_hit']:.3f} tau~ {entry['chain_tau']:.2f} "
                    f"samples {len(seen)}/{len(dataset)}")
        if step % cfg.checkpoint_every == 0 and step < cfg.max_steps:
            tokens_seen, label_rows = tokens_seen + int(label_rows), 0
            loop_s += time.monotonic() - loop_started
            loop_started = time.monotonic()
            last_ckpt = save()
    tokens_seen, label_rows = tokens_seen + int(label_rows), 0
    loop_s += time.monotonic() - loop_started
    loop_started = None
    if cache is not None:
        log(f"train: {cached_steps} of {step - start_step} steps took the target's outputs from the cache, "
            f"{cached_samples} samples in all "
            f"({len(cache)} samples, {cache.used} of {cache.capacity_tokens} rows)")
    if bar is not None:
        bar.close()
    if window:  # flush a partial logging window so no step's metrics are lost
        history.append({"step": step, "lr": scheduler.get_last_lr()[0], "tokens_seen": tokens_seen,
                        "samples_seen": len(seen), **{k: float(v) / window for k, v in sums.items()}})
    ran = step > start_step
    if ran:
        last_ckpt = save()
    wall = wall_before + time.monotonic() - started
    if status == "paused":
        log(f"train: paused at step {step}/{cfg.max_steps} after {wall / 60:.1f} min of training; "
            f"run the same command again to resume from {last_ckpt}")
        return TrainResult(status, step, history, None, last_ckpt, wall, tokens_seen)

    if not ran and (cfg.drafter_dir / "config.json").is_file():
        log(f"train: already finished at step {step}; the drafter is in {cfg.drafter_dir}")
        return TrainResult(status, step, history, cfg.drafter_dir, last_ckpt, wall, tokens_seen)
    # response tokens of the distinct samples trained on (this run's)
    distinct = int(dataset.response_tokens()[sorted(seen)].sum()) if seen else 0
    totals = {"label_rows_per_s": round(tokens_seen / max(loop_s, 1e-9), 1), "distinct_tokens": distinct,
              "cumulative_label_rows": prior["cumulative_label_rows"] + tokens_seen,
              "cumulative_distinct_tokens": prior["cumulative_distinct_tokens"] + distinct}
    drafter_dir = _finish(cfg, drafter, dataset, history, step, tokens_seen, wall, target_name, totals, log)
    return TrainResult(status, step, history, drafter_dir, last_ckpt, wall, tokens_seen)


def _data_identity(dataset: TokenDataset) -> dict[str, int]:
    return {k: dataset.manifest[k] for k in ("num_samples", "num_tokens")}


def _finish(cfg: TrainConfig, drafter: UBTreeDrafter, dataset: TokenDataset, history: list[dict[str, float]],
            step: int, tokens_seen: int, wall: float, target_name: str, totals: dict[str, Any],
            log: Callable[[str], None]) -> Path:
    """Export, round-trip check, and the `train` record. `totals`: throughput and cumulative counts."""
    final = history[-1] if history else {}
    provenance = {
        "training": {"steps": step, "tokens_seen": tokens_seen, "wall_time_s": round(wall, 1), **totals,
                     "init_drafter": cfg.init_drafter, "final_metrics": final, "config": cfg.to_dict()},
        "data": {**manifest_summary(dataset.manifest), "answers": cfg.answers},
    }
    drafter_dir = export_drafter(drafter, cfg.drafter_dir, provenance)
    check_round_trip(drafter, drafter_dir)
    log(f"train: exported {drafter_dir} (round trip OK)")
    if cfg.records_path:
        from ubtree_vllm.bench.records import append_record

        gen = dataset.manifest["generation"]
        # T_train of the answers trained on: the greedy ones of a mixed dataset are T = 0
        t_train = 0.0 if cfg.answers == "greedy" else gen["temperature"]
        append_record({
            "kind": "train", "method": "ubtree", "target": target_name, "drafter": str(drafter_dir),
            "dataset": "+".join(gen["sources"]), "num_prompts": dataset.manifest["num_samples"],
            "max_new_tokens": gen["max_new_tokens"], "temperature": t_train,
            "batch_size": cfg.batch_size, "top_k": drafter.cfg.top_k, "block_size": drafter.cfg.block_size,
            "loss": final.get("loss"), "tokens_seen": tokens_seen, "wall_time_s": round(wall, 1), "steps": step,
            **totals,
            "notes": (f"selector_loss={cfg.selector_loss} beta={cfg.beta} loss_decay={cfg.loss_decay} "
                      f"proposer_kl={cfg.proposer_kl} detach_selector={cfg.detach_selector} "
                      f"blocks_per_seq={cfg.blocks_per_seq} init={cfg.init_drafter or 'fresh'} "
                      f"layers={drafter.cfg.num_layers}{f' (grown by {cfg.grow_layers})' if cfg.grow_layers else ''} "
                      f"stream_data={cfg.stream_data} samples={len(dataset)} "
                      f"T_train={t_train} greedy_samples={gen.get('greedy_samples', 0)} answers={cfg.answers} "
                      f"final top1={final.get('top1', float('nan')):.3f} "
                      f"topk_hit={final.get('topk_hit', float('nan')):.3f} "
                      f"chain_tau_proxy={final.get('chain_tau', float('nan')):.2f}"),
        }, path=cfg.records_path)
    return drafter_dir
