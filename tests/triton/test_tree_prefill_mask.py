"""triton_ops.tree_prefill_mask against its torch twins: FlashInfer's packed custom mask of a uniform decode tree step
(random parents-first trees, requests of different lengths with slack pages, a padding request, chunks that split a
row's fresh keys) and its flat page list; the mask twin against an independent construction from the parents.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernel_device import DEVICE
from ubtree_vllm.triton_ops.reference import paged_kv_indices_reference, tree_prefill_mask_reference
from ubtree_vllm.triton_ops.tree_prefill_mask import paged_kv_indices, tree_prefill_mask

SENTINEL = 0xAB  # out_mask's bytes before the launch; the ones past the segments must keep it
EXTRA_ENTRIES = 3  # row-buffer entries past the step's R_pad * q rows (T > R_pad * q)


@dataclass
class Step:
    """One uniform decode step's inputs (CPU tensors) and, for the independent check, its trees."""
    seq_lens: torch.Tensor  # [R_pad] int32
    row_index: torch.Tensor  # [T] int64
    row_path: torch.Tensor  # [T, P] int64
    kv_pages: torch.Tensor  # [R_pad] int32
    mask_offsets: torch.Tensor  # [R_pad + 1] int64
    q: int
    page_size: int
    parents: list[list[int] | None]  # per request, root first; None: a padding request
    dropped: set[int]  # global tree rows given row_index -1 (the root rule)

    def mask_args(self, device: torch.device) -> tuple:
        return (self.seq_lens.to(device), self.row_index.to(device), self.row_path.to(device), self.q,
                self.kv_pages.to(device), self.mask_offsets.to(device), self.page_size)

    @property
    def kv_lens(self) -> list[int]:
        return [p * self.page_size for p in self.kv_pages.tolist()]


def random_parents(q: int, gen: torch.Generator) -> list[int]:
    """Parents of a q-node tree, root first, each parent earlier than its child."""
    return [-1] + [int(torch.randint(j, (1,), generator=gen)) for j in range(1, q)]


def make_step(contexts: list[int | None], q: int, page_size: int, path_width: int, seed: int,
              drop: int = 0, min_slack: int = 0) -> Step:
    """Requests with committed ``contexts`` (None: padding) and random q-node trees; each request planned with its
    pages plus ``min_slack`` + 0..2 slack pages (a padding request: 1 page). ``drop`` random tree rows lose their
    row_index. Roots', padding rows' and extra entries' paths hold plausible node rows, which the root rule must
    ignore."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(contexts)
    rows = num_reqs * q + EXTRA_ENTRIES
    row_index = torch.full((rows,), -1, dtype=torch.int64)
    row_path = torch.randint(0, num_reqs * q, (rows, path_width), generator=gen)  # decoys where no path is read
    seq_lens, kv_pages, all_parents = [], [], []
    for r, context in enumerate(contexts):
        if context is None:
            seq_lens.append(0)
            kv_pages.append(1)
            all_parents.append(None)
            continue
        parents = random_parents(q, gen)
        seq_lens.append(context + q)
        kv_pages.append(-(-(context + q) // page_size) + min_slack + int(torch.randint(3, (1,), generator=gen)))
        all_parents.append(parents)
        for i in range(1, q):
            g = r * q + i
            path = [i]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            assert len(path) <= path_width
            row_index[g] = g
            row_path[g] = -1
            row_path[g, :len(path)] = torch.tensor([r * q + j for j in reversed(path)])
    tree_rows = row_index[row_index >= 0]
    dropped = set(tree_rows[torch.randperm(len(tree_rows), generator=gen)[:drop]].tolist())
    for g in dropped:
        row_index[g] = -1
    seg = [q * p * page_size // 8 for p in kv_pages]
    mask_offsets = torch.tensor([0] + seg, dtype=torch.int64).cumsum(0)
    return Step(torch.tensor(seq_lens, dtype=torch.int32), row_index, row_path,
                torch.tensor(kv_pages, dtype=torch.int32), mask_offsets, q, page_size, all_parents, dropped)


def run_mask(fill, step: Step, device: torch.device, **kwargs) -> torch.Tensor:
    """The step's mask buffer (SENTINEL-filled, 5 bytes past the segments) after ``fill``, on the CPU."""
    out = torch.full((int(step.mask_offsets[-1]) + 5,), SENTINEL, dtype=torch.uint8, device=device)
    fill(*step.mask_args(device), out, max_kv_len=max(step.kv_lens), **kwargs)
    return out.cpu()


