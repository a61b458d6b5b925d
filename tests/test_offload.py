"""Every policy gives what the all-on-device run gives: same greedy tokens, same logits."""

from __future__ import annotations

import pytest
import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen.engine.executor import MicroBatch
from tiergen.cache.step import StepMeta
from tiny_models import CASES, build

PROMPTS = [[5], list(range(3, 30)), [7, 8, 9, 10, 11], list(range(50, 62)), [100, 3, 17],
           [9, 9, 9, 9, 9, 9, 9, 9]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

POLICIES = {
    "weights-on-disk": dict(weights=(0, 0)),
    "weights-3-tiers": dict(weights=(30, 30)),
    "cache-on-host-cpu-attention": dict(cache=(0, 100), cpu_attention=True),
    "cache-partly-on-disk": dict(cache=(50, 0)),
    "micro-batches-uneven": dict(gpu_batch_size=2, num_gpu_batches=2),
    "hidden-off-device": dict(hidden=(0, 50), gpu_batch_size=2, num_gpu_batches=2),
    "everything-on-disk": dict(weights=(0, 0), cache=(0, 0), hidden=(0, 0),
                               gpu_batch_size=4, num_gpu_batches=2),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    build(request.param, directory)
    return directory


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, dtype="float32")
    return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)], prefill_and_decode_logits(llm)


def prefill_and_decode_logits(llm: LLM) -> list[torch.Tensor]:
    """Logits of a prefill and two decode steps of all prompts, as blocks of micro-batches
    of the policy's size."""
    ex = llm.executor
    micro = llm.micro_batch
    groups = [PROMPTS[i:i + micro] for i in range(0, len(PROMPTS), micro)]
    states = []
    for g in groups:
        width = max(map(len, g))
        ids = torch.zeros(len(g), width, dtype=torch.long)
        valid = torch.zeros(len(g), width + 2, dtype=torch.bool)
        for row, p in enumerate(g):
            ids[row, width - len(p):] = torch.tensor(p)
            valid[row, width - len(p):width] = True
        states.append((ids, valid, ex.new_cache(len(g), width + 2), width))
    out = []
    for step in range(3):
        block = []
        for ids, valid, cache, width in states:
            start = 0 if step == 0 else width + step - 1
            if step:
                valid[:, start] = True
                ids = torch.full((ids.shape[0], 1), 40 + step)
            block.append(MicroBatch(ids, StepMeta.build(valid, start, ids.shape[1]), cache))
        out.append(torch.cat(ex.forward_block(block)))
    for *_, cache, _ in states:
        cache.close()
    return out


def tolerance(llm: LLM) -> float:
    """How close another policy's logits come: 1e-5, or 1e-4 (as against transformers) where
    linear-attention layers carry the rounding of other batch shapes through their states."""
    return 1e-4 if llm.config.keeps_states else 1e-5


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_matches_all_on_device(model_dir, reference, name, tmp_path):
    tokens, logits = reference
    llm = LLM(model_dir, dtype="float32", policy=Policy(**POLICIES[name], offload_dir=tmp_path))
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens
    tol = tolerance(llm)
    for ours, ref in zip(prefill_and_decode_logits(llm), logits):
        torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    assert not list((tmp_path / "spill").glob("*")), "spill files left behind"


def test_fused_specs_describe_fuse_layer(model_dir):
    """Plans are made from fused_specs without loading; they must match what fusing makes."""
    ex = LLM(model_dir, dtype="float32").executor
    for j, layer in enumerate(ex.weights.resident):
        assert {n: tuple(t.shape) for n, t in layer.items()} == ex.model.fused_specs(j)


# Dense layers of the Llama and Gemma 3 families are row ranges of checkpoint tensors (fused
# q/k/v and gate/up are rows one after the other): read in place. So are stacked routed
# experts and DeepSeek's per-head latent projections, a stack of row ranges each. gpt-oss's
# experts are transposed: converted, while the rest of its layers is read in place.
IN_PLACE = {"llama-mha", "llama-gqa-tied", "llama-mqa-headdim", "llama3-rope", "mistral",
            "mistral-window", "qwen2", "qwen2-window", "qwen2-yarn", "qwen3", "gemma3-window4",
            "gemma3-window8-linear", "mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v2",
            "deepseek-v2-lite", "deepseek-v3", "glm4-moe", "glm4-moe-lite", "minimax-m2", "deepseek-v32", "glm-moe-dsa"}


def test_weights_on_disk_are_read_in_place_where_they_lie(model_dir, tmp_path, request):
    """Weights on disk come straight from the checkpoint's files where a fused tensor is
    row ranges of checkpoint tensors in the compute dtype (nothing converted or copied); only
    the others are converted. Either way they are exactly what fusing makes."""
    from tiergen.offload.disk import CheckpointWeights

    resident = LLM(model_dir, dtype="float32", device="cpu").executor.weights.resident
    llm = LLM(model_dir, dtype="float32", policy=Policy(weights=(0, 0), offload_dir=tmp_path))
    disk = llm.executor.weights.disk
    case = request.node.callspec.params["model_dir"]
    assert isinstance(disk, CheckpointWeights), "some tensors are read in place"
    assert (disk.converted is None) == (case in IN_PLACE), case
    if disk.converted is None:
        assert not list(tmp_path.iterdir()), "nothing is written to the offload directory"
    else:
        converted = {k.split("/")[1] for k in disk.converted.entries}
        assert converted and not converted & {k.split("/")[1] for k in disk.entries | disk.rows}
    for j, layer in enumerate(resident):
        for name, want in layer.items():
            shape, dtype = disk.shape(j, name)
            got = disk.read_into(j, name, torch.empty(shape, dtype=dtype))
            assert torch.equal(got, want), (j, name)


def test_a_dtype_other_than_the_checkpoints_is_converted(model_dir, tmp_path):
    from tiergen.offload.disk import OffloadedWeights

    llm = LLM(model_dir, dtype="bfloat16", policy=Policy(weights=(0, 0), offload_dir=tmp_path))
    assert isinstance(llm.executor.weights.disk, OffloadedWeights)


@pytest.mark.parametrize("change", [lambda t: t * 2, lambda t: t + 1, lambda t: -t,
                                    lambda t: t * 3 - 256, lambda t: t.to(torch.float32)])
def test_a_tensor_fusing_changes_is_not_read_in_place(change):
    """Values changed by fusing are found out; rows only joined (or reordered) are ranges."""
    from tiergen.offload.disk import layer_segments

    specs = {"a": (6, 4), "b": (3, 4), "n": (4,)}
    joined = layer_segments(lambda r: {"ab": torch.cat([r["a"], r["b"]]), "n": r["n"]}, specs)
    assert joined == {"ab": [("a", 0, 6), ("b", 0, 3)], "n": [("n", 0, 4)]}
    assert layer_segments(lambda r: {"n": r["n"].flip(0)}, {"n": (3,)}) == {
        "n": [("n", 2, 1), ("n", 1, 1), ("n", 0, 1)]}
    assert layer_segments(lambda r: {"ab": torch.cat([r["a"], r["b"]]), "n": change(r["n"])},
                          specs) == {"ab": [("a", 0, 6), ("b", 0, 3)]}
