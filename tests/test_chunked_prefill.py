"""Chunked prefill gives what whole-prompt prefill gives, for every architecture."""

from __future__ import annotations

import pytest
import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen.engine.generate import MicroBatchState, make_sequences
from tiny_models import CASES, build

PROMPTS = [[5], list(range(3, 40)), [7, 8, 9, 10, 11], list(range(20, 120))]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(CASES))
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    build(request.param, d)
    return d


def first_logits(llm: LLM) -> torch.Tensor:
    """Logits that pick the first new token, through the engine's own prefill loop."""
    seqs = make_sequences(PROMPTS, [GREEDY] * len(PROMPTS), [], None)
    state = MicroBatchState(llm.executor, seqs, llm.prefill_chunk_size)
    steps = 0
    while True:
        logits = llm.executor.forward_block([state.work()])[0]
        steps += 1
        if state.start + state.num_tokens >= state.prompt.shape[1]:
            state.cache.close()
            return logits, steps
        list(state.advance(logits))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_whole(model_dir, chunk, tmp_path):
    whole = LLM(model_dir, dtype="float32", prefill_chunk_size=None)
    chunked = LLM(model_dir, dtype="float32", prefill_chunk_size=chunk)
    expected, one_step = first_logits(whole)
    got, steps = first_logits(chunked)
    assert one_step == 1 and steps == -(-max(map(len, PROMPTS)) // chunk)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    want = [r.token_ids for r in whole.generate(PROMPTS, GREEDY)]
    assert [r.token_ids for r in chunked.generate(PROMPTS, GREEDY)] == want
    # and through a policy that streams weights and cache from disk
    offloaded = LLM(model_dir, dtype="float32", prefill_chunk_size=chunk,
                    policy=Policy(weights=(0, 0), cache=(0, 0), offload_dir=tmp_path))
    torch.testing.assert_close(first_logits(offloaded)[0], expected, atol=1e-4, rtol=1e-4)
    assert [r.token_ids for r in offloaded.generate(PROMPTS, GREEDY)] == want


def test_sliding_window_cache_stops_growing(tmp_path):
    """A windowed layer keeps W slots however long the sequence: KV bytes are flat past W."""
    build("mistral-window", tmp_path)
    ex = LLM(tmp_path, dtype="float32").executor

    def kv_bytes(capacity: int) -> int:
        cache = ex.new_cache(2, capacity)
        try:
            return sum(t.nbytes for t in cache.layers)
        finally:
            cache.close()

    per_slot = kv_bytes(1)
    assert kv_bytes(4) == 4 * per_slot
    assert kv_bytes(8) == kv_bytes(9) == kv_bytes(5000) == 8 * per_slot


PEAK_SCRIPT = """
import json, sys, torch, tiergen
from tiergen.offload.memory import resident_set, reset_peak_resident_set
from tiergen import LLM, SamplingParams
model, chunk = sys.argv[1], (None if sys.argv[2] == "none" else int(sys.argv[2]))
llm = LLM(model, dtype="float32", prefill_chunk_size=chunk)
llm.generate([[5] * 8, [6] * 5], SamplingParams(max_tokens=1))
before = resident_set()[0]
reset_peak_resident_set()
base = torch.cuda.memory_allocated() if llm.device.type == "cuda" else 0
llm.generate([[5] * 4096, [6] * 4000], SamplingParams(max_tokens=1))
# where the scores live: GPU memory on a GPU, the process's RAM on a CPU
grown = (llm.last_stats.peak_device - base if llm.device.type == "cuda"
         else resident_set()[1] - before)
print(json.dumps({"grown": grown}))
"""


@pytest.mark.slow
def test_chunked_prefill_peak_memory_is_far_lower(tmp_path):
    """A 4,096-token prefill of a padded batch: the unchunked masks and scores grow with the
    square of the prompt, the chunked ones with chunk x context."""
    import json
    import subprocess
    import sys

    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=8192)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    grown = {}
    for chunk in ("none", "512"):
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path), chunk],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        grown[chunk] = json.loads(out.stdout.strip().splitlines()[-1])["grown"]
    print({k: f"{v / 2**20:.0f} MiB" for k, v in grown.items()})
    assert grown["512"] * 3 < grown["none"]


def test_a_decode_steps_metadata_is_the_general_rule():
    """StepMeta.build's decode step (one token after the first) gives the positions and mask
    of the general rule: each row counts its valid slots, sees its valid slots up to the new
    one, and always the new one (padding rows stay finite), whatever lies after it (holes,
    unwritten capacity)."""
    from tiergen.cache.step import StepMeta

    g = torch.Generator().manual_seed(3)
    for start in (1, 9, 30):
        valid = torch.rand(4, 40, generator=g) > 0.4
        valid[0] = False  # a row that is all padding
        meta = StepMeta.build(valid, start, 1)
        slots = torch.arange(40)
        want_mask = ((slots <= start) & valid) | (slots == start)
        assert torch.equal(meta.mask, want_mask[:, None, None])
        want_pos = (valid[:, :start + 1].cumsum(-1) - 1).clamp(min=0)[:, start:]
        assert torch.equal(meta.positions, want_pos) and meta.start == start


