"""The tag's elastic field (``elastic=MIN:MAX``, docs/protocol.md "The AdminComment tag"): parsed to a
(MIN, MAX) tuple, rendered after req and hold, kept through every change the coordinator and the
Prolog make to a tag. docs/contracts.json holds the vectors every language shares; these are the
Python API's own cases."""

from __future__ import annotations

import pytest

from slurm_antman.jobtag import (ACROSS_NODES, ELASTIC_MAX, ONE_NODE, JobTag, TagError, elastic_kind, parse_elastic,
                                  parse_tag)
from slurm_antman.slurm.tag import read_admin_comment


def test_parse_and_render_round_trip() -> None:
    tag = parse_tag("antman:class=opportunistic;elastic=2:4")
    assert tag == JobTag("opportunistic", elastic=(2, 4))
    assert tag.render() == "antman:class=opportunistic;elastic=2:4"
    assert parse_tag(tag.render()) == tag


def test_no_elastic_field_is_none() -> None:
    assert parse_tag("antman:class=opportunistic").elastic is None
    assert "elastic" not in JobTag("opportunistic").render()


def test_canonical_place_is_after_hold_before_unknown_fields_and_gpus() -> None:
    tag = JobTag("guaranteed", gpus={"n2": [1], "n1": [0]}, requested="auto", hold="quota",
                 extra=(("zz", "1"),), elastic=(1, 2))
    assert tag.render() == "antman:class=guaranteed;req=auto;hold=quota;elastic=1:2;zz=1;gpus=n1:0,n2:1"
    assert parse_tag(tag.render()) == tag


def test_the_range_survives_every_change_of_the_tag() -> None:
    tag = JobTag("opportunistic", requested="auto", elastic=(1, 4))
    assert tag.with_gpus("n1", [3, 1]).elastic == (1, 4)
    assert tag.only_on(["n1"]).elastic == (1, 4)
    assert tag.with_hold("quota").with_hold(None).elastic == (1, 4)
    # an upgrade keeps it: the sidecar uses it only while the job is opportunistic
    up = tag.with_class("guaranteed")
    assert up.elastic == (1, 4) and up.render() == "antman:class=guaranteed;req=auto;elastic=1:4"


@pytest.mark.parametrize("value", [(0, 1), (2, 1), (1, ELASTIC_MAX + 1), (1,), (1, 2, 3), [1, 2], ("1", "2"),
                                   (1.0, 2), (True, 2)])
def test_a_tag_cannot_be_built_with_a_bad_range(value) -> None:
    with pytest.raises(TagError, match="elastic"):
        JobTag("opportunistic", elastic=value)


@pytest.mark.parametrize("value", ["3:2", "0:2", "1:65", "01:2", "1:2 ", "", "x"])
def test_a_damaged_field_names_elastic(value: str) -> None:
    text = f"antman:class=opportunistic;elastic={value}"
    with pytest.raises(TagError, match="elastic") as e:
        parse_tag(text)
    assert isinstance(e.value, ValueError)
    # Slurm's readers (squeue views, the coordinator) keep the job's class and say what is wrong
    read = read_admin_comment(text)
    assert read.job_class == "opportunistic" and read.tag is None and "elastic" in read.problem


def test_parse_elastic_bounds() -> None:
    assert parse_elastic("1:1") == (1, 1)
    assert parse_elastic(f"{ELASTIC_MAX}:{ELASTIC_MAX}") == (ELASTIC_MAX, ELASTIC_MAX)
    with pytest.raises(TagError, match="MIN <= MAX"):
        parse_elastic("5:4")


# ---- what a range means on a node: elastic_kind ---------------------------------------------------

@pytest.mark.parametrize("elastic, gpus, kind", [
    ((1, 2), 2, ONE_NODE),         # --gres=gpu:2 --antman-elastic=1:2
    ((2, 2), 2, ONE_NODE),         # MIN == MAX: elastic in name, one width
    ((1, 1), 1, ONE_NODE),
    ((2, 8), 2, ACROSS_NODES),     # --array=0-3 --gres=gpu:2 --antman-elastic=2:8
    ((8, 8), 2, ACROSS_NODES),     # MIN == MAX across nodes: every task needed
    ((1, 4), 1, ACROSS_NODES),     # one GPU per task: any MIN
    ((4, 12), 3, None),            # MIN not a multiple of the task's GPUs
    ((3, 8), 2, None),
    ((1, 4), 2, None),             # an admin's edit job_submit.lua would refuse: not elastic
    ((2, 6), 4, None),             # MAX not a multiple of the node's GPUs
    ((1, 2), 4, None),             # MAX below the GPUs held
    ((1, 2), 0, None),             # no GPU here
    (None, 2, None),               # no range
])
def test_elastic_kind(elastic, gpus: int, kind) -> None:
    assert elastic_kind(elastic, gpus) == kind


def test_elastic_kind_reads_a_parsed_tag() -> None:
    tag = parse_tag("antman:class=opportunistic;elastic=4:8;gpus=n1:0+1")
    assert elastic_kind(tag.elastic, 2) == ACROSS_NODES and elastic_kind(tag.elastic, 8) == ONE_NODE
    assert ONE_NODE != ACROSS_NODES
