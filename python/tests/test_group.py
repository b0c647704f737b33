"""memra_kv.group against four real memra-kvd processes (four "GPUs" on the host backend): the
group file and the TP x PP layout (the same refusals as client/group_file.h and
core/group_layout.h), group admission (one yes or no; a full rank leaves nothing held; a client
SIGKILLed between reserve and confirm leaks nothing once the deadline passes), group sessions
and group prefixes (found only when every rank holds them, restored byte-identically on all)."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import memra_kv
from memra_kv import plans
from memra_kv.group import (Group, GroupRankError, default_stage_layers, group_from_sockets,
                            parse_group_file, plan_group_layout)
from group_plans import CAPACITY, group_plan
from kvtest import poll_until

HERE = os.path.dirname(os.path.abspath(__file__))
PREFIX_FLAGS = ("--prefix_cache_budget_bytes=16MiB", "--prefix_block_tokens=16")


def start_ranks(kvd, count=4, budgets=None, flags=(), prefix=False):
    budgets = budgets or ["64MiB"] * count
    return [kvd("--budget_bytes=" + budget, *(PREFIX_FLAGS if prefix else ()), *flags)
            for budget in budgets]


def write_group_file(daemons, tp, pp, name="pytest"):
    lines = ["group %s" % name, "tp %d" % tp, "pp %d" % pp]
    lines += ["rank %d %s" % (rank, daemon.socket) for rank, daemon in enumerate(daemons)]
    path = os.path.join(daemons[0].dir, "pytest.group")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def reserved(daemon):
    with daemon.admin() as admin:
        return admin.status().admission.reserved_bytes


def refusal(call):
    with pytest.raises(memra_kv.InvalidArgument) as raised:
        call()
    return raised.value.message


# ---- the group file and the layout (no daemon) --------------------------------------------

def test_group_file_parses_and_refuses_as_the_cpp_parser():
    group = parse_group_file("# g\ngroup g-1\ntp 2\npp 2  # stages\nstage_layers 3,5\n"
                             "rank 1\t/s1\nrank 0 /s0 /a0\nrank 3 /s3\nrank 2 /s2\n", "g.txt")
    assert (group.name, group.tp, group.pp, group.stage_layers) == ("g-1", 2, 2, (3, 5))
    assert [r.socket for r in group.ranks] == ["/s0", "/s1", "/s2", "/s3"]
    assert group.ranks[0].admin_socket == "/a0"
    cases = {
        "tp 1\npp 1\nrank 0 /s\n": "group file g.txt: no `group` line",
        "group g\ntp 2\nsize 4\n": 'group file g.txt line 3: unknown key "size"',
        "group g\ntp 2\ntp 4\n": "line 3: `tp` given twice (line 2 and here)",
        "group g\ntp -2\n": 'line 2: tp "-2" is not a whole number of at most 4294967295',
        "group g/h\n": 'line 1: group name "g/h" is not 1..64 of [A-Za-z0-9._-]',
        "group g\ntp 0\npp 1\n": "line 2: tp 0 x pp 1 is not a group of 1..1024 ranks",
        "group g\ntp 2\npp 2\nstage_layers 10,10,10\n":
            "line 4: stage_layers lists 3 stages for pp 2",
        "group g\ntp 2\npp 2\nrank 4 /s4\n": "line 4: rank 4 is outside tp 2 x pp 2 = 4 ranks",
        "group g\ntp 2\npp 1\nrank 1 /s1\nrank 1 /s2\n":
            "line 5: rank 1 given twice (line 4 and here)",
        "group g\ntp 4\npp 1\nrank 1 /s1\n":
            "group file g.txt: 3 of tp 4 x pp 1 = 4 ranks have no `rank` line: 0, 2, 3",
        "group g\ntp 1\npp 1\nrank 0 run/gpu0.sock\n":
            'line 4: rank 0\'s socket "run/gpu0.sock" is not an absolute path',
        "group g\ntp 2\npp 1\nrank 0 /s0\nrank 1 /s0\n":
            "line 5: socket /s0 of rank 1 is rank 0's too (line 4): one daemon serves one rank",
    }
    for text, message in cases.items():
        assert message in refusal(lambda: parse_group_file(text, "g.txt")), text
    assert "--socket: 1 sockets for tp 2 x pp 1 = 2 ranks" in refusal(
        lambda: group_from_sockets("cli", 2, 1, ["/a"], source="--socket"))


def test_layout_mirrors_core_group_layout():
    assert default_stage_layers(10, 4) == [2, 3, 3, 2]
    llama = plans.model_plan([plans.kv_layer(i, 128, 8) for i in range(32)])
    layout = plan_group_layout(llama, 2, 2)
    assert [(r.rank, r.stage, r.tp_rank, r.layer_lo, r.layer_hi, r.tp_ranks)
            for r in layout.ranks] == [(0, 0, 0, 0, 16, 2), (1, 0, 1, 0, 16, 2),
                                       (2, 1, 0, 16, 32, 2), (3, 1, 1, 16, 32, 2)]
    wide = plan_group_layout(llama, 16, 1)  # one head per rank, each held twice
    assert (wide.stages[0].kv_shards, wide.stages[0].kv_replicas) == (8, 2)
    assert [r.kv_shard for r in wide.ranks[:4]] == [0, 0, 1, 1]
    assert "layer 0 of stage 0 (layers [0, 32)): n_head_kv 8 is not divisible by tp 3" in \
        refusal(lambda: plan_group_layout(llama, 3, 1))
    deepseek = plans.model_plan([plans.latent_layer(i, 576) for i in range(61)],
                                mtp_blocks=[plans.latent_layer(61, 576)])
    mla = plan_group_layout(deepseek, 8, 2)
    assert (mla.stages[1].layer_lo, mla.stages[1].layer_hi, mla.stages[1].mtp_blocks) == \
        (31, 62, 1)
    assert mla.stages[1].latent_replicated and mla.ranks[15].tp_ranks == 1
    hybrid = plans.model_plan([plans.kv_layer(0, 128, 2), plans.recurrent_layer(1, 64, 4, 128)])
    assert "layer 1 of stage 0 (layers [0, 2)): recurrent state is not sharded" in refusal(
        lambda: plan_group_layout(hybrid, 2, 1))


# ---- admission -------------------------------------------------------------------------------

def test_tp4_admission_holds_each_ranks_shard_and_releases_all(kvd):
    daemons = start_ranks(kvd)
    with Group.connect(write_group_file(daemons, 4, 1), "py-group") as group:
        fingerprint = group.register_plan(group_plan())
        costs = group.price(fingerprint, CAPACITY)
        with daemons[0].client() as client:  # a quarter of the heads on every rank
            whole = client.cost(CAPACITY, plan=group_plan())
            quarter = client.cost(CAPACITY, plan=group_plan(), tp_ranks=4)
        assert costs == [quarter.arena_bytes] * 4
        assert quarter.breakdown.kv_bytes_per_token * 4 == whole.breakdown.kv_bytes_per_token

        admission = group.admit(fingerprint, CAPACITY)
        assert [state.phase for state in admission.ranks] == ["confirmed"] * 4
        assert [state.bytes for state in admission.ranks] == costs
        assert [reserved(daemon) for daemon in daemons] == costs
        assert group.release(admission) == sum(costs)
        assert [reserved(daemon) for daemon in daemons] == [0] * 4


def test_a_full_rank_refuses_the_group_and_nothing_is_held(kvd):
    daemons = start_ranks(kvd, budgets=["64MiB", "64MiB", "64MiB", "1MiB"])
    capacity = 4096  # 4 MiB a shard: more than rank 3's whole budget
    with Group.connect(write_group_file(daemons, 4, 1), "py-group") as group:
        fingerprint = group.register_plan(group_plan())
        cost = group.price(fingerprint, capacity)[3]
        with pytest.raises(GroupRankError) as raised:
            group.admit(fingerprint, capacity)
        error = raised.value
        assert (error.rank, error.daemon, error.moved) == (3, daemons[3].socket, ())
        assert error.code == memra_kv.ErrorCode.RESOURCE_EXHAUSTED
        assert isinstance(error.error, memra_kv.AdmissionRefused)
        assert error.error.needed == cost and error.error.budget == 1 << 20
        assert "group 0x%x rank 3/4 (%s): RESOURCE_EXHAUSTED: " % (
            error.group_id, daemons[3].socket) in str(error)
        assert [reserved(daemon) for daemon in daemons] == [0] * 4
        with pytest.raises(GroupRankError) as creating:
            group.create_session(fingerprint, capacity)
        assert creating.value.rank == 3
        assert [reserved(daemon) for daemon in daemons] == [0] * 4
        for daemon in daemons:
            with daemon.admin() as admin:
                assert admin.status().sessions == 0


def test_a_client_killed_between_reserve_and_confirm_leaks_nothing_after_the_deadline(kvd):
    # A lease grace far past the deadline: only the daemons' own deadline sweep can free it.
    daemons = start_ranks(kvd, flags=("--lease_grace_ms=600000",))
    out = os.path.join(daemons[0].dir, "doomed")
    engine = subprocess.Popen([sys.executable, os.path.join(HERE, "group_engine.py"),
                               write_group_file(daemons, 2, 2), out, "1500"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert poll_until(lambda: os.path.exists(out), engine.pid), engine.stdout.read()
        with open(out) as f:
            facts = dict(line.split("=", 1) for line in f.read().split())
        held = [int(b) for b in facts["bytes"].split(",")]
        assert all(b > 0 for b in held)
        assert [reserved(daemon) for daemon in daemons] == held  # PENDING on every rank
    finally:
        engine.send_signal(signal.SIGKILL)
        engine.wait()
    assert poll_until(lambda: [reserved(d) for d in daemons] == [0] * 4, patience=30.0)
    for daemon in daemons:  # the engine is still in its lease grace: the deadline freed it
        with daemon.admin() as admin:
            assert len(admin.engines()) == 1


# ---- sessions and prefixes ---------------------------------------------------------------------

def commit_tokens(group_session, token_ids):
    """Commits token_ids on every rank, writing each rank's own bytes: (rank, layer, kind, row)."""
    transaction = group_session.begin()
    appends = group_session.prepare(transaction, len(token_ids))
    for rank, append in enumerate(appends):
        session = group_session.sessions[rank]
        for layer in append.layers:
            for kind in (memra_kv.KEYS, memra_kv.VALUES):
                rows = session.plane_bytes(layer.layer, kind)
                for row in range(len(token_ids)):
                    rows[layer.write_row + row] = np.uint8(
                        (rank * 61 + layer.layer * 17 + kind * 5 + row) % 251)
    group_session.publish(transaction)
    return group_session.commit(transaction, len(token_ids), token_ids)


