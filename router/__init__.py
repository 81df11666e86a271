"""The L2 entry point of a PD deployment (`pdserve router`): picks a prefill and a decode service
per request, injects bootstrap_host/bootstrap_port/bootstrap_room, sends both legs at once and
relays the decode side's answer. Plain mode (`--worker-urls`) routes to colocated services.

Request lifecycle:
    client -> app.py (request id, auth, JSON errors) -> request_plan.py (rooms, rid)
      -> state.pick() per role (policies/, only available workers: health.py + breaker.py)
      -> dispatch.py: prefill and decode legs concurrently (upstream.py over http_client.py)
      -> the decode answer, whole or streamed as it arrives (stream_relay.py, logprobs.py)

| module | job |
|---|---|
| `config.py` | `RouterArgs`, the flags (SGLang router spelling), validation naming the flag |
| `launch.py` | `pdserve router`: run the app until SIGTERM |
| `app.py` | middleware, inference routes, route table |
| `request_plan.py` | what a body needs (rooms per item and sample, routing key) and what is added |
| `dispatch.py` | PD dual dispatch and plain mode; retries only of refused connections |
| `upstream.py` | one leg: open, read, settle (breaker verdict), failure kinds |
| `http_client.py` | pooled keep-alive HTTP/1.1 client of the legs (TCP_NODELAY) |
| `stream_relay.py` | SSE relay, prefill stream watch, well-formed error endings |
| `logprobs.py` | prefill's prompt logprobs merged into decode's answer |
| `workers.py` | worker registry and states |
| `health.py`, `breaker.py` | periodic health checks (eject / re-admit), circuit breakers |
| `loads.py` | `/v1/loads` polling for power_of_two and `--dp-aware` |
| `policies/` | random, round_robin, power_of_two, cache_aware (+ its radix tree) |
| `admin.py`, `auth.py` | `/workers` administration; `--api-key` |
| `info_api.py`, `metrics.py` | health, readiness, models, info, `/v1/loads`; `/metrics` |
"""
