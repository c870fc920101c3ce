"""Role groups are checked before any worker starts; every problem is named at once."""

from __future__ import annotations

import pytest

from fusedrl.controller.placement import RoleGroups, check_role_groups

NEEDED = ["actor", "rollout", "ref"]


def test_default_is_one_fused_group():
    assert check_role_groups(NEEDED, None) == [NEEDED]
    assert check_role_groups(NEEDED, [["actor", "rollout"], ["ref"]]) == [["actor", "rollout"], ["ref"]]


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([["actor", "rollout"]], "role 'ref' is not placed"),
        ([["actor", "rollout", "ref"], ["ref"]], "role 'ref' is placed twice"),
        ([["actor", "rollout", "ref"], ["critic"]], "role 'critic' is not used by this run"),
        ([["actor", "ref"], ["rollout"]], "role 'rollout' must share the actor's group"),
    ],
)
def test_problems_are_named(groups, message):
    with pytest.raises(ValueError, match=message):
        check_role_groups(NEEDED, groups)


def test_all_problems_at_once():
    with pytest.raises(ValueError, match="'critic' must share.*'ref' is not placed"):
        check_role_groups(["actor", "rollout", "ref", "critic"], [["actor", "rollout"], ["critic"]])


def test_role_groups_lookup_names_the_missing_role():
    a, b = object(), object()
    groups = RoleGroups({"actor": a, "rollout": a, "ref": b})  # type: ignore[dict-item]
    assert groups.group_for("ref") is b
    assert groups.unique() == [a, b]  # each group once, in start order
    with pytest.raises(RuntimeError, match="no worker group holds 'critic'"):
        groups.group_for("critic")
