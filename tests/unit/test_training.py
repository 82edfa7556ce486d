"""Drafter training on CPU with tiny random targets: data, objective, trainer, resume, export, errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.io import load_drafter
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.training import data as data_mod
from ubtree_vllm.training.data import DataGenConfig, TokenDataset, generate_dataset
from ubtree_vllm.training.evaluate import evaluate, load_eval_prompts, spec_bench_subset
from ubtree_vllm.drafter.io import export_dflash_proposer
from ubtree_vllm.training.export import check_round_trip, export_drafter
from ubtree_vllm.training.losses import (
    LossConfig,
    collate,
    drafter_loss,
    make_generator,
    sample_anchors,
)
from ubtree_vllm.training.run_config import apply_overrides, read_section
from ubtree_vllm.training.target import FrozenTarget
from ubtree_vllm.training.train import TrainConfig, train

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
DRAFTER = {"num_layers": 1, "block_size": 4, "top_k": 8, "selector_rank": 8, "mask_token_id": 3}


def make_tokenizer(word_prefix: str = "w") -> PreTrainedTokenizerFast:
    """Word-level tokenizer with a chat template; ids 0-3 are <unk>, <|im_start|>, <|im_end|> (EOS), <mask>."""
    words = ["<unk>", "<|im_start|>", "<|im_end|>", "<mask>", "user", "assistant", "system"]
    words += [f"{word_prefix}{i}" for i in range(VOCAB - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_target(path: Path, vocab: int = VOCAB, word_prefix: str = "w") -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    make_tokenizer(word_prefix).save_pretrained(path)
    return path


def write_prompt_files(root: Path, count: int = 30) -> Path:
    rng = torch.Generator().manual_seed(1)
    root.mkdir(parents=True, exist_ok=True)
    for name, key in data_mod.PROMPT_SOURCES.values():
        with open(root / name, "w") as handle:
            for _ in range(count):
                words = torch.randint(0, 80, (int(torch.randint(3, 10, (1,), generator=rng)),), generator=rng)
                handle.write(json.dumps({key: " ".join(f"w{int(w)}" for w in words)}) + "\n")
    return root


def count_up(prompts, seed, temperatures=()):
    """A learnable stand-in for the target's answers: count up from the last prompt token."""
    return [[7 + (p[-1] + k) % (VOCAB - 7) for k in range(1, 25)] + [2] for p in prompts]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("training")
    target = make_target(root / "target")
    prompts = write_prompt_files(root / "prompts")
    cfg = DataGenConfig(target=str(target), out_dir=str(root / "data"), data_root=str(prompts), num_prompts=24,
                        shard_size=12, max_new_tokens=24)
    generate_dataset(cfg, generator=count_up, log=lambda _: None)
    return {"root": root, "target": target, "prompts": prompts, "data": root / "data"}


def train_config(ws: dict[str, Path], out: Path, **changes) -> TrainConfig:
    values = {"target": str(ws["target"]), "data_dir": str(ws["data"]), "output_dir": str(out),
              "drafter": dict(DRAFTER), "blocks_per_seq": 6, "batch_size": 4, "max_seq_len": 64, "max_steps": 6,
              "lr": 1e-2, "warmup_steps": 2, "log_every": 1, "checkpoint_every": 100, "progress": False,
              "records_path": None}
    values.update(changes)
    return TrainConfig(**values)


# ---- data ------------------------------------------------------------------------------
def test_training_prompt_sources_exclude_benchmarks():
    files = {name for name, _ in data_mod.PROMPT_SOURCES.values()}
    assert files == {"sharegpt_first_human_turns.jsonl", "gsm8k_train.jsonl"}
    assert not files & data_mod.BENCHMARK_FILES


def test_gen_data_hf_backend_writes_resumable_shards(tmp_path, workspace):
    cfg = DataGenConfig(target=str(workspace["target"]), out_dir=str(tmp_path / "d"),
                        data_root=str(workspace["prompts"]), num_prompts=5, shard_size=3, max_new_tokens=6,
                        batch_size=4, backend="hf", temperature=1.0)
    manifest = generate_dataset(cfg, log=lambda _: None)
    assert manifest["complete"] and [s["file"] for s in manifest["shards"]] == ["shard-00000.safetensors",
                                                                                "shard-00001.safetensors"]
    assert manifest["target"]["tokenizer_vocab_size"] == VOCAB and manifest["target"]["eos_token_ids"] == [2]
    ds = TokenDataset.load(tmp_path / "d")
    tok = AutoTokenizer.from_pretrained(workspace["target"])
    expected = data_mod.select_prompts(*[data_mod.load_prompt_texts(workspace["prompts"], cfg.sources)[0]], tok, 5,
                                       cfg.max_prompt_tokens, cfg.seed)
    for i in range(len(ds)):
        ids, prompt_len = ds.sample(i)
        assert ids[:prompt_len].tolist() == expected[i]
        response = ids[prompt_len:].tolist()
        assert 1 <= len(response) <= 6 and 2 not in response[:-1]  # truncated at the first EOS
    # A finished dataset is not regenerated; other settings in the same folder are refused.
    generate_dataset(cfg, generator=lambda *a: pytest.fail("regenerated a finished shard"), log=lambda _: None)
    with pytest.raises(ValueError, match="temperature"):
        generate_dataset(DataGenConfig(**{**cfg.__dict__, "temperature": 0.0}), log=lambda _: None)


def test_gen_data_refuses_lengths_beyond_the_target_positions(tmp_path, workspace):
    cfg = DataGenConfig(target=str(workspace["target"]), out_dir=str(tmp_path / "d"),
                        data_root=str(workspace["prompts"]), max_prompt_tokens=2000, max_new_tokens=100)
    with pytest.raises(ValueError, match="max_position_embeddings 2048"):
        generate_dataset(cfg, generator=count_up, log=lambda _: None)


