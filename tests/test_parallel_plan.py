"""Planning parallel runs: each rank's share and policy, the run's predicted speed with the
link's costs, the link's measurement, and the commands that use them."""

from __future__ import annotations

import dataclasses

import pytest

from tiergen import TiergenError, cli
from tiergen.offload.memory import Budgets
from tiergen.offload.policy import Policy
from tiergen.parallel.link import measure_link
from tiergen.parallel.stage import layer_costs, split_layers
from tiergen.models import build_model
from tiergen import calibration
from tiergen.planner import calibrate
from tiergen.planner.cost import Workload, estimate
from tiergen.planner.parallel import plan_parallel, rank_calibration, units
from test_planner import BF16, CPU, LLAMA7B, SMOL, WORK, run_plan
from tiny_models import build

LINK = dict(latency=2e-4, bandwidth=2e9, reduce_latency=5e-4, reduce_bandwidth=2e9)
CAL = dataclasses.replace(CPU, hardware={"torch_threads": "4"}, link=LINK)
GiB = 2**30


def with_link(**link):
    return dataclasses.replace(CAL, link={**LINK, **link})


def test_units_deal_micro_batches_as_the_run_does():
    assert units(Policy(), 32, 64, 2) == [[[16], [16]]]
    assert units(Policy(num_gpu_batches=2), 10, 64, 3) == [[[2, 2], [2, 2], [2]]]
    assert units(Policy(gpu_batch_size=4, num_gpu_batches=2), 20, 64, 2) == \
        [[[4], [4]], [[4], [4]], [[4]]]
    assert units(Policy(), 1, 64, 2) == [[[1]]]  # one micro-batch: one unit, nothing overlaps


def test_a_rank_gets_its_share_of_the_cores_and_the_disk():
    cal = rank_calibration(CAL, 2)
    assert cal.matmul["float32"] == CAL.matmul["float32"] / 2
    assert cal.gemv["bfloat16"] == CAL.gemv["bfloat16"] / 2
    assert cal.disk_read == CAL.disk_read / 2
    assert rank_calibration(CAL, 1) is CAL


def test_a_rank_s_products_share_what_all_threads_reach():
    """Interpolated between one thread and four for two threads of four, unless that is more
    than half of what all four reach together (memory-bound rows: the ranks share it)."""
    tables = {"float32": {"1": 8.0, "16": 4.0}, "float32 x1": {"1": 6.0, "16": 1.0}}
    cal = rank_calibration(dataclasses.replace(CAL, linear_rows=tables), 2)
    assert cal.linear_rows == {"float32": {"1": 4.0, "16": 2.0}}  # min(6 + 2/3 * 2, 8 / 2), ...
    tables["float32 x1"]["1"] = 1.0  # threads scale: the interpolation is below the share
    cal = rank_calibration(dataclasses.replace(CAL, linear_rows=tables), 2)
    assert cal.linear_rows["float32"]["1"] == pytest.approx(1 + 7 / 3)


def test_one_rank_is_the_one_process_estimate():
    e = plan_parallel(SMOL, BF16, WORK, CAL, Budgets(), 1, 1, Policy())
    one = estimate(SMOL, BF16, Policy(), WORK, CAL)
    assert e.total_tok_s == pytest.approx(one.total_tok_s, rel=1e-9)
    assert e.decode_tok_s == pytest.approx(one.decode_tok_s, rel=1e-9)


def test_ranks_hold_the_run_s_share_of_the_model():
    whole = estimate(SMOL, BF16, Policy(), WORK, CAL).memory["device"]
    pipe = plan_parallel(SMOL, BF16, WORK, CAL, Budgets(), 2, 1, Policy())
    costs, head = layer_costs(build_model(SMOL))
    assert [r.layers for r in pipe.ranks] == split_layers(costs, 2, head)
    tp = plan_parallel(SMOL, BF16, WORK, CAL, Budgets(), 1, 2, Policy())
    assert [r.layers for r in tp.ranks] == [range(30)] * 2 and [r.shard for r in tp.ranks] == [0, 1]
    for e in (pipe, tp):
        held = [r.estimate.memory["device"] for r in e.ranks]
        assert max(held) < 0.75 * whole and sum(held) > whole


def test_two_ranks_hold_in_ram_what_one_streams_from_disk():
    """A 7B model in bfloat16 (13.5 GB) under 8 GB per process: one process puts weights on
    disk; two pipeline stages or two shards hold theirs in RAM and are predicted faster."""
    work, budgets = Workload(16, 8, 4), Budgets(host=8 * GiB)
    one = plan_parallel(LLAMA7B, BF16, work, CAL, budgets, 1, 1)
    assert one.ranks[0].estimate.memory["disk"] > 0
    for stages, tensor in ((2, 1), (1, 2)):
        e = plan_parallel(LLAMA7B, BF16, work, CAL, budgets, stages, tensor)
        assert all(r.estimate.memory["disk"] == 0 for r in e.ranks)
        assert e.total_tok_s > 1.2 * one.total_tok_s


