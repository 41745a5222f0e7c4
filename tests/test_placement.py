"""Placement properties over many memberships: holders, groups, loss tolerance, labels."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memsnap.job.placement import NodeInfo, Placement, margin, place, protection_level, recoverable, replace_node


@st.composite
def memberships(draw, max_nodes=14):
    k = draw(st.integers(1, 4))
    m = draw(st.integers(0, 2))
    n = draw(st.integers(k + m + 1, max(k + m + 1, max_nodes)))
    racks = draw(st.integers(0, 5))
    nodes = [
        NodeInfo(f"{draw(st.integers(0, 9))}{i:02x}", {"rack": f"r{i % racks}"} if racks else {}) for i in range(n)
    ]
    return nodes, k, m


@settings(max_examples=300, deadline=None)
@given(memberships())
def test_holders_are_distinct_others_in_the_same_group(case):
    nodes, k, m = case
    p = place(nodes, k, m)
    assert sorted(p.nodes) == sorted(n.node_id for n in nodes)
    assert all(len(g) >= k + m + 1 for g in p.groups)
    for o, hs in p.holders.items():
        assert len(hs) == k + m and len(set(hs)) == k + m
        assert o not in hs
        assert {p.group_of(h) for h in hs} == {p.group_of(o)}
    assert set(p.holders) == set(p.nodes)  # no node is unprotected


def _loss_sets(group, size):
    for r in range(size + 1):
        yield from itertools.combinations(group, r)


@settings(max_examples=120, deadline=None)
@given(memberships(max_nodes=11))
def test_any_m_plus_one_losses_in_a_group_are_survivable_with_the_local_copy(case):
    nodes, k, m = case
    p = place(nodes, k, m)
    everyone = set(p.nodes)
    for group in p.groups:
        for lost in _loss_sets(group, m + 1):
            alive = everyone - set(lost)
            assert all(recoverable(p, o, alive, local_copy=True) for o in p.nodes), lost
            if len(lost) <= m:
                assert all(recoverable(p, o, alive, local_copy=False) for o in p.nodes), lost


def test_lean_mode_loses_data_at_m_plus_one_losses_and_the_local_copy_saves_it():
    p = place([NodeInfo(f"n{i}") for i in range(4)], 2, 1)
    owner = p.nodes[0]
    alive = set(p.nodes) - set(p.holders[owner][:2])  # m+1 of its holders, not the owner
    assert not recoverable(p, owner, alive, local_copy=False)
    assert recoverable(p, owner, alive, local_copy=True)
    assert not recoverable(p, owner, alive - {owner}, local_copy=True)


@settings(max_examples=80, deadline=None)
@given(memberships(max_nodes=9), st.booleans())
def test_protection_level_matches_a_brute_force_search(case, local_copy):
    nodes, k, m = case
    p = place(nodes, k, m)
    rng = random.Random(len(nodes) * 31 + k)
    everyone = set(p.nodes)
    already = set(rng.sample(sorted(everyone), rng.randint(0, 2)))
    level = protection_level(p, everyone - already, local_copy)
    for gi, group in enumerate(p.groups):
        alive_now = everyone - already
        if not all(recoverable(p, o, alive_now, local_copy) for o in group):
            assert level[gi] == -1
            continue
        survives = 0  # the largest r such that every r more losses leave the group's owners whole
        for r in range(1, len(group) + 1):
            candidates = sorted(set(group) & alive_now)
            ok = all(
                all(recoverable(p, o, alive_now - set(extra), local_copy) for o in group)
                for extra in itertools.combinations(candidates, min(r, len(candidates)))
            )
            if not ok:
                break
            survives = r
        assert level[gi] == survives, (gi, already)


def test_full_health_levels():
    p = place([NodeInfo(f"n{i}") for i in range(8)], 2, 1)
    alive = set(p.nodes)
    assert protection_level(p, alive) == {0: 2, 1: 2}
    assert protection_level(p, alive, local_copy=False) == {0: 1, 1: 1}


@settings(max_examples=150, deadline=None)
@given(memberships(), st.randoms(use_true_random=False))
def test_placement_is_deterministic_whatever_the_input_order(case, rnd):
    nodes, k, m = case
    shuffled = list(nodes)
    rnd.shuffle(shuffled)
    assert place(nodes, k, m) == place(shuffled, k, m)


@settings(max_examples=150, deadline=None)
@given(k=st.integers(1, 3), m=st.integers(0, 2), groups=st.integers(1, 4), extra=st.integers(0, 3))
def test_racks_are_spread_over_groups_when_the_labels_allow_it(k, m, groups, extra):
    size = k + m + 1
    n = groups * size + min(extra, groups - 1 if groups > 1 else 0)
    count = n // size
    # racks of at most `count` nodes each: a split with no shared rack in any group exists
    nodes = [NodeInfo(f"n{i:03d}", {"rack": f"r{i // count}"}) for i in range(n)]
    p = place(nodes, k, m)
    labels = {nd.node_id: nd.labels["rack"] for nd in nodes}
    for g in p.groups:
        racks = [labels[x] for x in g]
        assert len(set(racks)) == len(racks), p.groups


def test_zones_are_spread_before_racks():
    nodes = [NodeInfo(f"n{i}", {"zone": f"z{i % 3}", "rack": f"r{i}"}) for i in range(6)]
    p = place(nodes, 1, 1)  # two groups of three, one node from each zone in each
    zone = {nd.node_id: nd.labels["zone"] for nd in nodes}
    for g in p.groups:
        assert sorted(zone[x] for x in g) == ["z0", "z1", "z2"]


def test_remainder_nodes_join_groups_and_stay_protected():
    p = place([NodeInfo(f"n{i}") for i in range(11)], 2, 1)
    assert sorted(len(g) for g in p.groups) == [5, 6]
    p = place([NodeInfo(f"n{i}") for i in range(6)], 2, 1, group_size=6)
    assert len(p.groups) == 1


def test_replace_node_takes_every_slot():
    nodes = [NodeInfo(f"n{i}") for i in range(8)]
    p = place(nodes, 2, 1)
    lost = p.groups[1][0]
    q = replace_node(p, lost, NodeInfo("fresh"))
    assert lost not in q.nodes and "fresh" in q.groups[1]
    assert q.holders["fresh"] == p.holders[lost]
    for o, hs in p.holders.items():
        if o != lost:
            assert q.holders[o] == tuple("fresh" if h == lost else h for h in hs)
    with pytest.raises(ValueError, match="not in this placement"):
        replace_node(p, "nope", NodeInfo("x"))
    with pytest.raises(ValueError, match="already placed"):
        replace_node(p, lost, NodeInfo(p.groups[0][0]))


def test_too_few_nodes_says_what_is_needed():
    with pytest.raises(ValueError, match=r"at least k\+m\+1=4 nodes.*lower k or m"):
        place([NodeInfo(f"n{i}") for i in range(3)], 2, 1)
    with pytest.raises(ValueError, match="group_size=3"):
        place([NodeInfo(f"n{i}") for i in range(8)], 2, 1, group_size=3)
    with pytest.raises(ValueError, match="unique"):
        place([NodeInfo("a")] * 4, 1, 1)
    with pytest.raises(ValueError, match="k=0"):
        place([NodeInfo(f"n{i}") for i in range(8)], 0, 1)


def test_placement_round_trips_through_json_and_is_reducible():
    import copy
    import json

    p = place([NodeInfo(f"n{i}", {"zone": f"z{i % 2}"}) for i in range(9)], 2, 2)
    assert Placement.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    # Ray serialises actor-call arguments by reduction, as deepcopy does: no mappingproxy inside
    assert copy.deepcopy(p) == p
    node = NodeInfo("a", {"rack": "r1"})
    assert copy.deepcopy(node) == node and hash(node) == hash(NodeInfo("a", {"rack": "r1"}))


@pytest.mark.parametrize(
    ("m", "lost", "local", "survives"),
    [
        (1, 0, True, 2),  # a holder, then the owner's own copy
        (1, 1, True, 1),
        (1, 2, True, 0),  # only the owner's copy is left: it is the last one
        (1, 0, False, 1),
        (1, 1, False, 0),
        (1, 2, False, -1),  # lean mode: more than m pieces gone is unreadable from RAM
        (2, 3, True, 0),
        (2, 2, False, 0),
    ],
)
def test_one_rule_says_how_many_more_losses_an_owner_survives(m, lost, local, survives):
    assert margin(m, lost, local) == survives
