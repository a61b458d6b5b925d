"""The cost model, the policy search and ``tiergen plan``, with a fixed hand-made calibration."""

import argparse
import dataclasses

import pytest
import torch

from tiergen import LLM, SamplingParams, TiergenError
from tiergen.config import ModelConfig, MoEConfig
from tiergen.engine.executor import block_needs
from tiergen.kernels import AMX_PROMPT
from tiergen.models import build_model
from tiergen.offload.memory import Budgets
from tiergen.offload.policy import Policy
from tiergen.offload.weights import WeightPlan
from tiergen import calibration, cli
from tiergen.planner import calibrate, paper, search
from tiergen.calibration import Calibration
from tiergen.planner.cost import PlacedWeights, Workload, blocks, estimate, touched_experts
from tiergen.planner.search import choose_policy, format_plan, kv_cache_line, plan, policy_flags
from tiergen.weights import open_model
from tiny_models import build

CPU = Calibration(hardware={}, disk_read=2.5e9, host_to_device=12e9, device_to_host=12e9,
                  host_memcpy=12e9, matmul={"float32": 150e9, "bfloat16": 400e9},
                  gemv={"float32": 20e9, "bfloat16": 13e9}, cpu_attention=30e9,
                  measured_at="2025-01-01T00:00:00+00:00", seconds=1.0)
GPU = dataclasses.replace(CPU, host_to_device=25e9, device_to_host=25e9,
                          matmul={"float32": 50e12, "bfloat16": 400e12},
                          gemv={"float32": 2e12, "bfloat16": 2e12}, device="cuda:0")
SMOL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                   intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                   max_position=8192, tie_word_embeddings=True)
LLAMA7B = dataclasses.replace(SMOL, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                              tie_word_embeddings=False)
BF16 = torch.bfloat16
WORK = Workload(prompt_len=64, gen_len=32, batch=32)
ALL_ON_DEVICE = ((100, 0), (100, 0), (100, 0))


def placement(p: Policy) -> tuple:
    return p.weights, p.cache, p.hidden


def needs_of(cfg, dtype, policy, work, device_type="cpu", chunk=None):
    """block_needs of the policy's first block, with prefill steps of ``chunk`` tokens
    (default: the whole prompt)."""
    weights = WeightPlan.make(build_model(cfg), dtype, policy, torch.device(device_type))
    rows = blocks(policy, work.batch, 64)[0]
    capacity = work.prompt_len + work.gen_len
    return block_needs(weights, cfg, dtype, policy, [(r, capacity) for r in rows],
                       chunk or work.prompt_len)


