"""Mixture of experts and latent attention beyond parity: expert placement, reads of routed
experts only, the MLA cache's size, and absorbed against naive attention."""

from __future__ import annotations

import pytest
import torch

import tiergen.models.moe as moe
from tiergen import LLM, Policy, SamplingParams
from tiergen.config import from_hf_config
from tiergen.errors import TiergenError
from tiergen.offload.experts import HostRates
from tiny_models import CASES, build
from test_offload import PROMPTS, prefill_and_decode_logits, tolerance

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
MOE_CASES = ["deepseek-v2", "deepseek-v2-lite", "deepseek-v3", "deepseek-v32", "glm-moe-dsa",
             "glm4-moe", "glm4-moe-lite", "gpt-oss", "kimi-linear", "minimax-m2", "mixtral", "qwen2-moe",
             "qwen3-moe", "qwen3-next", "qwen3.5-moe"]

EXPERT_POLICIES = {
    "experts-on-disk": dict(experts="disk"),
    "experts-in-host-rest-on-disk": dict(experts="host", weights=(0, 0)),
    "experts-on-disk-micro-batches": dict(experts="disk", weights=(50, 50), gpu_batch_size=2,
                                          num_gpu_batches=3, cache=(0, 0)),
}


@pytest.fixture(scope="module", params=MOE_CASES)
def moe_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    build(request.param, directory)
    return directory


@pytest.fixture(scope="module")
def reference(moe_dir):
    llm = LLM(moe_dir, dtype="float32")
    return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)], prefill_and_decode_logits(llm)


def test_cases_are_listed():
    assert set(MOE_CASES) <= set(CASES)


@pytest.mark.parametrize("name", sorted(EXPERT_POLICIES))
def test_expert_placement_matches_all_on_device(moe_dir, reference, name, tmp_path):
    tokens, logits = reference
    llm = LLM(moe_dir, dtype="float32", policy=Policy(**EXPERT_POLICIES[name], offload_dir=tmp_path))
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens
    tol = tolerance(llm)
    for ours, ref in zip(prefill_and_decode_logits(llm), logits):
        torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


def test_experts_on_disk_read_only_routed_experts(moe_dir, tmp_path, monkeypatch):
    """Each MoE layer call reads exactly the experts its tokens chose, once per block."""
    llm = LLM(moe_dir, dtype="float32", policy=Policy(experts="disk", offload_dir=tmp_path))
    disk = llm.executor.weights.disk
    reads: list[tuple[int, str, int]] = []
    read_row = disk.read_row

    def counting(layer, name, row, out):
        reads.append((layer, name, row))
        return read_row(layer, name, row, out)

    routed: list[set[int]] = []
    route = moe.route

    def recording(cfg, x, gate, *biases):
        ids, weights = route(cfg, x, gate, *biases)
        routed.append(set(ids.flatten().tolist()))
        return ids, weights

    monkeypatch.setattr(disk, "read_row", counting)
    monkeypatch.setattr(moe, "route", recording)
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    cfg = llm.executor.cfg
    moe_layers = [j for j in range(cfg.num_layers) if cfg.is_moe_layer(j)]
    assert routed and len(routed) % len(moe_layers) == 0
    # one block (all prompts in one micro-batch) per step: calls go layer by layer
    names = ["experts.gate_up", "experts.down"]
    names += ["experts.gate_up_bias", "experts.down_bias"] if cfg.moe.expert_bias else []
    expected = []
    for call, experts in enumerate(routed):
        layer = moe_layers[call % len(moe_layers)]
        expected += [(layer, name, e) for e in sorted(experts) for name in names]
    assert sorted(reads) == sorted(expected)
    assert len(reads) < len(names) * cfg.moe.num_experts * len(routed)  # not every expert