def live_bytes(group_session, rows):
    out = []
    for rank, session in enumerate(group_session.sessions):
        for layer in session.layout.layers:
            for kind in (memra_kv.KEYS, memra_kv.VALUES):
                out.append((rank, layer.layer, kind,
                            bytes(session.plane_bytes(layer.layer, kind)[:rows].tobytes())))
    return out


def test_tp2_pp2_session_prefix_restores_byte_identically_on_every_rank(kvd):
    daemons = start_ranks(kvd, prefix=True)
    tokens = [i * 3 + 1 for i in range(64)]
    with Group.connect(write_group_file(daemons, 2, 2), "py-group") as group:
        fingerprint = group.register_plan(group_plan())
        layout = group.layout(fingerprint)
        assert [(r.layer_lo, r.layer_hi, r.tp_ranks) for r in layout.ranks] == \
            [(0, 2, 2), (0, 2, 2), (2, 4, 2), (2, 4, 2)]
        with group.create_session(fingerprint, CAPACITY) as source:
            assert [s.layout.layers[0].layer for s in source.sessions] == [0, 0, 2, 2]
            assert commit_tokens(source, tokens) == 64
            assert source.committed_len() == 64
            written = live_bytes(source, 64)
            assert len({data for _, _, _, data in written}) == len(written)  # all distinct
            captured = group.capture_prefix(source, tokens, 64)
            assert [c.boundary_tokens for c in captured] == [64] * 4

        match = group.lookup_prefix(fingerprint, tokens)
        assert match.matched_tokens == 64 and len(match.entry_ids) == 4
        assert not group.lookup_prefix(fingerprint, [9] * 64).hit
        with group.create_session(fingerprint, CAPACITY) as target:
            assert group.restore_prefix(target, tokens) == 64
            assert target.committed_len() == 64
            assert live_bytes(target, 64) == written

        # Rewind and spec rollback move every rank together.
        with group.create_session(fingerprint, CAPACITY) as session:
            commit_tokens(session, tokens[:32])
            assert session.rewind(16) == 16
            assert [s.committed_len for s in session.states()] == [16] * 4
            with pytest.raises(GroupRankError) as too_far:
                session.rewind(40)
            assert too_far.value.rank == 0 and too_far.value.moved == ()
            assert "cannot rewind to 40 rows" in str(too_far.value)
            assert "[ranks left moved: none]" in str(too_far.value)
            assert session.committed_len() == 16


