"""The engine against Hugging Face's own forward pass on the same tiny checkpoints.

For every sampled token we compare the engine's logits row with HF's logits at the same
position of the full sequence (fp32, tight tolerance), and the greedy tokens with HF
`generate`, across architectures, page sizes, chunked prefill, batches of different lengths
and requests that join a running batch.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_utils import EngineHarness, greedy

PROMPTS = [
    list(range(5, 24)),  # 19 tokens: more than one page of 16
    [100, 200, 300],  # shorter than a page
    list(range(30, 70)),  # 40 tokens: chunked into several pieces with chunk 7
    [7],  # a single token
]
LATE_PROMPT = list(range(200, 233))
NEW_TOKENS = 10
ATOL = 2e-4


def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def check_against_hf(model, harness: EngineHarness, prompts: dict[str, list[int]]) -> None:
    for rid, prompt in prompts.items():
        out = harness.outputs[rid]
        assert len(out) == NEW_TOKENS, (rid, out)
        full = torch.tensor([prompt + out])
        with torch.no_grad():
            ref_logits = model(full).logits[0, len(prompt) - 1 : -1]
        ours = torch.stack(harness.logits[rid])
        assert ours.shape == ref_logits.shape
        torch.testing.assert_close(ours, ref_logits, atol=ATOL, rtol=1e-4)
        ref_tokens = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            do_sample=False, pad_token_id=0,
        )[0, len(prompt):].tolist()
        assert out == ref_tokens, rid


@pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen2", "qwen3", "mistral"], indirect=True)
@pytest.mark.parametrize(
    ("page_size", "chunk"), [(1, -1), (16, -1), (16, 7), (1, 5)],
    ids=["page1", "page16", "page16-chunk7", "page1-chunk5"],
)
def test_batched_greedy_matches_hf(tiny_model_dir, page_size, chunk):
    harness = EngineHarness(tiny_model_dir, page_size=page_size, chunked_prefill_size=chunk)
    prompts = {f"r{i}": p for i, p in enumerate(PROMPTS)}
    for rid, p in prompts.items():
        harness.add(rid, p, greedy(NEW_TOKENS))

    def join_late(step: int) -> None:
        if step == 3:  # the first requests are decoding by now
            harness.add("late", LATE_PROMPT, greedy(NEW_TOKENS))

    harness.run(on_step=join_late)
    prompts["late"] = LATE_PROMPT
    check_against_hf(hf_model(tiny_model_dir), harness, prompts)
    assert harness.pool_whole


def test_llama3_rope_scaling_matches_hf(tiny_llama3_rope_dir):
    # Positions beyond original_max_position_embeddings (64) exercise the scaled frequencies.
    prompts = {"long": list(range(3, 100)), "short": [9, 8, 7]}
    harness = EngineHarness(tiny_llama3_rope_dir, page_size=16)
    for rid, p in prompts.items():
        harness.add(rid, p, greedy(NEW_TOKENS))
    harness.run()
    check_against_hf(hf_model(tiny_llama3_rope_dir), harness, prompts)


def test_retraction_keeps_greedy_outputs(tiny_llama_dir):
    """A pool too small for all requests at once forces retraction; outputs must not change."""
    prompts = {f"r{i}": list(range(10 + i, 40 + i)) for i in range(4)}
    tight = EngineHarness(tiny_llama_dir, page_size=4, max_total_tokens=96)
    roomy = EngineHarness(tiny_llama_dir, page_size=4)
    for h in (tight, roomy):
        for rid, p in prompts.items():
            h.add(rid, p, greedy(NEW_TOKENS))
        h.run()
    assert tight.engine.scheduler.num_retractions > 0
    for rid in prompts:
        assert tight.outputs[rid] == roomy.outputs[rid]
    assert tight.pool_whole and roomy.pool_whole


@pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen3"], indirect=True)
def test_equal_length_fresh_prompts_match_hf(tiny_model_dir):
    """Equal-length fresh prompts take the batched causal path that skips the pool read."""
    prompts = {f"r{i}": list(range(10 + 7 * i, 22 + 7 * i)) for i in range(3)}
    harness = EngineHarness(tiny_model_dir, page_size=4)
    for rid, p in prompts.items():
        harness.add(rid, p, greedy(NEW_TOKENS))
    harness.run()
    check_against_hf(hf_model(tiny_model_dir), harness, prompts)