def unpack(mask: torch.Tensor, step: Step) -> list[torch.Tensor]:
    """Per request the [q, kv_len] bool matrix of its segment (little bit order)."""
    bits = ((mask[:, None].long() >> torch.arange(8)) & 1).bool().flatten()  # [8 * bytes]
    offsets = step.mask_offsets.tolist()
    return [bits[8 * offsets[r]:8 * offsets[r + 1]].view(step.q, kv_len) for r, kv_len in enumerate(step.kv_lens)]


def pack(matrices: list[torch.Tensor], little: bool = True) -> torch.Tensor:
    """The segments' bytes of per-request [q, kv_len] bool matrices, concatenated."""
    weights = 1 << torch.arange(8) if little else 1 << torch.arange(7, -1, -1)
    return torch.cat([(m.reshape(-1, 8).long() * weights).sum(1) for m in matrices]).to(torch.uint8)


def expected_visibility(step: Step, root_sees_self: bool = True) -> list[torch.Tensor]:
    """Per request, built from the parents alone: a root or pathless row sees the context and its own key; a tree row
    the context and its ancestors-or-self among the q fresh keys (ancestor closure, parents first); nothing after.
    ``root_sees_self=False`` is a deliberately wrong rule (roots without their own key)."""
    out = []
    for r, (parents, kv_len) in enumerate(zip(step.parents, step.kv_lens)):
        q, ctx = step.q, max(int(step.seq_lens[r]) - step.q, 0)
        m = torch.zeros(q, kv_len, dtype=torch.bool)
        ancestors = torch.eye(q, dtype=torch.bool)  # [q, q] ancestors[i, j]: j on the root -> i path
        for i in range(1, q):
            if parents is not None:
                ancestors[i] |= ancestors[parents[i]]
        for i in range(q):
            m[i, :ctx] = True
            if i == 0 or parents is None or r * q + i in step.dropped:
                m[i, ctx] = root_sees_self
            else:
                m[i, ctx:ctx + q] = ancestors[i]
        out.append(m)
    return out


# (committed contexts, None = padding request, q); contexts around page edges, one of several pages
REQUESTS = [([37, None, 0, 5, 70], 6), ([12, 3, None], 9), ([0, 100], 1), ([16, 23, 8, None, 61], 4)]


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("contexts,q", REQUESTS)
@pytest.mark.parametrize("block_bytes", [1, 2, 128])
def test_mask_kernel_matches_reference(contexts, q, page_size, block_bytes):
    step = make_step(contexts, q, page_size, path_width=q + 5, seed=q * page_size, drop=1 if q > 2 else 0)
    ref = run_mask(tree_prefill_mask_reference, step, torch.device("cpu"))
    got = run_mask(tree_prefill_mask, step, DEVICE, block_bytes=block_bytes)
    assert torch.equal(got, ref)
    assert (got[int(step.mask_offsets[-1]):] == SENTINEL).all()


def test_mask_kernel_wide_paths():
    """P = 65 (a 64-node tree's width) with shallow trees: most path columns are -1."""
    step = make_step([40, None, 2], 7, 16, path_width=65, seed=3)
    ref = run_mask(tree_prefill_mask_reference, step, torch.device("cpu"))
    assert torch.equal(run_mask(tree_prefill_mask, step, DEVICE), ref)


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("contexts,q", REQUESTS)
def test_reference_decodes_to_the_tree_masks(contexts, q, page_size):
    step = make_step(contexts, q, page_size, path_width=q + 2, seed=7 + q, drop=1 if q > 2 else 0)
    got = unpack(run_mask(tree_prefill_mask_reference, step, torch.device("cpu")), step)
    for r, (matrix, expected) in enumerate(zip(got, expected_visibility(step))):
        assert torch.equal(matrix, expected), f"request {r}"
        assert matrix.any(dim=1).all(), f"request {r}: a row without a visible key"


