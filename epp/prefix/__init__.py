"""Prefix-cache affinity's data structures, shared by the two prefix scorers (upstream EPP's hashing / indexer split).

  hashing.py       block-hash chains: the approximate scorer's character blocks, the KV-event token-id blocks
  endpoint_ids.py  small integer ids for endpoint addresses (reused after removal) and the int bitsets over them
  approx_index.py  the approximate scorer's index: per endpoint an LRU of the blocks sent to it, a memory budget
  precise_index.py the precise scorer's index: the blocks each engine announces, plus speculative holds
  request_holds.py the precise scorer's picks in flight: a request holds its blocks until its response ends

The plugins (epp/scheduling/plugins/prefix_cache_scorer.py, precise_prefix_cache_scorer.py) match, score and
record with them; epp/kv_events/ feeds the precise index.
"""