def test_gen_data_resumes_after_an_interrupted_shard(tmp_path, workspace):
    cfg = DataGenConfig(target=str(workspace["target"]), out_dir=str(tmp_path / "d"),
                        data_root=str(workspace["prompts"]), num_prompts=6, shard_size=2, max_new_tokens=4)
    calls = []

    def flaky(prompts, seed, temperatures):
        calls.append(seed)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return count_up(prompts, seed)

    with pytest.raises(KeyboardInterrupt):
        generate_dataset(cfg, generator=flaky, log=lambda _: None)
    assert not json.loads((tmp_path / "d" / "manifest.json").read_text())["complete"]
    calls.clear()
    manifest = generate_dataset(cfg, generator=count_up_recorder(calls), log=lambda _: None)
    assert manifest["complete"] and manifest["num_samples"] == 6 and len(calls) == 2  # shards 1 and 2 only


def test_gen_data_greedy_samples_answer_first_samples_at_t0(tmp_path, workspace):
    cfg = DataGenConfig(target=str(workspace["target"]), out_dir=str(tmp_path / "d"),
                        data_root=str(workspace["prompts"]), num_prompts=4, shard_size=2, max_new_tokens=4,
                        samples_per_prompt=3, greedy_samples=1, temperature=0.7)
    seen = []

    def recorder(prompts, seed, temperatures):
        seen.append(list(temperatures))
        return count_up(prompts, seed)

    manifest = generate_dataset(cfg, generator=recorder, log=lambda _: None)
    assert seen == [[0.0, 0.7, 0.7] * 2] * 2 and manifest["generation"]["greedy_samples"] == 1
    with pytest.raises(ValueError, match="greedy_samples"):
        generate_dataset(DataGenConfig(**{**cfg.__dict__, "greedy_samples": 0}), generator=recorder,
                         log=lambda _: None)
    with pytest.raises(ValueError, match=r"greedy_samples must be in \[0, samples_per_prompt = 3\]"):
        DataGenConfig(samples_per_prompt=3, greedy_samples=4)


def test_answers_selects_the_greedy_or_the_sampled_answers_of_a_mixed_dataset(tmp_path, workspace):
    cfg = DataGenConfig(target=str(workspace["target"]), out_dir=str(tmp_path / "d"),
                        data_root=str(workspace["prompts"]), num_prompts=6, shard_size=2, max_new_tokens=6,
                        samples_per_prompt=3, greedy_samples=1, temperature=1.0)

    def marked(prompts, seed, temperatures):  # a greedy answer is token 3 repeated, a sampled one token 4
        return [[3 if t == 0.0 else 4] * 5 + [2] for t in temperatures]

    generate_dataset(cfg, generator=marked, log=lambda _: None)
    for answers, token, count in (("all", None, 18), ("greedy", 3, 6), ("sampled", 4, 12)):
        ds = TokenDataset.load(tmp_path / "d", answers=answers)
        assert len(ds) == count
        firsts = {int(ds.sample(i)[0][ds.sample(i)[1]]) for i in range(len(ds))}
        assert firsts == ({3, 4} if token is None else {token})
        streamed = TokenDataset.load(tmp_path / "d", shard_files=[], answers=answers)  # ShardStream's path
        for shard in ds.manifest["shards"]:
            streamed.append_shard(shard["file"])
        assert torch.equal(streamed.input_ids, ds.input_ids) and torch.equal(streamed.offsets, ds.offsets)
    greedy_only = DataGenConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "g"), "temperature": 0.0,
                                   "samples_per_prompt": 1, "greedy_samples": 0})
    generate_dataset(greedy_only, generator=marked, log=lambda _: None)
    assert len(TokenDataset.load(tmp_path / "g", answers="greedy")) == 6
    with pytest.raises(ValueError, match="answers='sampled': the dataset has no such answers"):
        TokenDataset.load(tmp_path / "g", answers="sampled")
    with pytest.raises(ValueError, match=r"answers must be one of \('all', 'greedy', 'sampled'\)"):
        TrainConfig(answers="hot")


def test_a_run_on_the_greedy_answers_records_t_train_0(tmp_path, workspace):
    cfg = DataGenConfig(target=str(workspace["target"]), out_dir=str(tmp_path / "d"),
                        data_root=str(workspace["prompts"]), num_prompts=8, shard_size=4, max_new_tokens=24,
                        samples_per_prompt=2, greedy_samples=1, temperature=1.0)
    generate_dataset(cfg, generator=count_up, log=lambda _: None)
    records = tmp_path / "records.jsonl"
    train(train_config(workspace, tmp_path / "run", data_dir=str(tmp_path / "d"), answers="greedy", max_steps=2,
                       records_path=str(records)), log=lambda _: None)
    record = json.loads(records.read_text().splitlines()[-1])
    assert record["temperature"] == 0.0 and "answers=greedy" in record["notes"] and "samples=8" in record["notes"]


class FakeEngine:
    """vLLM's LLMEngine calls as engine_stream uses them; finishes a random subset of requests per step."""

    def __init__(self, seed: int = 0) -> None:
        self.requests: dict[str, list[int]] = {}
        self.rng = torch.Generator().manual_seed(seed)
        self.most_in_flight = 0

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = list(prompt["prompt_token_ids"])
        self.most_in_flight = max(self.most_in_flight, len(self.requests))

    def get_num_unfinished_requests(self):
        return len(self.requests)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        from types import SimpleNamespace

        outs = []
        for rid in list(self.requests):
            if float(torch.rand(1, generator=self.rng)) < 0.4:
                tokens = count_up([self.requests.pop(rid)], 0)[0]
                completion = SimpleNamespace(token_ids=tokens[:-1], stop_reason=2, finish_reason="stop")
                outs.append(SimpleNamespace(request_id=rid, finished=True, outputs=[completion]))
        return outs