def test_kernel_rejects_wrong_rules():
    """The kernel's bytes are the independent construction's, and not those of a wrong root rule or bit order."""
    step = make_step([37, None, 5], 5, 16, path_width=8, seed=11)
    got = run_mask(tree_prefill_mask, step, DEVICE, block_bytes=2)[:int(step.mask_offsets[-1])]
    assert torch.equal(got, pack(expected_visibility(step)))
    assert not torch.equal(got, pack(expected_visibility(step, root_sees_self=False)))
    assert not torch.equal(got, pack(expected_visibility(step), little=False))


def test_mask_ignores_path_entries_of_other_requests():
    """A tree row's path column holding another request's row (outside the contract's -1 padding) marks no key:
    its local index falls outside 0 .. q - 1, where slack keys after the fresh ones would show it."""
    step = make_step([37, 5, 20], 5, 8, path_width=8, seed=5, min_slack=1)
    plain = run_mask(tree_prefill_mask_reference, step, torch.device("cpu"))
    for g in step.row_index[step.row_index >= 0].tolist():
        r = g // step.q
        step.row_path[g, -1] = (r + 1) * step.q + 1 + g % 2  # local index q + 1 or q + 2
        step.row_path[g, -2] = (r - 1) * step.q + 2  # local index 2 - q < 0
    assert torch.equal(run_mask(tree_prefill_mask_reference, step, torch.device("cpu")), plain)
    assert torch.equal(run_mask(tree_prefill_mask, step, DEVICE, block_bytes=1), plain)


def test_mask_nothing_to_do():
    out = torch.full((4,), SENTINEL, dtype=torch.uint8, device=DEVICE)
    empty32 = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    tree_prefill_mask(empty32, rows, rows.view(0, 1), 3, empty32, torch.zeros(1, dtype=torch.int64, device=DEVICE),
                      16, out, max_kv_len=0)
    assert (out.cpu() == SENTINEL).all()


def kv_case(block_pages_seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A 3-row table with negative ids for 6 requests: one past the table's width, two padding (one without pages)."""
    gen = torch.Generator().manual_seed(block_pages_seed)
    block_table = torch.randint(-3, 50, (3, 7), generator=gen, dtype=torch.int32)
    block_table[1, 2] = -1
    kv_pages = torch.tensor([4, 7, 9, 2, 0, 5], dtype=torch.int32)  # request 2 runs past max_blocks = 7
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), kv_pages.cumsum(0).to(torch.int32)])
    return block_table, kv_pages, kv_indptr, int(kv_pages.max())


def test_kv_indices_reference_by_hand():
    block_table = torch.tensor([[5, -1, 7], [2, 3, 4]], dtype=torch.int32)
    kv_pages = torch.tensor([2, 4, 1], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 2, 6, 7], dtype=torch.int32)
    out = torch.full((9,), -9, dtype=torch.int32)
    paged_kv_indices_reference(block_table, kv_pages, kv_indptr, out, 4)
    assert out.tolist() == [5, 0, 2, 3, 4, 0, 0, -9, -9]


@pytest.mark.parametrize("block_pages", [2, 128])
def test_kv_indices_kernel_matches_reference(block_pages):
    block_table, kv_pages, kv_indptr, max_pages = kv_case(block_pages)
    total = int(kv_indptr[-1])
    ref = torch.full((total + 4,), -9, dtype=torch.int32)
    paged_kv_indices_reference(block_table, kv_pages, kv_indptr, ref, max_pages)
    got = torch.full((total + 4,), -9, dtype=torch.int32, device=DEVICE)
    paged_kv_indices(block_table.to(DEVICE), kv_pages.to(DEVICE), kv_indptr.to(DEVICE), got, max_pages,
                     block_pages=block_pages)
    assert torch.equal(got.cpu(), ref)
    assert (ref[:total] >= 0).all() and (ref[total:] == -9).all()
    assert ref[int(kv_indptr[2]) + 7:int(kv_indptr[3])].eq(0).all()  # past the table's width
    assert ref[int(kv_indptr[3]):total].eq(0).all()  # padding requests