def test_mla_cache_holds_only_the_latent(tmp_path):
    build("deepseek-v2", tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    cfg = llm.executor.cfg
    per_token = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    assert cfg.kv_layout() == (1, 1, per_token)
    assert cfg.kv_bytes_per_token(4) == per_token * 4 * cfg.num_layers
    cache = llm.executor.new_cache(batch=3, capacity=10)
    for layer in cache.layers:
        assert layer.numel() == 3 * 10 * per_token
    cache.close()


@pytest.mark.parametrize("case", ["deepseek-v2", "deepseek-v2-lite", "deepseek-v3"])
def test_absorbed_equals_naive(case, tmp_path):
    build(case, tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    absorbed = prefill_and_decode_logits(llm)
    tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    llm.executor.model.absorb = False
    for a, n in zip(absorbed, prefill_and_decode_logits(llm)):
        torch.testing.assert_close(a, n, atol=1e-5, rtol=1e-5)
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens


def test_experts_run_where_cheapest():
    rates = HostRates(host_flops=1e11, host_bandwidth=5e10, link_bandwidth=2e10)
    params = 3 * 4096 * 14336  # a Mixtral expert
    for nbytes in (params * 2, params * 9 // 16):  # bfloat16, Q4_0
        assert rates.on_host(1, nbytes, params, 4096, 2)  # decode: reading beats shipping
        assert not rates.on_host(512, nbytes, params, 4096, 2)  # a long prompt: ship it


def test_bad_moe_configs_are_refused():
    base = dict(architectures=["MixtralForCausalLM"], vocab_size=8, hidden_size=8,
                intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                num_local_experts=4)
    with pytest.raises(TiergenError, match="num_experts_per_tok"):
        from_hf_config(base | dict(num_experts_per_tok=5))
    with pytest.raises(TiergenError, match="num_local_experts"):
        from_hf_config({k: v for k, v in base.items() if k != "num_local_experts"}
                       | dict(num_experts_per_tok=2))
    ds = dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=8, hidden_size=8,
              intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=4,
              kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2)
    with pytest.raises(TiergenError, match="n_group"):
        from_hf_config(ds | dict(topk_method="group_limited_greedy", n_group=3, topk_group=1))
    with pytest.raises(TiergenError, match="topk_method"):
        from_hf_config(ds | dict(topk_method="noaux_tc"))
    v3 = ds | dict(architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(TiergenError, match="scoring_func"):
        from_hf_config(v3 | dict(scoring_func="softmax"))
    with pytest.raises(TiergenError, match="best two"):
        from_hf_config(v3 | dict(n_group=4, topk_group=2))
    assert from_hf_config(v3 | dict(n_group=2, topk_group=1)).moe.scoring == "sigmoid"
    with pytest.raises(TiergenError, match="experts must be one of"):
        Policy(experts="gpu")


def test_glm_and_minimax_configs_are_read_or_refused_by_the_field():
    """Partial rotary as each family writes it, and what tiergen cannot run refused with the
    field that asks for it."""
    base = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                num_experts_per_tok=2, moe_intermediate_size=4)
    glm = base | dict(architectures=["Glm4MoeForCausalLM"], n_routed_experts=4)
    assert from_hf_config(glm).rotary_dim == 16  # GLM-4.5's default: half of a head
    assert from_hf_config(glm | dict(partial_rotary_factor=0.25)).rotary_dim == 8
    assert from_hf_config(glm | dict(rope_parameters=dict(
        rope_type="default", rope_theta=1e6, partial_rotary_factor=1.0))).rotary_dim == 32
    assert from_hf_config(glm).moe.topk_method == "noaux_tc"
    assert from_hf_config(glm | dict(attention_bias=True)).qkv_bias
    assert not from_hf_config(glm | dict(attention_bias=True)).o_bias
    minimax = base | dict(architectures=["MiniMaxM2ForCausalLM"], num_local_experts=4,
                          rotary_dim=16)
    cfg = from_hf_config(minimax)
    assert (cfg.rotary_dim, cfg.qk_norm, cfg.qk_norm_across_heads) == (16, True, True)
    assert cfg.moe.router_bias and cfg.moe.scoring == "sigmoid" and not cfg.moe.shared_intermediate_size
    for bad, match in ((glm | dict(scoring_func="softmax"), "scoring_func 'softmax'"),
                       (minimax | dict(scoring_func="softmax"), "scoring_func 'softmax'"),
                       (minimax | dict(qk_norm_type="per_head"), "qk_norm_type 'per_head'"),
                       (minimax | dict(rotary_dim=15), "rotary_dim or partial_rotary_factor"),
                       (minimax | dict(rotary_dim=64), "rotary_dim or partial_rotary_factor"),
                       (glm | dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)),
                        "rope_type 'longrope'")):
        with pytest.raises(TiergenError, match=match):
            from_hf_config(bad)


