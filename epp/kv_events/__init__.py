"""The EPP's view of what every engine really holds in its KV cache, learned from the engines' KV-cache events.

  decode.py      vLLM's event wire format, both encodings (positional arrays before 2026, maps tagged by `type`)
  index.py       block index: per endpoint, the blocks it caches, keyed by hashes the EPP computes itself
  subscriber.py  one background thread: a ZeroMQ SUB per endpoint, sequence tracking, replay on gaps
  tokenize.py    the pool's tokenizer, loaded in the EPP, so prompts hash like the engine's blocks

The `precise-prefix-cache-scorer` plugin (epp/scheduling/plugins/precise_prefix_cache_scorer.py) ties them together.
"""