def test_gen_data_engine_stream_keeps_shards_in_flight_and_completes_each(tmp_path, workspace, monkeypatch):
    cfg = DataGenConfig(target=str(workspace["target"]), out_dir=str(tmp_path / "d"),
                        data_root=str(workspace["prompts"]), num_prompts=10, shard_size=3, max_new_tokens=30,
                        samples_per_prompt=2, inflight_samples=7)
    engine = FakeEngine()
    manifest = generate_dataset(cfg, stream=data_mod.engine_stream(engine, cfg, [2]), log=lambda _: None)
    assert manifest["complete"] and len(manifest["shards"]) == 4 and manifest["num_samples"] == 20
    assert 7 <= engine.most_in_flight < 7 + 6  # several shards at once, never a shard more than the cap
    ds = TokenDataset.load(tmp_path / "d")
    for i in range(len(ds)):  # every answer is its own prompt's (the stop token put back), in prompt order
        ids, prompt_len = ds.sample(i)
        assert ids[prompt_len:].tolist() == count_up([ids[:prompt_len].tolist()], 0)[0]
    # the time budget stops pulling shards; the ones in flight still finish and are written
    cfg2 = DataGenConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "e"), "max_minutes": 1.0})
    clock = iter(range(0, 10**6, 40))  # every clock read 40 s later: the second shard's pull is past the minute
    monkeypatch.setattr(data_mod.time, "monotonic", lambda: float(next(clock)))
    manifest = generate_dataset(cfg2, stream=data_mod.engine_stream(FakeEngine(1), cfg2, [2]), log=lambda _: None)
    assert not manifest["complete"] and [s["file"] for s in manifest["shards"]] == ["shard-00000.safetensors"]
    with pytest.raises(ValueError, match="inflight_samples must be >= 1"):
        DataGenConfig(inflight_samples=0)


def test_gen_data_vllm_engine_takes_a_fixed_kv_cache_when_given(monkeypatch, tmp_path):
    """kv_cache_memory_bytes reaches vLLM's LLM (several gen-data engines can then start at once); unset, vLLM
    profiles; not part of the dataset's identity."""
    import vllm

    seen = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: seen.append(kwargs))
    fixed = DataGenConfig(backend="vllm", kv_cache_memory_bytes=8 << 30, gpu_memory_utilization=0.1)
    data_mod._vllm_engine(tmp_path, fixed)
    data_mod._vllm_engine(tmp_path, DataGenConfig(backend="vllm"))
    assert seen[0]["kv_cache_memory_bytes"] == 8 << 30 and seen[0]["gpu_memory_utilization"] == 0.1
    assert "kv_cache_memory_bytes" not in seen[1]
    assert fixed.identity() == DataGenConfig(backend="vllm").identity()
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be >= 1 or null, got 0"):
        DataGenConfig(kv_cache_memory_bytes=0)


def test_gen_data_hf_backend_mixes_greedy_and_sampled_answers(tmp_path, workspace):
    cfg = DataGenConfig(target=str(workspace["target"]), out_dir=str(tmp_path / "d"),
                        data_root=str(workspace["prompts"]), num_prompts=3, shard_size=3, max_new_tokens=5,
                        batch_size=4, backend="hf", temperature=1.0, samples_per_prompt=2, greedy_samples=1)
    generate_dataset(cfg, log=lambda _: None)
    mixed = TokenDataset.load(tmp_path / "d")
    greedy_cfg = DataGenConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "g"), "temperature": 0.0,
                                  "samples_per_prompt": 1, "greedy_samples": 0})
    generate_dataset(greedy_cfg, log=lambda _: None)
    greedy = TokenDataset.load(tmp_path / "g")
    assert len(mixed) == 2 * len(greedy) == 6
    for i in range(len(greedy)):  # sample 2i is prompt i's greedy answer, 2i + 1 its sampled one
        assert torch.equal(mixed.sample(2 * i)[0], greedy.sample(i)[0])
        assert mixed.sample(2 * i + 1)[1] == greedy.sample(i)[1]


def count_up_recorder(calls):
    def gen(prompts, seed, temperatures):
        calls.append(seed)
        return count_up(prompts, seed)
    return gen


# ---- objective -------------------------------------------------------------------------
def test_anchors_are_distinct_and_inside_the_response():
    lengths, prompt_lens = torch.tensor([20, 9, 5]), torch.tensor([5, 8, 5])
    pos, valid = sample_anchors(lengths, prompt_lens, 20, 6, torch.Generator().manual_seed(0))
    assert valid.sum(1).tolist() == [6, 0, 0]  # rows 2 and 3 have no response position with a label
    row = pos[0][valid[0]]
    assert len(set(row.tolist())) == 6 and row.min() >= 5 and row.max() <= 18
    pos, valid = sample_anchors(torch.tensor([12]), torch.tensor([4]), 12, 20, torch.Generator().manual_seed(0))
    assert pos[0][valid[0]].tolist() == list(range(4, 11))  # all of 4..len-2, ascending