def test_measured_rates_fill_in_defaults():
    rates = HostRates.measured(None, 1e10, None)
    assert rates.host_bandwidth == 1e10
    assert rates.host_flops == HostRates().host_flops
    assert rates.link_bandwidth == HostRates().link_bandwidth


def test_calibrated_rates_take_the_host_from_the_cpu_and_the_link_from_the_gpu():
    from test_planner import CPU, GPU
    assert HostRates.calibrated(CPU, GPU) == HostRates(400e9, 12e9, 25e9)
    assert HostRates.calibrated(None, GPU) == HostRates.measured(None, None, 25e9)
    assert HostRates.calibrated(CPU, None) == HostRates.measured(400e9, 12e9, None)
    assert HostRates.calibrated(None, None) == HostRates()


@pytest.mark.parametrize("case", ["deepseek-v3", "glm4-moe"])
def test_multi_token_prediction_layers_are_skipped(case, tmp_path):
    # DeepSeek-V3, Kimi K2 and GLM-4.5 checkpoints carry a next-token-prediction layer after the last
    # one (model.layers.{num_hidden_layers}.*); generation does not use it.
    from safetensors.torch import load_file, save_file

    build(case, tmp_path)
    expected = [r.token_ids for r in LLM(tmp_path, dtype="float32").generate(PROMPTS, GREEDY)]
    (shard,) = tmp_path.glob("*.safetensors")
    tensors = load_file(shard)
    n = sum(k.endswith("input_layernorm.weight") for k in tensors)
    extra = {f"model.layers.{n}.{k.split('.', 3)[3]}": v.clone()
             for k, v in tensors.items() if k.startswith("model.layers.1.")}
    extra |= {f"model.layers.{n}.eh_proj.weight": torch.zeros(64, 128),
              f"model.layers.{n}.enorm.weight": torch.ones(64)}
    save_file(tensors | extra, shard, metadata={"format": "pt"})
    assert [r.token_ids for r in LLM(tmp_path, dtype="float32").generate(PROMPTS, GREEDY)] \
        == expected


def test_expert_cache_keeps_experts_read_from_disk(tmp_path):
    """Experts read from disk stay in a host cache for reuse: the same tokens and logits as
    without it, and a repeated run reads nothing when every expert fits; a small cache holds
    no more than its bytes (the layer in use aside) and still gives the same tokens and
    logits."""
    build("qwen3-moe", tmp_path / "hf")
    plain = LLM(tmp_path / "hf", dtype="float32",
                policy=Policy(experts="disk", expert_cache=0, offload_dir=tmp_path / "a"))
    tokens = [r.token_ids for r in plain.generate(PROMPTS, GREEDY)]
    logits = prefill_and_decode_logits(plain)
    llm = LLM(tmp_path / "hf", dtype="float32",
              policy=Policy(experts="disk", expert_cache="1G", offload_dir=tmp_path / "b"))
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens
    for ours, ref in zip(prefill_and_decode_logits(llm), logits):
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    disk, cache = llm.executor.weights.disk, llm.executor.weights.expert_cache
    assert cache.hits > 0 and cache.used > 0
    before = disk.rows_read
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens
    assert disk.rows_read == before  # every expert came from the cache
    expert = cache.used // len(cache.entries)
    small = LLM(tmp_path / "hf", dtype="float32",
                policy=Policy(experts="disk", expert_cache=3 * expert, offload_dir=tmp_path / "c"))
    assert [r.token_ids for r in small.generate(PROMPTS, GREEDY)] == tokens
    assert small.executor.weights.expert_cache.used <= 3 * expert
    # experts dropped from a full cache lend their tensors to the next ones read
    for ours, ref in zip(prefill_and_decode_logits(small), logits):
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)


