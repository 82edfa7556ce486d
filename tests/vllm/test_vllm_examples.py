"""The examples run as documented (``examples/serve.sh`` is exercised by test_vllm_server.py).

``offline_generate.py`` runs in a subprocess with vLLM's default multiprocess engine, on the
hand-built copy pair: the drafter's weights copy the target, so the run must be greedy
token-identical to vLLM without speculation *and* vLLM's spec-decode metrics must report
long acceptances.
"""
from __future__ import annotations

import json
import subprocess
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from vllm_engines import ENGINE_KWARGS, REPO_ROOT, subprocess_env

PROMPTS = [[3, 7, 9], [10, 11], [5] * 17]
MAX_TOKENS = 20


def test_offline_generate_multiprocess_with_copying_drafter(copy_pair):
    target, drafter = copy_pair
    command = [sys.executable, str(REPO_ROOT / "examples" / "offline_generate.py"), "--drafter", str(drafter),
               "--target", str(target), "--budget", "8", "--beam-width", "2", "--max-tokens", str(MAX_TOKENS),
               "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
               "--kv-cache-memory-bytes", str(64 << 20), "--json"]
    for prompt in PROMPTS:
        command += ["--prompt-token-ids", ",".join(map(str, prompt))]
    proc = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))

    plain = LLM(model=str(target), **ENGINE_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    expected = [list(o.outputs[0].token_ids) for o in
                plain.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)]
    assert result["token_ids"] == expected
    # gamma = 4: every round accepts the whole copied chain, plus the bonus token.
    assert result["spec_decode"]["mean_acceptance_length"] > 3.0, result["spec_decode"]


def test_serve_script_usage_errors():
    script = str(REPO_ROOT / "examples" / "serve.sh")
    assert "--drafter" in subprocess.run(["bash", script, "--help"], capture_output=True, text=True).stdout
    missing = subprocess.run(["bash", script], capture_output=True, text=True)
    assert missing.returncode == 2 and "--drafter DRAFTER_DIR is required" in missing.stderr
