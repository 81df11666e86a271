"""GPU checks that CPU CI cannot run: the engine on `--device cuda` against Hugging Face.

    python tests/gpu/check_cuda.py            # exits non-zero on any mismatch

1. Tiny Llama / Qwen2 / Qwen3 checkpoints (fp32): every greedy token of a batch of different
   prompt lengths, with page sizes 1 and 16 and chunked prefill, equals Hugging Face `generate`
   on the same GPU.
2. bf16 on CUDA (the default dtype there): the embedded SmolLM2-135M answers the capital of
   France with Paris, and decode throughput at batch 1 and 32 is printed.
Needs: a CUDA build of torch, transformers, and the project installed (`pip install -e .[test]`).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.messages.sampling import SamplingParams  # noqa: E402
from engine_utils import EngineHarness, greedy  # noqa: E402
from tiny_models import build_tiny_checkpoint  # noqa: E402

PROMPTS = [list(range(5, 24)), [100, 200, 300], list(range(30, 70))]
NEW = 12


def check_tiny(arch: str, folder: Path) -> bool:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    ok = True
    for page_size, chunk in ((1, -1), (16, -1), (16, 7)):
        harness = EngineHarness(folder, device="cuda", dtype="float32", page_size=page_size,
                                chunked_prefill_size=chunk)
        for i, p in enumerate(PROMPTS):
            harness.add(str(i), p, greedy(NEW))
        harness.run()
        for i, p in enumerate(PROMPTS):
            ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW,
                                 min_new_tokens=NEW, do_sample=False, pad_token_id=0)
            ref = ref[0, len(p):].tolist()
            if ref != harness.outputs[str(i)]:
                ok = False
                print(f"MISMATCH {arch} page {page_size} chunk {chunk} prompt {i}: "
                      f"{harness.outputs[str(i)]} != {ref}")
        if not harness.pool_whole:
            ok = False
            print(f"KV pages leaked: {arch} page {page_size}")
    print(f"{arch}: {'ok' if ok else 'FAILED'}")
    return ok


def check_smollm2() -> bool:
    from common.engine.tokenizer import Tokenizer
    from common.model_store.default_model import ensure_default_model

    folder = ensure_default_model()
    tokenizer = Tokenizer.from_model_path(folder)
    question = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]), add_special_tokens=False)
    harness = EngineHarness(folder, device="cuda", dtype="bfloat16", max_total_tokens=65536)
    harness.add("q", question, SamplingParams(max_new_tokens=16, temperature=0.0))
    harness.run()
    answer = tokenizer.decode(harness.outputs["q"])
    print(f"SmolLM2 bf16 on CUDA: {answer!r}")
    for batch in (1, 32):
        for i in range(batch):
            harness.add(f"b{batch}-{i}", list(range(100, 228)), greedy(64))
        torch.cuda.synchronize()
        start = time.perf_counter()
        harness.run()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        print(f"batch {batch}: {batch * 64 / elapsed:.0f} generated tok/s (prefill included)")
    return "Paris" in answer


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen2", "qwen3"):
            folder = Path(tmp) / arch
            folder.mkdir()
            ok &= check_tiny(arch, build_tiny_checkpoint(folder, arch))
    ok &= check_smollm2()
    print("ALL OK" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
