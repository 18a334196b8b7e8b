"""trainbox/run/ranks.py: the one reader of the launcher's rank variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE) that the memory plan, FSDP2's re-shard choice, the throughput line, the output writer, GPU
placement and the exit deadline all use."""

from __future__ import annotations

from hypothesis import given, strategies as st

from trainbox.run import ranks

NAMES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")


def test_torchruns_variables_are_read():
    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "11", "LOCAL_RANK": "3"}
    got = ranks.world_size(env), ranks.local_world_size(env), ranks.rank(env), ranks.local_rank(env)
    assert got == (16, 8, 11, 3)
    assert ranks.distributed(env) and ranks.nodes(env) == 2


def test_a_plain_process_is_one_rank_zero():
    assert (ranks.world_size({}), ranks.local_world_size({}), ranks.rank({}), ranks.local_rank({})) == (1, 1, 0, 0)
    assert not ranks.distributed({}) and ranks.nodes({}) == 1
    assert not ranks.distributed({"WORLD_SIZE": "1"}) and ranks.distributed({"WORLD_SIZE": "2"})


def test_without_local_world_size_each_rank_counts_as_a_node_of_its_own():
    """The memory-safe reading (FSDP2 re-shards after forward as across nodes; the plan's advice names nodes)."""
    assert ranks.local_world_size({"WORLD_SIZE": "4"}) == 1 and ranks.nodes({"WORLD_SIZE": "4"}) == 4
    assert ranks.local_world_size({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "9"}) == 2  # never more than the run


def test_an_uneven_layout_spans_every_node_it_touches():
    """3 ranks at 2 per node are 2 nodes: FSDP2 re-shards as across nodes (as it did when it compared the sizes)."""
    env = {"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}
    assert ranks.nodes(env) == 2
    assert ranks.nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) == 1


def test_fsdp_reshards_only_across_nodes(monkeypatch):
    from trainbox.training import speed

    for world, local, across in (("8", "8", False), ("16", "8", True), ("3", "2", True), ("1", None, False)):
        monkeypatch.setenv("WORLD_SIZE", world)
        if local is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert speed.reshards_after_forward(memory_first=False) is across, (world, local)
        assert speed.reshards_after_forward(memory_first=True) is True


def test_os_environ_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert ranks.world_size() == 4 and ranks.nodes() == 1 and ranks.local_rank() == 2
    monkeypatch.delenv("WORLD_SIZE")
    assert not ranks.distributed()


@given(st.dictionaries(st.sampled_from(NAMES), st.text(max_size=12)))
def test_any_text_is_an_answer_not_a_traceback(env):
    world, local = ranks.world_size(env), ranks.local_world_size(env)
    assert world >= 1 and 1 <= local <= world and ranks.nodes(env) >= 1
    assert ranks.rank(env) >= 0 and ranks.local_rank(env) >= 0
    assert ranks.distributed(env) == (world > 1)
    for junk in ("", "two", "-3", "1.5"):
        assert ranks.world_size({"WORLD_SIZE": junk}) == 1 and ranks.rank({"RANK": junk}) == 0
