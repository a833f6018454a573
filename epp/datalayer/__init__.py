"""The EPP's datalayer: each endpoint's Model Server Protocol numbers, scraped from its /metrics.

dialects.py     where each engine (vLLM, SGLang, TRT-LLM) keeps the numbers, as a table
exposition.py   the targeted scanner of the Prometheus text format, and parse_metrics (the extractor)
http_client.py  the keep-alive HTTP/1.1 connection a scrape uses (the source)
collector.py    per-endpoint collectors driven by one ticker, and the Datalayer the EPP's parts read
bench.py        `kvgate bench scrape`: scrape cost at pool scale
"""

from kvgate.epp.datalayer.collector import Datalayer, EndpointCollector, OnChange, Ticker
from kvgate.epp.datalayer.dialects import DIALECTS, Dialect, Series, dialect_for
from kvgate.epp.datalayer.exposition import MetricsParseError, comparable, iter_samples, parse_labels, parse_metrics
from kvgate.epp.datalayer.http_client import MetricsConnection, ScrapeError

__all__ = ["DIALECTS", "Datalayer", "Dialect", "EndpointCollector", "MetricsConnection", "MetricsParseError",
           "OnChange", "ScrapeError", "Series", "Ticker", "comparable", "dialect_for", "iter_samples",
           "parse_labels", "parse_metrics"]
