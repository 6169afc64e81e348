"""The wait-for graph solver shared by the verifier and the run analyzer."""

from pipetrace.schedule.waitfor import CYCLE, DEAD_END, ENDS_AT, solve


def test_a_cycle_keeps_the_order_first_walked_and_collects_its_feeders():
    # 0 feeds the cycle 2 -> 1 -> 2; 3 feeds 0
    groups = solve({0: 2, 1: 2, 2: 1, 3: 0}, [0, 1, 2, 3])
    assert [(g.kind, g.cycle, g.members) for g in groups] == [(CYCLE, [2, 1], [0, 1, 2, 3])]


def test_chains_ending_at_the_same_waiting_free_node_are_one_group():
    groups = solve({0: 5, 1: 0, 2: 5, 3: 4}, [0, 1, 2, 3])
    assert [(g.kind, g.end, g.members) for g in groups] == [
        (ENDS_AT, 5, [0, 1, 2]),
        (ENDS_AT, 4, [3]),
    ]


def test_waits_for_nothing_are_grouped_by_the_last_waiting_node():
    # 1 and 3 each wait for nothing named: two separate problems, not one
    groups = solve({0: 1, 1: None, 2: 3, 3: None}, [0, 1, 2, 3])
    assert [(g.kind, g.end, g.members) for g in groups] == [
        (DEAD_END, 1, [0, 1]),
        (DEAD_END, 3, [2, 3]),
    ]


def test_groups_come_in_the_order_of_their_first_member():
    groups = solve({4: 5, 5: 4, 0: 9}, [4, 5, 0])
    assert [g.kind for g in groups] == [CYCLE, ENDS_AT]
    assert solve({}, []) == []
