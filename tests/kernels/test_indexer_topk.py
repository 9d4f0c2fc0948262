import pytest
import torch

from moebus.kernels.indexer_topk import indexer_topk, indexer_topk_cpu, indexer_topk_ref, indexer_topk_triton


def naive(q, w, keys, start, nvis, k, scale) -> torch.Tensor:
    """Float64 scores, then a sort by (-score, entry): ties go to the lower entry."""
    out = torch.full((q.shape[0], k), -1, dtype=torch.long)
    for r in range(q.shape[0]):
        scored = []
        for e in range(int(nvis[r])):
            key = keys[int(start[r]) + e].double()
            s = sum(float(w[r, h]) * max(float(q[r, h].double() @ key), 0.0) * scale for h in range(q.shape[1]))
            scored.append((-s, e))
        for i, (_, e) in enumerate(sorted(scored)[:k]):
            out[r, i] = e
    return out


def inputs(rows, heads, dim, seqs, dtype, device="cpu"):
    """`seqs` sequences of keys; each row belongs to one and sees a prefix of its keys (0 included)."""
    g = torch.Generator().manual_seed(rows * 131 + dim)
    lens = torch.randint(0, 40, (seqs,), generator=g)
    starts = torch.cumsum(lens, 0) - lens
    keys = torch.randn(int(lens.sum()), dim, generator=g).to(dtype)
    owner = torch.randint(0, seqs, (rows,), generator=g)
    nvis = (torch.rand(rows, generator=g) * (lens[owner] + 1).float()).long()
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    w = torch.randn(rows, heads, generator=g)
    return q.to(device), w.to(device), keys.to(device), starts[owner].to(device), nvis.to(device)


CASES = [(1, 1, 16, 1, 4), (9, 8, 16, 3, 4), (33, 4, 81, 2, 7), (17, 2, 145, 4, 64)]  # rows, heads, dim, seqs, k


@pytest.mark.parametrize("case", CASES)
def test_ref_and_cpu_match_fp64(case):
    rows, heads, dim, seqs, k = case
    q, w, keys, start, nvis = inputs(rows, heads, dim, seqs, torch.float32)
    expected = naive(q, w, keys, start, nvis, k, dim ** -0.5)
    assert torch.equal(indexer_topk_ref(q, w, keys, start, nvis, k, dim ** -0.5), expected)
    cpu = indexer_topk_cpu(q, w, keys, start, nvis, k, dim ** -0.5)
    if cpu is None:
        pytest.skip("no C compiler: the CPU path is the reference")
    assert torch.equal(cpu, expected)
    assert torch.equal(indexer_topk(q, w, keys, start, nvis, k, dim ** -0.5), expected)


def test_bf16_cpu_matches_ref():
    q, w, keys, start, nvis = inputs(33, 4, 81, 2, torch.bfloat16)
    cpu = indexer_topk_cpu(q, w, keys, start, nvis, 7, 0.1)
    if cpu is None:
        pytest.skip("no C compiler")
    assert torch.equal(cpu, indexer_topk_ref(q, w, keys, start, nvis, 7, 0.1))


def test_ties_go_to_the_lower_entry():
    q = torch.ones(1, 1, 4)
    keys = -torch.ones(6, 4)  # every dot product is negative: all scores are 0
    keys[4] = 1.0
    out = indexer_topk(q, torch.ones(1, 1), keys, torch.tensor([0]), torch.tensor([6]), 3, 1.0)
    assert out.tolist() == [[4, 0, 1]]


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_ref(case, triton_device):
    rows, heads, dim, seqs, k = case
    q, w, keys, start, nvis = inputs(rows, heads, dim, seqs, torch.float32, triton_device)
    out = indexer_topk_triton(q, w, keys, start, nvis, k, dim ** -0.5)
    assert torch.equal(out.cpu(), indexer_topk_ref(q.cpu(), w.cpu(), keys.cpu(), start.cpu(), nvis.cpu(), k,
                                                   dim ** -0.5))