def test_candidate_logits_equal_full_lm_head_logits(workspace):
    model = LlamaForCausalLM.from_pretrained(workspace["target"])
    target = FrozenTarget(model, layer_ids=(0, 2))
    ids = torch.randint(0, VOCAB, (2, 7))
    features, final = target.forward(ids, torch.ones_like(ids, dtype=torch.bool))
    full = model(input_ids=ids, output_hidden_states=True)
    assert torch.equal(features, torch.cat([full.hidden_states[1], full.hidden_states[3]], -1))
    cand = torch.randint(0, VOCAB, (14, 5))
    got = target.candidate_logits(final.flatten(0, 1), cand)
    torch.testing.assert_close(got, full.logits.flatten(0, 1).gather(1, cand), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("selector_loss,loss_decay", [("kl", None), ("hard_ce", 7.0)])
def test_loss_is_finite_and_reaches_every_trainable_parameter(workspace, selector_loss, loss_decay):
    model = LlamaForCausalLM.from_pretrained(workspace["target"])
    cfg = DrafterConfig.for_target(model.config, "tiny", **DRAFTER)
    drafter = UBTreeDrafter(cfg)
    target = FrozenTarget(model, cfg.target_layer_ids)
    drafter.bind_hf_target(model)
    ds = TokenDataset.load(workspace["data"])
    batch = collate([ds.sample(i) for i in range(3)], 64)
    out = drafter_loss(drafter, target, batch, LossConfig(selector_loss, 0.1, loss_decay, 4), make_generator(0, 0))
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.num_tokens > 0
    assert all(p.grad is not None for p in drafter.parameters())
    assert 0 <= out.metrics["topk_hit"] <= 1 and out.top1_by_depth.shape == (cfg.block_size,)


# ---- trainer ---------------------------------------------------------------------------
def test_a_few_steps_reduce_the_loss(tmp_path, workspace):
    # norm_init_scale 1: the tiny random target's embeddings are small (std 0.02), so its logits are flat
    # already; the 0.1 default (for real targets, whose logits through the target's norm are peaked) would
    # leave the toy drafter too little logit range to fit the pattern within 40 steps.
    result = train(train_config(workspace, tmp_path / "run", max_steps=40, lr=3e-2, warmup_steps=4,
                                norm_init_scale=1.0), log=lambda _: None)
    assert result.status == "finished" and result.step == 40

    def mean(key, window):
        return sum(h[key] for h in window) / len(window)

    first, last = result.history[:5], result.history[-5:]
    # The tiny random target's tied LM head is small, so logits stay flat and the loss moves
    # slowly, while the count-up pattern is learnt: top-1 accuracy rises from chance.
    assert mean("loss", last) < 0.95 * mean("loss", first)
    assert mean("ce", last) < mean("ce", first) - 0.3
    assert mean("top1", last) > 0.3 > mean("top1", first)
    assert (tmp_path / "run" / "loss_curve.png").stat().st_size > 0
    assert (result.drafter_dir / "config.json").is_file() and (result.drafter_dir / "ubtree_meta.json").is_file()


def test_resume_gives_the_same_next_losses(tmp_path, workspace):
    full = train(train_config(workspace, tmp_path / "full"), log=lambda _: None)
    first = train(train_config(workspace, tmp_path / "sliced"), stop_at_step=3, log=lambda _: None)
    assert first.status == "paused" and first.step == 3 and first.drafter_dir is None
    second = train(train_config(workspace, tmp_path / "sliced"), log=lambda _: None)
    assert second.status == "finished" and second.step == 6
    assert [h["step"] for h in second.history] == list(range(1, 7))  # no step lost or repeated
    assert [h["loss"] for h in second.history] == [h["loss"] for h in full.history]
    a = load_file(str(full.drafter_dir / "model.safetensors"))
    b = load_file(str(second.drafter_dir / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_length_pools_regroup_each_window_by_length_and_resume_in_order():
    """LengthPools: each pool is one draw of N batches' samples, cut into length-sorted batches in a seeded order;
    its state continues the same batches; one batch per pool is the data order itself."""
    from ubtree_vllm.training.batching import LengthPools

    lengths = [(7 * i) % 23 + 1 for i in range(40)]
    order = iter(range(40))

    def draw(count):
        return [next(order) for _ in range(count)]

    pools = LengthPools(lambda i: lengths[i], batch_size=4, batches_per_pool=3, seed=5)
    batches = [pools.next_batch(draw) for _ in range(5)]  # one pool and two batches of the next
    first = sorted(range(12), key=lambda i: (lengths[i], i))
    assert sorted(batches[:3]) == sorted(first[k:k + 4] for k in range(0, 12, 4))  # the window, regrouped
    assert set(sum(batches[3:5], [])) <= set(range(12, 24))  # the next window, nothing else
    state = pools.state_dict()
    rest = [pools.next_batch(draw) for _ in range(3)]
    order = iter(range(24, 40))
    resumed = LengthPools(lambda i: lengths[i], batch_size=4, batches_per_pool=3, seed=5)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(draw) for _ in range(3)] == rest
    order = iter(range(40))
    single = LengthPools(lambda i: lengths[i], batch_size=4, batches_per_pool=1, seed=5)
    assert [sorted(single.next_batch(draw)) for _ in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_length_pooled_training_sees_the_same_samples_and_resumes_exactly(tmp_path, workspace):
    """length_pool_batches = 2: after two pools the samples trained on are the unpooled run's; a run paused mid-pool
    (step 3) and resumed gives the same losses and drafter as one without the pause."""
    from ubtree_vllm.training import checkpoint as ckpt

    train(train_config(workspace, tmp_path / "plain", max_steps=4), log=lambda _: None)
    train(train_config(workspace, tmp_path / "pooled", max_steps=4, length_pool_batches=2), log=lambda _: None)
    seen = [ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / run)[-1])["seen"] for run in ("plain", "pooled")]
    assert seen[0] == seen[1] and len(seen[0]) == 16
    full = train(train_config(workspace, tmp_path / "full", length_pool_batches=2), log=lambda _: None)
    train(train_config(workspace, tmp_path / "sliced", length_pool_batches=2), stop_at_step=3, log=lambda _: None)
    second = train(train_config(workspace, tmp_path / "sliced", length_pool_batches=2), log=lambda _: None)
    assert [h["loss"] for h in second.history] == [h["loss"] for h in full.history]
    a = load_file(str(full.drafter_dir / "model.safetensors"))
    b = load_file(str(second.drafter_dir / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="length_pool_batches must be >= 1, got 0"):
        train_config(workspace, tmp_path / "bad", length_pool_batches=0)


def test_resume_refuses_changed_settings(tmp_path, workspace):
    train(train_config(workspace, tmp_path / "run"), stop_at_step=1, log=lambda _: None)
    with pytest.raises(ValueError, match=r"\['lr'\]"):
        train(train_config(workspace, tmp_path / "run", lr=1e-3), log=lambda _: None)


def test_joint_ablation_sends_the_selector_loss_into_the_proposer(workspace):
    """detach_selector=True (the recipe): the selector's loss leaves the proposer alone; False: it reaches it."""
    model = LlamaForCausalLM.from_pretrained(workspace["target"])
    cfg = DrafterConfig.for_target(model.config, "tiny", **DRAFTER)
    target = FrozenTarget(model, cfg.target_layer_ids)
    batch = collate([TokenDataset.load(workspace["data"]).sample(i) for i in range(3)], 64)
    grads = {}
    for detach in (True, False):
        torch.manual_seed(0)
        drafter = UBTreeDrafter(cfg)
        drafter.bind_hf_target(model)
        loss_cfg = LossConfig("kl", beta=0.0, loss_decay=7.0, blocks_per_seq=4, proposer_kl=0.0,
                              detach_selector=detach)
        drafter_loss(drafter, target, batch, loss_cfg, make_generator(0, 0)).loss.backward()
        grads[detach] = drafter.backbone.fc.weight.grad
        assert drafter.selector.pair_weight.grad.abs().sum() > 0
    assert grads[True] is None or grads[True].abs().sum() == 0
    assert grads[False].abs().sum() > 0


def test_fresh_drafter_starts_from_standardised_features_and_the_target_norm(tmp_path, workspace):
    result = train(train_config(workspace, tmp_path / "run", max_steps=1), log=lambda _: None)
    state = torch.load(result.checkpoint, weights_only=False)
    model = LlamaForCausalLM.from_pretrained(workspace["target"])
    target = FrozenTarget(model, DrafterConfig.for_target(model.config, "tiny", **DRAFTER).target_layer_ids)
    ds = TokenDataset.load(workspace["data"])
    batch = collate([ds.sample(i) for i in range(16)], 64)  # feature_stats_batches * batch_size samples
    valid = torch.arange(batch.input_ids.shape[1])[None] < batch.lengths[:, None]
    sums, count = target.feature_square_sums(batch.input_ids, valid)
    torch.testing.assert_close(state["feature_scale"], 1 / (sums / count).sqrt().float())
    fresh = train(train_config(workspace, tmp_path / "fresh", max_steps=1, lr=1e-9, warmup_steps=1000),
                  log=lambda _: None)
    norm = torch.load(fresh.checkpoint, weights_only=False)["model"]["backbone.norm.weight"]
    torch.testing.assert_close(norm, 0.1 * model.model.norm.weight.detach(), atol=1e-6, rtol=0)  # the default
    scaled = train(train_config(workspace, tmp_path / "scaled", max_steps=1, lr=1e-9, warmup_steps=1000,
                                norm_init_scale=0.25), log=lambda _: None)
    norm = torch.load(scaled.checkpoint, weights_only=False)["model"]["backbone.norm.weight"]
    torch.testing.assert_close(norm, 0.25 * model.model.norm.weight.detach(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="norm_init_scale"):
        train_config(workspace, tmp_path / "bad", norm_init_scale=0.0)


def test_a_slice_continues_an_exported_drafter_and_adds_to_its_totals(tmp_path, workspace):
    first = train(train_config(workspace, tmp_path / "a", max_steps=3, records_path=str(tmp_path / "r.jsonl")),
                  log=lambda _: None)
    meta = json.loads((first.drafter_dir / "ubtree_meta.json").read_text())["training"]
    assert meta["cumulative_label_rows"] == first.tokens_seen and meta["distinct_tokens"] > 0
    # Resuming from the exported drafter keeps its function (fc unfolds the fresh feature scale).
    second = train(train_config(workspace, tmp_path / "b", max_steps=2, lr=1e-9, warmup_steps=1000, seed=5,
                                init_drafter=str(first.drafter_dir), records_path=str(tmp_path / "r.jsonl")),
                   log=lambda _: None)
    a = load_file(str(first.drafter_dir / "model.safetensors"))
    b = load_file(str(second.drafter_dir / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k].float(), a[k].float(), rtol=2e-2, atol=1e-3)
    rec = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert rec[1]["cumulative_label_rows"] == first.tokens_seen + second.tokens_seen
    assert rec[1]["cumulative_distinct_tokens"] == rec[0]["distinct_tokens"] + rec[1]["distinct_tokens"]
    assert rec[1]["label_rows_per_s"] > 0


def test_a_grown_drafter_starts_as_the_same_function_and_trains_its_new_layer(tmp_path, workspace):
    from ubtree_vllm.training.grow import grow_layers

    first = train(train_config(workspace, tmp_path / "a", max_steps=3), log=lambda _: None)
    small = load_drafter(first.drafter_dir)
    grown = grow_layers(small, 2)
    assert grown.cfg.num_layers == 3 and small.cfg.num_layers == 1
    gen = torch.Generator().manual_seed(0)
    n, nb, s, length, h = 2, 3, DRAFTER["block_size"] + 1, 10, small.cfg.hidden_size
    args = (torch.randn(n, nb, s, h, generator=gen), torch.arange(s).expand(n, nb, s) + 12,
            torch.randn(n, length, small.cfg.num_features, generator=gen), torch.arange(length).expand(n, length),
            torch.ones(n, length, dtype=torch.bool))
    with torch.no_grad():
        torch.testing.assert_close(grown.backbone(*args), small.backbone(*args), rtol=0, atol=0)
    # Through the trainer: the override names the grown depth; the new layer leaves the identity.
    second = train(train_config(workspace, tmp_path / "b", max_steps=3, init_drafter=str(first.drafter_dir),
                                grow_layers=1, drafter={**DRAFTER, "num_layers": 2}), log=lambda _: None)
    out = load_drafter(second.drafter_dir)
    assert out.cfg.num_layers == 2
    assert out.backbone.layers[1].self_attn.o_proj.weight.abs().max() > 0
    with pytest.raises(ValueError, match="grow_layers 1"):
        train(train_config(workspace, tmp_path / "c", init_drafter=str(first.drafter_dir), grow_layers=1),
              log=lambda _: None)
    with pytest.raises(ValueError, match="grow_layers must be >= 0 and needs init_drafter"):
        train_config(workspace, tmp_path / "d", grow_layers=1)


@pytest.mark.parametrize("setting,value,match", [
    ("drafter", {"num_layers": 3}, "drafter.num_layers"), ("drafter", {"top_k": 4}, "drafter.top_k"),
    ("target_name", "other", "target")])
def test_init_drafter_with_another_config_fails_at_start(tmp_path, workspace, setting, value, match):
    first = train(train_config(workspace, tmp_path / "a", max_steps=1), log=lambda _: None)
    changes = {setting: {**DRAFTER, **value} if setting == "drafter" else value}
    with pytest.raises(ValueError, match=match):
        train(train_config(workspace, tmp_path / "b", init_drafter=str(first.drafter_dir), **changes),
              log=lambda _: None)


def test_streamed_training_picks_up_shards_as_they_land(tmp_path, workspace):
    """The trainer trains on an unfinished dataset, unseen samples first, and takes new shards in."""
    from ubtree_vllm.training.data import ShardStream

    cfg = DataGenConfig(target=str(workspace["target"]), out_dir=str(tmp_path / "d"),
                        data_root=str(workspace["prompts"]), num_prompts=12, shard_size=4, max_new_tokens=24,
                        samples_per_prompt=2)
    calls = []

    def interrupted_after_one_shard(prompts, seed, temperatures):
        calls.append(len(prompts))
        if len(calls) > 1:
            raise InterruptedError
        return count_up(prompts, seed)

    with pytest.raises(InterruptedError):
        generate_dataset(cfg, generator=interrupted_after_one_shard, log=lambda _: None)
    assert calls == [8, 8]  # 4 prompts x 2 samples per shard; the second shard never landed
    dataset = TokenDataset.load(tmp_path / "d", shard_files=[])
    stream = ShardStream(dataset, seed=0)
    assert stream.refresh() == 8 and stream.refresh() == 0
    assert sorted(stream.take(8)) == list(range(8))  # every fresh sample once before any replay
    generate_dataset(cfg, generator=count_up, log=lambda _: None)  # the rest lands
    assert stream.refresh() == 16 and sorted(stream.take(16)) == list(range(8, 24))
    assert len(dataset) == 24 and set(stream.take(30)) <= set(range(24))

    result = train(train_config(workspace, tmp_path / "run", data_dir=str(tmp_path / "d"), stream_data=True,
                                max_steps=4, records_path=str(tmp_path / "r.jsonl")), log=lambda _: None)
    assert result.status == "finished" and result.step == 4
    rec = json.loads((tmp_path / "r.jsonl").read_text())
    assert rec["distinct_tokens"] > 0 and "stream_data=True" in rec["notes"]


def test_schedule_by_time_finishes_at_the_budget(tmp_path, workspace):
    with pytest.raises(ValueError, match="max_minutes"):
        train_config(workspace, tmp_path / "x", schedule_by_time=True)
    result = train(train_config(workspace, tmp_path / "run", schedule_by_time=True, max_minutes=1e-4,
                                max_steps=10_000), log=lambda _: None)
    assert result.status == "finished" and result.drafter_dir is not None and result.step < 10_000


# ---- export ----------------------------------------------------------------------------
def test_export_round_trips_with_identical_logits(tmp_path, workspace):
    model = LlamaForCausalLM.from_pretrained(workspace["target"])
    drafter = UBTreeDrafter(DrafterConfig.for_target(model.config, "tiny", **DRAFTER))
    drafter.bind_hf_target(model)
    out = export_drafter(drafter, tmp_path / "drafter", {"note": "test"})
    # Proposer logits and selector edge log-probs after reload equal the bf16-rounded original's.
    compared = check_round_trip(drafter, out)
    assert set(compared) == {"proposer_logits", "root_edge_logp", "edge_logp"}
    assert load_drafter(out).cfg == drafter.cfg
    assert json.loads((out / "ubtree_meta.json").read_text())["note"] == "test"
    # A corrupted weight file fails the check.
    tensors = load_file(str(out / "model.safetensors"))
    tensors["selector.pair_weight"] = tensors["selector.pair_weight"] * 2
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(AssertionError, match="edge_logp"):
        check_round_trip(drafter, out)


def test_dflash_proposer_export_has_no_selector(tmp_path, workspace):
    model = LlamaForCausalLM.from_pretrained(workspace["target"])
    drafter = UBTreeDrafter(DrafterConfig.for_target(model.config, "tiny", **DRAFTER))
    drafter.bind_hf_target(model)
    src = export_drafter(drafter, tmp_path / "drafter", {})
    dst = export_dflash_proposer(src, tmp_path / "dflash")
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "ubtree" not in cfg
    assert cfg["dflash_config"] == {"target_layer_ids": list(drafter.cfg.target_layer_ids), "mask_token_id": 3}
    names = set(load_file(str(dst / "model.safetensors")))
    assert names and not any(n.startswith("selector.") for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= names


# ---- bad input -------------------------------------------------------------------------
@pytest.mark.parametrize("drafter,match", [
    ({"target_layer_ids": [0, 7]}, "target_layer_ids"),
    ({"block_size": 1}, "block_size"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"num_layerz": 2}, "num_layerz"),
])
def test_bad_drafter_settings_fail_at_start(tmp_path, workspace, drafter, match):
    with pytest.raises(ValueError, match=match):
        train(train_config(workspace, tmp_path / "run", drafter={**DRAFTER, **drafter}), log=lambda _: None)


def test_dataset_of_another_tokenizer_or_vocab_fails_at_start(tmp_path, workspace):
    other = make_target(tmp_path / "other", word_prefix="v")
    with pytest.raises(ValueError, match="tokenizer"):
        train(train_config(workspace, tmp_path / "run", target=str(other)), log=lambda _: None)
    bigger = make_target(tmp_path / "bigger", vocab=VOCAB + 32)
    with pytest.raises(ValueError, match="vocab_size"):
        train(train_config(workspace, tmp_path / "run2", target=str(bigger)), log=lambda _: None)


def test_unknown_train_setting_is_an_error():
    with pytest.raises(ValueError, match="unknown train setting.*'lr_max'"):
        TrainConfig.from_dict({"lr_max": 1.0})
    with pytest.raises(ValueError, match="selector_loss"):
        TrainConfig(selector_loss="mse")


def test_example_run_files_parse(tmp_path):
    for name in ("train_drafter.yaml", "train_drafter_gpu.yaml"):
        path = REPO / "examples" / name
        DataGenConfig.from_dict(read_section(path, "data"))
        TrainConfig.from_dict(read_section(path, "train"))
    values = apply_overrides({"drafter": {"num_layers": 2}}, ["drafter.top_k=16", "beta=0", "loss_decay=null"])
    assert values == {"drafter": {"num_layers": 2, "top_k": 16}, "beta": 0, "loss_decay": None}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"trian": {}}))
    with pytest.raises(ValueError, match="trian"):
        read_section(bad, "train")


