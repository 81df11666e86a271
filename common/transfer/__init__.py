"""KV transfer engines: move a request's KV pages from a prefill pool into a decode pool."""
