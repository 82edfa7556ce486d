"""Generate with UBTree speculative decoding through vLLM's offline ``LLM`` API.

    python examples/offline_generate.py --drafter DRAFTER_DIR \\
        --prompt "What is the capital of France?" --prompt "Write a haiku about the sea."

The target defaults to the converted SmolLM2-135M-Instruct folder
(``ubtree_vllm.models.default_target.default_target_path()``); chat prompts are rendered
with its chat template. ``--prompt-token-ids 1,2,3`` sends raw token ids instead (targets
without a tokenizer). The plugin is picked up by vLLM through its ``vllm.general_plugins``
entry point, in every process vLLM starts: no import of ubtree_vllm is needed here.

After generating, the script prints vLLM's spec-decode metrics: the mean acceptance
length is 1 + accepted draft tokens / verification rounds. ``--json`` prints one JSON
object instead (used by the CI test).
"""
from __future__ import annotations

import argparse
import json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="UBTree drafter folder (config.json + model.safetensors)")
    parser.add_argument("--target", default=None, help="target model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--budget", type=int, default=64, help="tree budget B = num_speculative_tokens")
    parser.add_argument("--beam-width", type=int, default=None, help="beam width W (default: min(12, B))")
    parser.add_argument("--top-k", type=int, default=None, help="candidates per depth K (default: the drafter's)")
    parser.add_argument("--prompt", action="append", default=[], help="chat prompt (repeatable)")
    parser.add_argument("--prompt-token-ids", action="append", default=[],
                        help="comma-separated token ids, sent as is (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default=None,
                        help="vLLM dtype (default: float32 on the CPU, where the default target answers badly in "
                             "bf16; the model's own dtype on a GPU)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                        help="share of device memory (on the CPU backend: of host memory) for vLLM")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="fixed KV-cache size in bytes (overrides --gpu-memory-utilization)")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs")
    parser.add_argument("--json", action="store_true", help="print one JSON object (token ids, texts, metrics)")
    args = parser.parse_args(argv)
    if not args.prompt and not args.prompt_token_ids:
        args.prompt = ["What is the capital of France?"]
    return args


def spec_decode_summary(llm) -> dict[str, float]:
    """vLLM's spec-decode counters and the mean acceptance length derived from them."""
    counters = {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
                if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                              "vllm:spec_decode_num_accepted_tokens")}
    drafts = counters.get("num_drafts", 0)
    counters["mean_acceptance_length"] = 1 + counters.get("num_accepted_tokens", 0) / drafts if drafts else 1.0
    return counters


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    target = args.target
    if target is None:
        from ubtree_vllm.models.default_target import default_target_path

        target = str(default_target_path())
    speculative_config = {"method": "ubtree", "model": args.drafter, "num_speculative_tokens": args.budget}
    if args.beam_width is not None:
        speculative_config["beam_width"] = args.beam_width
    if args.top_k is not None:
        speculative_config["top_k"] = args.top_k
    import torch

    dtype = args.dtype or ("auto" if torch.cuda.is_available() else "float32")
    llm = LLM(model=target, speculative_config=speculative_config, dtype=dtype,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, enforce_eager=args.enforce_eager,
              skip_tokenizer_init=not args.prompt, disable_log_stats=False, seed=0)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, detokenize=bool(args.prompt))
    outputs = []
    if args.prompt:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs += llm.chat(conversations, params, use_tqdm=False)
    if args.prompt_token_ids:
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids.split(",")]) for ids in args.prompt_token_ids]
        outputs += llm.generate(prompts, params, use_tqdm=False)
    summary = spec_decode_summary(llm)
    if args.json:
        print(json.dumps({"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                          "texts": [o.outputs[0].text for o in outputs], "spec_decode": summary}))
        return
    for out in outputs:
        print(f"--- {out.prompt!r}\n{out.outputs[0].text or list(out.outputs[0].token_ids)}")
    print(f"mean acceptance length {summary['mean_acceptance_length']:.2f} "
          f"({summary.get('num_accepted_tokens', 0):.0f} accepted drafts in {summary.get('num_drafts', 0):.0f} rounds)")


if __name__ == "__main__":
    main()
