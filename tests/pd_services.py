"""Real PD deployments for tests: `pdserve prefill` + `pdserve decode` (+ a colocated service
on the same model for comparison), each on free ports, always stopped."""

from __future__ import annotations

from server_utils import ServerProcess, free_port

COMMON = ("--max-total-tokens", "2048", "--torch-num-threads", "1",
          "--max-running-requests", "16")


class PDDeployment:
    def __init__(self, model_dir, page_size: int, backend: str, dp: int = 2, extra=()):
        self.bootstrap_port = free_port()
        args = (*COMMON, "--page-size", str(page_size), "--disaggregation-transfer-backend",
                backend, *extra)
        self.prefill = ServerProcess(model_dir, *args, "--dp-size", str(dp),
                                     "--disaggregation-bootstrap-port",
                                     str(self.bootstrap_port), command="prefill")
        self.decode = ServerProcess(model_dir, *args, "--dp-size", str(dp), command="decode")
        self.colocated = ServerProcess(model_dir, *COMMON, "--page-size", str(page_size))

    def __enter__(self):
        try:
            for server in (self.prefill, self.decode, self.colocated):
                server.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        for server in (self.colocated, self.decode, self.prefill):
            server.stop()

    def assert_pools_whole(self):
        for server in (self.prefill, self.decode):
            stats = server.wait_pool_whole()
            assert stats["num_free_pages"] == stats["num_total_pages"], (server.url, stats)

    def pd_fields(self, rooms):
        return {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": rooms}
