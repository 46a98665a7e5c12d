"""A simulated vLLM 0.33 OpenAI server for demos and the component tests.

`python -m engines.sim serve MODEL [vllm serve flags] [--sim-* knobs]`

- `state`: the engine model (weights, draft, sleep levels, decode loop, spec-decode accounting)
- `lm`: the toy language model (deterministic text; junk from discarded weights)
- `metrics`: vLLM's Prometheus metrics by their real names
- `control`: sim-only fault injection, step delays and the call log
- `server`: the HTTP routes (OpenAI API, dev API, /metrics, /sim/*)
- `__main__`: `vllm serve`-compatible argv and the process lifecycle
"""