@pytest.mark.parametrize("start,num_tokens", [(7, 7), (14, 7), (28, 7), (35, 5)])
def test_chunk_attention_equals_the_masked_path(start, num_tokens):
    """A chunk's two-pass attention (earlier slots, then itself, merged by log-sum-exp) against
    SDPA's masked path, with a row whose every earlier slot is padding, a row padded in part,
    and a full one; GQA with two query heads per K/V head."""
    from tiergen.cache.step import StepMeta
    from tiergen.cache.attention import attention

    torch.manual_seed(start)
    valid = torch.zeros(3, 40, dtype=torch.bool)
    valid[0, 30:], valid[1, 5:], valid[2] = True, True, True
    meta = StepMeta.build(valid, start, num_tokens)
    q = torch.randn(3, 4, num_tokens, 8)
    k, v = torch.randn(2, 3, 2, start + num_tokens, 8)
    want = attention(q, k, v, meta.mask)
    got = attention(q, k, v, meta.mask, key_valid=valid[:, :meta.end])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start", [0, 10, 40, 100])
def test_a_window_without_a_mask_is_its_band(start):
    """A sliding window's chunk with every key valid (mask None) against SDPA's masked path
    over the band spelled out: a first chunk longer than the window, chunks over a ring not
    yet full and full."""
    from tiergen.cache.attention import attention

    T, window = 60, 48
    S = min(start, window) + T
    torch.manual_seed(start)
    q = torch.randn(2, 4, T, 16)
    k, v = torch.randn(2, 2, 2, S, 16)
    place, key = torch.arange(T)[:, None] + S - T, torch.arange(S)[None]
    band = ((key <= place) & (key > place - window)).expand(2, 1, T, S)
    got = attention(q, k, v, None, key_valid=torch.ones(2, S, dtype=torch.bool), window=window)
    torch.testing.assert_close(got, attention(q, k, v, band), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 32, 128], ids=["causal", "window-32", "window-128"])
def test_a_padded_first_chunk_attends_each_row_as_alone(window):
    """Prompts of 70, 33, 1 and 70 tokens left-padded into one first chunk: each row's output
    equals, to the bit, what the row's prompt gives alone, through the cache view the
    engine uses (a sliding window's ring too, whose mask stays when the window is shorter
    than the prompt); GQA with two query heads per K/V head."""
    from tiergen.cache.kv import KVView, RollingKVView
    from tiergen.cache.step import StepMeta

    def run(q, k, v, valid):
        B, kvh, T, D = k.shape
        kv = torch.zeros(2, B, kvh, T if window is None else window, D)
        view = KVView(kv) if window is None else RollingKVView(kv, window)
        return view.attend(q, k, v, StepMeta.build(valid, 0, T))

    torch.manual_seed(5)
    lengths, T = [70, 33, 1, 70], 70
    q = torch.randn(4, 4, T, 64)
    k, v = torch.randn(2, 4, 2, T, 64)
    valid = torch.arange(T)[None] >= T - torch.tensor(lengths)[:, None]
    batched = run(q, k, v, valid)
    for b, n in enumerate(lengths):
        own = slice(T - n, T)
        alone = run(q[b:b + 1, :, own], k[b:b + 1, :, own], v[b:b + 1, :, own],
                    torch.ones(1, n, dtype=torch.bool))
        assert torch.equal(batched[b:b + 1, :, own], alone), b


def test_prefill_chunks_cover_the_prompt_once():
    from tiergen.engine.generate import chunks, prefill_chunk

    assert prefill_chunk(None, 37) == 37 and prefill_chunk(16, 37) == 16
    assert prefill_chunk(512, 37) == 37
    assert [(c.start, c.stop) for c in chunks(16, 37)] == [(0, 16), (16, 32), (32, 37)]
    assert [(c.start, c.stop) for c in chunks(None, 5)] == [(0, 5)]


def test_the_default_prefill_chunk_is_the_devices():
    """"auto" chunks: 1,024 tokens on a CPU, 512 on a GPU; whole prompts batch invariant."""
    from tiergen.engine.config import resolve_prefill_chunk

    assert resolve_prefill_chunk("auto", False, "cpu") == 1024
    assert resolve_prefill_chunk("auto", False, "cuda") == 512
    assert resolve_prefill_chunk("auto", True, "cpu") is None
    assert resolve_prefill_chunk(64, False, "cuda") == 64