def test_a_failed_expert_read_leaves_no_half_read_expert_in_the_cache(tmp_path, monkeypatch):
    """Experts are read on the I/O threads, several at once; a read that fails raises on the
    compute thread, and the expert it was reading is not kept, so the next run reads it
    again and gives the same tokens."""
    build("qwen3-moe", tmp_path / "hf")
    llm = LLM(tmp_path / "hf", dtype="float32",
              policy=Policy(experts="disk", expert_cache="1G", offload_dir=tmp_path / "o"))
    disk, cache = llm.executor.weights.disk, llm.executor.weights.expert_cache
    read_row, failed = disk.read_row, []

    def failing(layer, name, row, out):
        if not failed:
            failed.append((layer, row))
            out.view(torch.uint8).fill_(0xFF)  # (half-written)
            raise OSError("the disk went away")
        return read_row(layer, name, row, out)

    monkeypatch.setattr(disk, "read_row", failing)
    with pytest.raises(OSError, match="the disk went away"):
        llm.generate(PROMPTS, GREEDY)
    assert failed and failed[0] not in cache.entries
    tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    plain = LLM(tmp_path / "hf", dtype="float32",
                policy=Policy(experts="disk", expert_cache=0, offload_dir=tmp_path / "p"))
    assert tokens == [r.token_ids for r in plain.generate(PROMPTS, GREEDY)]


def test_expert_cache_defaults_to_half_the_host_budget_left(tmp_path):
    build("mixtral", tmp_path / "hf")
    free = LLM(tmp_path / "hf", dtype="float32", device="cpu",
               policy=Policy(experts="disk", offload_dir=tmp_path))
    assert free.executor.weight_plan.expert_cache == 0  # no budget: no cache
    needs = free.executor.weight_plan.needs()
    budget = needs["host"] + needs["device"] + 64 * 2**20
    llm = LLM(tmp_path / "hf", dtype="float32", device="cpu", host_memory=budget,
              policy=Policy(experts="disk", offload_dir=tmp_path))
    assert llm.executor.weight_plan.expert_cache == 32 * 2**20
    with pytest.raises(TiergenError, match="memory size"):
        Policy(experts="disk", expert_cache="lots")


@pytest.mark.parametrize("shared_gate", [False, True], ids=["shared", "gated-shared"])
@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_one_tokens_shared_expert_runs_in_the_routed_experts_call(shared_gate, kind,
                                                                monkeypatch):
    """At batch 1 the shared expert (here wider than the routed ones) runs last in the routed
    experts' native call: the same numbers, to the bit, as the experts run one by one and
    the shared expert apart, gated or not."""
    from tiergen import kernels
    from tiergen.config import MoEConfig
    from tiergen.weights.packed import stack
    from tiergen.weights.quant import GGMLType
    from test_packed import random_packed

    hidden, inter, shared, n = 128, 64, 96, 4
    cfg = MoEConfig(num_experts=n, top_k=2, intermediate_size=inter,
                    shared_intermediate_size=shared, shared_gate=shared_gate)
    q4 = GGMLType.Q4_0
    w = {"router": torch.randn(n, hidden, generator=torch.Generator().manual_seed(0)),
         "experts": moe.Experts(
             stack([random_packed(q4, 2 * inter, hidden, seed=e) for e in range(n)]),
             stack([random_packed(q4, hidden, inter, seed=n + e) for e in range(n)])),
         "shared_gate_up": random_packed(q4, 2 * shared, hidden, seed=2 * n),
         "shared_down": random_packed(q4, hidden, shared, seed=2 * n + 1)}
    if shared_gate:
        w["shared_gate"] = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1))
    x = torch.randn(1, 1, hidden, generator=torch.Generator().manual_seed(2))
    calls = []
    one_call = moe.experts_row
    monkeypatch.setattr(moe, "experts_row", lambda *a: calls.append(len(a[1])) or one_call(*a))
    with kernels.activations_set(kind):
        fused = moe.moe_mlp(cfg, w, x)
        assert calls == [cfg.top_k + 1]
        monkeypatch.setattr(moe, "_one_token", lambda *a, **k: None)
        apart = moe.moe_mlp(cfg, w, x)
    assert torch.equal(fused, apart)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_native_routing_chooses_as_the_tensor_operations(rows, method, scoring, monkeypatch):
    """DeepSeek's float32 router on a CPU runs in one native call (tg_route): the same
    experts, best first, as route's tensor operations, and weights within float rounding
    (its sums run in another order), with the choice bias of V3 or without it."""
    from tiergen.config import MoEConfig

    g = torch.Generator().manual_seed(rows)
    cfg = MoEConfig(num_experts=32, top_k=6, intermediate_size=64, router_float32=True,
                    scoring=scoring, topk_method=method, num_groups=4, topk_groups=2,
                    norm_topk_prob=method == "noaux_tc", routed_scaling_factor=2.5)
    x, gate = torch.randn(rows, 256, generator=g), torch.randn(32, 256, generator=g) / 16
    for bias in (None, torch.randn(32, generator=g) / 4):
        assert moe.route_rows(cfg, x, gate, bias) is not None
        native = moe.route(cfg, x, gate, bias)
        with monkeypatch.context() as m:
            m.setattr(moe, "route_rows", lambda *a: None)
            ids, weights = moe.route(cfg, x, gate, bias)
        assert torch.equal(native[0], ids)
        torch.testing.assert_close(native[1], weights, rtol=1e-6, atol=1e-7)
    # a broken hidden state still chooses k distinct experts that exist
    ids, _ = moe.route(cfg, torch.full_like(x, float("nan")), gate, None)
    assert all(sorted(set(row)) == sorted(row) and 0 <= min(row) and max(row) < 32
               for row in ids.tolist())