def test_a_prefix_not_every_rank_holds_is_a_miss_and_restores_nothing(kvd):
    daemons = start_ranks(kvd, prefix=True)
    tokens = [i * 7 + 2 for i in range(32)]
    with Group.connect(write_group_file(daemons, 4, 1), "py-group") as group:
        fingerprint = group.register_plan(group_plan())
        with group.create_session(fingerprint, CAPACITY) as source:
            commit_tokens(source, tokens)
            for rank in (0, 1, 2):  # rank 3 never captures
                session = source.sessions[rank]
                session._client.capture_prefix(session, tokens, 32)
        for rank in (0, 1, 2):  # each daemon alone holds it
            shard = group.layout(fingerprint).ranks[rank]
            assert group.clients[rank].lookup_prefix(
                fingerprint, tokens, layer_lo=shard.layer_lo, layer_hi=shard.layer_hi,
                tp_ranks=shard.tp_ranks).outcome == "hit"
        match = group.lookup_prefix(fingerprint, tokens)
        assert (match.matched_tokens, match.entry_ids) == (0, ())
        with group.create_session(fingerprint, CAPACITY) as target:
            with pytest.raises(memra_kv.NotFound) as missed:
                group.restore_prefix(target, tokens)
            assert "no prefix of the 32 tokens is held by all 4 ranks" in missed.value.message
            assert [s.committed_len for s in target.states()] == [0] * 4


