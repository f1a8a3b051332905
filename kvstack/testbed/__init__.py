"""The test bed: what kvstack's tests, demo and benches run on (never imported by the runtime).

- `tiny_models`: the tiny random-weight models (Llama, Llama-4, Qwen3-Next) and their engine args.
- `engine`: engine helpers (shut an `LLM` down, track the peak of device blocks).
- `demo`: `make demo` / `kvstack demo`, kvstack and upstream vLLM side by side.
- `upstream_tests`: the runner of upstream vLLM's own test suite with its ledger.
"""
