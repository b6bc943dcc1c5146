"""The OpenAI-compatible frontend (`api.py`: /v1/models, /v1/chat/completions, /v1/completions) and vLLM's
`/tokenize` and `/detokenize` (`tokenize.py`), over the shared helpers of `mmserve.entrypoints`."""
