"""GPU check of PD disaggregation with the `torch` transfer backend (NCCL, device to device).

    python tests/gpu/check_pd_nccl.py             # needs 2 CUDA devices; non-zero on failure
    python tests/gpu/check_pd_nccl.py --dry-run   # the same script on CPU with gloo

1. Transfer throughput: a sender process (prefill pool on device A) and a receiver process
   (decode pool on device B) move 16 and 256 MiB of scattered 16-token pages through
   `TorchKVSender` / `TorchKVReceiver`; prints GB/s and checks the bytes.
2. Services: `pdserve prefill` (dp 1, device A) and `pdserve decode` (dp 1, device B) with
   `--disaggregation-transfer-backend torch`, and a colocated service on device A; greedy
   answers of the embedded SmolLM2-135M through the PD pair equal the colocated ones, and the
   capital of France is Paris.
NCCL needs one device per rank, hence two devices (one process per GPU, as in production).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

LAYERS, HEADS, DIM, PAGE = 30, 3, 64, 16


def _pool(pages: int, device: str):
    from common.engine.kv_pool import PagedKVPool

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return PagedKVPool(pages, PAGE, LAYERS, HEADS, DIM, dtype, torch.device(device))


def _receiver_main(device: str, pages: int, conn) -> None:
    from common.transfer.base import KVPoll
    from common.transfer.torch_dist import TorchKVReceiver

    pool = _pool(2 * pages, device)
    receiver = TorchKVReceiver(pool, "127.0.0.1", 120.0)
    conn.send(receiver.endpoint_for("prefill"))
    dst = list(range(0, 2 * pages, 2))
    results = []
    for room in range(4):  # a warm-up, then three timed transfers
        receiver.expect(room, dst)
        conn.send(("ready", room))
        while receiver.poll(room) not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.0002)
        results.append(receiver.poll(room) is KVPoll.Success)
    last = PAGE * 2 * (pages - 1)
    conn.send((all(results), float(pool.k[:, last:last + PAGE].float().sum())))


def transfer_throughput(device_a: str, device_b: str, mib: int) -> bool:
    from common.transfer.base import KVPoll, TransferTrailer
    from common.transfer.torch_dist import TorchKVSender

    page_bytes = LAYERS * 2 * HEADS * DIM * PAGE * (2 if device_a.startswith("cuda") else 4)
    pages = max(1, (mib << 20) // page_bytes)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(device_b, pages, child))
    proc.start()
    endpoint = parent.recv()
    src = _pool(pages, device_a)
    src.k.normal_()
    src.v.normal_()
    sender = TorchKVSender(src, 120.0)
    best = float("inf")
    for room in range(4):
        assert parent.recv() == ("ready", room)
        start = time.perf_counter()
        state = sender.send(endpoint, room, list(range(pages)),
                            list(range(0, 2 * pages, 2)), TransferTrailer(first_token=1))
        while state.state not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.0002)
        if room:
            best = min(best, time.perf_counter() - start)
    ok, checksum = parent.recv()
    proc.join(30)
    expected = float(src.k[:, PAGE * (pages - 1):].float().sum())
    ok = ok and abs(checksum - expected) <= 1e-3 * max(1.0, abs(expected))
    nbytes = pages * page_bytes
    print(f"torch backend {device_a} -> {device_b}: {nbytes / 2**20:.0f} MiB in "
          f"{best * 1e3:.1f} ms = {nbytes / best / 1e9:.2f} GB/s ({'ok' if ok else 'FAILED'})")
    return ok


def services(device_a: str, device_b: str) -> bool:
    from common.model_store.default_model import ensure_default_model
    from server_utils import ServerProcess, free_port, http_json

    model = ensure_default_model()
    bootstrap = free_port()
    common = ("--max-total-tokens", "8192", "--disaggregation-transfer-backend", "torch")
    prompts = ["What is the capital of France?", "Count from one to five:",
               "Write a haiku about GPUs."]
    ok = True
    with ServerProcess(model, "--device", device_a, "--max-total-tokens", "8192") as colo, \
            ServerProcess(model, "--device", device_a, *common,
                          "--disaggregation-bootstrap-port", str(bootstrap),
                          command="prefill") as pre, \
            ServerProcess(model, "--device", device_b, *common, command="decode") as dec:
        for text in prompts:
            chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 32,
                    "temperature": 0}
            _, want = http_json(colo.url + "/v1/chat/completions", chat)
            pd = {**chat, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                  "bootstrap_room": random.getrandbits(63)}
            got = {}
            thread = threading.Thread(target=lambda: got.setdefault(
                "prefill", http_json(pre.url + "/v1/chat/completions", pd)))
            thread.start()
            start = time.perf_counter()
            status, answer = http_json(dec.url + "/v1/chat/completions", pd)
            elapsed = time.perf_counter() - start
            thread.join()
            same = status == 200 and answer["choices"][0]["message"] == \
                want["choices"][0]["message"]
            ok &= same
            print(f"{'ok' if same else 'MISMATCH'} ({elapsed * 1e3:.0f} ms) {text!r} -> "
                  f"{json.dumps(answer if status != 200 else answer['choices'][0]['message'])}")
            if "capital" in text and same:
                ok &= "Paris" in answer["choices"][0]["message"]["content"]
        for server in (pre, dec):
            stats = server.stats()
            whole = stats["num_free_pages"] == stats["num_total_pages"]
            ok &= whole
            if not whole:
                print(f"KV pages leaked on {server.url}: {stats}")
    print(f"PD services on {device_a} + {device_b}: {'ok' if ok else 'FAILED'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU + gloo, no GPU needed")
    args = parser.parse_args()
    if args.dry_run:
        device_a = device_b = "cpu"
    else:
        if torch.cuda.device_count() < 2:
            print(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
            return 2
        device_a, device_b = "cuda:0", "cuda:1"
    ok = all(transfer_throughput(device_a, device_b, mib) for mib in (16, 256))
    ok &= services(device_a, device_b)
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
