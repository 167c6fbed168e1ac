"""Mini-batch splits: every rollout row once; ``length`` order groups similar lengths."""

from __future__ import annotations

import pytest
import torch

from gspo_core.step import minibatches


def _padded_tokens(lengths_N: torch.Tensor, batches: list[torch.Tensor]) -> int:
    return sum(int(lengths_N[b].max()) * len(b) for b in batches)


@pytest.mark.parametrize("order", ["random", "length", "group"])
def test_every_row_exactly_once(order):
    lengths_N = torch.randint(1, 500, (64,), generator=torch.Generator().manual_seed(0))
    batches = minibatches(lengths_N, 4, order, torch.Generator().manual_seed(1), group_size=8)
    assert len(batches) == 4 and all(len(b) == 16 for b in batches)
    assert sorted(torch.cat(batches).tolist()) == list(range(64))


def test_length_order_pads_less_and_keeps_batch_order_random():
    lengths_N = torch.randint(16, 512, (64,), generator=torch.Generator().manual_seed(0))
    real = int(lengths_N.sum())
    waste = {
        order: 1 - real / _padded_tokens(lengths_N, minibatches(lengths_N, 4, order, torch.Generator().manual_seed(2)))
        for order in ("random", "length")
    }
    assert waste["length"] < 0.2 < waste["random"], waste
    firsts = set()
    for seed in range(8):
        batches = minibatches(lengths_N, 4, "length", torch.Generator().manual_seed(seed))
        firsts.add(int(lengths_N[batches[0]].max()))
        spans = [int(lengths_N[b].max() - lengths_N[b].min()) for b in batches]
        assert sum(spans) <= int(lengths_N.max() - lengths_N.min())  # contiguous length ranges
    assert len(firsts) > 1  # the shortest batch does not always go first


def test_same_generator_same_split():
    lengths_N = torch.tensor([5, 5, 5, 9, 9, 1, 1, 7])
    a = minibatches(lengths_N, 2, "length", torch.Generator().manual_seed(3))
    b = minibatches(lengths_N, 2, "length", torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("order", ["group", "length"])
def test_rows_of_a_group_stay_together_where_lengths_allow(order):
    """Equal lengths (benchmarks' fixed-length completions): each mini-batch is 2 whole groups of 8,
    in a random arrangement; with ``group`` order also when lengths differ."""
    lengths_N = torch.full((64,), 41) if order == "length" else torch.randint(1, 99, (64,))
    splits = set()
    for seed in range(4):
        batches = minibatches(lengths_N, 4, order, torch.Generator().manual_seed(seed), group_size=8)
        groups = [sorted({i // 8 for i in b.tolist()}) for b in batches]
        assert all(len(g) == 2 for g in groups) and sorted(i for g in groups for i in g) == list(range(8))
        splits.add(tuple(map(tuple, groups)))
    assert len(splits) > 1


def test_length_order_keeps_groups_whole_where_prompts_are_shared():
    """A chat job: each prompt's 8 completions differ in length (EOS). Sorting rows scattered every group over
    all 4 mini-batches (its prompt ran once per row); with shared prompts the groups stay whole, sorted by
    their longest row, so each mini-batch runs 2 prompts and still pads only to lengths close to its own."""
    from gspo_core.config import GSPOConfig
    from gspo_core.rollout.base import Completion
    from gspo_core.step import Rollout, plan_minibatches

    gen = torch.Generator().manual_seed(0)
    completions = [
        Completion(p, [1] * (40 + p), [2] * int(torch.randint(3, 25, (1,), generator=gen)), [], "", "stop")
        for p in range(8)
        for _ in range(8)
    ]
    rollout = Rollout(rows=[{}] * 64, prompts=[""] * 8, completions=completions)
    adv_N = torch.ones(64)
    for share in (True, False):
        cfg = GSPOConfig(mini_batches=4, group_size=8, prompts_per_step=8, share_prompts=share)
        plan = plan_minibatches(rollout, adv_N, cfg, torch.Generator().manual_seed(1))
        prompts = [len({completions[i].prompt_index for i in b.tolist()}) for b in plan.batches]
        assert sorted(i for b in plan.batches for i in b.tolist()) == list(range(64))
        if share:
            assert prompts == [2, 2, 2, 2], prompts
        else:  # rows sorted by their own length: groups scattered (less padding, no prompt to share)
            assert max(prompts) > 2, prompts


def test_an_unset_micro_batch_budget_is_the_devices_default():
    """Unset, the budget is small on CPU (a real vocabulary's logits set the memory) and large on a GPU (forwards of
    a row or two left an H200 idle: the update ran 12x slower, docs/bench.md); a job's own value always wins."""
    from gspo_core.batching import micro_batch_budget

    assert micro_batch_budget(None, torch.device("cpu")) == 1024
    assert micro_batch_budget(None, torch.device("cuda")) == 16_384
    assert micro_batch_budget(0, torch.device("cuda")) == 0
    assert micro_batch_budget(300, torch.device("cpu")) == 300
