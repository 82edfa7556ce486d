"""Where a training step's time goes on the GPU, and label rows/s for a few batch shapes.

The recipe's loss + backward + AdamW step on random token sequences of typical lengths (the
step's cost does not depend on the tokens), with the drafter of the run file. Prints mean
step time and label rows/s per shape (CUDA-synchronised wall time over `--steps` steps after
two warm-up steps), then torch.profiler's CUDA time per `loss.*` stage (training/losses.py)
and the top kernels for the first shape.

  python3 scripts/gpu/profile_train_step.py --config examples/train_drafter_gpu.yaml \
      --shapes 16x256,16x64,32x128 --steps 8 --records runs/records.jsonl
"""
from __future__ import annotations

import argparse
import time

import torch
import yaml

from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.training.data import resolve_target_path
from ubtree_vllm.training.losses import Batch, LossConfig, drafter_loss, make_generator
from ubtree_vllm.training.target import FrozenTarget


def random_batch(num_seqs: int, prompt_len: int, length: int, vocab: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (num_seqs,), generator=g)
    ids = torch.randint(3, vocab, (num_seqs, int(lengths.max())), generator=g)
    return Batch(ids, lengths, torch.full((num_seqs,), prompt_len))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/train_drafter_gpu.yaml")
    ap.add_argument("--shapes", default="16x256,16x64,32x128", help="SEQSxANCHORS,...")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=640, help="longest sequence (lengths drawn in [len/2, len])")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--device", default="cuda", help="cuda (bf16 autocast) or cpu (float32; a smoke run)")
    ap.add_argument("--records", default=None, help="append one train_label_rows_per_s microbench record per shape")
    ap.add_argument("--head-loss", default="fused,torch",
                    help="LM-head loss paths to time per shape: fused (the Triton kernel; CUDA) and/or torch")
    args = ap.parse_args()
    run_file = yaml.safe_load(open(args.config))
    train = run_file["train"]
    from transformers import AutoConfig

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    target_path = resolve_target_path("default")
    hf = AutoConfig.from_pretrained(target_path)
    drafter_cfg = DrafterConfig.for_target(hf, run_file.get("data", {}).get("target_name") or "default",
                                           **train.get("drafter", {}))
    target = FrozenTarget.from_pretrained(target_path, drafter_cfg.target_layer_ids, device,
                                          torch.bfloat16 if cuda else torch.float32)
    drafter = UBTreeDrafter(drafter_cfg).to(device)
    drafter.bind_hf_target(target.model)
    drafter.train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    base = dict(selector_loss=train.get("selector_loss", "kl"), beta=train.get("beta", 0.1),
                loss_decay=train.get("loss_decay", 7.0), proposer_kl=train.get("proposer_kl", 1.0),
                detach_selector=train.get("detach_selector", True),
                head_chunk_rows=train.get("head_chunk_rows", 4096))

    def step(batch: Batch, loss_cfg: LossConfig, index: int, fused: bool) -> int:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = drafter_loss(drafter, target, batch.to(device), loss_cfg, make_generator(0, index),
                               fused_head=fused)
        optimizer.zero_grad(set_to_none=True)
        with torch.profiler.record_function("backward"):
            out.loss.backward()
        with torch.profiler.record_function("optimizer"):
            optimizer.step()
        return int(out.num_tokens)

    first = None
    paths = args.head_loss.split(",")
    if not cuda:
        paths = ["torch"]
    # Process warm-up (allocator growth, cuBLAS handles, Triton compiles) before any shape is timed.
    warm_cfg = LossConfig(blocks_per_seq=8, **base)
    for path in paths:
        for i in range(2):
            step(random_batch(4, args.prompt_len, args.seq_len, drafter_cfg.vocab_size, 1000 + i), warm_cfg, i,
                 path == "fused")
    sync()
    for shape, path in ((s, p) for s in args.shapes.split(",") for p in paths):
        fused = path == "fused"
        seqs, anchors = (int(x) for x in shape.split("x"))
        loss_cfg = LossConfig(blocks_per_seq=anchors, **base)
        batches = [random_batch(seqs, args.prompt_len, args.seq_len, drafter_cfg.vocab_size, i)
                   for i in range(args.steps + 2)]
        for i in range(2):
            step(batches[i], loss_cfg, i, fused)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start, rows = time.perf_counter(), 0
        for i in range(2, args.steps + 2):
            rows += step(batches[i], loss_cfg, i, fused)
        sync()
        wall = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        if args.records:
            from ubtree_vllm.bench.records import append_record

            append_record({"kind": "microbench", "method": "ubtree", "target": drafter_cfg.target_name,
                           "batch_size": seqs, "block_size": drafter_cfg.block_size, "top_k": drafter_cfg.top_k,
                           "metric": "train_label_rows_per_s", "value": round(rows / wall, 1), "unit": "label rows/s",
                           "notes": (f"training step (loss + backward + AdamW) of the recipe, {path} LM-head loss, "
                                     f"{seqs} sequences x up to "
                                     f"{anchors} anchors, random tokens of {args.seq_len // 2}-{args.seq_len} positions, "
                                     f"{1000 * wall / args.steps:.1f} ms/step, nothing else on the device")},
                          path=args.records)
        print(f"shape {seqs} seqs x {anchors} anchors, {path} head loss: {1000 * wall / args.steps:.1f} ms/step, "
              f"{rows / args.steps:.0f} label rows/step, {rows / wall:,.0f} label rows/s, "
              f"peak {peak:.1f} GiB", flush=True)
        first = first or (batches, loss_cfg, fused)

    batches, loss_cfg, fused = first
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(2):
            step(batches[i], loss_cfg, 100 + i, fused)
        sync()
    events = prof.key_averages()
    print("\nCUDA time per stage over 2 steps (ms):")
    for e in events:
        if e.key.startswith(("loss.", "backward", "optimizer")):
            print(f"  {e.key:<24} cuda {e.device_time_total / 1000:9.1f}  cpu {e.cpu_time_total / 1000:9.1f}")
    print(events.table(sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=25,
                       max_name_column_width=60))


if __name__ == "__main__":
    main()