def test_connect_names_a_rank_that_does_not_answer(kvd):
    daemons = start_ranks(kvd, count=1)
    missing = os.path.join(daemons[0].dir, "nobody.sock")
    group_file = group_from_sockets("g", 2, 1, [daemons[0].socket, missing])
    with pytest.raises(GroupRankError) as raised:
        Group.connect(group_file, "py-group", timeout=0.5)
    assert (raised.value.rank, raised.value.daemon) == (1, missing)
    assert raised.value.code == memra_kv.ErrorCode.UNAVAILABLE


def test_a_rank_refusing_commit_leaves_every_rank_at_the_base(kvd):
    daemons = start_ranks(kvd)
    with Group.connect(write_group_file(daemons, 4, 1), "py-group") as group:
        fingerprint = group.register_plan(group_plan())
        with group.create_session(fingerprint, CAPACITY) as session:
            commit_tokens(session, list(range(8)))
            transaction = session.begin()
            assert transaction.base_len == 8
            session.prepare(transaction, 4)
            session.publish(transaction)
            session.sessions[2].taint("pytest: rank 2's memory is suspect")
            with pytest.raises(GroupRankError) as raised:
                session.commit(transaction, 4, [1, 2, 3, 4])
            error = raised.value
            # Ranks 0 and 1 had committed: rewound to the base; 2 refused; 3 aborted.
            assert (error.rank, error.moved) == (2, ())
            assert error.code == memra_kv.ErrorCode.FAILED_PRECONDITION
            assert "group 0x%x rank 2/4 (%s)" % (session.group_id, daemons[2].socket) in str(error)
            assert "[ranks left moved: none]" in str(error)
            assert [s.committed_len for s in session.states()] == [8] * 4
            with pytest.raises(GroupRankError) as begin:  # the tainted rank refuses, others undo
                session.begin()
            assert (begin.value.rank, begin.value.moved) == (2, ())
