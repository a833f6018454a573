"""The EPP's view of what every engine really holds in its KV cache, learned from the engines' KV-cache events.

  sources.py        where each endpoint publishes (pod annotations, flags, --kv-events-endpoint)
  subscriber.py     one background thread: reads every endpoint's sockets, hands index Deltas to the EPP's loop
  sockets.py        one endpoint's ZeroMQ sockets: SUB (+ connection monitor) and replay DEALER
  sequencer.py      one endpoint's sequence numbers: apply, hold, ask for a replay on a gap, reset (pure)
  decode.py         vLLM's event wire format, both encodings (older positional arrays, newer maps tagged by `type`)
  engine_hashes.py  one endpoint's engine block hashes → the EPP's, events → Deltas, the shared block budget
  tokenize.py       the pool's tokenizer, loaded in the EPP, so prompts hash like the engine's blocks

The index the Deltas change is epp/prefix/precise_index.py; the `precise-prefix-cache-scorer` plugin
(epp/scheduling/plugins/precise_prefix_cache_scorer.py) ties them together.
"""