def test_gen_data_and_train_cli_exit_status(tmp_path, workspace, capsys):
    from ubtree_vllm import cli

    out = tmp_path / "d"
    common = ["--target", str(workspace["target"]), "--out", str(out), "--data-root", str(workspace["prompts"]),
              "--max-new-tokens", "3", "--set", "shard_size=1", "--set", "max_prompt_tokens=64"]
    assert cli.main(["gen-data", *common, "--num-prompts", "2", "--max-minutes", "0"]) == 3  # budget: no shard
    assert cli.main(["gen-data", *common, "--num-prompts", "2"]) == 0
    assert "2 samples" in capsys.readouterr().out
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"data": {"target": str(workspace["target"]), "out_dir": str(out)},
                                   "train": {"output_dir": str(tmp_path / "t"), "drafter": DRAFTER, "max_steps": 2,
                                             "blocks_per_seq": 2, "batch_size": 2, "records_path": None,
                                             "progress": False}}))
    assert cli.main(["train", "--config", str(run), "--max-minutes", "0"]) == 3  # paused before step 1
    assert cli.main(["train", "--config", str(run)]) == 0
    assert (tmp_path / "t" / "drafter" / "model.safetensors").is_file()


def test_incomplete_dataset_is_refused(tmp_path, workspace):
    cfg = DataGenConfig(target=str(workspace["target"]), out_dir=str(tmp_path / "d"),
                        data_root=str(workspace["prompts"]), num_prompts=4, shard_size=2, max_new_tokens=4)
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(cfg, generator=lambda p, s, t: (_ for _ in ()).throw(KeyboardInterrupt) if s else
                         count_up(p, s), log=lambda _: None)
    with pytest.raises(ValueError, match="incomplete"):
        train(train_config(workspace, tmp_path / "run", data_dir=str(tmp_path / "d")), log=lambda _: None)


