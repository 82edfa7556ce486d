"""`bench e2e` warms each concurrency up with a full window of requests before measuring it."""
from ubtree_vllm.bench.e2e import warmup_at
from ubtree_vllm.bench.prompts import PromptSet


def test_the_warmup_fills_the_window_cycling_a_short_set():
    prompts = PromptSet("mt_bench", ((1, 2), (3,), (4, 5, 6)), stop_token_ids=(7,))
    warm = warmup_at(prompts, 5)
    assert warm.prompts == ((1, 2), (3,), (4, 5, 6), (1, 2), (3,))
    assert (warm.dataset, warm.stop_token_ids) == ("mt_bench", (7,))
    assert warmup_at(prompts, 2).prompts == ((1, 2), (3,))