def test_ranks_agree_on_how_the_batch_is_cut():
    """Under a tight budget each rank offloads what it must; all cut the batch alike (the
    run needs it) and each still fits its budget."""
    budget = 120 << 20
    e = plan_parallel(SMOL, BF16, Workload(512, 256, 64), CAL, Budgets(host=budget), 2, 1)
    assert len({(p.gpu_batch_size, p.num_gpu_batches) for p in e.policies}) == 1
    for r in e.ranks:
        assert r.estimate.memory["device"] + r.estimate.memory["host"] <= budget


@pytest.mark.parametrize("stages,tensor", [(2, 1), (1, 2), (2, 2)])
def test_the_link_s_costs_are_added_per_message(stages, tensor):
    """One sequence (one unit, nothing overlaps): each decode step pays, per stage, one
    message on (one back with the tokens), and per shard two all-reduces a layer and the
    logits' gather; a second of latency each makes the difference exact."""
    work = Workload(16, 9, 1)
    fast = plan_parallel(SMOL, BF16, work, with_link(latency=0, reduce_latency=0), Budgets(),
                         stages, tensor, Policy())
    slow = plan_parallel(SMOL, BF16, work, with_link(latency=1.0, reduce_latency=1.0),
                         Budgets(), stages, tensor, Policy())
    per_step = (stages if stages > 1 else 0) + (2 * SMOL.num_layers + 1 if tensor > 1 else 0)
    assert slow.decode_seconds - fast.decode_seconds == pytest.approx(8 * per_step, abs=0.01)


def test_settings_that_cannot_run_are_refused():
    with pytest.raises(TiergenError, match="2 policies for 4 parallel ranks"):
        plan_parallel(SMOL, BF16, WORK, CAL, Budgets(), 2, 2, [Policy()] * 2)
    with pytest.raises(TiergenError, match="cannot share the model's 3 key-value heads"):
        plan_parallel(SMOL, BF16, WORK, CAL, Budgets(), 1, 2 * 2)
    with pytest.raises(TiergenError,
                       match=r"parallel rank 0 \(layers 0-18\): no offloading policy fits"):
        plan_parallel(SMOL, BF16, WORK, CAL, Budgets(host=1 << 20), 2, 1)


def test_plan_command_prints_every_rank(tmp_path, monkeypatch, capsys):
    build("llama-gqa-tied", tmp_path)
    argv = ["-m", str(tmp_path), "--prompt-len", "8", "--gen-len", "4", "--batch", "8",
            "--dtype", "float32", "--device", "cpu", "--pipeline-parallel", "2",
            "--tensor-parallel", "2"]
    assert run_plan(argv, monkeypatch, cal=CAL) == 0
    out = capsys.readouterr().out
    assert "2 pipeline stage(s) x 2 tensor shard(s)" in out
    for rank, where in enumerate(["layers 0-0, shard 0", "layers 0-0, shard 1",
                                  "layers 1-1, shard 0", "layers 1-1, shard 1"]):
        assert f"rank {rank:<4} {where}: --percent" in out
    assert "all-reduce 500 us" in out and "predicted" in out


def test_plan_command_on_paper_for_a_machine_profile(monkeypatch, capsys):
    assert run_plan(["--config", "llama-3.1-8b", "--machine", "epyc-2core-24g", "--batch", "4",
                     "--prompt-len", "64", "--gen-len", "8", "--pipeline-parallel", "4"],
                    monkeypatch) == 0
    out = capsys.readouterr().out
    assert "rank 3    layers" in out and "predicted" in out


def test_generate_with_policy_auto_plans_each_rank(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(calibrate, "get", lambda device, **kw: CAL)
    args = ["generate", "--max-tokens", "4", "--json", "The capital of France is", "Hello"]
    assert cli.main(args) == 0
    one = capsys.readouterr().out
    assert cli.main(args + ["--policy", "auto", "--pipeline-parallel", "2", "--host-memory",
                            "120M", "--offload-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == one
    assert "rank 1    layers" in captured.err and "predicted decode" in captured.err


def test_the_link_is_measured_between_two_ranks():
    link = measure_link()
    assert set(link) == {"latency", "bandwidth", "reduce_latency", "reduce_bandwidth"}
    assert 0 < link["latency"] < 0.1 and 0 < link["reduce_latency"] < 0.1
    assert link["bandwidth"] > 1e7 and link["reduce_bandwidth"] > 1e7


def test_the_link_is_kept_with_the_calibration(tmp_path):
    path = calibration.save(CAL, tmp_path / "calibration.json")
    data = calibration._read_json(path)
    assert calibration._from_dict(data["cpu"]).link == LINK
    with pytest.raises(ValueError):
        calibration._from_dict({**data["cpu"], "link": {"latency": -1}})
