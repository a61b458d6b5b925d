"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) beyond parity: the indexer and the
gathered attention against plain references, what a decode step reads of the cache, ties,
short contexts as the V3 path, and GLM-5's layers that reuse a choice."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiergen.cache.kv as kv
from tiergen import LLM, SamplingParams
from tiergen.cache.attention import chosen_attention, index_choice
from tiergen.cache.kv import LatentKVView
from tiergen.cache.step import StepMeta
from tiergen.errors import TiergenError
from test_shared_prefix import PREFIX, RESTS, assert_same, run
from tiny_models import build

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_the_indexer_and_the_gathered_attention_equal_plain_loops():
    g = torch.Generator().manual_seed(0)
    B, T, S, IH, ID, H, W, K = 2, 5, 30, 4, 8, 3, 12, 6
    q, w, k = torch.randn(B, T, IH, ID, generator=g), torch.randn(B, T, IH, generator=g), \
        torch.randn(B, S, ID, generator=g)
    allowed = torch.rand(B, T, S, generator=g) < 0.7
    allowed[..., 0] = True
    chosen = index_choice(q, w, k, allowed, K)
    for b in range(B):
        for t in range(T):
            scores = [sum(w[b, t, h] * max(0.0, float(q[b, t, h] @ k[b, s]) / ID**0.5)
                          for h in range(IH)) if allowed[b, t, s] else float("-inf")
                      for s in range(S)]
            best = sorted(range(S), key=lambda s: -scores[s])[:K]
            assert set(chosen[b, t].tolist()) == set(best)
    qa, rows = torch.randn(B, H, T, W, generator=g), torch.randn(B, S, W, generator=g)
    out = chosen_attention(qa, rows, chosen, allowed, 8)
    for b in range(B):
        for t in range(T):
            keep = [s for s in chosen[b, t].tolist() if allowed[b, t, s]]
            p = torch.softmax(qa[b, :, t] @ rows[b, keep].T / W**0.5, dim=-1)
            torch.testing.assert_close(out[b, :, t], p @ rows[b, keep, :8])


def test_ties_across_the_last_place_go_to_the_earlier_slots():
    scores = torch.tensor([[0.5, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0]])
    allowed = torch.ones(1, 1, 10, dtype=torch.bool)
    # one head of weight 1 whose products are the scores: q = 1, k = score * sqrt(1)
    chosen = index_choice(torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1), scores.T[None],
                          allowed, 5)
    assert sorted(chosen[0, 0].tolist()) == [0, 1, 2, 3, 7]


def test_a_decode_step_reads_every_indexer_key_but_only_the_chosen_latent_rows():
    """Over a cache in host RAM: the latent rows the indexer did not choose are made NaN,
    and the step gives the same numbers (a NaN read anywhere would spread)."""
    g = torch.Generator().manual_seed(1)
    B, H, W, ID, rank, S, K = 2, 4, 12, 8, 8, 40, 6
    cache = torch.randn(1, B, 1, 64, W + ID, generator=g)
    valid = torch.zeros(B, 64, dtype=torch.bool)
    valid[:, :S + 1] = True
    valid[1, :5] = False  # a padded row
    meta = StepMeta.build(valid, S, 1)
    q, row = torch.randn(B, H, 1, W, generator=g), torch.randn(B, 1, 1, W + ID, generator=g)
    index = torch.randn(B, 1, 3, ID, generator=g), torch.randn(B, 1, 3, generator=g)
    view = LatentKVView(cache, rank)
    out, chosen = view.attend_indexed(q, row, meta, K, index=index)
    assert chosen.shape == (B, 1, K) and not (chosen[1] < 5).any()
    unread = torch.ones(B, 64, dtype=torch.bool)
    unread[torch.arange(B)[:, None], chosen[:, 0]] = False
    cache[0, :, 0][unread] = cache[0, :, 0][unread].index_fill(-1, torch.arange(W), float("nan"))
    again, same = view.attend_indexed(q, row, meta, K, index=index)
    assert torch.equal(same, chosen) and torch.equal(again, out) and again.isfinite().all()


def test_ties_leave_a_prompt_its_numbers_alone_and_in_a_padded_batch(tmp_path):
    """With 8 indexer heads the tiny model's scores tie at 0 across the last place (where
    every head's product is negative): a row chooses as alone whatever its padding."""
    build("deepseek-v32", tmp_path, index_n_heads=8)
    llm = LLM(tmp_path, dtype="float32", share_prefixes=False)
    prompts = [PREFIX + r for r in RESTS]
    batched = run(llm, prompts)
    assert_same(batched, [run(llm, [p])[0] for p in prompts])


@pytest.mark.parametrize("case", ["deepseek-v32", "glm-moe-dsa"])
def test_a_context_within_index_topk_is_the_v3_path(case, tmp_path):
    """Where every row is chosen, sparse attention is DeepSeek-V3's dense latent attention:
    the same weights without the indexer give the same tokens and logits."""
    build(case, tmp_path / "sparse", index_topk=128)
    v3 = tmp_path / "v3"
    v3.mkdir()
    tensors = load_file(tmp_path / "sparse" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".indexer." not in k},
              v3 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "sparse" / "config.json").read_text())
    config |= dict(architectures=["DeepseekV3ForCausalLM"], rope_interleave=True)
    (v3 / "config.json").write_text(json.dumps(config))
    prompts = [list(range(3, 40)), [5], [7, 8, 9]]
    sparse, dense = LLM(tmp_path / "sparse", dtype="float32"), LLM(v3, dtype="float32")
    assert [r.token_ids for r in sparse.generate(prompts, GREEDY)] == \
        [r.token_ids for r in dense.generate(prompts, GREEDY)]
    torch.testing.assert_close(sparse.logits(prompts[0]), dense.logits(prompts[0]),
                               rtol=1e-5, atol=1e-5)


def test_glm5s_shared_layers_reuse_the_choice_before_them(tmp_path, monkeypatch):
    build("glm-moe-dsa", tmp_path)  # layers: full, shared, full
    llm = LLM(tmp_path, dtype="float32")
    made, used = [], []
    choose, attend = kv.index_choice, kv.chosen_attention
    monkeypatch.setattr(kv, "index_choice", lambda *a: made.append(choose(*a)) or made[-1])
    monkeypatch.setattr(kv, "chosen_attention",
                        lambda q, rows, chosen, *a: used.append(chosen) or attend(q, rows, chosen, *a))
    llm.generate([list(range(3, 40))], SamplingParams(max_tokens=3, temperature=0))
    assert len(used) == 3 * len(made) // 2 and len(made) == 2 * 3  # 3 steps, 2 indexers each
    for step in range(3):
        assert used[3 * step + 1] is made[2 * step]  # the shared layer takes layer 0's choice
    with pytest.raises(TiergenError, match="reuses the sparse-attention choice"):
        llm.config.span(range(1, 3))
