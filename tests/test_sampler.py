"""The resumable data position: coverage, determinism, and resuming with prefetching workers."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from memsnap.errors import ConfigError, StateMismatchError
from memsnap.sampler import ResumableLoader, ResumableSampler


def test_each_epoch_is_a_seeded_permutation():
    s = ResumableSampler(23, seed=5)
    e0 = list(s)
    assert sorted(e0) == list(range(23)) and e0 != list(range(23))
    assert list(ResumableSampler(list(range(23)), seed=5)) == e0  # a sized dataset works too
    s.set_epoch(1)
    assert sorted(list(s)) == list(range(23)) and list(s) != e0
    assert list(ResumableSampler(23, shuffle=False)) == list(range(23))


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_split_the_epoch(drop_last):
    ranks = [list(ResumableSampler(10, seed=1, rank=r, world_size=3, drop_last=drop_last)) for r in range(3)]
    assert len({len(r) for r in ranks}) == 1
    flat = [i for r in ranks for i in r]
    if drop_last:
        assert len(flat) == 9 and len(set(flat)) == 9
    else:
        assert len(flat) == 12 and set(flat) == set(range(10))


def test_restored_sampler_yields_the_rest_of_the_epoch():
    s = ResumableSampler(17, seed=2)
    s.set_epoch(3)
    whole = list(s)
    s.advance(6)
    t = ResumableSampler(17, seed=0)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == {"epoch": 3, "seed": 2, "consumed": 6}
    assert list(t) == whole[6:] and len(t) == 11


def test_finished_epoch_rolls_over_and_set_epoch_keeps_position():
    s = ResumableSampler(8, seed=0)
    first = list(s)
    s.advance(8)
    second = list(s)
    assert s.epoch == 1 and sorted(second) == list(range(8)) and second != first
    s.advance(3)
    s.set_epoch(1)
    assert s.consumed == 3


def test_bad_arguments_are_refused():
    with pytest.raises(ConfigError, match="rank=2, world_size=2"):
        ResumableSampler(8, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="length"):
        ResumableSampler(object())
    s = ResumableSampler(8)
    with pytest.raises(ConfigError, match=r"advance\(9\)"):
        s.advance(9)
    with pytest.raises(StateMismatchError, match="consumed=20"):
        s.load_state_dict({"epoch": 0, "seed": 0, "consumed": 20})
    with pytest.raises(StateMismatchError, match="lacks"):
        s.load_state_dict({"epoch": 0})


def loader(seed: int, workers: int = 2, drop_last: bool = False) -> ResumableLoader:
    data = torch.arange(30)
    return ResumableLoader(
        DataLoader(
            data,  # type: ignore[arg-type]  # torch declares Dataset; a tensor indexes as one
            batch_size=4,
            sampler=ResumableSampler(data, seed=seed),
            num_workers=workers,
            drop_last=drop_last,
        )
    )


def test_only_batches_handed_to_the_loop_count_and_resume_is_exact():
    ref = [b.tolist() for b in loader(7, workers=0)]
    run = loader(7)
    it = iter(run)
    seen = [next(it).tolist() for _ in range(3)]  # workers have prefetched more than 3 batches
    assert run.state_dict() == {"sampler": {"epoch": 0, "seed": 7, "consumed": 12}}
    del it
    resumed = loader(0)
    resumed.load_state_dict(run.state_dict())
    assert len(resumed) == 5
    assert seen + [b.tolist() for b in resumed] == ref
    assert resumed.state_dict()["sampler"]["consumed"] == 30


def test_drop_last_tail_ends_the_epoch():
    run = loader(1, workers=0, drop_last=True)
    assert len(list(run)) == 7 and run.sampler.consumed == run.sampler.num_samples
    assert len(list(run)) == 7 and run.sampler.epoch == 1


def test_starting_an_iterator_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expect = torch.rand(1)
    torch.manual_seed(0)
    next(iter(loader(1, workers=1)))
    assert torch.equal(torch.rand(1), expect)


def test_loader_needs_a_resumable_sampler_and_batch_size():
    with pytest.raises(ConfigError, match="sampler=ResumableSampler"):
        ResumableLoader(DataLoader(torch.arange(4), batch_size=2))
    with pytest.raises(ConfigError, match="batch_size"):
        ResumableLoader(DataLoader(torch.arange(4), batch_size=None, sampler=ResumableSampler(4)))


def test_plain_dataloader_with_advance_resumes_exactly():
    data = torch.arange(20)
    ref = [b.tolist() for b in DataLoader(data, batch_size=3, sampler=ResumableSampler(data, seed=4))]
    sampler = ResumableSampler(data, seed=4)
    seen = []
    for batch in DataLoader(data, batch_size=3, sampler=sampler, num_workers=2):
        seen.append(batch.tolist())
        sampler.advance(len(batch))
        if len(seen) == 4:
            break
    again = ResumableSampler(data, seed=0)
    again.load_state_dict(sampler.state_dict())
    assert seen + [b.tolist() for b in DataLoader(data, batch_size=3, sampler=again)] == ref