def ram_used(needs, device_type="cpu"):
    return needs["host"] + (needs["device"] if device_type == "cpu" else 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Config and directory of tiny random models, built once per case."""
    made = {}

    def get(case):
        if case not in made:
            d = tmp_path_factory.mktemp(case)
            build(case, d)
            made[case] = (open_model(d).config, d)
        return made[case]
    return get


# (a) no budget pressure: everything on the device ---------------------------------------

@pytest.mark.parametrize("device_type,cal", [("cpu", CPU), ("cuda", GPU)])
def test_no_budget_puts_everything_on_the_device(device_type, cal):
    policy, _ = choose_policy(SMOL, BF16, WORK, cal, device_type, Budgets())
    assert placement(policy) == ALL_ON_DEVICE
    assert not (policy.compress_weights or policy.compress_cache or policy.cpu_attention)
    assert policy.gpu_batch_size * policy.num_gpu_batches == WORK.batch


def test_search_places_the_weights_once_a_split_and_bisects_each_blocks_chunk(monkeypatch):
    """What keeps the search quick on a 32-layer model, counted rather than timed: the weights
    are placed once per split and compression (not per cache option or block shape), and
    each block's prefill chunk is found by bisection."""
    calls = {"placed": 0, "steps": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(PlacedWeights, "make", counted("placed", PlacedWeights.make))
    monkeypatch.setattr(search, "step_needs", counted("steps", search.step_needs))
    work = Workload(512, 32, 64)
    for device_type, cal, budgets in [("cpu", CPU, Budgets(host=8 << 30)),
                                      ("cuda", GPU, Budgets(device=8 << 30, host=10 << 30))]:
        calls.update(placed=0, steps=0)
        assert plan(LLAMA7B, BF16, work, cal, device_type, budgets)
        splits = len(search.weight_splits(device_type)) * len(search.expert_options(LLAMA7B, device_type))
        assert calls["placed"] <= 2 * splits  # weights as they are, and compressed
        blocks_tried = (splits * 4 * len(search.cache_options(device_type))
                        * sum(len(counts) for _, counts in search.batch_shapes(work.batch)))
        assert calls["steps"] <= blocks_tried * (work.prompt_len.bit_length() + 1)


# (b) the chosen plan fits, and the executor takes it -------------------------------------

@pytest.mark.parametrize("device_type,cal", [("cpu", CPU), ("cuda", GPU)])
@pytest.mark.parametrize("fraction", [0.9, 0.6, 0.35, 0.2])
def test_chosen_plan_fits_the_budget(device_type, cal, fraction):
    full = needs_of(SMOL, BF16, Policy(gpu_batch_size=32), WORK, device_type)
    budgets = (Budgets(host=int(fraction * ram_used(full))) if device_type == "cpu" else
               Budgets(device=int(fraction * full["device"]), host=int(fraction * full["device"])))
    for e in plan(SMOL, BF16, WORK, cal, device_type, budgets):
        assert e.memory == needs_of(SMOL, BF16, e.policy, WORK, device_type, e.prefill_chunk)
        assert not search.over_budget(e.memory, budgets, device_type)
        assert budgets.host is None or ram_used(e.memory, device_type) <= budgets.host
    policy, _ = choose_policy(SMOL, BF16, WORK, cal, device_type, budgets)
    assert policy != Policy(gpu_batch_size=32)  # the unconstrained plan did not fit


def test_executor_runs_the_chosen_plan_and_plans_the_same_memory(tiny, tmp_path):
    cfg, path = tiny("llama-gqa-tied")
    work = Workload(prompt_len=40, gen_len=4, batch=8)  # a cache worth offloading
    full = needs_of(cfg, torch.float32, Policy(gpu_batch_size=8), work)
    budget = int(0.7 * ram_used(full))
    policy, e = choose_policy(cfg, torch.float32, work, CPU, "cpu", Budgets(host=budget))
    assert ram_used(e.memory) <= budget < ram_used(full)
    policy = dataclasses.replace(policy, offload_dir=tmp_path / "offload")
    llm = LLM(path, dtype="float32", policy=policy, host_memory=budget)
    out = llm.generate([list(range(i, i + work.prompt_len)) for i in range(work.batch)],
                       SamplingParams(max_tokens=work.gen_len, temperature=0, ignore_eos=True))
    assert [len(r.token_ids) for r in out] == [work.gen_len] * work.batch
    assert llm.last_stats.planned == e.memory  # (d): the run's own accounting


# (c) nothing fits ----------------------------------------------------------------------

def test_nothing_fits_says_what_and_how_to_fix():
    with pytest.raises(TiergenError, match=r"no offloading policy fits 32 prompt.*smallest plan "
                                           r"found \(--percent .*needs .* of host memory.*raise "
                                           r"--host-memory to at least"):
        choose_policy(SMOL, BF16, WORK, CPU, "cpu", Budgets(host=20 << 20))
    with pytest.raises(TiergenError, match=r"device memory.*--device-memory.*allow compression"):
        choose_policy(SMOL, BF16, WORK, GPU, "cuda", Budgets(device=20 << 20),
                      allow_compression=False)
    assert plan(SMOL, BF16, WORK, CPU, "cpu", Budgets(host=20 << 20)) == []


# (d) memory is block_needs -------------------------------------------------------------

@pytest.mark.parametrize("policy", [
    Policy(), Policy(weights=(30, 0), cache=(50, 0), gpu_batch_size=8, num_gpu_batches=2),
    Policy(weights=(0, 50), cache=(0, 100), cpu_attention=True, gpu_batch_size=16),
    Policy(weights=(50, 0), compress_weights=True, compress_cache=True, gpu_batch_size=5)])
def test_estimate_memory_is_block_needs(policy):
    for device_type in ("cpu", "cuda"):
        e = estimate(SMOL, BF16, policy, WORK, CPU, device_type)
        assert e.memory == needs_of(SMOL, BF16, policy, WORK, device_type)


# (e) monotonicity ----------------------------------------------------------------------

def total_seconds(cal, policy, device_type="cpu", cfg=SMOL):
    e = estimate(cfg, BF16, policy, WORK, cal, device_type)
    return e.prefill_seconds + e.decode_seconds


@pytest.mark.parametrize("field,policy,device_type", [
    ("disk_read", Policy(weights=(20, 0), gpu_batch_size=32), "cpu"),
    ("disk_read", Policy(cache=(0, 0), gpu_batch_size=32), "cpu"),
    ("host_to_device", Policy(weights=(0, 100), gpu_batch_size=32), "cuda"),
    ("cpu_attention", Policy(gpu_batch_size=32), "cpu"),
    ("host_memcpy", Policy(weights=(0, 0), compress_weights=True, gpu_batch_size=32), "cpu")])
def test_faster_links_predict_less_time(field, policy, device_type):
    cal = GPU if device_type == "cuda" else CPU
    if field == "disk_read":  # a slow disk, so that it binds
        cal = dataclasses.replace(cal, disk_read=cal.disk_read / 100)
    faster = dataclasses.replace(cal, **{field: getattr(cal, field) * 4})
    assert total_seconds(faster, policy, device_type) < total_seconds(cal, policy, device_type)


def test_faster_matmuls_predict_less_time():
    policy = Policy(gpu_batch_size=32)
    faster = dataclasses.replace(CPU, matmul={k: 4 * v for k, v in CPU.matmul.items()},
                                 gemv={k: 4 * v for k, v in CPU.gemv.items()})
    assert total_seconds(faster, policy) < total_seconds(CPU, policy)


@pytest.mark.parametrize("prompt_len,faster", [(512, True), (AMX_PROMPT // 2, False)])
def test_a_long_prompts_packed_products_take_the_rates_measured_on_amx(prompt_len, faster):
    """Where calibration timed packed products on AMX tiles (packed-amx-), a prompt of
    AMX_PROMPT tokens or more is predicted at those rates; shorter prompts and the decode
    steps keep the integer kernels' (kernels.amx_prompt)."""
    packed = {"1": 50e9, "8": 10e9, "256": 1e9}
    cal = dataclasses.replace(CPU, linear_rows={"float32": packed, "packed-float32": packed})
    amx = dataclasses.replace(cal, linear_rows={**cal.linear_rows,
                                                "packed-amx-float32": {"128": 4e9, "512": 2e9}})
    placed = PlacedWeights.make(SMOL, torch.float32, Policy(), "cpu")
    placed.layers = [dataclasses.replace(s, packed_params=s.params) for s in placed.layers]
    work = Workload(prompt_len=prompt_len, gen_len=8, batch=4)
    with_amx, without = (estimate(SMOL, torch.float32, Policy(), work, c, placed=placed)
                         for c in (amx, cal))
    assert (with_amx.prefill_seconds < without.prefill_seconds) == faster
    assert with_amx.decode_seconds == without.decode_seconds


@pytest.mark.parametrize("prompt_len", [512, AMX_PROMPT // 2])
def test_a_prompts_attention_takes_the_rate_calibration_measured(prompt_len):
    """A prompt step's attention FLOPs run at the rate measured for a prompt's attention (a
    long prompt's on the integer path: on AMX tiles, "amx-"), not at the GEMM rate; decode
    steps are not affected."""
    work = Workload(prompt_len=prompt_len, gen_len=8, batch=4)
    fast, slow, tiles = ({"float32": 1e15}, {"float32": 1e9},
                         {"float32": 1e9, "amx-float32": 1e15})
    est = {name: estimate(SMOL, torch.float32, Policy(), work,
                          dataclasses.replace(CPU, prompt_attention=rates))
           for name, rates in (("fast", fast), ("slow", slow), ("tiles", tiles))}
    assert est["fast"].prefill_seconds < est["slow"].prefill_seconds
    long = prompt_len >= AMX_PROMPT
    assert (est["tiles"].prefill_seconds == est["fast"].prefill_seconds) == long
    assert (est["tiles"].prefill_seconds == est["slow"].prefill_seconds) == (not long)
    assert est["fast"].decode_seconds == est["slow"].decode_seconds


def test_compression_speeds_up_disk_bound_decode():
    for field in ("weights", "cache"):
        plain = Policy(**{field: (0, 0)}, gpu_batch_size=32)
        packed = dataclasses.replace(plain, **{f"compress_{field}": True})
        slow = dataclasses.replace(CPU, disk_read=0.3e9)
        a, b = (estimate(SMOL, BF16, p, WORK, slow) for p in (plain, packed))
        assert b.decode_seconds < a.decode_seconds
        assert b.memory["disk"] < a.memory["disk"]


def test_more_micro_batches_per_block_amortise_disk_weights():
    one = estimate(SMOL, BF16, Policy(weights=(0, 0), gpu_batch_size=8), WORK, CPU)
    four = estimate(SMOL, BF16, Policy(weights=(0, 0), gpu_batch_size=8, num_gpu_batches=4),
                    WORK, CPU)
    assert four.decode_tok_s > one.decode_tok_s
    assert one.binds == "weights_load"


def test_moe_reads_only_touched_experts(tiny):
    cfg = dataclasses.replace(SMOL, architecture="MixtralForCausalLM", num_layers=4,
                              moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=1536))
    assert touched_experts(1 * 2, 8) == pytest.approx(8 * (1 - (7 / 8) ** 2))
    assert touched_experts(10_000, 8) == pytest.approx(8)
    disk = Policy(weights=(0, 0), gpu_batch_size=1)
    single = estimate(cfg, BF16, disk, Workload(16, 8, 1), CPU)
    many = estimate(cfg, BF16, dataclasses.replace(disk, gpu_batch_size=32), Workload(16, 8, 32),
                    CPU)
    assert single.per_layer["weights_load"] < many.per_layer["weights_load"]


# (f), (g) the report -------------------------------------------------------------------

def test_format_plan_names_flags_tiers_and_speed():
    _, e = choose_policy(SMOL, BF16, WORK, CPU, "cpu", Budgets(host=120 << 20))
    text = format_plan(e, SMOL, BF16)
    for word in ("--percent", "--gpu-batch-size", "--num-gpu-batches", "device", "host", "disk",
                 "prefill", "decode", "tok/s", "binds", "per token", "GQA"):
        assert word in text
    assert search.policy_flags(e.policy) in text
    gpu = dataclasses.replace(e, policy=Policy(weights=(0, 100), cache=(0, 100),
                                               cpu_attention=True, compress_weights=True))
    assert "--percent 0 100 0 100 100 0" in format_plan(gpu, SMOL, BF16)
    assert "--cpu-attention --compress-weights" in format_plan(gpu, SMOL, BF16)


def test_kv_cache_line_tells_mla_gqa_and_windows_apart(tiny):
    lines = {case: kv_cache_line(tiny(case)[0], torch.float32)
             for case in ("deepseek-v2", "llama-gqa-tied", "mistral-window", "llama-mha")}
    assert len(set(lines.values())) == 4
    assert "MLA latent" in lines["deepseek-v2"] and "GQA" not in lines["deepseek-v2"]
    assert "GQA" in lines["llama-gqa-tied"] and "window" not in lines["llama-gqa-tied"]
    assert "rolling window 8" in lines["mistral-window"]
    assert "MHA" in lines["llama-mha"]
    mla = tiny("deepseek-v2")[0]
    # (kv_lora_rank 32 + rope 8) numbers * 4 bytes * 3 layers
    assert mla.kv_bytes_per_token(4) == (32 + 8) * 4 * 3
    assert f"{(32 + 8) * 4 * 3} B per token" in lines["deepseek-v2"]


def test_every_family_is_estimated(tiny):
    for case in ("deepseek-v2", "mixtral", "mistral-window", "gemma3-window4"):
        cfg = tiny(case)[0]
        work = Workload(12, 6, 4)
        policy, e = choose_policy(cfg, torch.float32, work, CPU, "cpu", Budgets())
        assert placement(policy) == ALL_ON_DEVICE and e.total_tok_s > 0
        squeezed = Budgets(device=e.memory["device"] * 4 // 5)
        assert plan(cfg, torch.float32, work, GPU, "cuda", squeezed)


# the command ---------------------------------------------------------------------------

def run_plan(argv, monkeypatch, cal=CPU):
    monkeypatch.setattr(calibrate, "load", lambda device: cal)
    parser = argparse.ArgumentParser()
    cli.add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_plan_command_prints_the_plan(tiny, monkeypatch, capsys):
    _, path = tiny("llama-gqa-tied")
    argv = ["-m", str(path), "--prompt-len", "8", "--gen-len", "4", "--batch", "8",
            "--dtype", "float32", "--device", "cpu", "--host-memory", "400K", "--top", "3"]
    assert run_plan(argv, monkeypatch) == 0
    out = capsys.readouterr().out
    assert "--percent" in out and "tok/s" in out and out.count("  or  ") == 2


def test_plan_command_plans_a_packed_model_in_the_dtype_it_runs(monkeypatch, capsys):
    """A GGUF model's matrices stay packed and it runs in float32 on a CPU (resolve_dtype),
    whatever bfloat16 would do for its checkpoint: the plan is for that dtype, here or on a
    machine profile (CPU's bfloat16 matmul is measured faster than its float32)."""
    argv = ["-m", "smollm2", "--prompt-len", "8", "--gen-len", "4", "--device", "cpu"]
    assert run_plan(argv, monkeypatch) == 0
    assert "float32 on cpu" in capsys.readouterr().out
    assert paper.default_dtype(CPU, torch.bfloat16, packed=True) == torch.float32
    assert paper.default_dtype(CPU, torch.float32) == torch.bfloat16


def test_plan_command_measures_when_uncalibrated(tiny, monkeypatch, capsys):
    _, path = tiny("llama-gqa-tied")
    monkeypatch.setattr(calibrate, "get", lambda device, progress=False: CPU)
    assert run_plan(["-m", str(path), "--device", "cpu", "--prompt-len", "4", "--gen-len", "2"],
                    monkeypatch, cal=None) == 0
    assert "not calibrated yet" in capsys.readouterr().err


@pytest.mark.parametrize("argv,match", [
    (["--host-memory", "1K", "--prompt-len", "8"], "raise --host-memory"),
    (["--prompt-len", "0"], "--prompt-len must be a positive integer"),
    (["--prompt-len", "250", "--gen-len", "10"], "exceeds the model's context")])
def test_plan_command_errors(tiny, monkeypatch, argv, match):
    _, path = tiny("llama-gqa-tied")
    with pytest.raises(TiergenError, match=match):
        run_plan(["-m", str(path), "--device", "cpu", *argv], monkeypatch)


def test_available_ram_reads_proc_meminfo():
    from tiergen.offload.memory import available_ram

    ram = available_ram()
    assert ram is None or ram > 0


def test_moe_plans_can_put_experts_on_disk(tmp_path):
    """Under a budget that holds everything but the routed experts, the plan sends them to
    disk (read only when routed to) rather than streaming whole layers."""
    build("mixtral", tmp_path)
    cfg = open_model(tmp_path).config
    model = build_model(cfg)
    full = WeightPlan.make(model, torch.float32, Policy(), torch.device("cpu")).needs()["device"]
    experts = WeightPlan.make(model, torch.float32, Policy(experts="disk"),
                              torch.device("cpu")).needs()["device"]
    budget = Budgets(host=(full + experts) // 2 + 2**20)
    estimates = plan(cfg, torch.float32, Workload(8, 4, 2), CPU, "cpu", budget,
                     allow_compression=False)
    assert estimates and any(e.policy.experts == "disk" for e in estimates)
    assert "--experts disk" in policy_flags(next(e.policy for e in estimates if e.policy.experts))


# plans on paper: shipped configs and machine profiles ------------------------------------

PARAMETERS = {"llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.55e9, "qwen2.5-72b": 72.71e9,
              "mixtral-8x22b": 140.63e9, "deepseek-v2": 235.74e9,
              "deepseek-v3": 671e9, "gpt-oss-120b": 116.83e9}  # as their model cards
# count (V3's without its multi-token-prediction layer)


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_shipped_configs_have_the_models_sizes(name):

    cfg, dtype = paper.load_config(name)
    model = build_model(cfg)
    specs = [*model.global_specs().values()] + [
        s for j in range(cfg.num_layers) for s in model.layer_specs(j).values()]
    assert sum(torch.Size(s).numel() for s in specs) == pytest.approx(PARAMETERS[name], rel=1e-3)
    assert dtype == torch.bfloat16


def test_plan_on_paper_for_a_shipped_model_and_machine(capsys):
    parser = argparse.ArgumentParser()
    cli.add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "--config", "llama-3.1-70b", "--machine", "t4-flexgen",
                              "--prompt-len", "512", "--gen-len", "32", "--batch", "64"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    # a T4 has no bfloat16: the profile's half precision is used; 140 GB of weights do not
    # fit its 15 GiB, so most of them are off the device
    assert "machine: t4-flexgen" in out and "80 layers, float16 on cuda" in out
    device, host = (int(x) for x in out.split("--percent ")[1].split()[:2])
    assert device < 30 and "tok/s" in out


def test_a_calibration_file_is_a_machine_profile(tmp_path, capsys, monkeypatch):

    cal = dataclasses.replace(CPU, hardware={"cpu": "x", "ram_gib": "24.0"})
    path = calibration.save(cal, tmp_path / "calibration.json")  # as tiergen calibrate writes it
    machine = paper.load_machine(str(path))
    assert machine.calibration == cal and machine.budgets == Budgets(None, 24 * 2**30)
    # CPU with bfloat16 measured faster than float32: auto picks it, as generate would there
    assert paper.default_dtype(cal, None) == torch.bfloat16
    parser = argparse.ArgumentParser()
    cli.add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "--config", "llama-3.1-8b", "--machine", str(path),
                              "--host-memory", "6G", "--prompt-len", "16", "--gen-len", "8",
                              "--batch", "32"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "bfloat16 on cpu" in out and "disk" in out


@pytest.mark.parametrize("argv,match", [
    (["--config", "llama-9b"], "model config 'llama-9b' not found: pass a JSON file or one of"),
    (["--config", "llama-3.1-8b", "--machine", "nowhere"], "machine profile 'nowhere' not found"),
    (["--config", "llama-3.1-8b", "--machine", "t4-flexgen", "--device", "cpu"],
     "--device and --machine exclude each other")])
def test_plan_on_paper_errors(argv, match):
    parser = argparse.ArgumentParser()
    cli.add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    with pytest.raises(TiergenError, match=match):
        args.func(args)


def test_a_profile_without_calibration_fields_is_refused(tmp_path):

    bad = tmp_path / "m.json"
    bad.write_text('{"hardware": {}, "disk_read": 1e9}')
    with pytest.raises(TiergenError, match="not a valid machine profile.*missing"):
        paper.load_machine(str(bad))
