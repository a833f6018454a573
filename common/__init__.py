"""Code more than one kvgate program uses: the contracts between engine, EPP and Envoy, bounded readers of
untrusted files, process helpers and the Envoy config renderer. It imports nothing else of kvgate."""
