"""/metrics' `name[]` filter as the server reads it from the raw query string (the page itself, filtered and
whole, is checked against a real sim engine in tests/epp/test_datalayer.py)."""

from kvgate.engine.server.routes.health import scrape_names
from kvgate.epp.datalayer.dialects import DIALECTS


def test_names_come_from_the_query_string_as_a_scraper_encodes_them():
    query = DIALECTS["vllm"].metrics_path().partition("?")[2].encode()
    names = scrape_names(query)
    assert names == frozenset(DIALECTS["vllm"].families()) and "kvgate:num_prefill_tokens_pending" in names
    assert scrape_names(query) is names  # the same query again: parsed once
    assert scrape_names(b"") == frozenset()
    assert scrape_names(b"name[]=a&x=1&name%5B%5D=b%3Ac&name[]=") == {"a", "b:c"}  # others and blanks ignored
    # decoded as Starlette decodes a query (latin-1, then UTF-8 escapes)
    assert scrape_names(b"name[]=%FF") == {"\ufffd"}  # undecodable: a name the registry does not have


def test_the_parse_cache_is_bounded():
    from kvgate.engine.server.routes.health import _cached_names_in

    for i in range(200):
        scrape_names(f"name[]=n{i}".encode())
    assert _cached_names_in.cache_info().currsize <= _cached_names_in.cache_info().maxsize == 64
    long = b"&".join(b"name[]=n%d" % i for i in range(1000))  # > 4 KiB: parsed, never kept
    before = _cached_names_in.cache_info()
    assert len(scrape_names(long)) == 1000
    assert _cached_names_in.cache_info() == before
