"""`bench e2e` warms each concurrency up, before measuring it, with the steps a measured run will take:
a full window of requests, of staggered lengths, so new requests are prefilled beside decoding ones."""
from types import SimpleNamespace

from ubtree_vllm.bench.engines import WARMUP_TOKENS, warm_up_at
from ubtree_vllm.bench.prompts import PromptSet


class FakeEngine:
    """Each step generates one token for every request in flight; a request finishes at its max_tokens."""

    def __init__(self) -> None:
        self.running: dict[int, list] = {}  # id -> [prompt, max_tokens, generated]
        self.steps: list[tuple[int, ...]] = []  # tokens generated so far by each request in flight, per step
        self.enqueued_beside_decoding = 0

    def add(self, prompt, params) -> None:
        if any(generated > 0 for _, _, generated in self.running.values()):
            self.enqueued_beside_decoding += 1
        self.running[len(self.steps) * 1000 + len(self.running)] = [prompt, params.max_tokens, 0]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self):
        self.steps.append(tuple(r[2] for r in self.running.values()))
        finished = []
        for key, request in list(self.running.items()):
            request[2] += 1
            if request[2] >= request[1]:
                finished.append(SimpleNamespace(finished=True, prompt=request[0], tokens=request[2]))
                del self.running[key]
        return finished


class FakeLLM:
    def __init__(self) -> None:
        self.llm_engine = FakeEngine()
        self.sent: list[tuple[list[int], int]] = []

    def enqueue(self, prompt, params, use_tqdm=False) -> None:
        self.sent.append((prompt["prompt_token_ids"], params.max_tokens))
        self.llm_engine.add(prompt["prompt_token_ids"], params)


def test_the_warmup_runs_two_windows_of_staggered_requests_cycling_a_short_set():
    prompts = PromptSet("mt_bench", ((1, 2), (3,), (4, 5, 6)), stop_token_ids=(7,))
    llm = FakeLLM()
    warm_up_at(llm, prompts, 4)
    assert [p for p, _ in llm.sent] == [[1, 2], [3], [4, 5, 6], [1, 2], [3], [4, 5, 6], [1, 2], [3]]
    lengths = [n for _, n in llm.sent]
    assert set(lengths) == {WARMUP_TOKENS // 4, WARMUP_TOKENS // 2, 3 * WARMUP_TOKENS // 4, WARMUP_TOKENS}
    assert max(len(s) for s in llm.llm_engine.steps) == 4  # never more than the window in flight
    # requests finish at different steps, and the next ones join requests that are mid-answer
    assert llm.llm_engine.enqueued_beside_decoding >= 3
