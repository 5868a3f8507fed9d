"""Losing a whole node: several ft_launcher agents on this machine, each its own node.

Plain c10d flags (`--nnodes 2 --rdzv-backend c10d`), 2 ranks per node, the demo job (its
weights depend only on the steps taken, so a recovered run must end bit-identical to a
fault-free one). A node is lost by SIGKILL or SIGSTOP to its whole process tree.
"""

import pytest

from harness.launcher import warm_popen
from nvrx_core.demo.nodes import LocalCluster, checkpoint_after, wait_for
from nvrx_core.exit_codes import ExitCode
from nvrx_core.report import attribution
from nvrx_core.report.build import build_report

pytestmark = pytest.mark.timeout(300)

def job(run, step_time=0.4):
    """150 steps; the weights depend only on the steps taken, not on their pace. At 0.4 s a step the
    job outlasts what a test does while it trains (spares starting take ~30 s on a loaded machine:
    a job of 6 s was over before they arrived); the fault-free reference runs at full speed."""
    return ["-m", "nvrx_core.demo.train", "--steps", "150", "--step-time", str(step_time), "--ckpt-every", "2",
            "--ckpt-dir", str(run / "ckpt"), "--hash-file", str(run / "weights.sha")]


def finish(nodes, timeout=180):
    codes = {n.name: n.wait(timeout) for n in nodes}
    assert set(codes.values()) == {0}, f"{codes}\n" + "\n".join(n.output()[-2500:] for n in nodes)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    run = tmp_path_factory.mktemp("fault_free")
    with LocalCluster(str(run), job(run, step_time=0.0), popen=warm_popen) as cluster:
        nodes = [cluster.start("a"), cluster.start("b")]
        finish(nodes)
    return (run / "weights.sha").read_text()


def test_a_killed_node_then_a_hung_node_are_each_replaced_by_a_spare(tmp_path, fault_free):
    with LocalCluster(str(tmp_path), job(tmp_path), flags=["--max-restarts", "3"], popen=warm_popen) as cluster:
        a, b = cluster.start("a"), cluster.start("b")
        wait_for(lambda: a.group_ranks() and b.group_ranks(), 120, "a and b in the first round")
        spares = [cluster.start("spare1"), cluster.start("spare2")]  # after: a node's arrival decides its role
        wait_for(lambda: checkpoint_after([a, b], 0), 120, "a first checkpoint")
        rank_a, rank_b = a.group_ranks()[0], b.group_ranks()[0]
        assert {rank_a, rank_b} == {0, 1}
        wait_for(lambda: all(s.events("spare_waiting") for s in spares), 60, "both spares waiting")

        b.kill()  # a node dies: its agent and workers at once
        first = wait_for(lambda: [s for s in spares if s.events("spare_activated")], 60, "a spare activated")[0]
        assert first.events("spare_activated")[0]["group_rank"] == rank_b
        second = next(s for s in spares if s is not first)
        stopped_at = wait_for(lambda: [e["time"] for e in first.events("workers_started")], 60, "spare started")[0]

        wait_for(lambda: checkpoint_after([a, first], stopped_at), 120, "a checkpoint after the first recovery")
        first.stop()  # a node hangs: every process of it stops where it is
        wait_for(lambda: second.events("spare_activated"), 60, "the second spare activated")
        assert second.events("spare_activated")[0]["group_rank"] == rank_b
        finish([a, second])

    assert (tmp_path / "weights.sha").read_text() == fault_free
    assert set(a.group_ranks()) == {rank_a} and len(a.group_ranks()) == 3  # a kept its rank through both
    # reported by whoever found it first: a's watcher, or the leader of the next round (a spare)
    lost = {e["lost_agent"] for n in (a, *spares) for e in n.events("node_lost")}
    assert len(lost) == 2 and first.events("spare_activated")[0]["agent"] in lost
    # `nvrx report` on the run directory (one events file per node) names both lost nodes, no rank
    verdicts = [i.verdict for i in build_report(str(tmp_path)).incidents]
    named = {node for v in verdicts if v.kind == attribution.NODE_LOST for node in v.node.split(", ")}
    assert named == lost and not any(v.culprits for v in verdicts if v.kind == attribution.NODE_LOST), verdicts


def test_without_a_spare_the_job_waits_for_a_replacement_node_with_the_lost_infra_rank(tmp_path, fault_free):
    """Ranks from the scheduler (--ft-use-infra-group-rank, $SLURM_PROCID); no spare: the survivor
    waits until the scheduler brings a node back with the lost one's rank."""
    flags = ["--max-restarts", "3", "--ft-use-infra-group-rank"]
    with LocalCluster(str(tmp_path), job(tmp_path, step_time=0.1), flags=flags, popen=warm_popen) as cluster:
        a = cluster.start("a", env={"SLURM_PROCID": "1"})
        b = cluster.start("b", env={"SLURM_PROCID": "0"})
        wait_for(lambda: checkpoint_after([a, b], 0), 120, "a first checkpoint")
        assert (a.group_ranks(), b.group_ranks()) == ([1], [0])  # the scheduler's, not arrival order
        b.kill()
        wait_for(lambda: a.events("restart_begun"), 60, "the survivor restarting")
        assert a.proc.poll() is None and len(a.group_ranks()) == 1  # waiting, not failed, no round without b
        replacement = cluster.start("replacement", env={"SLURM_PROCID": "0"})
        finish([a, replacement])
    assert replacement.group_ranks() == [0] and a.group_ranks() == [1, 1]
    assert (tmp_path / "weights.sha").read_text() == fault_free


def test_two_nodes_claiming_one_infra_rank_stop_before_any_worker_starts(tmp_path):
    flags = ["--ft-use-infra-group-rank", "--node-rank", "0"]
    with LocalCluster(str(tmp_path), job(tmp_path), nproc_per_node=1, popen=warm_popen) as cluster:
        nodes = [cluster.start("a", flags), cluster.start("b", flags)]
        codes = [n.wait(120) for n in nodes]
    assert codes == [ExitCode.CONFIG_ERROR] * 2, "\n".join(n.output()[-2000:] for n in nodes)
    for node in nodes:
        assert "both claim infra group rank 0" in node.output()
        assert not node.events("workers_started")
    assert not (tmp_path / "ckpt").exists()
