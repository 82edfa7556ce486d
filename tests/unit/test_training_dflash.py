"""The exported proposer folder runs in vLLM's built-in `dflash` method with our logits (vLLM CPU).

One vLLM engine in a fresh interpreter (in-process engine core, so the draft model can be
spied on): a tiny random Qwen3 target and a tiny random drafter, exported by
training/export.py. The first draft round's DFlash logits must equal our proposer's
logits on the same context, and the UBTree folder itself (with `selector.*`) must be
refused by vLLM's DFlash loader, which is why the proposer-only export exists.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
sys.path.insert(0, sys.argv[2])
from test_training import make_tokenizer, VOCAB
from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.io import load_drafter
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.drafter.io import export_dflash_proposer
from ubtree_vllm.training.export import export_drafter

def main():
    root = Path(sys.argv[1])
    torch.manual_seed(0)
    # head_dim 64: vLLM's CPU attention kernels do not support very small head sizes.
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    target = Qwen3ForCausalLM(cfg)
    target.save_pretrained(root / "target")
    make_tokenizer().save_pretrained(root / "target")
    drafter = UBTreeDrafter(DrafterConfig.for_target(cfg, "tiny-qwen3", num_layers=1, block_size=4, top_k=8,
                                                     selector_rank=8, mask_token_id=3))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.5)  # large random weights: distinct logits at every depth
    drafter.bind_hf_target(target)
    ubtree_dir = export_drafter(drafter, root / "drafter", {})
    dflash_dir = export_dflash_proposer(ubtree_dir, root / "dflash")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def engine(draft_dir):
        return LLM(model=str(root / "target"), max_model_len=256, dtype="float32", enforce_eager=True, seed=0,
                   gpu_memory_utilization=0.1,
                   speculative_config={"method": "dflash", "model": str(draft_dir), "num_speculative_tokens": 4})

    result = {}
    try:
        engine(ubtree_dir)
        result["ubtree_folder_error"] = None
    except Exception as exc:  # vLLM re-raises the loader's ValueError from the engine core
        result["ubtree_folder_error"] = repr(exc) + repr(getattr(exc, "__cause__", None))
    llm = engine(dflash_dir)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    proposes, logits = [], []
    orig_propose, orig_logits = runner.drafter.propose, runner.drafter.model.compute_logits

    def spy_propose(*args, **kwargs):
        names = ("num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
                 "next_token_ids")
        bound = {**dict(zip(names, args)), **kwargs}
        # target_hidden_states [P, F] (raw aux features), next_token_ids [1] (the anchor)
        proposes.append((bound["target_hidden_states"].clone(), bound["next_token_ids"].clone()))
        return orig_propose(*args, **kwargs)

    def spy_logits(hidden):
        out = orig_logits(hidden)
        logits.append(out.clone())
        return out

    runner.drafter.propose, runner.drafter.model.compute_logits = spy_propose, spy_logits
    prompt = [1, 4, 10, 11, 12, 13, 2, 1, 5]
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0, max_tokens=6))
    features, next_token = proposes[0]
    hf = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32)
    ours = load_drafter(ubtree_dir)
    ours.bind_hf_target(hf)
    ours.eval()
    states = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    hf_features = torch.cat([states[i + 1][0] for i in ours.cfg.target_layer_ids], -1)
    n = features.shape[0]
    with torch.no_grad():
        cands = ours.propose(next_token.long()[:1], torch.tensor([n]), features.float()[None], torch.arange(n)[None],
                             torch.ones(1, n, dtype=torch.bool), 1)
        our_logits = ours.proposer_logits(cands.hidden)[0]
    result.update({
        "feature_diff": (hf_features - features.float()).abs().max().item(),
        "logit_diff": (our_logits - logits[0].float()).abs().max().item(),
        "logit_scale": our_logits.abs().max().item(),
        "vllm_shape": list(logits[0].shape),
    })
    print("RESULT " + json.dumps(result))

if __name__ == "__main__":
    main()
'''


@pytest.mark.slow
def test_proposer_export_matches_vllm_dflash(tmp_path):
    pytest.importorskip("vllm")
    script = tmp_path / "dflash_parity.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=REPO, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert "no module or parameter named 'selector'" in result["ubtree_folder_error"]
    assert result["vllm_shape"] == [4, 96]  # gamma = 4 mask slots x vocab
    assert result["feature_diff"] < 1e-4  # vLLM's aux layers = HF hidden_states[i + 1]
    assert result["logit_diff"] < 1e-4 * max(1.0, result["logit_scale"])
