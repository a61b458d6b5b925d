"""FlexGen's schedule on a GPU: its pieces that a CPU can check (where prompt and decode
attention run, the order of asynchronous stores), and, where a GPU is present, exactness
against transformers and peaks within the device budget."""

import pytest
import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen.config import ModelConfig
from tiergen.cache.step import StepMeta
from tiergen.offload.kv import Stores, TieredKV, _Store, cache_moves
from tiny_models import build

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64,
                  intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  max_position=256)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cpu_attention_only_in_decode():
    """Under cpu_attention a cache in host RAM moves to the device for a prompt step (its
    attention runs there) and stays put for a decode step (attention on the CPU)."""
    assert cache_moves("host", "cuda", False, True, prompt=True)
    assert not cache_moves("host", "cuda", False, True, prompt=False)
    assert cache_moves("host", "cuda", False, False, prompt=False)
    assert not cache_moves("host", "cpu", False, True, prompt=True)  # host RAM is the device
    # a stand-in device with no memory of its own: where each step's view lives
    kv = TieredKV(CFG, 2, 16, torch.float32, torch.device("meta"), ["host", "host"], None,
                  cpu_attention=True)
    assert kv.load(0, 0, prompt=True).k.device.type == "meta"  # prompt: on the device
    assert kv.load(0, 8, prompt=False).k.device.type == "cpu"  # decode: in host RAM


class Event:
    """A copy's event that passes only when told to, and records who waited on it."""

    def __init__(self, log, name):
        self.log, self.name, self.passed = log, name, False

    def synchronize(self):
        self.log.append(("synchronize", self.name))
        self.passed = True

    def wait(self, stream=None):
        self.log.append(("wait", self.name))


def test_stores_land_in_order_and_buffers_wait_for_their_copies():
    stores, log = Stores(torch.device("cpu")), []
    work, other = torch.arange(8.0), torch.zeros(8)
    host = torch.zeros(2, 8)
    for j, value in enumerate((1.0, 2.0)):  # two layers' stores from the same buffer
        work.fill_(value)
        staged = work.clone()  # what the copy stream would have put in pinned staging
        stores.pending.setdefault(j, []).append(_Store(Event(log, j), staged, host[j], work))
    assert not host.any()  # nothing lands before its copy has passed
    stores.before_reuse(other)
    assert log == []  # no store reads that buffer
    stores.before_reuse(work)
    assert log == [("wait", 0), ("wait", 1)]  # the next write waits for both copies
    stores.settle(1)
    assert host[1].eq(2).all() and not host[0].any() and log[-1] == ("synchronize", 1)
    stores.settle()
    assert host[0].eq(1).all() and not stores.pending


@torch.inference_mode()  # as the executor runs
def test_a_cache_reads_back_what_it_stored_in_order(tmp_path):
    """Stores of successive steps (a compressed cache moves on a CPU) read back in order."""
    kv = TieredKV(CFG, 2, 16, torch.float32, torch.device("cpu"), ["host", "disk"], tmp_path,
                  compress=(8, 16))
    valid = torch.ones(2, 16, dtype=torch.bool)
    want = torch.randn(2, 2, 2, 2, 16, 16)  # layer, K|V, row, head, slot, dim
    for start, n in [(0, 5), (5, 3), (8, 1)]:
        meta = StepMeta.build(valid, start, n)
        for j in range(2):
            view = kv.load(j, start, prompt=n > 1)
            view.kv[:, :, :, start:start + n] = want[j][:, :, :, start:start + n]
            kv.store(j, view, meta)
    for j in range(2):
        got = kv.load(j, 9).kv[:, :, :, :9]
        assert torch.allclose(got, want[j][:, :, :, :9], atol=0.05)
    kv.close()


# -- on a GPU ------------------------------------------------------------------------------

POLICIES = {"resident": Policy(),
            "weights-in-host": Policy(weights=(0, 100), pin_memory=True),
            "cache-in-host-cpu-attention": Policy(cache=(0, 100), cpu_attention=True),
            "weights-on-disk": Policy(weights=(0, 0))}


@cuda
@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("case", ["llama-gqa-tied", "qwen2", "mistral-window"])
def test_greedy_tokens_equal_transformers_on_a_gpu(tmp_path, case, name):
    import dataclasses
    hf = build(case, tmp_path / "m").to("cuda")
    prompts = [[5, 9, 17, 3, 44, 2, 8], [7, 1, 2], [11] * 20]
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=8, do_sample=False)
        want.append(out[0, len(p):].tolist())
    policy = dataclasses.replace(POLICIES[name], offload_dir=tmp_path / "offload")
    llm = LLM(tmp_path / "m", dtype="float32", device="cuda", policy=policy)
    got = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [r.token_ids for r in got] == want


@cuda
@pytest.mark.parametrize("budget_mib", [80, 160])
@pytest.mark.parametrize("rows,prompt", [(4, 200), (16, 96)])
def test_device_peak_within_the_budget(tmp_path, budget_mib, rows, prompt):
    build("llama-gqa-tied", tmp_path / "m", hidden_size=512, intermediate_size=2048,
          num_hidden_layers=4, vocab_size=8192, max_position_embeddings=1024)
    budget = budget_mib << 20
    llm = LLM(tmp_path / "m", dtype="float32", device="cuda", device_memory=budget,
              policy=Policy(weights=(50, 50), cache=(50, 50), pin_memory=True))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    prompts = [[(7 * i + t) % 8000 + 1 for t in range(prompt)] for i in range(rows)]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert torch.cuda.max_memory_allocated() <= budget