def test_cli_registers_training_commands():
    from ubtree_vllm import cli

    assert {"gen-data", "train", "eval-tau", "report"} <= set(cli.COMMANDS)
    args = cli.build_parser().parse_args(["train", "--config", "x.yaml", "--set", "beta=0"])
    assert args.overrides == ["beta=0"]


# ---- evaluation ------------------------------------------------------------------------
def test_eval_prompt_sets(shared_data_dir):
    assert len(load_eval_prompts("spec_bench", shared_data_dir)) == 480
    assert len(load_eval_prompts("mt_bench", shared_data_dir)) == 80
    assert len(load_eval_prompts("humaneval", shared_data_dir)) == 164
    text = (shared_data_dir / "spec_bench_question.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    subset = spec_bench_subset(rows, 60)
    assert len(subset) == 60 and subset == spec_bench_subset(rows, 60)
    tasks = [r["category"] if r["category"] in ("translation", "summarization", "qa", "math_reasoning", "rag")
             else "mt_bench" for r in subset]
    assert {tasks.count(t) for t in set(tasks)} == {10} and len(set(tasks)) == 6
    # one Spec-Bench task: its rows in file order
    summaries = load_eval_prompts("spec_bench:summarization", shared_data_dir, 5)
    assert summaries == [r["turns"][0] for r in rows if r["category"] == "summarization"][:5]
    assert len(load_eval_prompts("spec_bench:rag", shared_data_dir)) == 80
    for bad in ("spec_bench:writing", "spec_bench:", "gsm8k"):
        with pytest.raises(ValueError, match=r"dataset must be one of spec_bench, mt_bench, humaneval, "
                                             r"spec_bench:translation, .*spec_bench:rag, got"):
            load_eval_prompts(bad, shared_data_dir)


def test_eval_tau_writes_one_record_per_setting(tmp_path, workspace):
    model = LlamaForCausalLM.from_pretrained(workspace["target"])
    drafter = UBTreeDrafter(DrafterConfig.for_target(model.config, "tiny", **DRAFTER))
    drafter.bind_hf_target(model)
    drafter_dir = export_drafter(drafter, tmp_path / "drafter", {})
    data_dir = tmp_path / "bench"
    data_dir.mkdir()
    (data_dir / "mt_bench_question.jsonl").write_text(
        "".join(json.dumps({"question_id": i, "category": "writing", "turns": [f"w{i} w{i + 1}", "x"]}) + "\n"
                for i in range(3)))
    records = tmp_path / "records.jsonl"
    results = evaluate(drafter_dir, target=str(workspace["target"]), datasets=["mt_bench"],
                       methods=["single", "ubtree"], temperatures=[0.0, 1.0], batch_size=2, max_new_tokens=6,
                       tree_budget=6, beam_width=2, top_k=4, data_dir=data_dir, records_path=str(records),
                       log=lambda _: None)
    assert len(results) == 4 and all(r.tau >= 1.0 for r in results)
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [(r["method"], r["temperature"]) for r in lines] == [
        ("ubtree-single", 0.0), ("ubtree-single", 1.0), ("ubtree", 0.0), ("ubtree", 1.0)]
    assert lines[0]["tree_budget"] == 4 and lines[0]["top_k"] == 1 and lines[2]["tree_budget"] == 6
    assert all(r["kind"] == "e2e" and r["output_tokens_per_s"] is None for r in lines)


def test_target_cache_reproduces_the_target_forward_and_skips_it(tmp_path, workspace):
    """Two epochs over 24 samples: with the cache the second epoch runs no target forward, and every
    step's loss equals the uncached run's (CPU, float32)."""
    from ubtree_vllm.training import train as train_mod

    calls = []
    original = train_mod.FrozenTarget.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    losses = {}
    for gb in (0.0, 0.01):
        calls.clear()
        train_mod.FrozenTarget.forward = counted
        try:
            result = train(train_config(workspace, tmp_path / f"run-{gb}", max_steps=12, batch_size=4,
                                        target_cache_gb=gb), log=lambda _: None)
        finally:
            train_mod.FrozenTarget.forward = original
        losses[gb] = [h["loss"] for h in result.history]
        forwards = len(calls) - train_mod.TrainConfig().feature_stats_batches  # minus the feature statistics
        assert forwards == (12 if gb == 0 else 6), (gb, len(calls))  # 24 samples = 6 steps per epoch
    assert losses[0.0] == pytest.approx(losses[0.01], rel=1e-5)


def test_target_cache_smaller_than_the_data_forwards_only_the_uncached_rows(tmp_path, workspace, monkeypatch):
    """A cache that holds about half the samples: later batches mix cached and new samples; the target runs on the
    new rows only, and every step's loss equals the uncached run's (CPU, float32)."""
    from ubtree_vllm.training import train as train_mod
    from ubtree_vllm.training.target_cache import TargetCache

    total = sum(min(len(TokenDataset.load(workspace["data"]).sample(i)[0]), 64) for i in range(24))

    class HalfCache(TargetCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.capacity_tokens = min(self.capacity_tokens, total // 2)

    rows = []
    original = train_mod.FrozenTarget.forward

    def counted(self, input_ids, valid):
        rows.append(input_ids.shape[0])
        return original(self, input_ids, valid)

    losses = {}
    for gb in (0.0, 0.01):
        rows.clear()
        monkeypatch.setattr(train_mod, "TargetCache", HalfCache)
        monkeypatch.setattr(train_mod.FrozenTarget, "forward", counted)
        result = train(train_config(workspace, tmp_path / f"run-{gb}", max_steps=12, batch_size=4,
                                    target_cache_gb=gb), log=lambda _: None)
        monkeypatch.undo()
        losses[gb] = [h["loss"] for h in result.history]
        forwarded = rows[train_mod.TrainConfig().feature_stats_batches:]
        if gb == 0:
            assert forwarded == [4] * 12
        else:  # the first epoch runs the target on every sample; the second only on what did not fit
            assert 24 < sum(forwarded) < 48 and any(0 < n < 4 for n in forwarded), forwarded
    assert losses[0.0] == pytest.approx(losses[0.01], rel=1e-5)


def test_target_cache_keeps_what_fits_and_refuses_a_useless_size():
    from ubtree_vllm.training.target_cache import TargetCache

    cache = TargetCache(10 * 5 * 4, feature_dim=3, hidden_dim=2, device=torch.device("cpu"), dtype=torch.float32)
    assert cache.capacity_tokens == 10
    feats, final = torch.randn(2, 6, 3), torch.randn(2, 6, 2)
    cache.store([7, 8], [6, 5], feats, final)  # 6 rows fit, the second sample's 5 do not
    assert len(cache) == 1 and cache.lookup([7, 8], 6) is None
    got_f, got_h = cache.lookup([7, 7], 8)
    assert torch.equal(got_f[0, :6], feats[0]) and torch.equal(got_f[1, 6:], feats[0, 5:6].expand(2, -1))
    assert torch.equal(got_h[0, :6], final[0])
    with pytest.raises(ValueError, match="holds no token"):
        TargetCache(10, feature_dim=3, hidden_dim=2, device=torch.device("cpu"), dtype=torch.float32)


def test_gen_data_workers_fill_one_folder_each_its_own_shards(tmp_path, workspace):
    """worker w of num_workers writes the shards with index = w (mod num_workers); their manifest merges."""
    base = dict(target=str(workspace["target"]), out_dir=str(tmp_path / "d"), data_root=str(workspace["prompts"]),
                num_prompts=10, shard_size=2, max_new_tokens=4, num_workers=2)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for worker in (1, 0):
        cfg = DataGenConfig(**base, worker=worker)

        def recorder(prompts, seed, temperatures, worker=worker):
            seen[worker].append(seed - cfg.seed * 100003)
            return count_up(prompts, seed)

        manifest = generate_dataset(cfg, generator=recorder, log=lambda _: None)
    assert seen == {1: [1, 3], 0: [0, 2, 4]}
    assert manifest["complete"] and [s["file"] for s in manifest["shards"]] == [data_mod.shard_name(i) for i in range(5)]
    assert len(TokenDataset.load(tmp_path / "d")) == 10
    with pytest.raises(ValueError, match=r"worker must be in \[0, num_workers = 2\)"):
        DataGenConfig(worker=2, num_workers=2)
