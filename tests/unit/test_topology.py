"""Topology registry: pure, on synthetic groups laid out like Megatron's."""

import pytest

from ccld_harness.workload import Layout, layout_groups
from ccld_plugin.topology import GroupInfo, Topology, group_id_of, role_index


def _topology(world, tp, pp):
    topo = Topology()
    topo.add(GroupInfo(group_id_of(range(world)), "world", tuple(range(world))))
    for role, groups in layout_groups(Layout(world, tp, pp)).items():
        for ranks in groups:
            if len(ranks) > 1:
                topo.add(GroupInfo(group_id_of(ranks), role, tuple(ranks)))
    return topo


def test_groups_siblings_cohort_stage_tp2_pp2_dp2():
    topo = _topology(8, 2, 2)
    assert {g.role for g in topo.groups_of(5)} == {"world", "tp", "dp", "pp"}
    assert topo.group_of(5, "tp").ranks == (4, 5)
    assert topo.group_of(5, "dp").ranks == (5, 7)
    assert topo.group_of(5, "pp").ranks == (1, 5)
    assert sorted(g.ranks for g in topo.siblings("tp")) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert topo.cohort(5) == [5, 7]
    assert topo.stage_of(5) == 1 and topo.stage_of(2) == 0


def test_cohort_without_dp_group_uses_shard_position():
    topo = _topology(4, 2, 1)  # TP2 x DP2, no PP
    assert topo.cohort(1) == [1, 3]
    topo = _topology(4, 1, 1)  # pure DP: every rank
    assert topo.cohort(2) == [0, 1, 2, 3]


def test_same_ranks_keep_the_more_specific_role():
    topo = Topology()
    gid = group_id_of([0, 1])
    topo.add(GroupInfo(gid, "world", (0, 1)))
    topo.add(GroupInfo(gid, "dp", (0, 1)))
    topo.add(GroupInfo(gid, "other", (0, 1)))
    assert topo.get(gid).role == "dp"


def test_unknown_role_is_rejected_with_the_allowed_list():
    with pytest.raises(ValueError, match="allowed: .*tp"):
        role_index("tensor")


def test_cohorts_of_all_ranks_are_each_ranks_cohort() -> None:
    """Topology.cohorts (every rank at once, one list per DP group) answers what cohort
    answers rank by rank, on random topologies (ranks in several groups of a role, DP
    groups of one rank, no DP group at all)."""
    import random

    rng = random.Random(5)
    for _ in range(300):
        world = rng.randint(1, 12)
        topo = Topology()
        for _ in range(rng.randint(0, 8)):
            ranks = sorted(rng.sample(range(world), rng.randint(1, world)))
            role = rng.choice(["dp", "dp_cp", "tp", "pp", "other", "world"])
            topo.add(GroupInfo(group_id_of(ranks), role, tuple(ranks)))
        got = topo.cohorts()
        assert sorted(got) == topo.ranks()
        assert all(got[r] == topo.cohort(r) for r in topo.ranks())
        for g in topo.groups.values():  # a DP group's members share its list
            members = [got[r] for r in g.ranks if got[r] == list(g.ranks)]
            assert all(m is members[0] for m in members)