@pytest.mark.parametrize("n,shared", [(6, 0), (16, 96)], ids=["routed", "shared"])
def test_a_long_prompts_experts_multiply_on_amx_tiles_apart_from_the_others(n, shared,
                                                                           monkeypatch):
    """On the integer path, the tokens of a step's rows on AMX tiles (long prompts) go
    through their shared experts on the tiles too, and through their routed experts there
    where each expert takes a quarter of the tokens or more (routed_on_tiles: 2 of 6 do, 2 of
    16 do not); the other rows' tokens through the integer kernels, apart. Batch invariant,
    each row's numbers are those it gets alone, whatever the tokens beside it chose (one
    token too)."""
    from tiergen import kernels
    from tiergen._platform import amx_usable
    from tiergen.config import MoEConfig
    from tiergen.weights.packed import stack
    from tiergen.weights.quant import GGMLType
    from test_packed import random_packed

    hidden, inter = 128, 64
    cfg = MoEConfig(num_experts=n, top_k=2, intermediate_size=inter,
                    shared_intermediate_size=shared)
    assert moe.routed_on_tiles(cfg) == (n == 6)
    q4 = GGMLType.Q4_0
    w = {"router": torch.randn(n, hidden, generator=torch.Generator().manual_seed(0)),
         "experts": moe.Experts(
             stack([random_packed(q4, 2 * inter, hidden, seed=e) for e in range(n)]),
             stack([random_packed(q4, hidden, inter, seed=n + e) for e in range(n)]))}
    if shared:
        w["shared_gate_up"] = random_packed(q4, 2 * shared, hidden, seed=2 * n)
        w["shared_down"] = random_packed(q4, hidden, shared, seed=2 * n + 1)
    tiled = set()
    real, real_glu = kernels.rounded_linear, kernels.amx_glu  # the products on the tiles
    monkeypatch.setattr(kernels, "rounded_linear",
                        lambda x, w, b=None: tiled.add(tuple(w.shape)) or real(x, w, b))
    monkeypatch.setattr(kernels, "amx_glu",
                        lambda x, w, gelu: tiled.add(tuple(w.shape)) or real_glu(x, w, gelu))
    g = torch.Generator().manual_seed(3)
    for T in (9, 1):
        x = torch.randn(3, T, hidden, generator=g)
        with kernels.activations_set("int8", batch_invariant=True):
            rows = kernels.amx_rows(torch.tensor([300, 20, 300]))
            if rows is None:  # no AMX here: every row on the integer kernels
                assert not amx_usable()
                return
            with kernels.rows_on_amx(rows):
                got = moe.moe_mlp(cfg, w, x)
            alone = []
            for r in range(3):
                with kernels.rows_on_amx(rows[r:r + 1] if rows[r] else None):
                    alone.append(moe.moe_mlp(cfg, w, x[r:r + 1]))
            integer = moe.moe_mlp(cfg, w, x[:1])  # outside a step: the integer kernels
        for r in range(3):
            assert torch.equal(got[r:r + 1], alone[r]), (T, r)
        assert not torch.equal(got[:1], integer)
        torch.testing.assert_close(got[:1], integer, rtol=0.05, atol=0.05 * integer.abs().max())
    routed = {(2 * inter, hidden), (hidden, inter)}
    assert tiled == (routed if n == 6 else {(2 * shared, hidden), (hidden, shared)})
