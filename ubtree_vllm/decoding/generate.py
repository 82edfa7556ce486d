"""`ubtree generate`: UBTree decoding of chat prompts with the reference (HF) decoder.

Prints each answer and its acceptance length tau (tokens committed per target forward,
bonus included). With `--check` it also decodes without speculation and reports whether
the outputs are token-identical (expected at temperature 0).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from ubtree_vllm.errors import CommandError

DEFAULT_PROMPTS = ("What is the capital of France? Answer in one sentence.",
                   "Write a short poem about the sea.")
SHIPPED_DRAFTER = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct-ubtree"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="user messages (default: two demo prompts)")
    parser.add_argument("--target", default=None, help="HF target folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=None, help=f"drafter folder (default: {SHIPPED_DRAFTER})")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sampling top-k (0 = off)")
    parser.add_argument("--tree-budget", type=int, default=64, help="B: draft nodes per round")
    parser.add_argument("--beam-width", type=int, default=12, help="W: beam width per depth")
    parser.add_argument("--candidates", type=int, default=None, help="K: proposer candidates per depth "
                        "(default: the drafter's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--check", action="store_true", help="also decode without speculation and compare")


def run_cli(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ubtree_vllm.config import SamplingConfig, UBTreeConfig
    from ubtree_vllm.decoding.reference import ReferenceDecoder
    from ubtree_vllm.drafter.io import load_drafter
    from ubtree_vllm.models.default_target import default_target_path

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_dir = Path(args.target) if args.target else default_target_path()
    drafter_dir = Path(args.drafter) if args.drafter else SHIPPED_DRAFTER
    try:
        sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
        drafter = load_drafter(drafter_dir, device=device, dtype=dtype)
        drafter.bind_hf_target(target)
        tree_cfg = UBTreeConfig(tree_budget=args.tree_budget, beam_width=args.beam_width,
                                top_k=args.candidates or drafter.cfg.top_k, block_size=drafter.cfg.block_size)
    except (ValueError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from exc

    texts = args.prompts or list(DEFAULT_PROMPTS)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for t in texts]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    print(f"target {target_dir} | drafter {drafter_dir} | device {device} | B={tree_cfg.tree_budget} "
          f"W={tree_cfg.beam_width} K={tree_cfg.top_k} gamma={tree_cfg.block_size} | {sampling}")
    start = time.perf_counter()
    outs = ReferenceDecoder(target, drafter, tree_cfg).generate(prompts, args.max_new_tokens, sampling,
                                                                seed=args.seed, eos_token_ids=eos)
    seconds = time.perf_counter() - start
    for text, out in zip(texts, outs):
        print(f"\n### {text}\n{tokenizer.decode(out.token_ids, skip_special_tokens=True)}")
        print(f"[{len(out.token_ids)} tokens, {len(out.tokens_per_round)} target forwards, "
              f"acceptance length {out.acceptance_length:.2f}]")
    rounds = sum(len(o.tokens_per_round) for o in outs)
    tau = sum(sum(o.tokens_per_round) for o in outs) / max(1, rounds)
    print(f"\nmean acceptance length {tau:.2f} over {rounds} rounds ({seconds:.1f} s, reference decoder)")
    if args.check:
        plain = ReferenceDecoder(target).generate(prompts, args.max_new_tokens, sampling, seed=args.seed,
                                                  eos_token_ids=eos)
        same = [a.token_ids == b.token_ids for a, b in zip(outs, plain)]
        print(f"without speculation: {sum(same)}/{len(same)} outputs token-identical"
              + ("" if sampling.greedy else " (T>0: equal in distribution, not per seed)"))
        if sampling.greedy and not all(same):
            return 1
    return 0
